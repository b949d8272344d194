"""The Kubernetes external-storage e2e suite against kubeloop in kind (docs/e2e-storage.md).

    python -m localstack.e2e_storage run        # images into the cluster, then e2e.test; a summary
    python -m localstack.e2e_storage dry-run    # which specs the filters select; needs no cluster
    python -m localstack.e2e_storage summary DIR/junit.xml

e2e.test (tools/build-binaries.sh e2e) runs directly, without the ginkgo CLI, so its specs run one after
the other: Ginkgo can only run a suite in parallel when its CLI hosts the processes. The driver is
described by deploy/kind/e2e-driver.yaml; the test images are kubeloop's own (tools/kind-e2e/images.sh),
named through tools/kind-e2e/repo-list.yaml, and `kind load`ed onto every node before a run.

A run writes into its results directory: e2e.log (the suite's output), junit.xml (Ginkgo's report),
junit_01.xml (the framework's shorter one), summary.txt and summary.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from controller_runtime.toolchain import REPO_ROOT, Toolchain

from . import csi_mock
from .kind import CLUSTER_NAME, DEFAULT_KUBECONFIG, Cluster, KindError, run

DRIVER_FILE = REPO_ROOT / "deploy" / "kind" / "e2e-driver.yaml"
# The class node-local mode runs the specs with (--storage-class): its WaitForFirstConsumer one.
NODE_LOCAL_E2E_CLASS = "kubeloop-wffc"
REPO_LIST = REPO_ROOT / "tools" / "kind-e2e" / "repo-list.yaml"
IMAGES_SCRIPT = REPO_ROOT / "tools" / "kind-e2e" / "images.sh"
DEFAULT_RESULTS = REPO_ROOT / ".kubeloop" / "e2e-storage"
DRIVER_NAME = "loop.csi.kubeloop.dev"

# One spec of each thing kubeloop does with a real kubelet, each well under a minute.
QUICK_SPECS = (
    "Dynamic PV (default fs)] volumes should store data",
    "Dynamic PV (block volmode)] volumes should store data",
    "Dynamic PV (default fs)] provisioning should provision storage with pvc data source",
    "Dynamic PV (default fs)] provisioning should provision storage with snapshot data source [Feature",
    "Dynamic PV (default fs)(allowExpansion)] volume-expand Verify if offline PVC expansion works",
    "Dynamic PV (immediate binding)] topology should provision a volume and schedule a pod with AllowedTop",
    "Dynamic PV (default fs)] capacity provides storage capacity information",
)


def external_specs(specs: Sequence[str]) -> str:
    """A Ginkgo focus on these specs of the External Storage suite only: the same texts also name
    in-tree CSI specs, whose drivers' images come from a registry."""
    return "External.Storage.*(" + "|".join(go_regexp_quote(f"[Testpattern: {s}") for s in specs) + ")"


def go_regexp_quote(text: str) -> str:
    """`text` as a Go (RE2) regular expression matching it literally. Python's re.escape also escapes
    spaces, which RE2 refuses."""
    return "".join(f"\\{ch}" if ch in r"\.+*?()|[]{}^$" else ch for ch in text)


@dataclass(frozen=True)
class Suite:
    """A selection of the external-storage specs: Ginkgo focus and skip expressions."""

    focus: str
    skip: str
    about: str
    # Its specs stop and start kubelet over ssh to the node (test/e2e/storage/utils KubeletCommand).
    node_ssh: bool = False
    # Its specs deploy the CSI mock driver's manifests, whose images localstack.csi_mock makes.
    csi_mock: bool = False


