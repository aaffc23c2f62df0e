"""(e) The plugin as sglang loads it: its ``sglang.srt.plugins`` entry point run by sglang's own
``load_plugins()``, switched by ``PORTABLE_SPEC_SGLANG``; and what happens on an sglang it does
not know.

A fresh process (the entry point's import hook must see sglang's modules imported after it):
with the variable unset nothing of the plugin nor of sglang's speculative code is imported; a
misspelt value is refused by name (sglang logs the plugin's error and goes on without it);
``1`` installs the plugin when sglang's speculative utilities are imported, with one log line,
in every worker module that binds the mask build (imported before the plugin, or after), and
``uninstall()`` gives every one of them sglang's own function back. The drafting patches
install when their worker module is imported (one log line each), and
``PORTABLE_SPEC_SGLANG_DRAFTING`` switches them alone.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("sglang")

import _sgl

from portable_spec.integrations import sglang as plugin
from portable_spec.integrations.sglang import internals, state

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = [
    "sglang.srt.speculative.eagle_worker_common",
    "sglang.srt.speculative.ngram_worker",
    "sglang.srt.speculative.dflash_worker_v2",
    "sglang.srt.speculative.dspark_components.dspark_worker_v2",
]

FRESH = textwrap.dedent(
    """
    import importlib, json, logging, os, sys
    sys.path.insert(0, {here!r})
    import conftest  # sglang on CPU: the stubs, Triton's interpreter
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(
        (record.name, record.getMessage() + (f" {{record.exc_info[1]}}" if record.exc_info else ""))
    )
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    import sglang.srt.plugins as plugins

    def load(value):
        if value is None:
            os.environ.pop("PORTABLE_SPEC_SGLANG", None)
        else:
            os.environ["PORTABLE_SPEC_SGLANG"] = value
        plugins._plugins_loaded = False
        plugins.load_plugins()

    out = {{}}
    load(None)
    out["off_modules"] = sorted(m for m in sys.modules if m.startswith((
        "sglang.srt.speculative", "portable_spec.integrations.sglang.masks",
        "portable_spec.integrations.sglang.plain", "portable_spec.integrations.sglang.grammars",
        "portable_spec.integrations.sglang.guidance")))
    load("yes")
    out["bogus"] = [m for n, m in records if "PORTABLE_SPEC_SGLANG" in m]
    load("1")
    for name in {workers!r}:
        importlib.import_module(name)
    from portable_spec.integrations import sglang as plugin
    out["installed"] = plugin.is_installed()
    importlib.import_module("sglang.srt.speculative.eagle_worker_v2")
    out["on_lines"] = [m for n, m in records if n.startswith("sglang.portable_spec")]
    def bound(name):
        value = sys.modules[name].build_grammar_vocab_mask
        return hasattr(value, "__portable_spec_original__")
    out["bound"] = {{name: bound(name) for name in {workers!r}}}
    from sglang.srt.speculative import spec_utils
    out["bound"]["spec_utils"] = bound("sglang.srt.speculative.spec_utils")
    plugin.uninstall()
    out["after"] = {{name: bound(name) for name in {workers!r}}}
    out["after"]["spec_utils"] = bound("sglang.srt.speculative.spec_utils")
    print("RESULT" + json.dumps(out))
    """
)


def test_entry_point_in_a_fresh_process():
    """sglang's loader in a process that has not imported sglang's speculative code: the
    plugin waits for it, and the worker modules imported afterwards bind the plugin's build."""
    script = FRESH.format(here=HERE, workers=WORKERS)
    env = dict(os.environ, SGLANG_PLUGINS="")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1800
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT") :])
    assert out["off_modules"] == [], out["off_modules"]
    assert out["bogus"] and all("'yes'" in m for m in out["bogus"]), out["bogus"]
    assert out["installed"]
    assert out["on_lines"] == [
        "portable_spec: sglang 0.5.23 patched (3 functions replaced)",
        "portable_spec: sglang NGRAM drafting 0.5.23 patched (2 functions replaced)",
        "portable_spec: sglang EAGLE drafting 0.5.23 patched (8 functions replaced)",
    ]
    assert all(out["bound"].values()), out["bound"]
    assert not any(out["after"].values()), out["after"]


def test_worker_modules_imported_before_are_rebound():
    """Worker modules that imported the build before the plugin was installed (here, in this
    process) call the plugin's, and sglang's own again after ``uninstall()``."""
    import importlib

    from sglang.srt.speculative import spec_utils

    own = spec_utils.build_grammar_vocab_mask
    modules = [importlib.import_module(name) for name in WORKERS]
    assert all(m.build_grammar_vocab_mask is own for m in modules)
    with _sgl.plugin_on():
        ours = spec_utils.build_grammar_vocab_mask
        assert ours is not own
        assert all(m.build_grammar_vocab_mask is ours for m in modules)
    assert spec_utils.build_grammar_vocab_mask is own
    assert all(m.build_grammar_vocab_mask is own for m in modules)


