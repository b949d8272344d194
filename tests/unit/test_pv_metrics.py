"""The pv-controller's metrics print as kube-controller-manager 1.36 prints its binder's: the
expected lines below are copied from a scrape of the real kcm (persistentvolume-binder-controller)
with the same objects."""

from __future__ import annotations

from typing import Any

from controller_runtime.metrics import Registry
from controller_runtime.resources import Obj
from services.pv_controller.metrics import BinderMetrics


def pv(name: str, phase: str, cls: str = "", **source: Any) -> Obj:
    return {
        "metadata": {"name": name},
        "spec": {"storageClassName": cls, "volumeMode": source.pop("mode", "Filesystem"), **source},
        "status": {"phase": phase},
    }


def pvc(name: str, phase: str, cls: str | None = "", vac: str | None = None) -> Obj:
    spec: Obj = {"storageClassName": cls}
    if vac is not None:
        spec["volumeAttributesClassName"] = vac
    return {"metadata": {"name": name, "namespace": "default"}, "spec": spec, "status": {"phase": phase}}


VOLUMES = [
    pv("host1", "Bound", hostPath={"path": "/tmp/a"}),
    pv("host2", "Available", hostPath={"path": "/tmp/b"}),
    pv("nfs", "Available", nfs={"server": "1.2.3.4", "path": "/x"}),
    pv("csi", "Available", "gold", csi={"driver": "drv.example.com", "volumeHandle": "h"}),
    pv("local", "Released", "gold", mode="Block", local={"path": "/x"}),
]
CLAIMS = [
    pvc("a", "Bound"),
    pvc("b", "Pending"),
    pvc("c", "Pending", "gold", "fast"),
    pvc("d", "Lost", None),
]


def scrape(metrics: BinderMetrics) -> list[str]:
    registry = Registry([])
    registry.register(metrics)
    return registry.exposition().decode().splitlines()


def test_counts_have_kcm_names_labels_and_help() -> None:
    metrics = BinderMetrics()
    metrics.sources.append((lambda: VOLUMES, lambda: CLAIMS))
    lines = scrape(metrics)
    for line in [
        "# HELP pv_collector_total_pv_count [ALPHA] Gauge measuring total number of persistent volumes",
        "# TYPE pv_collector_total_pv_count gauge",
        'pv_collector_total_pv_count{plugin_name="N/A",volume_mode="Block"} 1.0',
        'pv_collector_total_pv_count{plugin_name="N/A",volume_mode="Filesystem"} 1.0',
        'pv_collector_total_pv_count{plugin_name="kubernetes.io/host-path",volume_mode="Filesystem"} 2.0',
        'pv_collector_total_pv_count{plugin_name="kubernetes.io/nfs",volume_mode="Filesystem"} 1.0',
        "# HELP pv_collector_bound_pv_count [ALPHA] Gauge measuring number of persistent volume "
        "currently bound",
        'pv_collector_bound_pv_count{storage_class=""} 1.0',
        "# HELP pv_collector_unbound_pv_count [ALPHA] Gauge measuring number of persistent volume "
        "currently unbound",
        'pv_collector_unbound_pv_count{storage_class=""} 2.0',
        'pv_collector_unbound_pv_count{storage_class="gold"} 2.0',
        "# HELP pv_collector_bound_pvc_count [ALPHA] Gauge measuring number of persistent volume claim "
        "currently bound",
        'pv_collector_bound_pvc_count{namespace="default",storage_class="",volume_attributes_class=""} 1.0',
        "# HELP pv_collector_unbound_pvc_count [ALPHA] Gauge measuring number of persistent volume claim "
        "currently unbound",
        'pv_collector_unbound_pvc_count{namespace="default",storage_class="",volume_attributes_class=""} 2.0',
        'pv_collector_unbound_pvc_count{namespace="default",storage_class="gold",'
        'volume_attributes_class="fast"} 1.0',
        "# HELP retroactive_storageclass_total [ALPHA] Total number of retroactive StorageClass "
        "assignments to persistent volume claim",
        "# TYPE retroactive_storageclass_total counter",
        "retroactive_storageclass_total 0.0",
        "# HELP retroactive_storageclass_errors_total [ALPHA] Total number of failed retroactive "
        "StorageClass assignments to persistent volume claim",
        "retroactive_storageclass_errors_total 0.0",
    ]:
        assert line in lines
    # Nothing kcm does not print: no _created series, no operation families before an operation.
    assert not [line for line in lines if "_created" in line or "volume_operation" in line]


def test_operation_metrics_print_as_client_golang() -> None:
    metrics = BinderMetrics()
    metrics.observe_operation("loop.csi.kubeloop.dev", "provision", 0.3)
    metrics.observe_operation("loop.csi.kubeloop.dev", "provision", 7)
    metrics.operation_failed("", "delete")
    metrics.retroactive_assignment(success=True)
    metrics.retroactive_assignment(success=False)
    lines = scrape(metrics)
    labels = 'operation_name="provision",plugin_name="loop.csi.kubeloop.dev"'
    for line in [
        "# HELP volume_operation_total_seconds [ALPHA] Storage operation end to end duration in seconds",
        "# TYPE volume_operation_total_seconds histogram",
        f'volume_operation_total_seconds_bucket{{le="0.25",{labels}}} 0.0',
        f'volume_operation_total_seconds_bucket{{le="0.5",{labels}}} 1.0',
        f'volume_operation_total_seconds_bucket{{le="5",{labels}}} 1.0',
        f'volume_operation_total_seconds_bucket{{le="10",{labels}}} 2.0',
        f'volume_operation_total_seconds_bucket{{le="+Inf",{labels}}} 2.0',
        f"volume_operation_total_seconds_count{{{labels}}} 2.0",
        f"volume_operation_total_seconds_sum{{{labels}}} 7.3",
        # kcm's counter has no _total suffix, and an unknown plugin is "N/A".
        "# HELP volume_operation_total_errors [ALPHA] Total volume operation errors",
        "# TYPE volume_operation_total_errors counter",
        'volume_operation_total_errors{operation_name="delete",plugin_name="N/A"} 1.0',
        "retroactive_storageclass_total 2.0",
        "retroactive_storageclass_errors_total 1.0",
    ]:
        assert line in lines
    assert not [line for line in lines if "_created" in line]
