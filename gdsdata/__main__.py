"""``python -m gdsdata`` and the ``gdsdata`` command (its entry point, ``main``)."""

import sys


def main():
    """``gdsdata.cli.run``, imported here so that a Ctrl-C while the command starts (before its own
    handler is in place) is one line and exit status 130, not a traceback."""
    try:
        from gdsdata.cli import run
    except KeyboardInterrupt:
        print("gdsdata: interrupted while starting; nothing was written", file=sys.stderr)
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
