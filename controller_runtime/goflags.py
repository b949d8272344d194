"""The Go command line of kubeloop's CSI sidecars.

kubeloop's external-provisioner, -attacher, -resizer, node-driver-registrar and livenessprobe take
the command lines of their Go counterparts, so that a manifest written for upstream's images runs
kubeloop's unchanged. Each sidecar's `main.py` declares every flag its counterpart registers at the
version `tools/versions.env` pins, and what kubeloop does with it (`Support`):

- IMPLEMENTED: the flag behaves as upstream's.
- IGNORED: kubeloop has nothing the flag could set, and ignoring it changes nothing the cluster or
  the driver sees (Go runtime tuning, pprof, log buffering, worker counts of controllers kubeloop
  runs otherwise); given, it is accepted with one warning line naming it.
- REFUSED: kubeloop does not do what the flag asks; given with any other value than upstream's
  default it is a start-up error naming it, never a silent change of behaviour. At the default it
  asks for nothing, and is accepted.
- OWN: kubeloop's own flag, which upstream's sidecar does not have.

Feature gates (`--feature-gates=A=true,B=false`) are declared the same way, gate by gate (`Gate`).

The syntax is the one of the library upstream's sidecar parses with (`Syntax`), Go's flag package
or spf13/pflag, down to their quirks: a bool flag takes its value only after `=` (`--bool false`
is the flag set to true and the argument `false`), Go's package stops at the first argument that is
not a flag, values are read as Go reads them (strconv.ParseBool, ParseInt with base prefixes,
time.ParseDuration). `docs/sidecar-flags.md` has every sidecar's table.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from .logs import get_logger, setup_logging
from .quantity import parse_quantity
from .version import VERSION

if TYPE_CHECKING:  # imported when run: process brings asyncio, which the threaded sidecars do without
    from . import process, process_threads

log = get_logger("flags")


class Syntax(enum.Enum):
    """The Go library a sidecar parses its command line with."""

    # Go's flag package: `-name` and `--name` alike, `-name=value` and `-name value` (not for a bool),
    # `-h`/`-help`; parsing stops at the first argument that is not a flag, or after `--`.
    GO = "Go's flag package"
    # spf13/pflag: `--name=value` and `--name value` (not for a bool), one dash only for a one-letter
    # shorthand (`-v=5`, `-v 5`, `-v5`), `-h`/`--help`; arguments and flags may be interleaved.
    PFLAG = "spf13/pflag"


class Support(enum.Enum):
    IMPLEMENTED = "implemented"
    IGNORED = "accepted with a warning"
    REFUSED = "refused unless at upstream's default"
    OWN = "kubeloop's own"


Kind = Literal[
    "bool", "string", "int", "uint", "float", "float32", "duration", "level", "gates", "labels", "vmodule",
    "quantity",
]  # fmt: skip


class FlagError(Exception):
    """A command line the sidecar cannot start with; the text names the flag."""


# -- Go's value syntax ------------------------------------------------------------------------------


def parse_bool(text: str) -> bool:
    """strconv.ParseBool, with its error text (the value quoted as Go's %q, which JSON's escaping
    matches for these): flags use it, and so does the provisioner's reading of an annotation, whose
    error reaches an event."""
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise ValueError(f"strconv.ParseBool: parsing {json.dumps(text, ensure_ascii=False)}: invalid syntax")


def _underscores_ok(text: str) -> bool:
    """Go's underscoreOK: an underscore only between digits, or between a base prefix and a digit."""
    body = text.lstrip("+-")
    saw = "^"
    if len(body) >= 2 and body[0] == "0" and body[1] in "bBoOxX":
        body, saw = body[2:], "0"
    for ch in body:
        if ch.isalnum():
            saw = "0"
        elif ch == "_":
            if saw != "0":
                return False
            saw = "_"
        else:
            return False
    return saw != "_"


def _parse_integer(text: str, bits: int, signed: bool, base0: bool = True) -> int:
    """strconv.ParseInt/ParseUint(text, 0 or 10, bits)."""
    what = "ParseInt" if signed else "ParseUint"
    invalid = ValueError(f'strconv.{what}: parsing "{text}": invalid syntax')
    body, negative = text, False
    if signed and body[:1] in ("+", "-"):
        negative, body = body[0] == "-", body[1:]
    if not body:
        raise invalid
    base = 10
    if base0 and body[0] == "0":
        prefix = body[1:2].lower()
        if len(body) >= 3 and prefix in ("b", "o", "x"):
            base, body = {"b": 2, "o": 8, "x": 16}[prefix], body[2:]
        else:
            base, body = 8, body[1:]
    if "_" in body:
        if not base0 or not _underscores_ok(text):
            raise invalid
        body = body.replace("_", "")
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"[:base]
    if not all(ch.lower() in digits for ch in body):
        raise invalid
    value = int(body, base) if body else 0
    value = -value if negative else value
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if not low <= value <= high:
        raise ValueError(f'strconv.{what}: parsing "{text}": value out of range')
    return value