SUITES = {
    # Disruptive specs restart kubelet or nodes, Serial ones want the whole cluster, Slow ones (xfs,
    # stress, volume limits) take many minutes each on two cores.
    "default": Suite(
        "External.Storage", "Disruptive|Serial|Slow", "every spec but the Disruptive, Serial and Slow ones"
    ),
    # The ones the default leaves out for being disruptive or serial (some of them Slow as well).
    "disruptive": Suite(
        r"External.Storage.*\[(Disruptive|Serial)\]", "", "the Disruptive and Serial specs", node_ssh=True
    ),
    # What `make test` runs (tests/kind/test_e2e_storage.py): a few minutes of it.
    "quick": Suite(
        external_specs(QUICK_SPECS),
        "Disruptive|Serial|Slow",
        "provisioning, data, block mode, clones, snapshots, offline expansion, topology and capacity: "
        "a few minutes",
    ),
    # The CSI Mock specs: the suite's own mock driver behind kubeloop's sidecars (docs/e2e-storage.md),
    # how the sidecars and kubelet treat each CSIDriver field and the driver's errors. Those that need
    # SELinux on the nodes, restart things or need a feature gate the cluster leaves off are left out.
    "csi-mock": Suite(
        r"\[sig-storage\] CSI Mock",
        r"Disruptive|Serial|Slow|Feature:SELinux|SELinuxMount|Feature:OffByDefault",
        "the CSI Mock specs: the e2e suite's mock driver behind kubeloop's sidecars",
        csi_mock=True,
    ),
}
FOCUS, SKIP = SUITES["default"].focus, SUITES["default"].skip
# Ginkgo's own limit for the whole suite; the process gets a few minutes more to write its reports.
DEFAULT_TIMEOUT = "3h"


def say(message: str) -> None:
    print(f"[e2e-storage] {message}", file=sys.stderr, flush=True)


def duration_seconds(text: str) -> float:
    """Seconds in a Go duration of hours, minutes and seconds ("3h", "90m", "1h30m", "45s")."""
    total, number = 0.0, ""
    units = {"h": 3600, "m": 60, "s": 1}
    for ch in text.strip():
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in units and number:
            total += float(number) * units[ch]
            number = ""
        else:
            raise ValueError(f"not a duration of h, m and s: {text!r}")
    if number or total <= 0:
        raise ValueError(f"not a duration of h, m and s: {text!r}")
    return total


@dataclass
class Options:
    e2e_test: Path
    results: Path
    kubeconfig: Path = DEFAULT_KUBECONFIG
    kubectl: Path | None = None
    driver: Path = DRIVER_FILE
    repo_list: Path = REPO_LIST
    focus: str = FOCUS
    skip: str = SKIP
    timeout: str = DEFAULT_TIMEOUT
    dry_run: bool = False
    extra: list[str] = field(default_factory=list)
    # Added to e2e.test's environment (the ssh key and user of enable_node_ssh).
    env: dict[str, str] = field(default_factory=dict)

    @property
    def junit(self) -> Path:
        return self.results / "junit.xml"


def command(o: Options) -> list[str]:
    """The e2e.test command line. The skeleton provider is the one for clusters no cloud provider
    manages (kind); the log dump it would do after the suite needs ssh to the nodes, so it is off."""
    argv = [
        str(o.e2e_test),
        f"-kubeconfig={o.kubeconfig}",
        "-provider=skeleton",
        f"-storage.testdriver={o.driver}",
        # Where the driver file's FromFile paths (deploy/kind/e2e-vac.yaml) are resolved.
        f"-repo-root={REPO_ROOT}",
        f"-kube-test-repo-list={o.repo_list}",
        f"-report-dir={o.results}",
        f"-ginkgo.junit-report={o.junit}",
        f"-ginkgo.focus={o.focus}",
        *([f"-ginkgo.skip={o.skip}"] if o.skip else []),
        f"-ginkgo.timeout={o.timeout}",
        "-ginkgo.no-color",
        "-disable-log-dump",
    ]
    if o.kubectl is not None:
        argv.append(f"-kubectl-path={o.kubectl}")
    if o.dry_run:
        argv.append("-ginkgo.dry-run")
    return argv + o.extra


