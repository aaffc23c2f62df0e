"""``forced_drafts``: drafts extended by the grammar's forced continuation, on SmolLM2's real
vocabulary and tokenizer, against independent references: every drafted sequence replayed on a
fresh matcher (each token allowed by the mask before it and accepted), the tokenizer's
encoding of the whole output as the reference segmentation, matchers never moved, bad input
refused before anything moves."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import xgrammar as xgr
from _oracle import ProtocolMatcher

import portable_spec as ps
from portable_spec import testing as T
from portable_spec.drafting.segment import Segmenter
from portable_spec.engines.cursor import whole_characters

llguidance = pytest.importorskip("llguidance")

INVOICE, TOOL_CALL = T.SCHEMA_EXAMPLES["invoice"], T.SCHEMA_EXAMPLES["tool_call"]
INSTANCES = T.SCHEMA_EXAMPLES
VOCAB = 49152


@pytest.fixture(scope="module")
def tok():
    return T.hf_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def lltok():
    return T.llguidance_tokenizer()


@pytest.fixture(autouse=True)
def route(builder_mode, monkeypatch):
    """Every test twice: xgrammar matchers walked in the compiled phases (from one request
    on), and without the compiled helper (the per-request Python walk)."""
    import portable_spec.drafting.forced as forced

    monkeypatch.setattr(forced, "_BATCH_FROM", 1)
    return builder_mode


class Engine:
    """One engine's grammar for a workload: fresh matchers, their masks, their moves."""

    def __init__(self, name, compiler, lltok, schema, flexible):
        self.name = name
        if name == "xgrammar":
            self.compiled = compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=flexible
            )
        else:
            self.grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": flexible}
            )
            self.lltok = lltok

    def fresh(self):
        if self.name == "xgrammar":
            return xgr.GrammarMatcher(self.compiled)
        m = llguidance.LLMatcher(self.lltok, self.grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def row(self, m):
        out = np.zeros(VOCAB // 32, dtype=np.int32)
        if self.name == "xgrammar":
            m.fill_next_token_bitmask(out[None], 0)
        else:
            m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def accept(self, m, t):
        if self.name == "xgrammar":
            return m.accept_token(t)
        return m.try_consume_tokens([t]) == 1

    def forced(self, m):
        if self.name == "xgrammar":
            return "" if m.is_terminated() else m.find_jump_forward_string()
        return bytes(m.compute_ff_bytes()).decode("utf-8", errors="ignore")

    def print(self, m):
        """What the matcher's state shows: its mask and its forced continuation."""
        if self.name == "xgrammar":
            if m.is_terminated():
                return (True,)
            return (self.row(m).tobytes(), m.find_jump_forward_string())
        return (m.is_stopped(), self.row(m).tobytes(), bytes(m.compute_ff_bytes()))


def allowed(row, t):
    return 0 <= t < 32 * len(row) and bool((int(row[t >> 5]) >> (t & 31)) & 1)


def replay_ok(engine, committed, drafted, eos):
    """The reference: a fresh matcher takes the committed tokens, then every drafted token is
    allowed by the mask before it and accepted (the end token: allowed, and the last)."""
    m = engine.fresh()
    for t in committed:
        assert engine.accept(m, t)
    for i, t in enumerate(drafted):
        if not allowed(engine.row(m), t):
            return False
        if t == eos:
            return i == len(drafted) - 1
        if not engine.accept(m, t):
            return False
    return True


def output_tokens(tok, instance, compact=False):
    """The tokenizer's tokens of an instance, as xgrammar writes JSON (`, ` and `: `) or
    compact (llguidance without flexible whitespace)."""
    separators = (",", ":") if compact else (", ", ": ")
    return tok.encode(json.dumps(instance, separators=separators), add_special_tokens=False)


# -- the schema workloads, position by position --------------------------------------------------
CASES = [
    ("xgrammar", True),
    ("xgrammar", False),
    ("llguidance", True),
    ("llguidance", False),
]


@pytest.mark.parametrize("workload", sorted(INSTANCES))
@pytest.mark.parametrize(("engine_name", "flexible"), CASES)
def test_schema_outputs_draft_the_tokenizers_segmentation(
    tok, compiler, lltok, workload, engine_name, flexible
):
    """At every position of a real output: the drafts replay on a fresh matcher, they are the
    tokenizer's own tokens of the output (its encoding of the whole text), the end token is
    drafted once the grammar allows nothing else, and the matcher never moves."""
    engine = Engine(engine_name, compiler, lltok, T.SCHEMA_WORKLOADS[workload][0], flexible)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    compact = engine_name == "llguidance" and not flexible
    ids = [*output_tokens(tok, INSTANCES[workload], compact), eos]
    m = engine.fresh()
    drafted = covered = 0
    for i, t in enumerate(ids):
        before = engine.print(m)
        got = ps.forced_drafts([m], [[]], 8, tokenizer=tok)[0]
        assert engine.print(m) == before, f"position {i}: the matcher moved"
        assert got == ids[i : i + len(got)], (
            f"position {i}: drafted {tok.convert_ids_to_tokens(got)}, the output goes on with "
            f"{tok.convert_ids_to_tokens(ids[i : i + len(got)])}"
        )
        assert replay_ok(engine, ids[:i], got, eos)
        forced = engine.forced(m)  # where it spans two whole tokens or more, one is drafted
        whole = 0
        text = ""
        while i + whole < len(ids) - 1:
            text += tok.decode([ids[i + whole]])
            if not forced.startswith(text):
                break
            whole += 1
        if whole >= 2:  # the first of them is followed by forced text: it is drafted
            covered += 1
            assert got, f"position {i}: nothing drafted before {forced!r}"
        drafted += len(got)
        if t != eos:
            assert engine.accept(m, t)
    assert got == [eos]  # the last position: the grammar allows the end token only
    assert covered > 10 and drafted > len(ids)


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_engines_own_forced_tokens_without_a_tokenizer(tok, compiler, lltok, engine_name):
    """Without a tokenizer: the engine's own forced tokens (xgrammar 0.2.9's
    find_jump_forward_tokens, llguidance's compute_ff_tokens), each replayed."""
    engine = Engine(engine_name, compiler, lltok, T.INVOICE_SCHEMA, True)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*output_tokens(tok, INVOICE), eos]
    m = engine.fresh()
    if engine_name == "xgrammar" and not hasattr(m, "find_jump_forward_tokens"):
        with pytest.raises(ValueError, match="tokenizer"):  # xgrammar < 0.2.9: vLLM 0.32's
            ps.forced_drafts([m], [[]], 6)
        return
    drafted = 0
    for i, t in enumerate(ids):
        got = ps.forced_drafts([m], [[]], 6)[0]
        assert len(got) <= 6 and replay_ok(engine, ids[:i], got, eos)
        if engine_name == "llguidance":
            forced = [int(x) for x in m.compute_ff_tokens()] if not m.is_stopped() else []
            assert got[: len(forced)] == forced[:6]
        drafted += len(got)
        if t != eos:
            assert engine.accept(m, t)
    assert drafted > len(ids) // 2


def test_accepted_drafts_then_the_forced_continuation(tok, compiler):
    """The longest accepted prefix of the proposed drafts, then what the grammar forces from
    the state after it (the same as forcing from a matcher that took that prefix)."""
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, True)
    ids = output_tokens(tok, TOOL_CALL)
    m = engine.fresh()
    for i in range(len(ids) - 4):
        after = engine.fresh()
        for t in ids[: i + 3]:
            assert after.accept_token(t)
        refused = int(np.flatnonzero(engine.row(after) != -1)[0]) * 32  # in a word not all set
        while allowed(engine.row(after), refused):
            refused += 1
        bad = refused if i % 2 else VOCAB + i  # a token the grammar refuses, a padding id
        proposal = [*ids[i : i + 3], bad, ids[i + 3]]
        got = ps.forced_drafts([m], [proposal], 12, tokenizer=tok)[0]
        assert got[:3] == ids[i : i + 3]
        assert got[3:] == ps.forced_drafts([after], [[]], 9, tokenizer=tok)[0]
        assert replay_ok(engine, ids[:i], got, 2)
        assert m.accept_token(ids[i])


