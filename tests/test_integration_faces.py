"""Every engine integration has the same public face on the patching contract: its switch
(``ENV_VAR``, read by :func:`read_mode`), ``install(mode)``, ``uninstall()``,
``is_installed()``, ``integration_stats()`` in :class:`Stats`'s shape and ``reset_stats()``.

Run where the engines are absent (the unit suite's environment): ``install`` returns False
without a warning and patches nothing. The packages against their real engines:
tests/real_vllm, tests/real_tpu_inference, tests/real_sglang_jax, tests/real_sglang.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType

import pytest

from portable_spec.integrations.patching import Stats, read_mode

# package -> (the engine module it patches, the modes install takes)
ENGINES = {
    "vllm": ("vllm", ("on", "shadow")),
    "tpu_inference": ("tpu_inference", ("on",)),
    "sglang_jax": ("sgl_jax", ("on",)),
    "sglang": ("sglang", ("on", "shadow")),
}


def _package(name: str) -> ModuleType:
    return importlib.import_module(f"portable_spec.integrations.{name}")


@pytest.fixture(params=sorted(ENGINES))
def package(request: pytest.FixtureRequest) -> ModuleType:
    engine, _ = ENGINES[request.param]
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here: its own suite tests the package")
    return _package(request.param)


def test_the_same_face(package: ModuleType) -> None:
    face = ("ENV_VAR", "install", "uninstall", "is_installed", "integration_stats", "reset_stats")
    for name in face:
        assert name in package.__all__, name
        assert getattr(package, name) is not None
    assert package.ENV_VAR.startswith("PORTABLE_SPEC_")
    assert read_mode(package.ENV_VAR, environ={package.ENV_VAR: "1"}) == "on"


def test_an_absent_engine_installs_nothing_and_says_nothing(package, caplog) -> None:
    name = package.__name__.rsplit(".", 1)[1]
    _, modes = ENGINES[name]
    with caplog.at_level(logging.DEBUG):
        for mode in modes:
            assert package.install(mode) is False
            assert not package.is_installed()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    package.uninstall()  # idempotent, also when nothing was installed
    assert not package.is_installed()
    engine, _ = ENGINES[name]
    assert importlib.util.find_spec(engine) is None  # nothing pretended to be the engine


def test_modes_each_engine_cannot_run_are_refused_by_name(package) -> None:
    name = package.__name__.rsplit(".", 1)[1]
    _, modes = ENGINES[name]
    for mode in ("off", "1", "bogus", *({"on", "shadow"} - set(modes))):
        with pytest.raises(ValueError, match=repr(mode)):
            package.install(mode)
    assert not package.is_installed()


def test_stats_in_one_shape(package) -> None:
    snap = package.integration_stats()
    assert isinstance(snap["median_us"], dict) and isinstance(snap["samples"], dict)
    assert set(snap["median_us"]) == set(snap["samples"])
    counters = [k for k, v in snap.items() if isinstance(v, int)]
    series = [k for k, v in snap.items() if isinstance(v, list)]
    assert counters and all(snap[k] == 0 for k in counters)
    # the same keys a Stats of those names reports
    shape = Stats(counters, series, builds=list(snap["median_us"])).snapshot()
    assert set(shape) == set(snap)
    package.reset_stats()
    assert package.integration_stats() == snap
