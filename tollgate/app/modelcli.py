"""``tollgate models``: the catalog and the model cache, for operators."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TextIO

from tollgate.models.cache import (
    EntryInUse,
    ModelSourceError,
    check_entry,
    entries_for,
    prepare_model,
    remove_entry,
)
from tollgate.models.catalog import AdapterEntry, ModelEntry, Weights, load_catalog
from tollgate.models.sources import FetchOptions
from tollgate.runtime.settings import CommonSettings


def human_size(n: float) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def _duration(secs: float) -> str:
    if secs < 10:
        return f"{secs:.1f}s"
    seconds = round(secs)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressBar:
    """Bytes, rate and ETA of a download, or the elapsed time of a conversion, on one line.

    Times and rates run from the step's first report (its start) to now. A
    phase in ``opaque`` (a GGUF conversion: it computes for most of its time
    and writes its bytes at the end) shows a spinner and the elapsed time
    instead of a share and a rate it cannot know; its last line gives its
    bytes, time and mean rate. On a terminal the line is redrawn in place;
    otherwise (logs, CI) a line is written every ``every_s`` seconds and when
    a step ends.
    """

    WIDTH = 24
    SPINNER = "|/-\\"
    # a rate over less time than this measures the clock, not the transfer
    MIN_RATE_S = 0.1

    def __init__(
        self,
        out: TextIO = sys.stderr,
        every_s: float = 5.0,
        *,
        opaque: Collection[str] = ("convert",),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out
        self.tty = out.isatty()
        self.every_s = every_s
        self.opaque = frozenset(opaque)
        self.clock = clock
        self._phase = ""
        self._ended = False
        self._started = 0.0
        self._shown: float | None = None  # when the last line was written
        self._ticks = 0
        self._lock = threading.Lock()

    @staticmethod
    def _finished(done: int, total: int | None) -> bool:
        return total is not None and done >= total and done > 0

    def line(self, phase: str, done: int, total: int | None, now: float) -> str:
        elapsed = max(now - self._started, 0.0)
        finished = self._finished(done, total)
        if total:
            done = min(done, total)  # a folder watch may see a few files beyond the weights
        rate = f"{human_size(done / elapsed)}/s" if elapsed >= self.MIN_RATE_S else ""
        parts = [f"{phase:<8}"]
        if phase in self.opaque:
            if finished:
                parts.append(f"done  {human_size(done)} in {_duration(elapsed)}")
                if rate:
                    parts.append(f"({rate})")
            else:
                parts.append(
                    f"{self.SPINNER[self._ticks % len(self.SPINNER)]} {_duration(elapsed)}"
                )
                if done:
                    parts.append(f"{human_size(done)} written")
            return "  ".join(parts)
        if total:
            share = done / total
            filled = int(share * self.WIDTH)
            parts.append(f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {share:4.0%}")
            parts.append(f"{human_size(done)} / {human_size(total)}")
        else:
            parts.append(human_size(done))
        if rate:
            parts.append(rate)
        if total and done < total and rate and done > 0:
            parts.append(f"ETA {_duration((total - done) * elapsed / done)}")
        elif finished:
            parts.append(f"in {_duration(elapsed)}")
        return "  ".join(parts)

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        with self._lock:  # a parallel download reports from its worker threads
            self._report(phase, done, total)

    def _report(self, phase: str, done: int, total: int | None) -> None:
        now = self.clock()
        finished = self._finished(done, total)
        if phase == self._phase and self._ended:
            if finished:
                return  # a late report of a step already shown as done
            self._phase = ""  # the same phase again: the next model's step
        if phase != self._phase:
            if self._phase and not self._ended and self.tty:
                self.out.write("\n")
            self._phase, self._ended, self._started, self._shown = phase, False, now, None
            self._ticks = 0
        quiet = self._shown is not None and now - self._shown < self.every_s
        if not self.tty and not finished and quiet:
            return
        self._shown = now
        text = self.line(phase, done, total, now)
        self._ticks += 1
        if self.tty:
            self.out.write(f"\r{text}\033[K")
            if finished:
                self.out.write("\n")
        else:
            self.out.write(text + "\n")
        self._ended = finished
        self.out.flush()


def _state(entry: Weights, cache: Path) -> str:
    found = entries_for(entry, cache)
    if not found:
        local = entry.source.split("://", 1)[0] in ("file", "package")
        return "used in place" if local and not entry.source.endswith(".gguf") else "not cached"
    shown = []
    for c in found:
        text = f"{c.kind} {human_size(c.size)}"
        if c.revision:
            text += f" rev {c.revision[:12]}"
        if c.in_use:
            text += " in use"
        shown.append(text)
    return ", ".join(shown)


def run_models(action: str, ids: list[str], *, fix: bool = False) -> int:
    common = CommonSettings()
    catalog = load_catalog(common.catalog)
    cache = common.model_cache_dir
    options = FetchOptions.from_settings(common)
    # models and LoRA adapters alike: each has files the cache prepares
    every: list[ModelEntry | AdapterEntry] = [*catalog.models.values(), *catalog.adapters.values()]
    entries = every
    if ids:
        entries = []
        for name in ids:
            found = catalog.resolve(name) or catalog.resolve_adapter(name)
            if found is None:
                print(f"error: model {name!r} is not in the catalog", file=sys.stderr)
                return 1
            entries.append(found)

    def prepare(entry: Weights, timings: dict[str, float]) -> Path:
        # The bar below is the progress display: the libraries' own bars (tqdm
        # in transformers' GGUF loading and saving, huggingface_hub's
        # downloads) would write over its line. Read when they are imported,
        # which happens in the first preparation.
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        return prepare_model(
            entry,
            cache,
            options=options,
            budget_bytes=common.model_cache_budget,
            timings=timings,
            progress=ProgressBar(),
        )

    if action == "list":
        for entry in entries:
            aliases = f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else ""
            kind = entry.engine if isinstance(entry, ModelEntry) else f"adapter of {entry.base}"
            print(f"{entry.id}\t{kind}\t{_state(entry, cache)}\t{entry.source}{aliases}")
        return 0
    if action in ("prepare", "pull"):
        for entry in entries:
            timings: dict[str, float] = {}
            try:
                path = prepare(entry, timings)
            except ModelSourceError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            took = ", ".join(f"{part} {s:.1f} s" for part, s in timings.items())
            print(f"{entry.id}: {path}" + (f" ({took})" if took else " (cached)"))
        return 0
    if action == "rm":
        status = 0
        for entry in entries:
            for cached in entries_for(entry, cache):
                try:
                    remove_entry(cached.path)
                    print(f"{entry.id}: removed {cached.path.name} ({human_size(cached.size)})")
                except EntryInUse as exc:
                    print(f"error: {entry.id}: {exc}", file=sys.stderr)
                    status = 1
        return status
    # verify: every file's size and sha256 against the entry's manifest
    status = 0
    for entry in entries:
        for cached in entries_for(entry, cache):
            problems = check_entry(cached.path, full=True)
            if not problems:
                print(f"{entry.id}: {cached.path.name} ok ({human_size(cached.size)})")
                continue
            print(f"{entry.id}: {cached.path.name} CORRUPT: {'; '.join(problems[:5])}")
            if not fix:
                status = 1
                continue
            try:
                remove_entry(cached.path)
                prepare(entry, {})
                print(f"{entry.id}: prepared again")
            except (EntryInUse, ModelSourceError) as exc:
                print(f"error: {entry.id}: {exc}", file=sys.stderr)
                status = 1
    return status
