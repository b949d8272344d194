"""kcm's persistentvolume-binder as its own process (kubeloop-pv-controller)."""
