"""``CompactMask``: only the rows that constrain something, plus their row indices.

A dense mask has one int32 row of ``ceil(vocab / 32)`` words per verify-tree node, and most of
them can be all-allowed (-1): unconstrained requests, rejected drafts and their subtrees,
terminated nodes, padding. A compact mask lists only the rows of accepted, non-terminated
nodes of constrained requests (``K`` of them) and says where they go::

    rows   int32 [C]           ascending; rows[k] is the logits row that bits[k] constrains
    bits   int32 [C, words]    the grammar's mask for that row
    num_rows                   rows of the logits (and of the dense mask it stands for)

Every logits row not listed is all-allowed. ``C`` is ``K``, or a fixed capacity (``max_rows``)
so that XLA and CUDA graphs see one shape: the entries past ``K`` are *padding*, whose row index
is ``num_rows`` (a row past the logits: it applies to nothing) and whose bits are unspecified
(never read; they may hold stale data). ``rows`` is therefore non-decreasing, strictly
increasing over the real entries.

This module is numpy-only; the arrays can be any framework's (numpy on the host, torch tensors
or ``jax.Array`` on a device). A ``CompactMask`` of JAX arrays is a pytree (``rows`` and ``bits``
are its leaves, ``num_rows`` is static), so it passes into ``jax.jit``.

It also holds the rest of the mask format, in one place: :data:`ALL_ALLOWED` (the row value
that constrains nothing), :func:`words_for` (words per row), the :data:`LAYOUTS`, and the
checks of the arguments that describe a mask (``vocab_size``, ``layout``/``max_rows``, an
``out=`` buffer of either layout).
"""

from __future__ import annotations

import sys
from contextlib import suppress
from numbers import Integral
from typing import Any

import numpy as np

__all__ = [
    "ALL_ALLOWED",
    "LAYOUTS",
    "MAX_VOCAB_SIZE",
    "CompactMask",
    "apply_columns",
    "check_compact_out",
    "check_dense_out",
    "check_flag",
    "check_layout",
    "check_vocab_size",
    "compact_views",
    "index_words",
    "rebase_compact",
    "words_for",
]

#: the value of every word of a row that constrains nothing (all 32 bits set)
ALL_ALLOWED = -1

#: mask layouts: one row per node, or only the rows that constrain something (CompactMask)
LAYOUTS = ("dense", "compact")

#: the largest ``vocab_size`` a build takes: 2**21 = 2,097,152 tokens, eight times the largest
#: vocabularies of released models (262,144 tokens, Gemma 3's), padded logits included; a mask
#: row of it is 256 KiB. A larger ``vocab_size`` is a mistake (a byte count, an unset field)
#: that would otherwise allocate gigabytes before failing: ``ValueError`` naming this limit.
MAX_VOCAB_SIZE = 1 << 21


def words_for(vocab_size: int) -> int:
    """Number of int32 words in one bitmask row covering ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def check_vocab_size(vocab_size: Any) -> int:
    """Validate ``vocab_size`` (a positive int, numpy ints included, at most
    :data:`MAX_VOCAB_SIZE`) and return it as int."""
    if type(vocab_size) is int and 0 < vocab_size <= MAX_VOCAB_SIZE:  # the common case
        return vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, Integral):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    vocab_size = int(vocab_size)
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size = {vocab_size} is past portable_spec.MAX_VOCAB_SIZE = {MAX_VOCAB_SIZE}"
            " (real vocabularies have up to about 262k tokens): pass the model's logits width"
        )
    return vocab_size


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool (``True`` or ``False``), else ``TypeError`` naming ``name``."""
    if value is not True and value is not False:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_layout(layout: Any, max_rows: Any) -> int | None:
    """Validate ``layout`` and ``max_rows`` (compact only: a non-negative int or None); return
    ``max_rows`` as an int or None."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if max_rows is None:
        return None
    if layout != "compact":
        raise ValueError("max_rows bounds a compact mask; it needs layout='compact'")
    if isinstance(max_rows, bool) or not isinstance(max_rows, Integral):
        raise TypeError(f"max_rows must be an int, got {type(max_rows).__name__}")
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0, got {max_rows}")
    return int(max_rows)


def check_dense_out(out: Any, rows: int, words: int) -> np.ndarray:
    """An ``out=`` buffer of the dense layout, checked: a writable C-contiguous numpy int32
    ``[rows, words]`` array (returned as is); ``TypeError``/``ValueError`` otherwise."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy int32 array, got {type(out).__name__}")
    if out.dtype != np.int32:
        raise TypeError(f"out must have dtype int32, got {out.dtype}")
    if out.shape != (rows, words):
        raise ValueError(
            f"out must have shape ({rows}, {words}) (batch * nodes, ceil(vocab_size / 32)), "
            f"got {out.shape}"
        )
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous (rows are handed to C++ as flat memory)")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return out


