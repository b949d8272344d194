"""Small pieces of the process entry: durations, log formats, token bucket, endpoints."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

import pytest

from controller_runtime.clock_testing import FakeClock
from controller_runtime.health import parse_endpoint
from controller_runtime.logs import JsonFormatter, TextFormatter
from controller_runtime.process import add_http_flags, duration, parse_args
from controller_runtime.ratelimit import TokenBucket


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("100ms", 0.1), ("15s", 15), ("5m", 300), ("1h30m", 5400), ("2.5", 2.5), ("1m0.5s", 60.5)],
)
def test_duration(text: str, seconds: float) -> None:
    assert duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["5x", "m", "10 parsecs", "1h5"])
def test_bad_duration(bad: str) -> None:
    with pytest.raises(Exception, match="duration"):
        duration(bad)


def _record(**fields: object) -> logging.LogRecord:
    rec = logging.LogRecord("pv-controller", logging.INFO, __file__, 1, "bound claim", None, None)
    rec.kubeloop_fields = fields
    return rec


def test_text_and_json_logs_carry_fields() -> None:
    text = TextFormatter().format(_record(claim="ns/data", volume="pv 1"))
    assert 'msg="bound claim"' in text and "claim=ns/data" in text and 'volume="pv 1"' in text
    doc = json.loads(JsonFormatter().format(_record(claim="ns/data", count=3)))
    assert doc["msg"] == "bound claim" and doc["claim"] == "ns/data" and doc["count"] == 3


@pytest.mark.parametrize("raw", ["\x1b[31mred", "a\nlevel=error forged", "del\x7f", "c1\x9b2J", "nul\x00"])
def test_text_logs_escape_control_characters(raw: str) -> None:
    """A value from a request (a name, a path) never writes a raw control character: no ESC
    sequence reaches a terminal, no newline starts a forged line (issue 29)."""
    text = TextFormatter().format(_record(name=raw))
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text), repr(text)
    assert json.loads(text.split("name=", 1)[1]) == raw
    assert "\n" not in JsonFormatter().format(_record(name=raw))


def test_token_bucket() -> None:
    clock = FakeClock()
    bucket = TokenBucket(qps=2, burst=2, clock=clock)
    assert [bucket.reserve(), bucket.reserve()] == [0, 0]
    assert bucket.reserve() == pytest.approx(0.5)
    clock.step(10)
    assert bucket.reserve() == 0
    assert TokenBucket(qps=0, burst=1).reserve() == 0, "qps 0 means unlimited"


def test_token_bucket_available_peeks_without_taking() -> None:
    clock = FakeClock()
    bucket = TokenBucket(qps=2, burst=2, clock=clock)
    assert bucket.available() == 2.0
    assert bucket.reserve() == 0 and bucket.reserve() == 0
    assert bucket.available() == 0.0
    assert bucket.reserve() == 0.5 and bucket.available() == -1.0, "in debt"
    clock.step(1.0)
    assert bucket.available() == 1.0 and bucket.available() == 1.0
    assert TokenBucket(qps=0, burst=3).available() == 3.0


async def test_token_bucket_acquire_waits_on_its_clock() -> None:
    clock = FakeClock()
    bucket = TokenBucket(qps=4, burst=1, clock=clock)
    await bucket.acquire()
    second = asyncio.create_task(bucket.acquire())
    await clock.until_waiting()
    assert clock.waiting() == [0.25]
    await clock.advance(0.25)
    assert second.done()


def test_endpoint() -> None:
    assert parse_endpoint(":8080") == (None, 8080), "an empty host is every interface"
    assert parse_endpoint("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_endpoint("0.0.0.0:9808") == ("0.0.0.0", 9808)
    assert parse_endpoint("[::1]:9809") == ("::1", 9809)
    assert parse_endpoint("[::]:9809") == ("::", 9809)
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint("8080")


def _sidecar(default: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sidecar")
    add_http_flags(parser, default=default, health_port=True)
    return parser


def test_health_port_is_an_http_endpoint_on_every_interface() -> None:
    assert parse_args(_sidecar(":9808"), []).http_endpoint == ":9808"
    assert parse_args(_sidecar(":9808"), ["--health-port", "9000"]).http_endpoint == ":9000"
    assert parse_args(_sidecar(":9808"), ["--health-port=0"]).http_endpoint == "", "0 disables it"
    assert parse_args(_sidecar(""), ["--http-endpoint", "127.0.0.1:9809"]).http_endpoint == "127.0.0.1:9809"
    assert parse_args(_sidecar(":9808"), ["--http-endpoint="]).http_endpoint == ""
    for argv in (["--health-port", "9000", "--http-endpoint", ":9001"], ["--health-port=-1"]):
        with pytest.raises(SystemExit):
            parse_args(_sidecar(":9808"), argv)
