"""What each work queue of this process is retrying, and why, for people: the last error of every
key whose sync failed and has not succeeded since, its retries and when it is tried next. Served
read-only as JSON on `/debug/queues` (controller_runtime.health), which `kubectl kubeloop describe`
reads to say what a component is waiting for."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Failure:
    key: str
    error: str
    retries: int
    failed_at: float  # wall clock, seconds since the epoch
    next_retry_at: float


class QueueFailures:
    def __init__(self) -> None:
        self._failures: dict[str, dict[str, Failure]] = {}

    def failed(self, queue: str, key: str, error: str, retries: int, delay: float) -> None:
        now = time.time()
        self._failures.setdefault(queue, {})[key] = Failure(key, error, retries, now, now + delay)

    def succeeded(self, queue: str, key: str) -> None:
        entries = self._failures.get(queue)
        if entries is not None:
            entries.pop(key, None)

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        return {
            "queues": {
                queue: [
                    {**asdict(f), "next_retry_in": round(max(0.0, f.next_retry_at - now), 1)}
                    for f in sorted(entries.values(), key=lambda f: f.key)
                ]
                for queue, entries in sorted(self._failures.items())
                if entries
            }
        }


FAILURES = QueueFailures()
