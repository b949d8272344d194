"""`kubeloop-node-plugin`: the CSI driver and the node's external-provisioner and external-resizer
in one process, for node-local mode (the Helm chart's `node.embedSidecars`)."""
