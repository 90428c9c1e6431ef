"""Identities on the bus, the NATS server's authorization block, and TLS files.

Each role (router, worker, auth, metering, scaler, and ``admin`` for the
operator's tools) has its own nkey: an Ed25519 key pair whose seed stays with
that role's processes (a file, mode 0600) and whose public key goes into the
NATS server's configuration with the role's permissions
(:mod:`tollgate.wire.permissions`). NATS checks a signature of a server nonce
at every connect; the seed never crosses the network.

Users in the server configuration, not operator/account JWTs: Tollgate runs in
one NATS account, its permissions are a pure function of the topology, and
the file is regenerated whenever identities change. JWTs add a resolver and an
operator key to run, for what they are for (many accounts managed apart from
the server), which one stack does not need.

Rotation: ``rotate`` keeps a role's current seed as ``<role>.previous.nk`` and
writes a new one; the configuration then admits both until ``retire`` removes
the previous one, so services move to the new seed one by one without losing
the bus.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import nkeys

from tollgate.keys.tokens import write_secret
from tollgate.wire import bus
from tollgate.wire.permissions import grant
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700; tighten it when it exists."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def new_seed() -> str:
    """A fresh user nkey seed (``SU...``)."""
    return str(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode())


def public_key(seed: str) -> str:
    """The public half (``U...``) of a user seed; raises ``ValueError`` for a bad seed."""
    try:
        pair = nkeys.from_seed(seed.strip().encode())
        return str(pair.public_key.decode())
    except Exception as exc:  # nkeys raises its own errors and binascii's
        raise ValueError("not an nkey seed") from exc


@dataclass(frozen=True)
class Identities:
    """The seed files of every role of one prefix, in one private folder."""

    folder: Path
    prefix: str = "tg"

    def seed_file(self, role: Role, previous: bool = False) -> Path:
        stem = f"{self.prefix}-{role.value}"
        return self.folder / (f"{stem}.previous.nk" if previous else f"{stem}.nk")

    def ensure(self, roles: Iterable[Role] = tuple(Role)) -> Identities:
        """Create the seed of each role that has none (existing seeds are kept)."""
        private_dir(self.folder)
        for role in roles:
            path = self.seed_file(role)
            if not path.exists():
                write_secret(path, new_seed() + "\n")
        return self

    def rotate(self, role: Role) -> None:
        """A new seed for ``role``; the current one stays admitted as the previous one."""
        current = self.seed_file(role)
        if current.exists():
            os.replace(current, self.seed_file(role, previous=True))
        write_secret(current, new_seed() + "\n")

    def retire(self, role: Role) -> bool:
        """Stop admitting ``role``'s previous seed; whether there was one."""
        previous = self.seed_file(role, previous=True)
        if not previous.exists():
            return False
        previous.unlink()
        return True

    def public_keys(self, role: Role) -> list[str]:
        """The role's admitted public keys: the current one, then a previous one."""
        keys = []
        for previous in (False, True):
            path = self.seed_file(role, previous)
            if path.exists():
                keys.append(public_key(path.read_text()))
        return keys


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate and key, and the CA that clients trust."""

    cert: Path
    key: Path
    ca: Path
    verify_clients: bool = False  # mutual TLS: clients must show a certificate of this CA


def authorization(identities: Iterable[Identities]) -> dict[str, object]:
    """The server's ``authorization`` block: one user per role and prefix, with its grant."""
    users = []
    for ids in identities:
        topology = Topology(Subjects(ids.prefix))
        for role in Role:
            g = grant(topology, role)
            permissions = {"publish": {"allow": list(g.publish)}}
            permissions["subscribe"] = {"allow": list(g.subscribe)}
            for key in ids.public_keys(role):
                users.append({"nkey": key, "permissions": permissions})
    return {"users": users}


def server_config(identities: Iterable[Identities], tls: TlsFiles | None = None) -> str:
    """A nats-server configuration file with authentication (and TLS).

    Listen address, JetStream and its store stay on the command line (or in
    the configuration it is merged into). No user means no anonymous access:
    the server refuses any connection that does not sign with a listed key.
    """
    # The largest message: a request body up to the router's limit must fit.
    config: dict[str, object] = {
        "max_payload": bus.MAX_PAYLOAD,
        "authorization": authorization(identities),
    }
    if tls is not None:
        config["tls"] = {
            "cert_file": str(tls.cert),
            "key_file": str(tls.key),
            "ca_file": str(tls.ca),
            "verify": tls.verify_clients,
            "timeout": 5,
        }
    return (
        "# Generated by Tollgate (tollgate bus config): every role's identity and permissions.\n"
        + json.dumps(config, indent=2)
        + "\n"
    )


def make_certificates(folder: Path, hosts: Iterable[str], *, days: int = 825) -> TlsFiles:
    """A private CA and a server certificate for ``hosts`` (names or IP addresses).

    For a stack without a certificate authority of its own (a test, a single
    machine reached over a network); production brings certificates from its
    own authority (cert-manager, for one).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    private_dir(folder)
    now = dt.datetime.now(dt.UTC)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> str:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tollgate bus CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tollgate-nats")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(
        cert=folder / "server.pem", key=folder / "server-key.pem", ca=folder / "ca.pem"
    )
    write_secret(files.ca, ca_cert.public_bytes(serialization.Encoding.PEM).decode())
    write_secret(files.cert, cert.public_bytes(serialization.Encoding.PEM).decode())
    write_secret(files.key, pem_key(key))
    write_secret(folder / "ca-key.pem", pem_key(ca_key))
    return files