def test_lengths_padding_and_unconstrained_requests(tok, compiler):
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    ids = output_tokens(tok, TOOL_CALL)  # `{"tool_call_type": "function", ...` forced
    full = ps.forced_drafts([engine.fresh()], [[]], 64, tokenizer=tok)[0]
    assert full == ids[: len(full)] and len(full) > 10
    ms = [engine.fresh(), None, engine.fresh(), engine.fresh()]
    drafts = np.array([[ids[0], -1, 5], [7, 8, -1], [-1, -1, -1], [ids[0], ids[1], ids[2]]])
    got = ps.forced_drafts(ms, drafts, [3, 2, 0, 5], tokenizer=tok)
    assert got == [full[:3], [7, 8], [], full[:5]]
    assert ps.forced_drafts([None], [[1, 2, 3, VOCAB]], 9, vocab_size=VOCAB) == [[1, 2, 3]]
    assert ps.forced_drafts([], [], 4) == []


def test_the_model_writes_across_a_forced_texts_end(tok, compiler):
    """A forced text's last tokens merge with what may follow it: a key's closing quote with
    the colon (`":` is one token), the space before a value with the value (` false`); they
    are left out. Where nothing can merge (the closing `}}` before the end token), they stay."""
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, True)
    m = engine.fresh()
    assert m.accept_token(tok.convert_tokens_to_ids('{"'))
    forced = m.find_jump_forward_string()
    assert forced == 'tool_call_type"'
    got = ps.forced_drafts([m], [[]], 8, tokenizer=tok)[0]
    assert tok.decode(got) == "tool_call_type"  # the quote: the model writes `":`
    strict = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False).fresh()
    prefix = '{"tool_call_type": "function", "function_name": "get_current_weather", '
    prefix += '"function_arguments": {"location_city_name": "Paris", "temperature_unit": '
    prefix += '"celsius", "include_hourly'
    assert strict.accept_string(prefix)
    assert strict.find_jump_forward_string() == '_forecast": '
    got = ps.forced_drafts([strict], [[]], 8, tokenizer=tok)[0]
    assert tok.decode(got) == '_forecast":'  # not the space: the model writes ` false`