_INT32 = np.dtype(np.int32)


def _is_int32(array: Any) -> bool:
    dtype = getattr(array, "dtype", None)
    if isinstance(dtype, np.dtype):  # numpy and JAX (numpy's str() of a dtype is slow)
        return dtype == _INT32
    return str(dtype).rsplit(".", 1)[-1] == "int32"  # torch.int32, ...


class CompactMask:
    """The rows of a grammar mask that constrain something, and where they go.

    Attributes:
        rows: int32 ``[C]``: ``rows[k]`` is the logits row ``bits[k]`` applies to; ascending
            over the ``count`` real entries, then ``num_rows`` for each padding entry.
        bits: int32 ``[C, words]``: bit ``t % 32`` of word ``t // 32`` of ``bits[k]`` set means
            token ``t`` is allowed in row ``rows[k]``. Padding entries' bits are unspecified.
        num_rows: the rows of the logits this mask applies to (the dense mask it stands for
            is ``[num_rows, words]``); every row not listed is all-allowed.
        count: the number of real entries ``K`` where known (``None`` inside a ``jax.jit``,
            where the mask is rebuilt from its arrays).

    Build one with ``build_grammar_vocab_mask(..., layout="compact")`` (or
    ``build_host_bitmask``), apply it with :func:`portable_spec.apply_vocab_mask`. The
    constructor checks shapes and dtypes, not contents.
    """

    __slots__ = ("bits", "count", "num_rows", "rows")

    def __init__(self, rows: Any, bits: Any, num_rows: int, count: int | None = None) -> None:
        rows_shape = tuple(getattr(rows, "shape", ()))
        bits_shape = tuple(getattr(bits, "shape", ()))
        if len(rows_shape) != 1 or len(bits_shape) != 2 or rows_shape[0] != bits_shape[0]:
            raise ValueError(
                f"a CompactMask needs rows [C] and bits [C, words], got rows {rows_shape} and "
                f"bits {bits_shape}"
            )
        for name, array in (("rows", rows), ("bits", bits)):
            if not _is_int32(array):
                raise TypeError(f"CompactMask.{name} must have dtype int32, got {array.dtype}")
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)):
            raise TypeError(f"num_rows must be an int, got {type(num_rows).__name__}")
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        if count is not None and not 0 <= count <= rows_shape[0]:
            raise ValueError(f"count = {count} is not within the {rows_shape[0]} entries")
        self.rows = rows
        self.bits = bits
        self.num_rows = int(num_rows)
        self.count = None if count is None else int(count)
        _register_pytree()

    @classmethod
    def _from_parts(cls, rows: Any, bits: Any, num_rows: int, count: int | None) -> CompactMask:
        """Without checks (JAX rebuilds pytrees from placeholders as well as arrays)."""
        mask = object.__new__(cls)
        mask.rows, mask.bits, mask.num_rows, mask.count = rows, bits, num_rows, count
        return mask

    @property
    def capacity(self) -> int:
        """``C``: the number of entries, padding included."""
        return int(self.rows.shape[0])

    @property
    def words(self) -> int:
        """int32 words per row."""
        return int(self.bits.shape[1])

    def to_dense(self) -> np.ndarray:
        """The dense int32 ``[num_rows, words]`` mask on the host (all-allowed rows included).

        Works for arrays numpy can read (numpy, torch CPU tensors, ``jax.Array``); copy a
        mask on an accelerator to the host first (``.cpu()``). Padding entries are skipped.
        """
        try:
            rows = np.asarray(self.rows)
            bits = np.asarray(self.bits)
        except (TypeError, RuntimeError) as exc:
            raise TypeError(
                f"to_dense reads the mask on the host; bring its arrays there first ({exc})"
            ) from exc
        dense = np.full((self.num_rows, bits.shape[1]), ALL_ALLOWED, dtype=np.int32)
        real = rows < self.num_rows
        dense[rows[real]] = bits[real]
        return dense

    def __repr__(self) -> str:
        kind = type(self.rows).__module__.split(".")[0]
        return (
            f"CompactMask(entries={self.capacity}, count={self.count}, words={self.words}, "
            f"num_rows={self.num_rows}, arrays={kind})"
        )


