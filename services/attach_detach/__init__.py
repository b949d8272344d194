"""kube-controller-manager's attach-detach controller as its own process."""