def test_tokenizers_that_prefix_a_space(tok, compiler):
    """A tokenizer that puts a space before every text (SentencePiece's dummy prefix): forced
    text is segmented behind an anchor, so its tokens are those inside a longer text."""

    space = tok.convert_tokens_to_ids("Ġ")

    def sentencepiece_like(text):  # "▁" before every text: merged with a word, not a newline
        if text.startswith("\n"):
            return [space, *tok.encode(text, add_special_tokens=False)]
        return tok.encode(" " + text, add_special_tokens=False)

    seg = Segmenter(sentencepiece_like)
    assert seg.tokens("tool_call") == tuple(tok.encode("tool_call", add_special_tokens=False))
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    got = ps.forced_drafts([engine.fresh()], [[]], 8, tokenizer=sentencepiece_like)[0]
    plain = ps.forced_drafts([engine.fresh()], [[]], 8, tokenizer=tok)[0]
    assert got == plain and len(got) == 8


def test_forced_bytes_that_stop_inside_a_character(tok, compiler, lltok):
    """Two enum values that share the first byte of their first character: the forced bytes
    stop inside it; only whole characters are drafted."""
    assert whole_characters("é".encode()[:1]) == ""
    assert whole_characters(b'"caf' + "é".encode()[:1]) == '"caf'
    schema = {"type": "string", "enum": ["éa", "èb"]}
    m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    assert m.accept_token(tok.convert_tokens_to_ids('"'))
    assert ps.forced_drafts([m], [[]], 4, tokenizer=tok) == [[]]
    ll = llguidance.LLMatcher(
        lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)), log_level=0
    )
    assert ll.consume_token(tok.convert_tokens_to_ids('"'))
    assert bytes(ll.compute_ff_bytes()) == "é".encode()[:1]
    assert ps.forced_drafts([ll], [[]], 4, tokenizer=tok) == [[]]


