"""A final report no router acknowledged is kept in the orphans bucket, even
when NATS cannot take it at first (it went down with the router's host)."""

from __future__ import annotations

from typing import Any

from services.worker.consumer import keep_orphan


class _Bucket:
    def __init__(self, owner: _FlakyOrphans) -> None:
        self.owner = owner

    async def put(self, key: str, value: bytes) -> None:
        if self.owner.failures_left > 0:
            self.owner.failures_left -= 1
            raise TimeoutError("nats: timeout")
        self.owner.kept[key] = value


class _FlakyOrphans:
    """The consumer's orphans callable, over a bucket whose first puts fail."""

    def __init__(self, failures: int) -> None:
        self.failures_left = failures
        self.kept: dict[str, bytes] = {}
        self.opened: list[bool] = []  # each call's ``fresh``

    async def __call__(self, fresh: bool = False) -> Any:
        self.opened.append(fresh)
        return _Bucket(self)


async def test_a_report_is_kept_once_nats_takes_it_again() -> None:
    orphans = _FlakyOrphans(failures=2)
    assert await keep_orphan(orphans, "req-1", b"end", retry_s=10)
    assert orphans.kept == {"req-1": b"end"}
    # the bucket is opened anew after a failure: a restarted server may have lost it
    assert orphans.opened == [False, True, True]


async def test_a_report_nats_never_takes_is_given_up_after_the_retry_time() -> None:
    orphans = _FlakyOrphans(failures=1_000)
    assert not await keep_orphan(orphans, "req-1", b"end", retry_s=1.2)
    assert orphans.kept == {}
    assert 2 <= len(orphans.opened) <= 4  # tried again while the time lasted
