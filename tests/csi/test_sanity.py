"""csi-sanity v5.5.0, the real binary, against `--mode all` over a unix socket: once with mount
volumes and once with block volumes, on a shared pool and on a node-local one (`--node-local`).
Zero failures; the ginkgo summary goes into the output."""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from controller_runtime.toolchain import BUILD_SCRIPT, REPO_ROOT, MissingBinaryError, Toolchain

from .conftest import Driver, require_root


def sanity_binary() -> Path:
    """The cached csi-sanity; its absence is a failure telling how to build it, never a skip."""
    try:
        return Toolchain.default().binary("csi-sanity")
    except MissingBinaryError as e:
        pytest.fail(f"{e}\n(build just this one with: bash {BUILD_SCRIPT.relative_to(REPO_ROOT)} csi-sanity)")


def skipped_specs(report: Path) -> list[str]:
    if not report.exists():
        return []
    names = []
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            names.append(f"{case.get('name')}: {skipped.get('message', '')}")
    return names


@pytest.mark.root
@pytest.mark.parametrize("pool", ["shared", "node-local"])
@pytest.mark.parametrize("access_type", ["mount", "block"])
def test_csi_sanity(access_type: str, pool: str, csi_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_root()
    binary = sanity_binary()
    work = csi_root / f"sanity-{pool}-{access_type}"
    work.mkdir()
    # A small attach limit lets csi-sanity's max-attach test run (it publishes limit+1 volumes).
    flags = ["--max-volumes-per-node", "8"]
    if pool == "node-local":
        (work / "pool").mkdir()  # a node-local pool is never made by the driver
        flags.append("--node-local")
    driver = Driver(work, "all", f"sanity-{access_type}", flags).start()
    report = work / "junit.xml"
    # The ModifyVolume specs create and modify volumes with these (a VolumeAttributesClass's).
    mutable = work / "mutable-parameters.yaml"
    mutable.write_text("cacheMode: writethrough\n")
    try:
        proc = subprocess.run(
            [
                str(binary),
                f"--csi.endpoint={driver.endpoint}",
                # csi-sanity creates these two itself and fails when they already exist.
                # Both under the driver's --kubelet-dir, the only place it accepts paths.
                f"--csi.stagingdir={driver.kubelet / 'staging'}",
                f"--csi.mountdir={driver.kubelet / 'mount'}",
                f"--csi.testvolumeaccesstype={access_type}",
                "--csi.testnodevolumeattachlimit",
                f"--csi.testvolumemutableparameters={mutable}",
                f"--ginkgo.junit-report={report}",
                "--ginkgo.no-color",
                "--ginkgo.timeout=30m",
            ],
            capture_output=True,
            text=True,
            timeout=1900,
        )
    finally:
        code = driver.stop()
    output = proc.stdout + proc.stderr
    ran = re.search(r"Ran (\d+) of (\d+) Specs", output)
    counts = re.search(r"(\d+) Passed \| (\d+) Failed \| (\d+) Pending \| (\d+) Skipped", output)
    summary = (
        f"csi-sanity {pool} {access_type}: ran {ran.group(1)} of {ran.group(2)} specs; "
        f"passed {counts.group(1)}, failed {counts.group(2)}, pending {counts.group(3)}, "
        f"skipped {counts.group(4)}"
        if ran and counts
        else "csi-sanity printed no summary"
    )
    # Straight to the terminal, so the counts show in every run, not only with -s or on failure.
    with capsys.disabled():
        print(f"\n{summary}")
        for name in skipped_specs(report):
            print(f"  skipped: {name}")
    if proc.returncode != 0:
        failures = "\n".join(line for line in output.splitlines() if "[FAIL]" in line or "[FAILED]" in line)
        pytest.fail(
            f"{summary}\n{failures}\n--- last output ---\n{output[-12000:]}\n"
            f"--- driver log ---\n{driver.log.read_text()[-6000:]}"
        )
    assert counts is not None and counts.group(2) == "0", summary
    assert code == 0, f"the driver did not exit cleanly on SIGTERM (exit {code})"
    assert not driver.socket.exists(), "the driver left its socket behind after SIGTERM"
