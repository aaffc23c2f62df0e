"""The builder's route table: which row builds which call, what the tree says of its shape, and
that every row's mask is the oracle's (replayed on fresh matchers)."""

from __future__ import annotations

import numpy as np
import pytest
from _cases import matrix_case
from _oracle import ProtocolMatcher, Request, expected_mask
from _short_path import spy_routes

import portable_spec as ps
import portable_spec.builder.routes as routes
from portable_spec import native


def _probed(matchers, vocab_size):
    """The library's first look at the matchers (what the compiled rows read afterwards)."""
    live = [m for m in matchers if m is not None]
    zeros = np.zeros((len(live), 1), dtype=np.int64)
    ps.build_host_bitmask(live, ps.GrammarTree.from_linear_chain(zeros), vocab_size)


def _chain_case(smollm2, batch, k, seed):
    """``batch`` JSON-schema requests with ``k`` drafts each, the first ones on the grammar."""
    rng = np.random.default_rng(seed)
    requests = [Request(smollm2.grammars["json_schema"]) for _ in range(batch)]
    chains = np.zeros((batch, k + 1), dtype=np.int64)
    for b, request in enumerate(requests):
        m = request.fresh()
        for j in range(1, k + 1):
            row = np.zeros((1, smollm2.words), np.int32)
            m.fill_next_token_bitmask(row, 0)
            options = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            token = int(rng.choice(options)) if j < k else int(rng.integers(0, smollm2.size))
            chains[b, j] = token
            if not m.accept_token(token):
                break
    return requests, chains


def _chain_links(batch, nodes):
    nt = np.tile(np.append(np.arange(1, nodes), -1), (batch, 1)).astype(np.int64)
    return nt, np.full((batch, nodes), -1, dtype=np.int64)


def test_the_table_is_ordered_compiled_rows_first_and_ends_with_a_row_for_everything():
    names = [route.name for route in routes.ROUTES]
    assert len(set(names)) == len(names)
    compiled = [route.compiled for route in routes.ROUTES]
    assert compiled == sorted(compiled, reverse=True)  # the compiled rows, then the others
    assert routes.ROUTES[-1].applies(object())  # type: ignore[arg-type]
    assert all(route.when and route.how for route in routes.ROUTES)


def test_thresholds_are_work_and_scale_with_the_mask_width():
    """One number, fewer rows on wider masks: rows x (words + ROW_WORDS)."""
    narrow, wide = 1536, 4096
    assert routes.work(10, narrow) == 10 * (narrow + routes.ROW_WORDS)
    rows_narrow = next(
        r for r in range(1, 10**6) if routes.work(r, narrow) >= routes.ONE_THREAD_WORK
    )
    rows_wide = next(r for r in range(1, 10**6) if routes.work(r, wide) >= routes.ONE_THREAD_WORK)
    assert rows_wide < rows_narrow
    threads = ps.get_num_threads()
    assert routes.parts_for(rows_narrow - 1, narrow) == 1
    assert routes.parts_for(rows_narrow, narrow) == threads


def test_tree_shapes():
    nt, ns = _chain_links(3, 4)
    tokens = np.zeros((3, 4), dtype=np.int64)
    shape = ps.GrammarTree.from_host(nt, ns, tokens).shape
    assert shape == (3, 4, 12, False, False, True, 3)
    assert ps.GrammarTree.from_linear_chain(tokens).shape.linear
    packed = ps.GrammarTree.from_packed_chains(np.zeros(6, np.int64), [0, 1, 6]).shape
    assert (packed.batch, packed.nodes, packed.rows, packed.linear, packed.packed) == (
        2, 5, 6, True, True,
    )  # fmt: skip
    assert ps.GrammarTree.from_linear_chain(tokens).host_inputs()[0] is tokens
    with pytest.raises(AttributeError):
        shape.batch = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "case",
    ["lists", "one call", "small chains", "walk table", "unconstrained", "compact", "planned"],
)
def test_each_row_builds_the_oracles_mask(smollm2, case, monkeypatch):
    """A call made for each row is built by that row (and no earlier one), and its mask is the
    replay's; matchers end where they started."""
    if native.native is None and case in ("lists", "one call", "small chains"):
        pytest.skip("the compiled helper is not built")
    batch, k = 4, 3
    requests, chains = _chain_case(smollm2, batch, k, seed=hash(case) & 0xFFFF)
    matchers = [r.fresh() for r in requests]
    _probed(matchers, smollm2.size)
    nt, ns = _chain_links(batch, k + 1)
    taken = spy_routes(monkeypatch)
    layout = "dense"
    if case == "lists":
        mask = ps.build_chain_bitmask(
            matchers, [c[1:].tolist() for c in chains], smollm2.size, rows_per_request=k + 1
        )
    else:
        if case == "small chains":
            tree = ps.GrammarTree.from_linear_chain(chains.astype(np.int32))  # not in place
        elif case == "walk table":
            monkeypatch.setattr(routes, "ONE_THREAD_WORK", 1)  # too much for one call
            tree = ps.GrammarTree.from_linear_chain(chains)
        elif case == "unconstrained":
            matchers = [None] * batch
            requests = [None] * batch
            tree = ps.GrammarTree.from_linear_chain(chains)
        elif case == "planned":
            matchers = [ProtocolMatcher(r.fresh()) for r in requests]
            tree = ps.GrammarTree.from_linear_chain(chains)
        else:
            tree = ps.GrammarTree.from_linear_chain(chains)
        if case == "compact":
            layout = "compact"
        mask = ps.build_host_bitmask(matchers, tree, smollm2.size, layout=layout)
    assert taken == [case if case != "lists" else "chain lists"]
    if case == "unconstrained":
        assert mask is None
        return
    if layout == "compact":
        mask = mask.to_dense()
    np.testing.assert_array_equal(
        mask, expected_mask(requests, nt, ns, chains, smollm2.size, smollm2.words)
    )


def test_reasoning_and_inline_rows(smollm2, monkeypatch):
    """A request still reasoning takes the reasoning row, whose own builds go through the rows
    below the checks, over matchers held once (no build refuses its own matchers)."""
    requests, nt, ns, dt, want = matrix_case(smollm2, 8, 6)
    matchers = [None if r is None else r.native() for r in requests]
    _probed(matchers, smollm2.size)
    taken = spy_routes(monkeypatch)
    rule = ps.Reasoning([False] * 8, [smollm2.eos])
    mask = ps.build_host_bitmask(matchers, ps.GrammarTree.from_host(nt, ns, dt), smollm2.size,
                                 reasoning=rule)  # fmt: skip
    np.testing.assert_array_equal(mask, want)  # nobody reasoning: as without the rule
    assert taken == ["walk table"]
    active = [b == 0 for b in range(8)]
    taken.clear()
    ps.build_host_bitmask(
        matchers, ps.GrammarTree.from_host(nt, ns, dt), smollm2.size,
        reasoning=ps.Reasoning(active, [smollm2.eos]),
    )  # fmt: skip
    assert taken[0] == "reasoning" and len(taken) > 1
    assert "reasoning" not in taken[1:]
