"""kube-controller-manager's persistentvolume-expander (the expand controller) as a process."""
