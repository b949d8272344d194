"""docker-compose.node-local.yml is generated from the node-local registry: the checked-in file must
be what `python -m localstack.compose generate --pools node-local` prints, and no volume may be
shared between two nodes' services."""

from __future__ import annotations

import yaml

from controller_runtime.toolchain import REPO_ROOT
from localstack import compose
from localstack.pools import NODE_LOCAL


def test_checked_in_node_local_compose_file_is_generated() -> None:
    checked_in = (REPO_ROOT / compose.COMPOSE_FILES[NODE_LOCAL]).read_text()
    assert checked_in == compose.render(NODE_LOCAL), (
        "docker-compose.node-local.yml is stale: run "
        "`python -m localstack.compose generate --pools node-local > docker-compose.node-local.yml`"
    )


def test_no_volume_is_shared_between_nodes() -> None:
    services = yaml.safe_load(compose.render(NODE_LOCAL))["services"]
    users: dict[str, set[str]] = {}
    for name, svc in services.items():
        node = next((n for n in compose.NODES if name.endswith(f"-{n}")), None)
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if node is not None and source not in ("config", "/dev"):
                users.setdefault(source, set()).add(node)
    assert all(len(nodes) == 1 for nodes in users.values()), users
    assert "pool" not in users and "csi-driver-controller" not in services
    assert services["csi-driver-node-node-a"]["volumes"][1] == "pool-node-a:/var/lib/kubeloop/pools/node-a"
    assert services["external-provisioner-node-b"]["environment"] == {"NODE_NAME": "node-b"}
    assert services["node-finalizer"]["user"] == str(compose.NONROOT)
