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
from dataclasses import dataclass, field
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
        merging: the probe classes whose first character changes the segmentation (found by
            the first :meth:`Segmenter.stable`).
        words, last_word: the mask words the merging classes' characters sit in.
        keeps: the stable count by the values of those words.
    """

    tokens: tuple[int, ...]
    lcps: dict[str, int]
    merging: tuple[int, ...] | None = None
    words: tuple[int, ...] = ()
    last_word: int = -1
    keeps: dict[tuple[int, ...], int] = field(default_factory=dict)
    _flat: tuple[int, tuple[int, ...]] = (0, ())

    def known(self) -> tuple[int, ...]:
        """:attr:`keeps` flat: per entry the values of the mask words :attr:`words`, then its
        stable count (rebuilt when an entry was added)."""
        size, flat = self._flat
        if size != len(self.keeps):
            entries = list(self.keeps.items())
            flat = tuple([v for key, keep in entries for v in (*key, keep)])
            self._flat = (len(entries), flat)
        return flat


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
        #: forced text (UTF-8 bytes, as the engine gives it) -> the answer the compiled
        #: phases take for it, packed (``drafting.batched``), read by them with the GIL held
        self.replies: dict[bytes, bytes] = {}
        anchor = self._ids(_ANCHOR)
        plain = self._ids("a")
        behind = self._ids(_ANCHOR + "a")
        # an anchor only for tokenizers that change a text's start (a dummy prefix space)
        needed = behind[: len(anchor)] == anchor and behind[len(anchor) :] != plain
        self._anchor = len(anchor) if needed else 0
        self._anchor_ids = anchor
        #: per probe class: its first character, and where its one-token characters sit in a
        #: mask row: ``[(word, bits of the word)]`` and ``(word, bit) -> character``
        self.classes: list[tuple[str, list[tuple[int, int]], dict[tuple[int, int], str]]] = []
        for members in PROBE_CLASSES:
            words: dict[int, int] = {}
            at: dict[tuple[int, int], str] = {}
            for c in members:
                t = self.tokens(c)
                if len(t) == 1 and t[0] >= 0:
                    word, bit = t[0] >> 5, t[0] & 31
                    if (word, bit) not in at:
                        at[(word, bit)] = c
                        words[word] = words.get(word, 0) | (1 << bit)
            if words:
                self.classes.append((members[0], sorted(words.items()), at))

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

    def remember(self, key: bytes, reply: bytes) -> None:
        """Keep ``reply`` as the answer to the forced text ``key`` (bounded: the oldest
        entries leave first)."""
        with self._lock:
            replies = self.replies
            replies.pop(key, None)
            replies[key] = reply
            while len(replies) > _CACHED_TEXTS:
                del replies[next(iter(replies))]

    def _lcp(self, text: str, segment: Segment, probe: str) -> int:
        lcp = segment.lcps.get(probe)
        if lcp is None:
            lcp = _common_prefix(segment.tokens, self.tokens(text + probe))
            segment.lcps[probe] = lcp  # one writer or another: the same value
        return lcp

    def stable(self, text: str, segment: Segment, row: Callable[[], np.ndarray]) -> int:
        """How many of ``segment``'s tokens stay the tokenizer's whatever character the grammar
        allows next. ``row()`` gives the mask after the whole text (int32 words), asked only
        when some class of characters would merge with the text's end: the classes whose first
        character changes the segmentation (found once per text), each tried with its first
        character the mask allows. The answer is kept per text and per value of the mask words
        those classes sit in."""
        tokens = segment.tokens
        if segment.merging is None:
            self._merging(text, segment)
        if not segment.merging:
            return len(tokens)
        mask = row()
        if len(mask) <= segment.last_word:
            return self._keep(text, segment, mask)
        key = tuple([mask.item(w) for w in segment.words])
        keep = segment.keeps.get(key)
        if keep is None:
            keep = segment.keeps[key] = self._keep(text, segment, mask)
        return keep

    def _merging(self, text: str, segment: Segment) -> None:
        merging = tuple(
            k
            for k, (first, _, _) in enumerate(self.classes)
            if self._lcp(text, segment, first) < len(segment.tokens)
        )
        words = sorted({w for k in merging for w, _ in self.classes[k][1]})
        segment.words = tuple(words)
        segment.last_word = words[-1] if words else -1
        segment.merging = merging

    def _keep(self, text: str, segment: Segment, mask: np.ndarray) -> int:
        width = len(mask)
        keep = len(segment.tokens)
        for k in segment.merging or ():
            _, words, at = self.classes[k]
            for word, bits in words:
                if word >= width:
                    break
                hit = mask.item(word) & bits
                if hit:
                    probe = at[(word, (hit & -hit).bit_length() - 1)]
                    keep = min(keep, self._lcp(text, segment, probe))
                    break
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
    last = _last
    if last and last[0]() is tokenizer:
        return last[1]  # type: ignore[no-any-return]
    key, ref = _key_and_ref(tokenizer)
    with _segmenters_lock:
        entry = _segmenters.get(key)
    if entry is not None:
        held = _alive(entry[0])
        if held is tokenizer or (inspect.ismethod(tokenizer) and held == tokenizer):
            _remember(tokenizer, entry[1])
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
    _remember(tokenizer, segmenter)
    return segmenter


# the last tokenizer asked for (weakly) and its segmenter: one identity test per call
_last: list[Any] = []


def _remember(tokenizer: Any, segmenter: Segmenter) -> None:
    try:
        ref = weakref.ref(tokenizer)
    except TypeError:
        return
    _last[:] = [ref, segmenter]
