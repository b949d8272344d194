"""kubeloop's external-provisioner: the kubernetes-csi sidecar that turns PersistentVolumeClaims into
CSI CreateVolume calls and PersistentVolumes, and Released volumes into DeleteVolume calls."""
