"""X-Tollgate-Replay switches capture off only for a replay identity (on a running stack).

A capturing key's calls are captured whether or not they carry the header; a
replay key's calls marked with it are not. ``tollgate replay`` calls as such a
key: the one it is given, or one it issues for the run and revokes after.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import jwt
import pytest

from tests.conftest import SIM_MODEL, Stack
from tests.lib.streams import read_subject
from tests.router.test_auth import make_key, wait_status
from tollgate.app.replay import REPLAY_HEADER, ReplayError, replay_identity
from tollgate.keys.records import KeyState
from tollgate.keys.store import KeyStore
from tollgate.keys.tokens import auth_dir, strip_prefix
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

pytestmark = pytest.mark.usefixtures("sim_workers")

CHAT = "/v1/chat/completions"
BODY = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def call(url: str, token: str, replay: bool) -> str:
    headers = {"Authorization": f"Bearer {token}"}
    if replay:
        headers[REPLAY_HEADER] = "1"
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"{url}{CHAT}", json=BODY, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"]


async def captured(stack: Stack, tenant: str, want: set[str], timeout: float = 15) -> set[str]:
    """The captured request ids of ``tenant``, once all of ``want`` are there (or time is up)."""
    subject = Subjects().capture(tenant)
    nc = await stack.nats.connect(name="test-replay-header")
    try:
        js = nc.jetstream()
        stream = Topology(Subjects()).capture.name
        deadline = time.monotonic() + timeout
        while True:
            messages = await read_subject(js, subject, stream=stream)
            ids = {(m.headers or {}).get("Nats-Msg-Id", "") for m in messages}
            if want <= ids or time.monotonic() > deadline:
                return ids
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def test_only_a_replay_key_switches_capture_off(stack: Stack, router_url: str) -> None:
    tenant = f"hdr-{uuid.uuid4().hex[:8]}"
    plain, _ = await make_key(stack, tenant=tenant, capture=True)
    replayer, _ = await make_key(stack, tenant=tenant, capture=True, replay=True)
    for key in (plain, replayer):
        await wait_status(router_url, key, 200)

    plain_marked = await call(router_url, plain, replay=True)
    plain_unmarked = await call(router_url, plain, replay=False)
    replay_unmarked = await call(router_url, replayer, replay=False)
    replay_marked = await call(router_url, replayer, replay=True)

    want = {plain_marked, plain_unmarked, replay_unmarked}
    ids = await captured(stack, tenant, want)
    assert plain_marked in ids, "a normal key sending the header is still captured"
    assert want <= ids
    await asyncio.sleep(1.0)  # the replay call's capture would have come with the others
    assert replay_marked not in await captured(stack, tenant, want)


async def test_tollgate_replay_calls_as_a_replay_identity(stack: Stack, router_url: str) -> None:
    tenant = f"rpl-{uuid.uuid4().hex[:8]}"
    plain, plain_id = await make_key(stack, tenant=tenant, capture=True)
    replayer, _ = await make_key(stack, tenant=tenant, replay=True)
    await wait_status(router_url, replayer, 200)
    signing_keys = auth_dir(stack.var_dir) / "signing-keys.json"
    nc = await stack.nats.connect(name="test-replay-identity")
    try:
        store = await KeyStore(nc.jetstream(), Topology(Subjects()), actor="test").open()
        # a replay key is used as it is
        async with replay_identity(
            store, replayer, SIM_MODEL, base_url=router_url, signing_keys=signing_keys
        ) as token:
            assert token == replayer
        # any other key: a replay key of the same tenant, for the run only
        async with replay_identity(
            store, plain, SIM_MODEL, base_url=router_url, signing_keys=signing_keys
        ) as token:
            assert token != plain
            issued_id = await call(router_url, token, replay=True)
            # the issued key's record, by the id in its token (listing every key of a
            # long session's bucket is slow, and a listing may time out short)
            claims = jwt.decode(strip_prefix(token), options={"verify_signature": False})
            issued = await store.get(str(claims["jti"]))
            assert issued is not None and issued.key_id != plain_id
            assert issued.tenant == tenant and issued.replay and issued.name == "tollgate replay"
            assert issued.models == [SIM_MODEL] and issued.expires_at is not None
        after = await store.get(issued.key_id)
        assert after is not None and after.state is KeyState.REVOKED
        assert issued_id not in await captured(stack, tenant, set(), timeout=0)
        # a key that is not whitelisted, or no signing key to issue one
        with pytest.raises(ReplayError, match="whitelisted"):
            async with replay_identity(store, "tg-not.a.key", SIM_MODEL, base_url=router_url):
                pass
        with pytest.raises(ReplayError, match="--replay"):
            async with replay_identity(
                store,
                plain,
                SIM_MODEL,
                base_url=router_url,
                signing_keys=stack.var_dir / "no-such-signing-keys.json",
            ):
                pass
    finally:
        await nc.close()
