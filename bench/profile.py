"""bench/profile: where a pod's time goes from creation to mounted (and back to detached), on the
local stack with kubeloop's side of bench.attach: every kubeloop process (attach-detach controller,
external-attacher, the node agent and CSI node plugin of each node, the CSI controller plugin,
pv-controller) sampled by py-spy during one pass of N pods.

    python -m bench.profile [--pods 20] [--rate 100] [--out .kubeloop/profile]   (`make profile`)

As in bench.attach: N static volumes pre-bound to N claims, an unmeasured pass that formats them,
a one-pod warm-up; then py-spy attaches to every process and N pods are created (half per node),
waited for Running, deleted and waited for until their VolumeAttachments are gone. For each
process it writes <out>/<process>.txt, py-spy's collapsed stacks (one `frame;frame;... count` line
per stack: the input of flamegraph.pl, inferno or speedscope.app), and <out>/<process>.top.txt,
the hottest functions by own and by inclusive samples; and prints each process's CPU seconds
(its own and those of the commands it ran: mkfs, mount, losetup) and its hottest functions.
py-spy samples threads that are running, not those waiting, so percentages are shares of a
process's busy time. Needs root and py-spy (the bench extra of pyproject.toml).

    python -m bench.profile --provisioning 1000 [--rate 100] [--out .kubeloop/profile]

samples kubeloop's external-provisioner instead, over one unthrottled run of bench.provisioning's
kubeloop side (fresh control plane, driver and pv-controller; N claims created at once), from the
first claim's creation to the last one Bound, and reports the same way (provisioner.txt,
provisioner.top.txt; the other processes of the run are measured, not sampled).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.toolchain import REPO_ROOT
from localstack.storage_stack import ShortHomeComponents

from . import provisioning
from .attach import kubeloop_side, one_pass, session
from .common import percentile

TOP = 12
# A stack with one of these is waiting, not working: an executor thread with nothing to do blocks
# in its queue's get (a lock acquire or a condition wait), an idle event loop in epoll. py-spy's own
# idle detection misses most of them here (it counted idle executor threads and uvloop's wait as
# busy), so they are set apart. A condition wait anywhere else is a thread waiting for the GIL.
IDLE_FRAMES = frozenset(
    {"_queue_SimpleQueue_get", "PyThread_acquire_lock_timed", "epoll_wait", "epoll_pwait"}
)
# Our code, as py-spy names its files (paths relative to sys.path).
OURS = (
    "controller_runtime/",
    "services/",
    "csi_driver/",
    "external_attacher/",
    "external_provisioner/",
    "external_resizer/",
    "node_driver_registrar/",
)
# Entry points: on nearly every stack of a process, so they say nothing about where time goes.
ENTRY_FILES = ("/main.py", "controller_runtime/process.py", "controller_runtime/component.py")


@dataclass(frozen=True)
class HotSpot:
    frame: str
    samples: int
    share: float  # of the process's busy samples


@dataclass(frozen=True)
class Profile:
    samples: int
    busy: int  # samples not waiting (IDLE_FRAMES)
    leaf: list[HotSpot]  # the innermost frame, native or Python: where the thread was executing
    python: list[HotSpot]  # the innermost Python frame: which Python code it was doing it for
    ours: list[HotSpot]  # our functions, inclusive: counted once per stack they are on


def _location(frame: str) -> str:
    """`func (file.py)` -> `file.py`."""
    return frame.rpartition(" (")[2].rstrip(")")


def hot_spots(collapsed: Iterable[str], top: int = TOP) -> Profile:
    """The hottest frames of py-spy's collapsed stacks (`outer;...;inner count` per line) among the
    busy ones (no IDLE_FRAMES frame): by innermost frame, by innermost Python frame and, for our
    own functions but the entry points, inclusively."""
    leaf: Counter[str] = Counter()
    python: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = busy = 0
    for line in collapsed:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        if any(f.partition(" (")[0] in IDLE_FRAMES for f in frames):
            continue
        busy += count
        leaf[frames[-1]] += count
        py = [f for f in frames if _location(f).endswith(".py")]
        if py:
            python[py[-1]] += count
        for frame in {
            f for f in py if _location(f).startswith(OURS) and not _location(f).endswith(ENTRY_FILES)
        }:
            ours[frame] += count

    def spots(counter: Counter[str]) -> list[HotSpot]:
        return [HotSpot(f, n, n / busy) for f, n in counter.most_common(top)]

    return Profile(total, busy, spots(leaf), spots(python), spots(ours))


def format_profile(name: str, cpu: tuple[float, float], prof: Profile) -> str:
    own_cpu, children_cpu = cpu
    lines = [
        f"== {name}: {own_cpu:.1f} CPU s own, {children_cpu:.1f} CPU s in the commands it ran; "
        f"{prof.busy} busy of {prof.samples} samples"
    ]
    for title, spots in (
        ("innermost frame", prof.leaf),
        ("innermost Python frame", prof.python),
        ("our functions, inclusive", prof.ours),
    ):
        lines.append(f"  by {title} (% of busy samples):")
        lines.extend(f"    {s.share:6.1%}  {s.frame}" for s in spots)
    return "\n".join(lines) + "\n"


def cpu_with_children(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of a live process and of its waited-for children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: `pip install -e '.[bench]'` (make profile does)")
    return found


@contextlib.asynccontextmanager
async def sampled(
    spy: str, pids: Mapping[str, int], measured: Mapping[str, int], args: argparse.Namespace
) -> AsyncIterator[dict[str, tuple[float, float]]]:
    """py-spy records each of `pids` to <args.out>/<name>.txt while the context is open; the dict
    it yields is filled on exit with the CPU seconds (own, its commands') each of `measured` (the
    sampled processes and any others) spent meanwhile."""
    cpu_before = {name: cpu_with_children(pid) for name, pid in measured.items()}
    spies = {
        name: await asyncio.create_subprocess_exec(
            spy,
            "record",
            f"--pid={pid}",
            f"--rate={args.rate}",
            "--format=raw",
            "--nolineno",
            *(["--native"] if args.native else []),
            f"--output={args.out / f'{name}.txt'}",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    }
    cpu: dict[str, tuple[float, float]] = {}
    try:
        await asyncio.sleep(1)  # py-spy attaches
        yield cpu
        for name, pid in measured.items():
            own, children = cpu_with_children(pid)
            cpu[name] = (own - cpu_before[name][0], children - cpu_before[name][1])
    finally:
        for spy_proc in spies.values():
            spy_proc.send_signal(signal.SIGINT)
        for spy_proc in spies.values():
            await spy_proc.wait()


async def amain(args: argparse.Namespace, spy: str) -> tuple[dict[str, tuple[float, float]], float]:
    """Runs the profiled pass; returns each process's CPU seconds over it (own, its commands') and
    the pass's seconds."""
    comps = kubeloop_side(args.qps, args.burst)
    async with session(args.pods, args.qps, args.burst, args.timeout) as ses:
        group = ShortHomeComponents(ses.stack.cp, comps, ses.stack.home)
        await group.start()
        try:
            await one_pass(ses.stack, ses.clock, ses.volumes[:1], "warm", args.timeout)
            procs = {**ses.stack.components.processes, **group.processes}
            pids = {name: p.pid for name, p in procs.items() if p.pid is not None}
            # Measured, not sampled (not Python): the servers every controller talks to.
            servers = {name: ses.stack.cp.processes[name].pid for name in ("kube-apiserver", "etcd")}
            measured = {**pids, **{n: pid for n, pid in servers.items() if pid is not None}}
            async with sampled(spy, pids, measured, args) as cpu:
                print(f"profiling one pass of {args.pods} pods ...", flush=True)
                started = time.monotonic()
                t = await one_pass(ses.stack, ses.clock, ses.volumes, "profiled", args.timeout)
                elapsed = time.monotonic() - started
        finally:
            await group.stop()
    print(
        f"\none pass of {args.pods} pods in {elapsed:.1f} s: mount p50 {percentile(t.mount, 50):.2f} s, "
        f"p99 {percentile(t.mount, 99):.2f} s, all {t.mount_total:.2f} s; detach p50 "
        f"{percentile(t.detach, 50):.2f} s, p99 {percentile(t.detach, 99):.2f} s, "
        f"all {t.detach_total:.2f} s\n"
    )
    return cpu, elapsed


