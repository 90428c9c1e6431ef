"""A stand-in for a local worker, for the local backend's process-group tests.

``python tests/scaler/group_worker.py MODE``: starts a child in its own process
group (as vLLM starts its engine core: not a session of its own, no parent-death
signal, SIGTERM ignored as vLLM's engine core ignores it while it loads),
records ``<pid> <child pid> <CUDA_VISIBLE_DEVICES> <CUDA_DEVICE_ORDER>`` in
``$GROUP_WORKER_DIR/<worker id>``, then by MODE:

- ``crash``: exits at once with status 3, leaving the child;
- ``serve``: runs until SIGTERM, then exits 0, leaving the child;
- ``stubborn``: ignores SIGTERM (a drain that never ends).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENGINE = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('engine up', flush=True)\n"
    "time.sleep(600)\n"
)


def main() -> int:
    mode = sys.argv[1]
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE)
    assert engine.stdout is not None
    engine.stdout.readline()  # its SIGTERM is ignored from here on
    # Set before the record is written: the test may signal as soon as it reads it.
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    folder = Path(os.environ["GROUP_WORKER_DIR"])
    record = " ".join(
        [
            str(os.getpid()),
            str(engine.pid),
            os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
            os.environ.get("CUDA_DEVICE_ORDER", "-"),
        ]
    )
    partial = folder / f".{os.environ['TOLLGATE_WORKER_WORKER_ID']}"
    partial.write_text(record)
    partial.rename(folder / os.environ["TOLLGATE_WORKER_WORKER_ID"])  # whole or not at all
    if mode == "crash":
        return 3
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
