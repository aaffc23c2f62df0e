"""``forced_drafts``: the grammar's own continuation as speculative drafts.

On structured outputs the grammar alone decides many tokens (a JSON key after its opening
quote, the rest of an enum value, the closing brackets). Drafted, they cost the model nothing
but the verify forward they ride in, and they cannot change an output: the model verifies them
like any draft. :func:`forced_drafts` extends each request's proposed drafts (a drafter's, or
none) by what its grammar forces, in the tokens the model itself would write:

1. the longest prefix of the proposed drafts that the grammar accepts (each token allowed by
   the mask of the state before it);
2. then the forced continuation from there, in rounds: the engine's forced text, segmented
   by the model's tokenizer (:mod:`portable_spec.drafting.segment`) and taken token by token
   (a segmentation the grammar refuses ends the drafts there), its last tokens kept only where
   no character the grammar allows next would merge with them; then, where the grammar
   allows a single token (the end token once the output is complete; outlines-core's only
   kind of forced token), that token; and again.

Matchers never move: llguidance matchers and protocol matchers with ``fork()`` are walked on a
fork; xgrammar matchers (whose rollback is unlimited and cheaper than a fork), outlines-core
guides and protocol matchers without ``fork()`` are moved and rolled back before the call
returns.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import chain
from numbers import Integral
from typing import Any

import numpy as np

from portable_spec import native
from portable_spec.builder.reasoning import Reasoning, check_reasoning
from portable_spec.drafting.batched import (
    MAX_TOKENS,
    draft_xgrammar_batch,
    draft_xgrammar_common,
)
from portable_spec.drafting.segment import Segmenter, segmenter_for
from portable_spec.engines.cursor import Cursor, single_token, whole_characters
from portable_spec.engines.generic import ProtocolCursor, generic_info
from portable_spec.engines.llguidance import LLGuidanceCursor, check_llmatcher, probe_llguidance
from portable_spec.engines.outlines import OutlinesCursor
from portable_spec.engines.walk import ENDED_FREE, ENDED_HELD, REFUSED
from portable_spec.engines.xgrammar import (
    XGrammarCursor,
    has_forced_tokens,
    probe_xgrammar,
    xgrammar_info,
)
from portable_spec.errors import MatcherError
from portable_spec.grammars import (
    GENERIC,
    LLGUIDANCE,
    NONE,
    OUTLINES,
    XGRAMMAR,
    MatcherInfo,
    classify_grammars,
    matcher_kind,
)
from portable_spec.masks import MAX_VOCAB_SIZE, words_for
from portable_spec.pending import hold_matchers, release_matchers
from portable_spec.tree import host_array

__all__ = ["forced_drafts", "forced_text"]

_CURSORS = {
    XGRAMMAR: XGrammarCursor,
    LLGUIDANCE: LLGuidanceCursor,
    OUTLINES: OutlinesCursor,
    GENERIC: ProtocolCursor,
}
_ENDED = (ENDED_HELD, ENDED_FREE)
_NO_VOCAB = 1 << 62
_LISTS, _INTS = frozenset([list]), frozenset([int])
# xgrammar requests with a tokenizer take _draft_xgrammar (the common case, without the cursor's
# calls); False: every request takes the cursors (the tests compare both)
_SHORT_PATH = True
# xgrammar requests on the short path walk in batched compiled phases when the compiled helper
# can call xgrammar (drafting.batched); False: each takes _draft_xgrammar (the tests compare)
_BATCHED = True
_BATCH_FROM = 1  # requests; fewer take _draft_xgrammar (the compiled phases win from one on)
#: the requests set aside for the compiled phases: indices, drafts, reasoning starts, whether
#: the first draft ends a reasoning
_Later = tuple[list[int], list[list[int]], list[list[int]], list[bool]]
# Drafted tokens this many tokens before a forced text's end are taken as they are: what
# follows the text only re-segments its last pre-tokenizer piece.
_FAR_FROM_END = 8  # unconstrained requests without vocab_size: only negative ids end drafts


def forced_drafts(
    matchers: Sequence[Any],
    drafts: Any,
    max_len: int | Sequence[int],
    *,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    reasoning: Reasoning | None = None,
) -> list[list[int]]:
    """Each request's drafts extended by what its grammar forces.

    Args:
        matchers: one entry per request: ``None`` (unconstrained), an
            ``xgrammar.GrammarMatcher``, an ``llguidance.LLMatcher``, an ``outlines_core.Guide``
            or a :class:`portable_spec.GrammarMatcherLike` (forced text through its optional
            ``find_jump_forward_string()`` -> str or bytes, forced tokens through its optional
            ``find_jump_forward_tokens()`` -> token ids), each in the state after the
            request's committed tokens. None of them is moved (forks are walked, or the
            matcher is rolled back before the call returns).
        drafts: the proposed drafts per request: a sequence of int sequences (one per request,
            any lengths, possibly empty), or an int ``[batch, n]`` host array (numpy, or a
            framework's host array). A negative id ends a request's drafts (padding).
        max_len: the most tokens returned per request: one int for all, or one per request
            (ints >= 0).
        tokenizer: the model's tokenizer, a Hugging Face tokenizer (its ``encode``, without
            special tokens) or a callable ``str -> list[int]``. Forced text is drafted in its
            segmentation. Needed for xgrammar before 0.2.9 and for protocol matchers that only
            have ``find_jump_forward_string()``; without it each engine's own forced tokens
            are used (xgrammar 0.2.9's ``find_jump_forward_tokens``, a greedy longest-token
            segmentation that may differ from the tokenizer's; llguidance's
            ``compute_ff_tokens``). outlines-core's forced tokens are those of states that
            allow a single token, either way. Pass the same object every call: its
            segmentations are cached per forced text.
        vocab_size: the model's vocabulary size (the logits' width). Optional for xgrammar
            and llguidance matchers (their own vocabulary is used); needed with outlines-core
            guides and protocol matchers without a ``vocab_size`` attribute. Draft ids at or
            past it (or past a matcher's own vocabulary) end the drafts.
        reasoning: a :class:`portable_spec.Reasoning`: requests still reasoning draft freely
            (nothing is forced) up to the token that ends their reasoning; after it their
            grammar takes the rest of the drafts and forces as usual (a content end token is
            the grammar's first token: if the grammar refuses it, the drafts end before it).

    Returns:
        One list of int token ids per request, at most its ``max_len`` long: the longest
        prefix of its drafts the grammar accepts, then the grammar's forced continuation
        from there (an end token included where the grammar allows nothing else). Every
        token is allowed by the grammar's mask after the tokens before it. Unconstrained
        requests get their drafts up to the first negative id (or id past ``vocab_size``).

    Raises:
        TypeError, ValueError: bad matchers, drafts, ``max_len``, tokenizer, ``vocab_size`` or
            ``reasoning``; a matcher another build is walking; an xgrammar matcher without
            ``find_jump_forward_tokens`` (xgrammar < 0.2.9) and no tokenizer. Raised before
            any matcher moves.
        MatcherError: a matcher (or the tokenizer on a new forced text) raised; every matcher
            is back in its state.

    Blocks for host work only, on the calling thread: per constrained request one accept per
    draft and forced token (then one rollback; llguidance and forking protocol matchers walk a
    fork instead), the engine's forced text, the tokenizer on forced texts not seen before
    (cached per text), and one mask fill where a forced text ends next to characters that
    would merge with it or where the grammar may end. With the compiled helper, xgrammar
    requests are walked together in compiled phases (the GIL released), the same calls and
    tokens (:mod:`portable_spec.drafting.batched`); a call of probed xgrammar matchers, lists
    of int drafts, int limits and no reasoning is checked and walked in one compiled call.
    Hold the matchers for the call: do not move them from another thread meanwhile (another
    build over them is refused).
    """
    if (
        tokenizer is not None
        and reasoning is None
        and type(matchers) in (list, tuple)
        and len(matchers) >= _BATCH_FROM
        and type(drafts) in (list, tuple)
        and _SHORT_PATH
        and _BATCHED
        and native.forced_xgrammar()
    ):  # the common call: checked, held and walked in compiled phases (None: anything else)
        common = _common_limits(max_len, len(matchers))
        words = _common_words(vocab_size)
        if common is not None and words is not None:
            segmenter = segmenter_for(tokenizer)
            drafted = draft_xgrammar_common(matchers, drafts, common, words, segmenter)
            if drafted is not None:
                return drafted
    batch = _batch(matchers)
    rows = _drafts(drafts, batch)
    limits = _limits(max_len, batch)
    if vocab_size is not None:
        kinds, infos = classify_grammars(matchers, batch, vocab_size)
    else:
        kinds, infos = _own_facts(matchers)
    segmenter = None if tokenizer is None else segmenter_for(tokenizer)
    if segmenter is None:
        for b, kind in enumerate(kinds):
            if kind == XGRAMMAR and not has_forced_tokens(matchers[b]):
                raise ValueError(
                    f"matchers[{b}] is an xgrammar matcher without find_jump_forward_tokens "
                    "(xgrammar < 0.2.9): pass tokenizer= to segment its forced text"
                )
    rule = None
    if reasoning is not None:
        rule = check_reasoning(reasoning, batch, vocab_size or _NO_VOCAB)
    token, held = hold_matchers(matchers)  # refused here if another build walks one
    rows_of: dict[int, np.ndarray] = {}  # scratch mask rows by width (the short path's)
    short = segmenter is not None and _SHORT_PATH
    batched = short and _BATCHED and native.forced_xgrammar()
    free_vocab = vocab_size or _NO_VOCAB
    try:
        out: list[list[int]] = [[] for _ in range(batch)]
        if (
            batched
            and rule is None
            and batch >= _BATCH_FROM
            and kinds.count(XGRAMMAR) == batch
            and min(limits) > 0
            and max(limits) <= MAX_TOKENS
        ):  # the common case: every request to the compiled phases, as the loop below sets
            assert segmenter is not None
            everyone = list(range(batch))
            starts: list[list[int]] = [[] for _ in everyone]
            later: _Later = (everyone, rows, starts, [False] * batch)
            _draft_later(matchers, infos, limits, later, segmenter, out, rows_of)
            return out
        later = ([], [], [], [])  # the requests set aside for the compiled phases
        for b, (kind, info, row, limit) in enumerate(zip(kinds, infos, rows, limits, strict=True)):
            if kind == NONE or limit == 0:
                out[b] = _free(row, limit, free_vocab)
                continue
            assert info is not None
            start: list[int] = []
            content_end = False
            if rule is not None and rule.active[b]:
                start, rest = _reasoning_prefix(row, limit, info.vocab_size, rule)
                if rest is None:  # still reasoning after the drafts: nothing forced
                    out[b] = start
                    continue
                row, content_end = rest, bool(rest) and rest[0] in rule.content_ends
            if batched and kind == XGRAMMAR and info.handle and limit <= MAX_TOKENS:
                later[0].append(b)
                later[1].append(row)
                later[2].append(start)
                later[3].append(content_end)
                continue
            try:
                out[b] = _draft_one(
                    matchers[b],
                    kind,
                    info,
                    row,
                    limit,
                    start,
                    segmenter,
                    content_end,
                    short,
                    rows_of,
                )
            except BaseException as exc:
                raise MatcherError(b, exc) from exc
        if later[0]:
            assert segmenter is not None
            _draft_later(matchers, infos, limits, later, segmenter, out, rows_of)
        return out
    finally:
        release_matchers(token, held)


def _draft_one(
    matcher: Any,
    kind: int,
    info: MatcherInfo,
    row: list[int],
    limit: int,
    start: list[int],
    segmenter: Segmenter | None,
    content_end: bool,
    short: bool,
    rows_of: dict[int, np.ndarray],
) -> list[int]:
    """One request's drafts on the per-request paths (its index is named by the caller)."""
    if short and kind == XGRAMMAR:
        assert segmenter is not None
        return _draft_xgrammar(matcher, info, row, limit, start, segmenter, content_end, rows_of)
    cursor = _CURSORS[kind](matcher, info)
    try:
        return _draft(cursor, row, limit, start, segmenter, content_end)
    finally:
        cursor.close()


def _draft_later(
    matchers: Sequence[Any],
    infos: list[MatcherInfo | None],
    limits: list[int],
    later: _Later,
    segmenter: Segmenter,
    out: list[list[int]],
    rows_of: dict[int, np.ndarray],
) -> None:
    """The xgrammar requests set aside for the compiled phases, into ``out``: walked in the
    phases from :data:`_BATCH_FROM` requests on, on the per-request path otherwise or where
    the helper declines."""
    index, rows, starts, content_ends = later
    drafted = None
    if len(index) >= _BATCH_FROM:
        drafted = draft_xgrammar_batch(
            [matchers[b] for b in index],
            [infos[b] for b in index],  # type: ignore[misc]
            index,
            rows,
            [limits[b] for b in index],
            starts,
            content_ends,
            segmenter,
        )
    if drafted is not None:
        for b, tokens in zip(index, drafted, strict=True):
            out[b] = tokens
        return
    for b, row, start, content_end in zip(index, rows, starts, content_ends, strict=True):
        info = infos[b]
        assert info is not None
        try:
            out[b] = _draft_xgrammar(
                matchers[b], info, row, limits[b], start, segmenter, content_end, rows_of
            )
        except BaseException as exc:
            raise MatcherError(b, exc) from exc


def forced_text(matcher: Any) -> str:
    """The text every continuation of ``matcher``'s state starts with, in whole characters
    (xgrammar ``find_jump_forward_string``, llguidance ``compute_ff_bytes``, a protocol
    matcher's optional ``find_jump_forward_string``); "" where nothing is forced, the grammar
    ended, or the engine cannot say (outlines-core). Moves nothing; host work only. Raises
    TypeError for an object that is not a matcher."""
    kind = matcher_kind(matcher)
    if kind < 0:
        classify_grammars([matcher], 1, 32)  # names what is missing
    if kind == XGRAMMAR:
        if matcher.is_terminated():
            return ""
        try:
            return str(matcher.find_jump_forward_string())
        except UnicodeDecodeError as exc:  # xgrammar 0.2.8
            return whole_characters(bytes(exc.object))
    if kind == LLGUIDANCE:
        if matcher.is_error() or matcher.is_stopped():
            return ""
        return whole_characters(bytes(matcher.compute_ff_bytes()))
    if kind == GENERIC:
        find = getattr(matcher, "find_jump_forward_string", None)
        if not callable(find) or matcher.is_terminated():
            return ""
        text = find()
        return whole_characters(bytes(text)) if isinstance(text, (bytes, bytearray)) else str(text)
    return ""


# -- arguments ---------------------------------------------------------------------------------
def _batch(matchers: Any) -> int:
    if type(matchers) in (list, tuple):
        return len(matchers)
    if isinstance(matchers, (str, bytes)) or not isinstance(matchers, Sequence):
        raise TypeError(
            f"matchers must be a sequence with one entry per request, got {type(matchers).__name__}"
        )
    return len(matchers)


def _token_row(row: Any, b: int) -> list[int]:
    if type(row) is list and all(type(t) is int for t in row):
        return row  # read only
    if isinstance(row, np.ndarray):
        if row.ndim != 1 or (row.size and row.dtype.kind not in "iu"):
            raise TypeError(
                f"drafts[{b}] must be a 1-D integer array, got dtype {row.dtype} and shape "
                f"{row.shape}"
            )
        return [int(t) for t in row.tolist()]
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise TypeError(f"drafts[{b}] must be a sequence of int token ids, got {row!r}")
    out = []
    for i, t in enumerate(row):
        if type(t) is int:
            out.append(t)
            continue
        if isinstance(t, (bool, np.bool_)):
            raise TypeError(f"drafts[{b}][{i}] is the bool {t!r}, not a token id")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise TypeError(
                f"drafts[{b}][{i}] = {t!r} ({type(t).__name__}) is not an int token id"
            ) from None
    return out


def _drafts(drafts: Any, batch: int) -> list[list[int]]:
    """Per request, its drafts as a list of ints (negative ids kept: they end the drafts)."""
    if isinstance(drafts, (list, tuple)):
        if len(drafts) != batch:
            raise ValueError(f"drafts has {len(drafts)} entries for {batch} matchers")
        if set(map(type, drafts)) <= _LISTS and set(map(type, chain(*drafts))) <= _INTS:
            return list(drafts)  # lists of ints: each row read only, as _token_row keeps it
        return [_token_row(row, b) for b, row in enumerate(drafts)]
    if isinstance(drafts, (str, bytes, dict)) or drafts is None:
        raise TypeError(f"drafts must be one int sequence per request, got {drafts!r}")
    array = host_array("drafts", drafts)
    if array.ndim != 2 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(
            f"drafts must be an int [batch, n] array, got dtype {array.dtype} and shape "
            f"{array.shape}"
        )
    if array.shape[0] != batch:
        raise ValueError(f"drafts has {array.shape[0]} rows for {batch} matchers")
    return [[int(t) for t in row] for row in array.tolist()]


def _limits(max_len: Any, batch: int) -> list[int]:
    def one(value: Any, name: str) -> int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
            raise TypeError(f"{name} must be a non-negative int, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        return int(value)

    if type(max_len) is int and max_len >= 0:
        return [max_len] * batch
    if isinstance(max_len, Integral) and not isinstance(max_len, (bool, np.bool_)):
        return [one(max_len, "max_len")] * batch
    if isinstance(max_len, np.ndarray):
        max_len = max_len.tolist()
    if isinstance(max_len, (str, bytes)) or not isinstance(max_len, Sequence):
        raise TypeError(f"max_len must be an int or one int per request, got {max_len!r}")
    if len(max_len) != batch:
        raise ValueError(f"max_len has {len(max_len)} entries for {batch} matchers")
    return [one(v, f"max_len[{b}]") for b, v in enumerate(max_len)]


def _common_limits(max_len: Any, batch: int) -> int | list[int] | None:
    """``max_len`` when the common compiled call takes it (an int, or a list of ints, each
    from 0 to ``MAX_TOKENS``, not all 0), else None (the checked path takes it)."""
    if type(max_len) is int:
        return max_len if 0 < max_len <= MAX_TOKENS else None
    if (
        type(max_len) is list
        and len(max_len) == batch
        and set(map(type, max_len)) <= _INTS
        and min(max_len, default=0) >= 0
        and 0 < max(max_len, default=0) <= MAX_TOKENS
    ):
        return max_len
    return None


def _common_words(vocab_size: Any) -> int | None:
    """The mask row width (int32 words) the common compiled call walks with: the model's for
    a plain ``vocab_size`` (a matcher wider than it declines the call: the checked path names
    it), 0 without one (the widest matcher seen so far), else None."""
    if vocab_size is None:
        return 0
    if type(vocab_size) is int and 0 < vocab_size <= MAX_VOCAB_SIZE:
        return words_for(vocab_size)
    return None


def _own_facts(matchers: Sequence[Any]) -> tuple[list[int], list[MatcherInfo | None]]:
    """Kinds and facts of ``matchers`` from their own vocabularies (no ``vocab_size``)."""
    kinds: list[int] = []
    infos: list[MatcherInfo | None] = []
    seen: dict[int, int] = {}
    for i, g in enumerate(matchers):
        kind = matcher_kind(g)
        if kind == XGRAMMAR:  # the common case first
            info = xgrammar_info(g)
            if info is not None and seen.setdefault(id(g), i) == i:
                kinds.append(kind)
                infos.append(info)
                continue
        if kind == NONE:
            kinds.append(NONE)
            infos.append(None)
            continue
        if (
            kind < 0
            or kind == OUTLINES
            or (kind == GENERIC and getattr(g, "vocab_size", None) is None)
        ):
            # classify_grammars names what is wrong with an unknown object; the others need
            # the model's vocabulary to size their rows
            if kind < 0:
                classify_grammars([g], 1, 32)
            raise ValueError(
                f"matchers[{i}] is a {type(g).__name__}: pass vocab_size= (its mask width is "
                "the model's vocabulary)"
            )
        first = seen.setdefault(id(g), i)
        if first != i:
            raise ValueError(
                f"matchers[{i}] is the same matcher object as matchers[{first}]; each request "
                "needs its own matcher"
            )
        if kind == XGRAMMAR:
            info = xgrammar_info(g) or probe_xgrammar(g, 1)
        elif kind == LLGUIDANCE:
            try:
                check_llmatcher(g)
            except RuntimeError as exc:
                raise MatcherError(i, exc) from exc
            info = probe_llguidance(g, 1)
        else:
            info = generic_info(g, i, int(g.vocab_size))
        kinds.append(kind)
        infos.append(info)
    return kinds, infos


# -- one request -------------------------------------------------------------------------------
def _free(row: list[int], limit: int, vocab: int) -> list[int]:
    """Drafts of an unconstrained request: up to the first id outside the vocabulary."""
    out = []
    for t in row[:limit]:
        if not 0 <= t < vocab:
            break
        out.append(t)
    return out


def _reasoning_prefix(
    row: list[int], limit: int, vocab: int, rule: Any
) -> tuple[list[int], list[int] | None]:
    """A request still reasoning: its drafts up to the token that ends the reasoning, and the
    drafts its grammar takes after it (None: the drafts end still reasoning)."""
    out: list[int] = []
    for i, t in enumerate(row):
        if len(out) >= limit or not 0 <= t < vocab:
            return out, None
        if t in rule.ends:
            out.append(t)
            return out, row[i + 1 :]
        if t in rule.content_ends:
            return out, row[i:]  # the grammar's first token
        out.append(t)
    return out, None


def _draft(
    cursor: Cursor,
    row: list[int],
    limit: int,
    out: list[int],
    segmenter: Segmenter | None,
    content_end: bool = False,
) -> list[int]:
    """The accepted prefix of ``row`` then the forced continuation, appended to ``out`` (the
    free tokens of a reasoning request before its grammar starts) up to ``limit`` tokens.
    ``content_end``: ``row[0]`` ends a reasoning as the grammar's first token (refused: the
    request is still reasoning, nothing is forced)."""
    if not cursor.alive():
        return out
    for i, t in enumerate(row):
        if len(out) >= limit:
            return out
        outcome = cursor.take(t)
        if outcome == REFUSED:
            if i == 0 and content_end:
                return out
            break
        out.append(t)
        if outcome in _ENDED:
            return out
    _force(cursor, out, limit, segmenter)
    return out


def _draft_xgrammar(
    matcher: Any,
    info: MatcherInfo,
    row: list[int],
    limit: int,
    out: list[int],
    segmenter: Segmenter,
    content_end: bool,
    rows_of: dict[int, np.ndarray],
) -> list[int]:
    """:func:`_draft` for an xgrammar matcher, its cursor's calls made in place (the same
    tokens): the matcher is walked forward and rolled back before returning. A forced text
    taken whole is followed by no other (xgrammar's is the longest): only a single-token state
    (the end token) is looked for after it, with the mask the segmentation check filled."""
    if matcher.is_terminated():
        return out
    vocab, stops, accept = info.vocab_size, info.stop_set, matcher.accept_token
    held = 0
    filled: list[np.ndarray] = []  # the current state's mask, once filled

    def mask() -> np.ndarray:
        if not filled:
            block = rows_of.get(info.words)
            if block is None:
                block = rows_of[info.words] = np.zeros((1, info.words), dtype=np.int32)
            matcher.fill_next_token_bitmask(block, 0)
            filled.append(block[0])
        return filled[0]

    try:
        for i, t in enumerate(row):
            if len(out) >= limit:
                return out
            if not 0 <= t < vocab or not accept(t):
                if i == 0 and content_end:
                    return out
                break
            held += 1
            out.append(t)
            if t in stops:
                return out
        text_next = True
        while len(out) < limit:
            room = limit - len(out)
            text = ""
            if text_next:
                try:
                    text = str(matcher.find_jump_forward_string())
                except UnicodeDecodeError as exc:  # xgrammar 0.2.8
                    text = whole_characters(bytes(exc.object))
            if text:
                tokens = (segment := segmenter.segment(text)).tokens
                if not tokens:
                    return out
                far = room + _FAR_FROM_END <= len(tokens)
                taken = 0
                for t in tokens[:room] if far else tokens:
                    if not 0 <= t < vocab or not accept(t):
                        break
                    held += 1
                    taken += 1
                    if t in stops:
                        break
                if far or taken < len(tokens) or tokens[-1] in stops:
                    out.extend(tokens[: min(taken, room)])
                    return out
                filled.clear()
                n = min(segmenter.stable(text, segment, mask), room)
                out.extend(tokens[:n])
                if n < len(tokens) or n == room:
                    return out
            text_next = False  # after a whole forced text: none other follows
            if not matcher.is_completed():
                return out
            only = single_token(mask())
            if only is None or not 0 <= only < vocab or not accept(only):
                return out
            held += 1
            filled.clear()
            out.append(only)
            if only in stops:
                return out
            text_next = True
        return out
    finally:
        if held:
            matcher.rollback(held)


def _force(cursor: Cursor, out: list[int], limit: int, segmenter: Segmenter | None) -> None:
    """Append the grammar's forced continuation to ``out`` (see the module's docstring)."""
    while len(out) < limit:
        room = limit - len(out)
        if segmenter is not None:
            text = cursor.forced_text()
            if text:
                if not _take_text(cursor, text, segmenter, out, room):
                    return
                continue  # the whole text drafted: what the grammar forces after it
            if text is not None and not cursor.may_end():
                return  # nothing forced, and no end token to draft
        else:
            tokens = cursor.forced_tokens(room)
            if tokens:
                for t in tokens:
                    outcome = cursor.take(t)
                    if outcome == REFUSED:
                        return
                    out.append(t)
                    if outcome in _ENDED:
                        return
                if len(out) >= limit:
                    return
            elif tokens is not None and not cursor.may_end():
                return
        only = single_token(cursor.row())
        if only is None:
            return
        outcome = cursor.take(only)
        if outcome == REFUSED:
            return
        out.append(only)
        if outcome in _ENDED:
            return


def _take_text(cursor: Cursor, text: str, segmenter: Segmenter, out: list[int], room: int) -> bool:
    """Draft a forced text's tokens (at most ``room``) into ``out``; True when all of them
    were drafted and stay the model's whatever follows (drafting may go on after them)."""
    segment = segmenter.segment(text)
    tokens = segment.tokens
    if not tokens:
        return False
    if room + _FAR_FROM_END <= len(tokens):  # too far from the text's end to merge with it
        for t in tokens[:room]:
            outcome = cursor.take(t)
            if outcome == REFUSED:
                return False
            out.append(t)
            if outcome in _ENDED:
                return False
        return False
    taken = 0
    for t in tokens:
        outcome = cursor.take(t)
        if outcome == REFUSED:
            break
        taken += 1
        if outcome in _ENDED:
            out.extend(tokens[: min(taken, room)])
            return False
    if taken < len(tokens):  # a segmentation the grammar refuses: the drafts end before it
        out.extend(tokens[: min(taken, room)])
        return False
    # the characters that may follow the text: its last tokens are kept where none merges
    keep = segmenter.stable(text, segment, cursor.row)
    n = min(keep, room)
    out.extend(tokens[:n])
    return n == len(tokens)
