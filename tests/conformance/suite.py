"""The conformance suite: every scenario in go mode, then in kubeloop mode, then compared.

    python -m tests.conformance.suite [--subset] [-k SUBSTRING] [--parallel N] [--renormalise]

Prints one line per scenario, then "N scenarios, N identical, N differ", and writes the report with
every diff to .kubeloop/conformance/report.json, and what each mode recorded to raw-<mode>.json
(`--renormalise` compares those again without running anything: for work on the normaliser).
`make conformance` runs the whole set; pytest runs the subset (tests/conformance/test_conformance.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .compare import RawOutcome, Verdict, compare, normalise
from .model import Scenario
from .runner import MODES, WORK_DIR, run_mode
from .scenarios import ALL
from .surface import SurfaceMismatch, check_same_surface, load_surface, save_surface

REPORT = WORK_DIR / "report.json"


@dataclass
class Report:
    verdicts: list[Verdict]
    scenarios: dict[str, Scenario]
    documents: dict[str, dict[str, Any]]  # scenario -> mode -> normalised outcome
    seconds: dict[str, float] = field(default_factory=dict)

    def counts(self) -> tuple[int, int, int, int]:
        n = len(self.verdicts)
        same = sum(v.status == "identical" for v in self.verdicts)
        expected = sum(v.status == "expected-difference" for v in self.verdicts)
        return n, same, n - same, expected

    def summary(self) -> str:
        n, same, differ, expected = self.counts()
        line = f"{n} scenarios, {same} identical, {differ} differ"
        return line + (f" ({expected} of them expected, documented differences)" if expected else "")

    def write(self, path: Path = REPORT) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        n, same, differ, expected = self.counts()
        doc = {
            "summary": {
                "scenarios": n,
                "identical": same,
                "differ": differ,
                "expected_differences": expected,
            },
            "seconds": self.seconds,
            "scenarios": [
                {
                    **asdict(v),
                    "source": self.scenarios[v.scenario].source,
                    "outcomes": self.documents[v.scenario],
                }
                for v in self.verdicts
            ],
        }
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path


def select(subset: bool, pattern: str = "") -> list[tuple[int, Scenario]]:
    """Scenarios with their index in ALL (the index names their namespace in every run)."""
    return [
        (i, s) for i, s in enumerate(ALL) if (s.subset or not subset) and (not pattern or pattern in s.name)
    ]


async def run_suite(chosen: list[tuple[int, Scenario]], parallel: int = 8, verbose: bool = True) -> Report:
    raw = {}
    surfaces = {}
    seconds: dict[str, float] = {}

    def done(mode: str, scn: Scenario, took: float) -> None:
        if verbose:
            print(f"  [{mode}] {scn.name} ({took:.1f}s)", flush=True)

    for mode in MODES:
        t0 = time.monotonic()
        if verbose:
            print(f"== {mode} mode: {len(chosen)} scenarios", flush=True)
        run = await run_mode(mode, chosen, parallel, done)
        raw[mode], surfaces[mode] = run.outcomes, run.surface
        seconds[f"{mode}_startup"] = round(run.startup, 1)
        seconds[mode] = round(time.monotonic() - t0, 1)
        save_raw(mode, raw[mode])
        save_surface(WORK_DIR, mode, run.surface)
    seconds["total"] = round(sum(seconds[m] for m in MODES), 1)
    check_same_surface(surfaces)
    return judge(chosen, raw, seconds)


def raw_path(mode: str) -> Path:
    return WORK_DIR / f"raw-{mode}.json"


def save_raw(mode: str, outcomes: dict[str, RawOutcome]) -> None:
    raw_path(mode).parent.mkdir(parents=True, exist_ok=True)
    raw_path(mode).write_text(json.dumps({k: asdict(v) for k, v in outcomes.items()}))


def load_raw(mode: str) -> dict[str, RawOutcome]:
    return {k: RawOutcome(**v) for k, v in json.loads(raw_path(mode).read_text()).items()}


def judge(
    chosen: list[tuple[int, Scenario]], raw: dict[str, dict[str, RawOutcome]], seconds: dict[str, float]
) -> Report:
    verdicts = []
    documents: dict[str, dict[str, Any]] = {}
    for _, scn in chosen:
        docs = {mode: normalise(raw[mode][scn.name]) for mode in MODES}
        documents[scn.name] = docs
        verdicts.append(compare(scn.name, docs["go"], docs["kubeloop"], scn.expected))
    return Report(verdicts, {s.name: s for _, s in chosen}, documents, seconds)


def print_report(report: Report) -> None:
    for v in report.verdicts:
        print(f"{v.status:20} {v.scenario}")
    for v in report.verdicts:
        if v.status != "identical":
            note = f" (expected: {v.expected_reason})" if v.expected_reason else ""
            print(f"\n---- {v.scenario}: {v.status}{note}\n{v.diff}")
    print(f"\n{report.summary()}  [{report.seconds.get('total', 0):.0f}s]")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.conformance.suite", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--subset", action="store_true", help="only the scenarios `make test` runs")
    parser.add_argument("-k", dest="pattern", default="", help="only scenarios whose name contains this")
    parser.add_argument("--parallel", type=int, default=8, help="scenarios at once per mode (default: 8)")
    parser.add_argument("--report", type=Path, default=REPORT, help=f"(default: {REPORT})")
    parser.add_argument(
        "--renormalise", action="store_true", help="compare the last run's raw outcomes again, run nothing"
    )
    args = parser.parse_args(argv)
    chosen = select(args.subset, args.pattern)
    if not chosen:
        sys.exit("no scenario selected")
    if args.renormalise:
        raw = {mode: load_raw(mode) for mode in MODES}
        try:
            check_same_surface({mode: load_surface(WORK_DIR, mode) for mode in MODES})
        except SurfaceMismatch as e:
            sys.exit(f"conformance: {e}")
        chosen = [(i, s) for i, s in chosen if all(s.name in raw[m] for m in MODES)]
        previous = json.loads(args.report.read_text()).get("seconds", {}) if args.report.exists() else {}
        report = judge(chosen, raw, previous)
    else:
        try:
            report = asyncio.run(run_suite(chosen, args.parallel))
        except SurfaceMismatch as e:
            sys.exit(f"conformance: {e}")
    print_report(report)
    print(f"report: {report.write(args.report)}")
    _n, _same, differ, expected = report.counts()
    sys.exit(0 if differ == expected else 1)


if __name__ == "__main__":
    main()
