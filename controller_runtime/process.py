"""Process entry shared by every kubeloop binary: common flags, logging, uvloop, metrics/health
server, and graceful shutdown on SIGTERM, SIGINT or SIGHUP.

A component writes `async def run(args, ctx)` and calls `process.main(...)` from its console script.
On SIGTERM, SIGINT or SIGHUP the task running `run` is cancelled, so `finally:` blocks and `async
with` exits do the clean-up (stop workers, release the leader lease, close sockets) before the
process exits 0. SIGHUP is a stop like the others, even when the process inherited it ignored: the
terminal of a process run by hand (`make up`) is gone, and nobody is left there to stop it.

A second Ctrl-C (SIGINT) exits at once. A further SIGTERM or SIGHUP during the clean-up is only
logged: those are repeated by the processes in between, not by a person in a hurry (make passes
its SIGTERM on to its child, so `kill -TERM -PGID` of `make up` delivers two; shells and sudo pass a
hang-up on), and an exit there would skip the very clean-up the first one started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from .health import HealthServer
from .logs import get_logger, setup_logging
from .stop_signals import STOP_SIGNALS, first_stop

log = get_logger("process")


def duration(text: str) -> float:
    """Parses a Go-style duration (`100ms`, `15s`, `5m`, `1h30m`, or plain seconds) into seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    total, number = 0.0, ""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else ch
        if unit not in units or not number:
            raise argparse.ArgumentTypeError(f"invalid duration {text!r} (use e.g. 100ms, 15s, 5m)")
        total += float(number) * units[unit]
        number = ""
        i += len(unit)
    if number:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: a number needs a unit")
    return total


def add_bool_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, default: bool, help: str
) -> None:
    """A boolean flag spelled as Go's flag package takes it: `--name`, `--name=true`, `--name=false`."""

    def parse(text: str) -> bool:
        if text.lower() in ("1", "t", "true"):
            return True
        if text.lower() in ("0", "f", "false"):
            return False
        raise argparse.ArgumentTypeError(f"invalid boolean {text!r} (use true or false)")

    parser.add_argument(
        name,
        nargs="?",
        const=True,
        default=default,
        type=parse,
        help=f"{help} (default: {str(default).lower()})",
    )


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text writes key=value lines; json writes one object per line (default: text)",
    )
    group.add_argument(
        "-v",
        "--v",
        dest="verbosity",
        type=int,
        default=2,
        help="log verbosity as in klog; 4 and above include debug messages (default: 2)",
    )


def add_http_flags(parser: argparse.ArgumentParser, default: str = "", health_port: bool = False) -> None:
    """--http-endpoint; with `health_port`, also the CSI sidecars' older `--health-port N`, which
    means `--http-endpoint :N` (0 disables it). Only one of the two may be given, as upstream says;
    `parse_args` settles them into args.http_endpoint."""
    parser.add_argument(
        "--http-endpoint",
        # With --health-port, None tells "not given" from "given as the default" (see parse_args).
        default=None if health_port else default,
        help="host:port serving /metrics, /healthz and /readyz; an empty host (:8080) listens on "
        f"every interface, an empty value disables it (default: {default or 'disabled'})",
    )
    if health_port:
        parser.add_argument(
            "--health-port",
            type=int,
            default=None,
            help="(deprecated) port serving the same on every interface, i.e. --http-endpoint :PORT; "
            "0 disables it; not together with --http-endpoint",
        )
        parser.set_defaults(http_endpoint_default=default)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses flags, settling --health-port into --http-endpoint (see add_http_flags)."""
    args = parser.parse_args(argv)
    if not hasattr(args, "health_port"):
        return args
    if args.health_port is None:
        if args.http_endpoint is None:
            args.http_endpoint = args.http_endpoint_default
    elif args.http_endpoint is not None:
        parser.error("only one of --health-port and --http-endpoint may be set")
    elif args.health_port < 0:
        parser.error(f"--health-port must be a port number, got {args.health_port}")
    else:
        args.http_endpoint = f":{args.health_port}" if args.health_port else ""
    return args


def add_kube_flags(parser: argparse.ArgumentParser, qps: float = 5.0, burst: int = 10) -> None:
    group = parser.add_argument_group("Kubernetes API")
    group.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG", ""),
        help="path to a kubeconfig; empty means in-cluster configuration (default: $KUBECONFIG)",
    )
    group.add_argument(
        "--kube-api-qps",
        type=float,
        default=qps,
        help=f"steady requests per second to the API server, client side (default: {qps})",
    )
    group.add_argument(
        "--kube-api-burst",
        type=int,
        default=burst,
        help=f"requests allowed above --kube-api-qps in a burst (default: {burst})",
    )


def add_csi_flags(parser: argparse.ArgumentParser, timeout: float | None) -> None:
    """A CSI sidecar's driver socket and the timeout of each call to it (`timeout` in seconds;
    None for a sidecar whose timeout flag has another name)."""
    parser.add_argument(
        "--csi-address", default="/run/csi/socket", help="CSI driver socket (default: /run/csi/socket)"
    )
    if timeout is None:
        return
    parser.add_argument(
        "--timeout",
        type=duration,
        default=timeout,
        help=f"timeout of each CSI call (default: {timeout:g}s)",
    )


def add_retry_flags(parser: argparse.ArgumentParser) -> None:
    """The CSI sidecars' per-object retry backoff, with their defaults (1s doubling to 5m)."""
    parser.add_argument(
        "--retry-interval-start",
        type=duration,
        default=1.0,
        help="first retry delay after a failure, doubling with each failure (default: 1s)",
    )
    parser.add_argument(
        "--retry-interval-max", type=duration, default=300.0, help="longest retry delay (default: 5m)"
    )


