"""Where a JAX mask goes: device strings, the default placement of a tree's mask, and the row
layout of a mask whose rows are split over devices (and processes)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from portable_spec.backend import MaskLayout

__all__ = ["ProcessLocal", "as_placement", "mask_layout", "mask_placement", "resolve_device"]


@dataclass(frozen=True)
class ProcessLocal:
    """A placement spanning several processes, with the global shape of the mask: the host
    buffer holds this process's rows (``jax.make_array_from_process_local_data``)."""

    sharding: Sharding
    global_shape: tuple[int, int]


def resolve_device(name: str) -> jax.Device:
    """``"cpu"``, ``"gpu:1"``, ``"tpu"``... -> one of *this process's* devices.

    The index counts ``jax.local_devices(backend=platform)``: on a multi-process slice
    ``"tpu:0"`` is this host's first TPU core, never another host's.
    """
    platform, _, index = name.partition(":")
    try:
        number = int(index) if index else 0
    except ValueError:
        raise ValueError(
            f"device {name!r}: expected 'platform' or 'platform:index' (e.g. 'tpu:1')"
        ) from None
    try:
        devices = jax.local_devices(backend=platform)
    except RuntimeError as exc:
        raise ValueError(f"device {name!r}: no {platform!r} platform here ({exc})") from None
    if not 0 <= number < len(devices):
        raise ValueError(
            f"device {name!r}: this process has {len(devices)} local {platform} device(s)"
        )
    return devices[number]


def as_placement(device: Any) -> Any:
    """Normalise ``device=`` for the JAX backend: ``None`` (JAX's default device), a
    ``jax.Device``, a ``Sharding`` or a :class:`ProcessLocal`; strings name local devices."""
    if device is None or isinstance(device, (jax.Device, Sharding, ProcessLocal)):
        return device
    if isinstance(device, str):
        return resolve_device(device)
    raise TypeError(
        f"the JAX backend places masks on a jax.Device, a jax.sharding.Sharding or a device "
        f"string, got {type(device).__name__}"
    )


# -- the default placement of a tree's mask -----------------------------------------------------
def mask_placement(array: jax.Array) -> Any:
    """Where the mask of a tree staged from ``array`` goes by default.

    One device: that device. Split along the batch axis (any ``Sharding``): the mask's rows
    split the same way over the same devices (rows are request-major, so every device gets its
    own requests' rows). Replicated, or split along the nodes axis only: replicated over the
    same devices.

    Raises:
        ValueError: the split cannot be mirrored (uneven batch blocks).
    """
    return _mask_placement(array.sharding, tuple(array.shape))


@lru_cache(maxsize=256)
def _mask_placement(sharding: Sharding, shape: tuple[int, ...]) -> Any:
    if isinstance(sharding, SingleDeviceSharding) or len(sharding.device_set) == 1:
        return next(iter(sharding.device_set))
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        batch_axis = spec[0] if spec else None
        return NamedSharding(sharding.mesh, PartitionSpec(batch_axis))
    # any other Sharding: group the devices by the block of axis 0 they hold
    indices = sharding.devices_indices_map(shape)
    blocks: dict[tuple[int, int], list[jax.Device]] = {}
    for device, index in indices.items():
        rows = index[0] if index else slice(None)
        key = (rows.start or 0, shape[0] if rows.stop is None else rows.stop)
        blocks.setdefault(key, []).append(device)
    groups = [blocks[k] for k in sorted(blocks)]
    sizes = {k[1] - k[0] for k in blocks}
    if len(sizes) != 1 or len({len(g) for g in groups}) != 1:
        raise ValueError(
            f"the tree arrays' sharding {sharding} splits the batch axis unevenly; a mask "
            "cannot mirror it (pass device= a Sharding for the mask)"
        )
    mesh = Mesh(np.array(groups, dtype=object), ("rows", "replicas"))
    return NamedSharding(mesh, PartitionSpec("rows" if len(groups) > 1 else None))


# -- the layout of a mask under a placement -------------------------------------------------------
@dataclass(frozen=True)
class _Split:
    rows: int  # row blocks of the whole mask
    local_rows: int  # distinct row blocks on this process's devices
    columns: int  # blocks of the words axis


