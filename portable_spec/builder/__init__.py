"""The shared host mask builder: one bitmask row per verify-tree node, for a whole batch.

Data flow of one build::

    route table         routes.py: the first row that applies builds; the compiled rows
                        (small.py, small_llguidance.py, lists.py) check everything themselves
    check               every argument, before any matcher moves; the kinds looked up once;
                        the matchers held once (routes.py)
    tree.resolve()      host int64 links and tokens (waits for the staged copy only), once
    tree.validate()     the links, once
    build               the row's: the walk table or inline (dense.py), compact (compact.py),
                        reasoning (reasoning.py), the planner (dense.py over jobs.py)

The result obeys the row contract documented on :func:`build_host_bitmask`. The modules
below this one never import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portable_spec.builder import routes
from portable_spec.tree import GrammarTree

__all__ = ["build_host_bitmask"]


def build_host_bitmask(
    matchers: Sequence[Any],
    tree: GrammarTree,
    vocab_size: int,
    *,
    out: Any = None,
    layout: str = "dense",
    max_rows: int | None = None,
    reasoning: Any = None,
    return_valid: bool = False,
) -> Any:
    """Build the grammar bitmask of every node of every request's verify tree, on the host.

    Args:
        matchers: one entry per request: ``None`` (unconstrained), an
            ``xgrammar.GrammarMatcher``, or an object following
            :class:`portable_spec.GrammarMatcherLike`. Each matcher must be in the state after
            the request's committed tokens (node 0's token included).
        tree: the batch's verify trees (:class:`portable_spec.GrammarTree`).
        vocab_size: the model's vocabulary size (the logits' width); at least each matcher's,
            at most :data:`portable_spec.MAX_VOCAB_SIZE`.
        out: optional C-contiguous int32 ``[batch * nodes, ceil(vocab_size / 32)]`` buffer to
            write into instead of allocating (compact: a :class:`CompactMask` of numpy arrays
            with room for every row the build may list: ``max_rows``, or the rows of the
            constrained requests).
        layout: ``"dense"`` (the default: every row) or ``"compact"``: a
            :class:`portable_spec.CompactMask` listing only the rows of accepted,
            non-terminated nodes of constrained requests (``rows`` int32 ``[K]`` ascending,
            ``bits`` int32 ``[K, words]``); every row not listed is all-allowed, and nothing is
            written for it.
        max_rows: compact only: the mask has exactly this many entries (``K`` real ones, then
            padding entries whose row is ``batch * nodes`` and whose bits are not written), so
            its shape does not change from step to step. ``ValueError`` if the build lists
            more (raised after the walks, every matcher back in its state).
        reasoning: a :class:`portable_spec.Reasoning`: requests still reasoning at the root
            get their grammar only below the node that ends the reasoning, per path (rows
            before it allow everything but the content end tokens the grammar refuses first).
            Dense layout only (``ValueError`` with ``layout="compact"``).
        return_valid: also return which nodes the matchers (and the reasoning rule) accept.

    Returns:
        ``None`` when the batch is empty or no request has a grammar (``out`` untouched).
        Otherwise the int32 ``[batch * nodes, ceil(vocab_size / 32)]`` mask (``out`` itself if
        given). Row ``b * nodes + j`` belongs to node ``j`` of request ``b``; bit ``t % 32`` of
        word ``t // 32`` set means token ``t`` is allowed. Node 0 is accepted; node ``j > 0`` is
        accepted iff its parent is accepted and not terminated, ``0 <= token < vocab_size`` and
        the token's bit is set in the parent's row. An accepted, non-terminated node's row is
        the grammar's mask after its root path (bits past the grammar's vocabulary are 0).
        Every other row is all-allowed (-1): unconstrained requests, rejected nodes and their
        subtrees, terminated nodes, and nodes no link reaches. With ``layout="compact"``, a
        host :class:`CompactMask` of those rows (``None`` as above); expanded with
        ``to_dense()`` it equals the dense mask.

        With ``return_valid=True``: ``(mask, valid)``, ``valid`` a bool ``[batch, nodes]``
        array, True for the accepted nodes by the rule above (terminated ones included; every
        node a link reaches for unconstrained requests; never for unreached padding). An
        engine truncates its drafts to the valid prefix with it (no separate validation pass).
        ``(None, valid)`` when no request has a grammar.

    Raises:
        TypeError, ValueError: malformed tree, matchers, ``vocab_size`` or ``out``; raised
            before any matcher moves.
        MatcherError: a matcher raised during its walk (``request_index`` names it; the
            original exception is chained). Every matcher is back in its starting state.

    Blocks the calling thread until the mask is complete (it waits for the tree's staged copy
    first). Requests are spread over the library's thread pool (:func:`set_num_threads`).
    Every matcher ends in the state it started in.
    """
    if type(tree) is not GrammarTree and not isinstance(tree, GrammarTree):
        raise TypeError(f"tree must be a portable_spec.GrammarTree, got {type(tree).__name__}")
    return routes.build_tree(
        matchers, tree, vocab_size, out, layout, max_rows, reasoning, return_valid
    )
