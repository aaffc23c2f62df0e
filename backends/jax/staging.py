"""Stage tree arrays from ``jax.Array``: a device-side copy and ``copy_to_host_async`` now,
``np.asarray`` later.

Engines donate arrays to their next ``jit``: a tree array may be deleted between
``from_device`` and the build. So the host copy is not started from the caller's arrays but
from private device-side copies, made by one jitted computation per call (queued after the
computation producing the arrays, like any JAX operation); deleting or donating the caller's
arrays afterwards cannot touch them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["JaxStaged", "check_not_deleted", "local_shape", "stage_arrays"]


def check_not_deleted(array: jax.Array) -> None:
    """Raise ``ValueError`` if ``array`` was deleted (donated to a ``jit``, or ``.delete()``)."""
    if array.is_deleted():
        raise ValueError(
            f"the array ({array.dtype}{list(array.shape)}) was deleted (donated to a jit, or "
            "deleted) before GrammarTree.from_device; stage the tree before donating its arrays"
        )


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
    shards = [seen[k] for k in sorted(seen)]
    if array.ndim == 1 and sum(s.data.shape[0] for s in shards) < array.shape[0]:
        raise ValueError(
            "a 1-D tree array is one request's tree; it cannot be split over processes "
            "(make it [batch, nodes] and shard the batch axis)"
        )
    return shards


def local_shape(array: jax.Array) -> tuple[int, ...]:
    """Shape of the part of ``array`` this process reads: the whole array when it is fully
    addressable, else the addressable rows."""
    if array.is_fully_addressable or array.ndim == 0:
        return tuple(array.shape)
    rows = sum(s.data.shape[0] for s in _row_shards(array))
    return (rows, *array.shape[1:])


def _copy_all(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    # jnp.copy lowers to an identity in StableHLO; XLA then inserts a real copy because an
    # output may not alias a parameter that was not donated (tests check the buffers differ).
    return tuple(jnp.copy(a) for a in arrays)


_device_copy = jax.jit(_copy_all)


class JaxStaged:
    """Arrays whose device-to-host copies were started; ``resolve`` reads them."""

    __slots__ = ("_parts", "_result")

    def __init__(self, parts: list[tuple[str, Any]]) -> None:
        self._parts = parts
        self._result: list[np.ndarray] | None = None

    def resolve(self) -> list[np.ndarray]:
        """Block until the started copies have landed and return numpy arrays.

        ``np.asarray`` on an array whose ``copy_to_host_async`` was called reuses that copy;
        it waits for the copy only (and for the computations producing the array, which the
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

    What is read of each array:

    * fully replicated arrays (several devices holding the same data): one replica;
    * other fully addressable arrays: the whole array (JAX assembles the shards when read);
    * arrays not fully addressable (multi-process meshes): the addressable row blocks, which
      must be sharded along the batch axis only; the tree then holds this process's requests.

    That is first copied on the device by one jitted computation for all the arrays (one per
    set of devices when they live on different ones), so that the caller may donate or delete
    its arrays as soon as this returns; ``copy_to_host_async`` is then started on the copies.
    With multi-process arrays the copy is one program over the mesh: every process must stage
    its tree, as every process runs the engine's other programs.

    Raises:
        ValueError: an array was already deleted, or is split along its nodes axis over
            processes.
    """
    kinds: list[str] = []
    sources: list[jax.Array] = []
    for array in arrays:
        check_not_deleted(array)
        if not array.is_fully_addressable and array.ndim > 0:
            _row_shards(array)  # refuse arrays split along their nodes axis before copying
            kinds.append("rows")
            sources.append(array)
        elif array.ndim > 0 and array.is_fully_replicated and len(array.sharding.device_set) > 1:
            one = array.addressable_shards[0].data
            kinds.append("one")
            sources.append(one)
        else:
            kinds.append("whole")
            sources.append(array)
    groups: dict[frozenset[Any], list[int]] = {}
    for i, source in enumerate(sources):
        groups.setdefault(frozenset(source.sharding.device_set), []).append(i)
    copies: list[Any] = [None] * len(sources)
    for picked in groups.values():
        for i, copy in zip(picked, _device_copy(*(sources[i] for i in picked)), strict=True):
            copies[i] = copy
    parts: list[tuple[str, Any]] = []
    for kind, copy in zip(kinds, copies, strict=True):
        if kind == "rows":
            shards = _row_shards(copy)
            for shard in shards:
                shard.data.copy_to_host_async()
            parts.append((kind, shards))
        else:
            copy.copy_to_host_async()
            parts.append((kind, copy))
    return JaxStaged(parts)
