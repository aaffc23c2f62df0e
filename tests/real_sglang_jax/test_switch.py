"""The integration's switch in sglang-jax's environment: the shipped .pth line imports nothing
while ``PORTABLE_SPEC_SGLANG_JAX`` is unset (or off), and with it set every new process waits
for sglang-jax's scheduler and installs the integration when the scheduler is created."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

pytest.importorskip("sgl_jax")

PTH = "portable_spec_sglang_jax.pth"


def run(code: str, value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PORTABLE_SPEC_SGLANG_JAX"}
    if value is not None:
        env["PORTABLE_SPEC_SGLANG_JAX"] = value
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


STARTUP = (
    "import json, sys; print(json.dumps(sorted(m for m in sys.modules "
    "if m.split('.')[0] in ('portable_spec', 'numpy', 'sgl_jax', 'jax'))))"
)


def test_the_pth_file_is_installed_in_site_packages():
    assert os.path.isfile(os.path.join(sysconfig.get_paths()["purelib"], PTH))


@pytest.mark.parametrize("value", [None, "", "0", "off"])
def test_unset_or_off_imports_nothing(value):
    assert run(STARTUP, value) == []


@pytest.mark.parametrize("value", ["1", " On "])
def test_set_waits_for_the_scheduler_and_installs_when_it_is_created(value):
    code = """
import json, sys
hooked = 'portable_spec.integrations.sglang_jax.hook' in sys.modules
from portable_spec.integrations import sglang_jax
from portable_spec.integrations.sglang_jax import hook
early = [hook.watching(), sglang_jax.is_installed()]
import sgl_jax.srt.managers.scheduler as scheduler
from sgl_jax.srt.speculative.eagle_info import EagleVerifyInput
patched = lambda: hasattr(EagleVerifyInput.sample, '__portable_spec_original__')
before = [sglang_jax.is_installed(), patched()]
try:
    scheduler.Scheduler(None, None)  # installs first, then sglang-jax's own __init__ fails
except Exception:
    pass
after = [sglang_jax.is_installed(), patched()]
sglang_jax.uninstall()  # also stops the switch: Scheduler.__init__ given back
own_init = not hasattr(scheduler.Scheduler.__init__, '__wrapped__')
print(json.dumps({'hooked': hooked, 'early': early, 'before': before, 'after': after,
                  'given back': [own_init, patched(), hook.watching()]}))
"""
    report = run(code, value)
    assert report == {
        "hooked": True,
        "early": [True, False],
        "before": [False, False],
        "after": [True, True],
        "given back": [True, False, False],
    }


@pytest.mark.parametrize("value", ["yes", "shadow"])
def test_any_other_value_is_refused_on_stderr_and_patches_nothing(value):
    env = dict(os.environ, PORTABLE_SPEC_SGLANG_JAX=value)
    code = (
        "import json; from portable_spec.integrations.sglang_jax import hook; "
        "print(json.dumps(hook.watching()))"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False
    refusals = [line for line in out.stderr.splitlines() if "PORTABLE_SPEC_SGLANG_JAX=" in line]
    assert len(refusals) == 1 and repr(value) in refusals[0], out.stderr[-2000:]
