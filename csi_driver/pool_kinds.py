"""Pool kinds, as csi-driver-host-path's `--capacity kind=size`: one pool split into named budgets
("fast", "slow", ...) that a StorageClass chooses with the parameter `kind`. Pure: the flag's
values and the choice a request makes; the controller counts what each kind holds."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import invalid
from .validation import parse_size

KIND_PARAMETER = "kind"
# A kind travels in a StorageClass parameter and in log lines: a plain name, like a label value.
_KIND = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True)
class PoolCapacity:
    """What `--capacity` offers: one size for the whole pool (0: the pool filesystem's free
    space), or a size per kind, never both."""

    total: int = 0
    kinds: Mapping[str, int] = field(default_factory=dict)

    @property
    def budgeted(self) -> bool:
        """Whether records are counted against a configured size (else the filesystem decides)."""
        return bool(self.total or self.kinds)


def parse_capacity(text: str) -> tuple[str, int]:
    """One `--capacity` value: `SIZE` (kind "") or `KIND=SIZE`. ValueError says what is wrong."""
    kind, sep, size = text.rpartition("=")
    if sep and not _KIND.fullmatch(kind):
        raise ValueError(
            f"pool kind {kind!r} must be 1-63 letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    return kind, parse_size(size)


def pool_capacity(values: Sequence[tuple[str, int]]) -> PoolCapacity:
    """The `--capacity` flags together: the last unnamed size, or every kind's (the last of a
    repeated kind). ValueError when both forms are given: a volume would not know which budget
    it takes from."""
    kinds = {kind: size for kind, size in values if kind}
    unnamed = [size for kind, size in values if not kind]
    if kinds and unnamed:
        raise ValueError("--capacity SIZE and --capacity KIND=SIZE do not mix; give every size a kind")
    return PoolCapacity(total=unnamed[-1] if unnamed else 0, kinds=kinds)


def capacity_of_node(table: str, node: str) -> list[tuple[str, int]] | None:
    """This node's entry in a `--capacity-per-node` file: the `--capacity` values its pool offers
    instead of the flags', or None when the file names no such node (the flags then hold). The
    file is a JSON object of node name to a list of `[KIND=]SIZE` (the Helm chart's
    capacityPerNode, in a ConfigMap every node plugin mounts). Only this node's entry is read, so
    a mistake in another node's stops that node alone. ValueError says what is wrong."""
    try:
        nodes = json.loads(table)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from e
    if not isinstance(nodes, dict):
        raise ValueError("must be a JSON object of node name to a list of [KIND=]SIZE")
    entry = nodes.get(node)
    if entry is None:
        return None
    if not isinstance(entry, list) or not entry or not all(isinstance(v, str) for v in entry):
        raise ValueError(f"node {node!r}: must be a non-empty list of [KIND=]SIZE strings, not {entry!r}")
    try:
        return [parse_capacity(v) for v in entry]
    except ValueError as e:
        raise ValueError(f"node {node!r}: {e}") from e


def known_kinds(capacity: PoolCapacity) -> str:
    return ", ".join(sorted(capacity.kinds)) or "none (no --capacity KIND=SIZE)"


def chosen_kind(parameters: Mapping[str, str], capacity: PoolCapacity) -> str:
    """The kind a request's parameters choose: "" on a pool without kinds; on a pool with kinds
    one of them, which the class must name (no default: a class that forgot its kind would
    quietly spend another kind's budget). INVALID_ARGUMENT naming the known kinds."""
    kind = parameters.get(KIND_PARAMETER, "")
    if kind and kind not in capacity.kinds:
        raise invalid(f"pool kind {kind[:100]!r} is unknown; this pool's kinds: {known_kinds(capacity)}")
    if capacity.kinds and not kind:
        raise invalid(
            f"this pool is split into kinds ({known_kinds(capacity)}); choose one with the "
            f"StorageClass parameter {KIND_PARAMETER!r}"
        )
    return kind
