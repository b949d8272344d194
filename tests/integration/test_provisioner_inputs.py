"""external-provisioner against what a claim's author or a Secret's owner can write (issue 29): a
selected-node annotation naming a node outside the class's allowedTopologies, and a Secret whose
data is not UTF-8. Real apiserver, real driver, the provisioner as a subprocess under its RBAC."""

from __future__ import annotations

import base64
import contextlib
import uuid

import pytest

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import CSI_NODES, EVENTS, NODES, PERSISTENT_VOLUME_CLAIMS, SECRETS
from controller_runtime.secrets import NOT_UTF8
from csi_driver import TOPOLOGY_KEY
from localstack.controlplane import ControlPlane
from tests.support.waits import eventually_async, no_problems

from .provisioner_harness import create_topology_node, harness

pytestmark = pytest.mark.integration


async def test_a_selected_node_outside_allowed_topologies_gets_no_volume(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """Anyone who may write a claim may write its selected-node annotation. The Go sidecar refuses
    a node outside the class's allowedTopologies; kubeloop asked the driver for exactly that node's
    segment and got a volume where the admin had not allowed one."""
    suffix = uuid.uuid4().hex[:6]
    allowed, elsewhere = f"in-{suffix}", f"out-{suffix}"
    for node in (allowed, elsewhere):
        await create_topology_node(api, node)
    try:
        async with harness(control_plane, api, namespace) as h:
            terms = [{"matchLabelExpressions": [{"key": TOPOLOGY_KEY, "values": [allowed]}]}]
            cls = await h.create_class("zoned", allowedTopologies=terms)
            await h.create_pvc("outside", "8Mi", cls, annotations={storage.ANN_SELECTED_NODE: elsewhere})
            message = await h.wait_event("outside", storage.PROVISIONING_FAILED, "is not in requisite")
            assert message == (
                "error generating accessibility requirements: "
                f'topology [{{{TOPOLOGY_KEY} {elsewhere}}}] from selected node "{elsewhere}" is not in '
                f"requisite: [[{{{TOPOLOGY_KEY} {allowed}}}]]"
            )
            assert not await h.pvs() and not h.backing_files(), "a volume outside allowedTopologies"
            # Not a node the scheduler should be asked to replace: the annotation stays, as upstream.
            claim = await h.pvc("outside")
            assert claim is not None
            assert claim["metadata"]["annotations"][storage.ANN_SELECTED_NODE] == elsewhere

            # A node the class allows is provisioned as before, on that node.
            await h.create_pvc("inside", "8Mi", cls, annotations={storage.ANN_SELECTED_NODE: allowed})
            pv = (await h.bound("inside"))["inside"]
            assert pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"] == [
                {"matchExpressions": [{"key": TOPOLOGY_KEY, "operator": "In", "values": [allowed]}]}
            ]
            claim = await h.pvc("outside")
            assert claim is not None and not claim["spec"].get("volumeName")
            await h.assert_files_equal_pvs()
    finally:
        for node in (allowed, elsewhere):
            for res in (CSI_NODES, NODES):
                with contextlib.suppress(ApiError):
                    await api.delete(res, node)


async def test_a_secret_that_is_not_utf8_fails_with_an_event(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """A provisioner Secret in the claim's namespace whose data is not UTF-8 cannot travel in a
    CSI request (proto3 strings): the Go sidecar's CreateVolume fails with gRPC's marshalling
    error and the claim gets it as a ProvisioningFailed event. kubeloop's decode raised a
    UnicodeDecodeError that only reached the log, and the claim stayed Pending without a word."""
    async with harness(control_plane, api, namespace) as h:
        raw = base64.b64encode(b"\xff\xfe not utf-8").decode()
        await api.create(SECRETS, {"metadata": {"name": "creds"}, "data": {"key": raw}}, namespace)
        params = {
            "csi.storage.k8s.io/provisioner-secret-name": "creds",
            "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}",
        }
        cls = await h.create_class("secret", parameters=params)
        await h.create_pvc("data", "8Mi", cls)
        message = await h.wait_event("data", storage.PROVISIONING_FAILED, "invalid UTF-8")
        assert message == NOT_UTF8
        assert not await h.pvs() and not h.backing_files()
        # Fixed by its owner, the Secret serves at the next retry.
        plain = base64.b64encode(b"fine").decode()
        await api.patch(SECRETS, "creds", {"data": {"key": plain}}, namespace)
        pv = (await h.bound("data"))["data"]
        await h.assert_files_equal_pvs()

        # DeleteVolume needs it too: the PV says why it stays (VolumeFailedDelete), until fixed.
        await api.patch(SECRETS, "creds", {"data": {"key": raw}}, namespace)
        await api.delete(PERSISTENT_VOLUME_CLAIMS, "data", namespace)
        name = pv["metadata"]["name"]

        async def failed_delete() -> list[str]:
            items = (await api.list_page(EVENTS, "default"))["items"]
            found = [
                e["message"]
                for e in items
                if e["involvedObject"].get("name") == name and e["reason"] == storage.VOLUME_FAILED_DELETE
            ]
            return [] if NOT_UTF8 in found else [f"no VolumeFailedDelete for {name}: {found}"]

        await eventually_async("failed delete", failed_delete, 20, satisfied=no_problems, context=h.log_tail)
        assert await h.pv(name) is not None and h.backing_files()
        await api.patch(SECRETS, "creds", {"data": {"key": plain}}, namespace)

        async def deleted() -> list[str]:
            return [f"{name} still there"] if await h.pv(name) is not None else []

        await eventually_async("deleted", deleted, 20, satisfied=no_problems, context=h.log_tail)
        await h.assert_files_equal_pvs()


async def test_a_selected_node_name_with_url_syntax_names_no_node(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """The selected node is looked up by name in a request path. `node?dryRun=All` went there raw
    and read `node`: the claim was provisioned on a node its annotation did not name. Now it
    names a node that does not exist, and the claim goes back to the scheduler, as for any such."""
    node = f"url-{uuid.uuid4().hex[:6]}"
    await create_topology_node(api, node)
    try:
        async with harness(control_plane, api, namespace) as h:
            cls = await h.create_class("url")
            odd = f"{node}?dryRun=All"
            await h.create_pvc("odd", "8Mi", cls, annotations={storage.ANN_SELECTED_NODE: odd})
            await h.wait_event("odd", storage.PROVISIONING_FAILED, f'nodes "{odd}" not found')

            async def unselected() -> list[str]:
                claim = await h.pvc("odd")
                ann = (claim or {}).get("metadata", {}).get("annotations") or {}
                return [f"still selected: {ann}"] if storage.ANN_SELECTED_NODE in ann else []

            await eventually_async("unselected", unselected, 20, satisfied=no_problems, context=h.log_tail)
            await h.assert_files_equal_pvs()
    finally:
        for res in (CSI_NODES, NODES):
            with contextlib.suppress(ApiError):
                await api.delete(res, node)
