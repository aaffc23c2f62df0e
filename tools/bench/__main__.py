"""``python -m portable_spec.bench``: the same as ``portable-spec bench``."""

import sys

from portable_spec.bench import main

sys.exit(main())
