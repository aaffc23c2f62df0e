"""The vLLM and tpu-inference integrations' public face where neither engine is installed (the
default environment): the switch, install() answering False without an error, the counters'
shape, the row rules' layouts. With the engines: tests/real_vllm, tests/real_tpu_inference."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from portable_spec.integrations import tpu_inference, vllm
from portable_spec.integrations.entry_points import vllm_general_plugins
from portable_spec.integrations.vllm import internals
from portable_spec.integrations.vllm.rows import (
    Plan,
    first_padding,
    guidance_tail,
    stride_of,
    unwritten_rows,
)

no_engines = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None
    or importlib.util.find_spec("tpu_inference") is not None,
    reason="vLLM or tpu-inference is installed here",
)

FACE = ("ENV_VAR", "install", "uninstall", "is_installed", "integration_stats", "reset_stats")


@pytest.mark.parametrize("package", [vllm, tpu_inference])
def test_both_packages_have_the_contracts_face(package):
    for name in FACE:
        assert hasattr(package, name), name
    assert package.ENV_VAR == "PORTABLE_SPEC_VLLM"  # one switch: tpu-inference runs in vLLM
    snap = package.integration_stats()
    assert "median_us" in snap and "samples" in snap


@no_engines
@pytest.mark.parametrize("package", [vllm, tpu_inference])
def test_install_without_the_engine_is_false_and_says_nothing(package, caplog):
    with caplog.at_level("DEBUG"):
        assert package.install() is False
    assert not package.is_installed()
    assert not [r for r in caplog.records if r.name.startswith("vllm.portable_spec")]
    package.uninstall()  # nothing to give back: no error


@no_engines
def test_the_entry_point_off_imports_no_engine_and_on_patches_nothing_without_one(monkeypatch):
    monkeypatch.delenv(vllm.ENV_VAR, raising=False)
    vllm_general_plugins()
    monkeypatch.setenv(vllm.ENV_VAR, "1")
    vllm_general_plugins()  # no vLLM, no tpu-inference here: nothing to patch, no error
    assert not vllm.is_installed() and not tpu_inference.is_installed()
    code = (
        "import os, sys; os.environ['PORTABLE_SPEC_VLLM'] = 'off'\n"
        "from portable_spec.integrations.entry_points import vllm_general_plugins\n"
        "vllm_general_plugins()\n"
        "engines = ('vllm', 'tpu_inference', 'jax', 'torch', 'xgrammar', 'llguidance')\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in engines], sorted(sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("value", ["yes", "true", "2", "shadows"])
def test_a_misspelt_switch_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(vllm.ENV_VAR, value)
    with pytest.raises(ValueError, match=f"PORTABLE_SPEC_VLLM='{value}'"):
        vllm_general_plugins()


@pytest.mark.parametrize("name", ["FORCED_ENV_VAR", "WRITINGS_ENV_VAR", "LOOKUP_ENV_VAR"])
def test_a_misspelt_forced_drafts_switch_is_an_error_naming_it(monkeypatch, name):
    variable = getattr(vllm, name)
    monkeypatch.setenv(variable, "sometimes")
    with pytest.raises(ValueError, match=f"{variable}='sometimes'"):
        vllm.install("on")
    assert not vllm.is_installed()


def test_modes_are_checked_before_anything_is_imported():
    with pytest.raises(ValueError, match="mode"):
        vllm.install("off")
    with pytest.raises(ValueError, match="no shadow mode"):
        tpu_inference.install("shadow")


def test_the_counters_shape():
    vllm.reset_stats()
    snap = vllm.integration_stats()
    assert {k: snap[k] for k in ("calls", "built", "fallback_steps")} == dict.fromkeys(
        ("calls", "built", "fallback_steps"), 0
    )
    assert snap["median_us"] == {"portable_spec": {}, "vllm": {}, "forced_drafts": {}}
    assert snap["forced_drafted"] == snap["forced_accepted"] == 0
    tpu_inference.reset_stats()
    assert tpu_inference.integration_stats()["skipped_requests"] == 0


def test_the_release_table_names_every_target_it_checks():
    """Each known vLLM release lists every replaced method (a target missing from a row would
    silently not be installed on that release: the forced drafts' scheduler wrappers
    included) and what forced drafts rely on, and a layout."""
    for label, revision in internals.REVISIONS.items():
        assert set(internals.TARGETS) <= set(revision.sources), label
        assert {"update_draft_token_ids_in_output", "validate_tokens", "Request"} <= {
            target.rpartition(".")[2].rpartition(":")[2] for target in revision.sources
        }, label
        assert set(revision.sources) <= {*internals.TARGETS, *internals.READS}
        assert all(len(digest) == 64 for digest in revision.sources.values())
        assert vllm.layout_for(f"{label}.0") == internals.LAYOUTS[label]


def test_row_layouts():
    assert stride_of("packed", 4) == 0 and stride_of("strided", 4) == 5
    with pytest.raises(ValueError, match="layout"):
        stride_of("other", 4)
    assert unwritten_rows([[1, 2], [], [1, 2, 3, 4]], 0) == []
    assert unwritten_rows([[1, 2], [], [1, 2, 3, 4]], 5) == [3, 4, 6, 7, 8, 9]
    assert first_padding([]) == 0 and first_padding([3, 4]) == 2
    assert first_padding([3, -1, -1]) == 1


def test_plan_segments_by_the_rules():
    """Padding, reasoning bounds, a terminated grammar and the strided tail, as segments."""
    m = object()
    plan = Plan(stride_k=4)
    plan.add_request(m, [5, 6, -1], terminated=False, xgrammar=True)  # padding after 2
    plan.add_request(m, [7, 8, 9], terminated=False, xgrammar=True, bounds=(1, 2),
                     banned=lambda: (11,))  # fmt: skip
    plan.add_request(m, [1], terminated=True, xgrammar=True)
    assert plan.matchers == [m, None, None, None, m, None, None, None]
    assert plan.offsets == [0, 3, 4, 5, 6, 9, 10, 12, 15]
    assert plan.forced == [6]  # the reasoning end's row: all-allowed, the grammar starts there
    assert plan.masked == [(5, 7, (11,))]
    assert plan.unwritten == [4, 9, 12, 13, 14]
    assert plan.total == 15 and plan.grammar_segments == [0, 4]


def test_guidance_tail_rules():
    rows = np.arange(5, dtype=np.int32)[:, None].repeat(2, axis=1)
    out = rows.copy()
    guidance_tail(out, 0, [3, 4, 5], 4, 1, False, eos=9)  # refused at the second draft
    assert out[:, 0].tolist() == [0, 1, 1, 1, 1]
    out = rows.copy()
    guidance_tail(out, 0, [3, 9, 5], 4, 2, False, eos=9)  # the end token consumed
    assert out[:, 0].tolist() == [0, 1, -1, -1, -1]
    out = rows.copy()
    guidance_tail(
        out, 0, [3, 4, 9], 4, 1, True, eos=9
    )  # complete after one: its row until the end token
    assert out[:, 0].tolist() == [0, 1, 1, -1, -1]
    out = rows.copy()
    guidance_tail(out, 0, [3, 4], 4, 2, False, eos=9)  # padding after two
    assert out[:, 0].tolist() == [0, 1, 2, -1, -1]
