"""``GrammarTree``: the three verify-tree arrays, staged from wherever they live.

The tree is the input of the mask build. An engine creates it right after its draft kernels
and before it launches the target verify forward (``from_device`` starts the device-to-host
copy on the current stream then), and resolves it after the launch, so the copy and the host
work overlap the forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from portable_spec import native
from portable_spec.backend import ArrayInfo, Backend, StagedArrays
from portable_spec.registry import backend_for, host_backend
from portable_spec.topology import Topology, chain_topology, validate_links

__all__ = ["GrammarTree", "TreeShape", "as_int64", "host_array", "integer_info"]

_NAMES = ("retrieve_next_token", "retrieve_next_sibling", "draft_tokens")


class _Ready:
    """Staged arrays that are already on the host."""

    __slots__ = ("_arrays",)

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self._arrays = arrays

    def resolve(self) -> list[np.ndarray]:
        return self._arrays


def integer_info(name: str, array: Any, backend: Backend) -> ArrayInfo:
    """Shape and dtype of an integer array of ``backend``, without reading its data; errors
    name ``name`` (a deleted JAX array, a torch meta tensor, a float dtype, ...)."""
    try:
        info = backend.array_info(array)
    except ValueError as exc:  # e.g. a JAX array deleted (donated) before staging
        raise ValueError(f"{name}: {exc}") from exc
    except TypeError as exc:  # e.g. a torch meta tensor
        raise TypeError(f"{name}: {exc}") from exc
    if not info.is_integer:
        raise TypeError(f"{name} must have an integer dtype, got {info.dtype}")
    return info


def _info(name: str, array: Any, backend: Backend) -> ArrayInfo:
    info = integer_info(name, array, backend)
    if len(info.shape) not in (1, 2):
        raise ValueError(
            f"{name} must be [batch, nodes] or [nodes], got {len(info.shape)} dimensions "
            f"(shape {info.shape})"
        )
    return info


def _check_shapes(infos: Sequence[ArrayInfo], names: Sequence[str]) -> tuple[int, int]:
    shape = infos[0].shape
    for name, info in zip(names[1:], infos[1:], strict=True):
        if info.shape != shape:
            raise ValueError(
                f"{names[0]} has shape {shape} but {name} has shape {info.shape}; "
                "the tree arrays must have the same shape"
            )
    batch, nodes = (1, shape[0]) if len(shape) == 1 else shape
    if nodes < 1:
        raise ValueError(f"a verify tree needs at least the root node, got {nodes} nodes")
    return batch, nodes


def host_array(name: str, array: Any) -> np.ndarray:
    """A host view of ``array`` (numpy, a list, or a framework's host array), no copy if
    possible; an empty list is int64. Device arrays are refused with a ``TypeError`` naming
    ``name``: host data must never hide a synchronization."""
    if isinstance(array, np.ndarray):
        return array
    if isinstance(array, np.generic):
        return np.asarray(array)
    if isinstance(array, (list, tuple)):
        host = np.asarray(array)
        if host.size == 0 and host.dtype.kind == "f":
            host = host.astype(np.int64)
        return host
    try:
        return backend_for(array).to_host(array)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from exc


class TreeShape(NamedTuple):
    """What a tree tells about itself without its arrays being read: what a build's route
    (:mod:`portable_spec.builder.routes`) is chosen by. Immutable; :attr:`GrammarTree.shape`.

    Attributes:
        batch: requests.
        nodes: nodes per request (packed chains: the longest chain's; 0 while offsets staged
            from a device are not resolved yet).
        rows: rows of the tree's dense mask (``batch * nodes``; packed chains: the sum of the
            chains' lengths).
        linear: every request is a chain (:meth:`GrammarTree.from_linear_chain` or
            :meth:`GrammarTree.from_packed_chains`): node ``i``'s only child is ``i + 1``.
        packed: chains back to back (:meth:`GrammarTree.from_packed_chains`), no padding.
        on_host: the tree wraps the caller's own host arrays (nothing staged): a build can
            read them in place (:meth:`GrammarTree.host_inputs`).
        max_depth: the most draft tokens on one root path that the shape allows (``nodes -
            1``; a tree's own may be less: reading it needs the links).
    """

    batch: int
    nodes: int
    rows: int
    linear: bool
    packed: bool
    on_host: bool
    max_depth: int


class GrammarTree:
    """A batch of verify trees: first-child, next-sibling and draft-token arrays.

    Each array is ``[batch, nodes]`` (a 1-D ``[nodes]`` array means batch 1) of any integer
    dtype and any strides. Links are local node indices (-1 for none); node 0 is the last
    committed token and its draft token is ignored. Build trees with :meth:`from_device`,
    :meth:`from_host` or :meth:`from_linear_chain`; read them with :meth:`resolve`.
    """

    __slots__ = (
        "_arrays",
        "_backend",
        "_chain",
        "_inplace",
        "_offsets",
        "_packed",
        "_staged",
        "_topology",
        "_valid",
        "batch",
        "device",
        "nodes",
        "rows",
    )

    def __init__(
        self,
        staged: list[tuple[list[int], StagedArrays]] | None,
        batch: int,
        nodes: int,
        backend: Backend | None,
        chain: bool,
        device: Any = None,
        offsets: _PackedLayout | None = None,
        rows: int | None = None,
        inplace: tuple[Any, ...] | None = None,
    ) -> None:
        # The constructors of host trees call this positionally with staged=None and
        # backend=None (numpy): a keyword call or one more object costs microseconds with cold
        # caches, and these trees are made on every step of an engine.
        # (positions among the tree's arrays, the handle that stages them); None: `inplace`
        self._staged = staged
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._topology: Topology | None = None
        self._packed = rows is not None
        self._valid = chain or self._packed  # chains are valid by construction
        self._backend = backend
        self._chain = chain
        # packed chains: their checked row layout (None until resolved if staged)
        self._offsets = offsets
        # the caller's host arrays, read in place by the compiled builds (they check dtype and
        # layout): (tokens, the offsets as a tuple of ints or None) for host chains,
        # (next_token, next_sibling, draft) for host trees; None for trees staged from a device
        self._inplace = inplace
        self.batch = batch
        #: nodes per request; packed chains: the longest chain's (0 until the tree is resolved
        #: when the offsets were staged from a device)
        self.nodes = nodes
        #: rows of the tree's dense mask: ``batch * nodes``, or ``offsets[-1]`` for packed chains
        self.rows = batch * nodes if rows is None else rows
        #: where the tree's device arrays live (``None`` for host trees): the mask's default
        #: destination in :func:`portable_spec.build_grammar_vocab_mask`.
        self.device = device

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_device(
        cls, retrieve_next_token: Any, retrieve_next_sibling: Any, draft_tokens: Any
    ) -> GrammarTree:
        """Start copying the tree arrays to the host without blocking.

        Args:
            retrieve_next_token: ``[batch, nodes]`` first child of each node, or -1.
            retrieve_next_sibling: ``[batch, nodes]`` next sibling of each node, or -1.
            draft_tokens: ``[batch, nodes]`` token id at each node.

        Each array may come from any registered framework (torch, JAX, numpy; lists are taken
        as host data); arrays already on the host are used as they are, so mixed inputs work.
        For torch CUDA tensors the copy goes into pinned memory on the current stream and an
        event is recorded; for JAX arrays ``copy_to_host_async`` is started. Only shapes and
        dtypes are checked here (no synchronization); links are validated when the mask is
        built.

        Returns:
            A tree whose :meth:`resolve` waits only for these copies.
        """
        arrays = tuple(
            host_array(n, a) if isinstance(a, (list, tuple)) else a
            for n, a in zip(
                _NAMES, (retrieve_next_token, retrieve_next_sibling, draft_tokens), strict=True
            )
        )
        backends = [backend_for(a) for a in arrays]
        infos = [_info(n, a, b) for n, a, b in zip(_NAMES, arrays, backends, strict=True)]
        batch, nodes = _check_shapes(infos, _NAMES)
        staged = []
        for backend in dict.fromkeys(backends):  # one stage (one event) per framework
            picked = [i for i, b in enumerate(backends) if b is backend]
            staged.append((picked, backend.stage([arrays[i] for i in picked])))
        primary = _primary(backends)
        mine = [a for a, b in zip(arrays, backends, strict=True) if b is primary]
        device = _first_device(primary, mine)
        return cls(staged, batch, nodes, primary, chain=False, device=device)

    @classmethod
    def from_host(
        cls, retrieve_next_token: Any, retrieve_next_sibling: Any, draft_tokens: Any
    ) -> GrammarTree:
        """Wrap tree arrays that already live on the host (numpy arrays, lists, CPU tensors).

        Same array conventions as :meth:`from_device`. Never blocks; a device array raises
        ``TypeError`` (use :meth:`from_device` for those). The tree's backend is that of the
        arrays passed, as for every constructor: torch CPU tensors give torch masks (on the
        CPU), numpy arrays and lists numpy ones; with several frameworks, the first that is
        not numpy.
        """
        arrays = (retrieve_next_token, retrieve_next_sibling, draft_tokens)
        ndarray = np.ndarray
        framework = None
        if (
            type(retrieve_next_token) is ndarray
            and type(retrieve_next_sibling) is ndarray
            and type(draft_tokens) is ndarray
        ):  # the common case: numpy arrays, taken as they are
            hosts = list(arrays)
        else:
            hosts = [host_array(n, a) for n, a in zip(_NAMES, arrays, strict=True)]
            framework = _framework_of(arrays)
        next_token, next_sibling, draft = hosts
        shape = draft.shape
        int64 = _INT64
        if not (
            len(shape) == 2
            and shape[1] >= 1
            and next_token.shape == shape
            and next_sibling.shape == shape
            and (next_token.dtype is int64 or next_token.dtype.kind in "iu")
            and (next_sibling.dtype is int64 or next_sibling.dtype.kind in "iu")
            and (draft.dtype is int64 or draft.dtype.kind in "iu")
        ):  # the common case passes in a few attribute reads; anything else gets checked
            infos = [_info(n, h, host_backend()) for n, h in zip(_NAMES, hosts, strict=True)]
            shape = _check_shapes(infos, _NAMES)
        inplace = (next_token, next_sibling, draft)
        return cls(None, shape[0], shape[1], framework, False, None, None, None, inplace)

    @classmethod
    def from_linear_chain(cls, draft_tokens: Any) -> GrammarTree:
        """A chain per request: node ``i``'s only child is ``i + 1`` (chain-verify algorithms).

        Args:
            draft_tokens: ``[batch, nodes]`` (or ``[nodes]``) token ids, node 0 being the last
                committed token. Host or device array; device arrays are staged as in
                :meth:`from_device`.

        The links are generated on the host and need no validation.
        """
        if type(draft_tokens) is not np.ndarray and isinstance(draft_tokens, (list, tuple)):
            draft_tokens = np.asarray(draft_tokens, dtype=np.int64)
        if type(draft_tokens) is np.ndarray:  # the common host case: no framework look-up
            shape = draft_tokens.shape
            if (
                len(shape) == 2
                and shape[1] >= 1
                and (draft_tokens.dtype is _INT64 or draft_tokens.dtype.kind in "iu")
            ):
                inplace = (draft_tokens, None)
                return cls(None, shape[0], shape[1], None, True, None, None, None, inplace)
        backend = backend_for(draft_tokens)
        info = _info("draft_tokens", draft_tokens, backend)
        batch, nodes = _check_shapes([info], ["draft_tokens"])
        staged = [([2], backend.stage([draft_tokens]))]
        return cls(
            staged, batch, nodes, backend, chain=True, device=backend.device_of(draft_tokens)
        )

    @classmethod
    def from_packed_chains(cls, tokens: Any, offsets: Any) -> GrammarTree:
        """Chains of different lengths packed back to back, one mask row per node, no padding.

        Args:
            tokens: 1-D integer ``[offsets[-1]]`` array (numpy, torch or JAX, host or device;
                device arrays are staged as in :meth:`from_device`; lists are host data).
                Request ``b``'s chain is ``tokens[offsets[b]:offsets[b + 1]]``: its first
                entry is the root (the last committed token, whose value is not read), the
                others its draft tokens in order.
            offsets: 1-D integer ``[batch + 1]`` array, ``offsets[0] == 0`` and
                ``offsets[b + 1] - offsets[b] >= 1`` (every request has its root). Host
                offsets (numpy, a list, a CPU tensor) are checked at once; device arrays
                (JAX arrays included) are staged with the tokens and checked when the tree is
                resolved, still before any matcher moves.

        Checks shapes and dtypes now (``TypeError``/``ValueError`` naming the request or the
        array at fault), never blocks. The mask built over the tree has ``offsets[-1]`` rows; row
        ``offsets[b] + j`` is the node after request ``b``'s first ``j`` drafts, and
        ``return_valid`` gives a flat bool ``[offsets[-1]]``. The dense layout only.

        Returns:
            A tree with ``batch`` requests, ``nodes`` the longest chain's length and ``rows``
            ``offsets[-1]``; :meth:`resolve` returns its chains padded to ``[batch, nodes]``.
        """
        if type(tokens) is not np.ndarray and isinstance(tokens, (list, tuple)):
            tokens = np.asarray(tokens, dtype=np.int64)
        shape = tokens.shape if type(tokens) is np.ndarray else None
        if (
            shape is not None
            and len(shape) == 1
            and (tokens.dtype is _INT64 or tokens.dtype.kind in "iu")
        ):
            host = offsets if type(offsets) is np.ndarray else _host_offsets(offsets)
            if host is not None:  # the common host case: no framework look-up
                rows = shape[0]
                layout = _packed_layout(host, rows)
                inplace = (tokens, layout.bounds)
                framework = None if host is offsets else _framework_of([offsets])
                return cls(None, layout.batch, layout.nodes, framework, False, None, layout,
                           rows, inplace)  # fmt: skip
        backend = backend_for(tokens)
        info = _info("tokens", tokens, backend)
        if len(info.shape) != 1:
            raise ValueError(f"tokens must be 1-D [offsets[-1]], got shape {info.shape}")
        rows = info.shape[0]
        host = _host_offsets(offsets)
        if host is None:  # on a device: staged with the tokens, checked when resolved
            offsets_backend = backend_for(offsets)
            shape = _info("offsets", offsets, offsets_backend).shape
            if len(shape) != 1 or shape[0] < 1:
                raise ValueError(f"offsets must be 1-D [batch + 1], got shape {shape}")
            batch, nodes, layout = shape[0] - 1, 0, None
            arrays, backends = (tokens, offsets), [backend, offsets_backend]
            staged = []
            for each in dict.fromkeys(backends):
                picked = [i for i, b in enumerate(backends) if b is each]
                staged.append(([2 + i for i in picked], each.stage([arrays[i] for i in picked])))
        else:
            layout = _packed_layout(host, rows)
            batch, nodes = layout.batch, layout.nodes
            staged = [([2], backend.stage([tokens]))]
        device = backend.device_of(tokens)
        return cls(staged, batch, nodes, backend, False, device=device, offsets=layout, rows=rows)

    @classmethod
    def _placed_chains(
        cls, tokens: np.ndarray, lengths: list[int], starts: list[int], rows: int
    ) -> GrammarTree:
        """Internal: packed chains (int64 host ``tokens``, one chain per entry of ``lengths``)
        whose mask rows start at ``starts`` inside a mask of ``rows`` rows (ranges disjoint,
        in bounds; rows outside them are neither written nor flagged by a build)."""
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        offsets.flags.writeable = False
        layout = _PackedLayout(offsets, starts)
        tree = cls([([2], _Ready([tokens]))], layout.batch, layout.nodes, host_backend(),
                   False, offsets=layout, rows=int(offsets[-1]))  # fmt: skip
        tree.rows = rows
        return tree

    # -- reading -------------------------------------------------------------------------------
    @property
    def shape(self) -> TreeShape:
        """The tree's :class:`TreeShape` (read without waiting for a staged copy, except that
        packed chains whose offsets were staged report ``nodes`` 0 until resolved)."""
        nodes = self.nodes
        return TreeShape(
            self.batch, nodes, self.rows, self._chain or self._packed, self._packed,
            self._inplace is not None, nodes - 1 if nodes else 0,
        )  # fmt: skip

    def host_inputs(self) -> tuple[Any, ...] | None:
        """The caller's own host arrays as given, unconverted and unresolved, when the tree
        wraps them (``shape.on_host``), else ``None``: ``(next_token, next_sibling,
        draft_tokens)`` for :meth:`from_host`; ``(draft_tokens, None)`` for
        :meth:`from_linear_chain`; ``(tokens, offsets as a tuple of ints)`` for
        :meth:`from_packed_chains`. Their dtypes and layouts are the caller's: a reader checks
        them. Read them only while the build that asked runs."""
        return self._inplace

    @property
    def backend(self) -> Backend:
        """The backend of the tree's arrays (the first framework among them that is not
        numpy); numpy for trees of numpy arrays and lists."""
        return host_backend() if self._backend is None else self._backend

    @property
    def is_chain(self) -> bool:
        """Whether the tree was built by :meth:`from_linear_chain`."""
        return self._chain

    @property
    def is_packed(self) -> bool:
        """Whether the tree was built by :meth:`from_packed_chains`."""
        return self._packed

    @property
    def offsets(self) -> np.ndarray | None:
        """Packed chains (:meth:`from_packed_chains`): the int64 ``[batch + 1]`` row offsets
        (read-only; ``None`` until :meth:`resolve` when staged from a device); ``None`` for
        ``[batch, nodes]`` trees."""
        return None if self._offsets is None else self._offsets.offsets

    def spans(self) -> list[tuple[int, int]]:
        """Per request, ``(first row, nodes)``: where its rows lie in the dense mask (resolves
        packed chains whose offsets were staged from a device: may block)."""
        if not self._packed:
            return [(b * self.nodes, self.nodes) for b in range(self.batch)]
        if self._offsets is None:
            self.resolve()
        assert self._offsets is not None
        return self._offsets.spans

    def resolve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Wait for the staged copy (only if there is one) and return the host arrays.

        Returns:
            ``(next_token, next_sibling, draft_tokens)``: C-contiguous numpy int64 arrays,
            each ``[batch, nodes]`` (packed chains: padded to the longest chain, the nodes
            past a request's chain unreached padding with token 0): copies of the inputs (the
            links of a chain are shared by every chain tree of the same shape). They are
            cached: later calls return the same arrays without waiting. Do not modify them
            (they stay writable only because DLPack, through which xgrammar reads them, cannot
            export read-only arrays).
        """
        if self._arrays is None:
            shape = (self.batch, self.nodes)
            slots: list[np.ndarray | None] = [None, None, None, None]
            staged_arrays = self._staged
            if staged_arrays is None:  # the caller's host arrays
                host = self._inplace
                assert host is not None
                if len(host) == 3:
                    staged_arrays = [([0, 1, 2], _Ready(list(host)))]
                else:
                    staged_arrays = [([2], _Ready([host[0]]))]
            for positions, staged in staged_arrays:
                for position, host in zip(positions, staged.resolve(), strict=True):
                    if position == 3:  # packed chains' offsets, staged from a device
                        self._offsets = _packed_layout(host, self.rows)
                        self.nodes = self._offsets.nodes
                    elif self._packed:
                        slots[position] = as_int64(host, (-1,))
                    else:
                        slots[position] = as_int64(host, shape)
            if self._packed:
                assert self._offsets is not None
                slots[0], slots[1], slots[2] = self._offsets.padded(slots[2])
            elif self._chain:
                slots[0], slots[1] = _chain_links(self.batch, self.nodes)
            self._arrays = tuple(slots[:3])  # type: ignore[assignment]
            self._staged = []
        return self._arrays  # type: ignore[return-value]

    def host_chain_tokens(self) -> np.ndarray | None:
        """Internal (the small-call path): the tokens of a host chain tree, unresolved, as the
        caller gave them, when they are already a C-contiguous, writable, native int64 numpy
        array: ``[batch, nodes]`` for :meth:`from_linear_chain`, ``[rows]`` for
        :meth:`from_packed_chains` whose rows are its chains back to back. ``None`` otherwise
        (then :meth:`resolve`). Read them only while the build that asked runs."""
        host = self._inplace
        if self._arrays is not None or host is None or len(host) != 2:
            return None
        tokens = host[0]
        if (
            tokens.dtype != np.int64
            or not tokens.flags.c_contiguous
            or not tokens.flags.writeable
            or (self._packed and (self._offsets is None or tokens.shape[0] != self.rows))
        ):
            return None
        return tokens

    def validate(self) -> None:
        """Resolve and check the links (once); raise ``ValueError`` naming the problem.

        Uses the compiled checker when available (a yes/no answer, GIL released) and the
        Python validator to explain a "no"; see :func:`portable_spec.topology.validate_links`.
        """
        if self._valid:
            return
        next_token, next_sibling, _ = self.resolve()
        if not native.links_valid(next_token, next_sibling):
            self.topology()  # raises for malformed links
        self._valid = True

    def topology(self) -> Topology:
        """Resolve, validate the links (once) and return the parent structure.

        Raises ``ValueError`` for malformed links (see
        :func:`portable_spec.topology.validate_links`).
        """
        if self._topology is None:
            next_token, next_sibling, _ = self.resolve()
            if self._chain:
                self._topology = chain_topology(self.batch, self.nodes)
            else:
                self._topology = validate_links(next_token, next_sibling)
        return self._topology

    def __repr__(self) -> str:
        kind = "chain" if self._chain else "packed chains" if self._packed else "tree"
        state = "resolved" if self._arrays is not None else "staged"
        return (
            f"GrammarTree({kind}, batch={self.batch}, nodes={self.nodes}, "
            f"backend={self.backend.name!r}, {state})"
        )


