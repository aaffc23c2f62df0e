"""``python -m tools.devicecheck``: the device check (see ``scripts/device-check.sh``).

Subcommands: ``run`` (the check; what the script calls), ``part`` (one part, internal),
``export-vocab PATH`` (SmolLM2's vocabulary as a file that travels), ``check-wheels DIR``
(the carried wheels cover what the image lacks).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence

__all__ = ["main"]


def _limits(pairs: Sequence[str]) -> dict[str, float]:
    limits = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            limits[name] = float(value)
        except ValueError:
            raise SystemExit(f"--limit expects PART=SECONDS, got {pair!r}") from None
    return limits


def _run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from tools.devicecheck.driver import BY_NAME, Options, run_check

    parts = tuple(args.parts.split(",")) if args.parts else tuple(BY_NAME)
    unknown = [p for p in parts if p not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; parts: {', '.join(BY_NAME)}")
    limits = _limits(args.limit)
    unknown = [p for p in limits if p not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown parts in --limit: {unknown}")
    root = os.path.abspath(args.root)
    options = Options(
        mode="cpu" if args.cpu else "gpu",
        out=os.path.abspath(args.out),
        work=os.path.abspath(args.work or tempfile.mkdtemp(prefix="portable-spec-check-")),
        root=root,
        total_s=args.total,
        limits=limits,
        parts=parts,
        prepare_status=args.prepare_status,
        command=list(argv),
    )
    return run_check(options)


def _part(args: argparse.Namespace) -> int:
    from tools.devicecheck.driver import BY_NAME
    from tools.devicecheck.profiles import profile_for
    from tools.devicecheck.results import PartRecorder

    spec = BY_NAME[args.name]
    assert spec.module is not None, f"{args.name} is not run as a part process"
    rec = PartRecorder(args.result, args.name, args.mode)
    try:
        importlib.import_module(spec.module).run(rec, profile_for(args.mode))
    except BaseException:
        rec.note("error", traceback.format_exc()[-4000:])
        raise
    rec.finish()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    from tools.devicecheck.limits import DEFAULT_TOTAL_S

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m tools.devicecheck")
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the check (scripts/device-check.sh calls this)")
    run.add_argument("--cpu", action="store_true", help="no GPU: GPU parts are skipped")
    run.add_argument("--out", required=True, help="folder for device-check.json/.md/.log")
    run.add_argument("--work", help="folder for intermediate files (default: a new temp dir)")
    run.add_argument("--root", default=".", help="repository root (the tests live there)")
    run.add_argument(
        "--total",
        type=float,
        default=DEFAULT_TOTAL_S,
        help=f"total time limit, s ({DEFAULT_TOTAL_S:.0f}): a guard against a hang",
    )
    run.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PART=S",
        help="a part's own time limit (default: none under --cpu, calibrated on the GPU)",
    )
    run.add_argument("--parts", help="comma-separated parts to run (default: all)")
    run.add_argument("--prepare-status", help="JSON written by prepare.py (install report)")
    part = sub.add_parser("part", help="run one part (internal)")
    part.add_argument("name")
    part.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    part.add_argument("--result", required=True)
    vocab = sub.add_parser("export-vocab", help="write SmolLM2's vocabulary file")
    vocab.add_argument("path")
    wheels = sub.add_parser("check-wheels", help="carried wheels cover what the image lacks")
    wheels.add_argument("folder")
    args = p.parse_args(argv)
    if args.command == "run":
        return _run(args, argv)
    if args.command == "part":
        return _part(args)
    if args.command == "export-vocab":
        from portable_spec.testing import load_vocab, save_vocab

        save_vocab(load_vocab(), args.path)
        return 0
    if args.command == "check-wheels":
        from tools.devicecheck.wheels import missing_requirements

        problems = missing_requirements(args.folder)
        for wheel, names in problems.items():
            print(f"{wheel}: not carried and not in the image: {', '.join(names)}")
        return 1 if problems else 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
