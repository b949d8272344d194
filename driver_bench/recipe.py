"""A driver recipe: how to run a CSI driver and what its CSIDriver and StorageClass say.

The format (YAML, docs/driver-bench.md) is small on purpose: commands with placeholders, the
environment, a readiness timeout, the Kubernetes objects' fields and a command that lists what the
backend holds. Loading validates everything at once and names the field at fault, so a bad recipe
fails before any process starts."""

from __future__ import annotations

import string
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controller_runtime.quantity import parse_quantity

# What a command, an argument or an environment value may say in braces; the runner fills them in.
PLACEHOLDERS = {
    "python": "the Python interpreter running the bench (for drivers written in Python)",
    "socket": "the path of the unix socket the service must listen on",
    "endpoint": "the same socket as unix:///path (what most drivers' --endpoint wants)",
    "node_id": "the node id the node service must report in NodeGetInfo",
    "state_dir": "a directory of the driver's own, kept across restarts within a scenario",
    "shared_dir": "a directory every service of the driver reaches, on every node: its backend (with "
    "node-local pools, each node's own)",
    "kubelet_dir": "the directory the bench puts staging and target paths under (kubelet's root)",
    "recipe_dir": "the directory holding the recipe file (for scripts shipped beside it)",
}


class RecipeError(Exception):
    """A recipe that cannot be used, saying which file and field and why."""


@dataclass(frozen=True)
class Service:
    """One process of the driver: its command (placeholders unfilled) and what it serves."""

    role: str  # "controller" or "node"
    command: tuple[str, ...]


@dataclass(frozen=True)
class Inventory:
    """A command printing what the backend holds, one `volume <id>` or `snapshot <id>` a line."""

    command: tuple[str, ...]
    timeout_seconds: float = 30.0


@dataclass(frozen=True)
class VolumeShape:
    """The volumes a campaign asks for: size at creation and after ControllerExpandVolume."""

    size_bytes: int
    expand_to_bytes: int


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    controller: Service
    # None: the controller's process serves the Node service too, on the same socket.
    node: Service | None
    env: Mapping[str, str]
    ready_timeout_seconds: float
    # The name GetPluginInfo must report ("" when the recipe does not say).
    driver_name: str
    # The CSIDriver object's spec (attachRequired, podInfoOnMount, fsGroupPolicy...), and the
    # StorageClass's provisioner parameters, fsType, allowVolumeExpansion, volumeBindingMode and
    # mountOptions: the campaign reads parameters and fsType; `make up DRIVER=` reads all.
    csi_driver: Mapping[str, Any]
    storage_class: Mapping[str, Any]
    snapshot_parameters: Mapping[str, str]
    volume: VolumeShape
    inventory: Inventory | None
    # Whether the recipe has a snapshot_class: `make up DRIVER=` runs external-snapshotter's
    # csi-snapshotter only then, since it exits at once on a driver without CREATE_DELETE_SNAPSHOT.
    snapshots: bool = False

    @property
    def services(self) -> tuple[Service, ...]:
        return (self.controller,) if self.node is None else (self.controller, self.node)

    @property
    def parameters(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in (self.storage_class.get("parameters") or {}).items()}

    @property
    def fs_type(self) -> str:
        return str(self.storage_class.get("fsType", ""))

    @property
    def mount_options(self) -> list[str]:
        return [str(o) for o in self.storage_class.get("mountOptions") or []]

    def argv(self, service: Service, filled: Filled) -> list[str]:
        """The service's command with its placeholders filled in."""
        values = filled.values()
        return [fill(a, values) for a in service.command]

    def environment(self, filled: Filled) -> dict[str, str]:
        """The recipe's env with its placeholders filled in (added to the runner's own)."""
        values = filled.values()
        return {k: fill(v, values) for k, v in self.env.items()}

    @property
    def storage_class_name(self) -> str:
        return str(self.storage_class.get("name") or self.name)

    @property
    def attach_required(self) -> bool:
        # Kubernetes' default when a CSIDriver leaves it out (or there is none): attach.
        return bool(self.csi_driver.get("attachRequired", True))


@dataclass(frozen=True)
class Filled:
    """The placeholders' values for one run of one service."""

    socket: Path
    node_id: str
    state_dir: Path
    kubelet_dir: Path
    recipe_dir: Path
    # The bench runs one controller and one node service on one state directory, which is then
    # their shared backend too; the local stack gives each node's plugin a state directory of its
    # own and one shared directory to them all (a storage system every node reaches).
    shared_dir: Path | None = None
    python: str = field(default=sys.executable)

    def values(self) -> dict[str, str]:
        return {
            "python": self.python,
            "socket": str(self.socket),
            "endpoint": f"unix://{self.socket}",
            "node_id": self.node_id,
            "state_dir": str(self.state_dir),
            "shared_dir": str(self.shared_dir or self.state_dir),
            "kubelet_dir": str(self.kubelet_dir),
            "recipe_dir": str(self.recipe_dir),
        }


