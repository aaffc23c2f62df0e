"""The compiled helper's only way in: one entry per operation, each with its numpy/Python
implementation or the reason it has none.

The C extension (``portable_spec._native``, sources in ``portable_spec/csrc/``) is built at
install time when a compiler is present; it releases the GIL while it walks. At import the
module is loaded once and its ``ABI_VERSION`` checked; a stale build, a missing one or
``PORTABLE_SPEC_NO_NATIVE=1`` leaves every entry on its fallback. Callers call the entries
below (looked up on this module at call time: :func:`use` switches them all) and never reach
into the compiled module.

==================  ===========================================  =============================
entry               what it does                                 without the compiled helper
==================  ===========================================  =============================
links_valid         True when a batch's links are known valid    False: the caller's Python
                                                                 validator decides
repair_rows         one walked request's rows repaired           numpy/Python
row_repairer        the same, taken once for a loop              numpy/Python
keep_rows           the decision of repair_rows, no writes       numpy/Python
take_rows           listed rows copied out (compact layout)      numpy
traverse_xgrammar   one request's xgrammar walk, GIL released    xgrammar's Python binding
grow_xgrammar       a draft tree's new nodes decided, xgrammar   None: the caller's path
                    matchers moved step by step, GIL released
forced_start        forced_drafts' walk of xgrammar matchers     None: the caller's path
forced_step         in phases, GIL released (forced_xgrammar
forced_run          says whether they are there); forced_run
forced_release      its common call checked and held in C
chain_live          llguidance's written-rows pass               None: the caller's numpy pass
repair_chains       walked chains repaired (vLLM's repeat rule)  none: the vLLM plugin's only,
                                                                 its checked path otherwise
walk_chains         chains of xgrammar matchers walked and       none: taken only when
walk_trees          repaired in one call (or trees)              walks_xgrammar()
pack_chains         draft lists packed, walked                   None: the caller's path
vllm_chains         vLLM's step read from its objects (through   None: the plugin's path
                    the attribute names handed in), walked
vllm_guidance       vLLM's guidance step, one llguidance call    None: the plugin's path
                    per request (names handed in too)
llguidance_walk     one request's walk of an llguidance          None: the Python walk
                    matcher, its methods called from C
llguidance_walks    the same for a batch, straight into the      none: taken only when the
                    mask's rows                                  helper is in use
llguidance_masks    a small host build of llguidance matchers    None: the general build
                    in one call
chain_masks         build_chain_bitmask's common call            None: the general build
span_masks          small chain trees over host tokens           None: the general build
tree_masks          small host trees                             None: the general build
xgrammar_handle     whether the helper can call a matcher        0
walks_xgrammar      whether the helper calls xgrammar itself     False
configure           the library's tables the builds read         (kept for a later helper)
set_walk_hook       a callable run right before a walk drops     (nothing to hook)
                    the GIL (tests act there as another thread)
==================  ===========================================  =============================

The rule of ``repair_rows`` and ``keep_rows``: a node keeps its row iff the matcher was live
at the root and every node on its root path has its token in ``[0, limit)``, not a stop
token, its bit set in its parent's row, and was not refused by xgrammar's walk (a token in the
row's last word past the tokenizer's vocabulary: xgrammar sets such bits in some states but
refuses the token and leaves its row all-zero). Counts: ``checked`` are the children of kept
nodes (the draft tokens the grammar was asked about), ``refused`` those whose token is out of
range, whose bit is clear or that xgrammar refused (an accepted stop token is not a refusal).

Every compiled walk owns what it reads while the GIL is released: a reference to each matcher
it walks, private copies of the tokens, links and stop tokens, and the caller's output arrays
for the whole call. While it walks, its matchers are entered in the held table of
:mod:`portable_spec.pending`, so that no other build (one started with ``wait=False``, one on
another thread) walks them at the same time: a build that finds one of its matchers held
declines (returns ``None``) before writing anything, and the general build then refuses it
with a ``ValueError``.

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
    "ABI_VERSION",
    "chain_live",
    "chain_masks",
    "configure",
    "forced_release",
    "forced_run",
    "forced_start",
    "forced_step",
    "forced_xgrammar",
    "grow_xgrammar",
    "keep_rows",
    "level_xgrammar",
    "links_valid",
    "llguidance_masks",
    "llguidance_walk",
    "llguidance_walks",
    "native",
    "pack_chains",
    "repair_chains",
    "repair_rows",
    "row_repairer",
    "set_walk_hook",
    "span_masks",
    "take_rows",
    "traverse_xgrammar",
    "tree_masks",
    "use",
    "vllm_chains",
    "vllm_guidance",
    "walk_chains",
    "walk_trees",
    "walks_xgrammar",
    "xgrammar_handle",
]

logger = logging.getLogger("portable_spec")

Links = tuple[np.ndarray, np.ndarray, np.ndarray]

#: the entry points' layout these sources expect of the compiled module
ABI_VERSION = 11


def _load() -> ModuleType | None:
    if os.environ.get("PORTABLE_SPEC_NO_NATIVE", "") not in ("", "0"):
        return None
    try:
        module = importlib.import_module("portable_spec._native")
    except ImportError:
        return None
    found = getattr(module, "ABI_VERSION", None)
    if found != ABI_VERSION:
        logger.warning(
            "portable_spec._native is a build of other sources (ABI %s, these sources need "
            "%s): reinstall the library to rebuild it; the numpy/Python paths are used",
            found,
            ABI_VERSION,
        )
        return None
    return module


#: the compiled module in use, or None (every entry on its fallback); switch with :func:`use`
native: ModuleType | None = None

_tables: tuple[Any, ...] | None = None  # what configure() was given


def _decline(*args: Any) -> None:
    """A compiled-only build without the compiled helper: declines, nothing written."""
    return None


def _missing(*args: Any) -> Any:
    raise RuntimeError(
        "portable_spec's compiled helper is not in use; this entry has no fallback (its "
        "callers ask walks_xgrammar() first)"
    )


#: the compiled-only entries: the compiled function, or what answers without it
chain_masks: Callable[..., Any] = _decline
span_masks: Callable[..., Any] = _decline
tree_masks: Callable[..., Any] = _decline
pack_chains: Callable[..., Any] = _decline
vllm_chains: Callable[..., Any] = _decline
vllm_guidance: Callable[..., Any] = _decline
llguidance_walk: Callable[..., Any] = _decline
llguidance_walks: Callable[..., Any] = _missing
llguidance_masks: Callable[..., Any] = _decline
walk_chains: Callable[..., Any] = _missing
walk_trees: Callable[..., Any] = _missing
repair_chains: Callable[..., Any] = _missing
_COMPILED_ONLY = {
    "chain_masks": _decline,
    "span_masks": _decline,
    "tree_masks": _decline,
    "pack_chains": _decline,
    "vllm_chains": _decline,
    "vllm_guidance": _decline,
    "llguidance_walk": _decline,
    "llguidance_walks": _missing,
    "llguidance_masks": _decline,
    "walk_chains": _missing,
    "walk_trees": _missing,
    "repair_chains": _missing,
}


def use(helper: ModuleType | None) -> None:
    """Switch every entry to ``helper`` (a compiled module of this ABI) or, with ``None``, to
    its numpy/Python implementation (the compiled-only builds then decline). The tables given
    to :func:`configure` are handed to the new helper. Not thread-safe: call it when no build
    runs (tests, start-up)."""
    global native
    native = helper
    entries = globals()
    for name, fallback in _COMPILED_ONLY.items():
        entries[name] = fallback if helper is None else getattr(helper, name)
    if helper is not None and _tables is not None:
        helper.configure(*_tables)


def configure(facts: dict[int, Any], held: dict[int, Any], tally: np.ndarray) -> None:
    """Give the compiled builds the library's tables: ``facts`` (id(matcher) -> (weak
    reference, handle, words, vocab_size, stop_ids) of each probed xgrammar matcher the helper
    can call), ``held`` (id(matcher) -> the token of the build walking it) and ``tally`` (the
    float64 build counters). Called once, by :mod:`portable_spec.engines.xgrammar`."""
    global _tables
    _tables = (facts, held, tally, np.empty, np.int32, np.bool_, np.ndarray)
    if native is not None:
        native.configure(*_tables)


def set_walk_hook(hook: Callable[[], Any] | None) -> None:
    """Have every compiled walk call ``hook()`` right before it releases the GIL (after its
    checks, with its matchers held and its inputs copied), or stop with ``None``: the moment
    another thread could change what the walk reads. For tests; does nothing without the
    compiled helper."""
    if native is not None:
        native.set_walk_hook(hook)


def walks_xgrammar() -> bool:
    """Whether the compiled helper is in use and calls xgrammar's methods itself (bound by the
    first xgrammar matcher probed): then :func:`walk_chains` and :func:`walk_trees` take
    matchers whose :func:`xgrammar_handle` is not 0."""
    return native is not None and native is _bound_helper[0]


def links_valid(next_token: np.ndarray, next_sibling: np.ndarray) -> bool:
    """Whether the C-contiguous int64 ``[batch, nodes]`` links are known to be well formed
    (the rules of :func:`portable_spec.topology.validate_links`), GIL released.

    ``False`` means "not known": the links are malformed, or no compiled checker is
    available; the caller then runs the Python validator, which raises naming the problem.
    Does not block on anything but the check itself.
    """
    helper = native
    return helper is not None and bool(helper.links_valid(next_token, next_sibling))


def selection_valid(select: np.ndarray, parents: np.ndarray, n: int) -> bool:
    """Whether every request's selection is known to be a verify tree's, in one compiled pass
    (GIL released): ``select`` C-contiguous int64 ``[batch, m]`` with ``select[b, 0] == 0``,
    each entry a node below ``n`` or -1, no node twice, every selected node's parent
    (``parents``: C-contiguous int64 ``[batch, capacity]``, ``0 < n <= capacity``) selected.

    ``False`` means "not known": the selection is not one, or no compiled helper is available;
    the caller then runs its Python checks, which raise naming the problem.
    """
    helper = native
    return helper is not None and bool(helper.selection_valid(select, parents, n))


def tree_matches(
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    select: np.ndarray,
    parents: np.ndarray,
    tokens: np.ndarray,
) -> bool | None:
    """Whether verify trees are the selected subtrees of drafted trees, in one compiled pass
    (GIL released).

    Args:
        next_token, next_sibling, draft: C-contiguous int64 ``[batch, m]``: each verify tree's
            first-child / next-sibling links and tokens.
        select: C-contiguous int64 ``[batch, m]``: the drafted node at each verify node (-1:
            padding).
        parents, tokens: C-contiguous int64 ``[batch, n]``: the drafted trees (parent -1: the
            root, padding slots).

    Returns:
        True when every request's links are well formed (the rules of
        :func:`portable_spec.topology.validate_links`), each verify node's parent by the links
        is the verify node selecting its drafted node's parent (-1 where there is none) and
        every selected node but the root carries its drafted node's token; False otherwise,
        also for a selection or parent out of range. ``None`` when the compiled helper is not
        in use (the caller checks in Python). Raises ValueError for arrays of other shapes.
    """
    helper = native
    if helper is None:
        return None
    return bool(helper.tree_matches(next_token, next_sibling, draft, select, parents, tokens))


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
    grammar accepts: the root, and each child of a kept node the rule accepts (stop tokens
    included). Blocks until done (GIL released in the compiled helper).
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
    valid]) -> (kept, checked, refused)`` (``kept``: rows kept). Take it once per build: a
    later :func:`use` is not seen by a function already taken. ``valid`` is kept for the
    callers' symmetry (both implementations take the flags)."""
    helper = native
    if helper is not None:
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
    words = rows.shape[1]
    last_word = 32 * (words - 1)  # tokens past it may lie past the tokenizer's vocabulary
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
                if not (0 <= t < limit and (int(row[t >> 5]) >> (t & 31)) & 1) or (
                    t >= last_word and t not in stops and not rows[child].any()
                ):  # out of range, not allowed, or refused by xgrammar's walk
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
#: the single-step methods :func:`grow_xgrammar` calls (bound when their signatures say this
#: too; the walks above do without them): parameters after ``self``, then the return type
_XGRAMMAR_MOVES = {
    "accept_token": (["int", "bool"], "bool"),
    "fill_next_token_bitmask": (["Any", "int", "bool"], "bool"),
    "rollback": (["int"], "None"),
}
#: the queries forced_drafts' walk calls besides the moves (bound when their signatures say
#: this too; :func:`forced_start` declines otherwise)
_XGRAMMAR_FORCED = {
    "find_jump_forward_string": ([], "ffi.String"),
    "is_completed": ([], "bool"),
}
_bound_types: dict[type, bool] = {}
_bound_functions: list[Any] = []  # keeps the bound method functions (and their handles) alive
_bound_helper: list[ModuleType | None] = [None]  # the compiled helper that holds the binding
_forced_bound: list[ModuleType | None] = [None]  # the one whose forced-text queries are bound


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


