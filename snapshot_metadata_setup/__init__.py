"""Readies the external-snapshot-metadata sidecar beside the driver's controller service: its TLS
serving certificate and the SnapshotMetadataService object backup applications discover it by."""
