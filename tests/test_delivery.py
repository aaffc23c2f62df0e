"""Where masks go (``portable_spec.delivery``): one target resolver for
``build_grammar_vocab_mask`` and ``DraftSession``, refusing what names two frameworks before
any matcher moves; and the one delivery sequence handing its host buffer back when a build
fails."""

from __future__ import annotations

import gc

import pytest
import xgrammar as xgr
from _oracle import FailingMatcher, ProtocolMatcher

import portable_spec as ps
from portable_spec.delivery import resolve_target
from portable_spec.registry import get_backend


def _jax_cpu_device():
    jax = pytest.importorskip("jax")
    return jax.devices("cpu")[0]


def test_a_device_of_another_framework_than_backend_is_refused(smollm2):
    device = _jax_cpu_device()
    m = ProtocolMatcher(xgr.GrammarMatcher(smollm2.grammars["json_schema"]))
    with pytest.raises(TypeError, match="does not belong to backend 'numpy'"):
        ps.DraftSession([m], smollm2.size, backend="numpy", device=device)
    assert m.calls == []  # refused before the root rows were filled
    # the same device with its own backend, or found from the device, is fine
    with ps.DraftSession([m], smollm2.size, backend="jax", device=device) as s:
        assert s.backend.name == "jax"
    with ps.DraftSession([m], smollm2.size, device=device) as s:
        assert s.backend.name == "jax"


def test_the_resolver_rules():
    numpy = get_backend("numpy")
    tree_target = (numpy, "tree-device")
    # nothing named: the default (a tree's own target), else numpy host arrays
    assert resolve_target(None, default=tree_target) == tree_target
    assert resolve_target(None) == (numpy, None)
    # a string is read by the named backend, else by the default's
    assert resolve_target("cpu", "numpy") == (numpy, "cpu")
    assert resolve_target("cpu", default=tree_target) == (numpy, "cpu")
    with pytest.raises(TypeError, match="backend="):
        resolve_target("cpu")
    # a backend given as an object, or by name
    assert resolve_target(None, numpy) == (numpy, None)
    with pytest.raises(TypeError, match="name or a Backend"):
        resolve_target(None, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_target(None, "no-such-backend")
    # a device object names its own backend, whatever the default
    device = _jax_cpu_device()
    backend, placement = resolve_target(device, default=tree_target)
    assert backend.name == "jax" and placement is device
    with pytest.raises(TypeError, match="'jax' device and does not belong"):
        resolve_target(device, numpy)
    # what no framework claims (a device index) is the named backend's to read
    assert resolve_target(0, numpy) == (numpy, 0)


@pytest.mark.parametrize("layout", ["dense", "compact"])
@pytest.mark.parametrize("fail_in", ["accept", "fill"])
def test_a_failed_build_hands_its_host_buffer_back(smollm2, layout, fail_in):
    """The delivery sequence: a matcher raising mid-walk leaves every pooled block free (none
    leaked), and the matcher is back at its start."""
    pool = get_backend("numpy").pool
    tree = ps.GrammarTree.from_host([[1, 2, -1]], [[-1, -1, -1]], [[0, 107, 18]])
    bad = FailingMatcher(
        xgr.GrammarMatcher(smollm2.grammars["json_schema"]), fail_in=fail_in, at_call=2
    )
    gc.collect()
    gc.disable()  # masks of other tests must not come back to the pool meanwhile
    try:
        before = pool.stats()
        with pytest.raises(ps.MatcherError):
            ps.build_grammar_vocab_mask([bad], tree, smollm2.size, row_capacity=8, layout=layout)
        after = pool.stats()
    finally:
        gc.enable()
    assert after["lent"] == before["lent"]
    assert after["free"] == before["free"] + after["allocations"] - before["allocations"]
    assert bad.depth == 0
