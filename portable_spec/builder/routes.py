"""The build routes: one ordered table, and every threshold that chooses among its rows.

Every call of :func:`portable_spec.build_host_bitmask` and :func:`portable_spec.build_chain_bitmask`
walks :data:`ROUTES` from the top and is built by the first row that applies. A row is a name,
when it applies (read off the call: the tree's public :class:`~portable_spec.tree.TreeShape`,
the layout, the mask's width, the grammar engines) and how it builds. The first rows are single
compiled calls that check everything themselves: on anything unusual they decline (nothing
written, no matcher moved, each holds its matchers inside the call) and the walk goes on. Then
every argument is checked once, each request's engine is looked up once
(:func:`portable_spec.grammars.classify_grammars`), the matchers are held once for the rest of
the build (a build started meanwhile over one of them is refused), and the first row that
applies builds; these rows never decline.

Thresholds are in units of work (:func:`work`): rows times (mask words + :data:`ROW_WORDS`),
what filling the rows costs xgrammar: a fill's cost grows with the mask's width, plus a fixed
cost per node (accepting the draft, the state's bookkeeping, the repair) counted as its
equivalent in words. One core's rate is about the same on 49k, 131k and 152k vocabularies in
these units (``docs/routes.md``, ``docs/results/2026-12-06-routes.md``); the numbers below are
2-core figures of the JSON schema, the costliest sample grammar to fill; those measured at 49k
only keep their 49k decisions and scale with the width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np

from portable_spec import native
from portable_spec.builder import small, small_llguidance
from portable_spec.builder.compact import build_compact
from portable_spec.builder.dense import build_dense, build_inline, build_table
from portable_spec.builder.jobs import Build, Plan, per_node, walkable
from portable_spec.builder.lists import build_lists, chain_tree
from portable_spec.builder.reasoning import build_with_reasoning, check_reasoning
from portable_spec.grammars import (
    LLGUIDANCE,
    NONE,
    XGRAMMAR,
    classify_grammars,
    known_xgrammar_facts,
    matcher_kind,
)
from portable_spec.masks import (
    MAX_VOCAB_SIZE,
    check_compact_out,
    check_dense_out,
    check_flag,
    check_layout,
    check_vocab_size,
    words_for,
)
from portable_spec.pending import hold_matchers, release_matchers
from portable_spec.pool import get_num_threads
from portable_spec.tree import GrammarTree, TreeShape

__all__ = [
    "EXECUTOR_WORK",
    "ONE_THREAD_WORK",
    "POOL_WORK",
    "ROUTES",
    "ROW_WORDS",
    "SHORT_CHAIN_FACTOR",
    "SHORT_CHAIN_WORK",
    "SPLIT_PART_WORK",
    "SPLIT_WORK",
    "Call",
    "Route",
    "build",
    "build_chains",
    "build_tree",
    "parts_for",
    "pool_worthy",
    "work",
]

# -- the thresholds, in units of work ----------------------------------------------------------
#: A row's fixed cost (accepting its draft, the matcher's bookkeeping, the repair), in the mask
#: words whose filling costs as much. One thread's CPU time per row, cold caches, the JSON
#: schema (2 cores): chains of 5 nodes 5.3 µs at 49k (1,536 words), 10.0 at 131k (4,096),
#: 18.0 at 152k (4,748); trees of 16 nodes 4.2, 9.1, 14.5. The 49k and 131k pairs give 650 to
#: 1,400 words; 152k costs more per word (Qwen's vocabulary has more tokens the grammar must
#: check one by one). At 512 one unit costs 2.2 to 3.4 ns on every vocabulary.
ROW_WORDS = 512

#: From this much work on, the compiled walker cuts the batch into parts walked on the pool at
#: once (the chain lists, the walk table); below it one part on the calling thread is faster:
#: the other core starts with cold caches (xgrammar's grammar and token tables) and has to be
#: woken, about half a millisecond on this 2-core machine. 512 rows of 49k (2 cores, the JSON
#: schema: 96 rows 424 against 703 µs in two parts, 320 rows 1.26 against 1.39 ms; from 512
#: rows on the parts win, 2.42 against 2.53 ms, 1,280 rows 4.53 against 4.98); in these units
#: 228 rows of 131k, 200 of 152k (parts at 320 rows of 131k, K=4 batch 64: 1.20 to 1.43x the
#: serial fill against 1.08 to 1.13x on one thread; 1.22 to 1.58x against 1.13 to 1.23x in three
#: quiet runs of docs/results/2026-12-06-routes.md). The one-call rows take builds below it.
ONE_THREAD_WORK = 1_048_576

#: The planner runs its jobs on the pool from this much work with a grammar: below it, waking
#: pool workers costs more than it saves (48 rows of 49k: 2 cores, trees of the JSON schema).
POOL_WORK = 98_304

#: Chains that the compiled helper cannot walk itself stay on the calling thread up to
#: SHORT_CHAIN_FACTOR times POOL_WORK when each request's work is at most SHORT_CHAIN_WORK:
#: each request's work between two GIL hand-offs is too short for a second thread to gain
#: (1 to 8 drafts at 49k, batch 8 to 256: the pool was slower in every configuration).
SHORT_CHAIN_WORK = 18_432
SHORT_CHAIN_FACTOR = 64

#: With fewer requests than threads, an xgrammar tree of at least SPLIT_WORK is cut into
#: subtrees of at least SPLIT_PART_WORK walked in parallel on forks of the matcher. Forks, path
#: replays and waking a worker cost tens of microseconds, so only big trees gain (256 and 16
#: nodes of 49k).
SPLIT_WORK = 524_288
SPLIT_PART_WORK = 32_768

#: llguidance chains: from this much work on, one call of llguidance's parallel executor;
#: below, each chain in a compiled per-token loop on the calling thread (the executor's
#: hand-off and the pass that tells which rows it wrote cost more: 16-node chains of the JSON
#: schema at 49k, 86 against 215 µs at batch 1, 408 against 597 at 8, even at 32 requests).
EXECUTOR_WORK = 1_048_576
_MAX = MAX_VOCAB_SIZE  # the fast paths leave larger sizes to the checks


def work(rows: int, words: int) -> int:
    """The work of filling ``rows`` mask rows of ``words`` int32 words each (the unit of every
    threshold of this module)."""
    return rows * (words + ROW_WORDS)


def parts_for(rows: int, words: int) -> int:
    """How many parts the compiled walker cuts ``rows`` rows of ``words`` words into: the
    library's threads from :data:`ONE_THREAD_WORK` on, else 1."""
    return get_num_threads() if work(rows, words) >= ONE_THREAD_WORK else 1


