"""bench.footprint's `kind` scenario: how it reads a container's memory cgroup and processes from
the text of the node's files (the cluster itself is bench work, not a test)."""

from __future__ import annotations

import math

import pytest

from bench import footprint_kind
from bench.footprint_kind import cgroup_mib, kib_field, memory_cgroup_dir, node_files

MIB = 2**20
V1 = """12:memory:/kubelet.slice/pod.slice/cri-containerd-abc.scope
1:cpu,cpuacct:/kubelet.slice/pod.slice/cri-containerd-abc.scope
0::/
"""


def test_the_memory_cgroup_of_a_process_on_either_hierarchy() -> None:
    assert memory_cgroup_dir(V1) == (
        "/sys/fs/cgroup/memory/kubelet.slice/pod.slice/cri-containerd-abc.scope",
        False,
    )
    assert memory_cgroup_dir("0::/kubepods.slice/x.scope\n") == (
        "/sys/fs/cgroup/kubepods.slice/x.scope",
        True,
    )
    with pytest.raises(RuntimeError):
        memory_cgroup_dir("1:cpu:/x\n")


def test_the_working_set_is_usage_less_inactive_file_pages() -> None:
    d = "/sys/fs/cgroup/memory/c"
    v1 = {
        f"{d}/memory.usage_in_bytes": str(40 * MIB),
        f"{d}/memory.max_usage_in_bytes": str(50 * MIB),
        f"{d}/memory.stat": f"cache {MIB}\ntotal_cache {4 * MIB}\ntotal_rss {30 * MIB}\n"
        f"total_inactive_file {3 * MIB}\n",
    }
    assert cgroup_mib(v1, d, v2=False) == {
        "working_set": 37.0,
        "anon": 30.0,
        "file": 4.0,
        "cgroup_peak": 50.0,
    }
    v2 = {
        f"{d}/memory.current": str(20 * MIB),
        f"{d}/memory.stat": f"anon {16 * MIB}\nfile {2 * MIB}\ninactive_file {MIB}\n",
    }
    got = cgroup_mib(v2, d, v2=True)
    assert got["working_set"] == 19.0 and got["anon"] == 16.0 and math.isnan(got["cgroup_peak"])


def test_files_read_in_one_exec_are_split_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    out = "=== /proc/1/status\nName:\tx\nVmHWM:\t  2048 kB\n\n=== /proc/2/status\n\n=== /a\n7\n\n"
    monkeypatch.setattr(footprint_kind, "node_exec", lambda node, *command: out)
    files = node_files("n", ["/proc/1/status", "/proc/2/status", "/a"])
    assert files == {"/proc/1/status": "Name:\tx\nVmHWM:\t  2048 kB", "/proc/2/status": "", "/a": "7"}
    assert kib_field(files["/proc/1/status"], "VmHWM") == 2.0
    assert math.isnan(kib_field(files["/proc/1/status"], "RssAnon"))


SMAPS = """55f85b2a4000-55f85b2aa000 r--p 00000000 00:2b 952671                     /usr/bin/python3.11
Rss:                  24 kB
Anonymous:             0 kB
55f85b2aa000-55f85b2b4000 rw-p 00006000 00:2b 952671                     /usr/bin/python3.11
Rss:                  40 kB
Anonymous:             8 kB
7f0000000000-7f0000001000 rw-p 00000000 00:00 0                          [heap]
Rss:                 100 kB
Anonymous:           100 kB
7f0000002000-7f0000003000 r-xp 00000000 00:2b 17                         /lib/libc.so.6
Rss:                  12 kB
Anonymous:             0 kB
"""


def test_distinct_pages_count_each_file_once_across_processes() -> None:
    one = footprint_kind.file_pages_kib(SMAPS)
    assert one == {"/usr/bin/python3.11": 56, "/lib/libc.so.6": 12}
    other = {"/usr/bin/python3.11": 1024, "/csi-snapshotter": 2048}
    assert footprint_kind.distinct_mib(10.0, [one, other]) == 10.0 + (1024 + 12 + 2048) / 1024