def traverse_xgrammar(
    matcher: Any,
    next_token: np.ndarray,
    next_sibling: np.ndarray,
    draft: np.ndarray,
    rows: np.ndarray,
) -> bool:
    """One request's xgrammar walk: ``False`` when ``matcher`` is terminated (nothing
    written), else ``matcher.traverse_draft_tree(next_token, next_sibling, draft, rows)`` and
    ``True``. The compiled helper does both with the GIL released, on its own copies of the
    links and tokens (which it checks form a tree), holding the matcher, when it can call the
    matcher (probed by the library, see :func:`xgrammar_handle`); xgrammar's Python binding
    otherwise. The same rows either way.

    ``next_token``, ``next_sibling``, ``draft``: C-contiguous int64 ``[nodes]``; ``rows``:
    C-contiguous writable int32 ``[nodes, words]``, ``words`` the matcher's width. Blocks until
    the walk is done; raises what xgrammar raises (``RuntimeError`` carrying its message on
    the compiled path). The caller holds the matcher (no other build walks it meanwhile).
    """
    helper = native
    if helper is not None and helper is _bound_helper[0]:
        live = helper.xgrammar_traverse(matcher, next_token, next_sibling, draft, rows)
        if live is not None:
            return bool(live)
    if matcher.is_terminated():
        return False
    matcher.traverse_draft_tree(next_token, next_sibling, draft, rows)
    return True


