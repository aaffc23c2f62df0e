"""The integration's switch, versions, bad input and compiles, on tpu-inference's own runner.

Bad input gets a clear error before anything is uploaded, or (a structured request that is
not in the batch) its rows skipped with a log line, the other rows still in place; never a
wrong row. Unknown versions keep tpu-inference's own code, with one log line.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys

import numpy as np
import oracle
import pytest
import steps
import tpu_env
from test_rows import check_step, run_step

LOGGER = "vllm.portable_spec.tpu_inference"


def _step(tpu, grammars, seed, size=6, num_spec=4, max_num_reqs=8):
    rng = random.Random(seed)
    runner = steps.make_runner(tpu, max_num_reqs, num_spec)
    batch = steps.random_batch(rng, grammars, num_spec, size)
    return steps.build_step(runner, tpu, batch, rng)


def test_fewer_mask_rows_than_the_drafts_claim(tpu, grammars, integration, monkeypatch):
    step = _step(tpu, grammars, "fewer")
    output = step.grammar_output
    output.grammar_bitmask = output.grammar_bitmask[:-1]
    with pytest.raises(ValueError, match="claim"):
        run_step(step, "sample_tokens", monkeypatch)
    assert integration.integration_stats()["steps"] == 0


def test_logits_wider_than_the_mask(tpu, grammars, integration, monkeypatch):
    step = _step(tpu, grammars, "wider")
    wide = np.zeros((step.logits.shape[0], steps.VOCAB + 64), dtype=np.float32)
    step.state.logits = wide
    with pytest.raises(ValueError, match="columns"):
        run_step(step, "sample_tokens", monkeypatch)


def test_draft_counts_that_disagree(tpu, grammars, integration, monkeypatch):
    """vLLM's rows were built for other drafts than tpu-inference's logits hold."""
    rng = random.Random("disagree")
    runner = steps.make_runner(tpu, 8, 4)
    batch = [steps.random_request(rng, f"r{i}", grammars, 4, "valid") for i in range(4)]
    batch[0].drafts = [batch[0].drafts[0] if batch[0].drafts else 11] * 2
    step = steps.build_step(runner, tpu, batch, rng)
    drafts = step.state.scheduler_output.scheduled_spec_decode_tokens
    drafts["r0"] = drafts["r0"][:1]  # tpu-inference laid out two drafts
    step.grammar_output.grammar_bitmask = step.grammar_output.grammar_bitmask[:-1]
    with pytest.raises(ValueError, match="tpu-inference's logits hold 3 rows"):
        run_step(step, "sample_tokens", monkeypatch)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_structured_request_missing_from_the_batch(
    tpu, grammars, integration, monkeypatch, caplog, where
):
    """Its rows (vLLM wrote them) are skipped; every other row is its own request's."""
    step = _step(tpu, grammars, f"missing/{where}")
    output = step.grammar_output
    ids = list(output.structured_output_request_ids)
    at = {"first": 0, "middle": len(ids) // 2, "last": len(ids)}[where]
    drafts = [3, 4, 5]
    step.state.scheduler_output.scheduled_spec_decode_tokens["ghost"] = drafts
    offset = sum(
        1 + len(step.state.scheduler_output.scheduled_spec_decode_tokens.get(i, ()))
        for i in ids[:at]
    )
    ghost_rows = np.zeros((1 + len(drafts), output.grammar_bitmask.shape[1]), dtype=np.int32)
    output.grammar_bitmask = np.concatenate(
        [output.grammar_bitmask[:offset], ghost_rows, output.grammar_bitmask[offset:]]
    )
    output.structured_output_request_ids = [*ids[:at], "ghost", *ids[at:]]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        check_step(step, run_step(step, "sample_tokens", monkeypatch))
    assert integration.integration_stats()["skipped_requests"] == 1
    assert "ghost" in caplog.text


def test_mask_not_a_numpy_int32_matrix(tpu, grammars, integration, monkeypatch):
    step = _step(tpu, grammars, "dtype")
    step.grammar_output.grammar_bitmask = step.grammar_output.grammar_bitmask.astype(np.int64)
    with pytest.raises(TypeError, match="int32"):
        run_step(step, "sample_tokens", monkeypatch)


def _methods(tpu):
    from tpu_inference.runner.structured_decoding_manager import StructuredDecodingManager

    return (
        tpu.TPUModelRunner.sample_tokens,
        StructuredDecodingManager.prepare_structured_decoding_input,
        StructuredDecodingManager.__dict__["structured_decode_fn"],
    )


@pytest.mark.parametrize("unknown", ["tpu-inference", "vllm"])
def test_unknown_releases_keep_tpu_inference_code(tpu, monkeypatch, caplog, unknown):
    """Another tpu-inference version, or a vLLM whose rows are not 0.32's (its grammar_bitmask
    of another source): nothing patched, one log line."""
    from vllm.v1.structured_output import StructuredOutputManager

    from portable_spec.integrations import tpu_inference
    from portable_spec.integrations.tpu_inference import internals, state

    tpu_inference.uninstall()
    tpu_inference.reset_stats()
    own = _methods(tpu)
    assert state.INTEGRATION.new_patch_set().recognise() == ("0.32", "")
    if unknown == "tpu-inference":
        monkeypatch.setattr(internals, "version", lambda: "0.33.0")
    else:

        def grammar_bitmask(self, requests, ids, spec):  # rows laid out some other way
            return None

        monkeypatch.setattr(StructuredOutputManager, "grammar_bitmask", grammar_bitmask)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert tpu_inference.install() is False
        assert tpu_inference.install() is False
    assert _methods(tpu) == own
    assert not tpu_inference.is_installed()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "its own code runs" in lines[0]
    assert ("0.33.0" if unknown == "tpu-inference" else "grammar_bitmask") in lines[0]


def test_switched_by_the_vllm_plugin_variable(tpu, monkeypatch):
    """Off unless PORTABLE_SPEC_VLLM is on; ``shadow`` leaves the runner alone too."""
    from importlib.metadata import entry_points

    from portable_spec.integrations import tpu_inference
    from portable_spec.integrations import vllm as plugin
    from portable_spec.integrations.entry_points import vllm_general_plugins

    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("portable_spec") == (
        "portable_spec.integrations.entry_points:vllm_general_plugins"
    )
    assert tpu_inference.ENV_VAR == plugin.ENV_VAR
    tpu_inference.uninstall()
    own = _methods(tpu)
    try:
        for value in (None, "0", "shadow"):
            if value is None:
                monkeypatch.delenv(plugin.ENV_VAR, raising=False)
            else:
                monkeypatch.setenv(plugin.ENV_VAR, value)
            vllm_general_plugins()
            assert _methods(tpu) == own and not tpu_inference.is_installed(), value
        monkeypatch.setenv(plugin.ENV_VAR, "1")
        vllm_general_plugins()
        assert tpu_inference.is_installed()
        assert all(a is not b for a, b in zip(_methods(tpu), own, strict=True))
    finally:
        plugin.uninstall()
        tpu_inference.uninstall()
    assert _methods(tpu) == own


def test_patched_when_tpu_inference_imports_its_runner(tpu):
    """The entry point runs before tpu-inference imports its runner (a fresh interpreter):
    nothing of tpu-inference is imported then, and the runner is patched on import."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"""
import os, sys
sys.path.insert(0, {here!r})
import tpu_env
sys.path.insert(0, tpu_env.PACKAGES)  # tpu-inference importable, as when installed
os.environ["PORTABLE_SPEC_VLLM"] = "1"
from portable_spec.integrations import tpu_inference
from portable_spec.integrations.entry_points import vllm_general_plugins
vllm_general_plugins()
assert not any(m.startswith("tpu_inference") for m in sys.modules), "imported early"
assert not tpu_inference.is_installed()
runner = tpu_env.load()
assert tpu_inference.is_installed()
assert runner.TPUModelRunner.sample_tokens.__module__.startswith(tpu_inference.__name__)
print("patched on import")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **tpu_env.CPU_HOST)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=here
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "patched on import" in done.stdout