# -- the other engines ---------------------------------------------------------------------------
def test_outlines_guides_draft_single_token_states(tok):
    """outlines-core: tokens of states that allow one token (the dash after four digits of a
    date), the guide rolled back, never past its rollback window."""
    guide = T.outlines_guide("regex", max_rollback=8)
    digits = tok.encode("2026", add_special_tokens=False)
    before = (guide.get_state(), guide.get_allowed_rollback())
    got = ps.forced_drafts([guide], [digits], 8, vocab_size=VOCAB)[0]
    assert got[: len(digits)] == digits and tok.decode(got[len(digits) :]).startswith("-")
    assert (guide.get_state(), guide.get_allowed_rollback()) == before
    with pytest.raises(ValueError, match="vocab_size"):
        ps.forced_drafts([guide], [[]], 8)


class StringProtocol(ProtocolMatcher):
    """A protocol matcher that says its forced text (xgrammar's) and forks or not."""

    def __init__(self, inner, forks):
        super().__init__(inner, VOCAB)
        self._forks = forks

    def find_jump_forward_string(self):
        return self.inner.find_jump_forward_string().encode()  # bytes are taken too

    def __getattr__(self, name):
        if name == "fork" and self._forks:
            return lambda: StringProtocol(self.inner.fork(), True)
        raise AttributeError(name)


@pytest.mark.parametrize("forks", [True, False])
def test_protocol_matchers(tok, compiler, forks):
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    m = StringProtocol(engine.fresh(), forks)
    want = ps.forced_drafts([engine.fresh()], [[]], 10, tokenizer=tok)[0]
    assert ps.forced_drafts([m], [[]], 10, tokenizer=tok) == [want]
    assert m.depth == 0 and m.inner.find_jump_forward_string().startswith('{"tool')
    with pytest.raises(ValueError, match="vocab_size"):
        ps.forced_drafts([ProtocolMatcher(engine.fresh())], [[]], 4)


# -- reasoning -----------------------------------------------------------------------------------
def test_nothing_is_forced_while_reasoning(tok, compiler):
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    end, call = 1, 7  # stand-ins for </think> and a tool-call start
    rule = ps.Reasoning(np.array([True, True, True, False]), end, content_end_token_ids=[call])
    ms = [engine.fresh() for _ in range(4)]
    forced = ps.forced_drafts([engine.fresh()], [[]], 8, tokenizer=tok)[0]
    think = tok.encode(" so the call is", add_special_tokens=False)
    got = ps.forced_drafts(
        ms, [think, [*think, end], [*think, call, 5], []], 8, tokenizer=tok, reasoning=rule
    )
    assert got[0] == think  # still reasoning: drafted as proposed, nothing forced
    assert got[1] == [*think, end, *forced][:8]  # the grammar starts after the end token
    assert got[2] == think  # a content end the grammar refuses: still reasoning
    assert got[3] == forced


# -- refusals ------------------------------------------------------------------------------------
def test_bad_input_is_refused_before_any_matcher_moves(tok, compiler):
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    m = ProtocolMatcher(engine.fresh(), VOCAB)
    good = [[1, 2]]
    bad = [
        (TypeError, dict(matchers=m)),
        (TypeError, dict(matchers=[object()])),
        (ValueError, dict(drafts=[[1], [2]])),
        (TypeError, dict(drafts=[[1.5]])),
        (TypeError, dict(drafts=[[True]])),
        (TypeError, dict(drafts=["ab"])),
        (TypeError, dict(drafts=np.zeros((1, 2), np.float32))),
        (ValueError, dict(max_len=-1)),
        (TypeError, dict(max_len=2.0)),
        (ValueError, dict(max_len=[1, 2])),
        (TypeError, dict(tokenizer=42)),
        (TypeError, dict(tokenizer=lambda text: "not ids")),
        (TypeError, dict(tokenizer=lambda text: [0.5])),
        (TypeError, dict(reasoning="thinking")),
        (ValueError, dict(vocab_size=0)),
    ]
    for error, change in bad:
        kwargs = dict(matchers=[m], drafts=good, max_len=4, tokenizer=tok, vocab_size=VOCAB)
        kwargs.update(change)
        with pytest.raises(error):
            ps.forced_drafts(kwargs.pop("matchers"), kwargs.pop("drafts"), **kwargs)
    assert [c for c in m.calls if c[0] != "fill"] == []  # nothing accepted or rolled back
    same = engine.fresh()
    with pytest.raises(ValueError, match="same matcher"):
        ps.forced_drafts([same, same], [[], []], 4, tokenizer=tok)


