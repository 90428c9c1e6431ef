"""What every answer must satisfy, and one report of every case that did not.

The allowed 5xx: none, but a ``503`` that says it is about capacity
(``no_capacity`` or ``whitelist_stale``, with ``Retry-After``) for a case sent
while the suite itself may have filled the model's slots (the generated
requests, sent concurrently). A corpus case is sent alone to an idle stack, so
a 503 there has no capacity reason and counts.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from jsonschema import Draft202012Validator
from prometheus_client.parser import text_string_to_metric_families

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
CAPACITY_CODES = frozenset({"no_capacity", "whitelist_stale"})
GAUGES = ("tollgate_router_requests_in_flight", "tollgate_router_requests_queued")

# What a body shows when something internal leaked into it.
LEAK_MARKERS = (
    b"Traceback (most recent call last)",
    b'File "/',
    b'.py", line ',
    b"site-packages",
    b"<class '",
    b" object at 0x",
    b"During handling of the above exception",
)


@dataclass
class Case:
    """One request the suite sent, as a failure message names it."""

    target: str
    """``POST /v1/completions`` and the like."""
    label: str
    """What is special about it (a mutation, a corpus name)."""
    group: str = ""
    """Failures of one target and problem are grouped; a corpus case names its own group."""
    body: str = ""
    """A short preview of what was sent."""
    strict: bool = False
    """The document says this must be refused with a 4xx."""
    valid: bool = False
    """The document says this is a valid request (a 2xx, or the engine's 400)."""
    capacity_ok: bool = False
    """A 503 about capacity is an honest answer (see the module's doc)."""
    expect: frozenset[int] | None = None
    """When set, the only statuses allowed."""
    engine_refusal: str | None = None
    """A valid request the engine refuses when it takes it, as vLLM does: its message.
    Whole, the answer is a 400 with it; streamed, the refusal may come after the
    200 as an error event (vLLM's engine checks the prompt once the stream has
    begun). Either way it is not a success."""


@dataclass
class Answer:
    status: int | None
    headers: list[tuple[str, str]]
    body: bytes
    error: str | None = None
    """Why there is no status (no answer, a reset, a timeout)."""

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    @classmethod
    def of(cls, response: httpx.Response) -> Answer:
        headers = [(k, v) for k, v in response.headers.multi_items()]
        return cls(response.status_code, headers, response.content)


@dataclass
class Findings:
    """Every failed check of a run, grouped, for one assertion at the end."""

    seed: int
    rerun: str
    secrets: Mapping[str, str] = field(repr=False)
    """name -> secret text that must never appear in an answer or a log (nor in a report)."""
    sent: int = 0
    groups: dict[str, list[str]] = field(default_factory=dict)

    def fail(self, case: Case, problem: str, detail: str = "") -> None:
        key = (
            f"{case.target} [{case.group}]: {problem}"
            if case.group
            else f"{case.target}: {problem}"
        )
        example = f"{case.label} | sent {case.body}" + (f" | got {detail}" if detail else "")
        self.groups.setdefault(key, []).append(self.redact(example))

    def redact(self, text: str) -> str:
        """``text`` with every secret replaced by its name and control bytes escaped: a
        report is printed."""
        for name, secret in sorted(self.secrets.items(), key=lambda kv: -len(kv[1])):
            text = text.replace(secret, f"<{name}>")
        return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)

    def note(self, key: str, example: str) -> None:
        """A failure that is not about one request (a gauge, a log, a counter)."""
        self.groups.setdefault(key, []).append(self.redact(example))

    def check(
        self,
        case: Case,
        answer: Answer,
        response_schema: Draft202012Validator | None = None,
        event_schema: Draft202012Validator | None = None,
    ) -> None:
        self.sent += 1
        if answer.status is None:
            self.fail(case, f"no HTTP answer ({answer.error})")
            return
        status = answer.status
        text = answer.body
        everything = text + b"".join(f"{k}: {v}\n".encode() for k, v in answer.headers)
        for name, secret in self.secrets.items():
            if secret.encode() in everything:
                self.fail(case, f"the {name} is in the answer", _short(answer))
        for marker in LEAK_MARKERS:
            if marker in text:
                self.fail(
                    case, f"internal detail in the body ({marker.decode()!r})", _short(answer)
                )
                break
        if status >= 400:
            problem = error_shape_problem(answer)
            if problem:
                self.fail(
                    case, f"{status} error body is not OpenAI-shaped: {problem}", _short(answer)
                )
        if status >= 500 and not (case.capacity_ok and _capacity(answer)):
            self.fail(case, f"{status} {_message(answer)} (no 5xx is allowed)", _short(answer))
        elif case.expect is not None and status not in case.expect:
            self.fail(case, f"{status}, not {sorted(case.expect)}", _short(answer))
        elif case.strict and not 400 <= status < 500:
            self.fail(
                case, f"{status} for a request the document says is refused (4xx)", _short(answer)
            )
        elif (
            case.valid
            and status not in (200, 201, 400)
            and not (status == 503 and case.capacity_ok)
        ):
            self.fail(case, f"{status} for a valid request", _short(answer))
        if case.engine_refusal is not None and status in (200, 201, 400):
            self._check_engine_refusal(case, answer)
        if status in (200, 201):
            self._check_success(case, answer, response_schema, event_schema)

    def _check_engine_refusal(self, case: Case, answer: Answer) -> None:
        """The engine's refusal came, as a 400 or as a stream's error event."""
        assert case.engine_refusal is not None
        media = (answer.header("content-type") or "").split(";")[0].strip()
        if answer.status == 200 and media == "text/event-stream":
            found = _stream_error(answer)
            if found is None:
                self.fail(case, "a stream the engine refuses has no error event", _short(answer))
            elif case.engine_refusal not in found:
                self.fail(case, "a stream's error event is not the engine's refusal", found[:300])
        elif answer.status != 400:  # a 400: this refusal, or an earlier one of another field
            self.fail(case, f"{answer.status} for a request the engine refuses", _short(answer))

    def _check_success(
        self,
        case: Case,
        answer: Answer,
        response_schema: Draft202012Validator | None,
        event_schema: Draft202012Validator | None,
    ) -> None:
        media = (answer.header("content-type") or "").split(";")[0].strip()
        if media == "text/event-stream":
            self._check_stream(case, answer, event_schema)
            return
        if media != "application/json" or response_schema is None:
            return
        try:
            value = orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            self.fail(case, f"{answer.status} body is not JSON", _short(answer))
            return
        error = next(iter(response_schema.iter_errors(value)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            self.fail(
                case,
                f"{answer.status} body does not match the document at /{where}",
                error.message[:200],
            )

    def _check_stream(
        self, case: Case, answer: Answer, event_schema: Draft202012Validator | None
    ) -> None:
        events = [
            line[len(b"data: ") :]
            for line in answer.body.split(b"\n")
            if line.startswith(b"data: ")
        ]
        if not events or events[-1] != b"[DONE]":
            self.fail(case, "the stream does not end with data: [DONE]", _short(answer))
            return
        for data in events[:-1]:
            try:
                event = orjson.loads(data)
            except orjson.JSONDecodeError:
                self.fail(case, "a stream event is not JSON", data[:200].decode(errors="replace"))
                return
            if isinstance(event, dict) and "error" in event:
                if case.valid and case.engine_refusal is None:
                    self.fail(case, "a valid stream ended with an error event", data[:300].decode())
                return
            if event_schema is not None:
                error = next(iter(event_schema.iter_errors(event)), None)
                if error is not None:
                    where = "/".join(str(p) for p in error.absolute_path)
                    self.fail(
                        case,
                        f"a stream chunk does not match the document at /{where}",
                        error.message[:200],
                    )
                    return

    def report(self, limit: int = 100) -> str:
        lines = [
            f"{len(self.groups)} kinds of failure in {self.sent} requests "
            f"(seed {self.seed}; rerun: {self.rerun})"
        ]
        for key, examples in list(self.groups.items())[:limit]:
            lines.append(f"- {key} [{len(examples)}x]")
            for example in examples[:3]:
                lines.append(f"    e.g. {example[:500]}")
        if len(self.groups) > limit:
            lines.append(f"... and {len(self.groups) - limit} more kinds")
        return "\n".join(lines)

    def assert_clean(self) -> None:
        assert not self.groups, self.report()


def error_shape_problem(answer: Answer) -> str | None:
    """Why an error answer is not ``{"error": {"message", "type", "param", "code"}}``."""
    media = (answer.header("content-type") or "").split(";")[0].strip()
    if media != "application/json":
        return f"Content-Type {media or 'missing'!r}"
    try:
        body = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        return "not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "no 'error' object"
    if set(error) != {"message", "type", "param", "code"}:
        return f"keys {sorted(error)}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "empty message"
    if not isinstance(error["type"], str):
        return "type is not a string"
    if error["param"] is not None and not isinstance(error["param"], str):
        return "param is not a string or null"
    code = error["code"]
    if code is not None and (isinstance(code, bool) or not isinstance(code, str | int)):
        return "code is not a string, an integer or null"
    return None


def _stream_error(answer: Answer) -> str | None:
    """The message of a stream's first error event (None: no error event)."""
    for line in answer.body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            event = orjson.loads(line[len(b"data: ") :])
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            return str(event["error"].get("message"))
    return None


def _capacity(answer: Answer) -> bool:
    if answer.status != 503 or answer.header("retry-after") is None:
        return False
    try:
        return orjson.loads(answer.body)["error"]["code"] in CAPACITY_CODES
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


def _message(answer: Answer) -> str:
    """The error message of an answer, short, to tell one cause of a status from another."""
    try:
        message = str(orjson.loads(answer.body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ""
    return repr(message[:80])


def _short(answer: Answer) -> str:
    media = answer.header("content-type") or "no content-type"
    body = answer.body[:300].decode("utf-8", "backslashreplace")
    return f"{answer.status} {media} {body!r}"


# -- the router's gauges and the stack's logs ---------------------------------


async def gauges(router_url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{router_url}/metrics")).text
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in GAUGES:
            found[family.name] = sum(s.value for s in family.samples)
    return found


async def settled_gauges(router_url: str, timeout: float = 30) -> dict[str, float]:
    """Poll until nothing is in flight or queued; the last reading either way."""
    deadline = time.monotonic() + timeout
    while True:
        values = await gauges(router_url)
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.1)


def log_files(*folders: Path) -> list[Path]:
    """The log files under ``folders``; folders that vanish while read are passed over.

    (The services still run: ClickHouse removes its temporary parts meanwhile.)
    """
    found: set[Path] = set()
    for folder in folders:
        for root, _dirs, files in os.walk(folder):  # os.walk skips what it cannot read
            found.update(Path(root) / name for name in files if name.endswith(".log"))
    return sorted(p for p in found if p.is_file())


def secrets_in_logs(files: Iterable[Path], secrets: Mapping[str, str]) -> list[str]:
    """``"<secret name> in <file>"`` for every secret some log file holds."""
    found = []
    for path in files:
        data = path.read_bytes()
        for name, secret in secrets.items():
            if secret.encode() in data:
                found.append(f"the {name} is in {path.name}")
    return found


def error_lines(log: Path, since: int) -> list[str]:
    """Error-level lines a service logged after byte offset ``since``, alike ones counted once.

    Each is ``logger: message: the exception's last line``, which names the cause.
    """
    with log.open("rb") as f:
        f.seek(since)
        data = f.read()
    counts: dict[str, int] = {}
    for raw in data.splitlines():
        try:
            entry = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
            exc = str(entry.get("exc") or "").strip().splitlines()
            line = f"{entry.get('logger')}: {entry.get('msg')}" + (f": {exc[-1]}" if exc else "")
            counts[line[:240]] = counts.get(line[:240], 0) + 1
    return [f"{n}x {line}" for line, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def secret_parts(token: str) -> list[str]:
    """A key as it could show up: whole, without its ``tg-`` prefix, and its signature."""
    bare = token.removeprefix("tg-")
    parts = [token, bare]
    signature = bare.rsplit(".", 1)[-1]
    if len(signature) >= 20:
        parts.append(signature)
    return parts


def short(value: Any, limit: int = 160) -> str:
    text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
    return text if len(text) <= limit else f"{text[: limit - 30]}...({len(text)} chars)"
