"""The integrations' patching contract, on a small engine written to disk and imported for real
(source hashes, module rebinding and the import hook all need real modules)."""

from __future__ import annotations

import importlib
import logging
import re
import sys
import textwrap
import threading

import pytest

from portable_spec.integrations.face import read_mode
from portable_spec.integrations.import_hook import ImportHook
from portable_spec.integrations.patching import Patch, PatchSet, Revision, resolve, source_hash
from portable_spec.integrations.telemetry import LogOnce, Stats

ENGINE = """
class Base:
    def inherited(self):
        return "base"


class Worker(Base):
    def step(self, x):
        return x + 1

    @staticmethod
    def helper(x):
        return x * 2

    @classmethod
    def make(cls):
        return cls.__name__


def build(x):
    return x - 1


def bug(x):
    return "bug"
"""
USER = """
from {pkg}.core import build
from {pkg}.core import build as renamed


def call(x):
    return build(x)
"""


@pytest.fixture
def engine(tmp_path, monkeypatch, request):
    """A package ``<name>`` with ``core`` (the engine) and ``user`` (a module that bound
    ``build`` by name before any patch)."""
    pkg = "fake_engine_" + re.sub(r"\W", "_", request.node.name)
    root = tmp_path / pkg
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "core.py").write_text(textwrap.dedent(ENGINE))
    (root / "user.py").write_text(USER.format(pkg=pkg))
    (root / "late.py").write_text(USER.format(pkg=pkg))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield pkg
    for name in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
        del sys.modules[name]


def _hashes(pkg, *names):
    return {f"{pkg}.core:{n}": source_hash(resolve(f"{pkg}.core:{n}")[2]) for n in names}


def _wrap(tag):
    def make(original):
        def replacement(*args):
            return (tag, original(*args))

        return replacement

    return make


def _set(pkg, version="1.2.3", **overrides):
    targets = {
        "Worker.step": Patch(f"{pkg}.core:Worker.step", _wrap("step")),
        "Worker.inherited": Patch(f"{pkg}.core:Worker.inherited", _wrap("inh")),
        "Worker.helper": Patch(f"{pkg}.core:Worker.helper", _wrap("helper")),
        "Worker.make": Patch(f"{pkg}.core:Worker.make", _wrap("make")),
        "build": Patch(f"{pkg}.core:build", _wrap("build"), rebind=True),
        "bug": Patch(f"{pkg}.core:bug", _wrap("fixed"), fixes="the bug"),
    }
    targets.update(overrides)
    importlib.import_module(f"{pkg}.user")
    sources = _hashes(pkg, *targets)
    return PatchSet(
        "fake",
        patches=list(targets.values()),
        revisions={"r1": Revision("1.2", sources)},
        version=lambda: version,
        logger=logging.getLogger("test.fake"),
    )


@pytest.mark.parametrize(
    "value,mode",
    [
        ("1", "on"),
        ("on", "on"),
        (" ON ", "on"),
        ("shadow", "shadow"),
        ("", "off"),
        ("0", "off"),
        ("off", "off"),
        (None, "off"),
    ],
)
def test_read_mode(value, mode):
    environ = {} if value is None else {"X_SWITCH": value}
    assert read_mode("X_SWITCH", environ=environ) == mode


@pytest.mark.parametrize("value", ["yes", "true", "2", "onn", "shadows"])
def test_read_mode_refuses_anything_else_by_name(value):
    with pytest.raises(ValueError, match="X_SWITCH"):
        read_mode("X_SWITCH", environ={"X_SWITCH": value})


def test_read_mode_without_shadow():
    with pytest.raises(ValueError, match="X_SWITCH='shadow'"):
        read_mode("X_SWITCH", shadow=False, environ={"X_SWITCH": "shadow"})


@pytest.mark.parametrize("spec", ["nocolon", "a:b:c", ":x", "x:"])
def test_resolve_refuses_malformed_targets(spec):
    with pytest.raises(ValueError, match="not 'package.module"):
        resolve(spec)