def _first_device(backend: Backend, arrays: Sequence[Any]) -> Any:
    """Where the first of ``arrays`` that lives on a device is (None if all are host arrays):
    a CPU tensor listed before a CUDA one must not send the mask to the CPU."""
    for array in arrays:
        device = backend.device_of(array)
        if device is not None:
            return device
    return None


def _framework_of(arrays: Sequence[Any]) -> Backend | None:
    """The backend a mask over host ``arrays`` goes to: the first framework among them that
    is not numpy (torch CPU tensors: torch), or None (numpy: numpy arrays, lists)."""
    for array in arrays:
        if isinstance(array, (np.ndarray, np.generic, list, tuple)):
            continue
        backend = backend_for(array)
        if backend.name != "numpy":
            return backend
    return None


def _primary(backends: list[Backend]) -> Backend:
    for b in backends:
        if b.name != "numpy":
            return b
    return backends[0]


def as_int64(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A private C-contiguous native int64 copy of an integer ``array`` reshaped to
    ``shape``: the caller (or a staging pool) may reuse its buffer afterwards.

    Values are converted, whatever the byte order; 64-bit unsigned values beyond int64 (never
    node indices nor token ids) wrap like a C cast instead of raising.
    """
    if array.dtype.kind == "u" and array.dtype.itemsize == 8:
        # to native order first: a view of a byte-swapped array would reinterpret its bytes
        array = array.astype(np.uint64, copy=False).view(np.int64)
    return np.array(array.reshape(shape), dtype=np.int64, order="C", copy=True)


_chain_links_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _chain_links(batch: int, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    key = (batch, nodes)
    links = _chain_links_cache.get(key)
    if links is None:
        next_token = np.broadcast_to(
            np.append(np.arange(1, nodes, dtype=np.int64), -1), (batch, nodes)
        ).copy()
        next_sibling = np.full((batch, nodes), -1, dtype=np.int64)
        if len(_chain_links_cache) > 64:
            _chain_links_cache.clear()
        _chain_links_cache[key] = links = (next_token, next_sibling)
    return links


def _host_offsets(offsets: Any) -> np.ndarray | None:
    """Packed-chain offsets readable on the host without waiting, or None (a device array)."""
    if isinstance(offsets, (list, tuple, np.ndarray, np.generic)):
        return host_array("offsets", offsets)
    backend = backend_for(offsets)
    try:
        return backend.to_host(offsets)
    except TypeError:
        return None


def _check_offsets(offsets: np.ndarray, rows: int) -> np.ndarray:
    """Validate packed-chain offsets against ``rows`` tokens; return them as a read-only
    int64 copy."""
    if offsets.dtype.kind not in "iu":
        raise TypeError(f"offsets must have an integer dtype, got {offsets.dtype}")
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets must be 1-D [batch + 1], got shape {offsets.shape}")
    host = np.array(offsets, dtype=np.int64, copy=True)
    if host[0] != 0:
        raise ValueError(f"offsets[0] must be 0, got {int(host[0])}")
    lengths = np.diff(host)
    if lengths.size and lengths.min() < 1:
        b = int(np.argmax(lengths < 1))
        raise ValueError(
            f"request {b} has offsets[{b + 1}] - offsets[{b}] = {int(lengths[b])} nodes; "
            "every request needs at least its root (offsets must increase by >= 1)"
        )
    if int(host[-1]) != rows:
        raise ValueError(
            f"tokens has {rows} entries but offsets[-1] = {int(host[-1])}; "
            "they must be equal (one token per packed row)"
        )
    host.flags.writeable = False
    return host


class _PackedLayout:
    """The checked row layout of packed chains, shared by every tree with the same offsets:
    spans, the longest chain, the chain links padded to ``[batch, nodes]`` (read-only)."""

    __slots__ = (
        "batch", "bounds", "inside", "next_sibling", "next_token", "nodes", "offsets", "rows",
        "spans",
    )  # fmt: skip

    def __init__(self, offsets: np.ndarray, starts: list[int] | None = None) -> None:
        self.offsets = offsets
        bounds = offsets.tolist()
        #: the offsets as a tuple of ints, as the compiled small build reads them
        self.bounds: tuple[int, ...] = tuple(bounds)
        self.rows: int = bounds[-1]  # the packed tokens' count
        lengths = [e - s for s, e in itertools.pairwise(bounds)]
        self.batch = len(lengths)
        self.nodes = max(lengths, default=1)
        self.spans = list(zip(bounds[:-1] if starts is None else starts, lengths, strict=True))
        column = np.arange(self.nodes, dtype=np.int64)
        length = np.asarray(lengths, dtype=np.int64).reshape(-1, 1)
        # None when every chain has the same length (the tokens are the grid as they are)
        self.inside = None if min(lengths, default=0) == self.nodes else column < length
        next_token = np.where(column + 1 < length, column + 1, -1).astype(np.int64)
        self.next_token = np.ascontiguousarray(next_token.reshape(self.batch, self.nodes))
        self.next_sibling = np.full((self.batch, self.nodes), -1, dtype=np.int64)

    def padded(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Packed int64 tokens ``[rows]`` (a private copy) -> ``(next_token, next_sibling,
        draft)`` padded to ``[batch, nodes]`` (nodes past a chain: unreached, token 0)."""
        if self.inside is None:
            draft = tokens.reshape(self.batch, self.nodes)
        else:
            draft = np.zeros((self.batch, self.nodes), dtype=np.int64)
            draft[self.inside] = tokens
        return self.next_token, self.next_sibling, draft


# int64 offsets by their bytes, other integer dtypes by (dtype, bytes): the two never collide
_packed_cache: dict[bytes | tuple[str, bytes], _PackedLayout] = {}
_INT64 = np.dtype(np.int64)


def _packed_layout(host: np.ndarray, rows: int) -> _PackedLayout:
    """The layout of host offsets, checked (see :func:`_check_offsets`) the first time these
    offsets are seen; cached by their bytes."""
    key: bytes | tuple[str, bytes] | None = None
    if host.ndim == 1:
        dtype = host.dtype
        if dtype is _INT64:  # the common case, in as few steps as possible
            key = host.tobytes()
        elif dtype.kind in "iu":
            key = (dtype.str, host.tobytes())
    layout = None if key is None else _packed_cache.get(key)
    if layout is None or layout.rows != rows:
        layout = _PackedLayout(_check_offsets(host, rows))
        if key is not None:
            if len(_packed_cache) > 256:
                _packed_cache.clear()
            _packed_cache[key] = layout
    return layout