@dataclass
class Summary:
    passed: int = 0
    failed: int = 0
    # Selected specs that skipped themselves (a capability or feature the driver or cluster lacks).
    skipped: int = 0
    # Specs the focus and skip expressions left out.
    not_selected: int = 0
    failures: list[str] = field(default_factory=list)
    # The suite's own nodes ([SynchronizedBeforeSuite], [ReportAfterSuite] ...) that did not pass.
    suite_failures: list[str] = field(default_factory=list)
    selected_specs: list[str] = field(default_factory=list)

    def line(self) -> str:
        text = f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"
        if self.suite_failures:
            text += f" (suite setup or teardown failed: {', '.join(self.suite_failures)})"
        return text

    @property
    def ok(self) -> bool:
        return not self.failed and not self.suite_failures


FAILED_STATES = {"failed", "panicked", "timedout", "interrupted", "aborted"}


def parse_junit(path: Path) -> Summary:
    """Counts a Ginkgo v2 JUnit report. Every spec of the suite is in it: those the filters left out as
    skipped without a reason ("skipped"), those that skipped themselves with one ("skipped - ...")."""
    summary = Summary()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        status = case.get("status", "")
        if not status:  # a report from elsewhere: infer from the children
            if case.find("failure") is not None or case.find("error") is not None:
                status = "failed"
            elif case.find("skipped") is not None:
                status = "skipped"
            else:
                status = "passed"
        if not name.startswith("[It]"):
            if status in FAILED_STATES:
                summary.suite_failures.append(name)
            continue
        spec = name.removeprefix("[It]").strip()
        if status == "skipped":
            skipped = case.find("skipped")
            message = skipped.get("message", "") if skipped is not None else ""
            if message.startswith("skipped - "):
                summary.skipped += 1
                summary.selected_specs.append(spec)
            else:
                summary.not_selected += 1
        elif status == "pending":
            summary.not_selected += 1
        elif status in FAILED_STATES:
            summary.failed += 1
            summary.failures.append(spec)
            summary.selected_specs.append(spec)
        else:
            summary.passed += 1
            summary.selected_specs.append(spec)
    return summary


def write_summary(summary: Summary, results: Path, argv: Sequence[str], seconds: float | None) -> None:
    """summary.txt and summary.json; `seconds` is None for a dry run, whose specs all "pass"."""
    if seconds is None:
        lines = [f"dry run: {len(summary.selected_specs)} specs selected, {summary.not_selected} not"]
    else:
        lines = [summary.line(), f"took {seconds / 60:.1f} min"]
    lines += [f"FAILED: {name}" for name in summary.failures]
    lines += ["", "command:", " ".join(argv)]
    (results / "summary.txt").write_text("\n".join(lines) + "\n")
    data = {**asdict(summary), "seconds": seconds, "command": list(argv)}
    (results / "summary.json").write_text(json.dumps(data, indent=2) + "\n")


def images() -> list[str]:
    out = run(["bash", str(IMAGES_SCRIPT), "list"], timeout=300).stdout
    return out.split()


def load_images(cluster: Cluster) -> float:
    """Builds the test images when needed and loads them onto every node of the cluster."""
    start = time.monotonic()
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(IMAGES_SCRIPT), "build"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=3600, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise KindError(f"{IMAGES_SCRIPT.name} build failed:\n{result.stderr[-4000:]}")
    cluster.kind("load", "docker-image", "--name", cluster.name, *images(), timeout=900)
    return time.monotonic() - start


