"""The flags of the Go CSI sidecars kubeloop replaces, at the versions tools/versions.env pins.

csi-provisioner, csi-attacher and csi-resizer are built by tools/build-binaries.sh: their lists come
from the binaries' own `--help`, read live (a missing binary is a failure naming the build command).
node-driver-registrar and livenessprobe are not built: the Go module proxy serves neither (their v2
tags have no /v2 module path), so their lists are recorded under tests/unit/upstream-flags/, one
file per pinned version, from the `--help` of a binary built from the tag's vendored source:

    git archive v2.17.0 | tar -x -C /tmp/ndr
    (cd /tmp/ndr && go build -mod=vendor ./cmd/csi-node-driver-registrar)
    python -m tests.upstream_flags record node-driver-registrar /tmp/ndr/csi-node-driver-registrar

When a pin moves the recorded file of the new version is missing, and the flag test says so.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from controller_runtime import goflags, toolchain
from controller_runtime.toolchain import REPO_ROOT, MissingBinaryError, Toolchain
from localstack.go_sidecars import ATTACHER, PROVISIONER, RESIZER, GoSidecar, go_sidecar_binary

RECORDED = REPO_ROOT / "tests" / "unit" / "upstream-flags"

# Each sidecar kubeloop replaces: its pin in tools/versions.env and, for the built ones, its binary.
BUILT: dict[str, GoSidecar] = {
    "external-provisioner": PROVISIONER,
    "external-attacher": ATTACHER,
    "external-resizer": RESIZER,
}
PINS = {
    "external-provisioner": "EXTERNAL_PROVISIONER_VERSION",
    "external-attacher": "EXTERNAL_ATTACHER_VERSION",
    "external-resizer": "EXTERNAL_RESIZER_VERSION",
    "node-driver-registrar": "NODE_DRIVER_REGISTRAR_VERSION",
    "livenessprobe": "LIVENESSPROBE_VERSION",
}


@dataclass(frozen=True)
class UpstreamFlag:
    name: str
    type: str  # the word its usage prints after the name ("" for a bool; may be a backquoted name)
    default: str  # as its usage prints it, unquoted; "" when it prints none (the zero value)


@dataclass(frozen=True)
class UpstreamFlags:
    sidecar: str
    version: str
    flags: dict[str, UpstreamFlag]
    gates: dict[str, tuple[str, bool]]  # name -> (stage, default)


# The Go modules of the built ones, whose pkg/features declares their own gates.
MODULES = {
    "external-provisioner": "github.com/kubernetes-csi/external-provisioner/v6",
    "external-attacher": "github.com/kubernetes-csi/external-attacher/v4",
    "external-resizer": "github.com/kubernetes-csi/external-resizer/v2",
}
_SOURCE_GATE = re.compile(r"(\w+):\s*\{Default: (true|false), PreRelease: featuregate\.(\w+)")


def go_module_dir(module: str, version: str) -> Path:
    """A module's source in the Go module cache (`go mod download` fetches it through the proxy)."""
    try:
        return toolchain.go_module_dir(module, version)
    except toolchain.MissingModuleError as exc:
        raise MissingUpstream(str(exc)) from exc


def source_gates(sidecar: str, tools: Toolchain | None = None) -> dict[str, tuple[str, bool]]:
    """The gates a built sidecar's own pkg/features declares, GA ones included (--help lists no
    GA or deprecated gate)."""
    tools = tools or Toolchain.default()
    root = go_module_dir(MODULES[sidecar], tools.versions[PINS[sidecar]])
    text = "\n".join(
        p.read_text() for p in sorted((root / "pkg" / "features").glob("*.go")) if "_test" not in p.name
    )
    return {name: (stage.upper(), default == "true") for name, default, stage in _SOURCE_GATE.findall(text)}


class MissingUpstream(Exception):
    """An upstream list that is neither built nor recorded; the text says how to get it."""


# Go's flag.PrintDefaults: "  -name type" then usage lines indented "    \t"; a one-letter bool has
# its usage on the same line after a tab.
_GO_FLAG = re.compile(r"^  -([\w.-]+)(?: ([^\t]+))?(?:\t.*)?$")
# pflag's FlagUsages: "  -v, --v Level    usage" or "      --name type    usage".
_PFLAG_FLAG = re.compile(r"^ +(?:-\w, )?--([\w.-]+)(?: (\S+))?(?: {2,}(.*))?$")
_DEFAULT = re.compile(r"\(default (.*)\)\s*$")
_GATE = re.compile(r"\b(\w+)=true\|false \((ALPHA|BETA|GA|DEPRECATED) - default=(true|false)\)")


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def parse_help(text: str) -> tuple[dict[str, UpstreamFlag], dict[str, tuple[str, bool]]]:
    """Flags and feature gates from a Go sidecar's --help, in either library's format."""
    pflag = any(line.lstrip().startswith("--") for line in text.splitlines())
    blocks: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines():
        match = (_PFLAG_FLAG if pflag else _GO_FLAG).match(line)
        if match and not _GATE.search(line):
            name, word = match.group(1), match.group(2) or ""
            first = (match.group(3) or "") if pflag else ""
            blocks.append((name, word, [first]))
        elif blocks:
            blocks[-1][2].append(line)
    flags = {}
    gates: dict[str, tuple[str, bool]] = {}
    for name, word, lines in blocks:
        usage = "\n".join(lines).rstrip()
        default = _DEFAULT.search(usage)
        flags[name] = UpstreamFlag(name, word, _unquote(default.group(1)) if default else "")
        if name == "feature-gates":
            for gate, stage, value in _GATE.findall(usage):
                gates[gate] = (stage, value == "true")
    return flags, gates


