"""A tokenizer's own segmentation of forced text, and which of its tokens do not depend on
what follows the text (see :func:`portable_spec.forced_drafts`).

The model writes the tokens its tokenizer would give the whole output. Inside a forced text
that is the tokenizer's segmentation of the text, but its last tokens may merge with what
comes after it (``"`` + ``:`` is one token, ``":``; a space before a number is the number's
first byte). A token is *stable* when the segmentation of the text followed by any character
the grammar allows next still starts with it. The grammar's mask after the text says which
characters may follow; each class of characters a pre-tokenizer splits by (lower-case
letters, upper-case letters, digits, each whitespace and punctuation character) is probed with
its first allowed character, and :class:`Segment` keeps how many leading tokens survive each.

Tokenizers that prepend something to every text (SentencePiece's dummy prefix space: ``"a"``
-> ``"▁a"``) are run on the text behind an anchor (a newline) whose tokens are cut off again.
Segmentations are cached per text (bounded, thread-safe): forced texts repeat step after step.
"""

from __future__ import annotations

import inspect
import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PROBE_CLASSES", "Segment", "Segmenter", "segmenter_for"]

#: characters that may follow a forced text, by the classes pre-tokenizers split by: a class
#: is probed with its first character the grammar allows next
PROBE_CLASSES: tuple[str, ...] = (
    "abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " ", "\n", "\t", "\r",
    *"\"':,.;-_{}[]()!?/\\@#$%&*+=<>|~^`",
)  # fmt: skip
_ANCHOR = "\n"
_CACHED_TEXTS = 8192


@dataclass
class Segment:
    """One forced text's segmentation.

    Attributes:
        tokens: the tokenizer's token ids of the text.
        lcps: per probe character seen so far, how many of ``tokens`` start the segmentation
            of the text followed by it (filled by :meth:`Segmenter.stable`).
    """

    tokens: tuple[int, ...]
    lcps: dict[str, int]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _encoder(tokenizer: Any) -> Callable[[str], Any]:
    """``str -> token ids`` of a Hugging Face tokenizer (``encode`` without special tokens; a
    ``tokenizers.Tokenizer``'s ``Encoding.ids``) or of a plain callable."""
    encode = getattr(tokenizer, "encode", None)
    if callable(encode):

        def run(text: str) -> Any:
            out = encode(text, add_special_tokens=False)
            return getattr(out, "ids", out)

        return run
    if callable(tokenizer):
        return tokenizer  # type: ignore[no-any-return]
    raise TypeError(
        "tokenizer must be a callable str -> list[int] or a tokenizer with an encode method "
        f"(Hugging Face), got {type(tokenizer).__name__}"
    )


