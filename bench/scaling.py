"""bench/scaling: how the side-by-side figures move with size (issue 16). Runs the existing
benchmarks' own per-side measurements (bench.binding, bench.provisioning, bench.attach) at several
sizes, kubeloop and Go alternating at each point (bench/method.py):

    python -m bench.scaling [--points binding:100,provisioning:100,attach:100] [--rounds 1]

The default points are binding and provisioning at 100, 1,000 and 5,000 objects, unthrottled
(binding QPS 5000/10000, provisioning QPS 1000/2000, the benchmarks' own `unthrottled` scenarios),
and attach at 100, 500 and 1,000 pods over 2 nodes at QPS 50/100. Per side and point, in common
terms:

- throughput: binds/s (binding), claims/s (provisioning), pods/s (attach: pods over the time from
  the first creation until the last pod was Running);
- latency p50/p99: per claim from the controller's start to Bound (binding's "done"), from the
  claim's creation to Bound (provisioning), from the pod's creation to Running (attach's mount);
- peak RSS: of the process under test (binding: the controller; provisioning: the sidecar) or the
  sum of the side's two controllers (attach; the record keeps each one's);
- wall s: the side's whole measurement, set-up included, so the cost of a point is known before
  choosing which large points to run.

Each record also keeps the benchmark's own figures. Attach sets up its shared stack once per point
(N volumes, formatted by an unmeasured pass); that set-up time is recorded as `setup_s`. Writes
bench/results/scaling.json, which `python -m bench.report` renders with the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from controller_runtime.toolchain import REPO_ROOT
from services.pv_controller.controller import Options

from . import attach, binding, method, provisioning

BENCHES = ("binding", "provisioning", "attach")
DEFAULT_POINTS = (
    "binding:100,binding:1000,binding:5000,"
    "provisioning:100,provisioning:1000,provisioning:5000,"
    "attach:100,attach:500,attach:1000"
)
ATTACH_QPS, ATTACH_BURST = 50.0, 100
UNTHROTTLED = "unthrottled"


@dataclass(frozen=True)
class Point:
    bench: str
    size: int

    @property
    def label(self) -> str:
        load = f"QPS {ATTACH_QPS:g}/{ATTACH_BURST}" if self.bench == "attach" else UNTHROTTLED
        unit = {"binding": "pairs", "provisioning": "claims", "attach": "pods"}[self.bench]
        return f"{self.bench} {self.size:,} {unit} ({load})"


def parse_points(text: str) -> list[Point]:
    """`bench:size,...` -> points, in the order given; an unknown benchmark or a size below 1 is an
    error."""
    points = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = item.partition(":")
        if not sep or name not in BENCHES or not size.isdigit() or int(size) < 1:
            raise ValueError(f"not a point (bench:size, bench one of {', '.join(BENCHES)}): {item!r}")
        points.append(Point(name, int(size)))
    if not points:
        raise ValueError("no points")
    return points


@dataclass
class Scaled:
    """One side's run at one point, in the terms common to all three benchmarks."""

    size: int
    throughput_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    peak_rss_mib: float
    wall_s: float
    peak_rss_by_process: dict[str, float]
    source: dict[str, Any]  # the benchmark's own record


def from_binding(run: binding.Run, wall_s: float) -> Scaled:
    return Scaled(
        size=run.pairs,
        throughput_per_s=run.binds_per_s,
        latency_p50_s=run.completion_p50_s,
        latency_p99_s=run.completion_p99_s,
        peak_rss_mib=run.peak_rss_mb,
        wall_s=round(wall_s, 1),
        peak_rss_by_process={"controller": run.peak_rss_mb},
        source=dataclasses.asdict(run),
    )


def from_provisioning(run: provisioning.Run, wall_s: float) -> Scaled:
    return Scaled(
        size=run.claims,
        throughput_per_s=run.claims_per_s,
        latency_p50_s=run.latency_p50_s,
        latency_p99_s=run.latency_p99_s,
        peak_rss_mib=run.peak_rss_mib,
        wall_s=round(wall_s, 1),
        peak_rss_by_process={"provisioner": run.peak_rss_mib},
        source=dataclasses.asdict(run),
    )


