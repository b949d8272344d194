"""Benchmark of the CSI driver; run `python -m bench.csi_driver`."""
