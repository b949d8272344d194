"""bench.work reads the apiserver's and the driver's Prometheus text into per-operation work."""

from __future__ import annotations

from collections import Counter

from bench.work import Reading, WorkCounts, api_requests, api_seconds, csi_calls, flow_control_waits

APISERVER = """\
# HELP apiserver_request_total Counter of apiserver requests.
# TYPE apiserver_request_total counter
apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="persistentvolumes",scope="resource",subresource="",verb="POST",version="v1"} 10
apiserver_request_total{code="409",component="apiserver",dry_run="",group="",resource="persistentvolumes",scope="resource",subresource="",verb="POST",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="persistentvolumeclaims",scope="resource",subresource="status",verb="PUT",version="v1"} 4
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="",scope="",subresource="",verb="GET",version="",path="/healthz"} 3
# HELP apiserver_request_duration_seconds Response latency.
# TYPE apiserver_request_duration_seconds histogram
apiserver_request_duration_seconds_bucket{component="apiserver",dry_run="",group="",resource="persistentvolumes",scope="resource",subresource="",verb="POST",version="v1",le="+Inf"} 12
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="",resource="persistentvolumes",scope="resource",subresource="",verb="POST",version="v1"} 0.24
apiserver_request_duration_seconds_count{component="apiserver",dry_run="",group="",resource="persistentvolumes",scope="resource",subresource="",verb="POST",version="v1"} 12
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="",resource="persistentvolumeclaims",scope="resource",subresource="status",verb="PUT",version="v1"} 0.02
apiserver_request_duration_seconds_count{component="apiserver",dry_run="",group="",resource="persistentvolumeclaims",scope="resource",subresource="status",verb="PUT",version="v1"} 4
# HELP apiserver_flowcontrol_request_wait_duration_seconds Length of time a request spent waiting in its queue
# TYPE apiserver_flowcontrol_request_wait_duration_seconds histogram
apiserver_flowcontrol_request_wait_duration_seconds_bucket{execute="true",flow_schema="service-accounts",priority_level="workload-low",le="+Inf"} 8
apiserver_flowcontrol_request_wait_duration_seconds_sum{execute="true",flow_schema="service-accounts",priority_level="workload-low"} 0.4
apiserver_flowcontrol_request_wait_duration_seconds_count{execute="true",flow_schema="service-accounts",priority_level="workload-low"} 8
apiserver_flowcontrol_request_wait_duration_seconds_sum{execute="false",flow_schema="service-accounts",priority_level="workload-low"} 0.0
apiserver_flowcontrol_request_wait_duration_seconds_count{execute="false",flow_schema="service-accounts",priority_level="workload-low"} 2
"""

DRIVER = """\
# HELP csi_operations_seconds Duration of CSI calls.
# TYPE csi_operations_seconds histogram
csi_operations_seconds_count{driver_name="loop.csi.kubeloop.dev",grpc_status_code="OK",method_name="/csi.v1.Controller/CreateVolume"} 10
csi_operations_seconds_count{driver_name="loop.csi.kubeloop.dev",grpc_status_code="Aborted",method_name="/csi.v1.Controller/CreateVolume"} 1
csi_operations_seconds_sum{driver_name="loop.csi.kubeloop.dev",grpc_status_code="OK",method_name="/csi.v1.Controller/CreateVolume"} 0.5
"""


def test_requests_and_server_time_by_kind() -> None:
    assert api_requests(APISERVER) == Counter(
        {"POST persistentvolumes": 12, "PUT persistentvolumeclaims/status": 4, "GET /healthz": 3}
    )
    seconds = api_seconds(APISERVER)
    assert round(seconds["POST persistentvolumes"], 6) == 0.24
    assert round(seconds["PUT persistentvolumeclaims/status"], 6) == 0.02
    assert csi_calls(DRIVER) == Counter({"/csi.v1.Controller/CreateVolume": 11})
    waits, waited = flow_control_waits(APISERVER)
    assert waits == Counter({"workload-low": 10}) and round(waited["workload-low"], 6) == 0.4


def test_figures_are_per_operation_and_between_readings() -> None:
    before = Reading(Counter({"POST persistentvolumes": 2}), Counter({"POST persistentvolumes": 0.04}))
    after = Reading(
        api_requests(APISERVER), api_seconds(APISERVER), csi_calls(DRIVER), *flow_control_waits(APISERVER)
    )
    work = WorkCounts(cp=None)  # type: ignore[arg-type]  # figures never reach the control plane
    work.served = after - before
    figures = work.figures(operations=10)
    assert figures["api_requests_per_op"] == 1.7  # (10 + 4 + 3) / 10
    assert figures["api_requests"] == {
        "POST persistentvolumes": 1.0,
        "PUT persistentvolumeclaims/status": 0.4,
        "GET /healthz": 0.3,
    }
    assert figures["csi_calls_per_op"] == 1.1
    # Mean server time per request of each kind, from the counts and seconds of the window only.
    assert figures["api_server_ms"]["POST persistentvolumes"] == 20.0
    assert figures["api_server_ms"]["PUT persistentvolumeclaims/status"] == 5.0
    assert figures["flow_control_wait_ms"] == {"workload-low": 40.0}
