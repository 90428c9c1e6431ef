"""orjson codec for bus messages (pydantic models)."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def encode(message: BaseModel) -> bytes:
    """Serialise a contract to JSON bytes (None fields are left out)."""
    return orjson.dumps(message.model_dump(mode="json", exclude_none=True))


def decode(model: type[M], data: bytes) -> M:
    """Parse and validate JSON bytes as ``model``."""
    return model.model_validate(orjson.loads(data))


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)