def test_a_matcher_another_build_walks_is_refused(tok, compiler):
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    gate = threading.Event()

    class Gated(StringProtocol):
        def fill_next_token_bitmask(self, bitmask, index):
            gate.wait(10)
            return super().fill_next_token_bitmask(bitmask, index)

    m = Gated(engine.fresh(), forks=False)
    pending = ps.build_grammar_vocab_mask([m], ps.GrammarTree.from_linear_chain([[0]]), VOCAB,
                                          wait=False)  # fmt: skip
    try:
        with pytest.raises(ValueError, match="another build"):
            ps.forced_drafts([m], [[]], 4, tokenizer=tok)
    finally:
        gate.set()
        pending.result()
    assert ps.forced_drafts([m], [[]], 4, tokenizer=tok)[0]


def test_threads_share_a_tokenizer(tok, compiler):
    """Calls on several threads (one matcher each, one tokenizer and its cache) give what
    serial calls give."""
    engine = Engine("xgrammar", compiler, None, T.INVOICE_SCHEMA, True)
    ids = output_tokens(tok, INVOICE)
    serial = []
    m = engine.fresh()
    for t in ids:
        serial.append(ps.forced_drafts([m], [[]], 5, tokenizer=tok)[0])
        m.accept_token(t)
    results: dict[int, list] = {}

    def run(k):
        mine = engine.fresh()
        out = []
        for t in ids:
            out.append(ps.forced_drafts([mine], [[]], 5, tokenizer=tok)[0])
            mine.accept_token(t)
        results[k] = out

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(results[k] == serial for k in range(4))


def test_a_segmentation_the_mask_refuses_ends_the_drafts(tok, lltok):
    """A tokenizer that writes one token per byte: llguidance's parser takes `{` where the
    forced text is `{"` (another tokenization of the same text), its mask does not (it allows
    `{"` only). Drafts stop where the mask refuses, never past it."""
    byte_char = {b: c for c, b in T.byte_level_decoder().items()}

    def per_byte(text):
        return [tok.convert_tokens_to_ids(byte_char[b]) for b in text.encode()]

    engine = Engine("llguidance", None, lltok, T.TOOL_CALL_SCHEMA, False)  # `{"tool_...` forced
    m = engine.fresh()
    brace = per_byte("{")[0]
    assert m.validate_tokens([brace]) == 1 and not allowed(engine.row(m), brace)
    got = ps.forced_drafts([m], [[]], 8, tokenizer=per_byte)[0]
    assert replay_ok(engine, [], got, 2) and got == []
    canonical = ps.forced_drafts([m], [[]], 8, tokenizer=tok)[0]
    assert canonical and per_byte(tok.decode(canonical[:1])) != canonical[:1]


def test_the_xgrammar_short_path_drafts_what_its_cursor_drafts(tok, compiler, monkeypatch):
    """xgrammar requests take a short path (the cursor's calls in place): position by position
    and with proposed drafts, the same tokens as the cursor, every matcher back in its state."""
    import portable_spec.drafting.forced as forced

    for flexible in (True, False):
        engine = Engine("xgrammar", compiler, None, T.INVOICE_SCHEMA, flexible)
        ids = [*output_tokens(tok, INVOICE), 2]
        m = engine.fresh()
        for i, t in enumerate(ids):
            proposal = ids[i : i + 2 + i % 3] + [VOCAB + 1] * (i % 2)
            before = engine.print(m)
            got = {}
            for short in (True, False):
                monkeypatch.setattr(forced, "_SHORT_PATH", short)
                got[short] = ps.forced_drafts(
                    [m, engine.fresh()], [proposal, []], [2 + i % 7, 5], tokenizer=tok
                )
                assert engine.print(m) == before
            assert got[True] == got[False], f"position {i}"
            if t != 2:
                assert m.accept_token(t)


