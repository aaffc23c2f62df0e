"""The guard that every test leaves the library as it found it (tests/_leak_guard.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import _leak_guard as guard

from portable_spec.builder import dense, routes, small_llguidance

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_changed_constant_function_or_method_is_named_and_put_back():
    before = guard._library_state()
    work, fill = routes.EXECUTOR_WORK, dense.fill_llguidance_chains
    walks, in_place = dense._DenseRows.__dict__["llguidance_walks"], small_llguidance.in_place
    routes.EXECUTOR_WORK = 1
    dense.fill_llguidance_chains = lambda *args: None
    dense._DenseRows.llguidance_walks = lambda *args: None
    del small_llguidance.in_place
    changed = guard.changed_since(before)
    assert sorted(changed) == [
        "portable_spec.builder.dense._DenseRows.llguidance_walks",
        "portable_spec.builder.dense.fill_llguidance_chains",
        "portable_spec.builder.routes.EXECUTOR_WORK",
        "portable_spec.builder.small_llguidance.in_place",
    ]
    assert routes.EXECUTOR_WORK is work
    assert dense.fill_llguidance_chains is fill
    assert dense._DenseRows.__dict__["llguidance_walks"] is walks
    assert small_llguidance.in_place is in_place
    assert guard.changed_since(before) == []


def test_a_leaking_test_fails_and_the_next_one_sees_the_library_as_it_was(tmp_path):
    """Two tests in one process: the first leaves a route threshold and the compiled helper
    changed; it errors at its teardown naming both, and the second sees neither."""
    (tmp_path / "test_two.py").write_text(
        textwrap.dedent(
            """
            from portable_spec import native
            from portable_spec.builder import routes

            WORK, HELPER = routes.EXECUTOR_WORK, native.native

            def test_leaks():
                routes.EXECUTOR_WORK = 1
                native.use(None)

            def test_after():
                assert routes.EXECUTOR_WORK is WORK
                assert native.native is HELPER
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "_leak_guard", "-p", "no:randomly",
         "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path / "test_two.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 passed, 1 error" in out, out
    assert "ERROR at teardown of test_leaks" in out, out
    assert "portable_spec.builder.routes.EXECUTOR_WORK" in out, out
    assert "portable_spec.native.native" in out, out
