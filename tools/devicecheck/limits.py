"""How long a part may run before the check takes it for hung.

The limits guard against hangs; they never judge speed. A slow part (a busy host, a cold
first run that compiles kernels) must still pass, so:

- under ``--cpu`` (what CI and the test suite run) no part has a limit of its own: only the
  check's total limit applies (``--total``, :data:`DEFAULT_TOTAL_S`), which only a real hang
  reaches;
- on the GPU machine each part also has its own limit, so that a hung part leaves time for the
  parts after it: its typical quiet duration (``PartSpec.limit_s``, ``Suite.limit_s``) times
  the machine's slowdown measured at the start (:func:`calibrate`) times :data:`HEADROOM`,
  plus :data:`COLD_START_S` for a first run (CUDA context, Triton and XLA compilation).

``--limit PART=SECONDS`` overrides a part's limit in both modes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = [
    "COLD_START_S",
    "DEFAULT_TOTAL_S",
    "HEADROOM",
    "REFERENCE_S",
    "calibrate",
    "scaled_limit",
]

#: the check's total limit, s: a hang guard for the whole run
DEFAULT_TOTAL_S = 2700.0
#: a part's limit is this many times its typical duration on the calibrated machine
HEADROOM = 3.0
#: added to every part's limit on the GPU machine: compilation and warm-up of a first run
COLD_START_S = 120.0
#: seconds :func:`_workload` takes on one quiet core of a 2-core x86-64 development machine
REFERENCE_S = 0.05


def _workload() -> float:
    """A fixed mix of interpreter work and small numpy calls, like a part's host side;
    returns its wall time in seconds."""
    import numpy as np

    start = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i * i % 7
    a = np.arange(200_000, dtype=np.int64)
    for _ in range(20):
        a = (a * 3 + total) % 1_000_003
    return time.perf_counter() - start


def calibrate(rounds: int = 5) -> dict[str, Any]:
    """Time the fixed workload ``rounds`` times (blocks ~0.25 s on a quiet machine).

    Returns ``{"seconds": median s, "reference_s": REFERENCE_S, "factor": slowdown >= 1}``:
    how much slower than the reference machine this one runs now (a loaded host shows a
    larger factor). Only ever used to make limits longer.
    """
    seconds = statistics.median(_workload() for _ in range(max(1, rounds)))
    return {
        "seconds": round(seconds, 4),
        "reference_s": REFERENCE_S,
        "factor": round(max(1.0, seconds / REFERENCE_S), 2),
    }


def scaled_limit(typical_s: float, mode: str, factor: float) -> float | None:
    """A part's (or a correctness suite's) own limit in seconds, from its typical quiet
    duration: ``None`` under ``--cpu`` (only the total limit applies), else
    ``typical_s * factor * HEADROOM + COLD_START_S``."""
    if mode == "cpu":
        return None
    return typical_s * max(1.0, factor) * HEADROOM + COLD_START_S
