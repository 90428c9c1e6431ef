"""The closed bus on a real nats-server: each role may do its job and nothing else.

The server runs with the configuration Tollgate generates (one nkey per role,
permissions derived from the topology). For every role one allowed action
works and the forbidden ones are refused by the server itself.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS

from services.worker.claims import WorkClaims
from tests.conftest import NatsServer
from tests.lib.net import free_port
from tollgate.app.busauth import Identities, server_config
from tollgate.runtime.settings import CommonSettings, SettingError
from tollgate.wire import bus
from tollgate.wire.permissions import grant, subject_matches
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

S = Subjects()
T = Topology(S)
REPLY = S.reply("router-1", "req-1")


class Probe:
    """A connection as one role that records what the server refused."""

    def __init__(self, server: NatsServer, role: Role, prefix: str = "tg") -> None:
        self.server = server
        self.role = role
        self.prefix = prefix
        self.errors: list[str] = []

    async def __aenter__(self) -> Probe:
        access = self.server.access(self.role, self.prefix)

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc: NATS = await nats.connect(
            self.server.url,
            nkeys_seed_str=access.seed,
            tls=access.tls,
            inbox_prefix=access.inbox_prefix,
            error_cb=on_error,
            allow_reconnect=False,
        )
        self.js = self.nc.jetstream(timeout=1.0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def refused(self, subject: str, timeout: float = 3.0, kind: str = "publish") -> bool:
        """Whether the server reported a permissions violation on ``subject``.

        ``kind`` is ``publish`` or ``subscription``.
        """
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            # nats.py reports the server's error in lower case
            if any(f'violation for {kind} to "{subject.lower()}"' in e for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False

    async def publish_refused(self, subject: str, data: bytes = b"{}") -> bool:
        await self.nc.publish(subject, data)
        await self.nc.flush()
        return await self.refused(subject)

    async def subscribe_refused(self, subject: str) -> bool:
        await self.nc.subscribe(subject)
        await self.nc.flush()
        return await self.refused(subject, kind="subscription")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(free_port(), tmp_path_factory.mktemp("closed-bus"), tls=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def admin(server: NatsServer) -> AsyncIterator[NATS]:
    """The operator: creates everything (as the services' start-up would) and a key record."""
    nc = await server.connect(name="test-operator")
    js = nc.jetstream()
    await T.ensure(js)
    kv = await js.key_value(S.keys_bucket)
    await kv.put("key-1", b'{"type": "tg.key.v1"}')
    yield nc
    await nc.close()


def usage_event() -> bytes:
    """A forged usage event that would credit a tenant a thousand tokens."""
    event = {
        "type": "tg.usage.v1",
        "request_id": "r-1",
        "time": 0.0,
        "tenant": "acme",
        "key_id": "key-1",
        "model": "m",
        "prompt_tokens": -1000,
        "completion_tokens": 0,
        "outcome": "completed",
        "streamed": False,
        "total_s": 0.1,
        "http_status": 200,
    }
    return json.dumps(event).encode()


async def test_an_anonymous_connection_is_refused(server: NatsServer) -> None:
    # The server says so in its greeting...
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        greeting = sock.recv(4096).decode()
    assert greeting.startswith("INFO ")
    assert json.loads(greeting[5:])["auth_required"] is True
    # ...and a connection without a key gets no further.
    with pytest.raises(bus.BusRefused):
        await bus.connect(server.url, "anonymous", bus.Access(tls=server.access().tls))


async def test_a_key_the_server_does_not_know_is_refused(
    server: NatsServer, tmp_path: Path
) -> None:
    stranger = Identities(tmp_path / "elsewhere").ensure()
    settings = CommonSettings(
        nats_url=server.url,
        nats_nkey_file=stranger.seed_file(Role.ADMIN),
        nats_tls_ca=server.tls_files.ca if server.tls_files else None,
    )
    with pytest.raises(SettingError, match="TOLLGATE_NATS_NKEY_FILE") as refused:
        await asyncio.wait_for(settings.connect(Role.ADMIN, "stranger"), 10)
    seed = stranger.seed_file(Role.ADMIN).read_text().strip()
    assert seed not in str(refused.value)


async def test_an_unreadable_or_malformed_key_names_the_setting(tmp_path: Path) -> None:
    missing = CommonSettings(nats_nkey_file=tmp_path / "nope.nk")
    with pytest.raises(SettingError, match="TOLLGATE_NATS_NKEY_FILE: cannot read"):
        missing.bus_access(Role.ROUTER)
    (tmp_path / "bad.nk").write_text("not-a-seed-but-a-secret-looking-string")
    bad = CommonSettings(nats_nkey_file=tmp_path / "bad.nk")
    with pytest.raises(SettingError) as raised:
        bad.bus_access(Role.ROUTER)
    assert "TOLLGATE_NATS_NKEY_FILE" in str(raised.value)
    assert "secret-looking" not in str(raised.value)


async def test_a_service_without_a_valid_key_exits_at_once(server: NatsServer) -> None:
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env.update(TOLLGATE_NATS_URL=server.url, TOLLGATE_NATS_TLS_CA=str(server.tls_files.ca))  # type: ignore[union-attr]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.metering",
        "--port",
        str(free_port()),
        env={**env, "TOLLGATE_VAR_DIR": str(server.store.parent / "nowhere")},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 78, out.decode()
    assert "TOLLGATE_NATS_NKEY_FILE" in out.decode()


async def test_router_reads_keys_but_cannot_write_them(server: NatsServer, admin: NATS) -> None:
    async with Probe(server, Role.ROUTER) as router:
        kv = await router.js.key_value(S.keys_bucket)
        assert (await kv.get("key-1")).value == b'{"type": "tg.key.v1"}'
        with pytest.raises(nats.errors.TimeoutError):
            await kv.put("key-1", b'{"status": "active"}')
        assert await router.refused(f"$KV.{S.keys_bucket}.key-1")
        assert await router.publish_refused(f"$KV.{S.signing_bucket}.mine")
    # the record is as the operator wrote it
    kv = await admin.jetstream().key_value(S.keys_bucket)
    assert (await kv.get("key-1")).value == b'{"type": "tg.key.v1"}'


async def test_only_auth_and_the_operator_write_keys(server: NatsServer, admin: NATS) -> None:
    async with Probe(server, Role.AUTH) as auth:
        kv = await auth.js.key_value(S.keys_bucket)
        await kv.put("key-2", b'{"type": "tg.key.v1"}')
    for role in (Role.WORKER, Role.METERING, Role.SCALER):
        async with Probe(server, role) as probe:
            assert await probe.publish_refused(f"$KV.{S.keys_bucket}.key-1"), role


async def test_worker_serves_work_but_never_bills_or_reads_keys(
    server: NatsServer, admin: NATS
) -> None:
    async with Probe(server, Role.WORKER) as worker:
        await worker.nc.publish(S.heartbeat("m"), b"{}")  # allowed: heartbeats
        await worker.nc.publish(REPLY, b"{}")  # allowed: chunks to a router
        await worker.nc.flush()
        # a usage event with negative tokens never reaches the stream
        assert await worker.publish_refused(S.usage("acme"), usage_event())
        with pytest.raises(nats.errors.TimeoutError):
            kv = await worker.js.key_value(S.keys_bucket)
            await kv.get("key-1")
        assert await worker.refused(f"$JS.API.STREAM.INFO.KV_{S.keys_bucket}")
        assert await worker.subscribe_refused(f"$KV.{S.keys_bucket}.>")
        assert await worker.subscribe_refused(S.capture_all)
        assert await worker.subscribe_refused(f"{S.prefix}.reply.>")
    assert (await admin.jetstream().stream_info(S.usage_stream)).state.messages == 0


async def test_worker_claims_from_the_work_queue(server: NatsServer, admin: NATS) -> None:
    lane = S.infer_lane("m", "interactive", "acme", "k1")
    async with Probe(server, Role.ROUTER) as router:
        await T.ensure_work(router.js)  # the router makes the work queue
        ack = await router.js.publish(lane, b'{"request": 1}')
        assert ack.stream == S.infer_stream
        withdrawn = await router.js.publish(lane, b'{"request": 2}')
        # a router may withdraw a request (its client left), but never read one
        assert await router.js.delete_msg(S.infer_stream, withdrawn.seq)
        assert await router.publish_refused(f"$JS.API.DIRECT.GET.{S.infer_stream}")
    async with Probe(server, Role.WORKER) as worker:
        claims = WorkClaims(worker.nc, S, "m")
        claimed = await claims.take()
        assert claimed is not None and claimed.data == b'{"request": 1}'
        assert claimed.subject == lane
        assert await claims.take() is None  # claimed by the delete: gone from the queue
    assert (await admin.jetstream().stream_info(S.infer_stream)).state.messages == 0


async def test_worker_creates_nothing_on_the_bus(server: NatsServer, admin: NATS) -> None:
    """A consumer's creator picks where the server delivers its messages: not a worker."""
    async with Probe(server, Role.WORKER) as worker:
        for subject in (
            f"$JS.API.CONSUMER.CREATE.{S.infer_stream}",
            f"$JS.API.CONSUMER.CREATE.{S.infer_stream}.spy.{S.infer_lanes('m')}",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{S.infer_stream}.spy",
            f"$JS.API.STREAM.CREATE.{S.infer_stream}",
            f"$JS.API.STREAM.UPDATE.{S.infer_stream}",
        ):
            body = b'{"config": {"deliver_subject": "tg.usage.acme"}}'
            assert await worker.publish_refused(subject, body), subject
    usage = await admin.jetstream().stream_info(S.usage_stream)
    assert usage.state.messages == 0


async def test_scaler_counts_queued_requests_but_reads_none(
    server: NatsServer, admin: NATS
) -> None:
    async with Probe(server, Role.SCALER) as scaler:
        info = await scaler.js.stream_info(S.infer_stream, subjects_filter=S.infer_lanes("m"))
        assert info.config.name == S.infer_stream
        assert await scaler.subscribe_refused(S.infer_all)
        assert await scaler.subscribe_refused(f"{S.prefix}.infer.>")
        assert await scaler.publish_refused(f"$JS.API.CONSUMER.CREATE.{S.infer_stream}")
        assert await scaler.publish_refused(f"$JS.API.DIRECT.GET.{S.infer_stream}")
        assert await scaler.publish_refused(f"$JS.API.STREAM.MSG.GET.{S.infer_stream}")
        assert await scaler.publish_refused(f"$JS.API.STREAM.MSG.DELETE.{S.infer_stream}")
        assert await scaler.subscribe_refused(S.capture_all)
        await scaler.nc.subscribe(S.arrivals_all)  # allowed: arrivals and heartbeats
        await scaler.nc.subscribe(S.heartbeat_all)
        await scaler.nc.flush()
        assert not await scaler.refused(S.arrivals_all, timeout=0.3, kind="subscription")


async def first_answer(nc: NATS, subject: str) -> nats.aio.msg.Msg:
    """A request's answer once the responder's interest has reached the server's routing
    (a busy server can answer "no responders" for a moment after the subscription)."""
    for _ in range(20):
        try:
            return await nc.request(subject, b"{}", timeout=5)
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.1)
    return await nc.request(subject, b"{}", timeout=5)