def add_leader_election_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("leader election")
    group.add_argument(
        "--leader-election",
        action="store_true",
        help="run only while holding a coordination.k8s.io Lease, so replicas can stand by",
    )
    group.add_argument(
        "--leader-election-namespace",
        default="kube-system",
        help="namespace of the Lease (default: kube-system)",
    )
    group.add_argument(
        "--leader-election-lease-duration",
        type=duration,
        default=15.0,
        help="how long a lease is valid without renewal (default: 15s)",
    )
    group.add_argument(
        "--leader-election-renew-deadline",
        type=duration,
        default=10.0,
        help="how long the leader keeps trying to renew before it gives up (default: 10s)",
    )
    group.add_argument(
        "--leader-election-retry-period",
        type=duration,
        default=5.0,
        help="interval between attempts to acquire or renew (default: 5s)",
    )


def add_controller_flags(
    parser: argparse.ArgumentParser,
    *,
    resync_period: float = 600.0,
    resync_help: str = "informer resync period (default: 10m)",
    qps: float = 5.0,
    burst: int = 10,
) -> None:
    """What every controller process takes after its own flags: --resync-period (by default the
    CSI sidecars' 10m; a controller with another default words its own help), the kube, http,
    leader-election and logging flags."""
    parser.add_argument("--resync-period", type=duration, default=resync_period, help=resync_help)
    add_kube_flags(parser, qps=qps, burst=burst)
    add_http_flags(parser)
    add_leader_election_flags(parser)
    add_logging_flags(parser)


@dataclass
class Context:
    """What the entry helper hands to a component's run coroutine."""

    health: HealthServer | None
    stopping: asyncio.Event = field(default_factory=asyncio.Event)


Run = Callable[[argparse.Namespace, Context], Awaitable[None]]


async def _serve(run: Run, args: argparse.Namespace) -> int:
    return await serve_together([(run, args)], getattr(args, "http_endpoint", "") or "")


async def serve_together(parts: Sequence[tuple[Run, argparse.Namespace]], http_endpoint: str) -> int:
    """Runs each `run(args, ctx)` of `parts` until a stop signal (exit 0) or until one of them
    returns or fails (exit 0 when every one has returned, else 1; the others are cancelled). One
    HTTP endpoint serves them all: one process has one set of metrics, and its /healthz and
    /readyz hold every part's checks (kubeloop-node-plugin runs three components this way)."""
    loop = asyncio.get_running_loop()
    health = HealthServer(http_endpoint) if http_endpoint else None
    stopping = asyncio.Event()
    tasks: list[asyncio.Future[None]] = []

    def on_signal(signum: int) -> None:
        if first_stop(signum, stopping):
            for task in tasks:
                task.cancel()

    if health is not None:
        await health.start()
    tasks.extend(asyncio.ensure_future(run(args, Context(health, stopping))) for run, args in parts)
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        pending: set[asyncio.Future[None]] = set(tasks)
        failed = False
        while pending and not failed:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    failed = failed or not stopping.is_set()
                    continue
                try:
                    task.result()
                except Exception:
                    log.exception("fatal error")
                    failed = True
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return 1 if failed else 0
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        if health is not None:
            with contextlib.suppress(Exception):
                await health.stop()


def main(parser: argparse.ArgumentParser, run: Run, argv: Sequence[str] | None = None) -> None:
    """Parses flags, sets up logging and uvloop, runs `run` until it returns or a signal arrives."""
    args = parse_args(parser, argv)
    setup_logging(getattr(args, "log_format", "text"), getattr(args, "verbosity", 2))
    import uvloop

    sys.exit(uvloop.run(_serve(run, args)))