def enable_node_ssh(cluster: Cluster, results: Path) -> dict[str, str]:
    """Lets e2e.test reach every node as root over ssh, as the Disruptive specs do to stop and start
    kubelet: a key pair made for this results directory (by a node's ssh-keygen, so the host needs no
    ssh tools), its public half in each node's authorized_keys, and sshd started there (the node image
    has it installed but not enabled). Returns the environment that points e2e.test at the key."""
    nodes = cluster.nodes()
    key = results / "ssh" / "id_ed25519"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.parent.chmod(0o700)
        made = "/run/kubeloop-e2e-key"
        keygen = f"rm -f {made} {made}.pub && ssh-keygen -q -t ed25519 -N '' -f {made}"
        run(["docker", "exec", nodes[0], "sh", "-c", keygen])
        private = run(["docker", "exec", nodes[0], "cat", made]).stdout
        public = run(["docker", "exec", nodes[0], "cat", f"{made}.pub"]).stdout
        run(["docker", "exec", nodes[0], "rm", "-f", made, f"{made}.pub"])
        key.touch(mode=0o600)
        key.write_text(private)
        key.with_name(key.name + ".pub").write_text(public)
    public = key.with_name(key.name + ".pub").read_text()
    for node in nodes:
        run(
            ["docker", "exec", "-i", node, "sh", "-c",
             "umask 077 && mkdir -p /root/.ssh && cat > /root/.ssh/authorized_keys && systemctl start ssh"],
            input=public,
        )  # fmt: skip
    return {"KUBE_SSH_KEY_PATH": str(key), "KUBE_SSH_USER": "root"}


def node_local_driver(driver: Path, class_name: str, results: Path) -> Path:
    """A copy of the driver file, in `results`, for node-local mode: its dynamic specs use the
    existing StorageClass `class_name` rather than one each spec makes, and it claims no volume
    group snapshots. A group's volumes may be on several nodes (the specs' StatefulSet spreads
    them), and one node's plugin cuts snapshots of its own pool only; external-snapshotter's
    distributed snapshotting labels no group snapshot content with a node either, so the specs
    would wait for a group snapshot no node takes until they time out."""
    definition = yaml.safe_load(driver.read_text())
    definition["StorageClass"] = {"FromExistingClassName": class_name}
    definition["DriverInfo"]["Capabilities"].pop("groupSnapshot", None)
    derived = results / f"{driver.stem}-{class_name}.yaml"
    derived.write_text(yaml.safe_dump(definition, sort_keys=False))
    return derived


def check_cluster(cluster: Cluster, driver_deployed: bool = True) -> None:
    """Every node Ready and, for the suites that test kubeloop's driver, its CSIDriver object (the
    CSI Mock specs deploy a driver of their own)."""
    if not cluster.kubeconfig.exists():
        raise KindError(f"no kubeconfig at {cluster.kubeconfig}: bring the cluster up (make kind-up)")
    if driver_deployed:
        cluster.kubectl("get", "csidriver", DRIVER_NAME, "-o", "name")
    cluster.kubectl("wait", "--for=condition=Ready", "nodes", "--all", "--timeout=120s", timeout=150)


