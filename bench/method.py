"""The method every side-by-side benchmark shares (issue 16): kubeloop and the Go component run
alternately in one invocation (round r runs kubeloop, then Go), each figure is reported as the
median, min and max per side and of the per-round ratio, and the machine's noise is recorded by a
fixed CPU-bound calibration loop timed before and after the run.

A benchmark supplies what one side does in one round (its existing measurement code, returning a
dataclass of figures) and the list of figures to report; `run` does the rest and writes
bench/results/<name>.json, which `python -m bench.report` turns into the generated tables of
docs/benchmarks.md.

The ratio of a figure is always oriented so that above 1 means kubeloop is better: Go / kubeloop for
figures where lower is better (seconds, MiB, CPU), kubeloop / Go where higher is better (per
second). It is computed per round pair, so a slow moment of the machine that hits both sides of one
round cancels out, then summarised like the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .common import RESULTS_DIR, compile_sources, print_table, stamped
from .report import text_rows

SIDES = ("kubeloop", "go")
DEFAULT_ROUNDS = 5
# Iterations of the calibration loop: about 1.4 s of one core (CPython 3.11, the development VM).
CALIBRATION_ITERATIONS = 12_000_000
CALIBRATION_REPEATS = 3


@dataclass(frozen=True)
class Figure:
    """One reported figure: `key` is the field of a side's per-round record."""

    key: str
    label: str
    better: Literal["lower", "higher"] = "lower"


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float


def spread(values: Sequence[float]) -> Spread | None:
    """Median, min and max of a sample; None for an empty one."""
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values))


def pair_ratio(kubeloop: float, go: float, better: Literal["lower", "higher"]) -> float | None:
    """One round's ratio, above 1 when kubeloop is better; None when it is undefined (a zero)."""
    num, den = (go, kubeloop) if better == "lower" else (kubeloop, go)
    if num <= 0 or den <= 0:
        return None
    return num / den


def summarise(
    figures: Sequence[Figure], pairs: Sequence[Mapping[str, Mapping[str, Any]]]
) -> list[dict[str, Any]]:
    """Per figure: every round's values per side, their spreads and the spread of the per-pair
    ratios. `pairs[r][side]` is side's record of round r (a dict of figures)."""
    out = []
    for fig in figures:
        values = {side: [float(p[side][fig.key]) for p in pairs] for side in SIDES}
        ratios = [
            r
            for p in pairs
            if (r := pair_ratio(float(p["kubeloop"][fig.key]), float(p["go"][fig.key]), fig.better))
            is not None
        ]
        out.append(
            {
                "key": fig.key,
                "label": fig.label,
                "better": fig.better,
                "ratio_is": "go/kubeloop" if fig.better == "lower" else "kubeloop/go",
                "values": values,
                **{side: _as_dict(spread(values[side])) for side in SIDES},
                "ratio": _as_dict(spread(ratios)),
                "ratios": ratios,
            }
        )
    return out


def _as_dict(s: Spread | None) -> dict[str, float] | None:
    return dataclasses.asdict(s) if s is not None else None


def calibration_loop(iterations: int = CALIBRATION_ITERATIONS) -> float:
    """Seconds one core takes for a fixed pure-Python loop: the same work every run, so its time
    shows how much of a core the machine gave the benchmark at that moment."""
    start = time.perf_counter()
    acc = 0
    for i in range(iterations):
        acc = (acc + i * i) % 1_000_003
    elapsed = time.perf_counter() - start
    assert acc >= 0
    return elapsed


def calibrate(repeats: int = CALIBRATION_REPEATS) -> list[float]:
    return [round(calibration_loop(), 4) for _ in range(repeats)]


def calibration_summary(before: Sequence[float], after: Sequence[float]) -> dict[str, Any]:
    """The loop's times before and after the run; `drift` is after / before (medians), where 1.0
    means the machine was as quiet at the end as at the start."""
    b, a = spread(before), spread(after)
    assert b is not None and a is not None
    return {
        "iterations": CALIBRATION_ITERATIONS,
        "before_s": list(before),
        "after_s": list(after),
        "before": dataclasses.asdict(b),
        "after": dataclasses.asdict(a),
        "drift": round(a.median / b.median, 3),
    }


Record = dict[str, Any]
Pair = dict[str, Record]


async def alternate(
    rounds: int, one: Callable[[str, int], Awaitable[Any]], what: str = "", flip: bool = False
) -> list[Pair]:
    """`rounds` rounds of kubeloop then Go; `one(side, round)` measures one side once and returns
    a dataclass (or dict) of its figures. With `flip`, odd rounds run Go first: where one side's
    run leaves work behind for the next (a disk still flushing the writes), each side then follows
    the other equally often."""
    pairs: list[Pair] = []
    for r in range(rounds):
        pair: Pair = {}
        for side in SIDES[::-1] if flip and r % 2 else SIDES:
            print(f"{what}round {r + 1}/{rounds}: {side} ...", flush=True)
            rec = await one(side, r)
            is_record = dataclasses.is_dataclass(rec) and not isinstance(rec, type)
            pair[side] = dataclasses.asdict(rec) if is_record else dict(rec)
        pairs.append(pair)
    return pairs