async def provisioning_main(
    args: argparse.Namespace, spy: str
) -> tuple[dict[str, tuple[float, float]], float]:
    """One unthrottled run of bench.provisioning's kubeloop side over --provisioning claims, its
    external-provisioner sampled from the first claim's creation to the last one Bound (the
    window of its "CPU s while provisioning"); every process of the run is measured."""
    cpu: dict[str, tuple[float, float]] = {}

    @contextlib.asynccontextmanager
    async def observe(pids: Mapping[str, int]) -> AsyncIterator[None]:
        async with sampled(spy, {"provisioner": pids["provisioner"]}, pids, args) as spent:
            print(f"profiling the provisioner over {args.provisioning} claims ...", flush=True)
            yield
        cpu.update(spent)

    run = await provisioning.run_one("unthrottled", "kubeloop", args.provisioning, observe)
    print(
        f"\n{run.claims} claims in {run.total_s:.1f} s ({run.claims_per_s:.1f}/s, {run.failed} failed): "
        f"latency p50 {run.latency_p50_s:.2f} s, p99 {run.latency_p99_s:.2f} s; the provisioner's "
        f"{cpu['provisioner'][0]:.2f} CPU s is {cpu['provisioner'][0] / run.claims * 1000:.2f} ms per claim\n"
    )
    return cpu, run.total_s


