"""Progress of long work (pack, merge, verify): a tqdm bar on stderr where stderr is a terminal
(or a notebook's); where it is a file or a pipe (a batch job's log, Slurm's), the same figures as a plain line at
start, at most once every ``LOG_INTERVAL`` seconds, and at the end, instead of a bar's carriage
returns."""

import io
import sys

from tqdm import tqdm

LOG_INTERVAL = 60.0  # seconds between two lines of progress in a log


class _Lines(io.TextIOBase):
    """``stream`` for a bar written as lines: tqdm's carriage returns dropped, each state a line.
    Where the stream cannot be written any more (a log collector gone: a broken pipe), progress
    stops, not the work, as with logging."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line and self.stream is not None:
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # (ValueError: the stream closed)
                self.stream = None
        return len(text)

    def flush(self):
        pass  # (each line is flushed as it is written)


def bar(show: bool, **kwargs) -> tqdm:
    """A tqdm bar (``kwargs``: tqdm's) on stderr: none unless ``show``; where stderr is not a
    terminal, lines (see the module)."""
    stream = sys.stderr
    if not show:
        return tqdm(disable=True, **kwargs)
    if stream.isatty() or "ipykernel" in sys.modules:  # (a notebook's stderr is no terminal, yet shows a bar)
        return tqdm(file=stream, **kwargs)
    return tqdm(file=_Lines(stream), mininterval=LOG_INTERVAL, maxinterval=LOG_INTERVAL, ascii=True, **kwargs)