async def test_metering_answers_queries_but_cannot_publish_work(
    server: NatsServer, admin: NATS
) -> None:
    async with Probe(server, Role.METERING) as metering, Probe(server, Role.SCALER) as scaler:

        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b'{"answer": 42}')

        await metering.nc.subscribe(S.metering_query, cb=answer)
        await metering.nc.flush()
        reply = await first_answer(scaler.nc, S.metering_query)
        assert reply.data == b'{"answer": 42}'
        # its answers go only to the inboxes of those who may ask: a request
        # that names a key record as its reply subject writes nothing
        await scaler.nc.publish(S.metering_query, b"{}", reply=f"$KV.{S.keys_bucket}.forged")
        assert await metering.refused(f"$KV.{S.keys_bucket}.forged")
        assert await metering.publish_refused(
            S.infer_lane("m", "interactive", "acme", "k1"), b'{"request": 2}'
        )
        assert await metering.publish_refused(f"$JS.API.STREAM.MSG.DELETE.{S.infer_stream}")
    kv = await admin.jetstream().key_value(S.keys_bucket)
    assert "forged" not in await kv.keys()


async def test_only_the_operator_purges_or_deletes_streams(server: NatsServer, admin: NATS) -> None:
    for role in (Role.ROUTER, Role.WORKER, Role.AUTH, Role.METERING, Role.SCALER):
        async with Probe(server, role) as probe:
            for api in ("PURGE", "DELETE"):
                subject = f"$JS.API.STREAM.{api}.{S.usage_stream}"
                assert await probe.publish_refused(subject), (role, api)
    js = admin.jetstream()
    await js.purge_stream(S.infer_stream)
    assert (await js.stream_info(S.infer_stream)).state.messages == 0


