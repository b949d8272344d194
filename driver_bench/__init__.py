"""A test bench for any CSI driver (docs/driver-bench.md): a recipe says how to run the driver, a
campaign drives the CSI volume lifecycle through a fault-injecting proxy, as the sidecars and
kubelet would, and judges what the driver left behind; each finding becomes a reproducer that
`replay` runs against the driver alone."""