class Segmenter:
    """Segmentations of forced texts by one tokenizer (see the module's docstring).

    Raises ``TypeError`` at construction when the tokenizer does not turn text into a list of
    int token ids.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._encode = _encoder(tokenizer)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Segment] = OrderedDict()
        anchor = self._ids(_ANCHOR)
        plain = self._ids("a")
        behind = self._ids(_ANCHOR + "a")
        # an anchor only for tokenizers that change a text's start (a dummy prefix space)
        needed = behind[: len(anchor)] == anchor and behind[len(anchor) :] != plain
        self._anchor = len(anchor) if needed else 0
        self._anchor_ids = anchor
        # every probe character that is one token: its character, token id and class, by class
        chars: list[str] = []
        ids: list[int] = []
        classes: list[int] = []
        for k, members in enumerate(PROBE_CLASSES):
            for c in members:
                t = self.tokens(c)
                if len(t) == 1:
                    chars.append(c)
                    ids.append(t[0])
                    classes.append(k)
        self._probe_chars = chars
        self._probe_ids = np.array(ids, dtype=np.int64)
        self._probe_classes = np.array(classes, dtype=np.int64)

    def _ids(self, text: str) -> tuple[int, ...]:
        out = self._encode(text)
        if isinstance(out, np.ndarray):
            out = out.tolist()
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise TypeError(
                f"tokenizer returned {type(out).__name__} for {text!r}; it must return a list "
                "of int token ids"
            )
        ids = []
        for t in out:
            if isinstance(t, (bool, np.bool_)):
                raise TypeError(f"tokenizer returned the bool {t!r} among the token ids")
            try:
                ids.append(operator.index(t))
            except TypeError:
                raise TypeError(
                    f"tokenizer returned {t!r} ({type(t).__name__}) among the token ids of "
                    f"{text!r}; it must return int token ids"
                ) from None
        return tuple(ids)

    def tokens(self, text: str) -> tuple[int, ...]:
        """The token ids of ``text`` inside a longer text (behind the anchor where the
        tokenizer needs one; alone when the anchor merges with the text's start)."""
        if self._anchor:
            behind = self._ids(_ANCHOR + text)
            if behind[: self._anchor] == self._anchor_ids:
                return behind[self._anchor :]
        return self._ids(text)

    def segment(self, text: str) -> Segment:
        """The :class:`Segment` of a non-empty ``text`` (cached)."""
        with self._lock:
            found = self._cache.get(text)
            if found is not None:
                self._cache.move_to_end(text)
                return found
        segment = Segment(self.tokens(text), {})
        with self._lock:
            self._cache[text] = segment
            while len(self._cache) > _CACHED_TEXTS:
                self._cache.popitem(last=False)
        return segment

    def stable(self, text: str, segment: Segment, row: np.ndarray, vocab: int) -> int:
        """How many of ``segment``'s tokens stay the tokenizer's whatever character the grammar
        allows next: ``row`` is the mask after the whole text (int32 words, ``vocab`` tokens
        inside it). Each probe class is tried with its first allowed character."""
        ids = self._probe_ids
        inside = ids < vocab
        if not inside.all():
            ids = np.where(inside, ids, 0)
        allowed = ((row[ids >> 5] >> (ids & 31)) & 1).astype(bool) & inside
        picks = np.flatnonzero(allowed)
        if not len(picks):
            return len(segment.tokens)
        _, first = np.unique(self._probe_classes[picks], return_index=True)
        keep = len(segment.tokens)
        lcps = segment.lcps
        for index in picks[first].tolist():
            probe = self._probe_chars[index]
            lcp = lcps.get(probe)
            if lcp is None:
                lcp = _common_prefix(segment.tokens, self.tokens(text + probe))
                lcps[probe] = lcp  # one writer or another: the same value
            keep = min(keep, lcp)
        return keep


_segmenters: dict[tuple[int, int], tuple[Any, Segmenter]] = {}
_segmenters_lock = threading.Lock()
_MAX_HELD = 64


def _key_and_ref(tokenizer: Any) -> tuple[tuple[int, int], Any]:
    """The table key of a tokenizer and a reference to it that does not keep it alive where
    it can (a bound method, made afresh on every attribute access, is keyed and referenced by
    its object and function)."""
    if inspect.ismethod(tokenizer):
        key = (id(tokenizer.__self__), id(tokenizer.__func__))
        try:
            return key, weakref.WeakMethod(tokenizer)
        except TypeError:
            return key, tokenizer
    try:
        return (id(tokenizer), 0), weakref.ref(tokenizer)
    except TypeError:  # no weak references: held, the table bounded
        return (id(tokenizer), 0), tokenizer


def _alive(ref: Any) -> Any:
    return ref() if isinstance(ref, weakref.ref) else ref


def segmenter_for(tokenizer: Any) -> Segmenter:
    """The :class:`Segmenter` of ``tokenizer``, kept while the tokenizer lives (a bounded table
    for tokenizers without weak references). Raises ``TypeError`` for a tokenizer that does
    not map text to int token ids."""
    key, ref = _key_and_ref(tokenizer)
    with _segmenters_lock:
        entry = _segmenters.get(key)
    if entry is not None:
        held = _alive(entry[0])
        if held is tokenizer or (inspect.ismethod(tokenizer) and held == tokenizer):
            return entry[1]
    segmenter = Segmenter(tokenizer)
    with _segmenters_lock:  # dead tokenizers' entries leave when a new one comes
        for k, (r, _) in list(_segmenters.items()):
            if isinstance(r, weakref.ref) and r() is None:
                del _segmenters[k]
        held = [k for k, (r, _) in _segmenters.items() if not isinstance(r, weakref.ref)]
        for k in held[: max(0, len(held) - _MAX_HELD + 1)]:
            del _segmenters[k]
        _segmenters[key] = (ref, segmenter)
    return segmenter