def test_install_replaces_rebinds_and_uninstall_restores(engine, caplog):
    core = importlib.import_module(f"{engine}.core")
    user = importlib.import_module(f"{engine}.user")
    build, step = core.build, core.Worker.step
    patches = _set(engine)
    with caplog.at_level(logging.INFO, "test.fake"):
        assert patches.install()
    assert patches.is_installed() and patches.revision == "r1"
    assert [r.message for r in caplog.records].count(
        "portable_spec: fake r1 patched (6 functions replaced)"
    ) == 1
    w = core.Worker()
    assert w.step(1) == ("step", 2)
    assert w.inherited() == ("inh", "base")
    assert core.Worker.helper(3) == ("helper", 6) and w.helper(3) == ("helper", 6)
    assert core.Worker.make() == ("make", "Worker")
    # bound by name before the install, and imported after it
    assert user.build(5) == ("build", 4) and user.renamed(5) == ("build", 4)
    assert user.call(5) == ("build", 4)
    late = importlib.import_module(f"{engine}.late")
    assert late.build(5) == ("build", 4)
    assert patches.original(f"{engine}.core:build") is build
    assert source_hash(core.build) == source_hash(build)  # the engine's source, not ours
    assert patches.install()  # idempotent: nothing wrapped twice
    assert w.step(1) == ("step", 2)

    patches.uninstall()
    assert not patches.is_installed()
    assert core.build is build and user.build is build and user.renamed is build
    assert late.build is build  # bound the replacement while it was installed
    assert core.Worker.step is step and "inherited" not in vars(core.Worker)
    assert isinstance(vars(core.Worker)["helper"], staticmethod)
    assert w.inherited() == "base" and core.Worker.make() == "Worker"


def test_an_unknown_source_patches_nothing_and_warns_once(engine, caplog):
    patches = _set(engine)
    core = importlib.import_module(f"{engine}.core")
    original = core.bug
    exec(compile("def bug(x):\n    return 'changed'\n", core.__file__, "exec"), core.__dict__)
    core.bug.__code__ = core.bug.__code__.replace(co_firstlineno=10_000)  # no source to read
    changed = core.bug
    with caplog.at_level(logging.WARNING, "test.fake"):
        assert not patches.install()
        assert not patches.install()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{engine}.core:bug" in warnings[0].getMessage()
    assert not patches.is_installed()
    assert core.Worker().step(1) == 2 and core.build(1) == 0 and core.bug is changed
    assert original is not changed


@pytest.mark.parametrize("version", ["1.3.0", "1.21", "2"])
def test_another_version_patches_nothing(engine, caplog, version):
    patches = _set(engine, version=version)
    with caplog.at_level(logging.WARNING, "test.fake"):
        assert not patches.install()
    assert "version" in caplog.text and version in caplog.text
    assert importlib.import_module(f"{engine}.core").build(1) == 0


def test_an_absent_engine_is_no_warning(engine, caplog):
    patches = _set(engine, version=None)
    with caplog.at_level(logging.DEBUG, "test.fake"):
        assert not patches.install()
    assert not caplog.records


def test_a_failing_replacement_undoes_the_whole_set(engine):
    core = importlib.import_module(f"{engine}.core")
    user = importlib.import_module(f"{engine}.user")
    build = core.build

    def fail(original):
        raise RuntimeError("cannot make it")

    patches = _set(engine, bug=Patch(f"{engine}.core:bug", fail))
    with pytest.raises(RuntimeError, match="cannot make it"):
        patches.install()
    assert not patches.is_installed()
    assert core.build is build and user.build is build
    assert core.Worker().step(1) == 2 and "inherited" not in vars(core.Worker)


def test_a_revision_without_a_fix_leaves_that_patch_out(engine):
    core = importlib.import_module(f"{engine}.core")
    patches = _set(engine)
    sources = dict(patches.revisions["r1"].sources)
    del sources[f"{engine}.core:bug"]  # the engine fixed it upstream
    fixed = PatchSet(
        "fake",
        patches=patches.patches,
        revisions={"r2": Revision("1.2", sources)},
        version=lambda: "1.2.9",
        logger=logging.getLogger("test.fake"),
    )
    assert fixed.install()
    assert core.bug(0) == "bug" and core.build(1) == ("build", 0)
    fixed.uninstall()