def from_attach(run: attach.Pass, wall_s: float, setup_s: float) -> Scaled:
    return Scaled(
        size=run.pods,
        throughput_per_s=round(run.pods / run.mount_total_s, 2) if run.mount_total_s > 0 else 0.0,
        latency_p50_s=run.mount_p50_s,
        latency_p99_s=run.mount_p99_s,
        peak_rss_mib=round(sum(run.peak_rss_mib.values()), 1),
        wall_s=round(wall_s, 1),
        peak_rss_by_process=dict(run.peak_rss_mib),
        source={**dataclasses.asdict(run), "setup_s": round(setup_s, 1)},
    )


FIGURES = (
    method.Figure("throughput_per_s", "throughput /s", "higher"),
    method.Figure("latency_p50_s", "latency p50 s"),
    method.Figure("latency_p99_s", "latency p99 s"),
    method.Figure("peak_rss_mib", "peak RSS MiB"),
    method.Figure("wall_s", "wall s"),
)

BENCH = method.Bench(
    name="scaling",
    title="binding, provisioning and attach at several sizes",
    sides={"kubeloop": "kubeloop", "go": "Go"},
    figures=FIGURES,
)


def binding_timeout(pairs: int) -> float:
    """Generous for either side: kcm bound 1,000 unthrottled pairs in 37 s on the development VM."""
    return 120 + 0.2 * pairs


def attach_timeout(pods: int) -> float:
    return max(600.0, 2.0 * pods)


async def timed(make: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    started = time.monotonic()
    out = await make()
    return out, time.monotonic() - started


async def run_point(point: Point, rounds: int) -> list[method.Pair]:
    logs = REPO_ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    what = f"{point.label}: "
    n = point.size
    if point.bench == "binding":

        async def one_binding(side: str, _r: int) -> Scaled:
            run, wall = await timed(
                lambda: binding.run_one(
                    UNTHROTTLED,
                    side,
                    n,
                    Options.workers,
                    binding_timeout(n),
                    logs,
                    logs_prefix=f"scaling-{n}",
                )
            )
            return from_binding(run, wall)

        return await method.alternate(rounds, one_binding, what)
    if point.bench == "provisioning":

        async def one_provisioning(side: str, _r: int) -> Scaled:
            run, wall = await timed(lambda: provisioning.run_one(UNTHROTTLED, side, n))
            return from_provisioning(run, wall)

        return await method.alternate(rounds, one_provisioning, what)
    started = time.monotonic()
    timeout = attach_timeout(n)
    async with attach.session(n, ATTACH_QPS, ATTACH_BURST, timeout) as ses:
        setup = time.monotonic() - started
        sides = attach.side_components(ses, ATTACH_QPS, ATTACH_BURST)

        async def one_attach(side: str, r: int) -> Scaled:
            run, wall = await timed(
                lambda: attach.run_side(
                    ses.stack, sides[side], ses.clock, ses.volumes, f"s{r}-{side}", timeout
                )
            )
            return from_attach(run, wall, setup)

        return await method.alternate(rounds, one_attach, what)


async def collect(points: Sequence[Point], rounds: int) -> dict[str, list[method.Pair]]:
    out: dict[str, list[method.Pair]] = {}
    for point in points:
        started = time.monotonic()
        out[point.label] = await run_point(point, rounds)
        print(f"{point.label}: done in {time.monotonic() - started:.0f} s", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--points",
        default=DEFAULT_POINTS,
        help="comma-separated bench:size (bench: binding, provisioning, attach; default: all nine)",
    )
    method.add_rounds_arg(parser, default=1)
    parser.add_argument("--output", default=BENCH.name, help="results name: bench/results/NAME.json")
    args = parser.parse_args(argv)
    try:
        points = parse_points(args.points)
    except ValueError as exc:
        parser.error(str(exc))
    params = {"points": " ".join(f"{p.bench}:{p.size}" for p in points)}
    method.run(dataclasses.replace(BENCH, name=args.output), params, lambda: collect(points, args.rounds))


if __name__ == "__main__":
    main()
