"""The driver bench's pure parts, without a driver: the sweep, which step a raw call is, what the
caller believes exists from a call log, the inventory against it, a reproducer's translation of
ids and paths, and the report's timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver_bench import messages, oracles, report, stack_campaign
from driver_bench.faults import STEPS, Fault, FaultKind, parse_kinds, step_of, sweep
from driver_bench.oracles import Finding, Objects
from driver_bench.proxy import Call
from driver_bench.reproducer import Translation
from driver_bench.scenario import ScenarioResult
from kubeloop_grpc.csi import csi_pb2

CREATE = messages.method_of("CreateVolume")
DELETE = messages.method_of("DeleteVolume")


def test_the_sweep_is_a_baseline_then_every_fault_on_every_step() -> None:
    plan = sweep(FaultKind, STEPS)
    assert plan[0] is None and len(plan) == 1 + len(FaultKind) * len(STEPS)
    assert Fault(FaultKind.KILL_AFTER, "CreateVolumeFromSnapshot") in plan
    assert parse_kinds("timeout,drop") == [FaultKind.TIMEOUT, FaultKind.DROP]
    assert parse_kinds("all") == list(FaultKind)
    with pytest.raises(ValueError, match="unknown fault 'crash'"):
        parse_kinds("crash")
    fault = Fault(FaultKind.DUPLICATE, "DeleteVolume", 2)
    assert Fault.from_json(fault.to_json()) == fault and str(fault) == "duplicate DeleteVolume#2"


def test_a_restore_is_its_own_step() -> None:
    plain = csi_pb2.CreateVolumeRequest(name="a").SerializeToString()
    restore = csi_pb2.CreateVolumeRequest(
        name="b",
        volume_content_source=csi_pb2.VolumeContentSource(
            snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id="s")
        ),
    ).SerializeToString()
    assert step_of(CREATE, plain) == "CreateVolume"
    assert step_of(CREATE, restore) == "CreateVolumeFromSnapshot"
    assert step_of("/x.y/Unknown", b"\x00") == "Unknown"


def created(volume_id: str) -> bytes:
    data: bytes = csi_pb2.CreateVolumeResponse(volume=csi_pb2.Volume(volume_id=volume_id)).SerializeToString()
    return data


def test_the_caller_believes_only_answers_it_got() -> None:
    req = csi_pb2.CreateVolumeRequest(name="a").SerializeToString()
    log = [
        (CREATE, req, created("v1"), "UNAVAILABLE"),  # answered, but the answer was dropped
        (CREATE, req, created("v2"), "OK"),
        (CREATE, req, created("v3"), "OK"),
        (DELETE, csi_pb2.DeleteVolumeRequest(volume_id="v3").SerializeToString(), b"", "OK"),
    ]
    believed = oracles.belief(log)
    assert believed == Objects(frozenset({"v2"}), frozenset())
    held = Objects(frozenset({"v1", "v2"}), frozenset({"s1"}))
    assert [f.kind for f in oracles.compare(believed, held)] == ["leaked-volume", "leaked-snapshot"]
    assert [f.kind for f in oracles.compare(held, believed)] == ["lost-volume", "lost-snapshot"]


def test_a_replay_translates_ids_and_the_scenario_directory() -> None:
    tr = Translation(["/old/s01"], "/new/r", {})
    tr.learn({"volume": {"volume_id": "vol-1"}}, {"volume": {"volume_id": "vol-9"}})
    assert tr("vol-1") == "vol-9"
    assert tr("volumes/vol-1.img") == "volumes/vol-9.img"
    assert tr("/old/s01/kubelet/pods/v0/mount") == "/new/r/kubelet/pods/v0/mount"
    assert tr("/old/s011/x") == "/old/s011/x"
    # A stack's second node: the replay's one driver plays both.
    two = Translation(["/h/nodes/node-a", "/h/nodes/node-b"], "/new/r", {})
    assert two("/h/nodes/node-b/kubelet/x") == two("/h/nodes/node-a/kubelet/x") == "/new/r/kubelet/x"


def test_a_finding_seen_again_with_the_go_sidecars_is_the_drivers() -> None:
    ours = [Finding("leaked-volume", "v1"), Finding("stuck-pv", "pv-1")]
    verdict = stack_campaign.verdicts(ours, [Finding("leaked-volume", "v7")])
    assert verdict == {"leaked-volume": "driver", "stuck-pv": "kubeloop's sidecars"}
    unknown = stack_campaign.verdicts(ours, None, "no stack")
    assert unknown == {"leaked-volume": "unknown (no stack)", "stuck-pv": "unknown (no stack)"}


def test_the_report_times_the_driver_not_the_faults(tmp_path: Path) -> None:
    calls = [Call(0, CREATE, b"", 0.0, seconds=s) for s in (0.1, 0.3, 0.2)]
    calls.append(Call(3, CREATE, b"", 0.0, seconds=5.0, fault="kill-after CreateVolume"))
    result = ScenarioResult("s", None, tmp_path, [], calls, [], 1.0, False, True)
    (timing,) = report.timings([result])
    assert (timing.method, timing.count, timing.p50, timing.max) == ("CreateVolume", 3, 0.2, 0.3)
    doc = report.to_json("r.yaml", [result], {"concurrency": 1}, 1.0)
    assert "| CreateVolume | 3 | 0.2000 | 0.3000 |" in report.to_markdown(doc)
