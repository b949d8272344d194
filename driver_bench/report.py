"""The campaign's report, as JSON (for tools) and markdown (for people): what ran, what failed,
each finding's reproducer, and the driver's time per CSI method (p50 and max, as the proxy timed
the forwarded calls)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import messages
from .diagnosis import headline
from .scenario import ScenarioResult


@dataclass(frozen=True)
class Timing:
    method: str
    count: int
    p50: float
    max: float


def timings(results: Sequence[ScenarioResult]) -> list[Timing]:
    by_method: dict[str, list[float]] = {}
    for r in results:
        for c in r.calls:
            if c.fault:
                continue  # an injected fault's time is the bench's, not the driver's
            by_method.setdefault(messages.short_name(c.method), []).append(c.seconds)
    return [Timing(m, len(s), statistics.median(s), max(s)) for m, s in sorted(by_method.items())]


def to_json(
    recipe: str, results: Sequence[ScenarioResult], settings: dict[str, Any], seconds: float
) -> dict[str, Any]:
    return {
        "recipe": recipe,
        "settings": settings,
        "seconds": round(seconds, 3),
        "scenarios": [
            {
                "name": r.name,
                "fault": r.fault.to_json() if r.fault else None,
                "fired": r.fired,
                "seconds": round(r.seconds, 3),
                "calls": len(r.calls),
                "findings": [
                    {
                        **f.to_json(),
                        "headline": headline(r.fault, f),
                        **({"bug_of": r.verdicts[f.kind]} if f.kind in r.verdicts else {}),
                    }
                    for f in r.findings
                ],
                "reproducer": str(r.reproducer) if r.reproducer else None,
            }
            for r in results
        ],
        "findings": sum(len(r.findings) for r in results),
        "timings": [
            {
                "method": t.method,
                "count": t.count,
                "p50_seconds": round(t.p50, 4),
                "max_seconds": round(t.max, 4),
            }
            for t in timings(results)
        ],
    }


def to_markdown(doc: dict[str, Any]) -> str:
    scenarios = doc["scenarios"]
    failed = [s for s in scenarios if s["findings"]]
    lines = [
        f"# Driver bench: {doc['recipe']}",
        "",
        f"{len(scenarios)} scenarios in {doc['seconds']:.1f} s, {len(failed)} with findings "
        f"({doc['findings']} findings). Settings: "
        + ", ".join(f"{k}={v}" for k, v in doc["settings"].items())
        + ".",
        "",
        "| scenario | fault | fired | calls | seconds | findings | reproducer |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in scenarios:
        fault = s["fault"]
        fault_text = f"{fault['kind']} {fault['method']}" if fault else "none (baseline)"
        kinds = ", ".join(f["kind"] for f in s["findings"]) or "-"
        lines.append(
            f"| {s['name']} | {fault_text} | {'yes' if s['fired'] or not fault else 'no'} | {s['calls']} "
            f"| {s['seconds']:.2f} | {kinds} | {s['reproducer'] or '-'} |"
        )
    if failed:
        lines += ["", "## Findings", ""]
        for s in failed:
            for f in s["findings"]:
                # The stack campaign's second opinion (the Go sidecars in kubeloop's place), if any.
                whose = f" Bug of: {f['bug_of']}." if "bug_of" in f else ""
                lines.append(f"- {s['name']}: **{f['headline']}** ({f['kind']}): {f['summary']}{whose}")
    lines += ["", "## Time per CSI method (the driver's, through the proxy)", ""]
    lines += ["| method | calls | p50 s | max s |", "|---|---|---|---|"]
    for t in doc["timings"]:
        lines.append(f"| {t['method']} | {t['count']} | {t['p50_seconds']:.4f} | {t['max_seconds']:.4f} |")
    return "\n".join(lines) + "\n"


def write(out: Path, doc: dict[str, Any]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "report.json", out / "report.md"
    j.write_text(json.dumps(doc, indent=1) + "\n")
    m.write_text(to_markdown(doc))
    return j, m
