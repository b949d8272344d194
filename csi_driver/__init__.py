"""kubeloop's CSI plugin `loop.csi.kubeloop.dev`: volumes are sparse files in a pool directory,
attached as Linux loop devices on the node that stages them."""

from __future__ import annotations

import os

# The driver forks tools (mkfs, blkid, e2fsck, resize2fs). gRPC's fork handlers are
# meant for processes that keep using gRPC in the child; ours exec at once, and with the handlers
# on a child forked while gRPC threads are busy can crash before it execs. Must be set before
# grpc is imported, hence here.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# The names live in the shared layer, for the processes that deploy or register the driver.
from controller_runtime.driver_names import DRIVER_NAME as DRIVER_NAME
from controller_runtime.driver_names import TOPOLOGY_KEY as TOPOLOGY_KEY