def execute(o: Options, log: Path) -> tuple[int, float]:
    """Runs e2e.test with its output in `log`; returns its exit code and the seconds it took."""
    o.results.mkdir(parents=True, exist_ok=True)
    argv = command(o)
    start = time.monotonic()
    with log.open("w") as out:
        try:
            rc = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=o.results, env={**os.environ, **o.env},
                timeout=duration_seconds(o.timeout) + 600, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = -1
    return rc, time.monotonic() - start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m localstack.e2e_storage",
        description="The Kubernetes external-storage e2e suite (e2e.test) against kubeloop's kind cluster.",
    )
    parser.add_argument("command", choices=["run", "dry-run", "summary"])
    parser.add_argument("junit", nargs="?", type=Path, help="summary: the JUnit file to count")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="where reports go")
    parser.add_argument("--kubeconfig", type=Path, default=DEFAULT_KUBECONFIG)
    parser.add_argument("--name", default=CLUSTER_NAME, help="the kind cluster (for loading images)")
    parser.add_argument(
        "--suite", choices=sorted(SUITES), default="default",
        help="which specs: " + "; ".join(f"{name}: {s.about}" for name, s in SUITES.items()),
    )  # fmt: skip
    parser.add_argument("--focus", help="-ginkgo.focus instead of the suite's")
    parser.add_argument("--skip", help="-ginkgo.skip instead of the suite's")
    parser.add_argument("--timeout", default=DEFAULT_TIMEOUT, help="-ginkgo.timeout for the whole suite")
    parser.add_argument("--driver", type=Path, default=DRIVER_FILE, help="the -storage.testdriver file")
    parser.add_argument(
        "--storage-class",
        help="node-local mode: the dynamic specs use this existing StorageClass (FromExistingClassName) "
        "instead of one of their own, its WaitForFirstConsumer class, as csi-driver-host-path's "
        "distributed test driver does (an Immediate claim is made on an elected node, not the one a "
        "spec places its pods on), and no volume group snapshot is claimed (a group's volumes may be "
        "on several nodes)",
    )
    parser.add_argument("--no-load-images", action="store_true", help="run: the images are on the nodes")
    parser.epilog = "Arguments after -- go to e2e.test as they are (-ginkgo.v, -ginkgo.label-filter=...)."
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])

    if args.command == "summary":
        if args.junit is None:
            parser.error("summary needs the JUnit file")
        summary = parse_junit(args.junit)
        print(summary.line())
        for name in summary.failures:
            print(f"FAILED: {name}")
        sys.exit(0 if summary.ok else 1)

    toolchain = Toolchain.default()
    options = Options(
        e2e_test=toolchain.binary("e2e.test"), results=args.results.resolve(),
        kubeconfig=args.kubeconfig.resolve(), kubectl=toolchain.binary("kubectl"),
        driver=args.driver.resolve(), timeout=args.timeout,
        focus=SUITES[args.suite].focus if args.focus is None else args.focus,
        skip=SUITES[args.suite].skip if args.skip is None else args.skip,
        dry_run=args.command == "dry-run", extra=extra,
    )  # fmt: skip
    duration_seconds(options.timeout)  # refuse a bad --timeout before anything runs
    options.results.mkdir(parents=True, exist_ok=True)
    if args.storage_class:
        options.driver = node_local_driver(options.driver, args.storage_class, options.results)
    options.junit.unlink(missing_ok=True)

    if args.command == "run":
        cluster = Cluster(args.name, options.kubeconfig)
        try:
            check_cluster(cluster, driver_deployed=not SUITES[args.suite].csi_mock)
            if not args.no_load_images:
                say("building the test images and loading them into the cluster")
                say(f"images loaded in {load_images(cluster):.0f}s")
            if SUITES[args.suite].csi_mock:
                say("making the CSI Mock specs' images (localstack.csi_mock) and loading them")
                cluster.kind(
                    "load", "docker-image", "--name", cluster.name, *csi_mock.build_all(), timeout=900
                )
            if SUITES[args.suite].node_ssh:
                say("starting sshd on every node with a key of this run (kubelet restarts)")
                options.env.update(enable_node_ssh(cluster, options.results))
        except KindError as e:
            say(f"error: {e}")
            sys.exit(2)

    say(" ".join(command(options)))
    log = options.results / ("dry-run.log" if options.dry_run else "e2e.log")
    rc, seconds = execute(options, log)
    if not options.junit.exists():
        say(f"e2e.test exited {rc} without a JUnit report; see {log}")
        sys.exit(2)
    summary = parse_junit(options.junit)
    write_summary(summary, options.results, command(options), None if options.dry_run else seconds)
    if options.dry_run:
        (options.results / "specs.txt").write_text("".join(f"{s}\n" for s in summary.selected_specs))
        say(f"{len(summary.selected_specs)} specs selected, {summary.not_selected} not ({seconds:.0f}s); "
            f"list in {options.results / 'specs.txt'}")  # fmt: skip
        sys.exit(0 if rc == 0 else 1)
    say(f"{summary.line()} in {seconds / 60:.1f} min (e2e.test exit {rc}); reports in {options.results}")
    sys.exit(0 if summary.ok and rc == 0 else 1)


if __name__ == "__main__":
    main()