def test_one_compile_per_logits_shape(tpu, grammars, integration, monkeypatch):
    """Steps of every mix (drafts, constrained or not, skipped requests) with the same logits
    rows reuse one compiled apply: the mask's shapes depend on the logits' only."""
    from portable_spec.integrations.tpu_inference.apply import apply_packed

    rng = random.Random("compiles")
    before = apply_packed._cache_size()
    shapes = set()
    for i in range(8):
        step = _step(tpu, grammars, f"compiles/{i}", size=rng.randrange(1, 9))
        check_step(step, run_step(step, "sample_tokens", monkeypatch))
        shapes.add(step.logits.shape)
    assert apply_packed._cache_size() - before <= len(shapes) < 8


def test_precompile_inputs_compile_the_step_function(tpu, grammars, integration):
    """tpu-inference precompiles structured_decode_fn with its own dummy inputs (bool flags,
    rows aligned with the logits, as its CompilationManager passes them): the patched function
    takes them, masks the flagged rows, and compiles what a step of that shape runs."""
    from tpu_inference.utils import device_array

    from portable_spec.integrations.tpu_inference.apply import apply_packed

    rng = random.Random("precompile")
    runner = steps.make_runner(tpu, 16, 0)
    n = runner.num_reqs_paddings[0]
    flags = np.zeros((16, 1), dtype=np.bool_)
    flags[[1, 4]] = True
    bits = np.random.default_rng(0).integers(-(2**31), 2**31, (16, 1536)).astype(np.int32)
    logits = np.random.default_rng(1).standard_normal((n, steps.VOCAB), dtype=np.float32)
    args = device_array(runner.mesh, (logits, flags[:n], bits[:n], runner.structured_decode_arange))
    before = apply_packed._cache_size()
    masked = np.asarray(
        runner.structured_decoding_manager.structured_decode_fn(args[1], args[2], args[0], args[3])
    )
    allowed = ((bits[:n, :, None] >> np.arange(32)) & 1).astype(bool).reshape(n, -1)
    want = np.where(flags[:n] & ~allowed, -np.inf, logits)
    assert np.array_equal(masked, want)
    compiled = apply_packed._cache_size()
    assert compiled <= before + 1
    batch = steps.random_batch(rng, grammars, 0, n)  # a step whose logits have n rows
    step = steps.build_step(runner, tpu, batch, rng)
    assert step.logits.shape[0] == n
    check_step(step, run_step(step, "manager", None))
    assert apply_packed._cache_size() == compiled
    assert oracle.constrained_rows(step) > 0
