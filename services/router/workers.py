"""The router's live view of workers: the shared heartbeat view.

A call's worker counts as lost once it has been silent for
``TOLLGATE_ROUTER_HEARTBEAT_MISSES`` of its beat intervals
(:meth:`WorkerView.alive`, :meth:`WorkerView.window`).
"""

from __future__ import annotations

from tollgate.runtime.workers import WorkerView

__all__ = ["WorkerView"]
