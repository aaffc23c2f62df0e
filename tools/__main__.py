"""``python -m tools <command>``: see :mod:`tools.cli`."""

import sys

from tools.cli import main

sys.exit(main())
