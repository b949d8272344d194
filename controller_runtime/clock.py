"""Timestamps as the Kubernetes API writes them, in UTC: metav1.Time (RFC 3339, whole seconds) for
Events, conditions and phase transitions, and metav1.MicroTime (microseconds) for Leases.

Each takes an optional `at` so a caller (or a test) can stamp a time of its choosing; without
it, the current time is used."""

from __future__ import annotations

import datetime


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def now_rfc3339(at: datetime.datetime | None = None) -> str:
    """metav1.Time: `2006-01-02T15:04:05Z`."""
    return (at or utc_now()).astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(at: datetime.datetime | None = None) -> str:
    """metav1.MicroTime: `2006-01-02T15:04:05.000000Z`."""
    return (at or utc_now()).astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
