"""The command lines of kubeloop's CSI sidecars are their Go counterparts' (issue 51): every flag
upstream's binary at the pinned version takes, in its library's syntax (Go's flag package or
spf13/pflag), each implemented as upstream's, accepted with a warning where ignoring it changes
nothing, or refused naming it; and every command line kubeloop itself builds, and the Kubernetes e2e
suite's manifests at the pinned version, still parse. The upstream lists come from the built
binaries' --help (tools/build-binaries.sh; missing, the test fails naming the command) and from the
recorded lists of the two sidecars the module proxy does not serve (tests/upstream_flags.py)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_runtime import goflags
from controller_runtime.goflags import FlagError, FlagSet, Support, Syntax
from controller_runtime.toolchain import REPO_ROOT, read_versions
from external_attacher import main as attacher
from external_provisioner import main as provisioner
from external_resizer import main as resizer
from livenessprobe import main as livenessprobe
from node_driver_registrar import main as registrar
from tests.support.container_args import expand
from tests.upstream_flags import (
    MODULES,
    PINS,
    MissingUpstream,
    UpstreamFlags,
    go_module_dir,
    source_gates,
    upstream_flags,
)

SIDECARS: dict[str, Any] = {
    "external-provisioner": provisioner,
    "external-attacher": attacher,
    "external-resizer": resizer,
    "node-driver-registrar": registrar,
    "livenessprobe": livenessprobe,
}
# The library each upstream sidecar parses its command line with (read in its cmd/ source).
SYNTAX = {
    "external-provisioner": Syntax.PFLAG,
    "external-attacher": Syntax.GO,
    "external-resizer": Syntax.GO,
    "node-driver-registrar": Syntax.GO,
    "livenessprobe": Syntax.GO,
}
# A minimal command line each needs to start (the registrar refuses to run without this one).
REQUIRED = {"node-driver-registrar": ["--kubelet-registration-path=/var/lib/kubelet/plugins/d/csi.sock"]}
# The type words Go's and pflag's usage print for each of goflags' kinds.
TYPE_WORDS = {
    "bool": {""},
    "string": {"string"},
    "int": {"int"},
    "uint": {"uint"},
    "float": {"float", "float64"},
    "float32": {"float32", "float"},
    "duration": {"duration"},
    "level": {"Level", "value"},
    "gates": {"mapStringBool", "value"},
    "labels": {"value"},
    "vmodule": {"pattern=N,...", "value"},
    "quantity": {"quantity", "value"},
}


@cache
def upstream(sidecar: str) -> UpstreamFlags:
    try:
        return upstream_flags(sidecar)
    except MissingUpstream as exc:
        pytest.fail(str(exc))


def parser(sidecar: str) -> FlagSet:
    flags: FlagSet = SIDECARS[sidecar].build_parser()
    return flags


def parse(sidecar: str, *argv: str) -> argparse.Namespace:
    return parser(sidecar).parse([*REQUIRED.get(sidecar, []), *argv])


def refused(sidecar: str, *argv: str) -> str:
    with pytest.raises(FlagError) as err:
        parse(sidecar, *argv)
    return str(err.value)


def value_text(flag: goflags.Flag, value: Any) -> Any:
    """A parsed value in a form two spellings of one value compare equal in."""
    return round(value, 9) if isinstance(value, float) else value


# -- the lists: every upstream flag is declared, as upstream declares it ---------------------------


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_kubeloop_takes_the_command_line_of_the_pinned_upstream_version(sidecar: str) -> None:
    """The version each main.py says it follows is the pin, so moving a pin shows here first."""
    pinned = read_versions()[PINS[sidecar]]
    assert f"{sidecar} {pinned}" == SIDECARS[sidecar].UPSTREAM
    assert parser(sidecar).syntax is SYNTAX[sidecar]


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_every_upstream_flag_is_declared_with_upstreams_type_and_default(sidecar: str) -> None:
    up = upstream(sidecar)
    ours = parser(sidecar).flags
    missing = sorted(set(up.flags) - set(ours))
    assert not missing, f"{sidecar} {up.version} has flags kubeloop does not declare: {missing}"
    for name, flag in up.flags.items():
        mine = ours[name]
        assert mine.support is not Support.OWN, f"--{name} is upstream's, not kubeloop's own"
        if flag.type in set().union(*TYPE_WORDS.values()):
            assert flag.type in TYPE_WORDS[mine.kind], (
                f"--{name}: upstream's {flag.type}, kubeloop's {mine.kind}"
            )
        if mine.support is not Support.IMPLEMENTED:
            continue
        want = mine.initial() if not flag.default else goflags.PARSERS[mine.kind](flag.default)
        assert value_text(mine, mine.initial()) == value_text(mine, want), (
            f"{sidecar} --{name}: upstream's default {flag.default!r}, kubeloop's {mine.default!r}"
        )


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_kubeloops_own_flags_are_not_upstreams_and_upstreams_are_not_invented(sidecar: str) -> None:
    up = upstream(sidecar)
    for name, flag in parser(sidecar).flags.items():
        if flag.support is Support.OWN:
            assert name not in up.flags, f"--{name} is upstream's; declare it with its support"
        else:
            assert name in up.flags, (
                f"--{name} is declared upstream's, but {sidecar} {up.version} has no such flag"
            )


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_every_upstream_feature_gate_is_declared(sidecar: str) -> None:
    """The gates --help lists (every one but GA and deprecated ones), and the sidecar's own from
    its pkg/features source, GA ones included; nothing else."""
    up = upstream(sidecar)
    own = source_gates(sidecar) if sidecar in MODULES else {}
    gates = parser(sidecar).gates
    listed = {**up.gates, **own}
    assert set(gates) == set(listed), f"{sidecar} {up.version}'s gates: {sorted(listed)}"
    for name, (stage, default) in listed.items():
        assert (gates[name].stage, gates[name].default) == (stage, default), name
        assert gates[name].ignored is (name not in own and name not in ("AllAlpha", "AllBeta")), name


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_refused_and_ignored_flags_say_why(sidecar: str) -> None:
    for flag in parser(sidecar).flags.values():
        if flag.support in (Support.REFUSED, Support.IGNORED):
            assert flag.why, f"--{flag.name} needs the reason kubeloop gives"


# -- the three start-up failures ------------------------------------------------------------


def test_provisioner_takes_the_e2e_manifests_topology_gate() -> None:
    args = parse("external-provisioner", "--feature-gates=Topology=true")
    assert args.gates["Topology"] is True
    assert any("Topology=true" in w for w in args.flag_warnings)  # upstream warns of a GA gate set too


@pytest.mark.parametrize("sidecar", ["external-provisioner", "external-attacher", "external-resizer"])
@pytest.mark.parametrize("value", ["true", "false"])
def test_leader_election_takes_gos_bool_value(sidecar: str, value: str) -> None:
    assert parse(sidecar, f"--leader-election={value}").leader_election is (value == "true")


def test_resizer_takes_a_long_flag_with_one_dash() -> None:
    args = parse("external-resizer", "-v=5", "-csi-address=/csi/csi.sock")
    assert (args.csi_address, args.verbosity) == ("/csi/csi.sock", 5)


# -- the syntax of each library ---------------------------------------------------------------------

GO_SIDECARS = [s for s, syntax in SYNTAX.items() if syntax is Syntax.GO]


@pytest.mark.parametrize("sidecar", GO_SIDECARS)
@pytest.mark.parametrize("spelling", ["-{}=/x.sock", "--{}=/x.sock", "-{} /x.sock", "--{} /x.sock"])
def test_go_flags_take_one_or_two_dashes_and_an_equals_sign_or_a_space(sidecar: str, spelling: str) -> None:
    argv = spelling.format("csi-address").split(" ")
    assert parse(sidecar, *argv).csi_address == "/x.sock"


@pytest.mark.parametrize("spelling", ["--{}=/x.sock", "--{} /x.sock"])
def test_pflag_takes_two_dashes(spelling: str) -> None:
    assert parse("external-provisioner", *spelling.format("csi-address").split(" ")).csi_address == "/x.sock"


def test_pflag_refuses_a_long_flag_with_one_dash_as_upstream_does() -> None:
    assert (
        refused("external-provisioner", "-csi-address=/x.sock")
        == "unknown shorthand flag: 'c' in -csi-address=/x.sock"
    )


@pytest.mark.parametrize("spelling", ["-v=5", "-v 5", "-v5", "--v=5", "--v 5"])
def test_pflag_takes_klogs_verbosity_as_a_shorthand(spelling: str) -> None:
    assert parse("external-provisioner", *spelling.split(" ")).verbosity == 5


@pytest.mark.parametrize("sidecar", SIDECARS)
@pytest.mark.parametrize(
    "text", ["1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False"]
)
def test_bools_take_every_spelling_of_strconv_parsebool(sidecar: str, text: str) -> None:
    dash = "-" if SYNTAX[sidecar] is Syntax.GO else "--"
    args = parse(sidecar, f"{dash}automaxprocs={text}")
    assert args.automaxprocs is (text in ("1", "t", "T", "TRUE", "true", "True"))


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_a_bool_alone_is_true_and_takes_no_separate_value(sidecar: str) -> None:
    """`--bool false` is the flag set and an argument `false`: Go's flag package stops there (the
    flags after it are not read, as upstream reads none), pflag reads on; either way a warning says
    which arguments were ignored."""
    args = parse(sidecar, "--automaxprocs", "false", "--csi-address=/after.sock")
    assert args.automaxprocs is True
    if SYNTAX[sidecar] is Syntax.GO:
        assert args.csi_address == "/run/csi/socket"
        assert any("false --csi-address=/after.sock" in w for w in args.flag_warnings)
    else:
        assert args.csi_address == "/after.sock"
        assert any(w.endswith(": false") for w in args.flag_warnings)


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_a_bad_bool_names_the_flag(sidecar: str) -> None:
    assert "automaxprocs" in refused(sidecar, "--automaxprocs=yes")


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_an_unknown_flag_is_an_error_naming_it(sidecar: str) -> None:
    assert "no-such-flag" in refused(sidecar, "--no-such-flag=1")


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_a_flag_needing_a_value_at_the_end_is_an_error(sidecar: str) -> None:
    assert "flag needs an argument" in refused(sidecar, "--csi-address")


@pytest.mark.parametrize("sidecar", SIDECARS)
@pytest.mark.parametrize("spelling", ["-h", "--help"])
def test_help_exits_zero_with_every_flag(
    sidecar: str, spelling: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parser(sidecar).parse_args([spelling])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for name in parser(sidecar).flags:
        assert f"--{name}" in out


def test_gos_flag_package_stops_at_double_dash() -> None:
    args = parse("external-attacher", "--", "--csi-address=/x.sock")
    assert args.csi_address == "/run/csi/socket"


def test_values_are_read_as_go_reads_them() -> None:
    args = parse(
        "external-attacher",
        "--timeout=1m30s",
        "--worker-threads=0x10",
        "--kube-api-qps=2.5",
        "--retry-interval-start=250ms",
        "--kube-api-burst=010",
    )
    assert (args.timeout, args.worker_threads, args.kube_api_qps) == (90.0, 16, 2.5)
    assert (args.retry_interval_start, args.kube_api_burst) == (0.25, 8)
    assert "missing unit" in refused("external-attacher", "--timeout=10")
    assert "invalid syntax" in refused("external-attacher", "--worker-threads=-1")
    assert "invalid syntax" in refused("external-attacher", "--kube-api-qps=1_0")


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("0", 0.0),
        ("1h2m3.5s", 3723.5),
        ("-1.5h", -5400.0),
        ("300ms", 0.3),
        ("2us", 2e-6),
        ("1µs", 1e-6),
        ("10ns", 1e-8),
    ],
)
def test_durations_are_time_parseduration(text: str, seconds: float) -> None:
    assert goflags.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "s", "1d", "1.s.", "--1s", ".s"])
def test_durations_go_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        goflags.parse_duration(text)


# -- feature gates ----------------------------------------------------------------------------------


def test_feature_gates_add_up_and_the_later_value_wins() -> None:
    args = parse(
        "external-resizer",
        "--feature-gates=AnnotateFsResize=true, ReleaseLeaderElectionOnExit=true",
        "-feature-gates=ReleaseLeaderElectionOnExit=false",
    )
    assert args.gates["AnnotateFsResize"] is True and args.gates["ReleaseLeaderElectionOnExit"] is False


def test_an_unknown_gate_is_upstreams_error() -> None:
    assert "unrecognized feature gate: NoSuchGate" in refused(
        "external-attacher", "--feature-gates=NoSuchGate=true"
    )
    assert "malformed pair" in refused("external-attacher", "--feature-gates=Topology")


def test_a_gate_value_kubeloop_does_not_implement_is_refused_naming_it() -> None:
    error = refused("external-provisioner", "--feature-gates=Topology=false")
    assert "Topology=false" in error and "kubeloop-external-provisioner" in error
    error = refused("external-provisioner", "--feature-gates=AllAlpha=true")
    assert "CrossNamespaceVolumeDataSource=true" in error
    # Named on its own, a gate overrides AllAlpha.
    args = parse("external-provisioner", "--feature-gates=AllAlpha=true,CrossNamespaceVolumeDataSource=false")
    assert args.gates["ReleaseLeaderElectionOnExit"] is True


def test_the_attachers_gate_says_whether_an_attach_error_carries_its_grpc_code() -> None:
    assert attacher.build_parser().parse([]).gates["MutableCSINodeAllocatableCount"] is True
    args = parse("external-attacher", "--feature-gates=MutableCSINodeAllocatableCount=false")
    assert args.gates["MutableCSINodeAllocatableCount"] is False


# -- implemented, ignored, refused ------------------------------------------------------------------


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_an_ignored_flag_is_accepted_with_one_warning_naming_it(sidecar: str) -> None:
    for flag in parser(sidecar).flags.values():
        if flag.support is not Support.IGNORED:
            continue
        value = (
            "true"
            if flag.kind == "bool"
            else "2s"
            if flag.kind == "duration"
            else "a=1"
            if flag.kind == "vmodule"
            else "3"
        )
        args = parse(sidecar, f"--{flag.name}={value}")
        assert [w for w in args.flag_warnings if f"--{flag.name}" in w] == [
            f"ignoring --{flag.name}: {flag.why}"
        ]


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_a_refused_flag_is_an_error_naming_it_unless_at_upstreams_default(sidecar: str) -> None:
    for flag in parser(sidecar).flags.values():
        if flag.support is not Support.REFUSED:
            continue
        other = {"bool": "true", "string": "x", "int": "7", "labels": "a:b", "quantity": "1Ki"}[flag.kind]
        error = refused(sidecar, f"--{flag.name}={other}")
        assert error.startswith(f"--{flag.name} is not implemented by kubeloop-") and flag.why in error
        if flag.default or flag.kind == "string":
            assert not parse(sidecar, f"--{flag.name}={flag.default}").flag_warnings


def test_metrics_address_is_http_endpoints_older_name() -> None:
    assert parse("external-resizer", "--metrics-address=:8080").http_endpoint == ":8080"
    assert "only one of" in refused("external-resizer", "--metrics-address=:8080", "--http-endpoint=:8081")


def test_an_empty_leader_election_namespace_is_the_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "storage")
    assert parse("external-attacher").leader_election_namespace == "storage"
    assert (
        parse("external-attacher", "--leader-election-namespace=kube-system").leader_election_namespace
        == "kube-system"
    )
    monkeypatch.delenv("POD_NAMESPACE")
    assert goflags.in_cluster_namespace(Path("/nonexistent")) == "default"


def test_logging_format_and_kubeloops_older_log_format() -> None:
    assert parse("external-attacher", "--logging-format=json").log_format == "json"
    assert parse("external-attacher", "--log-format=json").log_format == "json"
    assert "logging-format" in refused("external-attacher", "--logging-format=yaml")
    assert parse("external-attacher").verbosity == 0  # klog's default; kubeloop's debug starts at 4


def test_version_prints_and_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse("external-provisioner", "--version")
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("kubeloop-external-provisioner ")


def test_resizers_operation_timeouts() -> None:
    """--resize-timeout and --modify-timeout, unless --timeout is given (upstream's
    resolveOperationTimeouts)."""
    assert resizer.operation_timeouts(parse("external-resizer", "--resize-timeout=20s")) == (20.0, 10.0)
    assert resizer.operation_timeouts(parse("external-resizer", "--timeout=10s", "--modify-timeout=30s")) == (
        10.0,
        10.0,
    )


def test_registrar_checks_what_upstream_checks() -> None:
    with pytest.raises(FlagError, match="kubelet-registration-path is a required parameter"):
        registrar.build_parser().parse([])
    with pytest.raises(SystemExit) as exited:
        parse("node-driver-registrar", "--mode=kubelet-registration-probe")
    assert exited.value.code == 0
    assert parse("node-driver-registrar", "--health-port=9809").http_endpoint == ":9809"
    assert parse("node-driver-registrar", "--health-port=0", "--http-endpoint=:9000").http_endpoint == ":9000"
    assert "Only one of" in refused("node-driver-registrar", "--health-port=9809", "--http-endpoint=:9000")
    args = parse("node-driver-registrar", "--connection-timeout=5s")
    assert args.flag_warnings == ["--connection-timeout is deprecated and will have no effect"]


def test_livenessprobe_serves_on_health_port_unless_http_endpoint_is_given() -> None:
    args = parse("livenessprobe")
    assert (args.http_endpoint, args.probe_timeout) == (":9808", 3.0)
    assert parse("livenessprobe", "--health-port=9898").http_endpoint == ":9898"
    assert parse("livenessprobe", "--health-port=9808", "--http-endpoint=:9000").http_endpoint == ":9000"
    assert "Only one of" in refused("livenessprobe", "--health-port=9898", "--http-endpoint=:9000")
    assert "Only one of" in refused("livenessprobe", "--metrics-address=:1", "--http-endpoint=:9000")


# -- every command line that exists -----------------------------------------------------------------

# The console script and `python -m` module of each sidecar.
SCRIPTS = {f"kubeloop-{name}": name for name in SIDECARS}
PY_MODULES = {
    "external_provisioner.main": "external-provisioner",
    "external_attacher.main": "external-attacher",
    "external_resizer.main": "external-resizer",
    "node_driver_registrar.main": "node-driver-registrar",
    "livenessprobe.main": "livenessprobe",
}
# The images of upstream's sidecars in the e2e suite's manifests.
UPSTREAM_IMAGES = {
    "csi-provisioner": "external-provisioner",
    "csi-attacher": "external-attacher",
    "csi-resizer": "external-resizer",
    "csi-node-driver-registrar": "node-driver-registrar",
    "livenessprobe": "livenessprobe",
}


def sidecar_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """The sidecar an argv runs and its flags, or None for another program."""
    if not argv:
        return None
    if argv[0] in SCRIPTS:
        return SCRIPTS[argv[0]], argv[1:]
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] in PY_MODULES:
        return PY_MODULES[argv[2]], argv[3:]
    return None


def pod_specs(docs: list[Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") not in (
            "Deployment",
            "DaemonSet",
            "StatefulSet",
            "Pod",
        ):
            continue
        pod = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
        for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            yield f"{doc['metadata']['name']}/{c['name']}", c


def manifest_command_lines(path: Path) -> list[tuple[str, list[str]]]:
    docs = list(yaml.safe_load_all(path.read_text()))
    return [
        (f"{path.name}:{name}", [*c.get("command", []), *c.get("args", [])]) for name, c in pod_specs(docs)
    ]


def compose_command_lines(path: Path) -> list[tuple[str, list[str]]]:
    services = yaml.safe_load(path.read_text())["services"]
    return [(f"{path.name}:{name}", list(svc.get("command") or [])) for name, svc in services.items()]


def registry_command_lines() -> list[tuple[str, list[str]]]:
    from localstack.components import NODE_LOCAL_REGISTRY, REGISTRY, ComponentContext
    from localstack.controlplane import Ports

    out = []
    for registry in (REGISTRY, NODE_LOCAL_REGISTRY):
        for comp in registry:
            ctx = ComponentContext(
                name=comp.name,
                home=Path("/home"),
                server="https://127.0.0.1:6443",
                ca_file=Path("/ca.crt"),
                kubeconfig=Path("/kubeconfig"),
                node="node-a" if comp.per_node else None,
                state_dir=Path("/state"),
                http_endpoint="127.0.0.1:18080",
                ports=Ports(),
                repo_root=REPO_ROOT,
            )
            out.append((f"registry:{comp.name}", comp.argv(ctx)))
    return out


def chaos_command_lines() -> list[tuple[str, list[str]]]:
    from tests.chaos.driver import chaos_components

    out = []
    for comp in chaos_components():
        from localstack.components import ComponentContext
        from localstack.controlplane import Ports

        ctx = ComponentContext(
            comp.name, Path("/home"), "https://127.0.0.1:6443", Path("/ca"), Path("/kc"),
            "node-a" if comp.per_node else None, Path("/state"), "127.0.0.1:1", Ports(), REPO_ROOT,
        )  # fmt: skip
        out.append((f"chaos:{comp.name}", comp.argv(ctx)))
    return out


def helm_command_lines() -> list[tuple[str, list[str]]]:
    from tests.support.helm import KUBELOOP, helm_template

    out = []
    for values in ([KUBELOOP], [KUBELOOP, "mode=node-local"]):
        docs = list(yaml.safe_load_all(helm_template(*values).stdout))
        for name, c in pod_specs(docs):
            out.append((f"helm {' '.join(values)}:{name}", [*c.get("command", []), *c.get("args", [])]))
    return out


def kubeloop_command_lines() -> list[tuple[str, str, list[str]]]:
    lines = [*registry_command_lines(), *chaos_command_lines()]
    deploy = REPO_ROOT / "deploy"
    for path in [*sorted((deploy / "kubernetes").glob("*.yaml")), deploy / "node-local" / "kubeloop.yaml"]:
        lines += manifest_command_lines(path)
    for name in ("docker-compose.yml", "docker-compose.node-local.yml"):
        lines += compose_command_lines(REPO_ROOT / name)
    return [(where, *found) for where, argv in lines if (found := sidecar_of(argv)) is not None]


def assert_every_sidecar_parses(lines: list[tuple[str, str, list[str]]], warnings: bool = False) -> None:
    """Each (where, sidecar, argv) parses; with `warnings` False, with no warning either."""
    assert {sidecar for _, sidecar, _ in lines} == set(SIDECARS), "some sidecar is run nowhere"
    for where, sidecar, argv in lines:
        try:
            args = parser(sidecar).parse(argv)
        except FlagError as exc:
            pytest.fail(f"{where}: {sidecar} {' '.join(argv)}: {exc}")
        assert warnings or not args.flag_warnings, (where, args.flag_warnings)


def test_every_command_line_kubeloop_builds_for_its_sidecars_parses() -> None:
    """The local stack's registries (both pool modes), the chaos stack's, deploy/, the compose
    files: each sidecar's argv parses, with no flag ignored."""
    assert_every_sidecar_parses(kubeloop_command_lines())


