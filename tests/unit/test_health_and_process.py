"""The HTTP endpoint and the process entry, on loopback and real subprocesses."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter

from controller_runtime.health import HealthServer
from controller_runtime.toolchain import REPO_ROOT
from localstack.proc import free_ports


async def test_metrics_healthz_and_readyz() -> None:
    registry = CollectorRegistry()
    Counter("kubeloop_test_total", "a test counter", registry=registry).inc(3)
    server = HealthServer("127.0.0.1:0", registry=registry)
    ready = {"reason": "caches not synced"}
    server.add_readiness_check("informers", lambda: ready["reason"])
    await server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/metrics") as resp:
                assert resp.status == 200
                assert "kubeloop_test_total 3.0" in await resp.text()
            async with http.get(f"{base}/healthz") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
            async with http.get(f"{base}/readyz") as resp:
                assert resp.status == 503
                assert "informers failed: caches not synced" in await resp.text()
            ready["reason"] = None  # type: ignore[assignment]
            async with http.get(f"{base}/readyz") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
    finally:
        await server.stop()


async def test_liveness_checks_may_be_coroutines_and_fail_with_500() -> None:
    server = HealthServer("127.0.0.1:0", registry=CollectorRegistry())
    answer: dict[str, str | None] = {"reason": "driver not ready"}

    async def probe() -> str | None:
        await asyncio.sleep(0)
        return answer["reason"]

    def broken() -> str | None:
        raise RuntimeError("boom")

    server.add_liveness_check("csi", probe)
    await server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/healthz") as resp:
                assert (resp.status, await resp.text()) == (500, "[-]csi failed: driver not ready\n")
            async with http.get(f"{base}/readyz") as resp:
                assert resp.status == 503
            answer["reason"] = None
            async with http.get(f"{base}/healthz") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
            server.add_liveness_check("broken", broken)
            async with http.get(f"{base}/healthz") as resp:
                assert (resp.status, await resp.text()) == (500, "[-]broken failed: RuntimeError: boom\n")
    finally:
        await server.stop()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def test_an_empty_host_serves_every_interface() -> None:
    """`:port` is what a pod's manifest says so that kubelet can probe the pod IP; `127.0.0.1:port`
    (the local stack) stays on IPv4 loopback."""
    (port,) = free_ports(1)
    hosts = ["127.0.0.1", "[::1]"] if _ipv6_loopback() else ["127.0.0.1"]
    everywhere = HealthServer(f":{port}", registry=CollectorRegistry())
    await everywhere.start()
    try:
        async with aiohttp.ClientSession() as http:
            for host in hosts:
                async with http.get(f"http://{host}:{port}/healthz") as resp:
                    assert (resp.status, await resp.text()) == (200, "ok"), host
    finally:
        await everywhere.stop()
    if len(hosts) < 2:
        return
    loopback = HealthServer(f"127.0.0.1:{port}", registry=CollectorRegistry())
    await loopback.start()
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientConnectionError):
                await http.get(f"http://[::1]:{port}/healthz")
    finally:
        await loopback.stop()


COMPONENT = textwrap.dedent("""
    import argparse, asyncio, sys
    from controller_runtime import process

    async def run(args, ctx):
        print("started", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            print("cleaned up", flush=True)

    parser = argparse.ArgumentParser(prog="demo", description="a demo component")
    process.add_logging_flags(parser)
    process.add_http_flags(parser)
    process.add_kube_flags(parser)
    process.add_leader_election_flags(parser)
    process.main(parser, run)
""")


async def start_component(tmp_path: Path, *args: str) -> asyncio.subprocess.Process:
    script = tmp_path / "component.py"
    script.write_text(COMPONENT)
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        *args,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_sigterm_runs_cleanup_and_exits_zero(tmp_path: Path) -> None:
    proc = await start_component(tmp_path, "--log-format=json")
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"started\n"
    proc.send_signal(signal.SIGTERM)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert b"cleaned up" in out
    assert b'"msg": "shutting down"' in err, "json logs"


async def test_help_explains_the_common_flags(tmp_path: Path) -> None:
    proc = await start_component(tmp_path, "--help")
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    text = out.decode()
    assert proc.returncode == 0
    for flag in (
        "--kubeconfig",
        "--kube-api-qps",
        "--kube-api-burst",
        "--http-endpoint",
        "--leader-election",
        "--log-format",
    ):
        assert flag in text
