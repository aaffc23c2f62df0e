"""What the GPU image lacks: the carried wheels must cover every requirement the image does not.

:data:`IMAGE_PACKAGES` lists the Python distributions preinstalled on the reference H200
machine's image (as listed on 2026-11-17). :func:`missing_requirements` reads each wheel's
``METADATA`` and returns the requirements that neither another carried wheel nor the image
provides, so ``scripts/fetch-device-wheels.sh`` fails here instead of the import failing there.
"""

from __future__ import annotations

import os
import re
import zipfile

__all__ = ["IMAGE_PACKAGES", "missing_requirements", "normalize", "wheel_name_version"]

IMAGE_PACKAGES = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
    meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
    narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
    prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
    sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
    statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
    typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
    zipp""".split()  # noqa: SIM905 (a word list reads better than 200 quoted names)
)

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str]:
    """``(normalized name, version)`` of a wheel file name."""
    parts = os.path.basename(filename).split("-")
    return normalize(parts[0]), parts[1]


def _requirements(path: str) -> list[str]:
    """Requirement names of a wheel (``Requires-Dist`` lines that are not extras)."""
    with zipfile.ZipFile(path) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(meta).decode("utf-8", "replace")
    names = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1]
        if "extra ==" in spec.replace("extra==", "extra =="):
            continue
        match = _REQUIREMENT.match(spec)
        if match:
            names.append(normalize(match.group(1)))
    return names


def missing_requirements(wheel_dir: str) -> dict[str, list[str]]:
    """``wheel -> requirements`` covered neither by another wheel in ``wheel_dir`` nor by the
    image; also reports two versions of one name (``pip`` refuses them together)."""
    wheels = sorted(f for f in os.listdir(wheel_dir) if f.endswith(".whl"))
    names = [wheel_name_version(f)[0] for f in wheels]
    problems: dict[str, list[str]] = {}
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems["(several versions)"] = duplicates
    carried = set(names)
    for wheel in wheels:
        lacking = [
            r
            for r in _requirements(os.path.join(wheel_dir, wheel))
            if r not in carried and r not in IMAGE_PACKAGES
        ]
        if lacking:
            problems[wheel] = lacking
    return problems
