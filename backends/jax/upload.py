"""Upload a host bitmask with ``jax.device_put``, safe against JAX aliasing host memory."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from portable_spec.hostbuffers import HostBuffer, HostBufferPool

from .placement import ProcessLocal

__all__ = ["upload_mask"]


def upload_mask(buffer: HostBuffer, placement: Any, pool: HostBufferPool) -> jax.Array:
    """Put the mask in ``buffer`` on ``placement`` (a device, a ``Sharding``, a
    :class:`~portable_spec.backends.jax.placement.ProcessLocal` or None) without blocking.

    The host buffer is lent to JAX, which may alias it (the CPU platform wraps suitably
    aligned numpy memory without copying) or read it during an asynchronous transfer; in both
    cases JAX holds the array alive, so the pool reuses the buffer only once JAX has let go of
    it. With a placement that spans other processes' devices the buffer holds this process's
    rows, and the result is the global array (``jax.make_array_from_process_local_data``).
    """
    host: np.ndarray = pool.lend(buffer)
    if isinstance(placement, ProcessLocal):
        return jax.make_array_from_process_local_data(
            placement.sharding, host, placement.global_shape
        )
    if isinstance(placement, Sharding) and not placement.is_fully_addressable:
        return jax.make_array_from_process_local_data(placement, host)
    return jax.device_put(host, placement)
