"""``python -m ggmlpy``: the ``ggmlpy`` command."""

import sys

from ggmlpy.cli import main

sys.exit(main())
