"""Applies tests/real_sglang_jax/cpu_harness.py in every process of an engine run when
PORTABLE_SPEC_SGLANG_JAX_CPU_HARNESS=1 (this directory on PYTHONPATH)."""

import os
import sys

if os.environ.get("PORTABLE_SPEC_SGLANG_JAX_CPU_HARNESS") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cpu_harness

    cpu_harness.activate()