def grow_xgrammar(
    matchers: list[Any],
    requests: np.ndarray,
    limits: np.ndarray,
    rows: np.ndarray,
    parents: np.ndarray,
    tokens: np.ndarray,
    valid: np.ndarray,
    live: np.ndarray,
    start: int,
    end: int,
) -> tuple[int, str | None, int, int] | None:
    """Decide the new nodes ``start .. end - 1`` of draft trees grown level by level (a
    :class:`portable_spec.DraftSession`'s), each request's xgrammar matcher moved through its
    single-step methods with the GIL released: one accept and one fill per new node, never a
    refill of a node decided before. With ``start`` 0 the root is new too: its row is the
    matcher's own (all-allowed when the matcher has ended), valid, live unless ended.

    Args:
        matchers: the xgrammar matcher of each listed request (probed by the library, at most
            ``words`` words wide: a narrower one's rows get zeros past its width).
        requests: int64 ``[count]``, each matcher's row of the arrays below (distinct).
        limits: int64 ``[count]``: tokens at or past it are refused without asking.
        rows: int32 ``[batch, capacity, words]``: rows of nodes below ``start`` are read (a
            node's token must be allowed by its parent's row), rows of new nodes written
            (the matcher's row when live, all-allowed otherwise).
        parents, tokens: int64 ``[batch, capacity]``: each node's parent (an earlier node, or
            -1: padding) and token.
        valid, live: bool ``[batch, capacity]``: ``live`` of nodes below ``start`` is read;
            both are written for new nodes (valid: the grammar accepts the root path, an end
            token included; live: valid and not terminated).

    Returns:
        ``(failed, message, checked, refused)``: ``failed`` -1, or the index into ``matchers``
        of the one xgrammar raised on (its new nodes written refused, later requests
        untouched; ``message``: xgrammar's words); ``checked``: new nodes whose token the
        grammar was asked about (children of live nodes), ``refused``: those it refused.
        ``None`` when the helper cannot do it (not in use, xgrammar's
        single-step methods not bound, a matcher it cannot call, or one another build walks):
        nothing written, nothing moved. Every matcher is back in its state when it returns.
        Blocks until done.
    """
    helper = native
    if helper is None or helper is not _bound_helper[0]:
        return None
    done = helper.xgrammar_grow(
        matchers, requests, limits, rows, parents, tokens, valid, live, start, end
    )
    if done is None:
        return None
    return int(done[2]), done[3], int(done[0]), int(done[1])


