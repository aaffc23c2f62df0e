"""Install what the check needs into a private folder, leaving the image's packages alone.

Run as a file, before the package is importable (standard library only)::

    python3 tools/devicecheck/prepare.py --site DIR [--wheels DIR] --status FILE

1. Carried wheels (``scripts/fetch-device-wheels.sh``) go to ``DIR`` with ``pip install
   --no-index --no-deps --target``, except those whose distribution the running Python already
   has at the same or a newer version (e.g. ``typing-extensions``): the image's copy stays.
2. The project goes to ``DIR`` without dependencies: ``pip install --no-build-isolation``
   (build isolation would need the network), compiling the optional C helper when a compiler
   is there. If pip cannot build it (no setuptools >= 77, say), the sources are copied as
   ``pyproject.toml``'s ``package-dir`` lays them out (``backends/`` becomes
   ``portable_spec/backends``) and the helper is compiled directly, or left out.
3. ``FILE`` receives what happened (JSON); the exit status is 1 only if the project could not
   be installed at all.

Nothing is installed into the running Python's own site-packages: use ``PYTHONPATH=DIR`` and
``python -P`` (so that the source tree in the current directory does not shadow ``DIR``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib import metadata
from typing import Any

PIP = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir"]
PIP += ["--disable-pip-version-check", "--no-compile", "--upgrade"]


def _version_key(version: str) -> tuple[int, ...]:
    """A sortable key of a release version (``4.16.0`` -> ``(4, 16, 0)``; letters end it)."""
    key = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        key.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(key)


def choose_wheels(folder: str) -> list[dict[str, Any]]:
    """Each wheel in ``folder`` with ``action``: ``install``, or ``keep image's X`` when this
    Python already has the distribution at the wheel's version or newer."""
    chosen = []
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        name, version = os.path.basename(path).split("-")[:2]
        entry: dict[str, Any] = {"file": os.path.basename(path), "name": name, "version": version}
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and _version_key(have) >= _version_key(version):
            entry["action"] = f"kept the image's {have}"
        else:
            entry["action"] = "install"
            entry["path"] = path
        chosen.append(entry)
    return chosen


def install_wheels(folder: str, site: str) -> dict[str, Any]:
    """Install the wheels :func:`choose_wheels` selects into ``site``."""
    wheels = choose_wheels(folder) if os.path.isdir(folder) else []
    paths = [w.pop("path") for w in wheels if w["action"] == "install"]
    report: dict[str, Any] = {"wheels": wheels, "ok": True}
    if paths:
        done = subprocess.run([*PIP, "--target", site, *paths], capture_output=True, text=True)
        report["ok"] = done.returncode == 0
        report["pip_output"] = (done.stdout + done.stderr)[-3000:]
        for w in wheels:
            if w["action"] == "install":
                w["action"] = "installed" if report["ok"] else "failed"
    return report


def _compile_native(root: str, package: str) -> tuple[bool, str]:
    """Compile the C helper (``portable_spec/csrc/``, one translation unit) into ``package``
    with the system C compiler."""
    compiler = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which(
        "cc"
    )
    include = sysconfig.get_paths()["include"]
    if compiler is None:
        return False, "no C compiler"
    if not os.path.exists(os.path.join(include, "Python.h")):
        return False, f"no Python.h in {include}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = os.path.join(package, f"_native{suffix}")
    source = os.path.join(root, "portable_spec", "csrc", "module.c")
    command = [compiler, "-O2", "-shared", "-fPIC", f"-I{include}", source, "-o", target]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return False, f"compiler failed: {done.stderr.strip()[-500:]}"
    return True, "compiled directly"


def copy_project(root: str, site: str) -> dict[str, Any]:
    """The copy fallback: ``portable_spec/`` and ``backends/`` as
    ``site/portable_spec`` and ``site/portable_spec/backends``, plus the C helper if it builds."""
    package = os.path.join(site, "portable_spec")
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(os.path.join(root, "portable_spec"), package, ignore=ignore)
    shutil.copytree(
        os.path.join(root, "backends"), os.path.join(package, "backends"), ignore=ignore
    )
    native, reason = _compile_native(root, package)
    return {"method": "copy", "native": native, "native_reason": reason}


#: what a build of the project reads (copied to a scratch folder: pip builds in the source
#: tree, and a ``build/`` folder left in the checkout could feed stale files to the next build)
PROJECT_FILES = ("pyproject.toml", "setup.py", "README.md", "portable_spec", "backends")


def _pip_install(root: str, site: str) -> subprocess.CompletedProcess:
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "*.egg-info")
    with tempfile.TemporaryDirectory(prefix="portable-spec-build-") as scratch:
        for name in PROJECT_FILES:
            source, target = os.path.join(root, name), os.path.join(scratch, name)
            if os.path.isdir(source):
                shutil.copytree(source, target, ignore=ignore)
            else:
                shutil.copy2(source, target)
        command = [*PIP, "--no-build-isolation", "--target", site, scratch]
        return subprocess.run(command, capture_output=True, text=True)


def install_project(root: str, site: str, *, allow_pip: bool = True) -> dict[str, Any]:
    """Install the project into ``site`` (pip without build isolation, else a copy)."""
    if allow_pip:
        done = _pip_install(root, site)
        if done.returncode == 0:
            native = bool(glob.glob(os.path.join(site, "portable_spec", "_native*")))
            reason = "built by pip" if native else "pip built no extension (no compiler?)"
            return {"method": "pip", "native": native, "native_reason": reason}
        pip_error = (done.stdout + done.stderr).strip()[-1500:]
    else:
        pip_error = "not tried"
    report = copy_project(root, site)
    report["pip_error"] = pip_error
    return report


def main() -> int:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--site", required=True, help="private folder to install into")
    p.add_argument("--wheels", default="", help="folder of carried wheels (may be missing)")
    p.add_argument("--status", required=True, help="JSON file for the install report")
    p.add_argument("--root", default=".", help="the repository root")
    p.add_argument("--copy", action="store_true", help="skip pip for the project: copy it")
    args = p.parse_args()
    start = time.perf_counter()
    root = os.path.abspath(args.root)
    os.makedirs(args.site, exist_ok=True)
    status: dict[str, Any] = {"python": sys.executable, "site": os.path.abspath(args.site)}
    status.update(install_wheels(args.wheels, args.site) if args.wheels else {"wheels": []})
    try:
        status["project"] = install_project(root, args.site, allow_pip=not args.copy)
    except (OSError, shutil.Error) as exc:
        status["project"] = {"method": "failed", "native": False, "native_reason": str(exc)}
    status["wall_s"] = round(time.perf_counter() - start, 2)
    with open(args.status, "w", encoding="utf-8") as f:
        json.dump(status, f, indent=1)
    project = status["project"]
    print(
        f"prepare: {sum(w['action'] == 'installed' for w in status['wheels'])} wheels installed, "
        f"project by {project['method']}, C helper: "
        f"{'yes' if project['native'] else 'no (' + project['native_reason'] + ')'}",
        flush=True,
    )
    return 1 if project["method"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
