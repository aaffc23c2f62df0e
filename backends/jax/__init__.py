"""The JAX backend: ``jax.Array`` on CPU, GPU or TPU, single-device or sharded.

stage   ``copy_to_host_async`` on each array (one replica of replicated arrays)
upload  ``jax.device_put`` to a device or ``Sharding``, lending the pooled host buffer
apply   a pure function for the engine's ``jax.jit`` (see :func:`apply_vocab_mask_jax`)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from portable_spec.backend import ArrayInfo, Backend
from portable_spec.hostbuffers import HostBuffer, HostBufferPool

from .apply import apply_vocab_mask_jax
from .staging import JaxStaged, local_shape, stage_arrays
from .upload import mask_placement, upload_mask

__all__ = ["JaxBackend", "apply_vocab_mask_jax"]


class JaxBackend(Backend):
    """Backend for ``jax.Array`` (registered as ``"jax"``)."""

    name = "jax"
    framework = "jax"

    def __init__(self) -> None:
        self.pool = HostBufferPool()

    def owns(self, obj: Any) -> bool:
        return isinstance(obj, (jax.Array, jax.Device, Sharding))

    def array_info(self, array: Any) -> ArrayInfo:
        dtype = array.dtype
        return ArrayInfo(local_shape(array), dtype, bool(jnp.issubdtype(dtype, jnp.integer)))

    def device_of(self, array: Any) -> Any:
        return mask_placement(array)

    def stage(self, arrays: Sequence[Any]) -> JaxStaged:
        """Non-blocking: see :func:`portable_spec.backends.jax.staging.stage_arrays`."""
        return stage_arrays(arrays)

    def acquire_host_mask(self, rows: int, words: int, device: Any = None) -> HostBuffer:
        return self.pool.acquire((rows, words), np.int32)

    def release_host_mask(self, buffer: HostBuffer) -> None:
        self.pool.release(buffer)

    def upload(self, buffer: HostBuffer, device: Any = None) -> jax.Array:
        """Non-blocking ``jax.device_put``; see
        :func:`portable_spec.backends.jax.upload.upload_mask`."""
        if isinstance(device, str):
            device = _device_from_string(device)
        return upload_mask(buffer, device, self.pool)

    def apply_vocab_mask(self, logits: Any, mask: Any) -> jax.Array:
        """Functional (returns a new array); traceable inside ``jax.jit``."""
        return apply_vocab_mask_jax(logits, mask)

    def describe(self) -> str:
        devices = jax.devices()
        return f"jax {jax.__version__} ({len(devices)} x {devices[0].platform})"


def _device_from_string(name: str) -> jax.Device:
    """``"cpu"``, ``"gpu:1"``, ``"tpu"``... -> a ``jax.Device``."""
    platform, _, index = name.partition(":")
    devices = jax.devices(platform)
    return devices[int(index) if index else 0]
