"""A text progress bar for long work: loading weights, writing a model file.

It sits on the lowest floor (it imports nothing of ggmlpy) because the benchmark draws it while it
writes its synthetic models, below the command line; :mod:`ggmlpy.backend` re-exports it, its public
home since before this module.
"""

from __future__ import annotations

import sys

__all__ = ["ProgressBar"]


class ProgressBar:
    """A text progress bar for ``Weights.load(progress=...)`` and other long work.

    ``bar(done, total)`` redraws one line on ``stream`` (stderr by default):
    ``loading [##########..........]  50%  12.0/24.0 MiB``; the line ends when
    ``done == total``. On a stream that is not a terminal it prints one line
    per 10% step reached (each step once) and the final line once, however
    often the caller reports the same figures, so logs stay short.

    Parameters
    ----------
    label : str
        Text before the bar.
    width : int
        Characters of the bar.
    stream : text stream, optional
        Where to draw (default ``sys.stderr``).
    unit : str
        What ``done`` and ``total`` count: ``"bytes"`` (shown in MiB, the
        default) or the name of anything else (``"params"``), shown in
        millions: ``1.2/24.5 M params``.
    """

    def __init__(self, label: str = "loading", width: int = 30, stream=None, unit: str = "bytes"):
        self.label, self.width, self.unit = label, width, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1
        self._ended = False

    def _amount(self, done: int, total: int) -> str:
        if self.unit == "bytes":
            return f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB"
        return f"{done / 1e6:.1f}/{total / 1e6:.1f} M {self.unit}"

    def __call__(self, done: int, total: int) -> None:
        frac = 1.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
        end = done >= total
        if end and self._ended:
            return                        # the final line is drawn once, however often it is reported
        if not end:
            if self._ended:               # a new run with the same bar
                self._ended, self._last_tenth = False, -1
            tenth = int(frac * 10)
            if not self.tty and tenth == self._last_tenth:
                return
            self._last_tenth = tenth
        self._ended = end
        filled = int(round(frac * self.width))
        pct = frac * 100 if end else min(frac * 100, 99.0)   # "100%" only on the final line
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {pct:3.0f}%  "
                f"{self._amount(done, total)}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if end else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
