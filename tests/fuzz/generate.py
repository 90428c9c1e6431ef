"""Requests generated from the OpenAPI documents (docs/openapi/): valid ones and mutated ones.

A small seeded generator rather than a property-testing library: every case
is a plain function of ``random.Random(seed)``, so a failing run is replayed
by its seed alone, and the suite decides per case what the gateway must
answer (see :attr:`Generated.refusal`).
"""

from __future__ import annotations

import copy
import json
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

DOCS = Path(__file__).parents[2] / "docs" / "openapi"

Path_ = tuple[str | int, ...]

# Values a mutation puts in place of a field. Each pool aims at one way a
# parser or a validator goes wrong: the wrong JSON type, integers at the edges
# of the machine's types, floats where integers go, strings that are subject
# tokens or wildcards on NATS, text that is not what it seems, and sizes.
WRONG_TYPES: list[Any] = ["abc", "", [1], [], {}, {"a": 1}, True, False, None, 0, 1.5, -1]
NUMBERS: list[Any] = [
    -5,
    -1,
    0,
    16.0,
    0.5,
    -0.0,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    10**30,
    1e308,
    -1e308,
    1e-300,
    float("nan"),
    float("inf"),
    float("-inf"),
    "inf",
    "NaN",
    "16",
    "0x10",
]
STRINGS: list[Any] = [
    "",
    " ",
    "*",
    ">",
    ".",
    "a.*",
    "a.>",
    "tg.infer.>",
    "sim.*",
    "\x00",
    "a\x00b",
    "é",
    "\u202etxt.exe",
    "a\u0301" * 50,
    "🙂" * 200,
    "\ud800",
    "\udfff\ud800",
    "\r\nX-Injected: 1",
    "../../etc/passwd",
    "%s%n%x",
    "${jndi:ldap://127.0.0.1/a}",
    "x" * 70_000,
    "é" * 40_000,
]
NEST_DEPTHS = [8, 64, 254, 256, 300, 1000]
SURROGATE = re.compile("[\ud800-\udfff]")


def load(name: str) -> dict[str, Any]:
    """One of the committed OpenAPI documents (``router`` or ``admin``)."""
    doc: dict[str, Any] = yaml.safe_load((DOCS / f"{name}.yaml").read_text())
    return doc