def pool_worthy(rows: int, words: int) -> bool:
    """Whether jobs filling ``rows`` constrained rows of ``words`` words are worth the pool."""
    return work(rows, words) >= POOL_WORK


def _nodes_for(amount: int, words: int) -> int:
    """The fewest rows of ``words`` words that make ``amount`` work."""
    return -(-amount // (words + ROW_WORDS))


# -- a call, as the rows see it ----------------------------------------------------------------
class Call:
    """One build's arguments and what the table has learnt of them so far.

    ``tree`` is ``None`` for draft lists (``drafts``, ``rows_per_request``) until a row needs
    the :func:`chain_tree` of them; ``words``, ``kinds``, ``infos``, ``constrained``,
    ``checked`` and ``thinking`` are filled by the checks.
    """

    __slots__ = (
        "checked", "constrained", "drafts", "grammars", "infos", "kinds", "layout", "max_rows",
        "out", "reasoning", "return_valid", "rows_per_request", "shape", "thinking", "tree",
        "vocab_size", "words",
    )  # fmt: skip

    def __init__(
        self,
        grammars: Any,
        tree: GrammarTree | None,
        vocab_size: Any,
        out: Any,
        layout: str,
        max_rows: int | None,
        reasoning: Any,
        return_valid: bool,
        drafts: Any = None,
        rows_per_request: Any = None,
    ) -> None:
        self.grammars, self.tree, self.vocab_size, self.out = grammars, tree, vocab_size, out
        self.layout, self.max_rows, self.reasoning = layout, max_rows, reasoning
        self.return_valid, self.drafts = return_valid, drafts
        self.rows_per_request = rows_per_request
        self.shape: TreeShape | None = None if tree is None else tree.shape
        self.words: int | None = None
        self.kinds: list[int] | None = None
        self.infos: list[Any] | None = None
        self.constrained: list[int] | None = None
        self.checked: Any = None  # the reasoning rule, checked
        self.thinking: list[int] = []  # the constrained requests still reasoning at the root

    def plain_words(self) -> int:
        """The mask's words per row when ``vocab_size`` is a plain positive int, else 0."""
        vocab_size = self.vocab_size
        return (vocab_size + 31) >> 5 if type(vocab_size) is int and 0 < vocab_size <= _MAX else 0


@dataclass(frozen=True)
class Route:
    """One row of the table.

    Attributes:
        name: what :func:`portable_spec.grammar_stats` and the tests call it.
        when: when it applies, in words (``applies`` says it in code).
        how: how it builds, in words.
        applies: ``applies(call)``: whether the row takes the call.
        build: ``build(call)``: the result of the build (compiled rows: ``None`` when they
            decline).
        compiled: a single compiled call that checks everything itself and may decline; the
            rows after the first that is not compiled run once the call is checked, its kinds
            looked up and its matchers held.
    """

    name: str
    when: str
    how: str
    applies: Callable[[Call], bool]
    build: Callable[[Call], Any]
    compiled: bool = False


# -- the compiled rows (before the checks) -------------------------------------------------------
def _lists_apply(call: Call) -> bool:
    return call.drafts is not None


def _lists_build(call: Call) -> Any:
    done = _lists(
        call.grammars, call.drafts, call.vocab_size, call.rows_per_request, call.out,
        call.reasoning, call.return_valid,
    )  # fmt: skip
    if done is None:  # on down the table over the equivalent tree
        _lists_to_tree(call)
    return done


def _lists(
    grammars: Any,
    drafts: Any,
    vocab_size: Any,
    rows_per_request: Any,
    out: Any,
    reasoning: Any,
    return_valid: bool,
) -> Any:
    """The "chain lists" row's build over the call's arguments as given (``None``: declined,
    nothing written, no matcher moved)."""
    threads = get_num_threads()
    if type(vocab_size) is not int or not 0 < vocab_size <= _MAX:
        return None  # (the checks say what is wrong)
    words = (vocab_size + 31) >> 5
    parts_from = _nodes_for(ONE_THREAD_WORK, words) if words and threads > 1 else 0
    return build_lists(
        grammars, drafts, vocab_size, rows_per_request, out, reasoning, return_valid,
        parts_from, threads,
    )  # fmt: skip


def _lists_to_tree(call: Call) -> None:
    """Replace ``call``'s draft lists by their :func:`chain_tree` (``TypeError``/``ValueError``
    naming the request at fault, or the number of matchers that does not match the drafts')."""
    tree = chain_tree(call.drafts, call.rows_per_request)
    grammars = call.grammars
    if type(grammars) in (list, tuple) and len(grammars) != tree.batch:
        raise ValueError(
            f"len(matchers) = {len(grammars)} but drafts holds {tree.batch} requests' chains"
        )
    call.tree, call.shape, call.drafts = tree, tree.shape, None


def _plain_dense(call: Call) -> bool:
    return call.reasoning is None and call.layout == "dense" and call.max_rows is None


def _first_kind(grammars: Any) -> int:
    return matcher_kind(grammars[0]) if type(grammars) in (list, tuple) and grammars else NONE


def _one_call_applies(call: Call) -> bool:
    return call.tree is not None and _plain_dense(call)


def _one_call_build(call: Call) -> Any:
    assert call.tree is not None
    return _one_call(call.grammars, call.tree, call.vocab_size, call.out, call.return_valid)


def _one_call(
    grammars: Any, tree: GrammarTree, vocab_size: Any, out: Any, return_valid: bool
) -> Any:
    """The "one call" row's build over a dense call's arguments as given: ``None`` when the
    tree is not the caller's host arrays, the work is ONE_THREAD_WORK or more (a tree's
    request SPLIT_WORK or more) or the compiled call declines (nothing written, no matcher
    moved)."""
    arrays = tree.host_inputs()
    if arrays is None or type(vocab_size) is not int or not 0 < vocab_size <= _MAX:
        return None  # (the checks say what is wrong)
    if _first_kind(grammars) == LLGUIDANCE:  # llguidance holds the GIL: one thread always
        return small_llguidance.in_place(grammars, arrays, vocab_size, out, return_valid)
    words = (vocab_size + 31) >> 5
    if work(tree.rows, words) >= ONE_THREAD_WORK:
        return None
    nodes = tree.nodes
    if not (tree.is_chain or tree.is_packed) and work(nodes, words) >= SPLIT_WORK:
        return None
    return small.in_place(grammars, arrays, nodes, vocab_size, out, return_valid)


def _small_chains_apply(call: Call) -> bool:
    shape = call.shape
    if shape is None or not shape.linear or not _plain_dense(call) or native.native is None:
        return False
    grammars, words = call.grammars, call.plain_words()
    return (
        type(grammars) is list
        and 0 < shape.batch == len(grammars)
        and words > 0
        and work(shape.rows, words) < ONE_THREAD_WORK
    )


def _small_chains_build(call: Call) -> Any:
    infos = known_xgrammar_facts(call.grammars, call.plain_words())
    if infos is None:
        return None
    assert call.tree is not None
    return small.small_chains(
        call.grammars, call.tree, infos, call.vocab_size, call.out, call.return_valid
    )


# -- the checks: every argument, the kinds once, the matchers held once ------------------------
def _check(call: Call) -> None:
    """Check every argument of ``call`` before any matcher moves (``TypeError``/
    ``ValueError``), look each request's engine up once; fill ``call.words``, ``kinds``,
    ``infos``, ``constrained``, ``checked`` and ``thinking``."""
    tree = call.tree
    assert tree is not None
    call.vocab_size = check_vocab_size(call.vocab_size)
    call.max_rows = check_layout(call.layout, call.max_rows)
    if tree.is_packed and call.layout != "dense":
        raise ValueError(
            "packed chains (GrammarTree.from_packed_chains) build dense masks only; "
            "use layout='dense'"
        )
    words = call.words = words_for(call.vocab_size)
    if call.reasoning is not None:
        if call.layout != "dense":
            raise ValueError("reasoning= builds dense masks only; use layout='dense'")
        if call.out is not None:
            check_dense_out(call.out, tree.rows, words)
        call.checked = check_reasoning(call.reasoning, tree.batch, call.vocab_size)
    if type(call.grammars) is list or type(call.grammars) is tuple:
        # read once: another thread changing the caller's list meanwhile changes nothing
        call.grammars = list(call.grammars)
    call.kinds, call.infos = classify_grammars(call.grammars, tree.batch, call.vocab_size)
    call.constrained = [b for b, kind in enumerate(call.kinds) if kind != NONE]
    if call.checked is not None:
        call.thinking = [b for b in call.constrained if call.checked.active[b]]


# -- the rows after the checks -------------------------------------------------------------------
def _unconstrained_apply(call: Call) -> bool:
    return not call.constrained


def _unconstrained_build(call: Call) -> Any:
    tree = call.tree
    assert tree is not None
    if call.return_valid:
        tree.validate()
        return None, per_node(tree, tree.topology().reachable)
    return None


def _reasoning_apply(call: Call) -> bool:
    return bool(call.thinking)


def _compact_apply(call: Call) -> bool:
    return call.layout == "compact"


def _compact_build(call: Call) -> Any:
    tree = call.tree
    assert tree is not None and call.words is not None and call.constrained is not None
    capacity = len(call.constrained) * tree.nodes if call.max_rows is None else call.max_rows
    target = None if call.out is None else check_compact_out(call.out, capacity, call.words)
    return build_compact(_resolved(call), target, call.max_rows)


def _table_apply(call: Call) -> bool:
    tree, words = call.tree, call.words
    assert tree is not None and words is not None and call.infos is not None
    if work(tree.nodes, words) >= SPLIT_WORK:
        return False  # requests big enough to cut over threads: the planner
    return walkable(call.infos, words) is not None


def _table_build(call: Call) -> Any:
    assert call.tree is not None and call.words is not None
    mask = _dense_out(call)
    return build_table(_resolved(call), mask, parts_for(call.tree.rows, call.words))


def _inline_apply(call: Call) -> bool:
    tree, words, kinds = call.tree, call.words, call.kinds
    assert tree is not None and words is not None and kinds is not None
    request = work(tree.nodes, words)
    if request >= SPLIT_WORK:
        return False
    chains = tree.is_chain or tree.is_packed
    limit = POOL_WORK
    if chains and request <= SHORT_CHAIN_WORK:
        limit *= SHORT_CHAIN_FACTOR
    if len(call.constrained or ()) * request >= limit:
        return False
    allowed = (XGRAMMAR, NONE) if chains or not call.return_valid else (XGRAMMAR,)
    return set(kinds).issubset(allowed)


def _inline_build(call: Call) -> Any:
    return build_inline(_resolved(call), _dense_out(call))


def _planned_build(call: Call) -> Any:
    return build_dense(_resolved(call), _dense_out(call))


def _always(call: Call) -> bool:
    return True


def _dense_out(call: Call) -> np.ndarray:
    tree, words = call.tree, call.words
    assert tree is not None and words is not None
    if call.out is not None:
        return check_dense_out(call.out, tree.rows, words)
    return np.empty((tree.rows, words), np.int32)


def _plan(call: Call) -> Plan:
    """How the planner runs this build's jobs (see :class:`Plan`)."""
    tree, words, kinds = call.tree, call.words, call.kinds
    assert tree is not None and words is not None and kinds is not None
    constrained_rows = sum(n for b, (_, n) in enumerate(tree.spans()) if kinds[b] != NONE)
    llguidance = [b for b, kind in enumerate(kinds) if kind == LLGUIDANCE]
    return Plan(
        parallel=pool_worthy(constrained_rows, words),
        split_nodes=_nodes_for(SPLIT_WORK, words),
        split_part=_nodes_for(SPLIT_PART_WORK, words),
        executor=bool(llguidance) and work(len(llguidance) * tree.nodes, words) >= EXECUTOR_WORK,
    )


def _resolved(call: Call) -> Build:
    """The :class:`Build` of a checked call: the tree resolved and its links validated."""
    tree = call.tree
    assert tree is not None and call.kinds is not None and call.infos is not None
    started = perf_counter()
    arrays = tree.resolve()
    resolved = perf_counter()
    tree.validate()
    return Build(
        call.grammars, tree, arrays, tree.spans(), call.vocab_size, call.kinds, call.infos,
        call.constrained or [], call.return_valid, (started, resolved), _plan(call),
    )  # fmt: skip


ROUTES: tuple[Route, ...] = (
    Route(
        "chain lists",
        "build_chain_bitmask's draft lists; every grammar an xgrammar matcher the compiled "
        "helper calls, plain ints, no content end tokens",
        "one compiled call packs the lists, writes the rows no grammar walks, walks and "
        "repairs; from ONE_THREAD_WORK on it packs them and the walker walks them in parts "
        "on the pool",
        _lists_apply,
        _lists_build,
        compiled=True,
    ),
    Route(
        "one call",
        "the caller's own host arrays (TreeShape.on_host), dense, no reasoning, no max_rows; "
        "xgrammar under ONE_THREAD_WORK (trees: each request under SPLIT_WORK), or llguidance",
        "one compiled call over the arrays as they are: checks, walk and repair on the "
        "calling thread",
        _one_call_applies,
        _one_call_build,
        compiled=True,
    ),
    Route(
        "small chains",
        "chains (TreeShape.linear) staged or of another dtype, dense, no reasoning, under "
        "ONE_THREAD_WORK, plain xgrammar matchers already probed",
        "the tokens resolved, one compiled walk of every chain on the calling thread",
        _small_chains_apply,
        _small_chains_build,
        compiled=True,
    ),
    Route(
        "unconstrained",
        "no request has a grammar",
        "nothing written: None (and the valid flags: every node a link reaches)",
        _unconstrained_apply,
        _unconstrained_build,
    ),
    Route(
        "reasoning",
        "a Reasoning rule with a constrained request still reasoning at the root",
        "the rule per root path (reasoning.py), its builds back through this table",
        _reasoning_apply,
        lambda call: _reasoning_build(call),
    ),
    Route(
        "compact",
        "layout='compact'",
        "the planner's jobs into scratch blocks, the kept rows committed in request order",
        _compact_apply,
        _compact_build,
    ),
    Route(
        "walk table",
        "dense; every constrained matcher one the compiled helper walks (same width and stop "
        "tokens); no tree big enough to cut (SPLIT_WORK)",
        "the compiled walker over a table of chains or trees: one part on the calling "
        "thread, or from ONE_THREAD_WORK parts on the pool",
        _table_apply,
        _table_build,
    ),
    Route(
        "inline",
        "dense, xgrammar only (unconstrained requests too on chains), under POOL_WORK (short "
        "chains: SHORT_CHAIN_FACTOR times more)",
        "request after request on the calling thread through xgrammar's binding",
        _inline_apply,
        _inline_build,
    ),
    Route(
        "planned",
        "everything else",
        "one job per request (subtrees of split trees, llguidance's executor from "
        "EXECUTOR_WORK, Python walks in one job) on the pool from POOL_WORK",
        _always,
        _planned_build,
    ),
)


def build(call: Call) -> Any:
    """Build ``call`` by the first row of :data:`ROUTES` that applies (see the module
    docstring); returns what :func:`portable_spec.build_host_bitmask` (or
    :func:`portable_spec.build_chain_bitmask`) returns, raises what it raises."""
    return _walk(call, 0)


def build_tree(
    matchers: Any,
    tree: GrammarTree,
    vocab_size: Any,
    out: Any,
    layout: str,
    max_rows: int | None,
    reasoning: Any,
    return_valid: bool,
) -> Any:
    """:func:`portable_spec.build_host_bitmask`: a plain dense call first tries the table's
    "one call" row over the arguments as given (the common small call: one compiled call, no
    :class:`Call` made, which costs microseconds with cold caches), then the rows after it."""
    check_flag("return_valid", return_valid)
    first = 0
    if reasoning is None and layout == "dense" and max_rows is None:
        done = _one_call(matchers, tree, vocab_size, out, return_valid)
        if done is not None:
            return done
        first = 2  # after "chain lists" (no draft lists) and "one call" (just tried)
    call = Call(matchers, tree, vocab_size, out, layout, max_rows, reasoning, return_valid)
    return _walk(call, first)


def build_chains(
    matchers: Any,
    drafts: Any,
    vocab_size: Any,
    rows_per_request: Any,
    out: Any,
    reasoning: Any,
    return_valid: bool,
) -> Any:
    """:func:`portable_spec.build_chain_bitmask`: the table's first row, "chain lists", called
    over the arguments as given (the common call: one compiled call, no :class:`Call` made,
    which costs microseconds with cold caches), then the rows after it over the lists' tree."""
    check_flag("return_valid", return_valid)
    done = _lists(matchers, drafts, vocab_size, rows_per_request, out, reasoning, return_valid)
    if done is not None:
        return done
    call = Call(
        matchers, None, vocab_size, out, "dense", None, reasoning, return_valid, drafts,
        rows_per_request,
    )  # fmt: skip
    _lists_to_tree(call)
    return _walk(call, 1)


def _walk(call: Call, first: int) -> Any:
    """The table walked from row ``first``: the compiled rows that apply until one builds,
    then the checked rows."""
    routes = ROUTES
    index = first
    for index in range(first, len(routes)):
        route = routes[index]
        if not route.compiled:
            break
        if route.applies(call):
            done = route.build(call)
            if done is not None:
                return done
    if call.tree is None:  # draft lists no compiled row took
        _lists_to_tree(call)
    return _checked_build(call, routes[index:], hold=True)


def _checked_build(call: Call, rows: Sequence[Route], hold: bool) -> Any:
    """The rows after the checks: check ``call``, hold its matchers (unless the caller holds
    them already: ``hold=False``), build by the first row that applies, release."""
    _check(call)
    route = next(route for route in rows if route.applies(call))
    if not hold:
        return route.build(call)
    # the matchers this build walks, held until it is done (ValueError if another build holds
    # one: it would walk them at the same time)
    token, held = hold_matchers(call.grammars)
    try:
        return route.build(call)
    finally:
        release_matchers(token, held)


def _reasoning_build(call: Call) -> Any:
    """The reasoning row: the rule per root path; every build it makes goes through the rows
    after the checks, over the matchers this build holds."""
    tree, words = call.tree, call.words
    assert tree is not None and words is not None
    arrays = tree.resolve()
    tree.validate()
    after = [route for route in ROUTES if not route.compiled]

    def inner(grammars: Any, sub: GrammarTree, vocab_size: int, **options: Any) -> Any:
        out, valid = options.get("out"), options.get("return_valid", False)
        return _checked_build(
            Call(grammars, sub, vocab_size, out, "dense", None, None, valid), after, hold=False
        )

    return build_with_reasoning(
        inner, call.grammars, tree, arrays, call.vocab_size, words, call.checked,
        call.thinking, call.out, call.return_valid, lambda rows: parts_for(rows, words),
    )  # fmt: skip
