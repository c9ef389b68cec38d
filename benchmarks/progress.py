"""A one-line progress bar for long sweeps: drawn only on a terminal, erased before table lines."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


class Progress:
    """``[#####.....] 12/40  30%  all_reduce 4 MiB gloo  eta 0:12`` redrawn in place with ``\\r``.

    Enabled only when ``enabled`` and the stream is a TTY, so piped output and logs stay clean.
    Call :meth:`print` for table lines (it erases the bar, prints, and redraws it).
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None, width: int = 24) -> None:
        self.stream = stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(enabled and total > 0 and isatty is not None and isatty())
        self.total, self.width = total, width
        self.done, self.label = 0, ""
        self._t0 = time.monotonic()
        self._shown = 0

    def _line(self) -> str:
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        fill = int(frac * self.width)
        eta = ""
        if 0 < self.done < self.total:
            left = (time.monotonic() - self._t0) / self.done * (self.total - self.done)
            eta = f"  eta {int(left // 60)}:{int(left % 60):02d}"
        text = f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} {frac:4.0%}  {self.label}{eta}"
        cols = shutil.get_terminal_size((100, 20)).columns
        return text[: max(cols - 1, 10)]

    def _draw(self) -> None:
        line = self._line()
        self.stream.write("\r" + line + " " * max(self._shown - len(line), 0))
        self.stream.flush()
        self._shown = len(line)

    def clear(self) -> None:
        """Erase the bar (the line is left empty for the next output)."""
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0

    def update(self, done: int, label: str = "") -> None:
        """``done`` steps finished; ``label`` says what runs now."""
        self.done, self.label = done, label
        if self.enabled:
            self._draw()

    def print(self, text: str) -> None:
        """Print a line of output above the bar."""
        self.clear()
        print(text, file=self.stream, flush=True)
        if self.enabled and self.done < self.total:
            self._draw()

    def finish(self) -> None:
        """Erase the bar for good."""
        self.clear()