def report(out: Path, cpu: dict[str, tuple[float, float]], elapsed: float) -> None:
    total = sum(sum(c) for c in cpu.values())
    cores = os.cpu_count() or 1
    print(
        f"CPU seconds over the pass ({total:.1f} in all, {total / (elapsed * cores):.0%} of {cores} cores):"
    )
    for name in sorted(cpu, key=lambda n: -sum(cpu[n])):
        print(f"  {sum(cpu[name]):5.1f}  {name}")
    print()
    for name in sorted(cpu, key=lambda n: -sum(cpu[n])):
        collapsed = out / f"{name}.txt"
        if not collapsed.exists():
            continue
        prof = hot_spots(collapsed.read_text().splitlines())
        text = format_profile(name, cpu[name], prof)
        (out / f"{name}.top.txt").write_text(text)
        print(text)
    print(f"collapsed stacks and summaries: {out}/")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=20, help="pods in the profiled pass (default: 20)")
    parser.add_argument(
        "--provisioning",
        type=int,
        metavar="CLAIMS",
        help="instead of the attach pass: the external-provisioner over one unthrottled run of "
        "bench.provisioning with this many claims",
    )
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second (default: 100)")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / ".kubeloop" / "profile", help="default: .kubeloop/profile"
    )
    parser.add_argument(
        "--no-native",
        dest="native",
        action="store_false",
        help="Python frames only (default: with native frames, so that the C call a thread is in shows)",
    )
    parser.add_argument("--qps", type=float, default=50.0, help="client QPS of the controllers (default: 50)")
    parser.add_argument("--burst", type=int, default=100, help="client burst (default: 100)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per pass (default: 600s)")
    args = parser.parse_args()
    spy = py_spy()
    args.out.mkdir(parents=True, exist_ok=True)
    report(args.out, *asyncio.run((provisioning_main if args.provisioning else amain)(args, spy)))


if __name__ == "__main__":
    main()
