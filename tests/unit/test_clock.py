"""The API's timestamp formats."""

from __future__ import annotations

import datetime

from controller_runtime.clock import micro_time, now_rfc3339

AT = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC)


def test_formats() -> None:
    assert now_rfc3339(AT) == "2026-01-02T03:04:05Z"
    assert micro_time(AT) == "2026-01-02T03:04:05.678901Z"
    # Another zone is converted to UTC.
    cet = AT.astimezone(datetime.timezone(datetime.timedelta(hours=1)))
    assert now_rfc3339(cet) == "2026-01-02T03:04:05Z"


def test_now_is_utc() -> None:
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    stamp = datetime.datetime.strptime(now_rfc3339(), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    assert before - datetime.timedelta(seconds=1) <= stamp <= before + datetime.timedelta(seconds=2)
