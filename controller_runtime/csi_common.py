"""What the sidecars' two CSI clients share: csi_client's on grpcio and asyncio (the controllers)
and csi_lite's on grpc_lite and threads (node-driver-registrar, livenessprobe). Neither grpc nor
asyncio is imported here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .logs import get_logger
from .metrics import Histogram

log = get_logger("csi")

# The upstream sidecars' metric: each CSI call's latency and gRPC code.
OPERATIONS = Histogram(
    "csi_sidecar_operations_seconds",
    "CSI operation latency by method and gRPC code",
    ("driver_name", "method_name", "grpc_status_code"),
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)

# The names of the codes after which a call may still be running in the driver: gRPC's cancelled,
# timed out and transport-broken calls, and CSI's "an operation is pending for this volume".
IN_PROGRESS = frozenset({"CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "ABORTED"})


@dataclass
class Backoff:
    """Waiting for a CSI driver at `address` to reach a state: each failed attempt's reason in,
    the delay before the next out, from 0.1 s doubling to 2 s, saying every 10 s why it still waits;
    after `wait` seconds (None: never) a TimeoutError naming `state` and the last reason."""

    address: str
    state: str
    wait: float | None
    delay: float = 0.1
    _start: float = field(default_factory=time.monotonic)
    _last_log: float = 0.0

    def next_delay(self, reason: str) -> float:
        now = time.monotonic()
        if self.wait is not None and now > self._start + self.wait:
            raise TimeoutError(f"CSI driver at {self.address} {self.state} after {self.wait}s: {reason}")
        if now - self._last_log > 10:
            log.info("still connecting to CSI driver", address=self.address, reason=reason)
            self._last_log = now
        delay, self.delay = self.delay, min(self.delay * 2, 2.0)
        return delay


def answered(address: str, name: str) -> str:
    """The driver's name from GetPluginInfo, which may not be empty."""
    if not name:
        raise RuntimeError(f"the CSI driver at {address} reports an empty name")
    log.info("CSI driver answered", address=address, driver=name)
    return name
