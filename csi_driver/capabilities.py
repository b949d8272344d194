"""Volume capabilities: what a request asks for, and whether this driver can give it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubeloop_grpc.csi import csi_pb2

from .backend.fs import SUPPORTED
from .errors import invalid

Mode = csi_pb2.VolumeCapability.AccessMode.Mode

SINGLE_NODE_MODES = frozenset(
    {
        Mode.SINGLE_NODE_WRITER,
        Mode.SINGLE_NODE_READER_ONLY,
        Mode.SINGLE_NODE_SINGLE_WRITER,
        Mode.SINGLE_NODE_MULTI_WRITER,
    }
)
READ_ONLY_MODES = frozenset({Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY})
# A filesystem mounted read-write on two nodes at once is corrupted, even when both "nodes" are
# names on one machine sharing the pool; only a raw block volume can be shared by writers.
MULTI_NODE_WRITER_MODES = frozenset({Mode.MULTI_NODE_SINGLE_WRITER, Mode.MULTI_NODE_MULTI_WRITER})


# mount(8) options that act on something other than the filesystem being mounted: set up another
# loop device, run a helper, create or chown directories (X-mount.*), turn the mount into a bind,
# move or remount of whatever the target names, or change mount propagation. A volume's mount
# flags are for its own filesystem (noatime, discard, data=..., ...), nothing else.
_FORBIDDEN_OPTIONS = frozenset(
    {
        "loop", "offset", "sizelimit", "encryption", "helper", "uhelper", "bind", "rbind", "move",
        "rmove", "remount", "user", "users", "owner", "group", "comment", "private", "rprivate",
        "shared", "rshared", "slave", "rslave", "unbindable", "runbindable",
    }
)  # fmt: skip


def forbidden_mount_option(flags: str) -> str | None:
    """The first option in a comma-separated mount flag that the driver refuses, else None."""
    for option in flags.split(","):
        key = option.split("=", 1)[0].strip().lower()
        if key in _FORBIDDEN_OPTIONS or key.startswith(("x-", "make-")):
            return option
    return None


@dataclass(frozen=True)
class Capability:
    access_type: str  # "mount" or "block"
    fs_type: str  # "" when not requested (block, or mount leaving it to the driver)
    mount_flags: tuple[str, ...]
    mode: int

    @property
    def single_node(self) -> bool:
        return self.mode in SINGLE_NODE_MODES

    @property
    def read_only(self) -> bool:
        return self.mode in READ_ONLY_MODES


def malformed_reason(cap: csi_pb2.VolumeCapability) -> str | None:
    """None when `cap` sets what every capability must (an access type and an access mode), else
    a sentence saying what it lacks: a request carrying it is INVALID_ARGUMENT wherever it comes."""
    if cap.WhichOneof("access_type") is None:
        return "volume_capability must set access_type to mount or block"
    mode = cap.access_mode.mode
    if mode == Mode.UNKNOWN or mode not in Mode.values():
        return "volume_capability.access_mode.mode must be set"
    return None


def unsupported_reason(cap: csi_pb2.VolumeCapability) -> str | None:
    """None when the driver supports `cap`, else a sentence saying why not."""
    if (reason := malformed_reason(cap)) is not None:
        return reason
    which = cap.WhichOneof("access_type")
    mode = cap.access_mode.mode
    if which == "mount":
        fs_type = cap.mount.fs_type
        if fs_type and fs_type not in SUPPORTED:
            return f"filesystem {fs_type!r} is not supported; use one of {', '.join(SUPPORTED)}"
        if mode in MULTI_NODE_WRITER_MODES:
            return (
                f"access mode {Mode.Name(mode)} cannot be used with a filesystem volume: a filesystem "
                "must not be mounted read-write on several nodes; request a block volume instead"
            )
        for flag in cap.mount.mount_flags:
            if "\x00" in flag or "\n" in flag:
                return f"mount flag {flag!r} contains a control character"
            if (option := forbidden_mount_option(flag)) is not None:
                return f"mount option {option!r} is not allowed: mount flags only tune the filesystem"
    return None


def parse_capability(cap: csi_pb2.VolumeCapability, what: str = "volume_capability") -> Capability:
    reason = unsupported_reason(cap)
    if reason is not None:
        raise invalid(f"{what}: {reason}")
    which = cap.WhichOneof("access_type")
    assert which is not None
    if which == "block":
        return Capability("block", "", (), cap.access_mode.mode)
    return Capability("mount", cap.mount.fs_type, tuple(cap.mount.mount_flags), cap.access_mode.mode)


def require_capability(message: Any, field: str = "volume_capability") -> Capability:
    if not message.HasField(field):
        raise invalid(f"{field} is required")
    cap: csi_pb2.VolumeCapability = getattr(message, field)
    return parse_capability(cap, field)
