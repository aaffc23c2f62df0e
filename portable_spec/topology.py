"""Validation of verify-tree links and the parent structure the builder needs.

A tree is stored per request as first-child / next-sibling links over local node indices::

    retrieve_next_token[b, i]    first child of node i, or -1
    retrieve_next_sibling[b, i]  next sibling of node i, or -1

Two implementations of the same checks, chosen by size:

* small batches (``batch * nodes <= SMALL_TREE_ROWS``) are checked in plain Python over lists,
  where numpy's per-call cost (about a microsecond) would dominate;
* larger ones are checked with a fixed number of vectorized numpy calls for the whole batch,
  using pointer jumping (``ceil(log2(nodes))`` rounds of ``p = p[p]``) for cycles and parents.

Neither walks links blindly: every loop is bounded by the node count, so malformed input
(cycles, huge depths) cannot hang. Both raise the same ``ValueError`` messages.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SMALL_TREE_ROWS", "Topology", "chain_topology", "validate_links"]

# Up to this many rows (batch * nodes) the list-based checks are faster than numpy's.
SMALL_TREE_ROWS = 256

_NT, _NS = "retrieve_next_token", "retrieve_next_sibling"


class Topology:
    """Parent structure of a validated ``[batch, nodes]`` tree.

    Global row ``r = b * nodes + j`` is node ``j`` of request ``b``.

    Attributes:
        parent: int64 ``[batch * nodes]``; parent row of each row, -1 for roots and for nodes
            no link reaches.
        reachable: bool ``[batch * nodes]``; the node is the root or hangs below it.
        orders: small trees only: per request, its reachable nodes with every parent before
            its children (breadth-first), as local indices.
        local_parents: small trees only: per request, the local parent of each node (-1 for
            the root and unreachable nodes).
        ancestor_jumps: large trees only: int64 arrays ``[batch * nodes + 1]``; entry ``k``
            maps every row to its ``2**k``-th ancestor, index ``batch * nodes`` being a
            sentinel (its own ancestor, the ancestor of roots). ``v &= v[jump]`` over them
            ANDs a per-row flag along every root path.
    """

    __slots__ = (
        "_parent",
        "_reachable",
        "ancestor_jumps",
        "batch",
        "local_parents",
        "nodes",
        "orders",
    )

    def __init__(
        self,
        batch: int,
        nodes: int,
        *,
        parent: np.ndarray | None = None,
        reachable: np.ndarray | None = None,
        orders: tuple[list[int], ...] | None = None,
        local_parents: tuple[list[int], ...] | None = None,
        ancestor_jumps: tuple[np.ndarray, ...] | None = None,
    ) -> None:
        self.batch = batch
        self.nodes = nodes
        self._parent = parent
        self._reachable = reachable
        self.orders = orders
        self.local_parents = local_parents
        self.ancestor_jumps = ancestor_jumps

    @property
    def small(self) -> bool:
        """Whether the list form (``orders``/``local_parents``) is present."""
        return self.orders is not None

    @property
    def parent(self) -> np.ndarray:
        if self._parent is None:
            assert self.local_parents is not None
            local = np.array(self.local_parents, dtype=np.int64).reshape(-1)
            offsets = np.repeat(np.arange(0, self.batch * self.nodes, self.nodes), self.nodes)
            self._parent = np.where(local >= 0, local + offsets, -1)
        return self._parent

    @property
    def reachable(self) -> np.ndarray:
        if self._reachable is None:
            assert self.orders is not None
            reachable = np.zeros(self.batch * self.nodes, dtype=bool)
            for b, order in enumerate(self.orders):
                reachable[b * self.nodes + np.asarray(order, dtype=np.int64)] = True
            self._reachable = reachable
        return self._reachable

    def request_parents(self, b: int) -> list[int]:
        """Local parent of each node of request ``b`` (-1: root or unreachable)."""
        if self.local_parents is not None:
            return self.local_parents[b]
        rows = self.parent[b * self.nodes : (b + 1) * self.nodes]
        return np.where(rows >= 0, rows - b * self.nodes, -1).tolist()

    def __repr__(self) -> str:
        form = "lists" if self.small else "arrays"
        return f"Topology(batch={self.batch}, nodes={self.nodes}, {form})"


def validate_links(next_token: np.ndarray, next_sibling: np.ndarray) -> Topology:
    """Check the links of a ``[batch, nodes]`` int64 tree and derive its parents.

    Raises ``ValueError`` naming the request and node for: links outside ``[-1, nodes)``, the
    root linked as anyone's child or sibling, a sibling of the root, a node with two parents
    (two links to it), and cycles (including self-links and loops through siblings). Nodes no
    link reaches are allowed (padding); they are reported in ``reachable``.
    """
    batch, nodes = next_token.shape
    if batch * nodes <= SMALL_TREE_ROWS:
        return _validate_lists(next_token, next_sibling)
    return _validate_numpy(next_token, next_sibling)


# -- errors (shared by both implementations; computed only once something is wrong) ----------
def _explain_request(b: int, nt: list[int], ns: list[int]) -> None:
    """Raise the first problem of request ``b`` (links as lists) if it has one.

    Order: links out of range, links to the root, a sibling of the root, two links into one
    node; cycles are found by the walk in :func:`_walk_request`.
    """
    nodes = len(nt)
    for name, links in ((_NT, nt), (_NS, ns)):
        for j, v in enumerate(links):
            if not -1 <= v < nodes:
                raise ValueError(
                    f"{name}[{b}, {j}] = {v} is outside [-1, {nodes}) "
                    f"(links are local node indices, -1 for none)"
                )
    for name, links in ((_NT, nt), (_NS, ns)):
        if 0 in links:
            raise ValueError(
                f"{name}[{b}, {links.index(0)}] = 0 links the root (node 0) into the tree; "
                "node 0 is the committed token and has no parent"
            )
    if ns[0] != -1:
        raise ValueError(f"{_NS}[{b}, 0] = {ns[0]}: the root (node 0) cannot have a sibling")
    seen: set[int] = set()
    for v in [*nt, *ns]:
        if v > 0 and v in seen:
            holders = [
                f"{name}[{b}, {k}]"
                for name, links in ((_NT, nt), (_NS, ns))
                for k, x in enumerate(links)
                if x == v
            ]
            raise ValueError(
                f"node {v} of request {b} has two parents: it is linked from "
                f"{' and '.join(holders)}"
            )
        seen.add(v)


def _walk_request(b: int, nt: list[int], ns: list[int]) -> tuple[list[int], list[int]]:
    """Check request ``b`` and return its walk order (parents first) and local parents."""
    nodes = len(nt)
    if (
        min(nt) < -1
        or max(nt) >= nodes
        or min(ns) < -1
        or max(ns) >= nodes
        or ns[0] != -1
        or 0 in nt
        or 0 in ns
    ):
        _explain_request(b, nt, ns)
    linked = [x for x in nt if x > 0]
    linked += [x for x in ns if x > 0]
    linked_set = set(linked)
    if len(linked_set) != len(linked):
        _explain_request(b, nt, ns)
    # With at most one link into every node and none into the root, a walk from the root
    # visits each node at most once: it cannot loop.
    parent = [-1] * nodes
    order = [0]
    append = order.append
    i = 0
    while i < len(order):
        v = order[i]
        i += 1
        c = nt[v]
        while c != -1:
            parent[c] = v
            append(c)
            c = ns[c]
    if len(order) < nodes:
        _check_unreachable_acyclic(b, nt, ns, order, linked_set)
    return order, parent


def _raise_first_error(next_token: np.ndarray, next_sibling: np.ndarray) -> None:
    """Raise the first problem, in request order, of links known to be malformed."""
    for b, (nt, ns) in enumerate(zip(next_token.tolist(), next_sibling.tolist(), strict=True)):
        _walk_request(b, nt, ns)
    raise AssertionError("_raise_first_error called on links without a defect")


def _raise_cycle(b: int, j: int) -> None:
    raise ValueError(
        f"the links of request {b} contain a cycle (node {j} is on it or below it); "
        "a verify tree must not loop back through children or siblings"
    )


# -- small trees: plain Python over lists -------------------------------------------------------
def _validate_lists(next_token: np.ndarray, next_sibling: np.ndarray) -> Topology:
    batch, nodes = next_token.shape
    orders: list[list[int]] = []
    parents: list[list[int]] = []
    for b, (nt, ns) in enumerate(zip(next_token.tolist(), next_sibling.tolist(), strict=True)):
        order, parent = _walk_request(b, nt, ns)
        orders.append(order)
        parents.append(parent)
    return Topology(batch, nodes, orders=tuple(orders), local_parents=tuple(parents))


def _check_unreachable_acyclic(
    b: int, nt: list[int], ns: list[int], order: list[int], linked: set[int]
) -> None:
    """Nodes the root does not reach are padding; they must not form a cycle among themselves.

    Every node has at most one incoming link, so the unreachable part is acyclic iff a walk
    from its orphans (unreachable nodes without incoming links) covers all of it.
    """
    nodes = len(nt)
    seen = [False] * nodes
    for v in order:
        seen[v] = True
    unreachable = [v for v in range(nodes) if not seen[v]]
    stack = [v for v in unreachable if v not in linked]
    covered = 0
    while stack:
        v = stack.pop()
        if seen[v]:
            continue
        seen[v] = True
        covered += 1
        for c in (nt[v], ns[v]):
            if c != -1:
                stack.append(c)
    if covered < len(unreachable):
        _raise_cycle(b, next(v for v in unreachable if not seen[v]))


# -- large trees: vectorized over the batch -----------------------------------------------------
def _rounds(n: int) -> int:
    return max(1, (n - 1).bit_length())


def _ancestor_jumps(parent_or_sentinel: np.ndarray, sentinel: int) -> tuple[np.ndarray, ...]:
    jumps = []
    jump = parent_or_sentinel
    while jump.min() != sentinel:  # until every row has jumped past its root
        jumps.append(jump)
        jump = jump[jump]
    return tuple(jumps)


def _validate_numpy(next_token: np.ndarray, next_sibling: np.ndarray) -> Topology:
    batch, nodes = next_token.shape
    if (
        min(next_token.min(), next_sibling.min()) < -1
        or max(next_token.max(), next_sibling.max()) >= nodes
        or (next_sibling[:, 0] != -1).any()
    ):
        _raise_first_error(next_token, next_sibling)

    total = batch * nodes
    sentinel = total
    offsets = np.arange(0, total, nodes, dtype=np.int64)[:, None]
    child_links = next_token >= 0
    sibling_links = next_sibling >= 0
    child_target = (next_token + offsets)[child_links]
    sibling_target = (next_sibling + offsets)[sibling_links]
    rows = np.arange(total, dtype=np.int64).reshape(batch, nodes)
    child_source = rows[child_links]
    sibling_source = rows[sibling_links]

    incoming = np.bincount(np.concatenate((child_target, sibling_target)), minlength=total)
    if incoming.max(initial=0) > 1 or incoming[::nodes].any():
        _raise_first_error(next_token, next_sibling)

    # pred[r]: the one row that links to r (as first child or as next sibling), else itself.
    identity = np.arange(total + 1, dtype=np.int64)
    pred = identity.copy()
    pred[child_target] = child_source
    pred[sibling_target] = sibling_source
    top = pred
    for _ in range(_rounds(nodes) + 1):
        top = top[top]
    # After enough doublings an acyclic chain of predecessors ends at a row without one
    # (a self-link is a row that is its own predecessor: it has an incoming link).
    cyclic = (incoming > 0)[top[:total]]
    if cyclic.any():
        _raise_first_error(next_token, next_sibling)
    reachable = top[:total] == np.repeat(offsets[:, 0], nodes)

    # A first child's parent is the row linking to it; a later sibling shares the parent of
    # the first sibling of its chain. Jump along sibling links to the chain head.
    head = identity.copy()
    head[sibling_target] = sibling_source
    for _ in range(_rounds(nodes)):
        head = head[head]
    parent_of_head = np.full(total + 1, -1, dtype=np.int64)
    parent_of_head[child_target] = child_source
    parent = parent_of_head[head[:total]]
    parent[~reachable] = -1

    jumps = _ancestor_jumps(np.append(np.where(parent >= 0, parent, sentinel), sentinel), sentinel)
    return Topology(batch, nodes, parent=parent, reachable=reachable, ancestor_jumps=jumps)


_chain_cache: dict[tuple[int, int], Topology] = {}


def chain_topology(batch: int, nodes: int) -> Topology:
    """Topology of ``batch`` linear chains (node i's only child is i + 1), cached by shape."""
    key = (batch, nodes)
    topo = _chain_cache.get(key)
    if topo is None:
        total = batch * nodes
        if total <= SMALL_TREE_ROWS:
            order = list(range(nodes))
            local = list(range(-1, nodes - 1))
            topo = Topology(batch, nodes, orders=(order,) * batch, local_parents=(local,) * batch)
        else:
            rows = np.arange(total, dtype=np.int64)
            parent = rows - 1
            parent[rows % nodes == 0] = -1
            jumps = _ancestor_jumps(np.append(np.where(parent >= 0, parent, total), total), total)
            topo = Topology(
                batch,
                nodes,
                parent=parent,
                reachable=np.ones(total, dtype=bool),
                ancestor_jumps=jumps,
            )
            for array in (parent, *jumps):
                array.flags.writeable = False
        if len(_chain_cache) > 64:
            _chain_cache.clear()
        _chain_cache[key] = topo
    return topo