def help_of(binary: Path) -> str:
    """A Go binary's --help (to stderr with Go's flag package, to stdout with pflag)."""
    result = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return result.stdout + result.stderr


def recorded_path(sidecar: str, version: str) -> Path:
    return RECORDED / f"{sidecar}-{version}.txt"


def write_recorded(sidecar: str, version: str, text: str) -> Path:
    flags, gates = parse_help(text)
    lines = [
        f"# The flags of upstream's {sidecar} {version}, from the --help of the binary built from the tag's",
        "# vendored source (tests/upstream_flags.py): name, the type word its usage prints (- for none),",
        "# the default it prints (- for none); then its feature gates.",
    ]
    for flag in sorted(flags.values(), key=lambda f: f.name):
        lines.append(f"flag {flag.name} {flag.type or '-'} {flag.default or '-'}")
    for gate, (stage, default) in sorted(gates.items()):
        lines.append(f"gate {gate} {stage} {str(default).lower()}")
    path = recorded_path(sidecar, version)
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def read_recorded(path: Path) -> tuple[dict[str, UpstreamFlag], dict[str, tuple[str, bool]]]:
    flags, gates = {}, {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        kind, name, a, b = line.split(" ", 3)
        if kind == "flag":
            flags[name] = UpstreamFlag(name, "" if a == "-" else a, "" if b == "-" else b)
        else:
            gates[name] = (a, b == "true")
    return flags, gates


def upstream_flags(sidecar: str, tools: Toolchain | None = None) -> UpstreamFlags:
    tools = tools or Toolchain.default()
    version = tools.versions.get(PINS[sidecar], "")
    if not version:
        raise MissingUpstream(f"tools/versions.env pins no {PINS[sidecar]}")
    if sidecar in BUILT:
        try:
            binary = go_sidecar_binary(BUILT[sidecar], tools)
        except MissingBinaryError as exc:
            raise MissingUpstream(str(exc)) from exc
        flags, gates = parse_help(help_of(binary))
        if not flags:
            raise MissingUpstream(f"{binary} --help lists no flags")
    else:
        path = recorded_path(sidecar, version)
        if not path.exists():
            raise MissingUpstream(
                f"{path.relative_to(REPO_ROOT)} is missing: the pin moved to {version}; record the new "
                "version's flags as tests/upstream_flags.py says"
            )
        flags, gates = read_recorded(path)
    return UpstreamFlags(sidecar, version, flags, gates)


DOC = REPO_ROOT / "docs" / "sidecar-flags.md"
_SECTION = re.compile(r"(<!-- flags: ([\w-]+) -->\n)(.*?)(<!-- /flags -->)", re.DOTALL)


def sidecar_parsers() -> dict[str, goflags.FlagSet]:
    from external_attacher.main import build_parser as attacher
    from external_provisioner.main import build_parser as provisioner
    from external_resizer.main import build_parser as resizer
    from livenessprobe.main import build_parser as livenessprobe
    from node_driver_registrar.main import build_parser as registrar

    return {
        "external-provisioner": provisioner(),
        "external-attacher": attacher(),
        "external-resizer": resizer(),
        "node-driver-registrar": registrar(),
        "livenessprobe": livenessprobe(),
    }


def render_doc(text: str) -> str:
    """docs/sidecar-flags.md with each `<!-- flags: NAME -->` section made from NAME's declarations."""
    parsers = sidecar_parsers()
    return _SECTION.sub(lambda m: m.group(1) + goflags.markdown(parsers[m.group(2)]) + m.group(4), text)


if __name__ == "__main__":
    # python -m tests.upstream_flags record <sidecar> <binary> | docs
    if sys.argv[1:] == ["docs"]:
        DOC.write_text(render_doc(DOC.read_text()))
        sys.exit(0)
    if len(sys.argv) != 4 or sys.argv[1] != "record" or sys.argv[2] not in PINS:
        sys.exit(f"usage: python -m tests.upstream_flags record {{{','.join(PINS)}}} BINARY | docs")
    sidecar, binary = sys.argv[2], Path(sys.argv[3])
    version = Toolchain.default().versions[PINS[sidecar]]
    print(write_recorded(sidecar, version, help_of(binary)))
