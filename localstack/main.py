"""`kubeloop-stack up` (what `make up` runs): the local Kubernetes storage stack in the foreground;
`kubeloop-stack down` (`make down`): stops the one running on a home from anywhere else.

`up` starts etcd, kube-apiserver, kube-controller-manager (storage controllers off) and
kube-scheduler on 127.0.0.1, then the kubeloop components of localstack/components.py, prints a
line as each becomes healthy and how to use kubectl, and runs until Ctrl-C, SIGTERM or SIGHUP (its
terminal closed), which stop everything in order. The kubeloop components are supervised: one that
crashes is restarted with exponential backoff (RestartPolicy), each restart printed and counted in
$KUBELOOP_HOME/status.json. The console may go away first (localstack/console.py): its lines then
go to the log, and the stop is the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from controller_runtime import process
from controller_runtime.logs import get_logger, log_to_file, setup_logging
from controller_runtime.toolchain import MissingBinaryError, Toolchain
from controller_runtime.unix_grpc import MAX_SOCKET_PATH
from csi_driver import DRIVER_NAME
from driver_bench.faults import parse_fault
from driver_bench.recipe import Recipe, RecipeError
from driver_bench.recipe import load as load_recipe

from . import console
from .components import (
    PROMETHEUS_PORT,
    Component,
    ComponentError,
    Components,
    instance_ports,
    instances,
    longest_socket_path,
    node_names,
    prometheus,
    registry,
)
from .controlplane import ControlPlane, Ports, StackLockedError, default_home, running_stack_pid
from .go_sidecars import with_go_sidecars
from .leftovers import find_leftovers
from .pools import NODE_LOCAL, POOL_MODES, SHARED, PoolCapacity, PoolOptionError, parse_pool_capacity
from .proc import (
    ManagedProcess,
    PortInUseError,
    RestartEvent,
    RestartPolicy,
    UnhealthyError,
    check_ports_free,
    tail,
)
from .recipe_stack import check_commands, node_local_problem, recipe_registry

# --sidecars: whose external-provisioner, -attacher and -resizer the stack runs.
SIDECAR_SETS = ("kubeloop", "go")

log = get_logger("stack")

# Errors with a message written for the person at the terminal: print it, no traceback.
_EXPECTED = (
    MissingBinaryError,
    PortInUseError,
    StackLockedError,
    UnhealthyError,
    ComponentError,
    RecipeError,
)

# How long `down` waits for the launcher to exit. A stop takes seconds; each process gets up to
# --stop-timeout (15 s) before SIGKILL, one after the other, so a slow one is still well inside.
DOWN_TIMEOUT = 120.0


def build_parser() -> argparse.ArgumentParser:
    defaults = Ports()
    parser = argparse.ArgumentParser(
        prog="kubeloop-stack",
        description=(
            "Runs the kubeloop local storage stack on this machine: etcd, kube-apiserver, "
            "kube-controller-manager (its storage controllers switched off), kube-scheduler, and the "
            "kubeloop components, all on 127.0.0.1 and in the foreground. Ctrl-C stops everything, "
            "and so does `down` from another terminal."
        ),
        epilog=(
            "State (certificates, kubeconfigs, etcd data, logs) lives in $KUBELOOP_HOME "
            "(default: .kubeloop/ in the checkout); the admin kubeconfig is $KUBELOOP_HOME/kubeconfig. "
            "See docs/local-stack.md."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser(
        "up",
        help="start the stack and keep it running until Ctrl-C / SIGTERM / SIGHUP",
        description="Start the stack in the foreground; Ctrl-C, SIGTERM or SIGHUP (its terminal "
        "closed) stops every process it started, in order.",
    )
    down = sub.add_parser(
        "down",
        help="stop the stack running on a home (from another terminal)",
        description="Send SIGTERM to the launcher running on the home, wait for its ordered stop, then "
        "look for mounts and loop devices left under the home. Exits 0 when the stack stopped (or none "
        "ran) and nothing is left, 1 otherwise.",
    )
    for command in (up, down):
        command.add_argument(
            "--home",
            type=Path,
            default=default_home(),
            help="state directory (default: $KUBELOOP_HOME, else .kubeloop/ in the checkout)",
        )
    down.add_argument(
        "--timeout",
        type=process.duration,
        default=DOWN_TIMEOUT,
        help=f"how long to wait for the stack to exit (default: {DOWN_TIMEOUT:g}s); it goes on "
        "stopping after that",
    )
    up.add_argument(
        "--restart-backoff",
        type=process.duration,
        default=RestartPolicy.initial,
        help="wait before restarting a crashed kubeloop component, doubled per further crash "
        f"(default: {RestartPolicy.initial:g}s)",
    )
    up.add_argument(
        "--restart-backoff-cap",
        type=process.duration,
        default=RestartPolicy.cap,
        help=f"the longest wait between restarts (default: {RestartPolicy.cap:g}s)",
    )
    ports = up.add_argument_group("ports (all on 127.0.0.1)")
    ports.add_argument(
        "--apiserver-port",
        type=int,
        default=defaults.apiserver,
        help=f"kube-apiserver secure port (default: {defaults.apiserver})",
    )
    ports.add_argument(
        "--etcd-port",
        type=int,
        default=defaults.etcd_client,
        help=f"etcd client port (default: {defaults.etcd_client})",
    )
    ports.add_argument(
        "--etcd-peer-port",
        type=int,
        default=defaults.etcd_peer,
        help=f"etcd peer port (default: {defaults.etcd_peer})",
    )
    ports.add_argument(
        "--kcm-port",
        type=int,
        default=defaults.kube_controller_manager,
        help=f"kube-controller-manager secure port (default: {defaults.kube_controller_manager})",
    )
    ports.add_argument(
        "--scheduler-port",
        type=int,
        default=defaults.kube_scheduler,
        help=f"kube-scheduler secure port (default: {defaults.kube_scheduler})",
    )
    up.add_argument(
        "--nodes",
        type=int,
        default=2,
        help="number of simulated nodes (node-a, node-b, ...) for per-node components (default: 2)",
    )
    pools = up.add_argument_group("pools (docs/local-stack.md)")
    pools.add_argument(
        "--pools",
        choices=POOL_MODES,
        default=SHARED,
        help=f"{SHARED}: one pool every node reaches, served by one controller plugin (a volume follows "
        f"its pod between nodes); {NODE_LOCAL}: each node its own pool, its own plugin serving "
        "controller and node, its own provisioner and resizer; volumes stay on their node and the "
        f"scheduler places pods by each node's free capacity (default: {SHARED})",
    )
    pools.add_argument(
        "--pool-capacity",
        default="",
        metavar="SIZE|NODE=SIZE,...",
        help="the size each pool offers: `4Gi` for every pool, `node-a=1Gi,node-b=4Gi` per node "
        f"({NODE_LOCAL} only), or both (`2Gi,node-a=1Gi`); default: the free space of the pool's "
        "filesystem",
    )
    up.add_argument(
        "--driver-recipe",
        type=recipe_argument,
        default=None,
        metavar="RECIPE",
        dest="recipe",
        help="run the stack on the CSI driver a driver-bench recipe describes (`make up DRIVER=...`, "
        "docs/driver-bench.md) instead of kubeloop's: its controller and node commands replace "
        f"kubeloop's plugins, its fields make the CSIDriver and StorageClass; with --pools {NODE_LOCAL} "
        "one instance of its one command per node, each on its own backend",
    )
    up.add_argument(
        "--driver-fault",
        type=fault_argument,
        default=None,
        metavar="KIND:STEP|none",
        help="with --driver-recipe: put driver-bench's fault proxy in front of each plugin's socket, "
        "armed with one fault (e.g. kill-after:CreateVolume; none: it only records the calls), the "
        "stack campaign's setting (docs/driver-bench.md)",
    )
    up.add_argument(
        "--sidecars",
        choices=SIDECAR_SETS,
        default="kubeloop",
        help="kubeloop: kubeloop's external-provisioner, -attacher and -resizer; go: upstream's Go "
        "csi-provisioner, csi-attacher and csi-resizer in their place, under the same identities and "
        "RBAC (`make up SIDECARS=go`; built by tools/build-binaries.sh), e.g. to tell a driver's bug "
        f"from a sidecar's; {SHARED} pools only (default: kubeloop)",
    )
    up.add_argument(
        "--prometheus",
        action="store_true",
        help=f"also run Prometheus on 127.0.0.1:{PROMETHEUS_PORT}, scraping every kubeloop process with "
        "kubeloop's alerting rules (deploy/prometheus) loaded; needs `make prometheus-deps`",
    )
    ports.add_argument(
        "--prometheus-port",
        type=int,
        default=PROMETHEUS_PORT,
        help=f"Prometheus's port with --prometheus (default: {PROMETHEUS_PORT})",
    )
    up.add_argument(
        "--etcd-unsafe-no-fsync",
        action="store_true",
        help="run etcd without fsync: faster, but a crash can lose or corrupt data; for tests",
    )
    up.add_argument(
        "--startup-timeout",
        type=process.duration,
        default=90.0,
        help="how long each component may take to become healthy (default: 90s)",
    )
    up.add_argument(
        "--stop-timeout",
        type=process.duration,
        default=15.0,
        help="how long a component may take to exit after SIGTERM before SIGKILL (default: 15s)",
    )
    up.add_argument(
        "--verbose",
        action="store_true",
        help="also print the launcher's structured log lines on the console (they always go to "
        "$KUBELOOP_HOME/logs/stack.log); without it the console shows the status lines only",
    )
    process.add_logging_flags(up)
    return parser


def fault_argument(text: str) -> str:
    """--driver-fault: checked while the arguments are parsed; the proxies parse it again."""
    try:
        parse_fault(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def recipe_argument(path: str) -> Recipe:
    """--driver-recipe: the recipe loaded and validated while the arguments are parsed, so a bad one
    is refused with its file, field and reason before anything starts."""
    try:
        return load_recipe(path)
    except RecipeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def stack_components(args: argparse.Namespace) -> list[Component]:
    """The pool mode's registry (or the recipe driver's), and Prometheus scraping every instance of
    it with --prometheus."""
    chosen = list(
        registry(args.pools)
        if args.recipe is None
        else recipe_registry(args.recipe, args.driver_fault, args.pools)
    )
    if args.sidecars == "go":
        chosen = with_go_sidecars(chosen)
    if args.prometheus:
        targets = instances(chosen, node_names(args.nodes))
        scraped = {i.name: i.http_port for i in targets if i.http_port is not None}
        chosen.append(prometheus(scraped, args.prometheus_port))
    return chosen


def _ports(args: argparse.Namespace) -> Ports:
    return Ports(
        etcd_client=args.etcd_port,
        etcd_peer=args.etcd_peer_port,
        apiserver=args.apiserver_port,
        kube_controller_manager=args.kcm_port,
        kube_scheduler=args.scheduler_port,
    )


def _say(line: str) -> None:
    """Status lines for the person at the terminal go to stdout; logs go to stderr."""
    print(line, flush=True)


def _status(name: str, seconds: float) -> None:
    _say(f"  ok  {name:<28} healthy in {seconds:5.2f}s")


def _restarting(proc: ManagedProcess, event: RestartEvent) -> None:
    # The structured log line is ManagedProcess's; this is the one for the person at the terminal.
    if event.restarted:
        _say(
            f"  !!  restarted {event.name} (exit code {event.exit_code}), attempt {event.attempt}, "
            f"next backoff {event.backoff:g}s (pid {event.pid}, {event.restarts} restarts in all)"
        )
    else:
        print(
            f"\n!!! {event.name} exited with code {event.exit_code}; restarting in {event.backoff:g}s "
            f"(attempt {event.attempt}).\n!!! last lines of {proc.log_path}:\n{tail(proc.log_path, 15)}\n",
            file=sys.stderr,
            flush=True,
        )


def write_status(path: Path, components: Components) -> None:
    """The components' pids and restart counters, rewritten on each change (atomically: a reader
    never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"components": components.status()}, indent=2) + "\n")
    os.replace(tmp, path)


