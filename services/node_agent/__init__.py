"""The node agent: kubelet's volume manager and node status for kubeloop's local stack."""
