"""kubernetes-csi node-driver-registrar in Python: registers a CSI driver running in another
container with kubelet, through kubelet's plugin-registration socket directory."""