def parse_int(text: str) -> int:
    return _parse_integer(text, 64, signed=True)


def parse_uint(text: str) -> int:
    return _parse_integer(text, 64, signed=False)


def parse_level(text: str) -> int:
    """klog's verbosity (component-base's VerbosityLevel): strconv.ParseUint(text, 10, 31)."""
    return _parse_integer(text, 31, signed=False, base0=False)


_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_HEX = re.compile(r"[+-]?0[xX]([0-9a-fA-F_]+\.?[0-9a-fA-F_]*|\.[0-9a-fA-F_]+)[pP][+-]?\d+")
_SPECIAL = re.compile(r"[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _parse_float(text: str, bits: int) -> float:
    """strconv.ParseFloat(text, bits): decimal, hexadecimal with a p exponent, inf, nan."""
    if _SPECIAL.fullmatch(text):
        return float(text)
    if _DECIMAL.fullmatch(text):
        value = float(text)
    elif _HEX.fullmatch(text) and _underscores_ok(text.split("p")[0].split("P")[0]):
        value = float.fromhex(text.replace("_", ""))
    else:
        raise ValueError(f'strconv.ParseFloat: parsing "{text}": invalid syntax')
    if math.isinf(value) or (bits == 32 and abs(value) > 3.4028234663852886e38):
        raise ValueError(f'strconv.ParseFloat: parsing "{text}": value out of range')
    return value


def parse_float(text: str) -> float:
    return _parse_float(text, 64)


def parse_float32(text: str) -> float:
    return _parse_float(text, 32)


_UNITS = {
    "ns": 1,
    "us": 10**3,
    "µs": 10**3,
    "μs": 10**3,
    "ms": 10**6,
    "s": 10**9,
    "m": 60 * 10**9,
    "h": 3600 * 10**9,
}
_MAX_DURATION = (1 << 63) - 1


def parse_duration_ns(text: str) -> int:
    """time.ParseDuration: a signed sequence of decimal numbers, each with a unit (`300ms`,
    `-1.5h`, `2h45m`; ns, us, µs, ms, s, m, h); `0` alone needs none. Nanoseconds."""
    invalid = ValueError(f'time: invalid duration "{text}"')
    s, negative = text, False
    if s[:1] in ("+", "-"):
        negative, s = s[0] == "-", s[1:]
    if s == "0":
        return 0
    if not s:
        raise invalid
    total = 0
    while s:
        match = re.match(r"(\d*)(?:\.(\d*))?", s)
        assert match is not None
        whole, frac = match.group(1), match.group(2)
        if not whole and not frac:
            raise invalid
        s = s[match.end() :]
        unit_match = re.match(r"[^\d.]*", s)
        assert unit_match is not None
        unit = unit_match.group(0)
        if not unit:
            raise ValueError(f'time: missing unit in duration "{text}"')
        if unit not in _UNITS:
            raise ValueError(f'time: unknown unit "{unit}" in duration "{text}"')
        s = s[len(unit) :]
        scale = _UNITS[unit]
        value = int(whole or "0") * scale
        if frac:
            value += int(frac) * scale // 10 ** len(frac)
        total += value
        if total > _MAX_DURATION + (1 if negative else 0):
            raise invalid
    return -total if negative else total


def parse_duration(text: str) -> float:
    """time.ParseDuration, in seconds."""
    return parse_duration_ns(text) / 1e9


def parse_gates(text: str) -> dict[str, bool]:
    """component-base's MapStringBool: `A=true,B=false`; each value a strconv.ParseBool."""
    gates: dict[str, bool] = {}
    for item in text.split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError("malformed pair, expect string=bool")
        key, value = key.strip(), value.strip()
        try:
            gates[key] = parse_bool(value)
        except ValueError as exc:
            raise ValueError(f"invalid value of {key}: {value}, err: {exc}") from None
    return gates


def parse_labels(text: str) -> dict[str, str]:
    """csi-lib-utils' --leader-election-labels: `key:value,key2:value2`."""
    labels: dict[str, str] = {}
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 2:
            raise ValueError(f"malformed item in list of labels: {item}")
        labels[parts[0]] = parts[1]
    return labels


def parse_vmodule(text: str) -> list[tuple[str, int]]:
    """klog's -vmodule: `pattern=N,...`."""
    items = []
    for item in text.split(","):
        if not item:
            continue
        parts = item.split("=")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f'"{item}" does not have the pattern=N format')
        try:
            items.append((parts[0], parse_level(parts[1])))
        except ValueError as exc:
            raise ValueError(f'parsing verbosity in "{item}": {exc}') from None
    return items


def _parse_string(text: str) -> str:
    return text


_QUANTITY = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?")


def _parse_quantity(text: str) -> int:
    """resource.Quantity, in units."""
    if not _QUANTITY.fullmatch(text):
        raise ValueError(
            "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
        )
    return parse_quantity(text)


