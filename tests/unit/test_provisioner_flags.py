"""The external-provisioner's command line: flags whose defaults are upstream's contract."""

from __future__ import annotations

from external_provisioner.main import build_parser


def test_capacity_publishing_has_its_own_slower_client_limits() -> None:
    """As csi-provisioner's --kube-api-capacity-qps/-burst: 1 and 5, apart from --kube-api-qps."""
    args = build_parser().parse_args([])
    assert (args.kube_api_capacity_qps, args.kube_api_capacity_burst) == (1.0, 5)
    assert (args.kube_api_qps, args.kube_api_burst) == (5.0, 10)
    args = build_parser().parse_args(["--kube-api-capacity-qps=3", "--kube-api-capacity-burst=7"])
    assert (args.kube_api_capacity_qps, args.kube_api_capacity_burst) == (3.0, 7)
