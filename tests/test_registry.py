"""Backend registry: lookup by name and by array type, entry-point plugins, import hygiene."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import portable_spec as ps
from portable_spec.backend import ArrayInfo, Backend
from portable_spec.hostbuffers import HostBufferPool
from portable_spec.registry import backend_for


def run_python(code: str, *, env_extra: dict | None = None, cwd=None) -> str:
    import os

    env = dict(os.environ)
    env.update(env_extra or {})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_names_and_aliases():
    assert ps.get_backend("numpy").name == "numpy"
    assert ps.get_backend("np") is ps.get_backend("numpy")
    assert ps.get_backend("torch") is ps.get_backend("cuda")
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; known backends: \["):
        ps.get_backend("tpu")
    with pytest.raises(TypeError, match="backend name must be a str"):
        ps.get_backend(3)
    assert ps.get_backend("cuda").name == "torch"  # the torch backend's other name


def test_available_backends_name_frameworks_not_devices():
    """The torch backend is listed as "torch" (its arrays live on the CPU or a GPU), so a
    machine without CUDA never shows "cuda"; every listed name can be asked for."""
    names = ps.available_backends()
    assert {"numpy", "torch", "jax"} <= set(names)
    assert "cuda" not in names
    for name in names:
        assert ps.get_backend(name).name == name


def test_backend_for_array_types():
    import torch

    assert backend_for(np.zeros(3)).name == "numpy"
    assert backend_for(np.int64(3)).name == "numpy"
    assert backend_for(torch.zeros(3)).name == "torch"
    assert backend_for(torch.device("cpu")).name == "torch"
    jax = pytest.importorskip("jax")
    assert backend_for(jax.numpy.zeros(3)).name == "jax"
    assert backend_for(jax.devices()[0]).name == "jax"
    with pytest.raises(TypeError, match="no portable_spec backend handles builtins.dict"):
        backend_for({})


def test_import_hygiene():
    """Importing the library and building a mask with a host tree and a pure-Python matcher
    imports neither torch, jax nor xgrammar."""
    out = run_python(
        """
        import sys
        import numpy as np
        import portable_spec as ps

        class M:
            def accept_token(self, t): return True
            def rollback(self, n): pass
            def fill_next_token_bitmask(self, bitmask, index): bitmask[index] = -1
            def is_terminated(self): return False

        tree = ps.GrammarTree.from_host([[1, -1]], [[-1, -1]], [[0, 5]])
        mask = ps.build_grammar_vocab_mask([M()], tree, 100)
        ps.apply_vocab_mask(np.zeros((2, 100), np.float32), mask)
        from portable_spec.registry import backend_for
        backend_for(np.zeros(2))
        print(sorted(m for m in ("torch", "jax", "xgrammar") if m in sys.modules))
        """
    )
    assert out.strip() == "[]"


def test_entry_point_plugin(tmp_path):
    """A third-party backend registered through the `portable_spec.backends` entry-point group
    is listed, loadable by name, found by array type, and its framework is not imported
    until the caller imports it."""
    pkg = tmp_path / "fakefw"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class Tensor:\n    def __init__(self, a): self.a = a\n")
    plugin = tmp_path / "fakefw_backend.py"
    plugin.write_text(
        textwrap.dedent(
            """
            import numpy as np
            from portable_spec.backend import ArrayInfo, Backend
            from portable_spec.hostbuffers import HostBufferPool

            class FakeBackend(Backend):
                name = "fake"
                framework = "fakefw"

                def __init__(self):
                    import fakefw
                    self.fw = fakefw
                    self.pool = HostBufferPool()

                def owns(self, obj):
                    return isinstance(obj, self.fw.Tensor)

                def array_info(self, array):
                    a = np.asarray(array.a)
                    return ArrayInfo(a.shape, a.dtype, a.dtype.kind in "iu")

                def stage(self, arrays):
                    class Ready:
                        def resolve(self_inner):
                            return [np.asarray(x.a) for x in arrays]
                    return Ready()

                def acquire_host_mask(self, rows, words, device=None):
                    return self.pool.acquire((rows, words))

                def release_host_mask(self, buffer):
                    self.pool.release(buffer)

                def upload(self, buffer, device=None):
                    return self.fw.Tensor(np.array(buffer.array))

                def apply_vocab_mask(self, logits, mask):
                    return logits
            """
        )
    )
    dist = tmp_path / "fakefw_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakefw-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[portable_spec.backends]\nfake = fakefw_backend:FakeBackend\n"
    )
    out = run_python(
        """
        import sys
        import portable_spec as ps
        names = ps.available_backends()
        before = "fakefw" in sys.modules
        import fakefw
        t = fakefw.Tensor([[1, -1], [-1, -1], [0, 7]])
        from portable_spec.registry import backend_for
        b = backend_for(t)
        tree = ps.GrammarTree.from_device(fakefw.Tensor([[1, -1]]), fakefw.Tensor([[-1, -1]]),
                                          fakefw.Tensor([[0, 7]]))

        class M:
            def accept_token(self, t): return True
            def rollback(self, n): pass
            def fill_next_token_bitmask(self, bitmask, index): bitmask[index] = 3
            def is_terminated(self): return False

        mask = ps.build_grammar_vocab_mask([M()], tree, 64)
        print("fake" in names, before, b.name, type(mask).__name__, mask.a.tolist())
        """,
        env_extra={"PYTHONPATH": str(tmp_path)},
    )
    assert out.strip().split(maxsplit=4) == [
        "True",
        "False",
        "fake",
        "Tensor",
        "[[3, 3], [-1, -1]]",
    ]


def test_register_backend_checks():
    with pytest.raises(TypeError, match="expects a Backend subclass"):
        ps.register_backend(object)

    class Nameless(Backend):
        pass

    with pytest.raises(ValueError, match="must set both `name` and `framework`"):
        ps.register_backend(Nameless)


class _PlacedArray:
    """An array of a made-up framework: host data plus where it lives (None: host)."""

    def __init__(self, data, device=None):
        self.data = np.asarray(data)
        self.device = device


class _PlacedBackend(Backend):
    name = "placed-test"
    framework = "numpy"

    def __init__(self):
        self.pool = HostBufferPool()

    def owns(self, obj):
        return isinstance(obj, _PlacedArray)

    def array_info(self, array):
        return ArrayInfo(array.data.shape, array.data.dtype, array.data.dtype.kind in "iu")

    def device_of(self, array):
        return array.device

    def stage(self, arrays):
        data = [a.data for a in arrays]

        class Ready:
            def resolve(self):
                return data

        return Ready()

    def acquire_host_mask(self, rows, words, device=None):
        return self.pool.acquire((rows, words))

    def release_host_mask(self, buffer):
        self.pool.release(buffer)

    def upload(self, buffer, device=None):
        return _PlacedArray(self.pool.lend(buffer), device)

    def apply_vocab_mask(self, logits, mask):
        return logits


def test_tree_device_is_the_first_array_that_has_one():
    """Mixed host and device arrays of one framework (a CPU tensor first, then CUDA ones):
    the tree's device, where its mask goes, is the first array's that lives on a device."""
    ps.register_backend(_PlacedBackend)
    host = _PlacedArray([[1, -1]])
    placed = _PlacedArray([[-1, -1]], device="npu:3")
    tree = ps.GrammarTree.from_device(host, placed, _PlacedArray([[0, 5]], device="npu:3"))
    assert tree.backend.name == "placed-test"
    assert tree.device == "npu:3"
    mask = ps.build_grammar_vocab_mask([None], tree, 64, row_capacity=2)
    if mask is not None:  # with a capacity, the all-allowed mask goes where the tree lives
        assert mask.device == "npu:3"
    all_host = ps.GrammarTree.from_device(host, _PlacedArray([[-1, -1]]), _PlacedArray([[0, 5]]))
    assert all_host.device is None