PARSERS: dict[str, Callable[[str], Any]] = {
    "bool": parse_bool,
    "string": _parse_string,
    "int": parse_int,
    "uint": parse_uint,
    "float": parse_float,
    "float32": parse_float32,
    "duration": parse_duration,
    "level": parse_level,
    "gates": parse_gates,
    "labels": parse_labels,
    "vmodule": parse_vmodule,
    "quantity": _parse_quantity,
}
# Values that add up over repeated flags (a Var whose Set merges) rather than the last one winning.
_MERGED = {"gates", "labels", "vmodule"}
# The type word Go's and pflag's usage print after a flag's name.
_TYPE_WORD = {
    "bool": "",
    "float32": "float",
    "gates": "mapStringBool",
    "labels": "value",
    "vmodule": "pattern=N,...",
    "level": "Level",
}


# -- declarations -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    name: str
    kind: Kind
    default: str  # upstream's default as its usage prints it, parsed like any value ("" for a Var)
    help: str
    support: Support = Support.IMPLEMENTED
    why: str = ""  # for IGNORED and REFUSED: what kubeloop does instead, in the warning or error
    dest: str = ""  # the attribute it sets; the name with underscores by default
    shorthand: str = ""  # pflag's one-letter form (klog's -v)
    choices: tuple[str, ...] = ()

    @property
    def attr(self) -> str:
        return self.dest or self.name.replace("-", "_")

    def initial(self) -> Any:
        if self.kind in _MERGED and not self.default:
            return [] if self.kind == "vmodule" else {}
        return PARSERS[self.kind](self.default)


@dataclass(frozen=True)
class Gate:
    """A feature gate upstream's sidecar knows, and what kubeloop does with it."""

    name: str
    default: bool
    stage: Literal["ALPHA", "BETA", "GA", "DEPRECATED"]
    # The one value kubeloop behaves as, or None when both are implemented (read from args.gates).
    kubeloop: bool | None = None
    why: str = ""
    locked: bool = False  # LockToDefault: upstream refuses the other value itself
    # A gate upstream's binary knows but the sidecar does not act on (k8s.io/apiserver's, which its
    # feature package registers): either value is accepted, with a warning line naming it.
    ignored: bool = False


ALL_GATES = (Gate("AllAlpha", False, "ALPHA"), Gate("AllBeta", False, "BETA"))

_APISERVER_GATE = (
    "a gate k8s.io/apiserver registers in upstream's binary, which imports its feature package; it "
    "gates API server code, which a sidecar does not run"
)


# k8s.io/apiserver's gates as upstream's --help lists them, by the apiserver minor its go.mod pins
# (the provisioner v0.36, the attacher and resizer v0.37).
APISERVER_GATES = {
    "v0.36": """
APIResponseCompression=BETA:true APIServerIdentity=BETA:true APIServingWithRoutine=ALPHA:false
AllowParsingUserUIDFromCertAuth=BETA:true AllowUnsafeMalformedObjectDeletion=ALPHA:false
CBORServingAndStorage=ALPHA:false ComponentFlagz=BETA:true ComponentStatusz=BETA:true
ConcurrentWatchObjectDecode=BETA:false ConstrainedImpersonation=BETA:true CoordinatedLeaderElection=BETA:false
DeclarativeValidationBeta=BETA:true DetectCacheInconsistency=BETA:true ListFromCacheSnapshot=BETA:true
ManifestBasedAdmissionControlConfig=ALPHA:false NativeHistograms=ALPHA:false OpenAPIEnums=BETA:true
RemoteRequestHeaderUID=BETA:true ShardedListAndWatch=ALPHA:false SizeBasedListCostEstimate=BETA:true
StorageVersionAPI=ALPHA:false StorageVersionHash=BETA:true
StructuredAuthenticationConfigurationEgressSelector=BETA:true
StructuredAuthenticationConfigurationJWKSMetrics=BETA:true TokenRequestServiceAccountUIDValidation=BETA:true
UnauthenticatedHTTP2DOSMitigation=BETA:true UnknownVersionInteroperabilityProxy=BETA:true
WatchCacheInitializationPostStartHook=BETA:true WatchList=BETA:true
""",
    "v0.37": """
APIResponseCompression=BETA:true APIServerIdentity=BETA:true
APIServerWebhookAuthenticationToken=ALPHA:false APIServingWithRoutine=ALPHA:false
AllowParsingUserUIDFromCertAuth=BETA:true AllowUnsafeMalformedObjectDeletion=BETA:true
CBORServingAndStorage=ALPHA:false ComponentFlagz=BETA:true ComponentStatusz=BETA:true
ConcurrentWatchObjectDecode=BETA:true ConsistentListFromCacheSkipTimeoutFallback=ALPHA:false
ConstrainedImpersonation=BETA:true CoordinatedLeaderElection=BETA:false
DeclarativeValidationBeta=BETA:true DetectCacheInconsistency=BETA:true EtcdRangeStream=BETA:true
ExcludeAdmissionWebhookVirtualResources=BETA:true ListFromCacheSnapshot=BETA:true
ManifestBasedAdmissionControlConfig=BETA:true NativeHistograms=BETA:true OpenAPIEnums=BETA:true
RemoteRequestHeaderUID=BETA:true ShardedListAndWatch=ALPHA:false SizeBasedListCostEstimate=BETA:true
StorageVersionAPI=ALPHA:false StorageVersionHash=BETA:true
StructuredAuthenticationConfigurationEgressSelector=BETA:true
StructuredAuthenticationConfigurationJWKSMetrics=BETA:true
TokenRequestServiceAccountUIDValidation=BETA:true UnauthenticatedHTTP2DOSMitigation=BETA:true
UnknownVersionInteroperabilityProxy=BETA:true WatchList=BETA:true WatchListCompression=BETA:true
WebhookRoundTripLoadBalancing=BETA:true
""",
}


