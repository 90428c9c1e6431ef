"""Engine processes die with their worker; a stop interrupts a blocking engine start.

The real engine's cases (vLLM's engine core after a SIGKILL, a SIGTERM during its
start) are in tests/worker/test_engine_lifetime.py; these use stand-in processes
(tests/worker/lifetime_child.py) started as vLLM starts its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from services.worker.lifetime import PARENT_ENV

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_dead(pids: list[int], timeout: float = 10) -> list[int]:
    """The pids still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@contextlib.contextmanager
def stand_in(mode: str) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """A stand-in worker and the pids of the processes it started; all killed at the end."""
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.worker.lifetime_child", mode],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        yield proc, pids
    finally:
        for pid in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("mode", ["fork", "spawn", "grandchild"])
def test_engine_processes_die_when_their_worker_is_killed(mode: str) -> None:
    with stand_in(mode) as (worker, engines):
        assert engines and all(alive(p) for p in engines)
        worker.kill()  # SIGKILL: the worker runs no code of its own any more
        worker.wait()
        assert wait_dead(engines) == [], "every engine process dies with the worker"


def test_without_the_guard_a_child_outlives_its_worker() -> None:
    """The control case: the test above would see an orphan."""
    with stand_in("unguarded") as (worker, [child]):
        worker.kill()
        worker.wait()
        assert wait_dead([child], timeout=1) == [child]


def test_an_engine_process_whose_worker_is_already_gone_exits() -> None:
    """The worker died before the child armed its signal: the child exits at once."""
    script = (
        "import os\n"
        "from services.worker.lifetime import die_with_parent\n"
        f"os.environ[{PARENT_ENV!r}] = str(os.getppid() + 100000)\n"
        "die_with_parent()\n"
        "print('still here')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout) == (1, "")


def test_the_worker_itself_and_unrelated_processes_are_left_alone() -> None:
    script = (
        "import os\n"
        "from services.worker.lifetime import die_with_parent\n"
        "print(die_with_parent())\n"  # no worker pid in the environment
        f"os.environ[{PARENT_ENV!r}] = str(os.getpid())\n"
        "print(die_with_parent())\n"  # the worker itself
    )
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.stdout.split() == ["False", "False"]


def test_vllm_loads_the_plugin_in_its_processes() -> None:
    """vLLM runs every ``vllm.general_plugins`` entry point in each process it starts."""
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("tollgate_engine_lifetime") == "services.worker.lifetime:vllm_plugin"


def test_a_stop_signal_interrupts_a_blocking_start_and_still_reaches_the_loop() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.worker.lifetime_child", "interrupt"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "interrupted=True loop=True", out.stderr


def test_engine_processes_left_at_the_end_are_killed_and_named() -> None:
    import multiprocessing

    from services.worker.lifetime import kill_engine_processes

    context = multiprocessing.get_context("spawn")
    done = context.Process(target=time.sleep, args=(0,))
    left = context.Process(target=time.sleep, args=(60,))
    done.start()
    left.start()
    done.join(30)
    assert kill_engine_processes() == [left.pid], "only what still ran is named"
    assert not left.is_alive() and left.exitcode == -signal.SIGKILL
