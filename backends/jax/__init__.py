"""The JAX backend: ``jax.Array`` on CPU, GPU or TPU, single-device, sharded or multi-process.

stage   one jitted device-side copy of the tree arrays (so the caller may donate them), then
        ``copy_to_host_async`` (one replica of replicated arrays, this process's row blocks
        of multi-process arrays)
layout  where each mask row goes: per row shard, its requests' rows then its padding
upload  ``jax.device_put`` to a device or ``Sharding`` (``make_array_from_process_local_data``
        across processes), lending the pooled host buffer
apply   one jitted function, inlined into the engine's ``jax.jit`` (see
        :func:`apply_vocab_mask_jax`)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from portable_spec.backend import ArrayInfo, Backend, MaskLayout
from portable_spec.hostbuffers import HostBuffer, HostBufferPool

from .apply import apply_vocab_mask_jax
from .placement import ProcessLocal, as_placement, mask_layout, mask_placement
from .staging import JaxStaged, check_not_deleted, local_shape, stage_arrays
from .upload import upload_mask

__all__ = ["JaxBackend", "apply_vocab_mask_jax"]


class JaxBackend(Backend):
    """Backend for ``jax.Array`` (registered as ``"jax"``)."""

    name = "jax"
    framework = "jax"

    def __init__(self) -> None:
        self.pool = HostBufferPool()

    def owns(self, obj: Any) -> bool:
        return isinstance(obj, (jax.Array, jax.Device, Sharding, ProcessLocal))

    def array_info(self, array: Any) -> ArrayInfo:
        """Shape (this process's rows of a multi-process array) and dtype.

        Raises ``ValueError`` for a deleted (donated) array."""
        check_not_deleted(array)
        dtype = array.dtype
        return ArrayInfo(local_shape(array), dtype, bool(jnp.issubdtype(dtype, jnp.integer)))

    def device_of(self, array: Any) -> Any:
        """See :func:`portable_spec.backends.jax.placement.mask_placement`."""
        return mask_placement(array)

    def stage(self, arrays: Sequence[Any]) -> JaxStaged:
        """Non-blocking: see :func:`portable_spec.backends.jax.staging.stage_arrays`."""
        return stage_arrays(arrays)

    def mask_layout(
        self,
        placement: Any,
        batch: int,
        nodes: int,
        vocab_size: int,
        row_capacity: int | None,
    ) -> MaskLayout:
        """Per row shard: its requests' rows, then its padding; see
        :func:`portable_spec.backends.jax.placement.mask_layout`."""
        return mask_layout(placement, batch, nodes, vocab_size, row_capacity)

    def acquire_host_mask(self, rows: int, words: int, device: Any = None) -> HostBuffer:
        return self.pool.acquire((rows, words), np.int32)

    def release_host_mask(self, buffer: HostBuffer) -> None:
        self.pool.release(buffer)

    def upload(self, buffer: HostBuffer, device: Any = None) -> jax.Array:
        """Non-blocking ``jax.device_put``; see
        :func:`portable_spec.backends.jax.upload.upload_mask`. Device strings name this
        process's devices (``jax.local_devices``)."""
        try:
            placement = as_placement(device)
        except BaseException:
            self.pool.release(buffer)
            raise
        return upload_mask(buffer, placement, self.pool)

    def apply_vocab_mask(self, logits: Any, mask: Any) -> jax.Array:
        """Functional (returns a new array); one jitted computation, inlined inside
        ``jax.jit``."""
        return apply_vocab_mask_jax(logits, mask)

    def describe(self) -> str:
        devices = jax.devices()
        return f"jax {jax.__version__} ({len(devices)} x {devices[0].platform})"
