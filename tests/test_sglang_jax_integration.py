"""The sglang-jax integration's tables and switch, where sglang-jax is not installed (its patches
run against sglang-jax's own code in tests/real_sglang_jax, scripts/test-sglang-jax.sh)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from portable_spec.integrations import sglang_jax as integration
from portable_spec.integrations.sglang_jax import fixes, hook, internals, patches, state

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = (ROOT / "docs" / "sglang-jax-upstream.md").read_text()
PTH = ROOT / "portable_spec" / "integrations" / "sglang_jax" / "portable_spec_sglang_jax.pth"

pytestmark = pytest.mark.skipif(
    "sgl_jax" in sys.modules or bool(os.environ.get("PORTABLE_SPEC_SGLANG_JAX")),
    reason="these tests want a process without sglang-jax and without the switch",
)


def sections() -> dict[str, str]:
    """Heading -> text of every ``###`` entry of docs/sglang-jax-upstream.md."""
    parts = re.split(r"^### (.+)$", UPSTREAM, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_fix_is_an_entry_of_the_upstream_notes_that_names_it():
    entries = sections()
    names = {id(v): k for k, v in vars(fixes).items() if k.isupper() and k != "FIXES"}
    for patch in fixes.FIXES:
        assert patch.fixes in entries, patch.fixes
        assert f"`fixes.{names[id(patch)]}`" in entries[patch.fixes], patch.fixes
    first = next(iter(entries))  # the mask itself, and no fix
    assert all(p.fixes != first for p in fixes.FIXES) and "fixes." not in entries[first]


def test_every_entry_naming_a_fix_has_that_patch():
    named = set(re.findall(r"`fixes\.([A-Z_]+)`", UPSTREAM))
    assert named == {k for k, v in vars(fixes).items() if v in fixes.FIXES}


def test_the_table_installs_everything_at_the_known_revision():
    patch_set = state.INTEGRATION.patch_set()
    (label,) = internals.REVISIONS
    replaced = tuple(p for p in patches.PATCHES if p.make is not None)
    assert patch_set.installs(label) == replaced
    assert set(internals.REVISIONS[label].sources) == {p.target for p in patches.PATCHES}
    assert patches.PATCHES[: len(fixes.FIXES)] == fixes.FIXES  # fixes innermost


def test_without_sglang_jax_install_is_false_without_a_word(caplog):
    with caplog.at_level(logging.DEBUG, logger="sgl_jax.portable_spec"):
        assert integration.install() is False
    assert not integration.is_installed() and not caplog.records
    snapshot = integration.integration_stats()
    assert snapshot["masked_steps"] == 0 and snapshot["waited_s"] == []
    assert {"median_us", "samples"} <= set(snapshot)


@pytest.mark.parametrize("mode", ["shadow", "off", "1"])
def test_install_has_no_other_mode(mode):
    with pytest.raises(ValueError, match="takes mode 'on' \\(sglang-jax has no shadow mode\\)"):
        integration.install(mode)


@pytest.mark.parametrize("value,on", [("1", True), ("on", True), ("0", False), ("", False)])
def test_the_switch(value, on):
    try:
        assert hook.activate_from_env({integration.ENV_VAR: value}) is on
        assert hook.watching() is on  # waits for sglang-jax's scheduler module
    finally:
        hook.deactivate()
    assert not hook.watching()


@pytest.mark.parametrize("value", ["yes", "shadow", "true"])
def test_any_other_value_is_one_line_on_stderr(value, capsys):
    for _ in range(2):  # also when the .pth line runs twice (site-packages through a link)
        assert hook.activate_from_env({integration.ENV_VAR: value}) is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"PORTABLE_SPEC_SGLANG_JAX={value!r}" in err[0]
    assert not hook.watching()


def run_pth_line(value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != integration.ENV_VAR}
    if value is not None:
        env[integration.ENV_VAR] = value
    code = "\n".join(
        [
            "import sys",
            PTH.read_text().strip(),  # what Python runs at the start of every process
            "imported = 'portable_spec' in sys.modules",
            "import json",
            "from portable_spec.integrations.sglang_jax import hook",
            "print(json.dumps({'imported': imported, 'watching': hook.watching()}))",
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("value", [None, "", "0", "off", " OFF "])
def test_the_pth_line_imports_nothing_while_off(value):
    assert run_pth_line(value) == {"imported": False, "watching": False}


def test_the_pth_line_activates_the_hook_when_on():
    assert run_pth_line("1") == {"imported": True, "watching": True}
