"""The controller base the external-provisioner's, -attacher's and -resizer's controllers share,
apart from controller_runtime.csi_client so that a process that only calls its driver (node-driver-
registrar, livenessprobe) does not import the informer machinery and the API client with it."""

from __future__ import annotations

from .controller import ControllerContext, InformerController
from .csi_client import CSIConnection


class SidecarController(InformerController):
    """A CSI sidecar's controller: an informer-fed controller with its driver's connection and name."""

    def __init__(self, context: ControllerContext, csi: CSIConnection) -> None:
        super().__init__(context)
        self.csi = csi
        self.driver = csi.driver_name
