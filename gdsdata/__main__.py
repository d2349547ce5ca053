"""``python -m gdsdata``: the same as the ``gdsdata`` command."""

import sys

from .cli import main

sys.exit(main())
