"""The demo engine end to end: speculative == plain constrained greedy decoding (float64,
both backends, both drafters, grammar-aware and blind), and finished output validates
independently."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from _demo_models import DEMO_MAX_LEN, require_backends

from examples.demo.constraints import load_constraint
from examples.demo.drafters import NgramDrafter, SelfDrafter
from examples.demo.engine import generate, required_max_len
from examples.demo.models import precision
from portable_spec.testing import PERSON_SCHEMA, REGEX_DATE_EMAIL

pytest.importorskip("gguf")

MAX_LEN = DEMO_MAX_LEN
SHORT = 14  # tokens per equivalence run: enough for several multi-token steps


@pytest.fixture(scope="module")
def person():
    return load_constraint()


def _prompt(tok, text):
    return tok.encode(tok.chat_prompt(text))


def _drafter(name, nodes, masked=True):
    if name == "ngram":
        return NgramDrafter(nodes, masked=bool(masked))
    return SelfDrafter(nodes, layers=24, branch=3, masked=bool(masked), root_only=masked == "root")


@pytest.mark.slow  # two full generations per backend in float64
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_speculative_equals_plain_decoding_float64(request, models, tok, person, backend):
    require_backends(request, backend)
    prompt = _prompt(tok, person.default_prompt)
    assert required_max_len(len(prompt), SHORT, 4) <= MAX_LEN
    with precision(backend, "float64"):
        model = models(backend, "float64")

        def run(drafter):
            return generate(
                model,
                person.matcher(),
                prompt,
                max_new_tokens=SHORT,
                stop_ids=[tok.eos_id],
                drafter=drafter,
            )

        plain = run(None)
        specs = {
            (name, masked): run(_drafter(name, 4, masked))
            for name, masked in [
                ("ngram", True),
                ("ngram", False),
                ("self", True),
                ("self", "root"),
                ("self", False),
            ]
        }
    assert len(plain.tokens) == SHORT and plain.accepted_per_step == [1] * SHORT
    assert tok.decode(plain.tokens).startswith('{"name": "Ada Lovelace"')
    for (name, masked), spec in specs.items():
        assert spec.tokens == plain.tokens, name
        # the drafts were really used: some step committed drafted tokens
        assert max(spec.accepted_per_step) >= 2, (name, spec.accepted_per_step)
        assert len(spec.steps) < SHORT
        assert all(s.mask_build_ms > 0 for s in spec.steps)
        assert all(0 <= s.valid_nodes <= s.draft_nodes <= 3 for s in spec.steps)
        if masked is True:  # the grammar checked every drafted node before the verify
            assert all(s.valid_nodes == s.draft_nodes for s in spec.steps), name
            assert all(s.draft_mask_ms > 0 for s in spec.steps), name
        elif masked == "root":  # the first level follows the grammar
            assert all(s.draft_mask_ms > 0 for s in spec.steps), name
        else:
            assert all(s.draft_mask_ms == 0 for s in spec.steps), name
    # the self drafter fills its tree; blind, some of it is off-grammar
    assert all(s.draft_nodes == 3 for s in specs[("self", True)].steps)
    assert any(s.valid_nodes < s.draft_nodes for s in specs[("self", False)].steps)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_finished_output_validates_against_the_schema(request, models, tok, person, backend):
    require_backends(request, backend)
    prompt = _prompt(tok, person.default_prompt)
    matcher = person.matcher()
    with precision(backend, "float32"):
        gen = generate(
            models(backend, "float32"),
            matcher,
            prompt,
            max_new_tokens=120,
            stop_ids=[tok.eos_id],
            drafter=NgramDrafter(6),
        )
    assert gen.finished and gen.tokens[-1] == tok.eos_id
    assert matcher.is_terminated()
    assert sum(gen.accepted_per_step) == len(gen.tokens)
    value = json.loads(tok.decode(gen.tokens))
    jsonschema.validate(value, PERSON_SCHEMA)
    assert value["name"] == "Ada Lovelace"
    assert person.check(tok.decode(gen.tokens))[0] is True


def test_regex_output_matches_and_budget_is_respected(request, models, tok):
    require_backends(request, "torch")
    constraint = load_constraint(regex=REGEX_DATE_EMAIL)
    prompt = _prompt(tok, constraint.default_prompt)
    with precision("torch", "float32"):
        model = models("torch", "float32")
        gen = generate(
            model,
            constraint.matcher(),
            prompt,
            max_new_tokens=60,
            stop_ids=[tok.eos_id],
            drafter=NgramDrafter(4),
        )
        short = generate(
            model,
            constraint.matcher(),
            prompt,
            max_new_tokens=5,
            stop_ids=[tok.eos_id],
            drafter=NgramDrafter(4),
        )
    text = tok.decode(gen.tokens)
    assert gen.finished, text
    assert re.fullmatch(REGEX_DATE_EMAIL, text), text
    assert not short.finished and short.tokens == gen.tokens[:5]


def test_cache_too_small_is_refused(request, models, tok, person):
    require_backends(request, "torch")
    prompt = _prompt(tok, person.default_prompt)
    with precision("torch", "float32"), pytest.raises(ValueError, match="positions"):
        generate(
            models("torch", "float32"),
            person.matcher(),
            prompt,
            max_new_tokens=MAX_LEN,
            stop_ids=[tok.eos_id],
        )


def test_constraint_check_rejects_invalid_json(person):
    assert person.check('{"name": "x"}')[0] is False  # missing required keys
    assert person.check("{")[0] is False
    ok = json.dumps(
        {"name": "x", "age": 3, "address": {"street": "s", "city": "c", "zip": "12345"}}
    )
    assert person.check(ok)[0] is True
    assert np.isscalar(person.check(ok)[0])
