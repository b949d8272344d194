"""`kubectl kubeloop`: why a claim or its pod is stuck, from the objects and events of its whole chain."""
