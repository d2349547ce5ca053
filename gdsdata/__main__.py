"""``python -m gdsdata``: the same as the ``gdsdata`` command."""

import sys

try:
    from gdsdata.cli import run
except KeyboardInterrupt:  # Ctrl-C before the command's own handler is in place (while starting)
    print("gdsdata: interrupted while starting; nothing was written", file=sys.stderr)
    sys.exit(130)
run()
