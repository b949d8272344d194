"""The node-to-node transfer (issue 47) against a local sparse copy: a 1 GiB sparse file pulled
through csi_driver.transfer's TLS server and client on 127.0.0.1, and `cp --sparse=always` of the
same file on the same machine, alternating per round (bench/method.py).

Two scenarios: `25` has a quarter of the file written (random data in 1 MiB blocks scattered over
it), `100` all of it. The server runs in a process of its own (as on another node it would), the
client in this one. Before each side the source is evicted from the page cache, so both read it
from the disk; both sides end with the copy on disk (the pull fsyncs it, `cp` is followed by an
fsync of its copy). Figures: wall time, the file's logical size per second, and the CPU both
processes of the transfer spent (client and server) against cp's.

    python -m bench.transfer [--scenarios 25,100] [--rounds 5] [--size-mib 1024] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import random
import resource
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.certs import PKI
from csi_driver.transfer import client, server, wire
from csi_driver.transfer.errors import TransferDenied

from .common import cpu_seconds, stop_process
from .datapath import drop_cached
from .method import Bench, Figure, Pair, add_rounds_arg, alternate, run

MiB = 1 << 20
SERVER_NAME = "transfer.loop.csi.kubeloop.dev"
TOKEN = "bench-token"
SCENARIOS = {"25": "25 % written, scattered 1 MiB blocks", "100": "100 % written"}

BENCH = Bench(
    name="transfer",
    title="pulling a sparse file through the TLS transfer vs. cp --sparse=always, 127.0.0.1",
    sides={"kubeloop": "transfer (TLS)", "go": "cp --sparse=always"},
    figures=(
        Figure("seconds", "seconds"),
        Figure("mib_s", "logical MiB/s", "higher"),
        Figure("cpu_s", "CPU s"),
    ),
)


@dataclass
class Figures:
    seconds: float
    mib_s: float
    cpu_s: float


@dataclass
class FileSources:
    """The one source the server offers: volume `bench` is the file of the scenario."""

    path: Path

    def describe(self, kind: str, source_id: str) -> wire.SourceInfo | None:
        if kind != "volume" or source_id != "bench" or not self.path.exists():
            return None
        size = self.path.stat().st_size
        return wire.SourceInfo(str(self.path), size, server.file_generation(str(self.path)), "block", "")

    @contextlib.asynccontextmanager
    async def hold(self, source_id: str) -> AsyncIterator[None]:
        yield


async def authenticate(token: str) -> str:
    if token != TOKEN:
        raise TransferDenied("not the bench's token")
    return "node-b"


def contexts(pki_dir: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) TLS contexts from a CA made for the run."""
    pki = PKI(pki_dir, ca_name="transfer-bench-ca")
    ca = pki.ensure_ca()
    pair = pki.ensure_serving("transfer", SERVER_NAME, [SERVER_NAME], ())
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(pair.cert, pair.key)
    return serving, ssl.create_default_context(cafile=str(ca.cert))


async def serve(source: Path, pki_dir: Path) -> None:
    """The server process: prints its port, serves until stdin closes."""
    srv = server.TransferServer(
        node="node-a",
        sources=FileSources(source),
        authenticate=authenticate,
        ssl_context=contexts(pki_dir)[0],
        host="127.0.0.1",
    )
    await srv.start()
    print(srv.port, flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await srv.stop()


def make_source(path: Path, size: int, percent: int, seed: int = 47) -> None:
    """`percent` of the file's MiB blocks written with random data, the rest a hole."""
    blocks = size // MiB
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(blocks), blocks * percent // 100))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        for block in chosen:
            os.pwrite(fd, rng.randbytes(MiB), block * MiB)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@contextlib.asynccontextmanager
async def server_process(source: Path, pki_dir: Path) -> AsyncIterator[tuple[int, int]]:
    """(port, pid) of a server process serving `source`."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.transfer", "--serve", str(source), "--pki", str(pki_dir),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not line:
            raise RuntimeError("the transfer server process did not start")
        yield int(line), proc.pid
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        await stop_process(proc)


async def scenario(work: Path, percent: int, size: int, rounds: int) -> list[Pair]:
    source, copy, pki_dir = work / "source.img", work / "copy.img", work / "pki"
    print(f"{percent}: writing the {size // MiB} MiB source ...", flush=True)
    await asyncio.to_thread(make_source, source, size, percent)
    client_ctx = contexts(pki_dir)[1]
    expected = await asyncio.to_thread(digest, source)
    async with server_process(source, pki_dir) as (port, pid):

        async def one(side: str, r: int) -> Figures:
            copy.unlink(missing_ok=True)
            await asyncio.to_thread(drop_cached, source)
            cpu = cpu_seconds(os.getpid()) + cpu_seconds(pid) if side == "kubeloop" else children_cpu()
            start = time.perf_counter()
            if side == "kubeloop":
                endpoint = ("127.0.0.1", port)
                await client.pull(
                    endpoint, client_ctx, SERVER_NAME, TOKEN, "node-b", "volume", "bench", str(copy), size
                )
            else:
                cp = await asyncio.create_subprocess_exec("cp", "--sparse=always", str(source), str(copy))
                if await cp.wait() != 0:
                    raise RuntimeError("cp failed")
                await asyncio.to_thread(fsync_file, copy)
            seconds = time.perf_counter() - start
            spent = (
                cpu_seconds(os.getpid()) + cpu_seconds(pid) if side == "kubeloop" else children_cpu()
            ) - cpu
            if r == 0 and await asyncio.to_thread(digest, copy) != expected:
                raise RuntimeError(f"{side}: the copy differs from the source")
            return Figures(round(seconds, 3), round(size / MiB / seconds, 1), round(spent, 2))

        try:
            return await alternate(rounds, one, f"{percent} %: ", flip=True)
        finally:
            copy.unlink(missing_ok=True)
            source.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated (default: %(default)s)"
    )
    add_rounds_arg(parser)
    parser.add_argument("--size-mib", type=int, default=1024, help="file size (default: 1024)")
    parser.add_argument("--dir", default="/var/tmp", help="where the files go (default: /var/tmp)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the server process's own mode
    parser.add_argument("--pki", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(Path(args.serve), Path(args.pki)))
        return
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="kubeloop-transfer-", dir=args.dir) as tmp:
        params = {
            "size_mib": args.size_mib,
            "region_mib": wire.REGION // MiB,
            "pool_fs": subprocess.run(
                ["findmnt", "-n", "-o", "FSTYPE", "--target", tmp],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip(),
        }

        async def collect() -> dict[str, list[Pair]]:
            work = Path(tmp)
            return {
                f"{n} % ({SCENARIOS[n]})": await scenario(work, int(n), args.size_mib * MiB, args.rounds)
                for n in names
            }

        run(BENCH, params, collect)


if __name__ == "__main__":
    main()