async def test_only_workers_publish_to_a_router_reply_subject(
    server: NatsServer, admin: NATS
) -> None:
    async with Probe(server, Role.ROUTER) as router:
        chunks = await router.nc.subscribe(f"{S.reply_prefix('router-1')}.*")
        await router.nc.flush()
        for role in (Role.ROUTER, Role.AUTH, Role.METERING, Role.SCALER):
            async with Probe(server, role) as probe:
                assert await probe.publish_refused(REPLY, b'{"forged": true}'), role
        async with Probe(server, Role.WORKER) as worker:
            await worker.nc.publish(REPLY, b'{"chunk": 1}')
            await worker.nc.flush()
        msg = await chunks.next_msg(timeout=5)
        assert msg.data == b'{"chunk": 1}'
        assert chunks.pending_msgs == 0  # nothing forged got through


async def test_a_role_reads_only_its_own_inbox(server: NatsServer, admin: NATS) -> None:
    async with Probe(server, Role.WORKER) as worker:
        assert await worker.subscribe_refused(f"_INBOX.{S.prefix}.router.>")
        assert await worker.subscribe_refused("_INBOX.>")


async def test_one_prefix_cannot_touch_another(server: NatsServer, admin: NATS) -> None:
    server.add_prefix("other")
    async with Probe(server, Role.ROUTER, prefix="other") as other:
        assert await other.publish_refused(S.infer_lane("m", "interactive", "acme", "k1"))
        assert await other.publish_refused(S.usage("acme"), usage_event())
        assert await other.subscribe_refused(S.heartbeat_all)


