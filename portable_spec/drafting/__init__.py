"""Grammar-aware drafting: masks for a draft tree that grows level by level.

A drafter that grows its tree level by level (EAGLE's top-k expansion, a beam, a trie walked
by depth) asks at every level "what may follow this node?": exactly the rows the verify mask
needs. :class:`DraftSession` answers that question once per node, for a whole batch:

::

    with ps.DraftSession(matchers, vocab, device=dev) as session:
        rows = session.root_mask()                    # [batch, words]: no device sync
        for level in range(depth):
            logits = ps.apply_vocab_mask(draft_logits, rows)
            parents, tokens = pick(logits)            # [batch, k] each, host or device
            rows = session.extend(parents, tokens)    # [batch * k, words]: the new nodes
        mask = session.verify_mask(select)            # the verify tree's mask, no second walk

Node ids: the root is node 0; the ``k`` nodes of a level get the next ``k`` ids, the same
for every request (``session.nodes`` before the call is the first). A parent of -1 marks a
padding slot (no node: all-allowed row, never valid).

xgrammar requests get a level's rows from one compiled walk of their tree so far (levels added
without masks are walked together); for the other engines each live node's grammar state is
kept (a fork for llguidance and protocol matchers with ``fork()``; see
:mod:`portable_spec.engines` for matchers that cannot fork), so a level costs work
proportional to its new nodes. The session's matchers are never moved. What is kept is
released by :meth:`DraftSession.close` (the ``with`` block's end, also when it raises).

The rows follow the row contract of :func:`portable_spec.build_host_bitmask`, node by node:
the verify mask of any subtree of the drafted tree (:meth:`DraftSession.verify_mask`) is
bit-identical to :func:`portable_spec.build_grammar_vocab_mask` on that subtree.

Drafters whose drafts reach the host before verify (n-gram, suffix, any chain) extend them by
what the grammar forces with :func:`forced_drafts` (:mod:`portable_spec.drafting.forced`), in
the tokens the model's tokenizer gives the forced text.
"""

from portable_spec.drafting.forced import forced_drafts, forced_text
from portable_spec.drafting.session import DraftSession, forced_tokens
from portable_spec.drafting.trees import graft_chain, links_from_parents

__all__ = [
    "DraftSession",
    "forced_drafts",
    "forced_text",
    "forced_tokens",
    "graft_chain",
    "links_from_parents",
]