def apply_columns(width: int, words: int | None, vocab_size: Any) -> tuple[int, int | None]:
    """How a mask of ``words`` int32 words per row (``None``: no mask) applies to logits
    ``width`` columns wide: ``(covered, banned_from)``.

    ``covered``: the leading columns whose bits are applied. ``banned_from``: the first column
    to set to ``-inf`` in every row (``None`` for none): ``vocab_size`` when given and smaller
    than ``width``. Without ``vocab_size`` the mask must cover every column.

    Raises:
        TypeError: ``vocab_size`` not an int.
        ValueError: logits wider than the mask covers without ``vocab_size``; ``vocab_size``
            past what the mask covers, or below 1; no mask and no ``vocab_size``.
    """
    if vocab_size is None:
        if words is None:
            raise ValueError("vocab_size is required to apply no mask")
        if width > 32 * words:
            raise ValueError(
                f"logits have {width} columns but the mask covers only {32 * words} tokens "
                f"({words} words): pass vocab_size= (the real vocabulary; columns at or past "
                "it are banned) or a mask as wide as the logits"
            )
        return width, None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    vocab_size = int(vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if words is not None and vocab_size > 32 * words:
        raise ValueError(
            f"vocab_size = {vocab_size} but the mask covers only {32 * words} tokens "
            f"({words} words): tokens {32 * words}..{vocab_size - 1} would be unconstrained"
        )
    covered = 0 if words is None else min(width, vocab_size)
    return covered, (vocab_size if vocab_size < width else None)


def check_compact_out(out: Any, capacity: int, words: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``(rows, bits)`` arrays of an ``out=`` CompactMask, checked: numpy int32, ``rows``
    ``[C]`` and ``bits`` C-contiguous ``[C, words]`` with ``C >= capacity``, writable."""
    if not isinstance(out, CompactMask):
        raise TypeError(
            f"out must be a portable_spec.CompactMask of numpy arrays for layout='compact', "
            f"got {type(out).__name__}"
        )
    rows, bits = out.rows, out.bits
    if not isinstance(rows, np.ndarray) or not isinstance(bits, np.ndarray):
        raise TypeError("out must hold numpy arrays (the host build writes into them)")
    if bits.shape[1] != words:
        raise ValueError(f"out.bits must have {words} words per row, got {bits.shape[1]}")
    if out.capacity < capacity:
        raise ValueError(
            f"out has room for {out.capacity} rows; this build may list up to {capacity}"
        )
    if not bits.flags.c_contiguous or not rows.flags.c_contiguous:
        raise ValueError("out.rows and out.bits must be C-contiguous")
    if not bits.flags.writeable or not rows.flags.writeable:
        raise ValueError("out is read-only")
    return rows, bits


def index_words(capacity: int, words: int) -> int:
    """Rows of ``words`` int32 words that hold an int32 index of ``capacity`` entries."""
    return -(-capacity // words) if words else 0


def compact_views(block: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, bits)`` views of a host block of ``capacity + index_words(capacity, words)``
    int32 rows: ``bits`` is ``block[:capacity]``, ``rows`` the ``capacity`` int32 after it.

    One block per compact mask keeps the host side to one pooled (pinned) allocation; an
    upload copies ``bits[:count]`` and ``rows`` from it.
    """
    words = block.shape[1]
    bits = block[:capacity]
    rows = block[capacity : capacity + index_words(capacity, words)].reshape(-1)[:capacity]
    return rows, bits


def rebase_compact(mask: CompactMask, block: np.ndarray, target: Any) -> CompactMask:
    """``mask`` (numpy views of the host ``block``) re-made of the same elements of ``target``,
    an array of ``block``'s shape and dtype in any framework that can flatten, slice and
    reshape views (numpy, a lent copy of the block, a torch tensor on the same memory)."""
    base = block.__array_interface__["data"][0]
    flat = target.reshape(-1)

    def view(array: np.ndarray) -> Any:
        start = (array.__array_interface__["data"][0] - base) // block.itemsize
        return flat[start : start + array.size].reshape(array.shape)

    return CompactMask(view(mask.rows), view(mask.bits), mask.num_rows, mask.count)


_registered = False


def _register_pytree() -> None:
    """Make CompactMask a JAX pytree once JAX is imported (this module imports numpy only)."""
    global _registered
    if _registered or "jax" not in sys.modules:
        return
    import jax

    def flatten(mask: CompactMask) -> tuple[tuple[Any, Any], int]:
        return (mask.rows, mask.bits), mask.num_rows

    def unflatten(num_rows: int, leaves: Any) -> CompactMask:
        rows, bits = leaves
        return CompactMask._from_parts(rows, bits, num_rows, None)

    with suppress(ValueError):  # registered already (another copy of this module)
        jax.tree_util.register_pytree_node(CompactMask, flatten, unflatten)
    _registered = True