def _died(proc: ManagedProcess, code: int) -> None:
    # Loud on purpose: the control plane is not supervised, so a dead process must be seen.
    log.error(
        "COMPONENT DIED; it is not restarted", component=proc.name, exit_code=code, log=str(proc.log_path)
    )
    print(
        f"\n!!! {proc.name} (pid {proc.pid}) exited with code {code}; it is NOT restarted.\n"
        f"!!! last lines of {proc.log_path}:\n{tail(proc.log_path, 15)}\n"
        "!!! The rest of the stack keeps running; press Ctrl-C to stop it.\n",
        file=sys.stderr,
        flush=True,
    )


_WHY_AFTER_A_STOP = "The node agents' logs say why."
_WHY_WITHOUT_A_STACK = "No stack runs: a stack killed without its stop (kill -9, a crash) left them."


def _report_leftovers(home: Path, why: str = _WHY_AFTER_A_STOP) -> bool:
    """Says what the node agents could not unmount (a plugin that had died, an agent killed at its
    stop timeout): the README promises nothing is left, so anything that is must be seen. Returns
    whether anything is left."""
    left = find_leftovers(home)
    if not left:
        return False
    devices = [f"{dev} ({back})" for dev, back in left.loop_devices]
    log.error("LEFT BEHIND after the stop", mounts=",".join(left.mounts), loop_devices=",".join(devices))
    print(
        f"\n!!! left behind under {home}:\n"
        + "".join(f"!!!   mount {m}\n" for m in left.mounts)
        + "".join(f"!!!   loop device {d}\n" for d in devices)
        + f"!!! {why} The next start takes them over and its stop unmounts\n"
        '!!! them (docs/local-stack.md, "Stopping").\n',
        file=sys.stderr,
        flush=True,
    )
    return True


