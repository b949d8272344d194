"""One CSI plugin of the local stack behind the bench's fault proxy (`make up DRIVER=` with
`--driver-fault`, the stack campaign of docs/driver-bench.md): this process serves the socket the
sidecars, the registrar and the node agent dial, and runs the recipe's command for that instance on
a socket of its own behind it. The proxy injects the fault in one call, kills and restarts the
driver from the recipe as the bench's runner does, and writes every call it saw, one JSON line
each, for the campaign, which runs in another process.

The proxy, not the driver, owns the socket the stack dials: a kill -9 of the driver then looks to
the sidecars as it does in a cluster (UNAVAILABLE until it is back), and the registration the node
agent made stays valid across restarts.

`python -m driver_bench.stack_plugin --recipe R --role controller|node --listen SOCK --socket SOCK
--node-id N --state-dir D --kubelet-dir D --shared-dir D --work D --calls FILE [--fault KIND:STEP]`"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from .faults import parse_fault
from .proxy import Call, FaultProxy
from .recipe import Filled, RecipeError, load
from .runner import Driver, Layout, ServiceProcess


def call_line(call: Call, wall_t0: float) -> dict[str, Any]:
    """A call as the campaign reads it back (`stack_campaign.read_calls`): bytes as base64, its
    start on the wall clock, so the calls of every instance merge into one order."""
    return {
        "wall": wall_t0 + call.started,
        "seconds": call.seconds,
        "method": call.method,
        "request": base64.b64encode(call.request).decode(),
        "response": base64.b64encode(call.response).decode() if call.response is not None else None,
        "code": call.code,
        "details": call.details,
        "fault": call.fault,
        "extra": call.extra,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="driver_bench.stack_plugin", description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--role", choices=("controller", "node"), required=True)
    p.add_argument("--listen", required=True, help="the socket the stack dials (the proxy's)")
    p.add_argument("--socket", required=True, help="the driver's own socket, behind the proxy")
    p.add_argument("--node-id", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--kubelet-dir", required=True)
    p.add_argument("--shared-dir", required=True)
    p.add_argument("--work", required=True, help="where the driver's log goes")
    p.add_argument("--calls", required=True, help="the JSON-lines file every call is appended to")
    p.add_argument("--fault", default="", help="KIND:STEP, e.g. kill-after:CreateVolume; none by default")
    p.add_argument("--timeout-seconds", type=float, default=0.1, help="the deadline of a timeout fault")
    return p


async def serve(args: argparse.Namespace, calls: TextIO) -> None:
    recipe = load(args.recipe)
    # The node instances run the recipe's node command, or its one command serving everything.
    service = recipe.node if args.role == "node" and recipe.node else recipe.controller
    socket = Path(args.socket)
    placeholders = Filled(
        socket=socket,
        node_id=args.node_id,
        state_dir=Path(args.state_dir),
        kubelet_dir=Path(args.kubelet_dir),
        recipe_dir=recipe.path.parent,
        shared_dir=Path(args.shared_dir),
    )
    layout = Layout(Path(args.work), socket.parent)
    driver = Driver(recipe, layout, {service.role: ServiceProcess(recipe, service, layout, placeholders)})
    proxy: FaultProxy | None = None

    def record(call: Call) -> None:
        assert proxy is not None
        calls.write(json.dumps(call_line(call, proxy.wall_t0)) + "\n")
        calls.flush()  # the campaign reads it while the stack runs

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # The driver runs in a process group of its own (so a kill -9 reaches all of it): the
        # stack's SIGTERM to this group does not reach it, this process stops it.
        loop.add_signal_handler(sig, stop.set)
    try:
        await driver.start()
        proxy = FaultProxy(driver, Path(args.listen), parse_fault(args.fault), args.timeout_seconds, record)
        await proxy.start()
        await stop.wait()
    finally:
        if proxy is not None:
            await proxy.stop()
        await driver.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    Path(args.state_dir).mkdir(parents=True, exist_ok=True)
    Path(args.listen).unlink(missing_ok=True)  # a socket left by a killed predecessor
    try:
        with Path(args.calls).open("a") as calls:
            asyncio.run(serve(args, calls))
    except RecipeError as e:
        print(f"driver_bench.stack_plugin: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
