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

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from portable_spec.backend import ArrayInfo, Backend, MaskLayout
from portable_spec.hostbuffers import HostBuffer, HostBufferPool
from portable_spec.masks import CompactMask, _register_pytree

from .apply import apply_compact_mask_jax, apply_vocab_mask_jax
from .placement import ProcessLocal, as_placement, mask_layout, mask_placement
from .staging import JaxStaged, check_not_deleted, local_shape, stage_arrays
from .upload import upload_compact, upload_mask

__all__ = ["JaxBackend", "apply_compact_mask_jax", "apply_vocab_mask_jax"]

_register_pytree()  # CompactMask of jax.Arrays passes into jax.jit


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

    def apply_vocab_mask(self, logits: Any, mask: Any, vocab_size: int | None = None) -> jax.Array:
        """Functional (returns a new array); one jitted computation, inlined inside
        ``jax.jit`` (``vocab_size`` is static)."""
        if vocab_size is None:
            return apply_vocab_mask_jax(logits, mask)
        return apply_vocab_mask_jax(logits, mask, vocab_size=_static_int(vocab_size))

    def upload_compact(self, buffer: HostBuffer, mask: CompactMask, device: Any = None) -> Any:
        """``jax.device_put`` of the index and the bits (replicated over the devices of a
        placement that splits rows); see
        :func:`portable_spec.backends.jax.upload.upload_compact`."""
        try:
            placement = as_placement(device)
        except BaseException:
            self.pool.release(buffer)
            raise
        return upload_compact(buffer, mask, placement, self.pool)

    def apply_compact_mask(
        self, logits: Any, mask: CompactMask, vocab_size: int | None = None
    ) -> jax.Array:
        """Functional; pure and jit-traceable (see :func:`apply_compact_mask_jax`)."""
        return apply_compact_mask_jax(logits, mask, _static_int(vocab_size))

    def capture_context(self, device: Any = None) -> Callable[[], AbstractContextManager[Any]]:
        """The caller's default device (``jax.default_device`` is per thread), for a mask whose
        placement is JAX's default."""
        default = jax.config.jax_default_device
        if default is None or device is not None:
            return nullcontext
        return lambda: jax.default_device(default)

    def describe(self) -> str:
        devices = jax.devices()
        return f"jax {jax.__version__} ({len(devices)} x {devices[0].platform})"


def _static_int(vocab_size: Any) -> Any:
    """``vocab_size`` as a Python int (a static argument of the jitted apply); other values
    are passed on for :func:`portable_spec.masks.apply_columns` to refuse."""
    if isinstance(vocab_size, (int, np.integer)) and not isinstance(vocab_size, bool):
        return int(vocab_size)
    return vocab_size