def pool_capacity(args: argparse.Namespace) -> PoolCapacity:
    return parse_pool_capacity(args.pool_capacity, args.pools, node_names(args.nodes))


def preflight(args: argparse.Namespace) -> str | None:
    """The checks that need no event loop; returns a message for the user, or None when all pass."""
    if os.geteuid() != 0:
        return (
            "kubeloop-stack up must run as root: the node plugins attach loop devices (losetup) and "
            "mount filesystems. Run it with sudo (e.g. `sudo make up`)."
        )
    try:
        tc = Toolchain.default()
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"):
            tc.binary(name)
        if args.prometheus:
            tc.binary("prometheus")
    except MissingBinaryError as e:
        return str(e)
    if args.nodes < 1:
        return "--nodes must be at least 1"
    recipe: Recipe | None = args.recipe
    if args.sidecars == "go" and args.pools != SHARED:
        # csi-resizer has no node deployment: a node pool's resizer would have no Go counterpart.
        return (
            f"--sidecars=go runs with --pools {SHARED} only (upstream's csi-resizer has no node deployment)"
        )
    if args.driver_fault is not None and recipe is None:
        return "--driver-fault needs --driver-recipe (the proxy runs in front of a recipe's driver)"
    if recipe is not None:
        if args.pools == NODE_LOCAL and (problem := node_local_problem(recipe)) is not None:
            return problem
        # Pool sizes are kubeloop's own driver's (its --capacity).
        if args.pool_capacity:
            return (
                "--pool-capacity sizes kubeloop's own pools; with --driver-recipe the backend is "
                "the recipe driver's own"
            )
        try:
            check_commands(recipe, args.home.resolve())
        except RecipeError as e:
            return str(e)
    try:
        pool_capacity(args)
    except PoolOptionError as e:
        return str(e)
    driver = recipe.driver_name if recipe is not None and recipe.driver_name else DRIVER_NAME
    socket = longest_socket_path(args.home.resolve(), node_names(args.nodes), driver)
    if len(str(socket)) > MAX_SOCKET_PATH:
        return (
            f"KUBELOOP_HOME {args.home.resolve()} is too deep: the stack's sockets would be "
            f"{len(str(socket))} bytes long (e.g. {socket}) and unix sockets allow {MAX_SOCKET_PATH}. "
            "Set KUBELOOP_HOME to a shorter directory."
        )
    try:
        check_ports_free(
            {
                **_ports(args).described(),
                **instance_ports(stack_components(args), node_names(args.nodes)),
            }
        )
    except (PortInUseError, MissingBinaryError) as e:
        return str(e)
    return None


