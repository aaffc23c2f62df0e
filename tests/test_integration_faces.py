"""Every engine integration is the same package around its engine: the same modules
(``internals``, ``patches``, ``state``), the same face (``ENV_VAR``, ``install(mode)``,
``uninstall()``, ``is_installed()``, ``integration_stats()``, ``reset_stats()``) on one
implementation (:class:`~portable_spec.integrations.face.Integration`), one version helper,
one wording for a mode it does not take, one shape of counters, one kind of once-per-process
line, and ``reset_stats()`` resetting the same three things.

The install checks run where the engines are absent (the unit suite's environment): ``install``
returns False without a warning and patches nothing. The packages against their real engines:
tests/real_vllm, tests/real_tpu_inference, tests/real_sglang_jax, tests/real_sglang.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import re
import subprocess
import sys
from types import ModuleType

import pytest

import portable_spec.integrations as integrations
from portable_spec.integrations.face import Integration, engine_version, read_mode
from portable_spec.integrations.patching import Patch, Revision
from portable_spec.integrations.telemetry import LogOnce, Stats

# package -> (the engine module it patches, the modes install takes, the engine's logger)
ENGINES = {
    "vllm": ("vllm", ("on", "shadow"), "vllm"),
    "tpu_inference": ("tpu_inference", ("on",), "vllm"),
    "sglang_jax": ("sgl_jax", ("on",), "sgl_jax"),
    "sglang": ("sglang", ("on", "shadow"), "sglang"),
}
FACE = {"ENV_VAR", "install", "uninstall", "is_installed", "integration_stats", "reset_stats"}
# what each package shows beside the face
EXTRAS = {
    "vllm": {
        "FORCED_ENV_VAR",
        "LAYOUTS",
        "LOG_EVERY_ENV_VAR",
        "LOOKUP_ENV_VAR",
        "THREADS_ENV_VAR",
        "WRITINGS_ENV_VAR",
        "layout_for",
    },
    "tpu_inference": {"install_on_import"},
    "sglang_jax": {"DRAFTING_ENV_VAR", "TIMING_ENV_VAR", "set_drafting", "set_timing"},
    "sglang": {"DRAFTING_ENV_VAR", "register", "set_drafting"},
}
MODULES = ("internals", "patches", "state")


def _part(name: str, module: str = "") -> ModuleType:
    return importlib.import_module(f"portable_spec.integrations.{name}{module and '.' + module}")


@pytest.fixture(params=sorted(ENGINES))
def name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def absent(name: str) -> ModuleType:
    """The package, where its engine is not installed."""
    engine = ENGINES[name][0]
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here: its own suite tests the package")
    return _part(name)


def test_the_integrations_package_names_every_engine_package():
    doc = integrations.__doc__ or ""
    for name in ENGINES:
        assert f"``{name}/``" in doc, name
    for module in ("patching", "face", "telemetry", "import_hook", "entry_points"):
        assert f"``{module}.py``" in doc, module


def test_one_layout(name):
    package = _part(name)
    for module in MODULES:
        assert importlib.util.find_spec(f"{package.__name__}.{module}") is not None, module
    assert "internals" in (package.__doc__ or "")


def test_the_same_face_and_nothing_else(name):
    package = _part(name)
    assert set(package.__all__) == FACE | EXTRAS[name]
    for n in package.__all__:
        assert getattr(package, n) is not None, n
    # no public function the face does not list (deprecated names included)
    defined = {
        n
        for n, v in vars(package).items()
        if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == package.__name__
    }
    assert defined <= set(package.__all__), defined - set(package.__all__)
    state = _part(name, "state")
    assert package.ENV_VAR is state.ENV_VAR and package.ENV_VAR.startswith("PORTABLE_SPEC_")
    assert read_mode(package.ENV_VAR, environ={package.ENV_VAR: "1"}) == "on"


def test_internals_name_the_engine_in_one_shape(name):
    engine, _, engine_logger = ENGINES[name]
    internals = _part(name, "internals")
    assert engine == internals.PACKAGE
    assert isinstance(internals.ENGINE, str) and internals.ENGINE
    assert internals.DISTRIBUTIONS and all(isinstance(d, str) for d in internals.DISTRIBUTIONS)
    assert internals.logger.name.startswith(f"{engine_logger}.portable_spec")
    assert internals.TARGETS and isinstance(internals.READS, tuple)
    assert not set(internals.TARGETS) & set(internals.READS)
    assert internals.REVISIONS
    listed = set(internals.TARGETS) | set(internals.READS)
    for revision in internals.REVISIONS.values():
        assert isinstance(revision, Revision)
        assert set(revision.sources) <= listed
    # the one version helper
    expected = engine_version(internals.PACKAGE, internals.DISTRIBUTIONS)
    assert internals.version() == expected
    assert (expected is None) == (importlib.util.find_spec(engine) is None)


def test_the_table_replaces_what_internals_names_and_reads_the_rest(name):
    internals, patches = _part(name, "internals"), _part(name, "patches")
    table = patches.PATCHES
    assert all(isinstance(p, Patch) for p in table)
    assert {p.target for p in table if p.make is not None} == set(internals.TARGETS)
    assert [p.target for p in table if p.make is None] == list(internals.READS)


def test_state_in_one_shape(name):
    state, internals = _part(name, "state"), _part(name, "internals")
    assert isinstance(state.STATS, Stats) and isinstance(state.LOG, LogOnce)
    assert state.LOG.logger is internals.logger
    assert set(state.COUNTERS) <= set(state.STATS.snapshot())
    face = state.INTEGRATION
    assert type(face) is Integration
    assert face.internals is internals and face.stats is state.STATS and face.log is state.LOG
    assert face.modes == ENGINES[name][1]


def test_the_face_is_the_integrations(name, monkeypatch):
    """Each face function is the package's Integration's, not a copy of it."""
    package, state = _part(name), _part(name, "state")
    calls = []
    for method in FACE - {"ENV_VAR"}:
        monkeypatch.setattr(
            state.INTEGRATION, method, lambda *a, _m=method: calls.append((_m, a)) or _m
        )
    assert package.install("shadow") == "install"
    assert package.is_installed() == "is_installed"
    assert package.integration_stats() == "integration_stats"
    package.uninstall()
    package.reset_stats()
    assert calls == [
        ("install", ("shadow",)),
        ("is_installed", ()),
        ("integration_stats", ()),
        ("uninstall", ()),
        ("reset_stats", ()),
    ]


def test_the_packages_are_light_until_an_install():
    """Importing a package (what an entry point or the sglang-jax switch does first) imports
    neither its engine nor its table of patches and their modules."""
    code = (
        "import json, sys\n"
        "import portable_spec.integrations.{v}, portable_spec.integrations.{s}\n"
        "import portable_spec.integrations.{j}, portable_spec.integrations.{t}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.endswith('.patches') or "
        "m.split('.')[0] in ('vllm', 'sglang', 'sgl_jax', 'tpu_inference'))))"
    ).format(v="vllm", s="sglang", j="sglang_jax", t="tpu_inference")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_an_absent_engine_installs_nothing_and_says_nothing(absent, name, caplog):
    _, modes, _ = ENGINES[name]
    with caplog.at_level(logging.DEBUG):
        for mode in modes:
            assert absent.install(mode) is False
            assert not absent.is_installed()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    absent.uninstall()  # idempotent, also when nothing was installed
    assert not absent.is_installed()
    assert importlib.util.find_spec(ENGINES[name][0]) is None  # nothing pretended to be it


MODE_ERROR = re.compile(
    r"^the (?P<engine>\S+) integration's install\(\) takes mode "
    r"(?:'on' or 'shadow'|'on' \((?P=engine) has no shadow mode\)), not (?P<mode>'.*')$"
)


def test_modes_an_engine_cannot_run_are_refused_in_one_wording(absent, name):
    _, modes, _ = ENGINES[name]
    engine = _part(name, "internals").ENGINE
    for mode in ("off", "1", "bogus", *({"on", "shadow"} - set(modes))):
        with pytest.raises(ValueError) as refused:
            absent.install(mode)
        found = MODE_ERROR.match(str(refused.value))
        assert found, str(refused.value)
        assert found["engine"] == engine and found["mode"] == repr(mode)
        assert ("'on' or 'shadow'" in str(refused.value)) == ("shadow" in modes)
    assert not absent.is_installed()


def test_stats_in_one_shape(absent, name):
    snap = absent.integration_stats()
    assert isinstance(snap["median_us"], dict) and isinstance(snap["samples"], dict)
    assert set(snap["median_us"]) == set(snap["samples"])
    counters = [k for k, v in snap.items() if isinstance(v, int)]
    series = [k for k, v in snap.items() if isinstance(v, list)]
    assert counters == list(_part(name, "state").COUNTERS)
    assert all(snap[k] == 0 for k in counters)
    # the same keys a Stats of those names reports
    shape = Stats(counters, series, builds=list(snap["median_us"])).snapshot()
    assert set(shape) == set(snap)
    absent.reset_stats()
    assert absent.integration_stats() == snap


def test_reset_stats_resets_the_same_three_things(absent, name, monkeypatch, caplog):
    """The counters, the once-per-process lines and the warning about an unknown release."""
    state, internals = _part(name, "state"), _part(name, "internals")
    first = state.COUNTERS[0]
    state.STATS.add(first, 3)
    assert state.LOG.first("a kind of event")
    monkeypatch.setattr(internals, "version", lambda: "999.0")  # an engine nobody knows
    with caplog.at_level(logging.WARNING, internals.logger.name):
        assert absent.install() is False
        assert absent.install() is False  # warned once
        absent.reset_stats()
        assert absent.install() is False  # and again after the reset
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert all(
        w.startswith(f"portable_spec: {internals.ENGINE} is not patched (") for w in warnings
    )
    assert absent.integration_stats()[first] == 0
    assert state.LOG.first("a kind of event")
    absent.reset_stats()
