"""Upload a host bitmask with ``jax.device_put``, safe against JAX aliasing host memory."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from portable_spec.hostbuffers import HostBuffer, HostBufferPool
from portable_spec.masks import CompactMask, rebase_compact

from .placement import ProcessLocal

__all__ = ["upload_compact", "upload_mask"]


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


def upload_compact(
    buffer: HostBuffer, mask: CompactMask, placement: Any, pool: HostBufferPool
) -> CompactMask:
    """Put a host compact mask (views of ``buffer``) on ``placement`` without blocking.

    The index and the bits go by one ``jax.device_put`` each, from the lent block (the same
    aliasing rule as :func:`upload_mask`). Without ``max_rows`` exactly the ``K`` listed rows
    travel; with it the whole ``[max_rows, words]`` (XLA needs the fixed shape; the padding
    rows hold whatever the block held). A placement that splits rows over devices gets the
    compact mask replicated on those devices (row indices are global).
    """
    try:
        if isinstance(placement, ProcessLocal) or (
            isinstance(placement, Sharding) and not placement.is_fully_addressable
        ):
            raise ValueError("a compact mask cannot span several processes")
        target = _replicated(placement)
    except BaseException:
        pool.release(buffer)
        raise
    host = rebase_compact(mask, buffer.array, pool.lend(buffer))
    rows, bits = jax.device_put((host.rows, host.bits), target)
    return CompactMask(rows, bits, mask.num_rows, mask.count)


def _replicated(placement: Any) -> Any:
    """``placement``, or a replicated sharding over its devices if it splits arrays."""
    if not isinstance(placement, Sharding) or len(placement.device_set) == 1:
        return placement
    if placement.is_fully_replicated:
        return placement
    if isinstance(placement, NamedSharding):
        return NamedSharding(placement.mesh, PartitionSpec())
    devices = sorted(placement.device_set, key=lambda d: d.id)
    return NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())
