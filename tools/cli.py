"""``portable-spec`` command line: ``demo``, ``bench`` and ``masks`` (a quick look at the builder).

Each subcommand lives in its own module and is imported only when used.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]

_SUBCOMMANDS = {
    "demo": ("portable_spec.demo.cli", "grammar-constrained speculative decoding with SmolLM2"),
    "bench": ("portable_spec.bench", "side-by-side performance of the mask build, staging, apply"),
    "masks": ("portable_spec.masks_cli", "build masks for a sample batch and print what happened"),
    "soak": ("portable_spec.soak", "long build+upload run checking that memory stays flat"),
}


def _usage() -> str:
    lines = ["usage: portable-spec <command> [options]", "", "commands:"]
    lines += [f"  {name:7s} {help_}" for name, (_, help_) in _SUBCOMMANDS.items()]
    lines.append("\n`portable-spec <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``portable-spec`` script and ``python -m portable_spec``; returns the
    exit status. A reader that stops early (``portable-spec --help | head -3``) ends the
    command quietly with status 1 (what Python's documentation advises), no traceback."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        # the rest of the output has nowhere to go: send it, and the final flush, to devnull
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    return status


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in _SUBCOMMANDS:
        print(f"portable-spec: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(_SUBCOMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