def apiserver_gates(minor: str) -> list[Gate]:
    """k8s.io/apiserver's gates of that minor (APISERVER_GATES, `Name=STAGE:default ...`): upstream's
    sidecars import its feature package, which registers them beside their own. GA and deprecated
    ones, which --help does not list, are not declared (a command line naming one is refused as an
    unknown gate, where upstream would take it and do nothing)."""
    gates = []
    for item in APISERVER_GATES[minor].split():
        name, _, spec = item.partition("=")
        stage, _, default = spec.partition(":")
        assert stage in ("ALPHA", "BETA"), item
        gates.append(Gate(name, default == "true", stage, ignored=True, why=_APISERVER_GATE))  # type: ignore[arg-type]
    return gates


# The controller sidecars' gate for a graceful stop. kubeloop's sidecars always stop in order on
# SIGTERM and release their Lease (process.py), which is what the gate turns on upstream; with it off
# upstream's sidecar exits at once and a standby waits for the Lease to expire.
RELEASE_ON_EXIT = Gate(
    "ReleaseLeaderElectionOnExit",
    False,
    "ALPHA",
    why="either value is accepted: kubeloop always stops in order on SIGTERM and releases its Lease, "
    "as upstream does with the gate on",
)


# -- the parser -------------------------------------------------------------------------------------

Settle = Callable[[argparse.Namespace], None]


