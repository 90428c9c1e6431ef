"""``tollgate bus``: identities, the NATS server's configuration, permissions, TLS files."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from tollgate.app.busauth import Identities, TlsFiles, make_certificates, server_config
from tollgate.wire.permissions import describe
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

DEFAULT_DIR = Path("var/nats/identities")


Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
# cli.command: adds a subcommand with its one-line summary
Command = Callable[[Subcommands, str, str], argparse.ArgumentParser]


def add_parser(sub: Subcommands, command: Command) -> None:
    """``tollgate bus`` and its actions; ``command`` adds one with its one-line summary."""
    bus = command(sub, "bus", "identities, permissions and TLS files for NATS")
    actions = bus.add_subparsers(dest="action", required=True, metavar="ACTION")

    ids = command(actions, "identities", "create each role's nkey seed; print public keys")
    ids.add_argument("--rotate", type=Role, help="new seed for ROLE; the old one stays admitted")
    ids.add_argument("--retire", type=Role, help="stop admitting ROLE's previous seed")

    config = command(actions, "config", "print nats-server's authorization (and TLS)")
    config.add_argument("--tls-cert", type=Path, help="the server's certificate (PEM)")
    config.add_argument("--tls-key", type=Path, help="the server certificate's key (PEM)")
    config.add_argument("--tls-ca", type=Path, help="the CA clients are verified with (PEM)")
    config.add_argument(
        "--verify-clients", action="store_true", help="mutual TLS: clients show a certificate"
    )

    perms = command(actions, "permissions", "the permission table (Markdown)")
    perms.add_argument("--prefix", default="tg", help="subject prefix")

    certs = command(actions, "certs", "a private CA and a server certificate")
    certs.add_argument("--out", type=Path, required=True, help="folder to write them to")
    certs.add_argument("--host", action="append", required=True, help="name or IP (repeatable)")

    for p in (ids, config):
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the seeds are")
        p.add_argument("--prefix", action="append", help="subject prefix (repeatable; tg)")
    bus.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    if ns.action == "permissions":
        print(describe(Topology(Subjects(ns.prefix))), end="")
        return 0
    if ns.action == "certs":
        files = make_certificates(ns.out, ns.host)
        print(f"CA {files.ca}\ncertificate {files.cert}\nkey {files.key}")
        return 0
    prefixes = ns.prefix or ["tg"]
    every = [Identities(ns.dir, prefix) for prefix in prefixes]
    if ns.action == "identities":
        for ids in every:
            ids.ensure()
            if ns.rotate:
                ids.rotate(ns.rotate)
            if ns.retire and not ids.retire(ns.retire):
                print(f"{ns.retire.value} has no previous seed", file=sys.stderr)
            for role in Role:
                keys = ", ".join(ids.public_keys(role))
                print(f"{ids.prefix} {role.value:9} {keys}   ({ids.seed_file(role)})")
        return 0
    tls = None
    if ns.tls_cert or ns.tls_key or ns.tls_ca:
        if not (ns.tls_cert and ns.tls_key and ns.tls_ca):
            print("error: give --tls-cert, --tls-key and --tls-ca together", file=sys.stderr)
            return 2
        tls = TlsFiles(ns.tls_cert, ns.tls_key, ns.tls_ca, ns.verify_clients)
    missing = [ids.seed_file(r) for ids in every for r in Role if not ids.seed_file(r).exists()]
    if missing:
        print(f"error: no seed {missing[0]}; run `tollgate bus identities`", file=sys.stderr)
        return 2
    print(server_config(every, tls), end="")
    return 0
