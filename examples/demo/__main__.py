"""``python -m examples.demo``: the end-to-end demo (see :mod:`examples.demo.cli`)."""

import sys

from examples.demo.cli import main

sys.exit(main(sys.argv[1:]))
