"""A progress bar on one line of stderr, for the CLI's long steps (loading a checkpoint,
decoding): ``loading weights [##########..........]  45/91``.

On a terminal the line is redrawn in place; elsewhere (a log, a pipe, a test) only the finished
line is written, so logs stay one line per bar. Standard library only.
"""

from __future__ import annotations

import sys

WIDTH = 20      # characters of the bar


class Progress:
    """``Progress(label, total)``; ``update(done)`` or ``advance()``; ``close()`` at the end
    (or use it as a context manager)."""

    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total, self.done = label, max(int(total), 0), 0
        self.stream = sys.stderr if stream is None else stream
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.closed = False

    def line(self) -> str:
        filled = WIDTH if self.total == 0 else WIDTH * self.done // self.total
        width = len(str(self.total))
        return (f"{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] "
                f"{self.done:>{width}}/{self.total}")

    def update(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        self.done = min(done, self.total)
        if self.live:
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stream.write(("\r" if self.live else "") + self.line() + "\n")
        self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