def _schema_cases(compiler, flexible: bool) -> list[tuple[Engine, object]]:
    """An xgrammar engine of each schema workload, with the instance whose output it walks."""
    return [
        (Engine("xgrammar", compiler, None, T.SCHEMA_WORKLOADS[name][0], flexible), instance)
        for name, instance in sorted(INSTANCES.items())
    ]


def _random_request(rng, tok, cases, eos: int):
    """A fresh matcher of a random case moved to a random position of its output (the end
    token included), and a proposal there: the output's next 0 to 8 tokens, as they are, one
    of them replaced by a random token, padded with -1, or followed by an id past the
    vocabulary. Returns ``(engine, matcher, tokens accepted, proposal)``."""
    engine, instance = cases[int(rng.integers(len(cases)))]
    ids = [*output_tokens(tok, instance), eos]
    at = int(rng.integers(0, len(ids)))
    m = engine.fresh()
    for t in ids[:at]:
        assert m.accept_token(t)
    ahead = list(ids[at : at + int(rng.integers(0, 9))])
    kind = int(rng.integers(5))
    if kind == 1 and ahead:
        ahead[int(rng.integers(len(ahead)))] = int(rng.integers(VOCAB))
    elif kind == 2:
        ahead += [-1, -1]
    elif kind == 3:
        ahead.append(VOCAB + 3)
    return engine, m, ids[:at], ahead


def test_the_compiled_phases_draft_what_the_python_walk_drafts(tok, compiler, route, monkeypatch):
    """Batches of xgrammar requests at random positions of both schema workloads, with random
    proposals (the output's next tokens, a refused token, padding, the end token), random
    limits and a reasoning request: the compiled phases give the per-request Python walk's
    tokens, every drafted sequence replays on a fresh matcher, no matcher moves."""
    import portable_spec.drafting.forced as forced

    if route == "python":
        pytest.skip("compares the compiled phases with the Python walk")
    rng = np.random.default_rng(45)
    eos, think_end = 2, tok.convert_tokens_to_ids("\n")
    for flexible in (True, False):
        cases = _schema_cases(compiler, flexible)
        for _ in range(12):
            batch = int(rng.integers(1, 24))
            matchers, proposals, committed, engines = [], [], [], []
            for _ in range(batch):
                engine, m, done, ahead = _random_request(rng, tok, cases, eos)
                if len(matchers) % 5 == 4:  # reasoning (when asked): free tokens, its end
                    ahead = [*tok.encode("so", add_special_tokens=False), think_end, *ahead]
                matchers.append(m)
                proposals.append(ahead)
                committed.append(done)
                engines.append(engine)
            limits = [int(x) for x in rng.integers(0, 13, size=batch)]
            reasoning = ps.Reasoning(
                active=[b % 5 == 4 for b in range(batch)], end_token_ids=[think_end]
            )
            before = [e.print(m) for e, m in zip(engines, matchers, strict=True)]
            got = {}
            for batched in (True, False):
                monkeypatch.setattr(forced, "_BATCHED", batched)
                for with_reasoning in (False, True):
                    got[batched, with_reasoning] = ps.forced_drafts(
                        matchers,
                        proposals,
                        limits,
                        tokenizer=tok,
                        reasoning=reasoning if with_reasoning else None,
                    )
                    assert [e.print(m) for e, m in zip(engines, matchers, strict=True)] == before
            assert got[True, False] == got[False, False]
            assert got[True, True] == got[False, True]
            for b, drafted in enumerate(got[True, False]):
                assert len(drafted) <= limits[b]
                assert replay_ok(engines[b], committed[b], drafted, eos), (b, drafted)


