"""The integers a JSON request body may hold, and where one it may not is.

Services read bodies with orjson, which reads an integer exactly from
:data:`INT_MIN` to :data:`INT_MAX` (64 bits, signed below zero, unsigned
above), reads a wider one as a float (rounded: ``2**64 + 1`` would become
``2**64``) and refuses one beyond a double's range as if the body were not
JSON. Neither is what the client sent, so a body with an integer beyond 64
bits is refused, and :func:`integer_beyond_64_bits` names where it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
# Every integer beyond 64 bits has at least 19 digits (-2**63 - 1 has 19, 2**64 has 20).
_LONG_DIGITS = re.compile(rb"\d{19,}")


class _Beyond:
    """Where an integer beyond 64 bits stood in the body."""


_BEYOND = _Beyond()


def _integer(text: str) -> int | _Beyond:
    # Past 20 digits it is out of range without converting it (int() refuses 4,300 digits).
    if len(text.lstrip("-")) > 20:
        return _BEYOND
    value = int(text)
    return value if INT_MIN <= value <= INT_MAX else _BEYOND


def integer_beyond_64_bits(raw: bytes) -> tuple[str | int, ...] | None:
    """The location (keys and indexes) of the first integer in ``raw`` beyond 64 bits.

    None when there is none, or when ``raw`` is not JSON for another reason.
    The body is read a second time (by the standard library, exactly) only
    when it has a run of 19 digits or more, so almost every body costs one
    regular expression search.
    """
    if _LONG_DIGITS.search(raw) is None:
        return None
    try:
        body = json.loads(raw, parse_int=_integer)
    except (ValueError, RecursionError):  # not JSON (or nested past the reader's limit)
        return None
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), body)]
    while stack:
        where, value = stack.pop()
        if value is _BEYOND:
            return where or None  # the body itself: not an object, refused as such
        if isinstance(value, dict):
            items: list[tuple[str | int, Any]] = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            continue
        stack.extend(((*where, key), child) for key, child in reversed(items))
    return None


def dotted(where: tuple[str | int, ...]) -> str:
    """A location as a client names a field: ``prompt.0``."""
    return ".".join(str(part) for part in where)


def integer_message(where: tuple[str | int, ...]) -> str:
    """The error message for an integer beyond 64 bits at ``where``."""
    return (
        f"Invalid value for '{dotted(where)}': Input should be an integer "
        f"from {INT_MIN} to {INT_MAX} (64 bits)."
    )