def test_the_helm_charts_sidecars_parse() -> None:
    assert_every_sidecar_parses(
        [(w, *found) for w, argv in helm_command_lines() if (found := sidecar_of(argv)) is not None]
    )


@cache
def kubernetes_module() -> Path:
    try:
        return go_module_dir("k8s.io/kubernetes", read_versions()["KUBERNETES_VERSION"])
    except MissingUpstream as exc:
        pytest.fail(str(exc))


def e2e_sidecar_command_lines() -> list[tuple[str, str, list[str]]]:
    """Every kubeloop-replaced sidecar container of the e2e suite's storage-csi manifests, with its
    $(VAR) references expanded from its env as kubelet expands them."""
    root = kubernetes_module() / "test" / "e2e" / "testing-manifests" / "storage-csi"
    out = []
    for path in sorted(root.rglob("*.yaml")):
        for name, c in pod_specs(list(yaml.safe_load_all(path.read_text()))):
            match = re.search(r"/([\w-]+):", c.get("image", ""))
            if not match or match.group(1) not in UPSTREAM_IMAGES:
                continue
            env = {e["name"]: e.get("value", "kube-system") for e in c.get("env", [])}
            argv = [expand(a, env) for a in c.get("args", [])]
            out.append((f"{path.relative_to(root)}:{name}", UPSTREAM_IMAGES[match.group(1)], argv))
    return out


def test_the_e2e_suites_sidecar_command_lines_parse_unchanged() -> None:
    """Upstream's own command lines: a GA gate set logs upstream's warning, nothing is refused."""
    assert_every_sidecar_parses(e2e_sidecar_command_lines(), warnings=True)


def test_the_docs_tables_are_made_from_the_declarations() -> None:
    from tests.upstream_flags import DOC, render_doc

    text = DOC.read_text()
    assert text == render_doc(text), (
        "docs/sidecar-flags.md is stale: run `python -m tests.upstream_flags docs`"
    )
    for sidecar in SIDECARS:
        assert f"<!-- flags: {sidecar} -->" in text
