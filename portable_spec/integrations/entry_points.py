"""The functions engines load through entry points (``pyproject.toml``): what each switches
on, in one place.

vLLM loads ``vllm.general_plugins`` in each of its processes at start-up, on every platform:
its CUDA and CPU engines, and tpu-inference (vLLM's TPU platform), whose runner masks the
logits with vLLM's rows. One variable, ``PORTABLE_SPEC_VLLM``, switches both integrations.
Nothing here imports an engine while the variable is off.
"""

from __future__ import annotations

from portable_spec.integrations.face import read_mode

__all__ = ["vllm_general_plugins"]


def vllm_general_plugins() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: reads ``PORTABLE_SPEC_VLLM``.

    * ``1``/``on``: vLLM's ``grammar_bitmask`` is built by the library
      (:func:`portable_spec.integrations.vllm.install`), and where tpu-inference is installed
      its runner is patched to apply those rows per logits row as soon as tpu-inference imports
      it (:func:`portable_spec.integrations.tpu_inference.install_on_import`);
    * ``shadow``: vLLM's patch only, in shadow mode (vLLM's rows are used: tpu-inference's
      runner is left alone);
    * unset, empty, ``0``, ``off``: nothing (no engine module is imported).

    Raises ValueError naming the variable for any other value. Idempotent: vLLM may load its
    plugins more than once per process.
    """
    from portable_spec.integrations import vllm

    mode = read_mode(vllm.ENV_VAR)
    if mode == "off":
        return
    vllm.install(mode)
    if mode == "on":
        from portable_spec.integrations import tpu_inference

        tpu_inference.install_on_import()
