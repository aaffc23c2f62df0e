"""``python -m portable_spec``: same as the ``portable-spec`` script."""

import sys

from portable_spec.cli import main

sys.exit(main())