def level_xgrammar(
    matchers: list[Any],
    requests: np.ndarray,
    limits: np.ndarray,
    rows: np.ndarray,
    parents: np.ndarray,
    tokens: np.ndarray,
    valid: np.ndarray,
    live: np.ndarray,
    first: int,
    level_parents: np.ndarray,
    level_tokens: np.ndarray,
    out: np.ndarray | None,
) -> tuple[int, bool, int, int, int, str | None] | None:
    """A level of a :class:`portable_spec.DraftSession` whose constrained requests are all
    walked by :func:`grow_xgrammar`, in one call: checked, written into the tree, decided, and
    its rows copied out.

    Args:
        matchers, requests, limits, rows, parents, tokens, valid, live: as for
            :func:`grow_xgrammar` (``parents``, ``tokens``, ``valid``, ``live`` are written for
            the level's nodes). Requests not listed in ``requests`` are unconstrained.
        first: the level's first node id (>= 1; ``first + k <= capacity``).
        level_parents, level_tokens: int64 ``[batch, k]`` C-contiguous: each new node's parent
            (an earlier node that is not a padding slot, or -1: a padding slot) and token (any
            value; a padding slot's is stored as 0). Copied before they are read.
        out: int32 ``[batch * k, words]`` C-contiguous, or None: where the level's rows are
            copied (row ``b * k + j``: node ``first + j`` of request ``b``).

    Returns:
        ``(status, padded, checked, rejected, failed, message)``: ``status`` 0 when done
        (``failed``, ``message``, ``checked``, ``rejected`` as :func:`grow_xgrammar` says; with
        ``failed >= 0`` nothing is copied); 1 when a parent is malformed: nothing written
        (the caller names it); 2 when the walk declined: the columns and the unconstrained
        requests' rows written, the listed requests' rows not, nothing copied. ``padded``:
        whether the level has a padding slot. ``None`` when the helper is not in use: nothing
        written. Blocks until done.
    """
    helper = native
    if helper is None or helper is not _bound_helper[0]:
        return None
    status, padded, checked, refused, failed, message = helper.xgrammar_level(
        matchers, requests, limits, rows, parents, tokens, valid, live, first,
        level_parents, level_tokens, out,
    )  # fmt: skip
    return int(status), bool(padded), int(checked), int(refused), int(failed), message


