"""``tollgate models``: the catalog and the model cache, for operators."""

from __future__ import annotations

import sys
import time
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
from tollgate.models.catalog import ModelEntry, load_catalog
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
    seconds = round(secs)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressBar:
    """Bytes, rate and ETA of a download or conversion, on one line.

    On a terminal the line is redrawn in place; otherwise (logs, CI) a line is
    written every ``every_s`` seconds and when a phase ends.
    """

    WIDTH = 24

    def __init__(self, out: TextIO = sys.stderr, every_s: float = 5.0) -> None:
        self.out = out
        self.tty = out.isatty()
        self.every_s = every_s
        self._phase = ""
        self._started = self._shown = 0.0

    def line(self, phase: str, done: int, total: int | None, now: float) -> str:
        elapsed = max(now - self._started, 1e-6)
        rate = done / elapsed
        parts = [f"{phase:<8}"]
        if total:
            share = min(done / total, 1.0)
            filled = int(share * self.WIDTH)
            parts.append(f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {share:4.0%}")
            parts.append(f"{human_size(done)} / {human_size(total)}")
        else:
            parts.append(human_size(done))
        parts.append(f"{human_size(rate)}/s")
        if total and done < total and rate > 0:
            parts.append(f"ETA {_duration((total - done) / rate)}")
        elif total and done >= total:
            parts.append(f"in {_duration(elapsed)}")
        return "  ".join(parts)

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        if phase != self._phase:
            if self._phase and self.tty:
                self.out.write("\n")
            self._phase, self._started, self._shown = phase, now, 0.0
        finished = total is not None and done >= total and done > 0
        if not self.tty and not finished and now - self._shown < self.every_s:
            return
        self._shown = now
        text = self.line(phase, done, total, now)
        if self.tty:
            self.out.write(f"\r{text}\033[K")
            if finished:
                self.out.write("\n")
                self._phase = ""
        else:
            self.out.write(text + "\n")
            if finished:
                self._phase = ""
        self.out.flush()


def _state(entry: ModelEntry, cache: Path) -> str:
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
    try:
        entries = [catalog.get(m) for m in ids] if ids else list(catalog.models.values())
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1

    def prepare(entry: ModelEntry, timings: dict[str, float]) -> Path:
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
            print(f"{entry.id}\t{entry.engine}\t{_state(entry, cache)}\t{entry.source}{aliases}")
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