def fill(text: str, values: Mapping[str, str]) -> str:
    """`text` with its placeholders replaced; `{{` and `}}` stand for braces."""
    return text.format_map(values)


def _placeholders(text: str, where: str) -> None:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as e:
        raise RecipeError(f"{where}: {e} in {text!r} (write {{{{ and }}}} for literal braces)") from None
    for name in names:
        if name not in PLACEHOLDERS:
            known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
            raise RecipeError(f"{where}: unknown placeholder {{{name}}} in {text!r} (known: {known})")


class _Reader:
    """Typed reads of the recipe's mapping, each failure naming the file and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, why: str) -> RecipeError:
        return RecipeError(f"recipe {self.path}: {where}: {why}")

    def mapping(self, doc: Mapping[str, Any], key: str, where: str, required: bool = False) -> dict[str, Any]:
        value = doc.get(key)
        if value is None:
            if required:
                raise self.fail(f"{where}{key}", "missing (a mapping is required)")
            return {}
        if not isinstance(value, dict):
            raise self.fail(f"{where}{key}", f"must be a mapping, not {type(value).__name__}")
        return value

    def command(self, doc: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
        value = doc.get("command")
        name = f"{where}{key}.command"
        if value is None:
            raise self.fail(name, "missing: the command that starts this service, as a list of arguments")
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, Sequence) or not value or not all(isinstance(a, str) for a in value):
            raise self.fail(name, "must be a non-empty list of strings")
        for arg in value:
            try:
                _placeholders(arg, name)
            except RecipeError as e:
                raise self.fail(name, str(e).removeprefix(f"{name}: ")) from None
        return tuple(value)

    def number(self, doc: Mapping[str, Any], key: str, where: str, default: float) -> float:
        value = doc.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.fail(f"{where}{key}", f"must be a positive number of seconds, not {value!r}")
        return float(value)

    def size(self, doc: Mapping[str, Any], key: str, where: str, default: str) -> int:
        value = doc.get(key, default)
        size = parse_quantity(str(value))  # 0 for a malformed quantity, as the apiserver's
        if size <= 0:
            raise self.fail(f"{where}{key}", f"not a quantity: {value!r} (e.g. 64Mi)")
        return size


KNOWN_KEYS = frozenset(
    {"name", "driver_name", "controller", "node", "env", "ready", "csi_driver", "storage_class",
     "snapshot_class", "volume", "inventory"}
)  # fmt: skip


def parse(doc: object, path: Path) -> Recipe:
    r = _Reader(path)
    if not isinstance(doc, dict):
        raise RecipeError(f"recipe {path}: must be a YAML mapping, not {type(doc).__name__}")
    unknown = sorted(set(doc) - KNOWN_KEYS)
    if unknown:
        raise r.fail(", ".join(map(str, unknown)), f"unknown field (known: {', '.join(sorted(KNOWN_KEYS))})")
    controller = Service(
        "controller", r.command(r.mapping(doc, "controller", "", required=True), "controller", "")
    )
    node_doc = doc.get("node")
    node = None if node_doc is None else Service("node", r.command(r.mapping(doc, "node", ""), "node", ""))
    env = r.mapping(doc, "env", "")
    for key, value in env.items():
        if not isinstance(value, str | int | float):
            raise r.fail(f"env.{key}", "must be a string")
        _placeholders(str(value), f"recipe {path}: env.{key}")
    ready = r.mapping(doc, "ready", "")
    volume = r.mapping(doc, "volume", "")
    size = r.size(volume, "size", "volume.", "64Mi")
    expand_to = r.size(volume, "expand_to", "volume.", str(size * 2))
    if expand_to <= size:
        raise r.fail("volume.expand_to", f"must be larger than volume.size ({expand_to} <= {size})")
    inventory_doc = doc.get("inventory")
    inventory = None
    if inventory_doc is not None:
        inv = r.mapping(doc, "inventory", "")
        inventory = Inventory(
            r.command(inv, "inventory", ""), r.number(inv, "timeout_seconds", "inventory.", 30)
        )
    snapshot_class = r.mapping(doc, "snapshot_class", "")
    return Recipe(
        name=str(doc.get("name") or path.stem),
        path=path,
        controller=controller,
        node=node,
        env={str(k): str(v) for k, v in env.items()},
        ready_timeout_seconds=r.number(ready, "timeout_seconds", "ready.", 30),
        driver_name=str(doc.get("driver_name") or ""),
        csi_driver=r.mapping(doc, "csi_driver", ""),
        storage_class=r.mapping(doc, "storage_class", ""),
        snapshot_parameters={str(k): str(v) for k, v in (snapshot_class.get("parameters") or {}).items()},
        volume=VolumeShape(size, expand_to),
        inventory=inventory,
        snapshots=doc.get("snapshot_class") is not None,
    )


def load(path: str | Path) -> Recipe:
    path = Path(path).resolve()
    try:
        text = path.read_text()
    except OSError as e:
        raise RecipeError(f"recipe {path}: cannot be read: {e.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path}: not YAML: {e}") from None
    return parse(doc, path)