class Document:
    """An OpenAPI document with its references followed and its ``allOf`` merged."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def resolve(self, node: Any) -> Any:
        while isinstance(node, dict) and "$ref" in node:
            target: Any = self.doc
            for part in node["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            node = target
        return node

    def flat(self, schema: Any) -> dict[str, Any]:
        """The schema with ``$ref`` followed and ``allOf`` parts merged into it."""
        schema = self.resolve(schema)
        if not isinstance(schema, dict) or "allOf" not in schema:
            return schema if isinstance(schema, dict) else {}
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        properties = dict(merged.get("properties", {}))
        required = list(merged.get("required", []))
        for part in schema["allOf"]:
            part = self.flat(part)
            for name, sub in part.get("properties", {}).items():
                properties.setdefault(name, sub)
            required += [r for r in part.get("required", []) if r not in required]
        merged["properties"] = properties
        merged["required"] = required
        return merged

    def operation(self, path: str, method: str) -> dict[str, Any]:
        op: dict[str, Any] = self.doc["paths"][path][method.lower()]
        return op

    def request_schema(self, path: str, method: str) -> dict[str, Any] | None:
        body = self.operation(path, method).get("requestBody")
        if body is None:
            return None
        return self.flat(body["content"]["application/json"]["schema"])

    def response_schema(
        self, path: str, method: str, status: int, media: str = "application/json"
    ) -> dict[str, Any] | None:
        responses = self.operation(path, method)["responses"]
        response = self.resolve(responses.get(str(status)) or responses.get("default") or {})
        content = response.get("content", {}).get(media)
        if content is None:
            return None
        if media == "text/event-stream":
            return self.flat(content.get("x-tollgate-event-schema"))
        return self.flat(content["schema"])

    def validator(self, schema: dict[str, Any]) -> Draft202012Validator:
        """A validator for ``schema`` whose references resolve in this document."""
        return Draft202012Validator({**schema, "components": self.doc["components"]})

    def edge_checked(self, schema: dict[str, Any], prefix: str = "") -> dict[str, Checked]:
        """Fields marked ``x-tollgate-checked: edge``, by pattern (``messages.*.role``)."""
        flat = self.flat(schema)
        required = set(flat.get("required", []))
        found: dict[str, Checked] = {}
        for name, sub in flat.get("properties", {}).items():
            sub_flat = self.flat(sub)
            if sub_flat.get("x-tollgate-checked") != "edge":
                continue
            pattern = f"{prefix}{name}"
            found[pattern] = Checked(sub_flat, name in required)
            for branch in self._branches(sub_flat):
                if branch.get("type") == "array" and "items" in branch:
                    found.update(self.edge_checked(branch["items"], f"{pattern}.*."))
                elif branch.get("type") == "object":
                    found.update(self.edge_checked(branch, f"{pattern}."))
        return found

    def _branches(self, schema: dict[str, Any]) -> list[dict[str, Any]]:
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return [self.flat(b) for b in schema[key]]
        return [schema]

    def shallow_valid(self, schema: dict[str, Any], value: Any) -> bool:
        """Whether ``value`` has the field's type, bounds and lengths, not looking inside it.

        What the edge checks of a field whose items it passes on untouched
        (a message's ``content`` parts, say).
        """

        def strip(s: dict[str, Any]) -> dict[str, Any]:
            s = self.flat(s)
            kept = {
                k: v
                for k, v in s.items()
                if k not in ("items", "properties", "additionalProperties", "required")
                and not k.startswith("x-")
            }
            # stripped branches are no longer exclusive: one that matches is enough
            branches = kept.pop("oneOf", []) + kept.pop("anyOf", [])
            if branches:
                kept["anyOf"] = [strip(b) for b in branches]
            return kept

        # the items are not looked at: placeholders keep the check (and its
        # error messages) from walking a value nested a thousand deep
        if isinstance(value, list):
            value = [None] * len(value)
        elif isinstance(value, dict):
            value = dict.fromkeys(value)
        return bool(Draft202012Validator(strip(schema)).is_valid(value))


def json_text_valid(value: Any) -> bool:
    """Whether ``value`` serialises to JSON any parser must accept (no NaN, no lone surrogate)."""
    stack = [value]
    seen: set[int] = set()  # a mutation may put one list in several places
    while stack:
        item = stack.pop()
        if isinstance(item, float) and (item != item or item in (float("inf"), float("-inf"))):
            return False
        if isinstance(item, str) and SURROGATE.search(item) is not None:
            return False
        if isinstance(item, list | dict):
            if id(item) in seen:
                continue
            seen.add(id(item))
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return True


def clip(value: Any, depth: int = 32) -> Any:
    """``value`` with what lies deeper than ``depth`` replaced by an empty list or object.

    For validators and printers that recurse (and build a repr of what they
    refuse): the documents' schemas end long before 32 levels, so the answer
    about the clipped value is the answer about the value.
    """
    if isinstance(value, list):
        return [clip(v, depth - 1) for v in value] if depth else []
    if isinstance(value, dict):
        return {k: clip(v, depth - 1) for k, v in value.items()} if depth else {}
    return value


def lax_number(value: Any) -> bool:
    """A boolean or a numeric string: what a lax validator (pydantic's, vLLM's) takes for a number.

    The document types such fields as numbers, but whether a server coerces
    these is its choice, so a refusal of them is not something to demand.
    """
    return isinstance(value, bool) or (
        isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\.\d+)?\s*", value) is not None
    )


def encode(value: Any, rng: random.Random) -> bytes:
    """JSON bytes, escaped to ASCII or not; NaN and lone surrogates are written as they are."""
    ascii_only = rng.random() < 0.5
    # the encoder recurses once per level; a mutation nests values up to 1000 deep
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))
    try:
        text = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)
    finally:
        sys.setrecursionlimit(limit)
    return text.encode("utf-8", "surrogatepass")


def nest(value: Any, depth: int, rng: random.Random) -> Any:
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"a": value}
    return value


def preview(value: Any, limit: int = 160) -> str:
    """A short, printable rendering of a value for a failure message."""
    try:
        text = json.dumps(clip(value, 8), ensure_ascii=True, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(clip(value, 8))
    return text if len(text) <= limit else f"{text[: limit - 30]}...({len(text)} chars)"


@dataclass(frozen=True)
class Checked:
    """A field the server validates: its schema, and whether its object requires it."""

    schema: dict[str, Any]
    required: bool


@dataclass
class Mutation:
    """One change to a valid body, for people: ``max_tokens <- "abc"``."""

    label: str


@dataclass
class Generated:
    body: Any
    mutations: list[Mutation] = field(default_factory=list)
    refusal: str | None = None
    """Why the document says the edge refuses the final body (a 4xx), or None:
    then any answer but a 5xx. Judged on the body as sent, not on the mutations
    that made it: a later mutation may undo an earlier one."""

    @property
    def strict(self) -> bool:
        return self.refusal is not None

    @property
    def label(self) -> str:
        text = "; ".join(m.label for m in self.mutations) or "valid"
        return f"{text} (refused: {self.refusal})" if self.refusal else text


class Generator:
    """Bodies from a schema: small valid values, then mutations of them."""

    def __init__(self, doc: Document, rng: random.Random) -> None:
        self.doc = doc
        self.rng = rng

    # -- valid values -------------------------------------------------------

    def value(self, schema: Any, depth: int = 0) -> Any:
        rng = self.rng
        s = self.doc.flat(schema)
        if "const" in s:
            return s["const"]
        if "enum" in s:
            return rng.choice(s["enum"])
        if "examples" in s and s.get("type") != "object" and rng.random() < 0.8:
            return rng.choice(s["examples"])
        for key in ("oneOf", "anyOf"):
            if key in s:
                branches = [self.doc.flat(b) for b in s[key]]
                solid = [b for b in branches if b.get("type") != "null"]
                pool = solid if solid and rng.random() < 0.9 else branches
                return self.value(rng.choice(pool), depth)
        types = s.get("type")
        if types is None:
            return rng.choice(["none", "auto"])
        if isinstance(types, list):
            solid_types = [t for t in types if t != "null"]
            kind = rng.choice(solid_types) if solid_types and rng.random() < 0.9 else "null"
        else:
            kind = types
        return getattr(self, f"_{kind}")(s, depth)

    def _null(self, s: dict[str, Any], depth: int) -> None:
        return None

    def _boolean(self, s: dict[str, Any], depth: int) -> bool:
        return self.rng.random() < 0.5

    def _integer(self, s: dict[str, Any], depth: int) -> int:
        low = s.get("minimum", s.get("exclusiveMinimum", -1) + 1 if "exclusiveMinimum" in s else 0)
        high = s.get("maximum", low + 64)
        if self.rng.random() < 0.2:
            return int(self.rng.choice([low, high]))
        return self.rng.randint(int(low), int(min(high, low + 64)))

    def _number(self, s: dict[str, Any], depth: int) -> float:
        low = s.get("minimum", s.get("exclusiveMinimum", -1.0))
        high = s.get("maximum", low + 2)
        value = round(self.rng.uniform(low, high), 3)
        return value if "exclusiveMinimum" not in s or value > low else float(high)

    def _string(self, s: dict[str, Any], depth: int) -> str:
        if "pattern" in s and "examples" in s:  # words would not match it
            return str(self.rng.choice(s["examples"]))
        words = ["hello", "Tollgate", "quick brown fox", "é", "漢字", "🙂", "tab\there", "line\n"]
        text = ""
        while len(text) < s.get("minLength", 0) or (not text and self.rng.random() < 0.9):
            text += self.rng.choice(words)
        return text[: s.get("maxLength", 48)]

    def _array(self, s: dict[str, Any], depth: int) -> list[Any]:
        low = s.get("minItems", 0)
        count = self.rng.randint(low, max(low, min(s.get("maxItems", 3), 3)))
        items = s.get("items", {"type": "string"})
        return [self.value(items, depth + 1) for _ in range(count)]

    def _object(self, s: dict[str, Any], depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        required = set(s.get("required", []))
        for name, sub in s.get("properties", {}).items():
            if name in required or (depth < 3 and self.rng.random() < 0.3):
                out[name] = self.value(sub, depth + 1)
        if s.get("additionalProperties") is True and self.rng.random() < 0.1:
            out[f"x_fuzz_{self.rng.randrange(1000)}"] = self.rng.choice([1, "x", [1], {"a": None}])
        return out

    # -- mutations ----------------------------------------------------------

    def mutate(
        self,
        body: Any,
        schema: dict[str, Any],
        count: int,
        *,
        strict_fields: dict[str, Checked],
        strict_all: bool = False,
        lax_numbers: bool = False,
    ) -> Generated:
        """``count`` mutations of ``body``.

        ``strict_fields`` are the field patterns the server validates, with
        their schemas; ``strict_all`` says it validates the whole body (the
        admin API, whose bodies forbid unknown fields); ``lax_numbers`` that it
        coerces numeric strings and booleans into numbers (pydantic's lax mode),
        so those are not refusals the document can promise.
        """
        out = Generated(copy.deepcopy(body))
        for _ in range(count):
            mutation = self._mutate_once(out)
            if mutation is not None:
                out.mutations.append(mutation)
        if not json_text_valid(out.body):
            out.refusal = "not valid JSON text"
        else:
            out.refusal = self.edge_refusal(out.body, strict_fields, lax_numbers)
        if strict_all and out.refusal is None:
            invalid = not self.doc.validator(schema).is_valid(clip(out.body))
            if invalid and not (lax_numbers and self._only_lax(out.body, schema)):
                out.refusal = "invalid body"
        return out

    def edge_refusal(
        self, body: Any, strict_fields: dict[str, Checked], lax_numbers: bool
    ) -> str | None:
        """The first field of ``body`` that ``strict_fields`` say the edge refuses, or None.

        A field is refused when its object lacks it and requires it, or when
        its value has not the field's type, bounds or lengths (a number written
        as a string or a boolean excepted with ``lax_numbers``). A pattern
        whose containers are not there (or not of the shape it names) is not
        looked at: the field that holds them is checked on its own.
        """
        for pattern, checked in strict_fields.items():
            *path, name = pattern.split(".")
            for where, container in self._containers(body, path, ()):
                if not isinstance(container, dict):
                    continue
                shown = ".".join(map(str, (*where, name)))
                if name not in container:
                    if checked.required:
                        return f"{shown} missing"
                    continue
                value = container[name]
                if self.doc.shallow_valid(checked.schema, value):
                    continue
                if lax_numbers and lax_number(value):
                    continue
                return f"{shown} {preview(value, 40)}"
        return None

    def _containers(self, value: Any, path: list[str], where: Path_) -> Iterator[tuple[Path_, Any]]:
        """The values at ``path`` (``*``: every item of a list), with where each is."""
        if not path:
            yield where, value
            return
        step, rest = path[0], path[1:]
        if step == "*":
            if isinstance(value, list):
                for index, item in enumerate(value):
                    yield from self._containers(item, rest, (*where, index))
        elif isinstance(value, dict) and step in value:
            yield from self._containers(value[step], rest, (*where, step))

    def _only_lax(self, body: Any, schema: dict[str, Any]) -> bool:
        """Whether every schema error is a number written as a string or a boolean."""
        for error in self.doc.validator(schema).iter_errors(clip(body)):
            if error.validator != "type" or not lax_number(error.instance):
                return False
        return True

    def _paths(self, value: Any, prefix: Path_ = ()) -> Iterator[Path_]:
        if len(prefix) > 6:
            return
        if isinstance(value, dict):
            for key, sub in value.items():
                yield (*prefix, key)
                yield from self._paths(sub, (*prefix, key))
        elif isinstance(value, list):
            for index, sub in enumerate(value[:4]):
                yield (*prefix, index)
                yield from self._paths(sub, (*prefix, index))

    def _mutate_once(self, out: Generated) -> Mutation | None:
        rng = self.rng
        paths = list(self._paths(out.body))
        if not paths:
            return None
        where = rng.choice(paths)
        pattern = ".".join("*" if isinstance(p, int) else str(p) for p in where)
        parent = out.body
        for step in where[:-1]:
            parent = parent[step]
        last = where[-1]
        op = rng.choices(["drop", "type", "number", "string", "nest", "extra"], [1, 3, 3, 3, 1, 1])[
            0
        ]
        if op == "drop":
            del parent[last]
            return Mutation(f"drop {pattern}")
        if op == "extra":
            container = parent[last] if isinstance(parent[last], dict) else parent
            if not isinstance(container, dict):
                return None
            name = rng.choice(["x_extra", "", "a.b", "*", ">", "é", "\x00", "$ref", "__proto__"])
            container[name] = rng.choice([1, "x", None, {"a": [1, {"b": 2}]}])
            return Mutation(f"extra field {name!r} near {pattern}")
        if op == "nest":
            depth = rng.choice(NEST_DEPTHS)
            parent[last] = nest(parent[last], depth, rng)
            return Mutation(f"{pattern} nested {depth} deep")
        pool = {"type": WRONG_TYPES, "number": NUMBERS, "string": STRINGS}[op]
        # a copy: a pool's list or object put in two places would let a later
        # mutation of one reach the other (and could make the body a cycle)
        new = copy.deepcopy(rng.choice(pool))
        parent[last] = new
        return Mutation(f"{pattern} <- {preview(new, 40)}")
