"""The demo (``scripts/demo.sh``): the JSON record, progress lines, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from examples.demo.cli import main
from tools.cli import main as tools_main

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
    assert record["draft_mask"] == "levels"  # grammar-aware drafting is the default
    assert len(record["tokens"]) == 6 == sum(record["accepted_per_step"])
    assert record["steps"] == len(record["accepted_per_step"]) == len(record["mask_build_ms"])
    drafted, valid = record["draft_nodes_per_step"], record["valid_nodes_per_step"]
    assert len(drafted) == len(valid) == record["steps"]
    assert valid == drafted and max(drafted) >= 1  # every masked draft node is grammar-valid
    assert record["text"].startswith('{"name"')
    assert record["finished"] is False and record["valid"] is False  # budget, not an error
    assert 0.0 <= record["mask_hidden_fraction"] <= 1.0


def test_plain_text_run_prints_progress_per_step(request, capsys, tmp_path):
    wanted = request.config.getoption("backend", default=None) or []
    if wanted and not any(w.split("-")[0] in ("torch", "cuda") for w in wanted):
        pytest.skip("torch not selected by --backend")
    grammar = tmp_path / "kv.ebnf"
    grammar.write_text('root ::= "port = " [0-9]+ "\\n"\n')
    rc = tools_main(
        ["demo", "--backend", "torch", "--ebnf", str(grammar), "--no-spec", "--no-warmup"]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.startswith("port = ") and out.rstrip("\n").split(" = ")[1].isdigit()
    steps = [line for line in err.splitlines() if line.startswith("step ")]
    assert len(steps) >= 3 and all("  +1 -> " in line for line in steps)  # one token a step
    assert "tokens/s" in err


def test_compare_runs_plain_and_speculative_in_one_process(request, capsys):
    wanted = request.config.getoption("backend", default=None) or []
    if wanted and not any(w.split("-")[0] in ("torch", "cuda") for w in wanted):
        pytest.skip("torch not selected by --backend")
    argv = ["--backend", "torch", "--draft", "ngram", "--max-new-tokens", "8", "--nodes", "4"]
    assert main([*argv, "--no-warmup", "--compare", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["compare"] is True
    plain, spec = record["plain"], record["speculative"]
    assert plain["draft"] == "none" and plain["accepted_per_step"] == [1] * 8
    assert plain["draft_nodes_per_step"] == [0] * 8
    assert spec["draft"] == "ngram" and spec["draft_mask"] == "levels"
    assert sum(spec["accepted_per_step"]) == 8 and spec["steps"] < 8
    assert spec["valid_nodes_per_step"] == spec["draft_nodes_per_step"]
    assert record["speedup"] == pytest.approx(spec["tokens_per_s"] / plain["tokens_per_s"], 1e-3)
    assert record["same_tokens"] is (plain["tokens"] == spec["tokens"])
    # the text form prints the table on stderr
    assert main([*argv, "--no-warmup", "--compare", "--no-draft-mask"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith('{"name"')
    lines = err.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("mode"))
    assert "tokens/s" in lines[header] and "speed-up" in lines[header]
    assert lines[header + 1].startswith("plain greedy") and lines[header + 1].endswith("1.00x")
    assert lines[header + 2].startswith("ngram drafter, blind")


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
        (["--compare", "--no-spec"], "--compare compares a speculative mode"),
        (["--root-mask-only"], "--root-mask-only is a masking mode of --draft self"),
    ],
)
def test_bad_input_gives_a_clear_error(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("scripts/demo.sh: error: ")
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