def forced_xgrammar() -> bool:
    """Whether :func:`forced_start` and :func:`forced_step` can walk xgrammar matchers (the
    compiled helper in use, bound to xgrammar's moves and forced-text queries)."""
    helper = native
    return helper is not None and helper is _bound_helper[0] and helper is _forced_bound[0]


def forced_start(
    matchers: list[Any],
    drafts: list[list[int]],
    content_ends: list[bool],
    state: np.ndarray,
    out: np.ndarray,
    rows: np.ndarray,
    replies: dict[bytes, bytes] | None = None,
) -> tuple[list[Any] | None, int, str | None, list[list[int]] | None] | None:
    """The first phases of :func:`portable_spec.forced_drafts`' walk of xgrammar matchers
    (``portable_spec/csrc/forced.c`` says the protocol), the GIL released.

    Args:
        matchers: xgrammar matchers probed by the library (each at most ``words`` wide).
        drafts: per matcher its proposed drafts (a list of ints).
        content_ends: per matcher whether its first draft ends a reasoning (refused: nothing).
        state: int64 ``[count, 8]``: columns 2 (tokens already in ``out``) and 3 (the most
            tokens) set by the caller; the walk's state after.
        out: int64 ``[count, cap]``: each request's drafts (``cap`` >= its most tokens).
        rows: int32 ``[count, words]``: the masks the stability check asks for.
        replies: forced text (its UTF-8 bytes as xgrammar gives them) -> the answer
            :func:`forced_step` would be given to it, packed as int64 ``[keep, len(tokens),
            len(words), entries, *tokens, *words, *known]`` bytes; texts found there are
            answered without returning (the phases go on), the others asked. Read with the
            GIL, copied.

    Returns:
        ``(asks, failed, message, drafts)``: ``asks`` None when no request asks anything,
        else per matcher None (done, rolled back, ``out[c, :state[c, 2]]`` its drafts), a
        forced text (str, or bytes that are not whole characters) whose tokens
        :func:`forced_step` takes, or True (the mask after the text in ``rows[c]``:
        :func:`forced_step` takes how many of its tokens are stable); ``failed`` -1, or the
        matcher xgrammar raised on (``message``); ``drafts`` every request's drafts (lists
        of ints) once all are done, else None. Matchers not done are moved by ``state[c,
        1]`` tokens, to be rolled back by the caller if it stops. ``None`` when the helper
        cannot walk them (nothing moved).
    """
    helper = native
    if not forced_xgrammar() or helper is None:
        return None
    return helper.xgrammar_forced_start(  # type: ignore[no-any-return]
        matchers, drafts, content_ends, state, out, rows, replies
    )


