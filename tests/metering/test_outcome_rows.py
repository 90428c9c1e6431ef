"""Usage rows keep the outcome string the router sent, known to this reader or not."""

from __future__ import annotations

import time

import pytest

from services.metering.ingest import to_row
from tests.lib.test_outcome import STORED, usage_event


@pytest.mark.parametrize("value", [*STORED, "some_new_ending"])
def test_a_row_holds_the_outcome_as_a_plain_string(value: str) -> None:
    row = to_row(usage_event(value), stream_seq=1, now=time.time())
    assert row["outcome"] == value and type(row["outcome"]) is str
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 2)
