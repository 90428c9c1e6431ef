"""The closed bus's cost: the gateway hop with and without authentication and TLS on NATS.

Two stacks side by side on this machine, each with its own nats-server, a
router (API keys on) and a simulated-engine worker: one on an open bus
(plain TCP, no identities), one on the closed bus as deployed (every service
on its own nkey, permissions from the topology, TLS with a certificate the
services verify). Both are measured in the same alternating rounds
(:func:`bench.__main__.interleaved_sweeps`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import procs as P
from tollgate.app.busauth import Identities, make_certificates, server_config
from tollgate.runtime.settings import CommonSettings
from tollgate.wire.topology import Role


def start_closed_nats(procs: P.Procs, folder: Path) -> tuple[str, Identities, Path]:
    """A nats-server that admits only generated identities, over TLS: its URL, ids, CA."""
    ids = Identities(folder / "identities").ensure()
    tls = make_certificates(folder / "tls", ["127.0.0.1"])
    config = folder / "auth.conf"
    config.write_text(server_config([ids], tls))
    url = P.start_nats(procs, config=config, store=folder / "store", scheme="tls")
    return url, ids, tls.ca


def bench_bus(work: Path, env: dict[str, str], quick: bool, rounds: int) -> dict[str, Any]:
    from bench.__main__ import SIM, interleaved_sweeps

    print("bus: the gateway on an open bus and on the closed bus (nkeys + TLS)", flush=True)
    with P.processes(work, env) as procs:
        open_nats = P.start_nats(procs)
        open_headers = P.api_key(open_nats, work)
        open_base = P.start_router(procs, open_nats)
        P.start_worker(procs, open_nats, SIM)

        closed_work = work / "closed"
        closed_work.mkdir()
        url, ids, ca = start_closed_nats(procs, closed_work / "nats")

        def role_env(role: Role) -> dict[str, str]:
            return {
                "TOLLGATE_NATS_NKEY_FILE": str(ids.seed_file(role)),
                "TOLLGATE_NATS_TLS_CA": str(ca),
                "TOLLGATE_VAR_DIR": str(closed_work),
            }

        admin = CommonSettings(
            nats_url=url, nats_nkey_file=ids.seed_file(Role.ADMIN), nats_tls_ca=ca
        )
        access = admin.bus_access(Role.ADMIN)
        closed_headers = P.api_key(url, closed_work, access)
        closed_base = P.start_router(procs, url, **role_env(Role.ROUTER))
        P.start_worker(procs, url, SIM, access=access, **role_env(Role.WORKER))
        targets = {
            "open_bus": (f"{open_base}/v1/chat/completions", open_headers),
            "closed_bus": (f"{closed_base}/v1/chat/completions", closed_headers),
        }
        out = interleaved_sweeps(targets, quick, rounds)
    out["rounds"] = rounds
    return out
