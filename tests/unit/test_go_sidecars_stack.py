"""`make up SIDECARS=go` (localstack.go_sidecars.with_go_sidecars): upstream's csi-provisioner,
csi-attacher and csi-resizer take the places of kubeloop's three, each under the ServiceAccount and
RBAC of upstream's own rbac.yaml, on the port of the sidecar it replaces; everything else in the
stack stays. Refused where upstream has no counterpart (node-local pools). The stack running this
way is tested end to end by tests/e2e/test_driver_stack_campaign.py (the Go sidecars' second
opinion)."""

from __future__ import annotations

from pathlib import Path

import yaml

from localstack.components import REGISTRY
from localstack.go_sidecars import REPLACES, UPSTREAM_NAMESPACE, with_go_sidecars
from localstack.main import build_parser, preflight


def test_the_three_sidecars_are_replaced_and_nothing_else() -> None:
    replaced = {c.name: c for c in with_go_sidecars(REGISTRY)}
    ours = {c.name: c for c in REGISTRY}
    assert list(replaced) == list(ours)
    for name, comp in replaced.items():
        if name not in REPLACES:
            assert comp is ours[name]
            continue
        sidecar, _ = REPLACES[name]
        assert comp.http_port == ours[name].http_port and comp.health_path == "/metrics"
        assert comp.identity is not None
        assert comp.identity.user == f"system:serviceaccount:{UPSTREAM_NAMESPACE}:{sidecar.account}"
        rbac, *kept = comp.manifests
        # Upstream's file declares the very account the sidecar authenticates as.
        accounts = [
            d for d in yaml.safe_load_all(Path(rbac).read_text()) if d and d["kind"] == "ServiceAccount"
        ]
        assert [(a["metadata"]["name"], a["metadata"]["namespace"]) for a in accounts] == [
            (sidecar.account, UPSTREAM_NAMESPACE)
        ]
        # kubeloop's RBAC goes, its other manifests (the CSIDriver, the classes) stay.
        assert kept == [m for m in ours[name].manifests if not m.startswith("deploy/rbac/")]


def test_go_sidecars_with_node_local_pools_are_refused_saying_why(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", f"--home={tmp_path}", "--sidecars=go", "--pools=node-local"])
    message = preflight(args)
    assert message is not None and "--sidecars=go runs with --pools shared only" in message, message
