"""Reflector decisions: when to resume the watch and when to re-list."""

from __future__ import annotations

from controller_runtime.client import ApiError, WatchExpiredError
from controller_runtime.http_client import CannotConnect, Disconnected
from controller_runtime.reflector import Backoff, Step, next_step


def test_normal_end_of_watch_resumes() -> None:
    assert next_step(None) is Step.RESUME


def test_gone_relists() -> None:
    assert next_step(WatchExpiredError("too old resource version")) is Step.RELIST
    assert next_step(ApiError(410, {"reason": "Expired"})) is Step.RELIST


def test_dropped_connection_resumes_from_last_version() -> None:
    assert next_step(Disconnected("the server closed the connection before answering")) is Step.RESUME
    assert next_step(TimeoutError()) is Step.RESUME


def test_other_errors_back_off() -> None:
    assert next_step(ApiError(500, None)) is Step.BACKOFF
    assert next_step(ApiError(403, {"reason": "Forbidden"})) is Step.BACKOFF
    assert next_step(OSError("connection refused")) is Step.BACKOFF
    assert next_step(CannotConnect("cannot connect to 127.0.0.1:6443")) is Step.BACKOFF


def test_backoff_doubles_to_cap_and_resets() -> None:
    b = Backoff(initial=1, maximum=4)
    delays = [b.next() for _ in range(5)]
    assert 1 <= delays[0] <= 1.2
    assert 2 <= delays[1] <= 2.4
    assert all(4 <= d <= 4.8 for d in delays[2:])
    b.reset()
    assert b.next() <= 1.2
