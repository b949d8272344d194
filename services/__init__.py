"""kubeloop's control-plane processes (pv-controller, attach-detach, volume-expand, node-agent) and
the local stack launcher (services.stack)."""
