"""Stage tree arrays from ``jax.Array``: ``copy_to_host_async`` now, ``np.asarray`` later."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["JaxStaged", "local_shape", "stage_arrays"]


def _row_shards(array: jax.Array) -> list[Any]:
    """The addressable shards holding distinct row blocks (replicas of a block dropped),
    sorted by their first row. Only sharding along axis 0 is accepted."""
    seen: dict[tuple[int, int], Any] = {}
    for shard in array.addressable_shards:
        index = shard.index
        for axis, part in enumerate(index[1:], start=1):
            if (part.start or 0) != 0 or (part.stop is not None and part.stop < array.shape[axis]):
                raise ValueError(
                    f"a tree array sharded along axis {axis} cannot be read per request; "
                    "shard tree arrays along the batch axis only (or replicate them)"
                )
        rows = index[0] if index else slice(None)
        key = (rows.start or 0, array.shape[0] if rows.stop is None else rows.stop)
        seen.setdefault(key, shard)
    return [seen[k] for k in sorted(seen)]


def local_shape(array: jax.Array) -> tuple[int, ...]:
    """Shape of the part of ``array`` this process reads: the whole array when it is fully
    addressable, else the addressable rows."""
    if array.is_fully_addressable or array.ndim == 0:
        return tuple(array.shape)
    rows = sum(s.data.shape[0] for s in _row_shards(array))
    return (rows, *array.shape[1:])


class JaxStaged:
    """Arrays whose device-to-host copies were started; ``resolve`` reads them."""

    __slots__ = ("_parts", "_result")

    def __init__(self, parts: list[tuple[str, Any]]) -> None:
        self._parts = parts
        self._result: list[np.ndarray] | None = None

    def resolve(self) -> list[np.ndarray]:
        """Block until the started copies have landed and return numpy arrays.

        ``np.asarray`` on an array whose ``copy_to_host_async`` was called reuses that copy;
        it waits for the copy only (and for the computation producing the array, which the
        copy itself waited for). Later calls return at once.
        """
        if self._result is None:
            result = []
            for kind, value in self._parts:
                if kind == "rows":
                    result.append(np.concatenate([np.asarray(s.data) for s in value], axis=0))
                else:
                    result.append(np.asarray(value))
            self._result = result
            self._parts = []
        return self._result


def stage_arrays(arrays: Sequence[jax.Array]) -> JaxStaged:
    """Start copying ``arrays`` to the host without blocking.

    * fully replicated arrays (several devices holding the same data): one replica is copied;
    * other fully addressable arrays: ``copy_to_host_async`` on the array (JAX assembles the
      shards when read);
    * arrays not fully addressable (multi-process meshes): the addressable row blocks, which
      must be sharded along the batch axis only; the tree then holds this process's requests.
    """
    parts: list[tuple[str, Any]] = []
    for array in arrays:
        if not array.is_fully_addressable and array.ndim > 0:
            shards = _row_shards(array)
            for shard in shards:
                shard.data.copy_to_host_async()
            parts.append(("rows", shards))
        elif array.ndim > 0 and array.is_fully_replicated and len(array.sharding.device_set) > 1:
            one = array.addressable_shards[0].data
            one.copy_to_host_async()
            parts.append(("one", one))
        else:
            array.copy_to_host_async()
            parts.append(("whole", array))
    return JaxStaged(parts)
