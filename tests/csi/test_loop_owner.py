"""The owner mark a node plugin writes into each loop device it attaches, read back from the
kernel: what lets a restarted plugin adopt a device whose record it never wrote (killed between
the attach and the write) and never another plugin's. The kernel stopped keeping lo_crypt_name with
cryptoloop's removal (5.19), so the mark also rides in lo_file_name; on this machine's kernel only
that copy comes back."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from csi_driver.backend import loop

pytestmark = pytest.mark.root


def test_an_attached_device_reads_back_its_owner_and_its_real_backing_file(csi_root: Path) -> None:
    backing = csi_root / "owned"
    with open(backing, "wb") as f:
        f.truncate(16 << 20)
    owner = "kubeloop:0123456789abcdef:rw"

    async def attach_and_list() -> tuple[list[loop.LoopDevice], list[loop.LoopDevice]]:
        marked = await loop.attach(str(backing), direct_io=False, read_only=False, owner=owner)
        plain = await loop.attach(str(backing), direct_io=False, read_only=True)
        try:
            listed = [d for d in await loop.list_devices() if d.name in (marked.name, plain.name)]
            return (
                [d for d in listed if d.name == marked.name],
                [d for d in listed if d.name == plain.name],
            )
        finally:
            await loop.detach(marked.name)
            await loop.detach(plain.name)

    (seen,), (unmarked,) = asyncio.run(attach_and_list())
    assert seen.owner == owner
    # The path still comes from the kernel's own record of the file, not from the mark's field.
    assert seen.backed_by(str(backing)) and os.path.samefile(seen.back_file, backing)
    assert unmarked.owner == "" and unmarked.backed_by(str(backing))
    os.unlink(backing)
