"""Token buckets: the client-side API limiter (--kube-api-qps/--kube-api-burst) and the overall
bucket of a workqueue's rate limiter. Both reserve a token and report how long to wait for it, on
the injected clock."""

from __future__ import annotations

from .clock import SYSTEM_CLOCK, Clock


class TokenBucket:
    """Holds up to `burst` tokens refilled at `qps` per second; qps <= 0 means unlimited."""

    def __init__(self, qps: float, burst: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self.qps = qps
        self.burst = max(1, burst)
        self.clock = clock
        self._tokens = float(self.burst)
        self._last = clock.monotonic()

    def reserve(self) -> float:
        """Takes one token (possibly going into debt) and returns the seconds to wait before using it."""
        if self.qps <= 0:
            return 0.0
        now = self.clock.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
        self._last = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def available(self) -> float:
        """Tokens that could be taken right now without waiting (negative while in debt); takes
        none. Unlimited buckets always report `burst`."""
        if self.qps <= 0:
            return float(self.burst)
        return min(float(self.burst), self._tokens + (self.clock.monotonic() - self._last) * self.qps)

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            await self.clock.sleep(delay)