def test_a_tokenizer_that_raises_leaves_every_matcher_in_its_state(tok, compiler):
    """The tokenizer raises on one request's forced text while the others of the batch are
    walked (moved, on the compiled phases): MatcherError names that request, every matcher is
    back in its state, and the next call drafts as usual."""
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    ids = output_tokens(tok, TOOL_CALL)
    matchers = [engine.fresh() for _ in range(3)]
    for t in ids[:1]:
        assert matchers[1].accept_token(t)
    poisoned = matchers[1].find_jump_forward_string()
    assert poisoned and poisoned != matchers[0].find_jump_forward_string()

    class Picky:
        def __call__(self, text):
            if text.startswith(poisoned):
                raise RuntimeError("this tokenizer refuses the text")
            return tok.encode(text, add_special_tokens=False)

    before = [engine.print(m) for m in matchers]
    for _ in range(2):  # fresh matchers, then probed ones (the common compiled call)
        with pytest.raises(ps.MatcherError) as raised:
            ps.forced_drafts(matchers, [ids[:2], [], ids[:3]], 6, tokenizer=Picky())
        assert raised.value.request_index == 1
        assert [engine.print(m) for m in matchers] == before
        assert _held_nothing()
    got = ps.forced_drafts([matchers[0], matchers[2]], [ids[:2], []], 6, tokenizer=tok)
    assert all(replay_ok(engine, [], d, 2) for d in got) and got[0][:2] == ids[:2]


def _held_nothing():
    from portable_spec import pending

    return not pending.held_table()


def test_the_common_call_drafts_what_the_python_walk_drafts(tok, compiler, route, monkeypatch):
    """The common call (xgrammar matchers the library probed, lists or tuples of ints, one
    limit, no reasoning) is checked, held and walked in one compiled call whose forced texts
    are answered from the tokenizer's replies table: the same tokens as the per-request
    Python walk, every drafted sequence replays on a fresh matcher, no matcher moves, nothing
    stays held; cold (every text asked) and warm (every text answered inside the call)."""
    import portable_spec.drafting.forced as forced
    from portable_spec import native

    if route == "python":
        pytest.skip("compares the compiled call with the Python walk")
    taken = []
    run = native.forced_run

    def spy(*args):
        done = run(*args)
        taken.append(done is not None)
        return done

    monkeypatch.setattr(native, "forced_run", spy)
    rng = np.random.default_rng(4545)
    eos = 2
    for flexible in (True, False):
        cases = _schema_cases(compiler, flexible)
        for _ in range(10):
            batch = int(rng.integers(1, 40))
            matchers, proposals, committed, engines = [], [], [], []
            for b in range(batch):
                engine, m, done, ahead = _random_request(rng, tok, cases, eos)
                matchers.append(m)
                proposals.append(tuple(ahead) if b % 7 == 6 else ahead)
                committed.append(done)
                engines.append(engine)
            if rng.integers(2):
                limit: int | list[int] = int(rng.integers(1, 13))
                limits = [limit] * batch
            else:  # one per request, some 0 (as engines pass them)
                limit = limits = [int(x) for x in rng.integers(0, 13, size=batch)]
            vocab = None if rng.integers(2) else VOCAB + 5
            before = [e.print(m) for e, m in zip(engines, matchers, strict=True)]
            monkeypatch.setattr(forced, "_BATCHED", False)
            expected = ps.forced_drafts(  # (the matchers probed here)
                matchers, proposals, limit, tokenizer=tok, vocab_size=vocab
            )
            monkeypatch.setattr(forced, "_BATCHED", True)
            for tokenizer in (lambda text: tok.encode(text, add_special_tokens=False), tok):
                del taken[:]
                got = ps.forced_drafts(
                    matchers, proposals, limit, tokenizer=tokenizer, vocab_size=vocab
                )
                assert taken == [True]  # the common call served it
                assert got == expected
                assert [e.print(m) for e, m in zip(engines, matchers, strict=True)] == before
                assert _held_nothing()
            for b, drafted in enumerate(got):
                assert len(drafted) <= limits[b]
                assert replay_ok(engines[b], committed[b], drafted, eos), (b, drafted)


