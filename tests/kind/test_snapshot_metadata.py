"""Changed block tracking as a backup application sees it, in kind: external-snapshot-metadata's
sidecar in the driver's controller pod, found through the driver's SnapshotMetadataService, dialled
over TLS with the CA that object names, with a ServiceAccount token for its audience; the sidecar
authenticates (TokenReview) and authorizes (SubjectAccessReview) the caller and relays to the driver.

The Kubernetes e2e suite's two snapshot-metadata specs cannot run against an external driver at
v1.36.3 (docs/csi-surfaces.md says why); this test does what their verifier does, by the same API."""

from __future__ import annotations

import base64
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from controller_runtime.toolchain import Toolchain
from csi_driver import DRIVER_NAME
from kubeloop_grpc.snapshotmetadata import schema_pb2, schema_pb2_grpc
from localstack import kind

from .conftest import KindCluster
from .workloads import take_snapshot, wait_ready

pytestmark = pytest.mark.root
BLOCK = 4096
SERVICE = "kubeloop-snapshot-metadata.kube-system"
MiB = 1 << 20


def block_claim_and_writer(ns: str) -> str:
    return f"""
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: disk, namespace: {ns}}}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: kubeloop
  resources: {{requests: {{storage: 16Mi}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: writer, namespace: {ns}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: app
      image: {kind.BUSYBOX_IMAGE}
      command: [sh, -c, "sleep 3600"]
      volumeDevices: [{{name: disk, devicePath: /dev/xvda}}]
  volumes:
    - name: disk
      persistentVolumeClaim: {{claimName: disk}}
"""


def write_blocks(kc: KindCluster, ns: str, first_block: int, count: int) -> None:
    kc.kubectl(
        "exec", "-n", ns, "writer", "--", "sh", "-c",
        f"dd if=/dev/urandom of=/dev/xvda bs={BLOCK} seek={first_block} count={count} conv=notrunc,fsync"
        " 2>/dev/null && sync",
    )  # fmt: skip


def snapshot(kc: KindCluster, ns: str, name: str) -> str:
    """Takes a VolumeSnapshot of the claim; returns its CSI snapshot handle once ready."""
    return str(take_snapshot(kc, ns, name, "disk")["status"]["snapshotHandle"])


@contextmanager
def sidecar_channel(kc: KindCluster) -> Iterator[grpc.Channel]:
    """A TLS channel to the sidecar's Service through `kubectl port-forward` (on 127.0.0.1), trusting
    only the CA the driver's SnapshotMetadataService names, and checking the name it names."""
    sms = kc.get("snapshotmetadataservices", DRIVER_NAME)
    host, port = sms["spec"]["address"].rsplit(":", 1)
    assert host == SERVICE
    forward = subprocess.Popen(
        [str(Toolchain.default().binary("kubectl")), f"--kubeconfig={kc.cluster.kubeconfig}",
         "port-forward", "-n", "kube-system", "service/kubeloop-snapshot-metadata", f":{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()
        found = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert found, f"kubectl port-forward said: {line!r}"
        credentials = grpc.ssl_channel_credentials(root_certificates=base64.b64decode(sms["spec"]["caCert"]))
        with grpc.secure_channel(
            f"127.0.0.1:{found.group(1)}", credentials, options=[("grpc.ssl_target_name_override", host)]
        ) as channel:
            yield channel
    finally:
        forward.kill()
        forward.wait()


def extents(responses: Iterator[schema_pb2.GetMetadataAllocatedResponse]) -> list[tuple[int, int]]:
    """The answer as merged (offset, length) byte ranges."""
    merged: list[tuple[int, int]] = []
    for response in responses:
        assert response.volume_capacity_bytes == 16 * MiB
        for block in response.block_metadata:
            if merged and merged[-1][0] + merged[-1][1] == block.byte_offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + block.size_bytes)
            else:
                merged.append((block.byte_offset, block.size_bytes))
    return merged


def test_a_backup_client_reads_allocated_and_changed_blocks_through_the_sidecar(
    kind_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = kind_cluster, namespace
    kc.apply(block_claim_and_writer(ns))
    wait_ready(kc, ns, "writer")
    write_blocks(kc, ns, 0, 6)  # 24 KiB at 0
    write_blocks(kc, ns, MiB // BLOCK, 3)  # 12 KiB at 1 MiB
    first = snapshot(kc, ns, "snap-1")
    write_blocks(kc, ns, 2 * MiB // BLOCK, 3)  # 12 KiB at 2 MiB
    write_blocks(kc, ns, 2, 1)  # rewrite 1 block inside the first run
    snapshot(kc, ns, "snap-2")

    # The backup application: its own ServiceAccount with the client role, a token for the audience.
    sms = kc.get("snapshotmetadataservices", DRIVER_NAME)
    kc.kubectl("create", "serviceaccount", "-n", ns, "backup")
    kc.kubectl("create", "serviceaccount", "-n", ns, "nobody")
    binding = f"kubeloop-test-backup-{ns}"
    kc.kubectl(
        "create", "clusterrolebinding", binding, "--clusterrole=kubeloop:snapshot-metadata-client",
        f"--serviceaccount={ns}:backup",
    )  # fmt: skip
    audience = sms["spec"]["audience"]

    def token_for(account: str, for_audience: str = audience) -> str:
        return kc.kubectl("create", "token", "-n", ns, account, f"--audience={for_audience}").strip()

    def allocated_request(token: str, name: str, **page: int) -> schema_pb2.GetMetadataAllocatedRequest:
        return schema_pb2.GetMetadataAllocatedRequest(
            security_token=token, namespace=ns, snapshot_name=name, **page
        )

    try:
        token = token_for("backup")
        with sidecar_channel(kc) as channel:
            stub = schema_pb2_grpc.SnapshotMetadataStub(channel)
            allocated = stub.GetMetadataAllocated(allocated_request(token, "snap-1"), timeout=60)
            assert extents(allocated) == [(0, 6 * BLOCK), (MiB, 3 * BLOCK)]
            delta = stub.GetMetadataDelta(
                schema_pb2.GetMetadataDeltaRequest(
                    security_token=token, namespace=ns, base_snapshot_id=first, target_snapshot_name="snap-2"
                ),
                timeout=60,
            )
            assert extents(delta) == [(2 * BLOCK, BLOCK), (2 * MiB, 3 * BLOCK)]
            # From an offset on, a page at a time: what a client resuming a stream asks.
            paged = stub.GetMetadataAllocated(
                allocated_request(token, "snap-2", starting_offset=MiB, max_results=1), timeout=60
            )
            assert extents(paged) == [(MiB, 3 * BLOCK), (2 * MiB, 3 * BLOCK)]

            # A token for another audience, and a caller who may not read the namespace's snapshots.
            def code_of(request_token: str) -> grpc.StatusCode:
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.GetMetadataAllocated(allocated_request(request_token, "snap-1"), timeout=60))
                return refused.value.code()

            assert code_of(token_for("backup", "someone-else")) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(token_for("nobody")) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        kc.kubectl("delete", "clusterrolebinding", binding, check=False)
