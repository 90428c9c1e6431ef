"""`tollgate models pull`'s progress lines: times and rates measured from each step's start."""

from __future__ import annotations

import io

from tollgate.app.modelcli import ProgressBar

MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bar(every_s: float = 5.0) -> tuple[ProgressBar, io.StringIO, Clock]:
    out, clock = io.StringIO(), Clock()
    return ProgressBar(out, every_s, clock=clock), out, clock


def test_a_conversion_shows_its_elapsed_time_and_its_real_mean_rate() -> None:
    # What a GGUF conversion reports: its start, nothing written for a long
    # while, its bytes within the last second, a folder-watch report that sees
    # the tokenizer files too (more than the weights' total), then its end.
    progress, out, clock = bar()
    total = 269 * MB
    progress("convert", 0, total)
    for _ in range(21):
        clock.now += 1
        progress("convert", 0, total)
    clock.now += 2
    progress("convert", total + 3 * MB, total)  # the watch sees the folder done
    clock.now += 0.4
    progress("convert", total, total)  # the step's own end, a moment later
    lines = out.getvalue().splitlines()
    # no share, no byte rate while it runs: a spinner and the time since the start
    assert lines[:5] == [
        "convert   | 0.0s",
        "convert   / 5.0s",
        "convert   - 10s",
        "convert   \\ 15s",
        "convert   | 20s",
    ]
    # its end once, with the time since the step started and the rate over that time
    assert lines[5:] == ["convert   done  269.0 MB in 23s  (11.7 MB/s)"]


def test_a_download_shows_share_rate_and_eta_then_its_total_time() -> None:
    progress, out, clock = bar(every_s=2.0)
    total = 100 * MB
    progress("fetch", 0, total)
    for _ in range(4):
        clock.now += 1
        progress("fetch", int((clock.now - 1000) * 10 * MB), total)
    clock.now += 6
    progress("fetch", total, total)
    assert out.getvalue().splitlines() == [
        "fetch     [........................]   0%  0 B / 100.0 MB",
        "fetch     [####....................]  20%  20.0 MB / 100.0 MB  10.0 MB/s  ETA 8.0s",
        "fetch     [#########...............]  40%  40.0 MB / 100.0 MB  10.0 MB/s  ETA 6.0s",
        "fetch     [########################] 100%  100.0 MB / 100.0 MB  10.0 MB/s  in 10s",
    ]


def test_the_next_model_starts_its_steps_afresh() -> None:
    progress, out, clock = bar()
    for model in range(2):
        progress("convert", 0, 10 * MB)
        clock.now += 30 + model * 10
        progress("convert", 10 * MB, 10 * MB)
        clock.now += 100  # between the two models: not part of either step
    done = [line for line in out.getvalue().splitlines() if "done" in line]
    assert done == [
        "convert   done  10.0 MB in 30s  (333.3 KB/s)",
        "convert   done  10.0 MB in 40s  (250.0 KB/s)",
    ]


def test_an_instant_step_has_no_rate() -> None:
    progress, out, clock = bar()
    progress("fetch", 0, 5 * MB)
    clock.now += 0.01
    progress("fetch", 5 * MB, 5 * MB)
    assert out.getvalue().splitlines()[-1].endswith("5.0 MB / 5.0 MB  in 0.0s")


def test_a_terminal_line_is_redrawn_in_place() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, clock = Tty(), Clock()
    progress = ProgressBar(out, clock=clock)
    progress("convert", 0, MB)
    clock.now += 0.5
    progress("convert", 0, MB)
    clock.now += 0.5
    progress("convert", MB, MB)
    assert out.getvalue() == (
        "\rconvert   | 0.0s\033[K"
        "\rconvert   / 0.5s\033[K"
        "\rconvert   done  1.0 MB in 1.0s  (1.0 MB/s)\033[K\n"
    )
