"""The index work of the mask build: one entry per operation, the compiled helper or numpy
behind each.

The C extension (``portable_spec._native``) is built at install time when a compiler is
present; it releases the GIL while it runs. Without it (or with ``PORTABLE_SPEC_NO_NATIVE=1``)
every entry below runs its numpy/Python equivalent: same results, tested against each other.
Callers call the entries and never ask which implementation answers.

=================  ==========================================================================
entry              what it does (one request's first-child / next-sibling links)
=================  ==========================================================================
links_valid        True when the links of a whole batch are known to be well formed
repair_rows        after a walk: keep the rows of accepted, live nodes, -1 into the others
                   (``row_repairer``: the same, taken once for a loop over requests)
keep_rows          the same decision without writes: the kept nodes, ascending
take_rows          copy the listed rows out (and number them), for the compact layout
traverse_xgrammar  one request's ``GrammarMatcher.traverse_draft_tree``, GIL released
xgrammar_handle    what the compiled helper needs to call a matcher's methods itself
=================  ==========================================================================

The rule of ``repair_rows`` and ``keep_rows``: a node keeps its row iff the matcher was live
at the root and every node on its root path has its token in ``[0, limit)``, not a stop
token, and its bit set in its parent's row. Counts: ``checked`` are the children of kept
nodes (the draft tokens the grammar was asked about), ``refused`` those whose token is out of
range or whose bit is clear (an accepted stop token is not a refusal).

xgrammar (0.2.8 and later) reaches its C++ through tvm-ffi: each Python call converts its
array arguments and dispatches under the GIL, then walks without it. On short chains that part
is most of a call, and two threads walking through it were hardly faster than one. The compiled
helper calls the same methods through tvm-ffi's C ABI instead (``TVMFFIFunctionCall`` on the
matcher type's own method functions, the arrays passed as DLPack tensors it describes itself),
the GIL released for the whole call, and walks a batch of chains in one call. It binds only
after checking tvm-ffi's version (0.1) and the two methods' signatures; anything else, or
``PORTABLE_SPEC_XGRAMMAR_FFI=0``, leaves xgrammar's Python binding in use (same rows).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "bound_helper",
    "keep_rows",
    "links_valid",
    "native",
    "repair_rows",
    "row_repairer",
    "take_rows",
    "traverse_xgrammar",
    "xgrammar_handle",
]

logger = logging.getLogger("portable_spec")

Links = tuple[np.ndarray, np.ndarray, np.ndarray]


def _load() -> ModuleType | None:
    if os.environ.get("PORTABLE_SPEC_NO_NATIVE", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module("portable_spec._native")
    except ImportError:
        return None


#: the compiled module, or None when unavailable or disabled (read at every call: setting it
#: to None switches every entry to its numpy/Python implementation)
native: ModuleType | None = _load()


def links_valid(next_token: np.ndarray, next_sibling: np.ndarray) -> bool:
    """Whether the C-contiguous int64 ``[batch, nodes]`` links are known to be well formed
    (the rules of :func:`portable_spec.topology.validate_links`), GIL released.

    ``False`` means "not known": the links are malformed, or no compiled checker is
    available; the caller then runs the Python validator, which raises naming the problem.
    Does not block on anything but the check itself.
    """
    helper = native
    return helper is not None and bool(helper.links_valid(next_token, next_sibling))


def repair_rows(
    rows: np.ndarray,
    links: Links,
    limit: int,
    stop_ids: np.ndarray,
    root_state: int,
    valid: np.ndarray | None = None,
) -> tuple[int, int]:
    """Repair one request's rows in place after its walk; return ``(checked, refused)``.

    ``rows``: C-contiguous writable int32 ``[nodes, words]`` as the walk left them (xgrammar
    zeroes rejected and terminated nodes' rows and leaves unreached ones untouched).
    ``links``: int64 ``[nodes]`` first child, next sibling, token. ``stop_ids``: int64 stop
    tokens. ``root_state``: 1 the matcher was live at the root, 0 terminated, -1 read it off
    row 0. Every row of a node that does not keep its row (rule in the module docstring)
    becomes all-allowed (-1). ``valid`` (bool ``[nodes]``, optional) receives which nodes the
    grammar accepts: the root, and each child of a kept node whose token is in range with its
    bit set (stop tokens included). Blocks until done (GIL released in the compiled helper).
    """
    repair = row_repairer(valid is not None)
    if valid is None:
        _, checked, refused = repair(rows, *links, limit, stop_ids, root_state)
    else:
        _, checked, refused = repair(rows, *links, limit, stop_ids, root_state, valid)
    return checked, refused


def row_repairer(valid: bool) -> Callable[..., tuple[int, int, int]]:
    """The implementation behind :func:`repair_rows`, for a loop over requests that calls it
    many times: ``repair(rows, next_token, next_sibling, draft, limit, stop_ids, root_state[,
    valid]) -> (kept, checked, refused)`` (``kept``: rows kept). ``valid``: whether the
    calls pass the ``valid`` output (a compiled helper older than these sources does not
    take it; the numpy/Python implementation answers then). Take it once per build: a
    later switch of :data:`native` is not seen by a function already taken."""
    helper = native
    if helper is not None and (not valid or getattr(helper, "REPAIR_VALID", 0)):
        return helper.repair_rows  # type: ignore[no-any-return]
    return _repair_rows_python


def _repair_rows_python(
    rows: np.ndarray,
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    limit: int,
    stop_ids: np.ndarray,
    root_state: int,
    valid: np.ndarray | None = None,
) -> tuple[int, int, int]:
    """:func:`row_repairer`'s numpy/Python implementation (the compiled helper's signature)."""
    links = (next_token, next_sibling, draft)
    keep, checked, refused = _decide(rows, links, limit, stop_ids, root_state, valid)
    drop = np.flatnonzero(~keep)
    if drop.size:
        rows[drop] = -1
    return len(keep) - len(drop), checked, refused


def keep_rows(
    rows: np.ndarray, links: Links, limit: int, stop_ids: np.ndarray, root_state: int
) -> tuple[np.ndarray, int, int]:
    """The nodes of one request that keep their row, and its ``(checked, refused)`` counts.

    Same arguments and rule as :func:`repair_rows`, but ``rows`` is only read (only the rows
    of kept nodes' parents are). Returns ``(kept, checked, refused)``: ``kept`` int32, the
    kept nodes in ascending order. Blocks until done (GIL released in the compiled helper).
    """
    helper = native
    if helper is not None:
        kept = np.empty(rows.shape[0], dtype=np.int32)
        count, checked, refused = helper.keep_rows(rows, *links, limit, stop_ids, root_state, kept)
        return kept[:count], checked, refused
    keep, checked, refused = _decide(rows, links, limit, stop_ids, root_state, None)
    return np.flatnonzero(keep).astype(np.int32), checked, refused


def take_rows(
    source: np.ndarray, index: np.ndarray, dest: np.ndarray, numbers: np.ndarray, base: int
) -> None:
    """``dest[i] = source[index[i]]`` (int32 rows, words of ``dest`` past the source's width
    set to 0) and ``numbers[i] = index[i] + base``. ``dest`` is C-contiguous
    ``[len(index), words]``, ``index`` and ``numbers`` int32 ``[len(index)]``. Returns None;
    blocks until copied (GIL released in the compiled helper)."""
    helper = native
    if helper is not None:
        helper.take_rows(source, index, dest, numbers, base)
        return
    width = source.shape[1]
    if width == dest.shape[1]:
        np.take(source, index, axis=0, out=dest, mode="clip")
    else:
        dest[:, :width] = source[index]
        dest[:, width:] = 0
    np.add(index, base, out=numbers, casting="unsafe")


def _decide(
    rows: np.ndarray,
    links: Links,
    limit: int,
    stop_ids: np.ndarray,
    root_state: int,
    valid: np.ndarray | None,
) -> tuple[np.ndarray, int, int]:
    """The decision of :func:`repair_rows` in Python: breadth first from the root over kept
    nodes, each child's test reading its parent's row. Returns ``(keep, checked, refused)``,
    ``keep`` bool ``[nodes]``; fills ``valid`` when given."""
    first, following, token = (a.tolist() for a in links)
    nodes = len(first)
    stops = frozenset(stop_ids.tolist())
    keep = [False] * nodes
    accepted = [False] * nodes
    accepted[0] = True
    if root_state < 0:
        root_state = int(bool(rows[0].any()))
    checked = refused = 0
    if root_state:
        keep[0] = True
        queue = [0]
        head = 0
        while head < len(queue):
            parent = queue[head]
            head += 1
            row = rows[parent]
            child = first[parent]
            while child != -1:
                t = token[child]
                checked += 1
                if not (0 <= t < limit and (int(row[t >> 5]) >> (t & 31)) & 1):
                    refused += 1
                else:
                    accepted[child] = True
                    if t not in stops and not keep[child]:
                        keep[child] = True
                        queue.append(child)
                child = following[child]
    if valid is not None:
        valid[:] = accepted
    return np.array(keep, dtype=bool), checked, refused


# ---------------------------------------------------------------------------------------------
# xgrammar's matcher methods through tvm-ffi's C ABI

#: the methods the compiled helper calls, with their parameters after ``self`` as tvm-ffi's
#: reflection states them; a matcher type whose methods say anything else is not bound
_XGRAMMAR_METHODS = {
    "traverse_draft_tree": ["Any", "Any", "Any", "Any", "float", "Any"],
    "is_terminated": [],
}
_bound_types: dict[type, bool] = {}
_bound_functions: list[Any] = []  # keeps the bound method functions (and their handles) alive
_bound_helper: list[ModuleType | None] = [None]  # the compiled helper that holds the binding


def xgrammar_handle(matcher: Any) -> int:
    """The address of an ``xgrammar.GrammarMatcher``'s tvm-ffi object when the compiled helper
    can call its methods itself (:func:`traverse_xgrammar`, the chain walks), else 0.

    The first matcher of a type binds the helper to that type's methods (a check of tvm-ffi's
    version and of the methods' signatures; logged at debug level when it declines). The
    address is valid while ``matcher`` lives. Never calls the matcher; does not block."""
    helper = native
    handle = getattr(matcher, "_handle", None)
    if helper is None or handle is None:
        return 0
    kind = type(handle)
    bound = _bound_types.get(kind)
    if bound is None:
        bound = _bound_types[kind] = _bind_xgrammar(helper, kind)
    # the binding lives in the helper that took it: another one standing in has none
    return handle.__chandle__() if bound and helper is _bound_helper[0] else 0  # type: ignore[no-any-return]


def bound_helper() -> ModuleType | None:
    """The compiled helper holding the binding of xgrammar's methods (``None`` until a matcher
    was bound): a handle is usable with this helper only."""
    return _bound_helper[0]


def traverse_xgrammar(
    matcher: Any,
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    rows: np.ndarray,
) -> None:
    """``matcher.traverse_draft_tree(next_token, next_sibling, draft, rows)`` with the GIL
    released when the compiled helper can call it (:func:`xgrammar_handle`), through
    xgrammar's Python binding otherwise; the same rows either way.

    ``next_token``, ``next_sibling``, ``draft``: C-contiguous int64 ``[nodes]``; ``rows``:
    C-contiguous writable int32 ``[nodes, words]``, ``words`` the matcher's width. Blocks until
    the walk is done; raises what xgrammar raises (``RuntimeError`` carrying its message on
    the direct path)."""
    helper = native
    handle = xgrammar_handle(matcher)
    if handle:
        helper.xgrammar_traverse(handle, next_token, next_sibling, draft, rows)  # type: ignore[union-attr]
    else:
        matcher.traverse_draft_tree(next_token, next_sibling, draft, rows)


def _signature(schema: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """``(parameter types, return types)`` of a method's tvm-ffi ``type_schema``: named
    (``{"named_args": {"params": [...], "return": [...]}}``, xgrammar 0.2.9) or positional,
    the return first (``{"args": [return, *params]}``, xgrammar 0.2.8)."""
    named = schema.get("named_args")
    if isinstance(named, dict):
        params = [p.get("type") for p in named.get("params", [])]
        return params, [r.get("type") for r in named.get("return", [])]
    listed = [a.get("type") for a in schema.get("args", [])]
    return listed[1:], listed[:1]


def _bind_xgrammar(helper: ModuleType, kind: type) -> bool:
    """Bind the compiled helper to the methods of xgrammar's matcher type ``kind`` (once per
    process: a second type is declined). True when bound."""
    if os.environ.get("PORTABLE_SPEC_XGRAMMAR_FFI", "") == "0":
        return False
    if not hasattr(helper, "xgrammar_bind") or any(_bound_types.values()):
        return False
    tvm_ffi = sys.modules.get("tvm_ffi")
    info = getattr(kind, "__tvm_ffi_type_info__", None)
    library = getattr(tvm_ffi, "LIB", None)
    version = str(getattr(tvm_ffi, "__version__", ""))
    if info is None or library is None or not version.startswith("0.1."):
        logger.debug("xgrammar through tvm-ffi's C ABI: not bound (tvm-ffi %r)", version)
        return False
    try:
        methods = {method.name: method for method in info.methods}
        for name, params in _XGRAMMAR_METHODS.items():
            method = methods.get(name)
            schema = json.loads(method.metadata["type_schema"]) if method is not None else {}
            said, returns = _signature(schema)
            if (
                method is None
                or method.is_static
                or said != [info.type_key, *params]
                or returns != ["bool"]
            ):
                logger.debug("xgrammar through tvm-ffi's C ABI: %s is %s; not bound", name, said)
                return False
        import ctypes

        def address(symbol: str) -> int:
            return int(ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value or 0)

        functions = [methods["traverse_draft_tree"].func, methods["is_terminated"].func]
        helper.xgrammar_bind(
            address("TVMFFIFunctionCall"),
            address("TVMFFIErrorMoveFromRaised"),
            address("TVMFFIObjectDecRef"),
            functions[0].__chandle__(),
            functions[1].__chandle__(),
            int(info.type_index),
        )
    except Exception as exc:  # an unexpected reflection layout: keep the Python binding
        logger.debug("xgrammar through tvm-ffi's C ABI: not bound (%s)", exc)
        return False
    _bound_functions.extend(functions)
    _bound_helper[0] = helper
    return True
