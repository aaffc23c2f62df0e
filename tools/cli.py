"""``python -m tools``: the checkout's command line (``demo``, ``bench``, ``masks``, ``soak``).

Run from the repository root (the scripts in ``scripts/`` do: ``scripts/demo.sh``,
``scripts/bench.sh``, ``scripts/masks.sh``, ``scripts/soak.sh``). Each command lives in its own
module, imported only when used, and also runs alone (``python -m tools.bench``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["COMMANDS", "main", "run_main"]

#: command -> (module with ``main(argv) -> int``, one line of help)
COMMANDS = {
    "demo": ("examples.demo.cli", "grammar-constrained speculative decoding with SmolLM2"),
    "bench": ("tools.bench.cli", "side-by-side performance of the mask build, staging, apply"),
    "masks": ("tools.masks", "build masks for a sample batch and print what happened"),
    "soak": ("tools.soak", "long build+upload run checking that memory stays flat"),
}


def _usage() -> str:
    lines = ["usage: python -m tools <command> [options]", "", "commands:"]
    lines += [f"  {name:7s} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n`python -m tools <command> --help` for a command's options.")
    return "\n".join(lines)


def run_main(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` (default: ``sys.argv[1:]``) and return its exit status (blocks for
    the whole command). A reader that stops early (``... --help | head -3``) ends the command
    quietly with status 1 (what Python's documentation advises), no traceback."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        status = int(main(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        # the rest of the output has nowhere to go: send it, and the final flush, to devnull
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    return status


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"tools: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m tools``; returns the exit status."""
    return run_main(_dispatch, argv)