def test_the_common_call_declines_what_it_does_not_check(tok, compiler, route):
    """Anything the compiled checks do not take goes to the checked path, which names what is
    wrong before any matcher moves: bools and floats among the drafts, a drafts count that is
    not the matchers', a matcher listed twice, a matcher another build holds."""
    from portable_spec import pending

    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    matchers = [engine.fresh() for _ in range(3)]
    assert ps.forced_drafts(matchers, [[], [], []], 4, tokenizer=tok)  # probed now
    before = [engine.print(m) for m in matchers]
    empty = [[], [], []]
    bad = [
        (TypeError, matchers, [[1], [True], []], {}),
        (TypeError, matchers, [[1], [1.5], []], {}),
        (TypeError, matchers, [[1], "ab", []], {}),
        (ValueError, matchers, [[1], []], {}),
        (ValueError, [matchers[0], matchers[1], matchers[0]], empty, {}),
        (ValueError, matchers, empty, {"max_len": [4, -1, 4]}),
        (TypeError, matchers, empty, {"max_len": [4, 2.0, 4]}),
        (ValueError, matchers, empty, {"max_len": [4, 4]}),
        (ValueError, matchers, empty, {"vocab_size": VOCAB // 2}),  # narrower than a matcher
        (ValueError, matchers, empty, {"vocab_size": 0}),
    ]
    for error, ms, drafts, change in bad:
        kwargs = {"max_len": 4, "tokenizer": tok, **change}
        with pytest.raises(error):
            ps.forced_drafts(ms, drafts, **kwargs)
        assert [engine.print(m) for m in matchers] == before
        assert _held_nothing()
    token, held = pending.hold_matchers([matchers[1]])
    try:
        with pytest.raises(ValueError, match="another build"):
            ps.forced_drafts(matchers, [[], [], []], 4, tokenizer=tok)
        assert [engine.print(m) for m in matchers] == before
        assert pending.held_table() == {id(matchers[1]): token}
    finally:
        pending.release_matchers(token, held)
    assert ps.forced_drafts(matchers, [[], [], []], 4, tokenizer=tok)[0]
    assert _held_nothing()


def test_an_error_inside_the_common_call_leaves_nothing_moved(tok, compiler, route):
    """An error raised inside the common compiled call after its phases moved the matchers (a
    malformed entry in the replies table, read between phases): every matcher is back in its
    state, nothing stays held, and the next call drafts as usual."""
    from portable_spec.drafting.segment import segmenter_for

    if route == "python":
        pytest.skip("the compiled call's own error path")
    engine = Engine("xgrammar", compiler, None, T.TOOL_CALL_SCHEMA, False)
    ids = output_tokens(tok, TOOL_CALL)
    matchers = [engine.fresh() for _ in range(3)]
    assert matchers[2].accept_token(ids[0])
    drafts = [ids[:1], [], ids[1:2]]  # requests 0 and 2 moved before the poisoned text
    assert ps.forced_drafts(matchers, drafts, 6, tokenizer=tok)[0]  # probed, cached
    ahead = engine.fresh()
    assert ahead.accept_token(ids[0])
    text = ahead.find_jump_forward_string()
    assert text
    replies = segmenter_for(tok).replies
    before = [engine.print(m) for m in matchers]
    kept = replies.get(text.encode())
    replies[text.encode()] = b"\x01" * 12  # not whole int64 words
    try:
        with pytest.raises((ValueError, ps.MatcherError)):
            ps.forced_drafts(matchers, drafts, 6, tokenizer=tok)
    finally:
        if kept is None:
            replies.pop(text.encode(), None)
        else:
            replies[text.encode()] = kept
    assert [engine.print(m) for m in matchers] == before
    assert _held_nothing()
    got = ps.forced_drafts(matchers, drafts, 6, tokenizer=tok)
    assert all(replay_ok(engine, ids[:1] if b == 2 else [], d, 2) for b, d in enumerate(got))
