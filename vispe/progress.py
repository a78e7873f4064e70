"""Progress of long benchmark loops on stderr: rows (a model under one policy) made of steps (batches), with an ETA.

On a terminal one line is redrawn at most once a second (``row 2/6 rope_axial (extend): 14/28 batches, 0:35
elapsed, ETA 1:20``); in a log file or CI (stderr not a terminal, or ``$CI`` set) only one line per finished row
is written; ``quiet`` writes nothing. Results stay on stdout.
"""
from __future__ import annotations

import os
import sys
import time
from typing import IO

__all__ = ["RowProgress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``83.4`` -> ``'1:23'``, ``3725`` -> ``'1:02:05'``."""
    s = int(round(max(0.0, seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class RowProgress:
    """``rows`` rows of ``steps_per_row`` steps each (the ETA assumes rows of equal cost: the same shapes and images).

    Call :meth:`start_row` with the row's label, :meth:`step` after each step (a batch, with its cost when steps
    differ), :meth:`end_row` after it.
    """

    def __init__(self, rows: int, steps_per_row: int, quiet: bool = False, stream: IO[str] | None = None,
                 live: bool | None = None, min_interval: float = 1.0, work_per_row: float | None = None) -> None:
        self.rows, self.steps_per_row = max(0, int(rows)), max(1, int(steps_per_row))
        # the ETA counts work, not steps, when steps differ in cost (a batch at 448 px against one at 112 px)
        self.work_per_row = float(work_per_row) if work_per_row else float(self.steps_per_row)
        self.done_work, self._row_work = 0.0, 0.0
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        if live is None:
            live = bool(getattr(self.stream, "isatty", lambda: False)()) and not os.environ.get("CI")
        self.live, self.min_interval = live, min_interval
        self.row, self.label, self.done_steps, self._row_steps = 0, "", 0, 0
        self._t0 = time.monotonic()
        self._row_t0 = self._t0
        self._last_draw = 0.0

    def _eta(self) -> str:
        total = self.rows * self.work_per_row
        if self.done_work <= 0 or total == 0:
            return "ETA --"
        elapsed = time.monotonic() - self._t0
        return f"ETA {format_seconds(elapsed / self.done_work * max(0.0, total - self.done_work))}"

    def skip_row(self) -> None:
        """A row that needs no work (a result reused from an earlier run): out of the count and the ETA."""
        self.rows = max(0, self.rows - 1)

    def start_row(self, label: str) -> None:
        self.row += 1
        self.label = label
        self._row_t0 = time.monotonic()
        self._row_steps, self._row_work = 0, 0.0
        self._draw(force=True)

    def step(self, work: float = 1.0) -> None:
        """One more step of the current row; ``work`` is its cost in the unit of ``work_per_row``."""
        self._row_steps += 1
        self.done_steps += 1
        self._row_work += work
        self.done_work += work
        self._draw()

    def end_row(self) -> None:
        self.done_steps += max(0, self.steps_per_row - self._row_steps)  # a row counts in full once done
        self.done_work += max(0.0, self.work_per_row - self._row_work)
        self._row_steps, self._row_work = self.steps_per_row, self.work_per_row
        if self.quiet:
            return
        line = (f"row {self.row}/{self.rows} {self.label}: done in {format_seconds(time.monotonic() - self._row_t0)}, "
                f"{format_seconds(time.monotonic() - self._t0)} elapsed, {self._eta()}")
        self.stream.write(("\r\033[K" if self.live else "") + line + "\n")
        self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        if self.quiet or not self.live:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        line = (f"row {self.row}/{self.rows} {self.label}: {self._row_steps}/{self.steps_per_row} batches, "
                f"{format_seconds(now - self._t0)} elapsed, {self._eta()}")
        self.stream.write("\r\033[K" + line)
        self.stream.flush()
