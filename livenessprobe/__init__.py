"""kubernetes-csi livenessprobe in Python: answers kubelet's liveness probe of a CSI driver
container by calling the driver's Probe."""
