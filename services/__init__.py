"""kubeloop's control-plane processes: pv-controller, attach-detach controller, volume-expand
controller and node agent, one package each."""
