"""Pure logic of the driver (no root needed): sizes, ids, paths, pagination tokens, mountinfo."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller_runtime.mounts import parse_mountinfo
from controller_runtime.unix_grpc import socket_path
from csi_driver.errors import CsiError
from csi_driver.main import build_parser
from csi_driver.pool_kinds import PoolCapacity, capacity_of_node, chosen_kind, parse_capacity, pool_capacity
from csi_driver.topology import local_topology, names_node, node_segment
from csi_driver.validation import (
    GiB,
    MiB,
    TiB,
    check_abs_path,
    check_id,
    choose_size,
    fits,
    format_size,
    paginate,
    parse_size,
)
from kubeloop_grpc.csi import csi_pb2


def code(fn: object, *args: object) -> grpc.StatusCode:
    with pytest.raises(CsiError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value.code


@pytest.mark.parametrize(
    ("required", "limit", "expected"),
    [
        (0, 0, GiB),  # nothing asked: the default
        (1, 0, MiB),  # rounded up to whole MiB
        (10 * GiB, 0, 10 * GiB),
        (MiB + 1, 0, 2 * MiB),
        (0, 512 * MiB, 512 * MiB),  # default capped by the limit
        (1, 5000, 4096),  # limit below a MiB: block-size rounding
        (MiB + 1, MiB + 8192, MiB + 4096),
        (10 * GiB, 10 * GiB, 10 * GiB),
    ],
)
def test_choose_size(required: int, limit: int, expected: int) -> None:
    size = choose_size(required, limit, TiB)
    assert size == expected
    assert fits(size, required, limit)


def test_choose_size_errors() -> None:
    assert code(choose_size, 2 * MiB, MiB, TiB) == grpc.StatusCode.OUT_OF_RANGE
    assert code(choose_size, 2 * TiB, 0, TiB) == grpc.StatusCode.OUT_OF_RANGE
    assert code(choose_size, 4097, 4100, TiB) == grpc.StatusCode.OUT_OF_RANGE
    assert code(choose_size, -1, 0, TiB) == grpc.StatusCode.INVALID_ARGUMENT


@given(st.integers(0, 2 * TiB), st.integers(0, 2 * TiB))
def test_choose_size_is_within_range_or_refuses(required: int, limit: int) -> None:
    try:
        size = choose_size(required, limit, TiB)
    except CsiError:
        return
    assert size >= required and (not limit or size <= limit) and size <= TiB and size % 4096 == 0


@pytest.mark.parametrize("good", ["vol-0123abcd", "fake-vol-id-228e5c10-f", "a", "A.b_c-1", "x" * 128])
def test_good_ids(good: str) -> None:
    assert check_id(good, "volume_id") == good


@pytest.mark.parametrize(
    "bad", ["", ".", "..", "../x", "a/b", "/abs", "a\x00b", ".hidden", "x" * 129, "a b", "é"]
)
def test_bad_ids(bad: str) -> None:
    assert code(check_id, bad, "volume_id") == grpc.StatusCode.INVALID_ARGUMENT


@given(st.text(max_size=300))
def test_an_accepted_id_is_always_one_plain_file_name(text: str) -> None:
    try:
        check_id(text, "id")
    except CsiError:
        return
    assert "/" not in text and "\x00" not in text and not text.startswith(".")


@pytest.mark.parametrize("good", ["/var/lib/kubelet/pods/x/mount", "/tmp/a/", "/a//b"])
def test_good_paths(good: str) -> None:
    assert check_abs_path(good, "target_path").startswith("/")


@pytest.mark.parametrize("bad", ["", "relative", "some/path", "/", "/a/../b", "/a/./b", "/a\x00", "//"])
def test_bad_paths(bad: str) -> None:
    assert code(check_abs_path, bad, "target_path") == grpc.StatusCode.INVALID_ARGUMENT


def test_pagination_walks_everything_once_and_survives_deletion() -> None:
    items = [(seq, f"v{seq}") for seq in range(1, 8)]
    seen, token = [], ""
    while True:
        page = paginate(items, token, 3)
        seen += page.entries
        if not page.next_token:
            break
        token = page.next_token
    assert seen == [v for _, v in items]
    first = paginate(items, "", 2)
    # the last entry of the page is deleted and a new one is created: the token still works
    later = [(s, v) for s, v in items if v != first.entries[-1]] + [(8, "v8")]
    assert paginate(later, first.next_token, 0).entries == ["v3", "v4", "v5", "v6", "v7", "v8"]


@pytest.mark.parametrize("token", ["invalid-token", "s", "s-1", "12", "s1x"])
def test_foreign_tokens_are_aborted(token: str) -> None:
    assert code(paginate, [(1, "a")], token, 0) == grpc.StatusCode.ABORTED


def test_sizes_parse_and_format() -> None:
    assert parse_size("10Gi") == 10 * GiB
    assert parse_size("512Mi") == 512 * MiB
    assert parse_size("1T") == 10**12
    assert parse_size("4096") == 4096
    assert format_size(10 * GiB) == "10Gi" and format_size(1536 * MiB) == "1536Mi" and format_size(7) == "7B"
    with pytest.raises(ValueError):
        parse_size("ten gigs")


def test_mountinfo_parsing_unescapes_paths() -> None:
    text = (
        "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
        "37 35 7:0 / /var/lib/kubelet/staging rw,relatime shared:2 - ext4 /dev/loop0 rw\n"
        "38 35 0:5 /loop0 /pods/target rw - devtmpfs udev rw,size=10k\n"
    )
    mounts = parse_mountinfo(text)
    assert [m.mountpoint for m in mounts] == ["/mnt/with space", "/var/lib/kubelet/staging", "/pods/target"]
    assert mounts[1].source == "/dev/loop0" and mounts[1].fs_type == "ext4" and not mounts[1].read_only
    assert mounts[2].root == "/loop0"


def test_socket_path_forms() -> None:
    assert socket_path("unix:///run/csi.sock") == "/run/csi.sock"
    assert socket_path("unix:/run/csi.sock") == "/run/csi.sock"
    assert socket_path("/run/csi.sock") == "/run/csi.sock"


@pytest.mark.parametrize(
    "flags",
    [
        "loop",
        "ro,loop",
        "offset=512",
        "bind",
        "rbind",
        "remount",
        "move",
        "X-mount.mkdir",
        "x-systemd.automount",
        "helper=x",
        "make-shared",
        "shared",
        "LOOP",
        " bind",
    ],
)
def test_mount_options_acting_outside_the_filesystem_are_refused(flags: str) -> None:
    from csi_driver.capabilities import forbidden_mount_option

    assert forbidden_mount_option(flags) is not None


@pytest.mark.parametrize(
    "flags", ["noatime", "discard,noatime", "data=ordered", "ro", "nodiscard", "errors=remount-ro"]
)
def test_filesystem_mount_options_are_accepted(flags: str) -> None:
    from csi_driver.capabilities import forbidden_mount_option

    assert forbidden_mount_option(flags) is None


# --- node-local topology and pool kinds -------------------------------------------------------------
Segments = list[dict[str, str]]


def _requirements(requisite: Segments, preferred: Segments) -> csi_pb2.TopologyRequirement:
    return csi_pb2.TopologyRequirement(
        requisite=[csi_pb2.Topology(segments=s) for s in requisite],
        preferred=[csi_pb2.Topology(segments=s) for s in preferred],
    )


def test_a_node_local_volume_is_accessible_from_its_node_only() -> None:
    own, other = node_segment("n1"), node_segment("n2")
    assert local_topology(None, "n1") == [own]
    assert local_topology(_requirements([other, own], [other]), "n1") == [own]
    assert local_topology(_requirements([], [own]), "n1") == [own]
    for reqs in (
        _requirements([other], []),
        _requirements([other], [other]),
        _requirements([], [other]),  # preferred only: it decides when there is no requisite
        _requirements([{**own, "zone": "a"}], []),  # a key the node does not have
    ):
        with pytest.raises(CsiError) as info:
            local_topology(reqs, "n1")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "n1" in info.value.message
    assert names_node(own, "n1") and not names_node(other, "n1") and not names_node({}, "n1")


def test_capacity_per_node_file_gives_this_nodes_entry() -> None:
    table = '{"node-a": ["50Gi"], "node-b": ["fast=1Gi", "slow=2Gi"], "node-c": ["lots"]}'
    assert capacity_of_node(table, "node-a") == [("", 50 * GiB)]
    assert capacity_of_node(table, "node-b") == [("fast", GiB), ("slow", 2 * GiB)]
    assert capacity_of_node(table, "node-d") is None  # not named: the --capacity flags hold
    for bad, words in (
        ("{", "not JSON"),
        ('["50Gi"]', "JSON object"),
        ('{"node-a": "50Gi"}', "node 'node-a': must be a non-empty list"),
        ('{"node-a": []}', "non-empty list"),
        ('{"node-a": [50]}', "strings"),
    ):
        with pytest.raises(ValueError, match=words):
            capacity_of_node(bad, "node-a")
    with pytest.raises(ValueError, match="node 'node-c': invalid size 'lots'"):
        capacity_of_node(table, "node-c")  # only this node's entry is read: node-a's stays usable


def test_driver_takes_its_nodes_capacity_from_the_file_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "capacity.json"
    table.write_text('{"node-a": ["fast=1Gi", "slow=2Gi"], "node-c": ["lots"]}')
    parse = build_parser().parse_args
    own = parse(["--node-id", "node-a", "--capacity", "5Gi", "--capacity-per-node", str(table)])
    assert own.capacity == PoolCapacity(kinds={"fast": GiB, "slow": 2 * GiB})
    assert own.capacity_from == str(table)
    other = parse(["--node-id", "node-b", "--capacity", "5Gi", "--capacity-per-node", str(table)])
    assert other.capacity == PoolCapacity(total=5 * GiB) and other.capacity_from == "--capacity"
    for argv, words in (
        (["--node-id", "node-c", "--capacity-per-node", str(table)], "invalid size 'lots'"),
        (["--node-id", "node-a", "--capacity-per-node", str(tmp_path / "missing")], "No such file"),
    ):
        with pytest.raises(SystemExit) as exited:
            parse(argv)
        assert exited.value.code == 2 and words in capsys.readouterr().err


def test_capacity_flags_and_the_kind_a_request_chooses() -> None:
    assert parse_capacity("50Gi") == ("", 50 * GiB)
    assert parse_capacity("fast=1Gi") == ("fast", GiB)
    for bad in ("=1Gi", "-x=1Gi", "fast=lots"):
        with pytest.raises(ValueError):
            parse_capacity(bad)
    assert pool_capacity([]) == PoolCapacity() and not PoolCapacity().budgeted
    assert pool_capacity([("", MiB), ("", GiB)]) == PoolCapacity(total=GiB)
    kinds = pool_capacity([("fast", MiB), ("slow", GiB), ("fast", 2 * MiB)])
    assert kinds == PoolCapacity(kinds={"fast": 2 * MiB, "slow": GiB}) and kinds.budgeted
    with pytest.raises(ValueError, match="do not mix"):
        pool_capacity([("", MiB), ("fast", MiB)])
    assert chosen_kind({"kind": "slow"}, kinds) == "slow"
    assert chosen_kind({}, PoolCapacity()) == ""
    for params, capacity, words in (
        ({"kind": "medium"}, kinds, "fast, slow"),
        ({}, kinds, "fast, slow"),
        ({"kind": "fast"}, PoolCapacity(), "none"),
    ):
        with pytest.raises(CsiError) as info:
            chosen_kind(params, capacity)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.message
