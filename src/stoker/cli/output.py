"""What every command prints the same way: counts with their nouns, sizes, a progress bar."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress", "counted", "size"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and its noun, singular for one: "1 group", "2 groups", "3 pairs"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def size(nbytes: float) -> str:
    """Bytes in one style everywhere the CLI prints them: B below 1 KiB, else KiB/MiB/GiB/TiB."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            break
    return f"{nbytes:.1f} {unit}"


class Progress:
    """Progress of a long step on stderr: a bar redrawn in place on a terminal; elsewhere (a
    log, a pipe) a plain line at most every `LINE_SECONDS`, and one at the end."""

    LINE_SECONDS = 10.0
    WIDTH = 30

    def __init__(self, total: int, label: str, unit: str = "") -> None:
        self.total, self.label, self.unit, self.done = total, label, unit, 0
        self.live = sys.stderr.isatty()
        self.started = self.said = time.perf_counter()

    def step(self, note: str = "") -> None:
        self.done += 1
        now = time.perf_counter()
        part = f"{self.done}/{self.total}{' ' + self.unit if self.unit else ''}"
        finished = self.done >= self.total
        if self.live:
            filled = self.WIDTH * self.done // max(1, self.total)
            bar = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}]"
            sys.stderr.write(f"\r{self.label} {bar} {part} {note}".rstrip() + ("\n" if finished else ""))
            sys.stderr.flush()
        elif finished or now - self.said >= self.LINE_SECONDS:
            self.said = now
            share = self.done / max(1, self.total)
            print(f"{self.label}: {part} ({share:.0%}) after {now - self.started:.1f}s", file=sys.stderr, flush=True)