def test_read_only_targets_are_recognised_not_replaced(engine):
    core = importlib.import_module(f"{engine}.core")
    patches = _set(engine, bug=Patch(f"{engine}.core:bug"))
    bug = core.bug
    assert patches.install()
    assert core.bug is bug
    patches.uninstall()


def test_patches_of_one_target_stack_in_table_order_and_leave_as_a_whole(engine, caplog):
    core = importlib.import_module(f"{engine}.core")
    user = importlib.import_module(f"{engine}.user")
    build, step = core.build, core.Worker.step
    target = f"{engine}.core:Worker.step"
    stacked = [
        Patch(target, _wrap("fix"), fixes="the step bug"),
        Patch(target, _wrap("mask")),
        Patch(f"{engine}.core:build", _wrap("fix"), fixes="the step bug", rebind=True),
        Patch(f"{engine}.core:build", _wrap("mask"), rebind=True),
    ]
    patches = PatchSet(
        "fake",
        patches=stacked,
        revisions={"r1": Revision("", _hashes(engine, "Worker.step", "build"))},
        version=lambda: "1",
        logger=logging.getLogger("test.fake"),
    )
    with caplog.at_level(logging.INFO, "test.fake"):
        assert patches.install()
    assert "(2 functions replaced)" in caplog.text
    assert core.Worker().step(1) == ("mask", ("fix", 2))  # the first made from the engine's
    assert user.build(5) == ("mask", ("fix", 4)) and core.build(5) == user.build(5)
    assert patches.original(target) is step and source_hash(core.Worker.step) == source_hash(step)
    patches.uninstall()
    assert core.Worker.step is step and core.build is build and user.build is build


def test_a_revision_naming_a_fixed_bug_leaves_only_that_patch_out(engine):
    core = importlib.import_module(f"{engine}.core")
    target = f"{engine}.core:Worker.step"
    stacked = [Patch(target, _wrap("fix"), fixes="the step bug"), Patch(target, _wrap("mask"))]
    sources = _hashes(engine, "Worker.step")
    patches = PatchSet(
        "fake",
        patches=stacked,
        revisions={"r2": Revision("", sources, fixed=frozenset({"the step bug"}))},
        version=lambda: "1",
        logger=logging.getLogger("test.fake"),
    )
    assert patches.installs("r2") == (stacked[1],)
    assert patches.install()
    assert core.Worker().step(1) == ("mask", 2)
    patches.uninstall()
    assert core.Worker().step(1) == 2


def test_tables_that_contradict_themselves_are_refused(engine):
    with pytest.raises(ValueError, match="fixed bugs no patch works around"):
        PatchSet(
            "fake",
            patches=[Patch("a:b", fixes="one bug")],
            revisions={"r": Revision("1", {"a:b": "0"}, fixed=frozenset({"another bug"}))},
            version=lambda: "1",
            logger=logging.getLogger("test.fake"),
        )
    with pytest.raises(ValueError, match="unpatched targets"):
        PatchSet(
            "fake",
            patches=[Patch("a:b")],
            revisions={"r": Revision("1", {"a:c": "0"})},
            version=lambda: "1",
            logger=logging.getLogger("test.fake"),
        )


def test_the_version_prefix_matches_whole_parts():
    assert Revision("0.32").matches_version("0.32.0")
    assert Revision("0.32").matches_version("0.32")
    assert Revision("0.5.23").matches_version("0.5.23.post1")
    assert not Revision("0.32").matches_version("0.321")
    assert not Revision("0.32").matches_version("0.3")
    assert Revision("").matches_version("7.0")


def test_the_import_hook_fires_after_the_import(engine):
    seen = []
    hook = ImportHook(f"{engine}.core", seen.append, logging.getLogger("test.fake"))
    hook.activate()
    assert hook.waiting() and not seen
    core = importlib.import_module(f"{engine}.core")
    assert seen == [core] and not hook.waiting()
    assert all(not isinstance(f, type(hook._finder)) or f is None for f in sys.meta_path[:1])
    hook.activate()  # already imported: at once
    assert seen == [core, core]


