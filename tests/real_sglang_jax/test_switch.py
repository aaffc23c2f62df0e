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


def test_set_waits_for_the_scheduler_and_installs_when_it_is_created():
    code = """
import json, sys
hooked = 'portable_spec.integrations.sglang_jax_hook' in sys.modules
from portable_spec.integrations import sglang_jax, sglang_jax_hook
early = [sglang_jax_hook.watching(), sglang_jax.installed()]
import sgl_jax.srt.managers.scheduler as scheduler
from sgl_jax.srt.speculative.eagle_info import EagleVerifyInput
before = [sglang_jax.installed(), hasattr(EagleVerifyInput.sample, '_portable_spec_original')]
try:
    scheduler.Scheduler(None, None)  # installs first, then sglang-jax's own __init__ fails
except Exception:
    pass
after = [sglang_jax.installed(), hasattr(EagleVerifyInput.sample, '_portable_spec_original')]
print(json.dumps({'hooked': hooked, 'early': early, 'before': before, 'after': after}))
"""
    report = run(code, "1")
    assert report == {
        "hooked": True,
        "early": [True, False],
        "before": [False, False],
        "after": [True, True],
    }
