"""The kubernetes-csi external-resizer as a process: ControllerExpandVolume for claims whose
request grew, PV capacity, and the claim's resize status for the node side to finish."""
