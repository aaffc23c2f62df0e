"""``portable-spec demo``: the JSON record, progress lines, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from portable_spec.cli import main as portable_spec
from portable_spec.demo.cli import main

pytest.importorskip("gguf")


def test_json_record_of_a_short_run(request, capsys):
    wanted = request.config.getoption("backend", default=None) or []
    if wanted and not any(w.split("-")[0] in ("torch", "cuda") for w in wanted):
        pytest.skip("torch not selected by --backend")
    rc = main(
        ["--backend", "torch", "--max-new-tokens", "6", "--nodes", "4", "--no-warmup", "--json"]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert err == ""  # no progress lines with --json
    record = json.loads(out)  # exactly one JSON object on stdout
    for key in ("text", "tokens", "steps", "accepted_per_step", "mask_build_ms", "verify_ms"):
        assert key in record
    assert record["backend"] == "torch" and record["draft"] == "ngram"
    assert len(record["tokens"]) == 6 == sum(record["accepted_per_step"])
    assert record["steps"] == len(record["accepted_per_step"]) == len(record["mask_build_ms"])
    assert record["text"].startswith('{"name"')
    assert record["finished"] is False and record["valid"] is False  # budget, not an error
    assert 0.0 <= record["mask_hidden_fraction"] <= 1.0


def test_plain_text_run_prints_progress_per_step(request, capsys, tmp_path):
    wanted = request.config.getoption("backend", default=None) or []
    if wanted and not any(w.split("-")[0] in ("torch", "cuda") for w in wanted):
        pytest.skip("torch not selected by --backend")
    grammar = tmp_path / "kv.ebnf"
    grammar.write_text('root ::= "port = " [0-9]+ "\\n"\n')
    rc = portable_spec(
        ["demo", "--backend", "torch", "--ebnf", str(grammar), "--no-spec", "--no-warmup"]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.startswith("port = ") and out.rstrip("\n").split(" = ")[1].isdigit()
    steps = [line for line in err.splitlines() if line.startswith("step ")]
    assert len(steps) >= 3 and all("  +1 -> " in line for line in steps)  # one token a step
    assert "tokens/s" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nodes", "0"], "--nodes must be between 1 and 64"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--draft-layers", "31"], "--draft-layers must be between 1 and 30"),
        (["--schema", "/nonexistent/schema.json"], "cannot read the schema file"),
        (["--regex", "[unclosed"], "cannot compile the grammar"),
        (["--prompt", "  "], "--prompt is empty"),
        (["--max-new-tokens", "9000"], "exceed the model's context of 8192 tokens"),
    ],
)
def test_bad_input_gives_a_clear_error(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("portable-spec demo: error: ")
    assert message in err


def test_schema_file_that_is_not_json(capsys, tmp_path):
    bad = tmp_path / "schema.json"
    bad.write_text("{not json")
    assert main(["--schema", str(bad)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_argparse_errors_return_status_2(capsys):
    assert main(["--backend", "tpu"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["--schema", "a", "--regex", "b"]) == 2
    assert "not allowed with" in capsys.readouterr().err
