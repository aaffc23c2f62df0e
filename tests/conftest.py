"""Shared fixtures: real and synthetic vocabularies, compiled sample grammars."""

from __future__ import annotations

import os
import string
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

# JAX on CPU with several devices for the sharding tests (must precede any jax import).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import xgrammar as xgr

# every test leaves the library's constants, functions and compiled helper as it found them
from _leak_guard import library_left_as_found  # noqa: F401

from portable_spec.testing import compile_sample, load_vocab, tokenizer_info

# The tools (tools/) and the demo (examples/demo/) are not installed: they are imported from the
# checkout. Appended, so that an installed portable_spec (the device check's) stays first.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)

GRAMMAR_KINDS = ("json_schema", "ebnf", "regex", "builtin_json")


@dataclass
class Vocab:
    """A tokenizer vocabulary with its xgrammar compiler and compiled sample grammars."""

    name: str
    size: int  # tokens the grammar knows
    eos: int
    compiler: Any
    grammars: dict[str, Any]
    tokens: list[str]

    @property
    def words(self) -> int:
        return -(-self.size // 32)


def _make_vocab(name: str, info: Any, tokens: list[str], eos: int) -> Vocab:
    compiler = xgr.GrammarCompiler(info)
    grammars = {kind: compile_sample(compiler, kind) for kind in GRAMMAR_KINDS}
    return Vocab(name, info.vocab_size, eos, compiler, grammars, tokens)


@pytest.fixture(scope="session")
def smollm2() -> Vocab:
    """SmolLM2-135M's GPT-2 byte-level vocabulary (49152 tokens) from the GGUF on disk."""
    gv = load_vocab()
    return _make_vocab("smollm2", tokenizer_info(gv), list(gv.tokens), gv.eos_id)


@pytest.fixture(scope="session")
def synthetic() -> Vocab:
    """A synthetic 150001-token raw vocabulary (not a multiple of 32, larger than any
    bitmask width the real one exercises)."""
    rng = np.random.default_rng(7)
    alphabet = list(string.ascii_letters + string.digits + ' {}[]":,.-_@\n')
    tokens = ["</s>", "<pad>", *string.printable[:95]]
    seen = set(tokens)
    while len(tokens) < 150_001:
        s = "".join(rng.choice(alphabet, int(rng.integers(2, 9))))
        if s not in seen:
            seen.add(s)
            tokens.append(s)
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[0])
    return _make_vocab("synthetic", info, tokens, 0)


@pytest.fixture(params=["smollm2", "synthetic"])
def vocab(request: pytest.FixtureRequest) -> Vocab:
    return request.getfixturevalue(request.param)


def pytest_sessionstart(session: pytest.Session) -> None:
    """``PORTABLE_SPEC_EXPECT_NATIVE=1`` (the sanitizer run of scripts/native-check.sh): the
    compiled helper must be the one on ``PYTHONPATH``, or the compiled tests would skip."""
    if os.environ.get("PORTABLE_SPEC_EXPECT_NATIVE") != "1":
        return
    import portable_spec.native as native_module

    helper = native_module.native
    where = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    if helper is None or not str(helper.__file__).startswith(where):
        pytest.exit(f"the compiled helper under test is not loaded (got {helper})", returncode=3)


# -- compiled helpers on / off -----------------------------------------------------------------
@pytest.fixture(params=["native", "python"])
def builder_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the compiled helpers and with their numpy/Python fallback."""
    import portable_spec.native as native_module

    if request.param == "native" and native_module.native is None:
        pytest.skip("portable_spec._native is not built here")
    if request.param == "python":
        real = native_module.native
        native_module.use(None)
        request.addfinalizer(lambda: native_module.use(real))
    return request.param


@pytest.fixture(scope="session")
def tok() -> Any:
    """SmolLM2's tokenizer, rebuilt from the GGUF."""
    from portable_spec.testing import load_tokenizer

    return load_tokenizer()


# -- the cross-backend matrix ------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    from _targets import TARGETS

    names = sorted({t.name for t in TARGETS} | {t.backend for t in TARGETS} | {"cuda"})
    parser.addoption(
        "--backend",
        action="append",
        default=[],
        choices=names,
        help="run the backend matrix only on these targets (a backend name such as `jax` "
        "selects all its targets; repeatable). Default: every available target.",
    )


def _selected_targets(config: pytest.Config) -> list:
    from _targets import TARGETS

    wanted = {"torch" if w == "cuda" else w for w in config.getoption("backend")}
    if not wanted:
        return TARGETS
    return [t for t in TARGETS if t.name in wanted or t.backend in wanted]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" in metafunc.fixturenames:
        targets = _selected_targets(metafunc.config)
        metafunc.parametrize("target", targets, ids=[t.name for t in targets], indirect=True)


@pytest.fixture
def target(request: pytest.FixtureRequest):
    t = request.param
    reason = t.skip_reason()
    if reason:
        pytest.skip(f"{t.name}: {reason}")
    return t


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    lines = []
    for t in _selected_targets(config):
        reason = t.skip_reason()
        lines.append(f"  {t.name:20s} {'ran' if reason is None else 'skipped: ' + reason}")
    terminalreporter.write_sep("-", "backend matrix")
    for line in lines:
        terminalreporter.write_line(line)
    # the skipped tests in one line (their reasons: hardware, engines or packages this machine
    # lacks), unless the run already lists them
    skipped = len(terminalreporter.stats.get("skipped", []))
    if skipped and not set(config.option.reportchars) & set("saA"):
        terminalreporter.write_line(
            f"{skipped} skipped; to list each with its reason, run again with -rs "
            "(scripts/test.sh -rs)"
        )


# -- a user's own model's tokenizer, without a model hub ----------------------------------------
#: the name the docs load their tokenizer by, as a user names their model
HF_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    """SmolLM2's tokenizer as ``transformers`` builds it from the GGUF on disk (its own GGUF
    reader, not the demo's): what ``AutoTokenizer.from_pretrained`` gives a user."""
    pytest.importorskip("transformers")
    from portable_spec.testing import hf_tokenizer as from_gguf

    return from_gguf()


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An ``HF_HOME`` whose model cache holds :data:`HF_MODEL`'s tokenizer, made the way the
    README tells a reader without a model hub (``portable_spec.testing.cache_hf_tokenizer``),
    so that ``from_pretrained(HF_MODEL)`` works with ``HF_HUB_OFFLINE=1`` and no network."""
    pytest.importorskip("transformers")
    from portable_spec.testing import cache_hf_tokenizer

    home = tmp_path_factory.mktemp("hf-home")
    cache_hf_tokenizer(str(home))
    return str(home)
