"""`kubectl-kubeloop`, a kubectl plugin (`kubectl kubeloop ...` once it is on PATH): a claim's whole
story in one view, and every volume on one line.

    kubectl kubeloop describe pvc NAME [-n NS] [-o json] [--watch]
    kubectl kubeloop get volumes [-o json]
    kubectl kubeloop move pvc NAME --to NODE [-n NS] [--timeout 10m] [--cancel]
    kubectl kubeloop drain NODE [--timeout 30m]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.process import duration

from . import moves, retries, volumes
from .diagnose import chain_keys, diagnose
from .render import describe
from .snapshot import take


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl kubeloop",
        description="Why is my volume stuck? Reads a claim and everything its volume's life touches "
        "(class, PersistentVolume, VolumeAttachments, pods, nodes and all their events) and says which "
        "component waits for what.",
    )
    parser.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG", ""),
        help="kubeconfig to use (default: $KUBECONFIG, else ~/.kube/config, else in-cluster)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    desc = sub.add_parser("describe", help="describe pvc NAME: the chain, timeline, waits and events")
    desc.add_argument("kind", choices=["pvc", "persistentvolumeclaim"])
    desc.add_argument("name")
    desc.add_argument("-n", "--namespace", default="default")
    desc.add_argument("-o", "--output", choices=["text", "json"], default="text")
    desc.add_argument("-w", "--watch", action="store_true", help="print again whenever the story changes")
    desc.add_argument("--interval", type=float, default=2.0, help="seconds between reads with --watch")
    get = sub.add_parser("get", help="get volumes: one line per PersistentVolume")
    get.add_argument("kind", choices=["volumes", "volume", "pv", "pvs"])
    get.add_argument("-o", "--output", choices=["text", "json"], default="text")
    mv = sub.add_parser(
        "move",
        help="move pvc NAME --to NODE: copy an unused node-local volume to another node and serve it there",
        description="Moves the node-local volume of a claim no pod uses to another node: that node's plugin "
        "copies it from the one that holds it, the PersistentVolume's node affinity is switched to it, and "
        "the old copy is deleted. Needs the MutablePVNodeAffinity feature gate on kube-apiserver. The node "
        "plugins carry the move out: stopping this command stops only the following of it.",
    )
    mv.add_argument("kind", choices=["pvc", "persistentvolumeclaim"])
    mv.add_argument("name")
    mv.add_argument("-n", "--namespace", default="default")
    mv.add_argument("--to", dest="target", help="the node to move the volume to")
    mv.add_argument(
        "--timeout", type=duration, default=600.0, help="how long to follow the move (default: 10m)"
    )
    mv.add_argument(
        "--cancel", action="store_true", help="abandon the claim's move, if it has not switched yet"
    )
    dr = sub.add_parser(
        "drain",
        help="drain NODE: move every node-local volume off a cordoned node",
        description="Moves every node-local volume off a cordoned node to Ready nodes with room (the "
        "CSIStorageCapacity of each volume's class), and says which it cannot move and why (a claim still "
        "used by a pod that is not being evicted, no node with room, a released volume).",
    )
    dr.add_argument("node")
    dr.add_argument(
        "--timeout", type=duration, default=1800.0, help="how long to follow the moves (default: 30m)"
    )
    return parser


def _kubeconfig(path: str) -> str:
    if path:
        return path
    home = os.path.expanduser("~/.kube/config")
    return home if os.path.exists(home) else ""


async def _describe(api: ApiClient, args: argparse.Namespace) -> int:
    last = ""
    while True:
        snap = await take(api, args.namespace, args.name)
        report = diagnose(snap)
        report.retries = await retries.gather(api, _kubeconfig(args.kubeconfig), chain_keys(snap))
        if args.output == "json":
            text = json.dumps(report.to_json(snap.now), indent=2) + "\n"
        else:
            text = describe(report, snap.now)
        # --watch prints when the story changed, not when only the clock moved.
        story = json.dumps(
            {**report.to_json(snap.now), "steps": [vars(s) for s in report.steps]}, sort_keys=True
        )
        if story != last:
            if last and args.output == "text":
                sys.stdout.write(f"--- {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}\n")
            sys.stdout.write(text)
            sys.stdout.flush()
            last = story
        if not args.watch:
            return 0
        await asyncio.sleep(args.interval)


async def _move(api: ApiClient, args: argparse.Namespace) -> int:
    try:
        if args.command == "drain":
            return await moves.drain(api, args.node, args.timeout)
        if not args.cancel and not args.target:
            print("error: --to NODE is required (or --cancel)", file=sys.stderr)
            return 2
        return await moves.move(api, args.namespace, args.name, args.target, args.timeout, args.cancel)
    except moves.Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    api = await ApiClient.from_kubeconfig(
        _kubeconfig(args.kubeconfig), qps=50, burst=100, user_agent="kubectl-kubeloop"
    )
    try:
        if args.command == "describe":
            return await _describe(api, args)
        if args.command in ("move", "drain"):
            return await _move(api, args)
        rows = await volumes.rows(api)
        if args.output == "json":
            sys.stdout.write(json.dumps([vars(r) for r in rows], indent=2) + "\n")
        else:
            sys.stdout.write(volumes.table(rows))
        return 0
    except ApiError as e:
        if e.not_found and args.command == "describe":
            # kubectl's words for a claim that is not there.
            missing = f'persistentvolumeclaims "{args.name}" not found'
            print(f"Error from server (NotFound): {missing}", file=sys.stderr)
        else:
            print(f"error: {e.message}", file=sys.stderr)
        return 1
    finally:
        await api.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        sys.exit(asyncio.run(_run(args)))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
