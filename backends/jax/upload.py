"""Upload a host bitmask with ``jax.device_put``, safe against JAX aliasing host memory."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from portable_spec.hostbuffers import HostBuffer, HostBufferPool

__all__ = ["mask_placement", "upload_mask"]


def mask_placement(array: jax.Array) -> Any:
    """Where the mask of a tree staged from ``array`` goes by default.

    A single-device array: that device. A ``NamedSharding`` over the batch axis: the same mesh
    axis over the mask's rows (rows are request-major, so each device gets its requests'
    rows). Replicated: replicated on the same mesh. Anything else: the default device.
    """
    sharding = array.sharding
    if isinstance(sharding, SingleDeviceSharding):
        return next(iter(sharding.device_set))
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        batch_axis = spec[0] if spec else None
        return NamedSharding(sharding.mesh, PartitionSpec(batch_axis))
    return None


def upload_mask(buffer: HostBuffer, placement: Any, pool: HostBufferPool) -> jax.Array:
    """``jax.device_put`` the mask to ``placement`` (a device, a ``Sharding`` or None).

    Non-blocking. The host buffer is lent to JAX, which may alias it (the CPU platform wraps
    suitably aligned numpy memory without copying) or read it during an asynchronous
    transfer; in both cases JAX holds the array alive, so the pool reuses the buffer only
    once JAX has let go of it. With a sharding that spans other processes' devices the
    buffer holds this process's rows (``jax.make_array_from_process_local_data``).
    """
    host: np.ndarray = pool.lend(buffer)
    if isinstance(placement, Sharding) and not placement.is_fully_addressable:
        return jax.make_array_from_process_local_data(placement, host)
    return jax.device_put(host, placement)
