"""The pure parts of the benchmark method (bench/method.py), its report (bench/report.py) and the
profile summary (bench/profile.py): spreads, per-round ratios, the generated table and section."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from bench import common, method, profile, report

FIGURES = (method.Figure("total_s", "total s"), method.Figure("rate", "per s", "higher"))


def pair(kubeloop: tuple[float, float], go: tuple[float, float]) -> method.Pair:
    return {
        "kubeloop": {"total_s": kubeloop[0], "rate": kubeloop[1]},
        "go": {"total_s": go[0], "rate": go[1]},
    }


def test_spread_is_median_min_max() -> None:
    assert method.spread([3.0, 1.0, 2.0]) == method.Spread(2.0, 1.0, 3.0)
    assert method.spread([4.0, 1.0, 2.0, 3.0]) == method.Spread(2.5, 1.0, 4.0)
    assert method.spread([]) is None


def test_ratio_is_above_one_when_kubeloop_is_better() -> None:
    assert method.pair_ratio(2.0, 4.0, "lower") == 2.0  # kubeloop took half Go's time
    assert method.pair_ratio(2.0, 4.0, "higher") == 0.5  # kubeloop did half Go's rate
    assert method.pair_ratio(0.0, 4.0, "lower") is None
    assert method.pair_ratio(1.0, 0.0, "higher") is None


def test_summarise_takes_ratios_per_round_pair_not_of_the_medians() -> None:
    # Round 2 is slow for both sides (a busy machine): its pair still says kubeloop is 2x faster.
    pairs = [pair((1.0, 10.0), (2.0, 5.0)), pair((10.0, 1.0), (20.0, 0.5)), pair((2.0, 5.0), (3.0, 5.0))]
    total, rate = method.summarise(FIGURES, pairs)
    assert total["kubeloop"] == {"median": 2.0, "min": 1.0, "max": 10.0}
    assert total["go"] == {"median": 3.0, "min": 2.0, "max": 20.0}
    assert total["ratio"] == {"median": 2.0, "min": 1.5, "max": 2.0}
    assert total["ratios"] == [2.0, 2.0, 1.5]
    assert total["ratio_is"] == "go/kubeloop"
    assert total["values"] == {"kubeloop": [1.0, 10.0, 2.0], "go": [2.0, 20.0, 3.0]}
    assert rate["ratio_is"] == "kubeloop/go"
    assert rate["ratio"] == {"median": 2.0, "min": 1.0, "max": 2.0}


def test_summarise_without_a_defined_ratio() -> None:
    (total, _) = method.summarise(FIGURES, [pair((0.0, 1.0), (0.0, 1.0))])
    assert total["ratio"] is None and total["ratios"] == []


def test_calibration_summary_and_loop() -> None:
    cal = method.calibration_summary([1.0, 1.2, 1.1], [1.3, 1.32, 1.4])
    assert cal["before"] == {"median": 1.1, "min": 1.0, "max": 1.2}
    assert cal["drift"] == pytest.approx(1.2, abs=0.001)
    assert method.calibration_loop(10_000) > 0


async def test_alternate_runs_kubeloop_then_go_each_round() -> None:
    calls: list[tuple[str, int]] = []

    async def one(side: str, r: int) -> dict[str, float]:
        calls.append((side, r))
        return {"total_s": float(r)}

    pairs = await method.alternate(3, one)
    assert calls == [("kubeloop", 0), ("go", 0), ("kubeloop", 1), ("go", 1), ("kubeloop", 2), ("go", 2)]
    assert pairs[2] == {"kubeloop": {"total_s": 2.0}, "go": {"total_s": 2.0}}


async def test_alternate_with_flip_runs_go_first_in_odd_rounds() -> None:
    calls: list[tuple[str, int]] = []

    async def one(side: str, r: int) -> dict[str, float]:
        calls.append((side, r))
        return {"total_s": float(r)}

    pairs = await method.alternate(3, one, flip=True)
    assert calls == [("kubeloop", 0), ("go", 0), ("go", 1), ("kubeloop", 1), ("kubeloop", 2), ("go", 2)]
    # The records of a pair are by side, whichever ran first.
    assert pairs[1]["kubeloop"] == pairs[1]["go"] == {"total_s": 1.0}


def sample_doc(name: str = "attach") -> dict[str, Any]:
    pairs = [pair((1.0, 10.0), (2.0, 5.0)), pair((2.0, 8.0), (3.0, 6.0))]
    return {
        "benchmark": name,
        "time": "2026-11-23T20:00:00Z",
        "machine": {"python": "3.11.7", "cpus": 2},
        "method": 1,
        "title": "a title",
        "sides": {"kubeloop": "kubeloop", "go": "kcm"},
        "params": {"pods": 10},
        "rounds": 2,
        "duration_s": 42.0,
        "calibration": method.calibration_summary([1.0, 1.1, 1.2], [1.2, 1.3, 1.4]),
        "scenarios": {"default": {"figures": method.summarise(FIGURES, pairs), "records": pairs}},
    }


def test_markdown_table_from_a_result() -> None:
    text = report.markdown(sample_doc())
    lines = text.splitlines()
    assert lines[0] == "### attach"
    heading = "attach: a title (pods 10; 2 rounds, kubeloop and Go alternating; 42 s; 2026-11-23, 2 CPUs)."
    assert heading in lines
    assert (
        "calibration loop (12,000,000 iterations, one core): before 1.10 s (1.00-1.20), "
        "after 1.30 s (1.20-1.40), after/before 1.18." in lines
    )
    assert (
        "| scenario | figure | kubeloop median (min-max) | kcm median (min-max) | ratio median (min-max) "
        "| ratio is |" in lines
    )
    rows = [line for line in lines if line.startswith("| default |")]
    assert rows == [
        "| default | total s | 1.50 (1.00-2.00) | 2.50 (2.00-3.00) | 1.75 (1.50-2.00) | Go/kubeloop |",
        "| default | per s | 9.00 (8.00-10.0) | 5.50 (5.00-6.00) | 1.67 (1.33-2.00) | kubeloop/Go |",
    ]


def test_section_orders_results_and_skips_old_ones() -> None:
    old = {"benchmark": "informer_sync", "runs": []}  # not written by the method
    body = report.section([sample_doc("attach"), old, sample_doc("binding")])
    assert body.index("### binding") < body.index("### attach")
    assert "informer_sync" not in body
    assert "No results yet" in report.section([old])


def test_replace_section_keeps_the_rest_of_the_document(tmp_path: Path) -> None:
    doc = f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold table\n{report.END}\n\n## hand-written\n"
    new = report.replace_section(doc, "new table\n")
    assert new == f"# Benchmarks\n\nintro\n\n{report.BEGIN}\n\nnew table\n\n{report.END}\n\n## hand-written\n"
    assert report.replace_section(new, "new table\n") == new
    with pytest.raises(ValueError):
        report.replace_section("no markers", "x")

    results = tmp_path / "results"
    results.mkdir()
    (results / "attach.json").write_text(json.dumps(sample_doc()))
    docs = tmp_path / "benchmarks.md"
    docs.write_text(doc)
    report.main(["--results", str(results), "--docs", str(docs)])
    written = docs.read_text()
    assert "old table" not in written and "### attach" in written and written.endswith("## hand-written\n")


def test_hot_spots_set_idle_stacks_apart() -> None:
    collapsed = [
        "main (services/x/main.py);run (services/x/agent.py);plan (services/x/plan.py) 6",
        "main (services/x/main.py);run (services/x/agent.py);write_atomic (controller_runtime/files.py);"
        "fsync (libc.so.6) 3",
        "_worker (concurrent/futures/thread.py);PyThread_acquire_lock_timed (libpython3.11.so.1.0) 30",
        "_worker (concurrent/futures/thread.py);_queue_SimpleQueue_get (_queuemodule.c.h);"
        "pthread_cond_timedwait (libc.so.6) 20",
        "Runner.run (asyncio/runners.py);epoll_wait (libc.so.6) 40",
        "Runner.run (asyncio/runners.py);read (ssl.py) 1",
    ]
    prof = profile.hot_spots(collapsed)
    assert (prof.samples, prof.busy) == (100, 10)
    assert [(s.frame, s.samples) for s in prof.leaf] == [
        ("plan (services/x/plan.py)", 6),
        ("fsync (libc.so.6)", 3),
        ("read (ssl.py)", 1),
    ]
    assert prof.python[1] == profile.HotSpot("write_atomic (controller_runtime/files.py)", 3, 0.3)
    # Our functions, inclusive, without the entry point main.py.
    assert [(s.frame, s.samples) for s in prof.ours] == [
        ("run (services/x/agent.py)", 9),
        ("plan (services/x/plan.py)", 6),
        ("write_atomic (controller_runtime/files.py)", 3),
    ]
    assert "10 busy of 100 samples" in profile.format_profile("p", (1.0, 0.5), prof)
    assert profile.hot_spots([]).busy == 0


async def test_wait_log_reads_only_what_the_process_wrote_since_its_start(tmp_path: Path) -> None:
    """The bench appends every run to one log per component: an earlier run's ready line must not
    count, the new one must, and a process that exits without it fails the wait."""
    import asyncio

    from bench.common import LogMark, wait_log

    log = tmp_path / "c.log"
    log.write_text("ready\n")  # an earlier run's
    mark = LogMark.here(log)
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", f"sleep 0.3; echo starting >> {log}; echo ready >> {log}"
    )
    waited = await wait_log(mark, "ready", proc, timeout=10)
    assert waited >= 0.2
    await proc.wait()

    mark = LogMark.here(log)
    proc = await asyncio.create_subprocess_exec("sh", "-c", f"echo starting >> {log}")
    await proc.wait()
    with pytest.raises(RuntimeError, match="exited before logging 'ready'"):
        await wait_log(mark, "ready", proc, timeout=10)
    assert LogMark.here(tmp_path / "absent.log").offset == 0


def test_cpu_use_counts_what_each_process_spent_inside_the_context() -> None:
    pids = {"self": os.getpid(), "gone": None}
    with common.CpuUse(lambda: pids) as use:
        deadline = time.process_time() + 0.05
        while time.process_time() < deadline:
            pass
    assert use.spent["self"] >= 0.04
    assert use.spent["gone"] == 0.0
    assert use.total(["self", "gone", "never-seen"]) == use.spent["self"]
