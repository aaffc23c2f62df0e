"""Draft trees on the host: the ``[batch, k]`` arrays a drafter hands over, selections of
drafted nodes, and tree shapes (parent ids to verify-tree links, chains grafted on)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec import native
from portable_spec.backend import Backend
from portable_spec.registry import backend_for
from portable_spec.tree import GrammarTree, as_int64, host_array, integer_info

__all__ = [
    "StagedColumns",
    "check_selection",
    "graft_chain",
    "links_from_parents",
    "selection_tree",
]


class StagedColumns:
    """``[batch, k]`` integer arrays (a level's parents and tokens, a selection), checked now
    and copied to the host without blocking (device arrays: the copy starts now).

    ``backend``: the framework the arrays most likely belong to (a DraftSession's), asked
    first; any other array's framework is looked up. numpy arrays need no look-up."""

    def __init__(
        self,
        arrays: Sequence[Any],
        names: Sequence[str],
        batch: int,
        backend: Backend | None = None,
    ) -> None:
        self.names = tuple(names)
        hosts: list[Any] = []
        infos = []
        for name, array in zip(names, arrays, strict=True):
            if isinstance(array, (list, tuple)):
                array = host_array(name, array)
            if type(array) is np.ndarray:
                if array.dtype.kind not in "iu":
                    raise TypeError(f"{name} must have an integer dtype, got {array.dtype}")
                shape = array.shape
                owner: Backend | None = None
            else:
                owner = backend if backend is not None and backend.owns(array) else None
                if owner is None:
                    owner = backend_for(array)
                host = host_view(owner, array)
                if host is not None:  # already in host memory (a CPU tensor): its numpy view
                    array, shape, owner = host, host.shape, None
                else:
                    shape = tuple(integer_info(name, array, owner).shape)
            given = tuple(shape)
            if len(shape) == 1 and batch == 1:
                shape = (1, shape[0])
            if len(shape) != 2 or shape[0] != batch:
                raise ValueError(
                    f"{name} must be [batch, k] with batch = {batch} (a 1-D [k] array for "
                    f"batch 1), got shape {given}"
                )
            if shape[1] < 1:
                raise ValueError(f"{name} has no columns (shape {given})")
            infos.append(shape)
            hosts.append((owner, array))
        if any(s != infos[0] for s in infos[1:]):
            raise ValueError(
                f"{names[0]} has shape {infos[0]} but {names[1]} has shape {infos[1]}; "
                "they must have the same shape"
            )
        self.shape: tuple[int, int] = infos[0]
        # started now, one staging per framework: the copies overlap what follows
        self._hosts: list[Any] = [array if owner is None else None for owner, array in hosts]
        self._handles: list[tuple[list[int], Any]] = []
        for owner in {id(o): o for o, _ in hosts if o is not None}.values():
            picked = [i for i, (o, _) in enumerate(hosts) if o is owner]
            self._handles.append((picked, owner.stage([hosts[i][1] for i in picked])))

    def resolve(self) -> list[np.ndarray]:
        """Wait for the copies; private C-contiguous int64 ``[batch, k]`` arrays."""
        hosts = list(self._hosts)
        for picked, handle in self._handles:
            for i, host in zip(picked, handle.resolve(), strict=True):
                hosts[i] = host
        return [as_int64(host, self.shape) for host in hosts]


def host_view(owner: Backend, array: Any) -> np.ndarray | None:
    """``array``'s numpy view when it is an integer array its framework keeps in host memory
    (a CPU torch tensor): nothing to stage, no copy to wait for. None otherwise (device arrays,
    JAX arrays, which may still be computing, anything the framework's checks refuse: the
    staging path checks those and names what is wrong)."""
    host = owner.host_view(array)
    if type(host) is not np.ndarray or host.dtype.kind not in "iu":
        return None
    return host


def check_selection(
    select: Any, batch: int, parents: np.ndarray, n: int, backend: Backend | None = None
) -> np.ndarray:
    """A verify-tree selection of drafted nodes, checked: int64 ``[batch, m]``.

    ``select``: int ``[batch, m]`` (``[m]`` for batch 1; host or device: waits for its copy),
    ``select[b, 0] = 0`` (the root), each entry a node below ``n`` or -1 (padding), no node
    twice, every selected node's parent selected. ``parents``: the drafted tree's int64
    ``[batch, capacity]`` parent ids; ``backend``: as for :class:`StagedColumns`.
    ``ValueError``/``TypeError`` naming the first bad entry.
    """
    (sel,) = StagedColumns((select,), ("select",), batch, backend).resolve()
    if native.selection_valid(sel, parents, n):  # else the checks below name the problem
        return sel
    if not (sel[:, 0] == 0).all():
        b = int(np.flatnonzero(sel[:, 0] != 0)[0])
        raise ValueError(f"select[{b}, 0] = {int(sel[b, 0])}: the first node must be 0, the root")
    bad = np.argwhere((sel < -1) | (sel >= n))
    if bad.size:
        b, j = (int(x) for x in bad[0])
        raise ValueError(
            f"select[{b}, {j}] = {int(sel[b, j])} is not a node (0..{n - 1}, or -1 for padding)"
        )
    batch, m = sel.shape
    rows_b = np.repeat(np.arange(batch), m)
    flat = sel.reshape(-1)
    chosen = flat >= 0
    count = np.bincount((rows_b * n + flat)[chosen], minlength=batch * n).reshape(batch, n)
    dup = np.argwhere(count > 1)
    if dup.size:
        b, v = (int(x) for x in dup[0])
        raise ValueError(f"select[{b}] names node {v} twice")
    parent = parents[rows_b, np.where(chosen, flat, 0)]
    orphan = chosen & (parent >= 0) & ~(count[rows_b, np.where(parent >= 0, parent, 0)] > 0)
    if orphan.any():
        i = int(np.flatnonzero(orphan)[0])
        b, j = divmod(i, m)
        raise ValueError(
            f"select[{b}, {j}] = {int(flat[i])} but its parent {int(parent[i])} is not "
            "selected: the selection must contain every selected node's ancestors"
        )
    return sel


def selection_tree(sel: np.ndarray, parents: np.ndarray, tokens: np.ndarray) -> GrammarTree:
    """The verify tree of a checked selection ``sel`` (int64 ``[batch, m]``, see
    :func:`check_selection`) of a drafted tree (``parents``/``tokens``: int64
    ``[batch, capacity]``) as a host :class:`GrammarTree`: children in selection order, draft
    tokens of the selected nodes (0 for padding)."""
    batch, m = sel.shape
    local = np.full((batch, parents.shape[1]), -1, dtype=np.int64)
    rows_b = np.arange(batch)[:, None]
    cols = np.broadcast_to(np.arange(m), (batch, m))
    chosen = sel >= 0
    local[np.broadcast_to(rows_b, (batch, m))[chosen], sel[chosen]] = cols[chosen]
    safe = np.where(chosen, sel, 0)
    parent = np.where(chosen, parents[rows_b, safe], -1)
    parent_local = np.where(parent >= 0, local[rows_b, np.where(parent >= 0, parent, 0)], -1)
    next_token, next_sibling = links_from_parents(parent_local)
    draft = np.where(chosen, tokens[rows_b, safe], 0)
    return GrammarTree.from_host(next_token, next_sibling, draft)


def links_from_parents(parents: Any) -> tuple[np.ndarray, np.ndarray]:
    """First-child / next-sibling links of trees given by parent ids.

    Args:
        parents: int ``[batch, nodes]`` (or ``[nodes]``): each node's parent node id, -1 for the
            root (node 0) and for padding. Children are linked in node order.

    Returns:
        ``(next_token, next_sibling)``: int64 arrays of the same shape, for
        :meth:`portable_spec.GrammarTree.from_host`. Vectorized (no loop over nodes).
    """
    p = np.asarray(parents, dtype=np.int64)
    one = p.ndim == 1
    if one:
        p = p[None, :]
    if p.ndim != 2:
        raise ValueError(f"parents must be [batch, nodes] or [nodes], got shape {p.shape}")
    batch, nodes = p.shape
    if ((p < -1) | (p >= nodes)).any():
        raise ValueError("parents must be node ids of the same tree or -1")
    next_token = np.full((batch, nodes), -1, dtype=np.int64)
    next_sibling = np.full((batch, nodes), -1, dtype=np.int64)
    b, v = np.nonzero(p >= 0)
    if b.size:
        par = p[b, v]
        order = np.lexsort((v, par, b))  # by request, parent, node
        b, v, par = b[order], v[order], par[order]
        first = np.ones(b.size, dtype=bool)
        first[1:] = (b[1:] != b[:-1]) | (par[1:] != par[:-1])
        next_token[b[first], par[first]] = v[first]
        follows = ~first[1:]
        next_sibling[b[:-1][follows], v[:-1][follows]] = v[1:][follows]
    if one:
        return next_token[0], next_sibling[0]
    return next_token, next_sibling


def graft_chain(
    parents: Sequence[int], tokens: Sequence[int], chain: Sequence[int], at: int = 0
) -> tuple[list[int], list[int], list[int]]:
    """Hang a draft chain (such as a forced continuation) below node ``at`` of a host tree.

    Args:
        parents: each node's parent (``parents[0] = -1``, every parent before its children).
        tokens: each node's token.
        chain: the tokens to add, in order.
        at: the node the chain starts below.

    Returns:
        ``(parents, tokens, chain_nodes)``: new lists with the chain added (nodes the tree
        already has along the chain, same parent and token, are reused rather than
        duplicated) and the node id of each chain token.
    """
    parents, tokens = [int(p) for p in parents], [int(t) for t in tokens]
    if len(parents) != len(tokens) or not parents or parents[0] != -1:
        raise ValueError("parents and tokens must have the same length >= 1, parents[0] = -1")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come before their children")
    if not 0 <= at < len(parents):
        raise ValueError(f"at = {at} is not a node (0..{len(parents) - 1})")
    children: dict[int, dict[int, int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, {}).setdefault(tokens[i], i)
    node, nodes = at, []
    for token in chain:
        token = int(token)
        child = children.get(node, {}).get(token)
        if child is None:
            child = len(parents)
            parents.append(node)
            tokens.append(token)
            children.setdefault(node, {})[token] = child
        nodes.append(child)
        node = child
    return parents, tokens, nodes