@dataclass
class FlagSet:
    """One sidecar's command line: upstream's flags in upstream's syntax, and kubeloop's own."""

    prog: str
    description: str
    syntax: Syntax
    upstream: str  # the counterpart and version, for --help: `external-provisioner v6.3.0`
    flags: dict[str, Flag] = field(default_factory=dict)
    gates: dict[str, Gate] = field(default_factory=dict)
    # Checks and derived values after parsing (FlagError for a combination that cannot run).
    settle: list[Settle] = field(default_factory=list)

    def add(self, *flags: Flag) -> None:
        for flag in flags:
            if flag.name in self.flags:
                raise ValueError(f"flag --{flag.name} declared twice")
            self.flags[flag.name] = flag

    def add_gates(self, *gates: Gate) -> None:
        for gate in (*ALL_GATES, *gates):
            self.gates[gate.name] = gate

    def _shorthands(self) -> dict[str, Flag]:
        return {f.shorthand: f for f in self.flags.values() if f.shorthand}

    # -- reading the command line --

    def parse_args(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """Parses `argv` (sys.argv[1:] by default); prints usage and exits 0 for help, prints the
        error and exits 2 for a command line it refuses. Sets every flag's attribute, and `given`
        (the names on the command line), `gates` (every known gate's value) and `flag_warnings`
        (the lines to log once logging is set up)."""
        try:
            return self.parse(sys.argv[1:] if argv is None else list(argv))
        except _Help:
            sys.stdout.write(self.usage())
            raise SystemExit(0) from None
        except FlagError as exc:
            self.error(str(exc))

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message}\nRun `{self.prog} --help` for the flags it takes.\n")
        raise SystemExit(2)

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """parse_args without the exits: raises FlagError (and _Help)."""
        values: dict[str, Any] = {}
        given: list[str] = []
        rest = self._scan(argv, values, given)
        args = argparse.Namespace(**{f.attr: f.initial() for f in self.flags.values()})
        for name, value in values.items():
            setattr(args, self.flags[name].attr, value)
        args.given = frozenset(given)
        args.flag_warnings = []
        if rest:
            args.flag_warnings.append(
                f"ignoring arguments that are not flags, as upstream's {self.upstream.split()[0]} does: "
                + " ".join(rest)
            )
        self._check_support(args, values)
        args.gates = self._gates(args, args.flag_warnings)
        for settle in self.settle:
            settle(args)
        return args

    def _scan(self, argv: list[str], values: dict[str, Any], given: list[str]) -> list[str]:
        """Reads the flags into `values` as the sidecar's library does; returns the other arguments."""
        args, rest = list(argv), []
        while args:
            s = args.pop(0)
            if len(s) < 2 or s[0] != "-":
                if self.syntax is Syntax.GO:
                    return [s, *args]  # Go's flag package stops at the first non-flag
                rest.append(s)
                continue
            if s == "--":
                return [*rest, *args]
            if self.syntax is Syntax.PFLAG and s[1] != "-":
                self._scan_shorthands(s, args, values, given)
                continue
            dashes = 2 if s[1] == "-" else 1
            name, sep, value = s[dashes:].partition("=")
            if not name or name[0] in "-=":
                raise FlagError(f"bad flag syntax: {s}")
            flag = self.flags.get(name)
            shown = "--" + name if self.syntax is Syntax.PFLAG else "-" + name
            if flag is None:
                if name == "help" or (name == "h" and self.syntax is Syntax.GO):
                    raise _Help()
                if self.syntax is Syntax.PFLAG:
                    raise FlagError(f"unknown flag: {shown}")
                raise FlagError(f"flag provided but not defined: {shown}")
            if not sep:
                if flag.kind == "bool":
                    value = "true"
                elif args:
                    value = args.pop(0)
                else:
                    raise FlagError(f"flag needs an argument: {shown}")
            self._set(flag, value, shown, values, given)
        return rest

    def _scan_shorthands(self, s: str, args: list[str], values: dict[str, Any], given: list[str]) -> None:
        """pflag's `-abc`, `-v=5`, `-v5`, `-v 5`."""
        shorts = s[1:]
        table = self._shorthands()
        while shorts:
            c, shorts = shorts[0], shorts[1:]
            flag = table.get(c)
            if flag is None:
                if c == "h":
                    raise _Help()
                raise FlagError(f"unknown shorthand flag: '{c}' in {s}")
            if shorts.startswith("="):
                value, shorts = shorts[1:], ""
            elif flag.kind == "bool":
                value = "true"
            elif shorts:
                value, shorts = shorts, ""
            elif args:
                value = args.pop(0)
            else:
                raise FlagError(f"flag needs an argument: '{c}' in {s}")
            self._set(flag, value, f"-{c}, --{flag.name}", values, given)

    def _set(self, flag: Flag, text: str, shown: str, values: dict[str, Any], given: list[str]) -> None:
        try:
            value = PARSERS[flag.kind](text)
        except ValueError as exc:
            if self.syntax is Syntax.PFLAG:
                raise FlagError(f'invalid argument "{text}" for "{shown}" flag: {exc}') from None
            if flag.kind == "bool":
                raise FlagError(f'invalid boolean value "{text}" for {shown}: {exc}') from None
            raise FlagError(f'invalid value "{text}" for flag {shown}: {exc}') from None
        if flag.choices and value not in flag.choices:
            raise FlagError(f'invalid value "{text}" for flag {shown}: one of {", ".join(flag.choices)}')
        if flag.kind in _MERGED and flag.name in values:
            previous = values[flag.name]
            value = [*previous, *value] if isinstance(previous, list) else {**previous, **value}
        values[flag.name] = value
        if flag.name not in given:
            given.append(flag.name)

    def _check_support(self, args: argparse.Namespace, values: dict[str, Any]) -> None:
        for name, value in values.items():
            flag = self.flags[name]
            if flag.support is Support.IGNORED:
                args.flag_warnings.append(f"ignoring --{name}: {flag.why}")
            elif flag.support is Support.REFUSED and value != flag.initial():
                raise FlagError(
                    f"--{name} is not implemented by {self.prog}: {flag.why} "
                    f"(leave it out, or at upstream's default {flag.default!r})"
                )

    def _gates(self, args: argparse.Namespace, warnings: list[str]) -> dict[str, bool]:
        """featuregate.SetFromMap over the --feature-gates flags given, then kubeloop's own check."""
        asked: dict[str, bool] = getattr(args, "feature_gates", None) or {}
        effective = {gate.name: gate.default for gate in self.gates.values()}
        for name, value in asked.items():
            gate = self.gates.get(name)
            if gate is None:
                raise FlagError(f"--feature-gates: unrecognized feature gate: {name}")
            if gate.locked and value != gate.default:
                raise FlagError(
                    f"--feature-gates: cannot set feature gate {name} to {str(value).lower()}, "
                    f"feature is locked to {str(gate.default).lower()}"
                )
            if gate.ignored:
                warnings.append(f"ignoring feature gate {name}: {gate.why}")
            elif gate.stage in ("GA", "DEPRECATED"):
                warnings.append(
                    f"setting {gate.stage} feature gate {name}={str(value).lower()}; "
                    "upstream will remove it in a future release"
                )
        # AllAlpha and AllBeta set every gate of their stage that is not named on its own.
        for special, stage in (("AllAlpha", "ALPHA"), ("AllBeta", "BETA")):
            if special in asked:
                for gate in self.gates.values():
                    if gate.stage == stage and gate.name not in asked:
                        effective[gate.name] = asked[special]
        effective.update(asked)
        for gate in self.gates.values():
            want = effective[gate.name]
            if (
                gate.kubeloop is not None
                and want != gate.kubeloop
                and gate.name not in ("AllAlpha", "AllBeta")
            ):
                raise FlagError(
                    f"--feature-gates: {gate.name}={str(want).lower()} is not implemented by {self.prog}: "
                    f"{gate.why}"
                )
        return effective

    # -- --help --

    def usage(self) -> str:
        dash = "--"  # Go's flag package prints one; both spellings work there, and two read better
        out = [
            f"Usage: {self.prog} [flags]",
            "",
            *textwrap.wrap(self.description, 100),
            "",
            *textwrap.wrap(
                f"Takes the flags of upstream's {self.upstream} in its syntax ({self.syntax.value}): "
                + (
                    "-name or --name, -name=value or -name value; a bool flag takes a value only "
                    "after = (-name=false); the flags end at the first argument that is not one."
                    if self.syntax is Syntax.GO
                    else "--name=value or --name value, -v=5 for klog's verbosity; a bool flag takes "
                    "a value only after = (--name=false)."
                ),
                100,
            ),
        ]
        for support, title in (
            (Support.IMPLEMENTED, "Flags (as upstream's)"),
            (Support.OWN, "kubeloop's own flags (not upstream's)"),
            (Support.IGNORED, "Accepted and ignored, with a warning line"),
            (Support.REFUSED, "Not implemented: refused unless at upstream's default"),
        ):
            flags = sorted((f for f in self.flags.values() if f.support is support), key=lambda f: f.name)
            if not flags:
                continue
            out += ["", f"{title}:"]
            for flag in flags:
                out += self._usage_lines(flag, dash, show_why=support in (Support.IGNORED, Support.REFUSED))
        if self.gates:
            out += ["", "Feature gates (--feature-gates=Name=true|false,...):"]
            for gate in sorted((g for g in self.gates.values() if not g.ignored), key=lambda g: g.name):
                line = f"  {gate.name}=true|false ({gate.stage} - default={str(gate.default).lower()})"
                if gate.kubeloop is not None and gate.name not in ("AllAlpha", "AllBeta"):
                    line += f"; kubeloop: only {str(gate.kubeloop).lower()}"
                out.append(line)
                if gate.why:
                    out += textwrap.wrap(gate.why, 100, initial_indent="      ", subsequent_indent="      ")
            ignored = sorted(g.name for g in self.gates.values() if g.ignored)
            if ignored:
                out += textwrap.wrap(
                    f"Accepted with a warning ({_APISERVER_GATE}): {', '.join(ignored)}.",
                    100,
                    initial_indent="  ",
                    subsequent_indent="  ",
                )
        return "\n".join(out) + "\n"

    @staticmethod
    def _usage_lines(flag: Flag, dash: str, show_why: bool) -> list[str]:
        word = _TYPE_WORD.get(flag.kind, flag.kind)
        head = f"  {'-' + flag.shorthand + ', ' if flag.shorthand else ''}{dash}{flag.name}"
        head += f" {word}" if word else ""
        text = flag.help
        if flag.default not in ("", "0", "0s", "false") or (flag.kind == "string" and flag.default):
            shown = f'"{flag.default}"' if flag.kind == "string" else flag.default
            text += f" (default {shown})"
        if show_why and flag.why:
            text += f" [kubeloop: {flag.why}]"
        return [head, *textwrap.wrap(text, 100, initial_indent="      ", subsequent_indent="      ")]


