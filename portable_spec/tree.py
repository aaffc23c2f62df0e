"""``GrammarTree``: the three verify-tree arrays, staged from wherever they live.

The tree is the input of the mask build. An engine creates it right after its draft kernels
and before it launches the target verify forward (``from_device`` starts the device-to-host
copy on the current stream then), and resolves it after the launch, so the copy and the host
work overlap the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_spec import native as compiled
from portable_spec.backend import ArrayInfo, Backend, StagedArrays
from portable_spec.registry import backend_for, get_backend
from portable_spec.topology import Topology, chain_topology, validate_links

__all__ = ["GrammarTree"]

_NAMES = ("retrieve_next_token", "retrieve_next_sibling", "draft_tokens")


class _Ready:
    """Staged arrays that are already on the host."""

    __slots__ = ("_arrays",)

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self._arrays = arrays

    def resolve(self) -> list[np.ndarray]:
        return self._arrays


def _info(name: str, array: Any, backend: Backend) -> ArrayInfo:
    try:
        info = backend.array_info(array)
    except ValueError as exc:  # e.g. a JAX array deleted (donated) before staging
        raise ValueError(f"{name}: {exc}") from exc
    except TypeError as exc:  # e.g. a torch meta tensor
        raise TypeError(f"{name}: {exc}") from exc
    if not info.is_integer:
        raise TypeError(f"{name} must have an integer dtype, got {info.dtype}")
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


def _host_array(array: Any) -> np.ndarray:
    """A host view of ``array`` (numpy, a list, or a framework's host array), no copy if
    possible. Device arrays are refused: ``from_host`` must never hide a synchronization."""
    if isinstance(array, np.ndarray):
        return array
    if isinstance(array, np.generic):
        return np.asarray(array)
    if isinstance(array, (list, tuple)):
        host = np.asarray(array)
        if host.size == 0 and host.dtype.kind == "f":
            host = host.astype(np.int64)
        return host
    return backend_for(array).to_host(array)


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
        "_staged",
        "_topology",
        "_valid",
        "batch",
        "device",
        "nodes",
    )

    def __init__(
        self,
        staged: list[tuple[list[int], StagedArrays]],
        batch: int,
        nodes: int,
        backend: Backend,
        chain: bool,
        device: Any = None,
    ) -> None:
        # (positions among the tree's arrays, the handle that stages them)
        self._staged = staged
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._topology: Topology | None = None
        self._valid = chain  # chains are valid by construction
        self._backend = backend
        self._chain = chain
        self.batch = batch
        self.nodes = nodes
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
            _host_array(a) if isinstance(a, (list, tuple)) else a
            for a in (retrieve_next_token, retrieve_next_sibling, draft_tokens)
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
        ``TypeError`` (use :meth:`from_device` for those).
        """
        hosts = []
        for name, array in zip(
            _NAMES, (retrieve_next_token, retrieve_next_sibling, draft_tokens), strict=True
        ):
            try:
                hosts.append(_host_array(array))
            except TypeError as exc:
                raise TypeError(f"{name}: {exc}") from exc
        numpy_backend = get_backend("numpy")
        shape = hosts[0].shape
        if not (
            len(shape) == 2
            and all(h.shape == shape and h.dtype.kind in "iu" for h in hosts)
            and shape[1] >= 1
        ):  # the common case passes in a few attribute reads; anything else gets checked
            infos = [_info(n, h, numpy_backend) for n, h in zip(_NAMES, hosts, strict=True)]
            shape = _check_shapes(infos, _NAMES)
        return cls([([0, 1, 2], _Ready(hosts))], shape[0], shape[1], numpy_backend, chain=False)

    @classmethod
    def from_linear_chain(cls, draft_tokens: Any) -> GrammarTree:
        """A chain per request: node ``i``'s only child is ``i + 1`` (chain-verify algorithms).

        Args:
            draft_tokens: ``[batch, nodes]`` (or ``[nodes]``) token ids, node 0 being the last
                committed token. Host or device array; device arrays are staged as in
                :meth:`from_device`.

        The links are generated on the host and need no validation.
        """
        if isinstance(draft_tokens, (list, tuple)):
            draft_tokens = np.asarray(draft_tokens, dtype=np.int64)
        backend = backend_for(draft_tokens)
        info = _info("draft_tokens", draft_tokens, backend)
        batch, nodes = _check_shapes([info], ["draft_tokens"])
        staged = [([2], backend.stage([draft_tokens]))]
        return cls(
            staged, batch, nodes, backend, chain=True, device=backend.device_of(draft_tokens)
        )

    # -- reading -------------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The backend of the tree's (first) device array; numpy for host trees."""
        return self._backend

    @property
    def is_chain(self) -> bool:
        """Whether the tree was built by :meth:`from_linear_chain`."""
        return self._chain

    def resolve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Wait for the staged copy (only if there is one) and return the host arrays.

        Returns:
            ``(next_token, next_sibling, draft_tokens)``: C-contiguous numpy int64 arrays,
            each ``[batch, nodes]``: copies of the inputs (the links of a chain are shared by
            every chain tree of the same shape). They are cached: later calls return the same
            arrays without waiting. Do not modify them (they stay writable only because
            DLPack, through which xgrammar reads them, cannot export read-only arrays).
        """
        if self._arrays is None:
            shape = (self.batch, self.nodes)
            slots: list[np.ndarray | None] = [None, None, None]
            for positions, staged in self._staged:
                for position, host in zip(positions, staged.resolve(), strict=True):
                    slots[position] = as_int64(host, shape)
            if self._chain:
                slots[0], slots[1] = _chain_links(self.batch, self.nodes)
            self._arrays = tuple(slots)  # type: ignore[assignment]
            self._staged = []
        return self._arrays  # type: ignore[return-value]

    def validate(self) -> None:
        """Resolve and check the links (once); raise ``ValueError`` naming the problem.

        Uses the compiled checker when available (a yes/no answer, GIL released) and the
        Python validator to explain a "no"; see :func:`portable_spec.topology.validate_links`.
        """
        if self._valid:
            return
        next_token, next_sibling, _ = self.resolve()
        checker = compiled.native
        if checker is None or not checker.links_valid(next_token, next_sibling):
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
        kind = "chain" if self._chain else "tree"
        state = "resolved" if self._arrays is not None else "staged"
        return (
            f"GrammarTree({kind}, batch={self.batch}, nodes={self.nodes}, "
            f"backend={self._backend.name!r}, {state})"
        )


def _first_device(backend: Backend, arrays: Sequence[Any]) -> Any:
    """Where the first of ``arrays`` that lives on a device is (None if all are host arrays):
    a CPU tensor listed before a CUDA one must not send the mask to the CPU."""
    for array in arrays:
        device = backend.device_of(array)
        if device is not None:
            return device
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