class _Outcome:
    failed = False


async def _up(args: argparse.Namespace, ctx: process.Context) -> None:
    started = time.monotonic()
    home: Path = args.home.resolve()
    # People read the terminal: the status lines below. The structured lines go to a file (and,
    # with --verbose, to the terminal too).
    log_to_file(home / "logs" / "stack.log", keep_stderr=args.verbose)
    cp = ControlPlane(
        home,
        _ports(args),
        etcd_unsafe_no_fsync=args.etcd_unsafe_no_fsync,
        startup_timeout=args.startup_timeout,
        stop_timeout=args.stop_timeout,
        on_status=_status,
        on_unexpected_exit=_died,
    )
    status_path = home / "status.json"

    def restarting(proc: ManagedProcess, event: RestartEvent) -> None:
        _restarting(proc, event)
        write_status(status_path, components)

    components = Components(
        cp,
        stack_components(args),
        node_names(args.nodes),
        startup_timeout=args.startup_timeout,
        stop_timeout=args.stop_timeout,
        on_status=_status,
        on_unexpected_exit=_died,
        restart=RestartPolicy(initial=args.restart_backoff, cap=args.restart_backoff_cap),
        on_restart=restarting,
        pools=args.pools,
        pool_capacity=pool_capacity(args),  # checked by preflight
    )
    on = f"the driver of recipe {args.recipe.path}" if args.recipe is not None else f"{args.pools} pools"
    on += ", upstream's Go sidecars" if args.sidecars == "go" else ""
    _say(f"kubeloop: starting the local stack in {home} ({on})")
    try:
        await cp.start()
        await components.start()
        write_status(status_path, components)
        kubectl = cp.toolchain.binary("kubectl")
        _say(
            f"\nkubeloop stack is ready in {time.monotonic() - started:.1f}s "
            f"(apiserver {cp.server}, logs in {cp.logs_dir}/)\n"
            "Use it with:\n"
            f"  export KUBECONFIG={cp.admin_kubeconfig}\n"
            f"  export PATH={kubectl.parent}:$PATH   # kubectl {cp.toolchain.kubernetes_version}\n"
            "  kubectl get --raw /readyz\n"
            f"Crashed kubeloop components are restarted; pids and restart counts: {status_path}\n"
            "Press Ctrl-C to stop the stack (or run `make down` in another terminal)."
        )
        await ctx.stopping.wait()
    except _EXPECTED as e:
        _Outcome.failed = True
        print(f"kubeloop-stack: {e}", file=sys.stderr, flush=True)
    finally:
        _say("kubeloop: stopping the stack")
        # The node agents stop before their node plugins and unmount their volumes on the way.
        await components.stop()
        await cp.stop()
        _report_leftovers(home)
        _say("kubeloop: stopped")