class _Help(Exception):
    pass


# -- what the sidecars share ------------------------------------------------------------------------


def standard_flags() -> list[Flag]:
    """csi-lib-utils' standardflags.RegisterCommonFlags (the controller sidecars' common flags)."""
    return [
        Flag("version", "bool", "false", "print the version and exit"),
        Flag(
            "csi-address",
            "string",
            "/run/csi/socket",
            "the CSI driver's socket (a path, or unix:///path)",
        ),
        Flag(
            "http-endpoint",
            "string",
            "",
            "host:port serving /metrics, /healthz and /readyz; an empty host (:8080) listens on every "
            "interface; empty disables it",
        ),
        Flag(
            "metrics-address",
            "string",
            "",
            "(deprecated) the same as --http-endpoint; only one of the two may be set",
        ),
        Flag(
            "metrics-path",
            "string",
            "/metrics",
            "the HTTP path of the Prometheus metrics",
            Support.REFUSED,
            "kubeloop serves its metrics at /metrics only",
        ),
        Flag(
            "kubeconfig",
            "string",
            "",
            "path to a kubeconfig; empty means the in-cluster configuration (kubeloop reads $KUBECONFIG "
            "when the flag is not given)",
        ),
        Flag("kube-api-qps", "float", "5", "steady requests per second to the API server, client side"),
        Flag("kube-api-burst", "int", "10", "requests allowed above --kube-api-qps in a burst"),
        Flag(
            "leader-election",
            "bool",
            "false",
            "run only while holding a coordination.k8s.io Lease, so replicas can stand by",
        ),
        Flag(
            "leader-election-namespace",
            "string",
            "",
            "namespace of the Lease; empty means $POD_NAMESPACE, else the service account's namespace, "
            "else default",
        ),
        Flag(
            "leader-election-lease-duration",
            "duration",
            "15s",
            "how long a lease is valid without renewal",
        ),
        Flag(
            "leader-election-renew-deadline",
            "duration",
            "10s",
            "how long the leader keeps trying to renew before it gives up",
        ),
        Flag(
            "leader-election-retry-period",
            "duration",
            "5s",
            "interval between attempts to acquire or renew",
        ),
        Flag(
            "leader-election-labels",
            "labels",
            "",
            "labels (key:value,...) put on the Lease by the replica that leads",
            Support.REFUSED,
            "kubeloop's Lease carries no labels",
        ),
    ]


