"""The volume attributes a VolumeAttributesClass sets: CSI `mutable_parameters`, given at
CreateVolume and changed on a live volume by ControllerModifyVolume.

One attribute, chosen because it changes what the volume does, can change while the volume is
in use, and lives where the controller reaches it (the backing file in the pool, shared by every
node in shared mode):

    cacheMode: writeback     writes reach the pool's page cache and the disk later (the default)
    cacheMode: writethrough  every write completes only once it is on the pool's disk (the
                             backing file carries the synchronous flag, FS_SYNC_FL / chattr +S):
                             nothing acknowledged is lost when the machine loses power, at the
                             cost of write speed (docs/volume-attributes.md has the figures)

A loop device bound to the file obeys the flag from its next write, so a modify needs no node
step and no remount.
"""

from __future__ import annotations

from collections.abc import Mapping

from .backend import files
from .errors import invalid

CACHE_MODE = "cacheMode"
WRITEBACK = "writeback"
WRITETHROUGH = "writethrough"

# Each key with the values it accepts, the first being what a volume has when it is not set.
ACCEPTED: dict[str, tuple[str, ...]] = {CACHE_MODE: (WRITEBACK, WRITETHROUGH)}


def _described() -> str:
    return "; ".join(f"{key}: {' or '.join(values)}" for key, values in ACCEPTED.items())


def check_mutable(params: Mapping[str, str], what: str = "mutable_parameters") -> dict[str, str]:
    """The parameters as a dict, or INVALID_ARGUMENT naming the first key or value this driver
    cannot set (and what it can): the spec's code for parameters a volume cannot support, which
    external-resizer records as Infeasible."""
    for key in sorted(params):
        if key not in ACCEPTED:
            raise invalid(f"{what}: unknown parameter {key!r}; the mutable parameters are {_described()}")
        if params[key] not in ACCEPTED[key]:
            raise invalid(
                f"{what}: {key}={params[key]!r} is not a value it takes; the mutable parameters are "
                f"{_described()}"
            )
    return dict(params)


def apply(path: str, params: Mapping[str, str]) -> None:
    """Gives the backing file the attributes `params` names (checked), leaving the others as they
    are: the spec forbids acting on a key's absence. Blocking; idempotent."""
    mode = params.get(CACHE_MODE)
    if mode is not None:
        files.set_synchronous(path, mode == WRITETHROUGH)