class _Launcher:
    """The running launcher `down` stops, named so that neither the signal nor the wait can reach a
    later process that took its pid: by a pidfd where the kernel gives one, else (a kernel before
    5.3, a seccomp profile that refuses pidfd_open) by its pid and its start time in /proc."""

    def __init__(self, pid: int, pidfd: int | None, started: str | None) -> None:
        self.pid, self.pidfd, self.started = pid, pidfd, started

    @classmethod
    def of(cls, pid: int) -> _Launcher | None:
        """None when the process is already gone."""
        try:
            return cls(pid, os.pidfd_open(pid), None)
        except ProcessLookupError:
            return None
        except OSError:  # ENOSYS, EPERM from a seccomp filter: fall back to the start time
            started = _start_time(pid)
            return None if started is None else cls(pid, None, started)

    def terminate(self) -> None:
        if self.pidfd is not None:
            signal.pidfd_send_signal(self.pidfd, signal.SIGTERM)
        elif _start_time(self.pid) == self.started:
            os.kill(self.pid, signal.SIGTERM)

    def wait(self, timeout: float) -> bool:
        """Whether it exited within `timeout` seconds."""
        if self.pidfd is not None:
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)  # readable once the process has exited
            return bool(poller.poll(int(timeout * 1000)))
        deadline = time.monotonic() + timeout
        while _start_time(self.pid) == self.started:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat, after the parenthesised name, which may
    hold spaces); None once it has exited, a zombie included."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else fields[19]


