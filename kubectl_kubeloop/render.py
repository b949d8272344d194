"""`kubectl kubeloop describe pvc` as text: the chain, the timeline, who waits for what, the events."""

from __future__ import annotations

import datetime as dt

from .diagnose import Report
from .snapshot import event_time


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return "<1s"  # the API keeps times to the second
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def describe(report: Report, now: dt.datetime) -> str:
    lines = [f"Claim:   {report.claim}", f"Phase:   {report.phase}"]
    lines.append("Status:  " + ("STUCK" if report.waiting else "ok"))
    lines.append("")
    lines.append("Chain:")
    for link in report.chain:
        lines.append(f"  {link.kind}/{link.name}: {link.state}")
        lines.extend(f"      {d}" for d in link.details)
    lines.append("")
    lines.append("Timeline:")
    if not report.steps:
        lines.append("  (nothing has happened yet)")
    for step in report.steps:
        took = _duration(step.seconds(now))
        state = "done" if step.ended else ("waiting" if step.started else "not started")
        lines.append(f"  {step.name:<10} {step.subject:<48} {took:>9}  {state}  {step.started or ''}")
    if report.waiting:
        lines.append("")
        lines.append("Waiting:")
        for w in report.waiting:
            lines.append(f"  {w.component}: {w.reason}")
    if report.control_plane:
        lines.append("")
        lines.append("Control plane:")
        for c in report.control_plane:
            lines.append(f"  {c.component}: {c.reason}")
    if report.retries:
        lines.append("")
        lines.append("Retrying:")
        for r in report.retries:
            upcoming = _duration(r.next_retry_in)
            where = f"{r.component} ({r.queue}) {r.key}"
            lines.append(f"  {where}: attempt {r.retries}, next in {upcoming}: {r.error}")
    lines.append("")
    lines.append("Events:")
    if not report.events:
        lines.append("  <none>")
    for e in report.events:
        obj = e["involvedObject"]
        count = f" (x{e['count']})" if (e.get("count") or 1) > 1 else ""
        source = (e.get("source") or {}).get("component") or e.get("reportingComponent") or ""
        lines.append(
            f"  {event_time(e)}  {e.get('type', ''):<7} {e.get('reason', ''):<24} "
            f"{obj.get('kind', '')}/{obj.get('name', '')}  [{source}]{count}: {e.get('message', '')}"
        )
    return "\n".join(lines) + "\n"
