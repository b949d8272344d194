"""`python -m driver_bench.main campaign --recipe R --out DIR`, `... stack-campaign --recipe R --out
DIR` and `... replay FILE` (docs/driver-bench.md).

campaign and stack-campaign exit 0 when no scenario found anything, 1 when one did (the report and
reproducers say what), 2 when the recipe (for stack-campaign: the stack) cannot be used. replay
exits 1 when the finding reproduces (the driver still has the bug), 0 when it does not, 2 when the
recipe cannot be used."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from controller_runtime.toolchain import MissingBinaryError
from localstack.pools import NODE_LOCAL, POOL_MODES, SHARED

from . import campaign, stack_campaign
from .diagnosis import headline
from .faults import STEPS, FaultKind, parse_kinds
from .recipe import RecipeError, load
from .reproducer import replay
from .stack_campaign import STACK_KINDS, STACK_STEPS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="driver_bench", description=__doc__.splitlines()[0] if __doc__ else "")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("campaign", help="the lifecycle under every fault, against a driver run from a recipe")
    c.add_argument("--recipe", required=True, help="the driver's recipe (YAML)")
    c.add_argument("--out", required=True, help="where the report, reproducers and scenario directories go")
    c.add_argument("--concurrency", type=int, default=1, help="lifecycles at once in each scenario")
    c.add_argument("--parallel", type=int, default=1, help="scenarios at once, each its own driver")
    c.add_argument("--faults", default="all", help="fault kinds, comma-separated, or all")
    c.add_argument("--steps", default=",".join(STEPS), help="the lifecycle steps to inject at")
    c.add_argument(
        "--timeout-seconds", type=float, default=0.1, help="the caller's deadline in a timeout fault"
    )
    s = sub.add_parser(
        "stack-campaign",
        help="a claim and two pods under each fault through the whole local stack (make up DRIVER=)",
    )
    s.add_argument("--recipe", required=True, help="the driver's recipe (YAML)")
    s.add_argument("--out", required=True, help="where the report, reproducers and stack logs go")
    s.add_argument("--faults", default=",".join(k.value for k in STACK_KINDS), help="fault kinds, or all")
    s.add_argument("--steps", default=",".join(STACK_STEPS), help="the steps to inject at")
    s.add_argument(
        "--timeout-seconds", type=float, default=0.1, help="the caller's deadline in a timeout fault"
    )
    s.add_argument(
        "--sidecars",
        choices=stack_campaign.SIDECARS,
        default="compare",
        help="whose external-provisioner, -attacher and -resizer make the calls: kubeloop's, upstream's "
        "Go ones, or compare (default): kubeloop's, and each scenario that finds something again with "
        "the Go ones, to tell the driver's bugs from kubeloop's sidecars'",
    )
    s.add_argument(
        "--nodes",
        type=int,
        default=2,
        help="simulated nodes; with two or more the claim is read back on another node (default: 2)",
    )
    s.add_argument(
        "--pools",
        choices=POOL_MODES,
        default=SHARED,
        help=f"the stack's pool mode (as make up POOLS=): {NODE_LOCAL} runs one instance of the recipe's "
        "one command per node, each on its own backend, and reads the claim back on its node "
        f"(default: {SHARED})",
    )
    r = sub.add_parser("replay", help="a reproducer against the driver alone")
    r.add_argument("file")
    r.add_argument("--work", default="", help="the replay's directory (default: a new temporary one)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "campaign":
            return _campaign(args)
        if args.command == "stack-campaign":
            return _stack_campaign(args)
        return _replay(args)
    except RecipeError as e:
        print(f"driver_bench: {e}", file=sys.stderr)
        return 2


def _sweep(args: argparse.Namespace) -> tuple[tuple[FaultKind, ...], tuple[str, ...]]:
    """--faults and --steps, checked."""
    steps = tuple(s for s in args.steps.split(",") if s)
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise SystemExit(f"driver_bench: unknown steps {unknown} (known: {', '.join(STEPS)})")
    try:
        return tuple(parse_kinds(args.faults)), steps
    except ValueError as e:
        raise SystemExit(f"driver_bench: {e}") from None


def _campaign(args: argparse.Namespace) -> int:
    kinds, steps = _sweep(args)
    options = campaign.Options(
        out=Path(args.out).resolve(),
        concurrency=args.concurrency,
        kinds=kinds,
        steps=steps,
        parallel=args.parallel,
        timeout_seconds=args.timeout_seconds,
    )
    outcome = asyncio.run(campaign.run(load(args.recipe), options))
    print(outcome.report_md.read_text())
    print(f"report: {outcome.report_md} and {outcome.report_json}")
    return 1 if outcome.findings else 0


def _stack_campaign(args: argparse.Namespace) -> int:
    kinds, steps = _sweep(args)
    unreached = [s for s in steps if s not in stack_campaign.REACHED]
    if unreached:
        known = ", ".join(stack_campaign.REACHED)
        raise SystemExit(f"driver_bench: the stack scenario never calls {unreached} (it calls {known})")
    if args.nodes < 1:
        raise SystemExit("driver_bench: --nodes must be at least 1")
    options = stack_campaign.StackOptions(
        out=Path(args.out).resolve(),
        kinds=kinds,
        steps=steps,
        timeout_seconds=args.timeout_seconds,
        nodes=args.nodes,
        sidecars=args.sidecars,
        pools=args.pools,
    )
    try:
        outcome = asyncio.run(stack_campaign.run(load(args.recipe), options))
    except (stack_campaign.StackError, MissingBinaryError) as e:
        print(f"driver_bench: {e}", file=sys.stderr)
        return 2
    print(outcome.report_md.read_text())
    print(f"report: {outcome.report_md} and {outcome.report_json}")
    return 1 if outcome.findings else 0


def _replay(args: argparse.Namespace) -> int:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="driver-bench-replay-"))
    result = asyncio.run(replay(Path(args.file), work))
    for f in result.findings:
        print(f"{headline(result.fault, f)} ({f.kind}): {f.summary}")
    recorded = ", ".join(f.kind for f in result.recorded)
    verdict = "reproduced" if result.reproduced else "not reproduced"
    print(f"{verdict} in {result.seconds:.1f} s (recorded: {recorded}); the replay's directory: {work}")
    return 1 if result.reproduced else 0


if __name__ == "__main__":
    sys.exit(main())