async def alternate_scenarios(
    scenarios: Mapping[str, str], rounds: int, one: Callable[[str, str, int], Awaitable[Any]]
) -> dict[str, list[Pair]]:
    """`alternate` for each scenario in turn (name -> its label in the table);
    `one(scenario, side, round)` measures one side once."""
    return {
        label: await alternate(rounds, functools.partial(one, name), f"{name}: ")
        for name, label in scenarios.items()
    }


def qps_labels(names: str, scenarios: Mapping[str, tuple[float, int]]) -> dict[str, str]:
    """Comma-separated scenario names -> their table labels with the client QPS/burst."""
    return {s: f"{s} (QPS {scenarios[s][0]:g}/{scenarios[s][1]})" for s in names.split(",")}


@dataclass
class Bench:
    """A side-by-side benchmark: its results name, the table title, the labels of its two sides
    and the figures it reports."""

    name: str
    title: str
    sides: dict[str, str]
    figures: tuple[Figure, ...]


def add_rounds_arg(parser: argparse.ArgumentParser, default: int = DEFAULT_ROUNDS) -> None:
    parser.add_argument(
        "--rounds",
        type=int,
        default=default,
        help=f"rounds, each running kubeloop then Go once (default: {default})",
    )


async def _until_terminated(
    collect: Callable[[], Coroutine[Any, Any, dict[str, list[Pair]]]],
) -> dict[str, list[Pair]]:
    """Runs `collect`; a SIGTERM cancels it, so its clean-up (processes, mounts, loop devices, a
    control plane) runs as after an error instead of dying with the process. Only the first one
    cancels: a second must not cut that clean-up short."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        if not terminated:
            terminated = True
            task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        groups = await collect()
    except asyncio.CancelledError:
        if not terminated:
            raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    if terminated:  # also when a clean-up swallowed the cancellation and the run went on
        raise SystemExit(128 + signal.SIGTERM)
    return groups


def run(
    bench: Bench,
    params: dict[str, Any],
    collect: Callable[[], Coroutine[Any, Any, dict[str, list[Pair]]]],
) -> Path:
    """Calibrates, runs `collect` (scenario name -> its round pairs, from `alternate`), calibrates
    again, prints the table and writes bench/results/<name>.json."""
    compile_sources()
    print("calibrating (before) ...", flush=True)
    before = calibrate()
    started = time.monotonic()
    groups = asyncio.run(_until_terminated(collect))
    duration = time.monotonic() - started
    print("calibrating (after) ...", flush=True)
    after = calibrate()
    doc = stamped(
        bench.name,
        {
            "method": 1,
            "title": bench.title,
            "sides": bench.sides,
            "params": params,
            "rounds": max((len(p) for p in groups.values()), default=0),
            "duration_s": round(duration, 1),
            "calibration": calibration_summary(before, after),
            "scenarios": {
                name: {"figures": summarise(bench.figures, pairs), "records": pairs}
                for name, pairs in groups.items()
            },
        },
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{bench.name}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    for title, header, rows in text_rows(doc):
        print_table(title, header, rows)
    print(f"\nresults: {path}")
    return path


def claims_figures(rate_key: str, rate_label: str) -> tuple[Figure, ...]:
    """The figures of a sidecar benchmark over N claims (bench.provisioning, bench.expansion)."""
    return (
        Figure("total_s", "total s"),
        Figure(rate_key, rate_label, "higher"),
        Figure("latency_p50_s", "latency p50 s"),
        Figure("latency_p99_s", "latency p99 s"),
        Figure("peak_rss_mib", "peak RSS MiB"),
        Figure("cpu_s", "CPU s"),
        Figure("failed", "failed claims"),
    )


def claims_main(
    bench: Bench,
    description: str,
    scenarios: Mapping[str, tuple[float, int]],
    claims: int,
    run_one: Callable[[str, str, int], Awaitable[Any]],
) -> None:
    """The command line of a sidecar benchmark over N claims: `--claims`, `--scenarios` (names of
    `scenarios`, each a client QPS/burst), `--rounds`; `run_one(scenario, side, claims)` measures
    one side once."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{bench.name}", description=description)
    parser.add_argument("--claims", type=int, default=claims, help=f"claims per run (default: {claims})")
    parser.add_argument("--scenarios", default=",".join(scenarios), help="comma-separated (default: all)")
    add_rounds_arg(parser)
    args = parser.parse_args()

    async def one(scenario: str, side: str, _round: int) -> Any:
        return await run_one(scenario, side, args.claims)

    async def collect() -> dict[str, list[Pair]]:
        return await alternate_scenarios(qps_labels(args.scenarios, scenarios), args.rounds, one)

    run(bench, {"claims": args.claims}, collect)