def forced_step(
    matchers: list[Any],
    answers: list[Any],
    state: np.ndarray,
    out: np.ndarray,
    rows: np.ndarray,
    replies: dict[bytes, bytes] | None = None,
) -> tuple[list[Any] | None, int, str | None, list[list[int]] | None] | None:
    """The next phases after :func:`forced_start` (or :func:`forced_run`): ``answers`` one
    per matcher, None where it asked nothing, else a tuple ``(tokens, keep)``: to a text, its
    tokens and how many are stable whatever follows (-1: unknown without the mask, -2: the
    text had no whole character), with -1 optionally ``(tokens, -1, words, known)``: the
    counts known for some values of the mask words ``words`` (``known`` flat: per entry those
    values, then its count), looked up after the fill instead of asking; to True, the text's
    tokens and how many of them are stable. ``replies`` as for :func:`forced_start`. Returns
    what :func:`forced_start` returns; ``None`` when the helper was switched meanwhile
    (nothing moved by this call)."""
    helper = native
    if not forced_xgrammar() or helper is None:
        return None
    return helper.xgrammar_forced_step(  # type: ignore[no-any-return]
        matchers, answers, state, out, rows, replies
    )


def forced_run(
    matchers: list[Any] | tuple[Any, ...],
    drafts: list[Any] | tuple[Any, ...],
    limits: int | list[int],
    token: object,
    block: np.ndarray,
    cap: int,
    words: int,
    replies: dict[bytes, bytes] | None,
) -> tuple[list[Any] | None, int, str | None, list[list[int]] | None] | None:
    """:func:`forced_start` for :func:`portable_spec.forced_drafts`' common call, its checks
    made in C too: every matcher an xgrammar matcher the library probed (at most ``words``
    int32 words wide), ``drafts`` one exact list or tuple of exact ints per matcher,
    ``limits`` an int for all or a list of ints, each from 0 to ``cap``, no reasoning. Its
    arrays are carved out of ``block`` (a 1-D int64 array of at least ``count * (8 + cap) +
    ceil(count * words / 2)``): the state ``[count, 8]``, the drafts ``[count, cap]``, then
    the rows (int32 ``[count, words]``), as :func:`forced_step` takes them. The matchers are
    entered in the held table (:mod:`portable_spec.pending`) under ``token`` and stay there
    until :func:`forced_release`, whatever this returns. Returns what :func:`forced_start`
    returns, or ``None`` (nothing held, nothing moved) for anything else, a matcher another
    build holds or one listed twice: the caller's checked path then serves, and names what is
    wrong."""
    helper = native
    if not forced_xgrammar() or helper is None:
        return None
    return helper.xgrammar_forced_run(  # type: ignore[no-any-return]
        matchers, drafts, limits, token, block, cap, words, replies
    )


