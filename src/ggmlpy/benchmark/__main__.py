"""``python -m ggmlpy.benchmark``: the same as ``ggmlpy bench``."""

import sys

from .driver import main

sys.exit(main())