@lru_cache(maxsize=256)
def _split(sharding: Sharding) -> _Split:
    """How ``sharding`` cuts a 2-D mask, found on a probe shape every split divides."""
    n = len(sharding.device_set)
    try:
        check = getattr(sharding, "check_compatible_aval", None)
        if check is not None:
            check((n, n))
        indices = sharding.devices_indices_map((n, n))
    except Exception as exc:  # a sharding for arrays of another rank
        raise ValueError(
            f"the mask is a 2-D [rows, words] array; {sharding} cannot place it ({exc})"
        ) from None
    local = sharding.addressable_devices
    row_blocks, local_blocks, column_blocks = set(), set(), set()
    for device, index in indices.items():
        rows, columns = (*index, slice(None), slice(None))[:2]
        row_blocks.add((rows.start, rows.stop))
        column_blocks.add((columns.start, columns.stop))
        if device in local:
            local_blocks.add((rows.start, rows.stop))
    return _Split(len(row_blocks), len(local_blocks), len(column_blocks))


def mask_layout(
    placement: Any, batch: int, nodes: int, vocab_size: int, capacity: int | None
) -> MaskLayout:
    """The JAX backend's :meth:`portable_spec.backend.Backend.mask_layout`.

    With a placement that splits the mask's rows into ``parts`` blocks, ``capacity`` (the
    global row count) gives each block ``capacity / parts`` rows: its requests' rows first,
    then padding. This process's host buffer holds its own blocks, in row order (the core
    builds the rows contiguously, then moves each block to its place: one pass over the built
    rows, about 1 ms per 16 MiB on the 2-core machine, and none when the batch fills the
    capacity). A placement
    that also splits the words axis into ``k`` blocks needs ``vocab_size % (32 * k) == 0``,
    so that each device's mask words cover exactly its slice of vocab-sharded logits.
    """
    placement = as_placement(placement)
    rows = batch * nodes
    words = -(-vocab_size // 32)
    if isinstance(placement, ProcessLocal):
        placement = placement.sharding
    if not isinstance(placement, Sharding) or len(placement.device_set) == 1:
        host = rows if capacity is None else capacity
        return MaskLayout(host, ((0, rows, 0),), placement)
    split = _split(placement)
    if split.columns > 1 and vocab_size % (32 * split.columns):
        raise ValueError(
            f"{placement} splits the mask's words axis into {split.columns} parts, which "
            f"needs (vocab_size / {split.columns}) % 32 == 0 so that each part's words cover "
            f"its slice of the logits; vocab_size = {vocab_size} does not. Shard the mask "
            "along its rows only (its words are then replicated), or pad the vocabulary"
        )
    if split.local_rows == 0:
        raise ValueError(f"{placement} places no part of the mask on this process's devices")
    parts, local = split.rows, split.local_rows
    if capacity is None:
        if rows % local:
            raise ValueError(
                f"the mask's {rows} rows (batch * nodes) cannot be split evenly over the "
                f"{local} row shards of {placement}; pass row_capacity (a multiple of "
                f"{parts}) to pad every shard"
            )
        blocks = ((0, rows, 0),)
        host, global_rows = rows, rows // local * parts
    else:
        if capacity % parts:
            raise ValueError(
                f"row_capacity = {capacity} cannot be split evenly over the {parts} row "
                f"shards of {placement}; use a multiple of {parts}"
            )
        if batch % local:
            raise ValueError(
                f"the batch of {batch} requests cannot be split evenly over the {local} row "
                f"shards of {placement} (each shard holds its own requests' rows)"
            )
        per_part, own = capacity // parts, rows // local
        if per_part < own:
            raise ValueError(
                f"row_capacity = {capacity} gives each of the {parts} row shards {per_part} "
                f"rows, fewer than its {batch // local} requests' {own} rows; use at least "
                f"{own * parts}"
            )
        blocks = tuple((i * own, own, i * per_part) for i in range(local))
        host, global_rows = local * per_part, capacity
    if placement.is_fully_addressable:
        return MaskLayout(host, blocks, placement)
    target = ProcessLocal(placement, (global_rows, words))
    return MaskLayout(host, blocks, target, collective=True)
