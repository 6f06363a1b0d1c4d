"""``python -m hyscale_compile.explain package.module:factory [--json]``: print the per-site report."""

import sys

from . import main

sys.exit(main())