AUTOMAXPROCS = Flag(
    "automaxprocs",
    "bool",
    "false",
    "set GOMAXPROCS to the container's CPU quota",
    Support.IGNORED,
    "a Go runtime setting; kubeloop is one Python process with one event loop",
)

PPROF = Flag(
    "enable-pprof",
    "bool",
    "false",
    "serve Go's pprof profiles at /debug/pprof/ on --http-endpoint",
    Support.IGNORED,
    "Go's profiler; kubeloop serves no /debug/pprof/",
)

_ALPHA_LOGGING = "upstream refuses it too: it needs the LoggingAlphaOptions gate, which no flag turns on"


def logging_flags(syntax: Syntax) -> list[Flag]:
    """component-base's logs/api/v1 flags (logsapi.AddGoFlags or AddFlags, with the json format
    registered), and kubeloop's own --log-format."""
    return [
        Flag(
            "logging-format",
            "string",
            "text",
            "the log format: text (key=value lines) or json (one object per line)",
            choices=("text", "json"),
        ),
        Flag(
            "log-format",
            "string",
            "",
            "kubeloop's older name of --logging-format",
            Support.OWN,
            choices=("", "text", "json"),
        ),
        Flag(
            "v",
            "level",
            "0",
            "log verbosity as klog's; kubeloop logs its debug lines from 4 on",
            dest="verbosity",
            shorthand="v" if syntax is Syntax.PFLAG else "",
        ),
        Flag(
            "vmodule",
            "vmodule",
            "",
            "per-file verbosity (pattern=N,...)",
            Support.IGNORED,
            "kubeloop's verbosity is one level for the whole process (-v)",
        ),
        Flag(
            "log-flush-frequency",
            "duration",
            "5s",
            "the longest time between log flushes",
            Support.IGNORED,
            "kubeloop writes every log line at once",
        ),
        Flag(
            "log-text-split-stream",
            "bool",
            "false",
            "[Alpha] text format: errors to stderr, info to stdout",
            Support.REFUSED,
            _ALPHA_LOGGING,
        ),
        Flag(
            "log-text-info-buffer-size",
            "quantity",
            "0",
            "[Alpha] text format with split streams: bytes of info messages buffered",
            Support.REFUSED,
            _ALPHA_LOGGING,
        ),
        Flag(
            "log-json-split-stream",
            "bool",
            "false",
            "[Alpha] json format: errors to stderr, info to stdout",
            Support.REFUSED,
            _ALPHA_LOGGING,
        ),
        Flag(
            "log-json-info-buffer-size",
            "quantity",
            "0",
            "[Alpha] json format with split streams: bytes of info messages buffered",
            Support.REFUSED,
            _ALPHA_LOGGING,
        ),
    ]


def feature_gates_flag() -> Flag:
    return Flag(
        "feature-gates",
        "gates",
        "",
        "feature gates, Name=true|false,... (the gates are listed below)",
    )


MASTER = Flag(
    "master",
    "string",
    "",
    "the API server's URL, overriding the kubeconfig's",
    Support.REFUSED,
    "kubeloop reads the API server from --kubeconfig or the in-cluster configuration",
)


def retry_flags(
    start: str = "first retry delay after a failure, doubling with each failure",
    longest: str = "longest retry delay",
) -> list[Flag]:
    """The controller sidecars' per-object backoff, 1s doubling to 5m."""
    return [
        Flag("retry-interval-start", "duration", "1s", start),
        Flag("retry-interval-max", "duration", "5m0s", longest),
    ]


def controller_sidecar(prog: str, description: str, syntax: Syntax, upstream: str) -> FlagSet:
    """The command line the provisioner, attacher and resizer share: csi-lib-utils' common flags,
    the logging flags, --automaxprocs and --feature-gates, and what they mean together."""
    flags = FlagSet(prog, description, syntax, upstream)
    flags.add(*standard_flags(), *logging_flags(syntax), AUTOMAXPROCS, feature_gates_flag())
    flags.settle += [settle_standard, settle_version(prog)]
    return flags