def test_a_failing_import_callback_never_breaks_the_import(engine, caplog):
    def fail(module):
        raise RuntimeError("nope")

    hook = ImportHook(f"{engine}.core", fail, logging.getLogger("test.fake"))
    hook.activate()
    with caplog.at_level(logging.ERROR, "test.fake"):
        core = importlib.import_module(f"{engine}.core")
    assert core.build(1) == 0
    assert "patching" in caplog.text and "nope" in caplog.text


def test_two_hooks_of_this_kind_do_not_ask_each_other_forever(engine):
    seen = []
    log = logging.getLogger("test.fake")
    first = ImportHook(f"{engine}.core", seen.append, log)
    second = ImportHook(f"{engine}.core", seen.append, log)
    first.activate()
    second.activate()
    importlib.import_module(f"{engine}.core")
    assert len(seen) >= 1
    first.deactivate()
    second.deactivate()


def test_stats_shape_and_threads():
    stats = Stats(["steps", "rows"], ["waited_s"], history=3)
    threads = [
        threading.Thread(target=lambda: [stats.add("steps") for _ in range(1000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats.add("rows", 7)
    for v in (1.0, 2.0, 3.0, 4.0):
        stats.sample("waited_s", v)
    stats.time("portable_spec", 8, 2e-6)
    stats.time("portable_spec", 8, 4e-6)
    stats.time("engine", 1, 1e-6)
    snap = stats.snapshot()
    assert snap["steps"] == 4000 and snap["rows"] == 7
    assert snap["waited_s"] == [2.0, 3.0, 4.0]
    assert snap["median_us"] == {"portable_spec": {8: pytest.approx(3.0)}, "engine": {1: 1.0}}
    assert snap["samples"] == {"portable_spec": {8: 2}, "engine": {1: 1}}
    with pytest.raises(KeyError):
        stats.add("unknown")
    stats.update({"steps": 2, "rows": 1}, {"waited_s": 5.0})
    with pytest.raises(KeyError, match="unknown"):
        stats.update({"steps": 1, "unknown": 1})  # nothing counted
    with pytest.raises(KeyError, match="unknown_s"):
        stats.update({"steps": 1}, {"unknown_s": 1.0})  # nothing counted either
    snap = stats.snapshot()
    assert (snap["steps"], snap["rows"], snap["waited_s"]) == (4002, 8, [3.0, 4.0, 5.0])
    stats.reset()
    assert stats.snapshot()["steps"] == 0 and stats.snapshot()["median_us"] == {}


def test_stats_list_their_builds_before_any_timing():
    stats = Stats(["calls"], builds=["portable_spec", "engine"])
    assert stats.add("calls") == 1 and stats.add("calls", 2) == 3
    snap = stats.snapshot()
    assert snap["median_us"] == {"portable_spec": {}, "engine": {}}
    assert snap["samples"] == {"portable_spec": {}, "engine": {}}
    stats.time("engine", 4, 5e-6)
    stats.reset()
    assert stats.snapshot()["median_us"] == {"portable_spec": {}, "engine": {}}


def test_sources_are_what_a_new_revision_lists(engine):
    patches = _set(engine)
    assert patches.sources() == dict(patches.revisions["r1"].sources)
    missing = PatchSet(
        "fake",
        patches=[Patch(f"{engine}.core:nowhere")],
        revisions={},
        version=lambda: "1",
        logger=logging.getLogger("test.fake"),
    )
    assert missing.sources() == {f"{engine}.core:nowhere": None}


def test_reset_warning_warns_again(engine, caplog):
    patches = _set(engine, version="9.0")
    with caplog.at_level(logging.WARNING, "test.fake"):
        assert not patches.install()
        assert not patches.install()
        patches.reset_warning()
        assert not patches.install()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_log_once_per_kind_until_reset(caplog):
    once = LogOnce(logging.getLogger("test.fake"))
    with caplog.at_level(logging.INFO, "test.fake"):
        for _ in range(3):
            once.warning("a", "refused %s", "a")
            once.warning("b", "refused %s", "b")
            once.info("c", "said once")
        once.reset()
        once.warning("a", "refused %s", "a")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a",
        "refused b",
        "said once",
        "refused a",
    ]
    assert once.first("d") and not once.first("d")


# -- patch sets stacked on the same functions -----------------------------------------------


def _tagged(pkg, tag, calls=None):
    """A patch set replacing ``build`` (rebound) and ``Worker.step``, each result tagged."""

    def make(original):
        if calls is not None:
            calls.append(tag)

        def replacement(*args):
            return (tag, original(*args))

        return replacement

    targets = ("build", "Worker.step")
    return PatchSet(
        f"fake-{tag}",
        patches=[
            Patch(f"{pkg}.core:build", make, rebind=True),
            Patch(f"{pkg}.core:Worker.step", make),
        ],
        revisions={"r1": Revision("", _hashes(pkg, *targets))},
        version=lambda: "1",
        logger=logging.getLogger("test.fake"),
    )


def _calls(pkg):
    """What ``build(5)`` and ``Worker().step(1)`` return, through the owner, a module that
    bound ``build`` before any install and one imported now."""
    core = importlib.import_module(f"{pkg}.core")
    user = importlib.import_module(f"{pkg}.user")
    late = importlib.import_module(f"{pkg}.late")
    return core.build(5), user.build(5), late.build(5), core.Worker().step(1)


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_stacked_sets_uninstall_in_any_order_and_leave_the_other(engine, order):
    core = importlib.import_module(f"{engine}.core")
    user = importlib.import_module(f"{engine}.user")
    build, step = core.build, core.Worker.step
    sets = {tag: _tagged(engine, tag) for tag in "AB"}
    assert sets["A"].install() and sets["B"].install()
    assert _calls(engine) == (("B", ("A", 4)),) * 3 + (("B", ("A", 2)),)
    first, second = order
    sets[first].uninstall()
    assert not sets[first].is_installed() and sets[second].is_installed()
    assert _calls(engine) == ((second, 4),) * 3 + ((second, 2),)
    assert sets[second].original(f"{engine}.core:build") is build
    sets[second].uninstall()
    assert not sets[second].is_installed()
    late = importlib.import_module(f"{engine}.late")
    assert core.build is build and user.build is build and user.renamed is build
    assert late.build is build and core.Worker.step is step


def test_the_middle_of_three_stacked_sets_comes_out_alone(engine):
    core = importlib.import_module(f"{engine}.core")
    build = core.build
    sets = [_tagged(engine, tag) for tag in "ABC"]
    for s in sets:
        assert s.install()
    assert _calls(engine)[0] == ("C", ("B", ("A", 4)))
    sets[1].uninstall()
    assert _calls(engine) == (("C", ("A", 4)),) * 3 + (("C", ("A", 2)),)
    assert sets[0].is_installed() and sets[2].is_installed() and not sets[1].is_installed()
    sets[0].uninstall()
    assert _calls(engine) == (("C", 4),) * 3 + (("C", 2),)
    sets[2].uninstall()
    assert core.build is build and _calls(engine) == (4, 4, 4, 2)


def test_a_stacked_set_recognises_the_engine_under_another(engine):
    """The source hash of a replacement is the engine's, however many sets are stacked."""
    sets = [_tagged(engine, tag) for tag in "AB"]
    assert sets[0].install()
    assert sets[1].recognise() == ("r1", "")
    assert sets[1].install()
    third = _tagged(engine, "C")
    assert third.recognise() == ("r1", "")
    for s in sets:
        s.uninstall()


def test_an_uninstall_that_cannot_remake_the_set_above_changes_nothing(engine):
    calls: list[str] = []
    lower = _tagged(engine, "A")
    assert lower.install()

    def fragile(original):  # makes its replacement once, then refuses
        if calls:
            raise RuntimeError("made once only")
        calls.append("B")
        return lambda *args: ("B", original(*args))

    upper = PatchSet(
        "fake-B",
        patches=[Patch(f"{engine}.core:build", fragile, rebind=True)],
        revisions={"r1": Revision("", _hashes(engine, "build"))},
        version=lambda: "1",
        logger=logging.getLogger("test.fake"),
    )
    assert upper.install()
    before = _calls(engine)
    assert before[:3] == (("B", ("A", 4)),) * 3
    with pytest.raises(RuntimeError, match="fake-B.*made again.*nothing was changed"):
        lower.uninstall()
    assert _calls(engine) == before
    assert lower.is_installed() and upper.is_installed()
    upper.uninstall()
    lower.uninstall()
    assert _calls(engine) == (4, 4, 4, 2)


def test_a_reloaded_module_is_not_patched_and_installs_again(engine):
    core = importlib.import_module(f"{engine}.core")
    user = importlib.import_module(f"{engine}.user")
    own = core.build
    patches = _set(engine)
    assert patches.install() and patches.is_installed()
    importlib.reload(core)  # the engine's own functions again, a new Worker class
    assert not patches.is_installed()
    assert core.build(5) == 4 and core.Worker().step(1) == 2
    assert patches.install() and patches.is_installed()
    assert core.build(5) == ("build", 4) and core.Worker().step(1) == ("step", 2)
    # a module that bound the function before the reload keeps what it bound (as a reload
    # leaves it), never the replacement of a function its module no longer has
    assert user.build is own
    late = importlib.import_module(f"{engine}.late")
    assert late.build(5) == ("build", 4)
    patches.uninstall()
    assert not patches.is_installed()
    assert core.build(5) == 4 and core.Worker().step(1) == 2 and late.build(5) == 4
    assert user.build is own


def test_uninstall_after_a_reload_leaves_the_reloaded_functions(engine):
    core = importlib.import_module(f"{engine}.core")
    patches = _set(engine)
    assert patches.install()
    importlib.reload(core)
    fresh_build, fresh_worker = core.build, core.Worker
    patches.uninstall()
    assert core.build is fresh_build and core.Worker is fresh_worker
    assert "inherited" not in vars(core.Worker) and core.Worker().step(1) == 2


def test_a_function_replaced_by_someone_else_is_not_installed(engine):
    core = importlib.import_module(f"{engine}.core")
    patches = _set(engine)
    assert patches.install()

    def theirs(x):
        return "theirs"

    core.build = theirs
    assert not patches.is_installed()
    patches.uninstall()
    assert core.build is theirs  # left as it now is
    assert core.Worker.step(core.Worker(), 1) == 2  # the rest given back


# -- what the one warning says --------------------------------------------------------------


def test_a_module_that_cannot_be_imported_is_named_not_taken_for_another_source(engine, caplog):
    """An engine module that fails to import here (a dependency missing) is reported as that
    import failure, with what it raised, never as a source that differs."""
    root = importlib.import_module(engine).__path__[0]
    with open(f"{root}/spec.py", "w") as f:
        f.write("import portable_spec_missing_dependency\n\ndef build(x):\n    return x\n")
    importlib.invalidate_caches()
    patches = _set(engine)
    patches.revisions["r1"] = Revision(
        "1.2", {**patches.revisions["r1"].sources, f"{engine}.spec:build": "0" * 64}
    )
    patches.patches = (*patches.patches, Patch(f"{engine}.spec:build"))
    with caplog.at_level(logging.WARNING, "test.fake"):
        assert not patches.install()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{engine}.spec does not import here" in warning, warning
    assert "No module named 'portable_spec_missing_dependency'" in warning, warning
    assert "differ" not in warning
    assert patches.sources()[f"{engine}.spec:build"] is None


def test_a_differing_source_and_a_missing_function_are_named_apart(engine, caplog):
    patches = _set(engine)
    sources = dict(patches.revisions["r1"].sources)
    sources[f"{engine}.core:bug"] = "0" * 64
    sources[f"{engine}.core:nowhere"] = "0" * 64
    patches.revisions["r1"] = Revision("1.2", sources)
    patches.patches = (*patches.patches, Patch(f"{engine}.core:nowhere"))
    label, why = patches.recognise()
    assert label is None
    assert why == (
        f"version 1.2.3, but the source of {engine}.core:bug differs "
        f"and {engine}.core:nowhere not found"
    )
