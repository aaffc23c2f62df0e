"""``python -m tools.bench``: the benchmark (see :mod:`tools.bench.cli`)."""

import sys

from tools.bench.cli import main
from tools.cli import run_main

sys.exit(run_main(main))
