"""The API surface a mode's scenarios ran against, and the check that both modes had the same one.

A scenario's outcome depends on the cluster as well as on the controllers: a claim whose dataSource
names a VolumeSnapshot gets "the server could not find the requested resource" where the snapshot
CRDs are missing and `"snap" not found` where they exist. Two runs compared on different clusters
differ for a reason that is neither side's behaviour (issue 44: the snapshot CRDs arrived in every
kubeloop run mode, not in the go mode's stack). So each mode records what its apiserver serves,
once its components have started (they apply their CRDs), and the suite refuses to compare two
runs whose surfaces differ, naming what one had and the other did not.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient


class SurfaceMismatch(RuntimeError):
    """The two modes ran on clusters that serve different APIs: their outcomes cannot be compared."""


async def api_surface(api: ApiClient) -> list[str]:
    """Every served resource as `group/version/resource` (`v1/pods` for the core group), sorted:
    API groups, their versions and the resources in each, CRDs' included (a CRD adds its group's
    resources to discovery once Established)."""
    core = json.loads(await api.get_text("/api"))
    groups = json.loads(await api.get_text("/apis"))
    versions = [f"api/{v}" for v in core.get("versions") or ()]
    versions += [
        f"apis/{v['groupVersion']}" for g in groups.get("groups") or () for v in g.get("versions") or ()
    ]
    out: list[str] = []
    for path in versions:
        listing: dict[str, Any] = json.loads(await api.get_text(f"/{path}"))
        group_version = listing.get("groupVersion", path.removeprefix("api/"))
        out.extend(f"{group_version}/{r['name']}" for r in listing.get("resources") or ())
    return sorted(out)


def surface_path(work_dir: Path, mode: str) -> Path:
    return work_dir / f"surface-{mode}.json"


def save_surface(work_dir: Path, mode: str, surface: list[str]) -> None:
    surface_path(work_dir, mode).parent.mkdir(parents=True, exist_ok=True)
    surface_path(work_dir, mode).write_text(json.dumps(surface, indent=0) + "\n")


def load_surface(work_dir: Path, mode: str) -> list[str]:
    return list(json.loads(surface_path(work_dir, mode).read_text()))


def check_same_surface(surfaces: dict[str, list[str]]) -> None:
    """SurfaceMismatch, with a diff of the served resources, unless every mode served the same."""
    (first, base), *rest = surfaces.items()
    for mode, other in rest:
        if other != base:
            diff = "\n".join(
                line
                for line in difflib.unified_diff(base, other, first, mode, lineterm="", n=0)
                if not line.startswith("@@")
            )
            raise SurfaceMismatch(
                f"the {first} and {mode} runs were made on clusters serving different APIs, so their "
                f"outcomes are not compared (make the two modes' stacks install the same CRDs and API "
                f"groups):\n{diff}"
            )
