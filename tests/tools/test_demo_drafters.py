"""Host-side pieces of the demo engine: tree layout, the n-gram drafter, greedy acceptance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.demo.drafters import NgramDrafter, host_tree_arrays
from examples.demo.engine import accept_path


@st.composite
def parent_lists(draw):
    n = draw(st.integers(1, 12))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def _walk(next_token, next_sibling):
    """Children of every node, following the links (bounded)."""
    children = {i: [] for i in range(len(next_token))}
    for p in range(len(next_token)):
        c = next_token[p]
        while c != -1:
            children[p].append(int(c))
            c = next_sibling[c]
            assert len(children[p]) <= len(next_token)
    return children


@settings(max_examples=60, deadline=None)
@given(parent=parent_lists(), pad=st.integers(0, 3), start=st.integers(0, 50))
def test_host_tree_arrays_match_the_parent_list(parent, pad, start):
    n = len(parent)
    tokens = list(range(100, 100 + n))
    nt, ns, toks, pos, mask = host_tree_arrays(parent, tokens, n + pad, start)
    children = _walk(nt, ns)
    for i in range(1, n):
        assert i in children[parent[i]]
    for i in range(n, n + pad):  # padding: unreachable, self-attending only
        assert all(i not in c for c in children.values()) and nt[i] == -1
        assert mask[i].sum() == 1 and mask[i, i]
    for i in range(n):
        ancestors = {i}
        j = i
        while parent[j] != -1:
            j = parent[j]
            ancestors.add(j)
        assert set(np.flatnonzero(mask[i])) == ancestors
        assert pos[i] == start + len(ancestors) - 1
    assert list(toks[:n]) == tokens


def test_host_tree_arrays_refuse_bad_parents():
    with pytest.raises(ValueError, match="parents must come first"):
        host_tree_arrays([-1, 2, 0], [1, 2, 3], 3, 0)
    with pytest.raises(ValueError, match="does not fit"):
        host_tree_arrays([-1, 0, 0], [1, 2, 3], 2, 0)


@settings(max_examples=80, deadline=None)
@given(
    context=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    nodes=st.integers(1, 10),
)
def test_ngram_draft_paths_occur_in_the_context(context, nodes):
    draft = NgramDrafter(nodes).draft(None, context, start=len(context) - 1)
    tree = draft.tree
    tree.topology()  # links are well-formed
    nt, ns, toks = (a[0] for a in tree.resolve())
    assert tree.nodes == nodes and toks[0] == context[-1]
    children = _walk(nt, ns)
    paths = {0: []}
    stack = [0]
    while stack:
        p = stack.pop()
        for c in children[p]:
            paths[c] = [*paths[p], int(toks[c])]
            stack.append(c)
    # every drafted path continues an earlier occurrence of the last token
    for path in paths.values():
        if path:
            seq = [context[-1], *path]
            assert any(context[s : s + len(seq)] == seq for s in range(len(context) - 1)), (
                context,
                path,
            )
    # and no two children of a node repeat a token
    for kids in children.values():
        assert len({int(toks[c]) for c in kids}) == len(kids)


def test_ngram_drafts_the_repetition_first():
    context = [7, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    draft = NgramDrafter(5).draft(None, context, start=12)
    nt, _, toks = (a[0] for a in draft.tree.resolve())
    chain, node = [], 0
    while nt[node] != -1:
        node = nt[node]
        chain.append(int(toks[node]))
    assert chain == [3, 4, 5, 1]
    np.testing.assert_array_equal(draft.positions, 12 + np.arange(5))


def test_ngram_without_a_match_drafts_the_root_only():
    draft = NgramDrafter(4).draft(None, [1, 2, 3], start=2)
    nt, ns, toks = (a[0] for a in draft.tree.resolve())
    assert (nt == -1).all() and (ns == -1).all() and toks[0] == 3


def test_accept_path_follows_the_argmax_through_siblings():
    #        0
    #     /  |  \
    #    1   2   3        tokens 10 11 12
    #        |
    #        4            token 20
    nt = np.array([1, -1, 4, -1, -1])
    ns = np.array([-1, 2, 3, -1, -1])
    draft = np.array([0, 10, 11, 12, 20])
    assert accept_path(nt, ns, draft, np.array([11, 0, 20, 0, 99])) == [0, 2, 4]
    assert accept_path(nt, ns, draft, np.array([11, 0, 21, 0, 99])) == [0, 2]
    assert accept_path(nt, ns, draft, np.array([13, 0, 20, 0, 99])) == [0]
    assert accept_path(nt, ns, draft, np.array([12, 0, 20, 0, 99])) == [0, 3]


# -- grammar-aware n-gram drafts ---------------------------------------------------------------
def _person_matcher(tok, prefix):
    from examples.demo.constraints import load_constraint

    m = load_constraint().matcher()
    for t in tok.encode(prefix):
        assert m.accept_token(t)
    return m


def test_grammar_aware_ngram_grafts_the_forced_continuation(tok):
    """After the name's closing quote the schema forces ', "age": ': the draft starts with
    that chain even though the context never contained it; every node is grammar-valid and
    the verify mask from the session equals build_grammar_vocab_mask on the draft's tree."""
    import portable_spec as ps
    from examples.demo.drafters import GrammarContext

    text = '{"name": "Ada Lovelace"'
    matcher = _person_matcher(tok, text)
    forced = matcher.find_jump_forward_tokens()
    assert tok.decode(forced) == ', "age":'
    context = tok.encode("Ada Lovelace is 36. ") + tok.encode(text)
    drafter = NgramDrafter(6)
    draft = drafter.draft(
        None, context, start=len(context) - 1, grammar=GrammarContext(matcher, 49152)
    )
    try:
        nt, _ns, toks = (a[0] for a in draft.tree.resolve())
        chain, node = [], 0
        while nt[node] != -1 and len(chain) < len(forced):
            node = nt[node]
            chain.append(int(toks[node]))
        assert chain == forced
        chosen = draft.select[0] >= 0
        # the root and the chain: the context's votes (a string after '":', more text after
        # the name's closing quote) are all refused by the grammar
        assert chosen.sum() == 1 + len(forced)
        assert draft.session.valid(draft.select)[0][chosen].all()
        mask = draft.session.verify_mask(draft.select)
    finally:
        draft.session.close()
    np.testing.assert_array_equal(mask, ps.build_grammar_vocab_mask([matcher], draft.tree, 49152))
    blind = NgramDrafter(6, masked=False).draft(
        None, context, start=len(context) - 1, grammar=GrammarContext(matcher, 49152)
    )
    assert blind.session is None