def forced_release(token: object, matchers: list[Any] | tuple[Any, ...]) -> None:
    """Take out of the held table what :func:`forced_run` entered under ``token`` (nothing
    for a matcher no longer held under it)."""
    helper = native
    if helper is not None:
        helper.xgrammar_forced_release(token, matchers)
    elif _tables is not None:  # the helper switched off meanwhile
        held = _tables[1]
        for g in matchers:
            if held.get(id(g)) is token:
                del held[id(g)]


def chain_live(
    target: np.ndarray,
    rows: np.ndarray,
    tokens: np.ndarray,
    usable: np.ndarray,
    ended: np.ndarray,
    ends: np.ndarray,
    sentinel: tuple[int, int],
) -> tuple[list[int], list[tuple[int, int, bool, bool]]] | None:
    """After llguidance's executor wrote chains into ``target`` (int32 ``[rows, width]``;
    request ``k``'s nodes are ``target`` rows ``rows[k]``, int64 ``[count, nodes]``, its
    drafts int64 ``tokens[k]``, ``[count, nodes - 1]``): per request how many leading drafts
    its parents' rows allow (at most ``usable[k]``, int64 ``[count]``), and in order the
    ``(request, draft, intact, end)`` of each such draft whose own row still holds both
    ``sentinel`` words or which ``ends`` flags (bool ``[count, nodes - 1]``: an end token),
    none for ``ended`` requests (bool ``[count]``): the caller decides those on a fork.
    ``None`` without the compiled helper (the caller's numpy pass answers). Holds the GIL (it
    makes the list of checks); every index is bounded where it is read."""
    helper = native
    if helper is None:
        return None
    return helper.chain_live(  # type: ignore[no-any-return]
        target, rows, tokens, usable, ended, ends, sentinel[0], sentinel[1]
    )


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
    if any(_bound_types.values()):
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
        queries = {name: (params, "bool") for name, params in _XGRAMMAR_METHODS.items()}
        _matching(info, methods, queries, "its draft-tree walk")
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
    except Exception as exc:  # a signature that differs, an unexpected reflection layout
        logger.debug("xgrammar through tvm-ffi's C ABI: not bound (%s)", exc)
        return False
    _bound_functions.extend(functions)
    _bound_helper[0] = helper
    _bind_moves(helper, info, methods)
    return True


def _matching(info: Any, methods: dict[str, Any], table: dict[str, Any], what: str) -> list[Any]:
    """The functions of ``table``'s methods (name -> (parameters, returned)) when every
    signature agrees; raises ``LookupError`` (logged by the caller) when one does not."""
    for name, (params, returned) in table.items():
        method = methods.get(name)
        schema = json.loads(method.metadata["type_schema"]) if method is not None else {}
        said, returns = _signature(schema)
        if (
            method is None
            or method.is_static
            or said != [info.type_key, *params]
            or returns != [returned]
        ):
            raise LookupError(f"xgrammar's {name} is {said} -> {returns}; {what} not bound")
    return [methods[name].func for name in table]


def _bind_moves(helper: ModuleType, info: Any, methods: dict[str, Any]) -> None:
    """Bind the single-step methods of :data:`_XGRAMMAR_MOVES` when their signatures agree
    (else :func:`grow_xgrammar` declines; logged at debug level)."""
    try:
        functions = _matching(info, methods, _XGRAMMAR_MOVES, "its moves")
        helper.xgrammar_bind_moves(*(f.__chandle__() for f in functions))
    except Exception as exc:  # a signature that differs, an unexpected reflection layout
        logger.debug("xgrammar's moves not bound (%s)", exc)
        return
    _bound_functions.extend(functions)
    _bind_forced(helper, info, methods)


def _bind_forced(helper: ModuleType, info: Any, methods: dict[str, Any]) -> None:
    """Bind the queries of :data:`_XGRAMMAR_FORCED` when their signatures agree (else
    :func:`forced_start` declines; logged at debug level)."""
    try:
        functions = _matching(info, methods, _XGRAMMAR_FORCED, "its forced-text queries")
        helper.xgrammar_bind_forced(*(f.__chandle__() for f in functions))
    except Exception as exc:  # a signature that differs, an unexpected reflection layout
        logger.debug("xgrammar's forced-text queries not bound (%s)", exc)
        return
    _bound_functions.extend(functions)
    _forced_bound[0] = helper


use(_load())