def down(args: argparse.Namespace) -> int:
    """`kubeloop-stack down`: SIGTERM to the launcher holding the home's lock, the wait for its exit
    (its ordered stop, as after Ctrl-C), then the launcher's own leftovers check."""
    home: Path = args.home.resolve()
    setup_logging()
    if (home / "logs").is_dir():
        # What it finds is in the stack's log too, after the launcher's own lines.
        log_to_file(home / "logs" / "stack.log")
    else:
        logging.getLogger().handlers[:] = [logging.NullHandler()]
    pid = running_stack_pid(home)
    if pid is None:
        _say(f"kubeloop: no stack is running in {home}")
        return 1 if _report_leftovers(home, _WHY_WITHOUT_A_STACK) else 0
    launcher = _Launcher.of(pid)
    if launcher is None:  # gone between the lock's answer and now
        return 1 if _report_leftovers(home) else 0
    try:
        if running_stack_pid(home) == pid:
            _say(f"kubeloop: stopping the stack in {home} (pid {pid}), waiting up to {args.timeout:g}s")
            try:
                launcher.terminate()
            except PermissionError:
                print(
                    f"kubeloop-stack: not allowed to signal the stack's launcher (pid {pid}): run "
                    "`down` as the user that started it (`sudo make down` for `sudo make up`)",
                    file=sys.stderr,
                )
                return 1
            if not launcher.wait(args.timeout):
                print(
                    f"kubeloop-stack: the stack (pid {pid}) is still stopping after {args.timeout:g}s; "
                    f"it goes on (see {home / 'logs' / 'stack.log'}). Run `make down` again to wait "
                    "for it.",
                    file=sys.stderr,
                )
                return 1
    finally:
        launcher.close()
    if _report_leftovers(home):
        return 1
    _say("kubeloop: stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    # First of all: no console write may end the launcher (localstack/console.py).
    console.install()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "down":
        try:
            sys.exit(down(args))
        except StackLockedError as e:
            print(f"kubeloop-stack: {e}", file=sys.stderr)
            sys.exit(1)
    problem = preflight(args)
    if problem is not None:
        print(f"kubeloop-stack: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        process.main(parser, _up, argv)
    except SystemExit as e:
        # process.main exits 0 after a clean stop; a start-up failure already explained itself
        # above and must still give a failing exit status to `make up` and to scripts.
        if _Outcome.failed and e.code in (0, None):
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
