"""`kubeloop-node-plugin`: kubeloop's CSI driver, external-provisioner and external-resizer in one
process, each configured by its own flags, for node-local mode.

In node-local mode every node runs the driver and the two sidecars that call its controller service
(docs/node-local.md). As three processes they hold three Python interpreters with the same
libraries: about 20 MiB of each one's memory is the same imported code (issue 49). Run together,
they share it, as TopoLVM runs lvmd inside its node plugin for edge nodes. What stays apart is what
makes them three components: each parses its own command line (upstream's flags for the sidecars),
talks to the driver over the CSI socket as before, reaches the API server with its own service
account (`--kubeconfig` naming the directory of its token), and has its own controllers, queues
and log lines (their logger names say whose). What they share: the event loop, one log format and
verbosity, and one HTTP endpoint, whose /metrics holds the three components' families once and
whose /healthz and /readyz hold the three components' checks. If one component stops or fails, the
process exits, and its container restarts the three.

    kubeloop-node-plugin [--http-endpoint=:8080] [--v=2] [--log-format=text] \\
        -- csi-driver DRIVER-FLAGS -- external-provisioner FLAGS -- external-resizer FLAGS
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controller_runtime import goflags, process
from controller_runtime.logs import get_logger, setup_logging
from csi_driver import main as driver
from external_provisioner import main as provisioner
from external_resizer import main as resizer

log = get_logger("node-plugin")

NAME = "kubeloop-node-plugin"
SEPARATOR = "--"
# Set once for the process, on kubeloop-node-plugin's own command line (names as in either syntax,
# `-name` or `--name`).
SHARED_FLAGS = frozenset(
    {"http-endpoint", "health-port", "metrics-address", "v", "log-format", "logging-format"}
)


Parse = Callable[[Sequence[str]], argparse.Namespace]


@dataclass(frozen=True)
class Component:
    """How one component's section of the command line becomes its arguments, and what runs it."""

    parse: Parse
    run: process.Run


def _go_flags(
    build: Callable[[], goflags.FlagSet], name: str
) -> Callable[[Sequence[str]], argparse.Namespace]:
    """A sidecar's section parsed as its own process parses it: upstream's flags, Go's syntax."""

    def parse(argv: Sequence[str]) -> argparse.Namespace:
        args = build().parse_args(argv)
        for line in args.flag_warnings:
            log.warning(line, component=name)
        return args

    return parse


COMPONENTS: dict[str, Component] = {
    # The driver's module first: importing it turns off gRPC's fork handlers, before grpc loads.
    "csi-driver": Component(lambda argv: process.parse_args(driver.build_parser(), argv), driver.run),
    "external-provisioner": Component(
        _go_flags(provisioner.build_parser, "external-provisioner"), provisioner.run
    ),
    "external-resizer": Component(_go_flags(resizer.build_parser, "external-resizer"), resizer.run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        usage=f"{NAME} [flags] -- csi-driver FLAGS [-- external-provisioner FLAGS] "
        "[-- external-resizer FLAGS]",
        description="Runs kubeloop's CSI driver and, beside it, the node's external-provisioner and "
        "external-resizer in one process (node-local mode): each takes its own flags after `-- NAME` "
        f"(`{NAME} -- NAME --help` lists them), reaches the driver over its CSI socket and the API "
        "server with its own credentials (a sidecar's --kubeconfig may name a service account's "
        "token directory). The flags here are the process's: its one HTTP endpoint (metrics of all "
        "three, and their liveness and readiness checks) and its logging. The process exits when any "
        "of the three stops.",
    )
    process.add_http_flags(parser)
    process.add_logging_flags(parser)
    return parser


def split(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The process's own flags, and each `-- NAME FLAGS...` section as (NAME, FLAGS)."""
    groups: list[list[str]] = [[]]
    for token in argv:
        if token == SEPARATOR:
            groups.append([])
        else:
            groups[-1].append(token)
    if any(not group for group in groups[1:]):
        raise SystemExit(f"{NAME}: `--` must be followed by a component: {', '.join(COMPONENTS)}")
    return groups[0], [(group[0], group[1:]) for group in groups[1:]]


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[tuple[process.Run, argparse.Namespace]]]:
    """Settles the whole command line, or exits with a message naming what is wrong."""
    own, sections = split(argv)
    args = process.parse_args(build_parser(), own)
    names = [name for name, _ in sections]
    unknown = [name for name in names if name not in COMPONENTS]
    if unknown:
        expected = ", ".join(COMPONENTS)
        raise SystemExit(f"{NAME}: unknown component {unknown[0]!r} (expected one of {expected})")
    for name, flags in sections:
        if {"-h", "--help"} & set(flags):
            COMPONENTS[name].parse(flags)  # prints the component's own help and exits
    if len(set(names)) != len(names):
        raise SystemExit(f"{NAME}: each component may be given once: {' '.join(names)}")
    if "csi-driver" not in names:
        raise SystemExit(f"{NAME}: `-- csi-driver FLAGS` is required: the sidecars here call its socket")
    for name, flags in sections:
        shared = [f for f in flags if f.startswith("-") and f.lstrip("-").split("=", 1)[0] in SHARED_FLAGS]
        if shared:
            raise SystemExit(
                f"{NAME}: {shared[0]} is the process's, not {name}'s: give it before the first `--`"
            )
    setup_logging(args.log_format, args.verbosity)
    return args, [(COMPONENTS[name].run, COMPONENTS[name].parse(flags)) for name, flags in sections]


def main(argv: Sequence[str] | None = None) -> None:
    args, parts = parse(sys.argv[1:] if argv is None else argv)
    import uvloop

    sys.exit(uvloop.run(process.serve_together(parts, args.http_endpoint or "")))


if __name__ == "__main__":
    main()