def node_sidecar(prog: str, description: str, upstream: str) -> FlagSet:
    """The command line the registrar and the livenessprobe share (Go's flag package): the logging
    flags and --automaxprocs."""
    flags = FlagSet(prog, description, Syntax.GO, upstream)
    flags.add(*logging_flags(Syntax.GO), AUTOMAXPROCS)
    flags.settle.append(settle_logging)
    return flags


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def in_cluster_namespace(path: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """csi-lib-utils' namespace for an empty --leader-election-namespace: $POD_NAMESPACE, else the
    service account's namespace, else `default`."""
    if ns := os.environ.get("POD_NAMESPACE", ""):
        return ns
    try:
        ns = path.read_text().strip()
    except OSError:
        ns = ""
    return ns or "default"


def settle_standard(args: argparse.Namespace) -> None:
    """What csi-lib-utils' flags mean together: --metrics-address is --http-endpoint's older name, an
    empty --leader-election-namespace the pod's namespace, an empty --kubeconfig $KUBECONFIG (else
    the in-cluster configuration); and --logging-format or --log-format."""
    if getattr(args, "metrics_address", "") and getattr(args, "http_endpoint", ""):
        raise FlagError("only one of `--metrics-address` and `--http-endpoint` can be set.")
    if getattr(args, "metrics_address", ""):
        args.http_endpoint = args.metrics_address
    if hasattr(args, "kubeconfig") and not args.kubeconfig:
        args.kubeconfig = os.environ.get("KUBECONFIG", "")  # kubeloop's, and the provisioner's
    if hasattr(args, "leader_election_namespace") and not args.leader_election_namespace:
        args.leader_election_namespace = in_cluster_namespace()
    settle_logging(args)


def settle_logging(args: argparse.Namespace) -> None:
    if (
        "log-format" in args.given
        and "logging-format" in args.given
        and args.log_format != args.logging_format
    ):
        raise FlagError(
            "--log-format and --logging-format disagree; --log-format is the older name of the other"
        )
    if "log-format" not in args.given:
        args.log_format = args.logging_format


def version_text(prog: str) -> str:
    return f"{prog} {VERSION}"


def settle_version(prog: str) -> Settle:
    """--version prints the program and kubeloop's version and exits, as upstream's print theirs."""

    def settle(args: argparse.Namespace) -> None:
        if args.version:
            sys.stdout.write(version_text(prog) + "\n")
            raise SystemExit(0)

    return settle


def _settle(flags: FlagSet, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses the command line, sets up logging, logs the warnings parsing left (ignored flags and
    arguments, gates set)."""
    args = flags.parse_args(argv)
    setup_logging(args.log_format, args.verbosity)
    for line in args.flag_warnings:
        log.warning(line)
    return args


def main(flags: FlagSet, run: process.Run, argv: Sequence[str] | None = None) -> None:
    """process.main for a sidecar with a Go command line (process.main takes an argparse parser)."""
    args = _settle(flags, argv)
    import uvloop

    from . import process

    sys.exit(uvloop.run(process._serve(run, args)))


def main_threaded(flags: FlagSet, run: process_threads.Run, argv: Sequence[str] | None = None) -> None:
    """main for a sidecar on threads (controller_runtime.process_threads): node-driver-registrar
    and livenessprobe, which make a call now and then and import no asyncio (issue 49)."""
    args = _settle(flags, argv)
    from . import process_threads

    sys.exit(process_threads.serve(run, args))


def markdown(flags: FlagSet) -> str:
    """One sidecar's tables in docs/sidecar-flags.md: its flags, then its feature gates."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| flag | type | upstream's default | kubeloop |", "|---|---|---|---|"]
    order = {Support.IMPLEMENTED: 0, Support.IGNORED: 1, Support.REFUSED: 2, Support.OWN: 3}
    for flag in sorted(flags.flags.values(), key=lambda f: (order[f.support], f.name)):
        default = "—" if flag.support is Support.OWN else f"`{flag.default}`" if flag.default else "none"
        what = {
            Support.IMPLEMENTED: "as upstream's",
            Support.IGNORED: f"accepted, one warning: {flag.why}",
            Support.REFUSED: f"refused unless at the default: {flag.why}",
            Support.OWN: f"kubeloop's own: {flag.help}",
        }[flag.support]
        kind = _TYPE_WORD.get(flag.kind, flag.kind) or "bool"
        rows.append(f"| `--{flag.name}` | {cell(kind)} | {cell(default)} | {cell(what)} |")
    if flags.gates:
        rows += ["", "| feature gate | stage, default | kubeloop |", "|---|---|---|"]
        for gate in sorted((g for g in flags.gates.values() if not g.ignored), key=lambda g: g.name):
            if gate.name in ("AllAlpha", "AllBeta"):
                what = f"sets every {gate.stage.lower()} gate not named on its own"
            elif gate.kubeloop is None:
                what = f"both values: {gate.why}" if gate.why else "both values"
            else:
                what = f"only {str(gate.kubeloop).lower()}, the other refused: {gate.why}"
            rows.append(f"| `{gate.name}` | {gate.stage}, {str(gate.default).lower()} | {cell(what)} |")
        ignored = sorted(g.name for g in flags.gates.values() if g.ignored)
        if ignored:
            names = ", ".join(f"`{n}`" for n in ignored)
            rows.append(f"| {names} | as upstream's | accepted, one warning: {_APISERVER_GATE} |")
    return "\n".join(rows) + "\n"