def test_grammar_aware_ngram_keeps_only_valid_votes(tok):
    """The context votes twice for a string after '":' and once for a number: blind, the
    string branch is drafted first; grammar-aware (the schema wants the age, an integer), only
    the number branch is drafted, and every drafted node is valid."""
    from examples.demo.drafters import GrammarContext

    prefix = '{"name": "Ada Lovelace", "age":'
    matcher = _person_matcher(tok, prefix)
    context = tok.encode('{"a": "b", "c": "d", "e": 3}') + tok.encode(prefix)
    space, three, quote = tok.encode(" ")[0], tok.encode("3")[0], tok.encode(' "')[0]

    def first_children(draft):
        nt, ns, toks = (a[0] for a in draft.tree.resolve())
        kids, c = [], nt[0]
        while c != -1:
            kids.append(int(toks[c]))
            c = ns[c]
        return kids

    blind = NgramDrafter(4, masked=False).draft(None, context, start=0)
    assert first_children(blind)[0] == quote and space in first_children(blind)
    aware = NgramDrafter(4).draft(None, context, start=0, grammar=GrammarContext(matcher, 49152))
    try:
        assert first_children(aware) == [space]
        chosen = aware.select[0] >= 0
        assert aware.session.valid(aware.select)[0][chosen].all()
        _, _, toks = (a[0] for a in aware.tree.resolve())
        assert three in toks.tolist()
    finally:
        aware.session.close()