def test_unknown_release_runs_sglangs_own(monkeypatch, caplog):
    """Another version, or a function whose source differs: one warning, nothing patched."""
    from sglang.srt.speculative import spec_utils

    own = spec_utils.build_grammar_vocab_mask
    monkeypatch.setattr(internals, "version", lambda: "0.5.24")
    with caplog.at_level(logging.WARNING, logger="sglang.portable_spec"):
        fresh = state.INTEGRATION.new_patch_set()
        assert not fresh.install() and not fresh.install()
    assert len(caplog.records) == 1 and "0.5.24" in caplog.records[0].getMessage()
    assert spec_utils.build_grammar_vocab_mask is own
    monkeypatch.undo()

    caplog.clear()
    revision = internals.REVISIONS["0.5.23"]
    changed = dict(revision.sources)
    changed[internals.BUILD] = "0" * 64
    monkeypatch.setitem(internals.REVISIONS, "0.5.23", type(revision)(revision.version, changed))
    with caplog.at_level(logging.WARNING, logger="sglang.portable_spec"):
        fresh = state.INTEGRATION.new_patch_set()
        assert not fresh.install()
    assert len(caplog.records) == 1
    assert "build_grammar_vocab_mask" in caplog.records[0].getMessage()
    assert spec_utils.build_grammar_vocab_mask is own


def test_modes_and_stats():
    with pytest.raises(ValueError, match="mode"):
        plugin.install("off")
    assert not plugin.is_installed()
    with _sgl.plugin_on("shadow"):
        assert plugin.is_installed()
        assert state.INTEGRATION.mode == "shadow"
    assert not plugin.is_installed()
    stats = plugin.integration_stats()
    assert {"steps", "built", "rows_compared", "rows_differing", "median_us"} <= set(stats)
    assert {"draft_steps", "draft_rows", "ngram_nodes_replaced", "forced_tokens_accepted"} <= set(
        stats
    )


def test_drafting_switch(monkeypatch):
    """``PORTABLE_SPEC_SGLANG_DRAFTING`` (read at install) and ``set_drafting``: off leaves
    sglang's own draft code; on and shadow patch it; a misspelt value is refused by name
    before anything is patched."""
    from sglang.srt.speculative import eagle_worker_v2, ngram_worker

    from portable_spec.integrations.sglang import state

    def patched() -> list[bool]:
        return [
            hasattr(eagle_worker_v2.EagleDraftWorker.draft, "__portable_spec_original__"),
            hasattr(ngram_worker.NGRAMWorker._prepare_draft_tokens, "__portable_spec_original__"),
        ]

    try:
        for value, expected in (
            ("0", [False, False]),
            ("", [True, True]),
            ("shadow", [True, True]),
        ):
            monkeypatch.setenv(state.DRAFTING_ENV_VAR, value)
            state.set_drafting_switch(None)  # read the variable again
            with _sgl.plugin_on():
                assert patched() == expected, value
                assert state.drafting_mode() == {"0": "off", "": "on", "shadow": "shadow"}[value]
            assert patched() == [False, False]
        monkeypatch.setenv(state.DRAFTING_ENV_VAR, "maybe")
        state.set_drafting_switch(None)
        with pytest.raises(ValueError, match=state.DRAFTING_ENV_VAR):
            plugin.install()
        assert not plugin.is_installed() and patched() == [False, False]
        state.set_drafting_switch("on")
        with _sgl.plugin_on():
            plugin.set_drafting(False)
            assert patched() == [False, False]
            plugin.set_drafting(True)
            assert patched() == [True, True]
        with _sgl.plugin_on("shadow"):
            assert state.drafting_mode() == "shadow"  # shadow mode never changes sglang's drafts
    finally:
        state.set_drafting_switch(None)


def _doc_block(marker: str) -> str:
    """The python block of docs/sglang.md that contains ``marker``."""
    doc = Path(HERE, "..", "..", "docs", "sglang.md").read_text()
    blocks = doc.split("```python\n")[1:]
    (block,) = [b.split("```")[0] for b in blocks if marker in b]
    return block


@pytest.mark.skipif(_sgl.DEVICE.type != "cpu", reason="what a CPU host needs")
def test_a_cpu_host_as_docs_sglang_md_says():
    """In a fresh process on this CPU host: without the CPU set-up, sglang's speculative modules
    do not import, and ``install()`` says so (the import that failed, never "a source that
    differs"); then docs/sglang.md's CPU block, as written, installs the plugin."""
    script = textwrap.dedent(
        """
        import logging, os
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("sglang.portable_spec").addHandler(handler)
        for name in ("TRITON_INTERPRET", "TORCHDYNAMO_DISABLE"):
            os.environ.pop(name, None)
        from portable_spec.integrations import sglang as plugin
        print("BARE", plugin.install(), lines)
        """
    ) + _doc_block("import conftest")
    root = os.path.dirname(os.path.dirname(HERE))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (bare,) = [line for line in done.stdout.splitlines() if line.startswith("BARE")]
    assert bare.startswith("BARE False"), bare
    assert "sglang.srt.speculative.spec_utils does not import here" in bare, bare
    assert "No module named 'torchvision'" in bare and "differ" not in bare, bare
