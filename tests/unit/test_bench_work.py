"""bench.work reads the apiserver's and the driver's Prometheus text into per-operation work."""

from __future__ import annotations

from collections import Counter

from bench.work import Reading, WorkCounts, api_requests, api_seconds, csi_calls, flow_control_waits


def line(name: str, value: float, **labels: str) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "} " + str(value)


def req(verb: str, resource: str, subresource: str = "", **more: str) -> dict[str, str]:
    return {"component": "apiserver", "group": "", "resource": resource, "scope": "resource",
            "subresource": subresource, "verb": verb, "version": "v1", **more}  # fmt: skip


PV_POST = req("POST", "persistentvolumes")
PVC_STATUS = req("PUT", "persistentvolumeclaims", "status")
HEALTHZ = {"verb": "GET", "resource": "", "subresource": "", "path": "/healthz"}
WAIT = "apiserver_flowcontrol_request_wait_duration_seconds"
LOW = {"flow_schema": "service-accounts", "priority_level": "workload-low"}
APISERVER = (
    "\n".join(
        [
            "# TYPE apiserver_request_total counter",
            line("apiserver_request_total", 10, code="201", **PV_POST),
            line("apiserver_request_total", 2, code="409", **PV_POST),
            line("apiserver_request_total", 4, code="200", **PVC_STATUS),
            line("apiserver_request_total", 3, code="200", **HEALTHZ),
            "# TYPE apiserver_request_duration_seconds histogram",
            line("apiserver_request_duration_seconds_bucket", 12, le="+Inf", **PV_POST),
            line("apiserver_request_duration_seconds_sum", 0.24, **PV_POST),
            line("apiserver_request_duration_seconds_count", 12, **PV_POST),
            line("apiserver_request_duration_seconds_sum", 0.02, **PVC_STATUS),
            line("apiserver_request_duration_seconds_count", 4, **PVC_STATUS),
            f"# TYPE {WAIT} histogram",
            line(f"{WAIT}_bucket", 8, execute="true", le="+Inf", **LOW),
            line(f"{WAIT}_sum", 0.4, execute="true", **LOW),
            line(f"{WAIT}_count", 8, execute="true", **LOW),
            line(f"{WAIT}_sum", 0.0, execute="false", **LOW),
            line(f"{WAIT}_count", 2, execute="false", **LOW),
        ]
    )
    + "\n"
)

CREATE = "/csi.v1.Controller/CreateVolume"
DRIVER = (
    "\n".join(
        [
            "# TYPE csi_operations_seconds histogram",
            line("csi_operations_seconds_count", 10, grpc_status_code="OK", method_name=CREATE),
            line("csi_operations_seconds_count", 1, grpc_status_code="Aborted", method_name=CREATE),
            line("csi_operations_seconds_sum", 0.5, grpc_status_code="OK", method_name=CREATE),
        ]
    )
    + "\n"
)


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