async def test_a_rotated_key_works_alongside_the_old_until_retired(
    server: NatsServer, admin: NATS
) -> None:
    ids = server.identities["tg"]
    old = ids.seed_file(Role.SCALER).read_text()
    ids.rotate(Role.SCALER)
    server.add_prefix("tg")  # rewrite the configuration and reload it
    for seed in (old, ids.seed_file(Role.SCALER).read_text()):
        nc = await bus.connect(server.url, "rotating", _access(server, seed))
        await nc.close()
    ids.retire(Role.SCALER)
    server.add_prefix("tg")
    with pytest.raises(bus.BusRefused):
        await bus.connect(server.url, "retired", _access(server, old))


def _access(server: NatsServer, seed: str) -> bus.Access:
    base = server.access(Role.SCALER)
    return bus.Access(seed.strip(), base.tls, base.inbox_prefix)


def test_the_configuration_admits_each_role_once(tmp_path: Path) -> None:
    ids = Identities(tmp_path, "tg").ensure()
    config = json.loads(server_config([ids]).split("\n", 1)[1])
    users = config["authorization"]["users"]
    assert len(users) == len(Role)
    assert {u["nkey"] for u in users} == {ids.public_keys(r)[0] for r in Role}
    assert "tls" not in config


@pytest.mark.parametrize("role", [r for r in Role if r is not Role.ADMIN])
def test_grants_follow_the_topology(role: Role) -> None:
    """Each role publishes where the topology says it writes, and nowhere it does not."""
    g = grant(T, role)
    for stream in T.streams:
        for subject in stream.subjects:
            concrete = subject.replace("*", "x")
            assert g.allows("publish", concrete) == (role in stream.writers), (stream.name, role)
            readable = g.allows("subscribe", concrete)
            assert readable == (role in stream.listeners), (stream.name, role)
    for bucket in T.buckets:
        assert g.allows("publish", f"$KV.{bucket.name}.k") == (role in bucket.writers)
        reads = g.allows("publish", f"$JS.API.DIRECT.GET.KV_{bucket.name}")
        assert reads == (role in bucket.readers | bucket.writers), (bucket.name, role)
    # nobody but the operator deletes or purges anything
    for stream in T.streams:
        assert not g.allows("publish", f"$JS.API.STREAM.DELETE.{stream.name}")
        assert not g.allows("publish", f"$JS.API.STREAM.PURGE.{stream.name}")


def test_subject_matching_follows_nats() -> None:
    assert subject_matches("tg.usage.*", "tg.usage.acme")
    assert not subject_matches("tg.usage.*", "tg.usage.acme.x")
    assert subject_matches("tg.>", "tg.usage.acme")
    assert not subject_matches("tg.>", "tg")
    assert not subject_matches("tg.usage.*", "tg.usage")


def test_the_documented_permission_table_is_the_generated_one() -> None:
    from tollgate.wire.permissions import describe

    text = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    documented = text.split("<!-- permissions:begin -->\n", 1)[1].split("<!-- permissions:end -->")[
        0
    ]
    assert documented == describe(T), (
        "docs/deploy.md is out of date: put the output of `tollgate bus permissions` "
        "between its permissions markers"
    )
