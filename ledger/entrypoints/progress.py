"""A progress line for long commands (`audit verify`, `audit export`, `ops rebuild`).

Written to stderr, and only when stderr is a terminal: a pipe, a log file or a
test sees nothing of it, and stdout (which may carry an export) never does.
The line is redrawn in place at most a few times a second, and cleared when the
work is done, so what the command prints afterwards starts on a clean line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_REDRAW_S = 0.2


class Progress:
    """`done` of `total` (or `done` alone when the total is unknown), as one line."""

    def __init__(
        self, label: str, unit: str, *, stream: TextIO | None = None, force: bool = False
    ) -> None:
        self._label = label
        self._unit = unit
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = force or self._stream.isatty()
        self._drawn_at = 0.0
        self._width = 0

    def update(self, done: int, total: int | None = None) -> None:
        """Show `done` (of `total`); redrawn at most every 0.2 s, always at the end."""
        if not self.enabled:
            return
        now = time.monotonic()
        finished = total is not None and done >= total
        if not finished and now - self._drawn_at < _REDRAW_S:
            return
        self._drawn_at = now
        if total:
            share = min(done / total, 1.0)
            bar = "#" * round(share * 20)
            text = (
                f"{self._label} [{bar:<20}] {share:4.0%}  {done:,} of {total:,} {self._unit}"
            )
        else:
            text = f"{self._label}: {done:,} {self._unit}"
        self._stream.write("\r" + text.ljust(self._width))
        self._stream.flush()
        self._width = len(text)

    def finish(self) -> None:
        """Clear the line (the command's own output follows)."""
        if self.enabled and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0
