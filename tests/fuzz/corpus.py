"""Hostile requests, written out: bodies and headers that have broken HTTP servers before.

Each is sent alone, to an idle stack. Unless a case names the statuses it
allows (``expect``) or says the document refuses it (``strict``: a 4xx), it
must get any answer but a 5xx, OpenAI-shaped when it is an error, and none may
repeat the bytes of ``no_echo`` (the HTTP layer's errors must not mirror what
they could not parse).
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from tests.conftest import SIM_MODEL
from tests.fuzz.oracle import Case
from tests.fuzz.rawhttp import request as raw_request
from tests.fuzz.traffic import HOSTILE_IDS, encoded

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MB = 1024 * 1024
BASES: dict[str, dict[str, Any]] = {
    CHAT: {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    COMPLETIONS: {"model": SIM_MODEL, "prompt": "hi", "max_tokens": 2},
}
# The max_completion_tokens values of the reports that started this suite.
TOKEN_LIMITS: list[Any] = ["abc", [1], {}, "inf", -5, 16.0]
WILDCARD_NAMES = ["*", ">", ".", "a.*", "a.>", "tg.infer.>", "sim.*", " ", "%00", "\x00", "é"]
FOUR_XX = frozenset(range(400, 500))


@dataclass
class Hostile:
    name: str
    target: str
    method: str = "POST"
    path: str = ""
    headers: dict[str, Any] = field(default_factory=dict)
    content: bytes | None = None
    raw: bytes | None = None
    """Bytes sent as they are over a socket, instead of an httpx request."""
    expect: frozenset[int] | None = None
    strict: bool = False
    no_echo: bytes | None = None

    def case(self) -> Case:
        preview = self.raw if self.raw is not None else self.content or b""
        shown = preview[:160].decode("utf-8", "backslashreplace")
        return Case(
            self.target, self.name, self.name, shown, strict=self.strict, expect=self.expect
        )


def dump(value: Any) -> bytes:
    """JSON bytes of any value (integers past 64 bits included)."""
    return json.dumps(value, allow_nan=True).encode()


def nested(depth: int, kind: str = "list") -> bytes:
    """JSON text ``depth`` levels deep, written directly (no encoder has to cope with it)."""
    if kind == "list":
        return b"[" * depth + b"1" + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def with_field(base: dict[str, Any], name: str, text: bytes) -> bytes:
    """``base`` as JSON with one more field whose value is the raw JSON ``text``."""
    head = dump(base)[:-1]
    return head + b', "' + name.encode() + b'": ' + text + b"}"


def json_post(name: str, path: str, body: bytes, auth: dict[str, str], **kw: Any) -> Hostile:
    headers = {**auth, "Content-Type": "application/json", **kw.pop("headers", {})}
    return Hostile(name, f"POST {path}", "POST", path, headers, body, **kw)


def router_cases(api_key: str, marker: bytes) -> list[Hostile]:
    auth = {"Authorization": f"Bearer {api_key}"}
    key = api_key.encode()
    cases: list[Hostile] = []
    for path, base in BASES.items():
        short = "chat" if path == CHAT else "completions"
        # depth: inside an unknown field, which the edge passes on untouched
        for depth in (300, 1000):
            for kind in ("list", "object"):
                body = with_field(base, "x_extra", nested(depth, kind))
                cases.append(
                    json_post(f"{short}: extra field, {kind}s {depth} deep", path, body, auth)
                )
        cases.append(
            json_post(
                f"{short}: extra field nested 5000 deep",
                path,
                with_field(base, "x_extra", nested(5000)),
                auth,
            )
        )
        # sizes: under the 4 MiB body limit, over NATS's 1 MiB message
        for size in (1.5, 3.5):
            big = "x" * int(size * MB)
            if path == CHAT:
                prompt = {**base, "messages": [{"role": "user", "content": big}]}
            else:
                prompt = {**base, "prompt": big}
            cases.append(json_post(f"{short}: {size} MB prompt", path, dump(prompt), auth))
            cases.append(
                json_post(
                    f"{short}: {size} MB unknown field",
                    path,
                    dump({**base, "x_pad": big}),
                    auth,
                )
            )
        cases.append(
            json_post(
                f"{short}: 5 MB body (over the limit)",
                path,
                dump({**base, "x_pad": "x" * 5 * MB}),
                auth,
                expect=frozenset({413}),
            )
        )
        # not JSON any parser must take
        for token in (b"NaN", b"Infinity", b"-Infinity"):
            body = with_field(
                {k: v for k, v in base.items() if k != "max_tokens"}, "max_tokens", token
            )
            cases.append(
                json_post(
                    f"{short}: max_tokens {token.decode()}",
                    path,
                    body,
                    auth,
                    expect=frozenset({400}),
                )
            )
        text_field = b'"messages": [{"role": "user", "content": ' if path == CHAT else b'"prompt": '
        tail = b"}]}" if path == CHAT else b"}"
        for label, text in (
            ("lone high surrogate escape", b'"\\ud800"'),
            ("lone low surrogate escape", b'"a\\udfffb"'),
            ("surrogate bytes (CESU-8)", b'"\xed\xa0\x80"'),
            ("bytes that are not UTF-8", b'"\xff\xfe\xfd"'),
            ("NUL escape", b'"a\\u0000b"'),
        ):
            body = (
                b'{"model": "'
                + SIM_MODEL.encode()
                + b'", "max_tokens": 2, '
                + text_field
                + text
                + tail
            )
            cases.append(json_post(f"{short}: {label}", path, body, auth))
        # duplicate keys: JSON leaves it open; no answer may be a 5xx
        dup = dump(base)[:-1] + b', "model": "no/such-model"}'
        cases.append(json_post(f"{short}: duplicate model key", path, dup, auth))
        dup = b'{"model": "no/such", ' + dump(base)[1:]
        cases.append(json_post(f"{short}: duplicate model key, good one last", path, dup, auth))
        cases.append(json_post(f"{short}: UTF-8 BOM", path, b"\xef\xbb\xbf" + dump(base), auth))
        for label, body in (
            ("empty body", b""),
            ("JSON null", b"null"),
            ("JSON string", b'"x"'),
            ("JSON number", b"1e999"),
            ("truncated", dump(base)[:-3]),
        ):
            cases.append(json_post(f"{short}: {label}", path, body, auth, expect=frozenset({400})))
        # content types and encodings
        plain = dump(base)
        for media in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonx",
            "",
        ):
            headers = {**auth, "Content-Type": media} if media else dict(auth)
            cases.append(
                Hostile(
                    f"{short}: Content-Type {media or 'missing'!r}",
                    f"POST {path}",
                    "POST",
                    path,
                    headers,
                    plain,
                    expect=frozenset({415}),
                )
            )
        cases.append(
            json_post(
                f"{short}: Content-Type with a charset",
                path,
                plain,
                auth,
                headers={"Content-Type": "application/json; charset=utf-8"},
                expect=frozenset({200}),
            )
        )
        for encoding, body in (
            ("gzip", plain),
            ("deflate", plain),
            ("br", plain),
            ("zstd", plain),
            ("x-unknown", plain),
            ("gzip, gzip", gzip.compress(plain)),
        ):
            cases.append(
                json_post(
                    f"{short}: Content-Encoding {encoding} on a plain body",
                    path,
                    body,
                    auth,
                    headers={"Content-Encoding": encoding},
                )
            )
        cases.append(
            json_post(
                f"{short}: gzip body",
                path,
                gzip.compress(plain),
                auth,
                headers={"Content-Encoding": "gzip"},
            )
        )
        bomb = gzip.compress(with_field(base, "x_pad", b'"' + b"0" * (32 * MB) + b'"'), 9)
        cases.append(
            json_post(
                f"{short}: gzip bomb (32 MB inflated)",
                path,
                bomb,
                auth,
                headers={"Content-Encoding": "gzip"},
            )
        )
        cases.append(
            json_post(
                f"{short}: deflate bomb (32 MB inflated)",
                path,
                zlib.compress(b" " * 32 * MB, 9),
                auth,
                headers={"Content-Encoding": "deflate"},
            )
        )
        # token limits
        fields = ["max_completion_tokens", "max_tokens"]
        for name in fields:
            for value in TOKEN_LIMITS:
                body = {**{k: v for k, v in base.items() if k != "max_tokens"}, name: value}
                # the document types both as integers >= 1 on chat, max_tokens on completions
                documented = path == CHAT or name == "max_tokens"
                invalid = not (
                    isinstance(value, int | float) and value >= 1 and value == int(value)
                )
                cases.append(
                    json_post(
                        f"{short}: {name} {value!r}",
                        path,
                        dump(body),
                        auth,
                        strict=documented and invalid,
                    )
                )
        for value in (0, -1, 129, 10**6, "x2", 2.5, 2**64, [2]):
            cases.append(
                json_post(
                    f"{short}: n {value!r}",
                    path,
                    dump({**base, "n": value}),
                    auth,
                    strict=True,
                )
            )
        for name in [*WILDCARD_NAMES, "sim/echo-1\x00", "sim/echo-1 ", "SIM/ECHO-1", "x" * 10_000]:
            body = dump({**base, "model": name})
            cases.append(
                json_post(
                    f"{short}: model {name[:20]!r}", path, body, auth, expect=frozenset({400, 404})
                )
            )
        cases.append(
            json_post(
                f"{short}: stream, usage, n=3",
                path,
                dump({**base, "stream": True, "n": 3, "stream_options": {"include_usage": True}}),
                auth,
                expect=frozenset({200}),
            )
        )
    for prompt in ([-1], [2**63], [[1], []], [1.5], [[1]] * 65, ["a"] * 65):
        body = dump({**BASES[COMPLETIONS], "prompt": prompt})
        cases.append(json_post(f"completions: prompt {str(prompt)[:30]}", COMPLETIONS, body, auth))
    many = {**BASES[CHAT], "messages": [{"role": "user", "content": "hi"}] * 10_000}
    cases.append(json_post("chat: 10000 messages", CHAT, dump(many), auth))
    for name in WILDCARD_NAMES:
        cases.append(
            Hostile(
                f"model card {name!r}, encoded",
                "GET /v1/models/{model}",
                "GET",
                f"/v1/models/{encoded(name)}",
                auth,
                expect=frozenset({400, 404}),
            )
        )
    cases += _raw_router_cases(key, marker)
    return cases


def _raw(name: str, target: str, data: bytes, **kw: Any) -> Hostile:
    return Hostile(name, target, raw=data, **kw)


def _raw_router_cases(key: bytes, marker: bytes) -> list[Hostile]:
    bearer = (b"Authorization", b"Bearer " + key)
    json_ct = (b"Content-Type", b"application/json")
    body = dump(BASES[CHAT])
    post = b"POST"
    chat = CHAT.encode()
    t = f"POST {CHAT}"
    cases = [
        _raw(
            "header line over 8190 bytes",
            t,
            raw_request(
                post, chat, [bearer, json_ct, (b"X-Fuzz", marker * (9000 // len(marker)))], body
            ),
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "Authorization over 8190 bytes, holding the key",
            t,
            raw_request(
                post,
                chat,
                [(b"Authorization", b"Bearer " + key + marker * (9000 // len(marker))), json_ct],
                body,
            ),
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "request line over 8190 bytes",
            "GET /v1/models",
            raw_request(b"GET", b"/v1/models?" + marker * (9000 // len(marker)), [bearer]),
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "300 header fields",
            t,
            raw_request(
                post, chat, [bearer, json_ct] + [(b"X-F%d" % i, b"v") for i in range(300)], body
            ),
        ),
        _raw(
            "non-UTF-8 bytes in Authorization",
            t,
            raw_request(
                post, chat, [(b"Authorization", b"Bearer \xff\xfe\xfd" + marker), json_ct], body
            ),
            expect=frozenset({401}),
            no_echo=marker,
        ),
        _raw(
            "the key then non-UTF-8 bytes in Authorization",
            t,
            raw_request(
                post, chat, [(b"Authorization", b"Bearer " + key + b"\xff"), json_ct], body
            ),
            expect=frozenset({401}),
        ),
        _raw(
            "non-UTF-8 bytes in api-key",
            t,
            raw_request(post, chat, [(b"api-key", b"\xc3\x28" + marker), json_ct], body),
            expect=frozenset({401}),
            no_echo=marker,
        ),
        _raw(
            "Latin-1 scheme in Authorization",
            t,
            raw_request(post, chat, [(b"Authorization", b"B\xe9arer " + key), json_ct], body),
            expect=frozenset({401}),
        ),
        _raw(
            "NUL in Authorization",
            t,
            raw_request(post, chat, [(b"Authorization", b"Bearer a\x00" + marker), json_ct], body),
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "duplicate Content-Type, JSON first",
            t,
            raw_request(post, chat, [bearer, json_ct, (b"Content-Type", b"text/plain")], body),
        ),
        _raw(
            "duplicate Content-Type, JSON last",
            t,
            raw_request(post, chat, [bearer, (b"Content-Type", b"text/plain"), json_ct], body),
        ),
        _raw(
            "two different Content-Length",
            t,
            raw_request(
                post,
                chat,
                [
                    bearer,
                    json_ct,
                    (b"Content-Length", b"5"),
                    (b"Content-Length", str(len(body)).encode()),
                ],
                body,
                length=False,
            ),
            strict=True,
        ),
        _raw(
            "Content-Length and Transfer-Encoding",
            t,
            raw_request(
                post,
                chat,
                [
                    bearer,
                    json_ct,
                    (b"Content-Length", str(len(body)).encode()),
                    (b"Transfer-Encoding", b"chunked"),
                ],
                b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n",
                length=False,
            ),
            strict=True,
        ),
        _raw(
            "chunked with a bad chunk size",
            t,
            raw_request(
                post,
                chat,
                [bearer, json_ct, (b"Transfer-Encoding", b"chunked")],
                b"zz" + marker + b"\r\n" + body + b"\r\n0\r\n\r\n",
                length=False,
            ),
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "Transfer-Encoding gzip, chunked on a plain body",
            t,
            raw_request(
                post,
                chat,
                [bearer, json_ct, (b"Transfer-Encoding", b"gzip, chunked")],
                b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n",
                length=False,
            ),
        ),
        _raw(
            "Transfer-Encoding identity",
            t,
            raw_request(post, chat, [bearer, json_ct, (b"Transfer-Encoding", b"identity")], body),
        ),
        _raw(
            "negative Content-Length",
            t,
            raw_request(
                post, chat, [bearer, json_ct, (b"Content-Length", b"-1")], body, length=False
            ),
            strict=True,
        ),
        _raw(
            "Content-Length past 2**64",
            t,
            raw_request(
                post,
                chat,
                [bearer, json_ct, (b"Content-Length", b"99999999999999999999999")],
                body,
                length=False,
            ),
            strict=True,
        ),
        _raw(
            "control byte in the method",
            "?",
            raw_request(b"G\x01T" + marker, b"/v1/models", [bearer]),
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "unknown method",
            "FOO /v1/models",
            raw_request(b"FOO", b"/v1/models", [bearer]),
            strict=True,
        ),
        _raw(
            "lowercase method",
            "get /v1/models",
            raw_request(b"get", b"/v1/models", [bearer]),
            strict=True,
        ),
        _raw(
            "HTTP/9.9",
            "GET /v1/models",
            raw_request(b"GET", b"/v1/models", [bearer], version=b"HTTP/9.9"),
        ),
        _raw(
            "HTTP/1.x",
            "GET /v1/models",
            raw_request(b"GET", b"/v1/models", [bearer], version=b"HTTP/1." + marker),
            strict=True,
            no_echo=marker,
        ),
        _raw("no version", "GET /v1/models", b"GET /v1/models\r\nHost: x\r\n\r\n", strict=True),
        _raw(
            "a request line of garbage",
            "?",
            marker + b"\x00\xff\r\n\r\n",
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "absolute-form target",
            "GET /v1/models",
            raw_request(b"GET", b"http://evil.example/v1/models", [bearer]),
        ),
        _raw("OPTIONS *", "OPTIONS *", raw_request(b"OPTIONS", b"*", [bearer])),
        _raw(
            "header without a colon",
            t,
            raw_request(post, chat, [bearer, json_ct, (b"X-No-Colon" + marker, b"")], body).replace(
                b"X-No-Colon" + marker + b": ", b"X-No-Colon" + marker
            ),
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "header folded over two lines",
            t,
            raw_request(post, chat, [bearer, json_ct, (b"X-Fold", b"a\r\n  " + marker)], body),
        ),
        _raw(
            "Expect: 100-continue",
            t,
            raw_request(post, chat, [bearer, json_ct, (b"Expect", b"100-continue")], body),
        ),
    ]
    for name in (b"*", b">", b"a.*", b"%00", b"%2A", b"\xc3\xa9", b"..%2F..%2Fmetrics"):
        cases.append(
            _raw(
                f"model card {name!r}, raw target",
                "GET /v1/models/{model}",
                raw_request(b"GET", b"/v1/models/" + name, [bearer]),
                strict=True,
            )
        )
    return cases


def admin_cases(admin_token: str, marker: bytes) -> list[Hostile]:
    auth = {"Authorization": f"Bearer {admin_token}"}
    token = admin_token.encode()
    cases: list[Hostile] = []
    for key_id in HOSTILE_IDS:
        path = f"/admin/keys/{encoded(key_id)}"
        shown = repr(key_id[:20])
        for method in ("GET", "DELETE"):
            cases.append(
                Hostile(
                    f"key id {shown}",
                    f"{method} /admin/keys/{{key_id}}",
                    method,
                    path,
                    auth,
                    expect=frozenset({400, 404}),
                )
            )
        cases.append(
            Hostile(
                f"key id {shown}",
                "PATCH /admin/keys/{key_id}",
                "PATCH",
                path,
                {**auth, "Content-Type": "application/json"},
                b'{"name": "x"}',
                expect=frozenset({400, 404}),
            )
        )
        cases.append(
            Hostile(
                f"kid {shown}",
                "POST /admin/signing-keys/{kid}/retire",
                "POST",
                f"/admin/signing-keys/{encoded(key_id)}/retire",
                auth,
                expect=frozenset({400, 404}),
            )
        )
    bearer = (b"Authorization", b"Bearer " + token)
    for raw_id in (b"*", b">", b".", b"a.*", b"%00", b"%2500", b"\xc3\xa9", b"a%20b", b"%2E"):
        for method in (b"GET", b"DELETE"):
            cases.append(
                _raw(
                    f"key id {raw_id!r}, raw target",
                    f"{method.decode()} /admin/keys/{{key_id}}",
                    raw_request(method, b"/admin/keys/" + raw_id, [bearer]),
                    expect=frozenset({400, 404}),
                )
            )
    create = "POST /admin/keys"
    good = {"tenant": "fuzz-hostile", "ttl_s": 600}
    json_ct = {**auth, "Content-Type": "application/json"}

    def post(name: str, body: bytes, **kw: Any) -> Hostile:
        return Hostile(
            name, create, "POST", "/admin/keys", {**json_ct, **kw.pop("headers", {})}, body, **kw
        )

    for depth in (300, 1000):
        cases.append(
            post(
                f"extra field nested {depth} deep",
                with_field(good, "x", nested(depth)),
                expect=frozenset({400}),
            )
        )
        cases.append(
            post(
                f"name nested {depth} deep",
                with_field({"tenant": "t"}, "name", nested(depth, "object")),
                expect=frozenset({400}),
            )
        )
    for size in (1.5, 3.5):
        cases.append(
            post(
                f"{size} MB tenant",
                dump({"tenant": "t" * int(size * MB)}),
                expect=frozenset({400, 413}),
            )
        )
        cases.append(post(f"{size} MB name", dump({**good, "name": "n" * int(size * MB)})))
    cases.append(post("rpm NaN", with_field(good, "rpm", b"NaN"), expect=frozenset({400})))
    cases.append(post("tenant lone surrogate", b'{"tenant": "\\ud800"}', expect=frozenset({400})))
    cases.append(post("tenant not UTF-8", b'{"tenant": "\xff"}', expect=frozenset({400})))
    cases.append(post("duplicate tenant key", b'{"tenant": 1, "tenant": "fuzz-dup", "ttl_s": 600}'))
    cases.append(post("JSON array", b"[]", expect=frozenset({400})))
    cases.append(post("gzip on a plain body", dump(good), headers={"Content-Encoding": "gzip"}))
    for field_name in ("rpm", "tpm", "budget_tokens"):
        for value in TOKEN_LIMITS:
            invalid = not (isinstance(value, int | float) and value >= 1 and value == int(value))
            cases.append(
                post(
                    f"{field_name} {value!r}",
                    dump({**good, field_name: value}),
                    expect=frozenset({400}) if invalid else frozenset({201}),
                )
            )
    cases.append(post("models []", dump({**good, "models": []}), expect=frozenset({400})))
    cases.append(post("ttl_s -5", dump({**good, "ttl_s": -5}), expect=frozenset({400})))
    cases.append(post("ttl_s 1e308", dump({**good, "ttl_s": 1e308})))
    cases.append(
        post(
            "budget_period 'week'",
            dump({**good, "budget_period": "week"}),
            expect=frozenset({400}),
        )
    )
    raw_create = create
    cases += [
        _raw(
            "non-UTF-8 bytes in Authorization",
            raw_create,
            raw_request(
                b"POST",
                b"/admin/keys",
                [
                    (b"Authorization", b"Bearer \xff\xfe" + marker),
                    (b"Content-Type", b"application/json"),
                ],
                dump(good),
            ),
            expect=frozenset({401}),
            no_echo=marker,
        ),
        _raw(
            "the admin token then non-UTF-8 bytes",
            raw_create,
            raw_request(
                b"POST",
                b"/admin/keys",
                [
                    (b"Authorization", b"Bearer " + token + b"\xe9"),
                    (b"Content-Type", b"application/json"),
                ],
                dump(good),
            ),
            expect=frozenset({401}),
        ),
        _raw(
            "Authorization over 8190 bytes, holding the admin token",
            raw_create,
            raw_request(
                b"POST",
                b"/admin/keys",
                [(b"Authorization", b"Bearer " + token + marker * (9000 // len(marker)))],
                dump(good),
            ),
            strict=True,
            no_echo=marker,
        ),
        _raw(
            "Content-Length and Transfer-Encoding",
            raw_create,
            raw_request(
                b"POST",
                b"/admin/keys",
                [bearer, (b"Content-Length", b"2"), (b"Transfer-Encoding", b"chunked")],
                b"2\r\n{}\r\n0\r\n\r\n",
                length=False,
            ),
            strict=True,
        ),
        _raw(
            "control byte in the method",
            "?",
            raw_request(b"P\x01ST" + marker, b"/admin/keys", [bearer]),
            strict=True,
            no_echo=marker,
        ),
    ]
    return cases
