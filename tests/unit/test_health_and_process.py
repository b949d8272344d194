"""The HTTP endpoint and the process entry, on loopback and real subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest

from controller_runtime.health import HealthServer
from controller_runtime.metrics import Counter, Registry
from controller_runtime.toolchain import REPO_ROOT
from localstack.proc import free_ports


async def test_metrics_healthz_and_readyz() -> None:
    registry = Registry([])
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
    server = HealthServer("127.0.0.1:0", registry=Registry([]))
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


async def _exchange(port: int, data: bytes) -> bytes:
    """Sends raw bytes and reads until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_the_endpoint_speaks_http_as_its_clients_expect() -> None:
    """The endpoint's own HTTP/1.1 server (issue 49, in place of aiohttp's): keep-alive, HEAD, the
    errors worded as aiohttp's, a request it cannot read refused with 400."""
    server = HealthServer("127.0.0.1:0", registry=Registry([]))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{server.port}"
            async with http.get(f"{base}/nothing") as resp:
                assert (resp.status, await resp.text()) == (404, "404: Not Found")
            async with http.post(f"{base}/healthz", data=b"x" * 100) as resp:
                assert (resp.status, await resp.text()) == (405, "405: Method Not Allowed")
                assert resp.headers["Allow"] == "GET,HEAD"
            async with http.head(f"{base}/healthz") as resp:
                assert (resp.status, resp.headers["Content-Length"]) == (200, "2")
            async with http.get(f"{base}/healthz?verbose=1") as resp:
                assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
            async with http.get(f"{base}/debug/queues") as resp:
                assert resp.headers["Content-Type"] == "application/json; charset=utf-8"
                assert isinstance(await resp.json(), (dict, list))
            async with http.get(f"{base}/metrics") as resp:
                assert resp.headers["Content-Type"].startswith("text/plain; version=")
        # Two requests on one connection, the second asking to close it.
        two = await _exchange(
            server.port,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /livez HTTP/1.1\r\nConnection: close\r\n\r\n",
        )
        assert two.count(b"HTTP/1.1 200 OK\r\n") == 2 and two.endswith(b"ok")
        # HTTP/1.0 closes after the answer unless asked to keep the connection.
        assert (await _exchange(server.port, b"GET /readyz HTTP/1.0\r\n\r\n")).endswith(b"\r\n\r\nok")
        for bad in (b"nonsense\r\n\r\n", b"GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"):
            assert (await _exchange(server.port, bad)).startswith(b"HTTP/1.1 400 Bad Request\r\n")
        # A connection left open does not keep stop() waiting.
        _reader, idle = await asyncio.open_connection("127.0.0.1", server.port)
    finally:
        await asyncio.wait_for(server.stop(), 5)
    idle.close()


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
    everywhere = HealthServer(f":{port}", registry=Registry([]))
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
    loopback = HealthServer(f"127.0.0.1:{port}", registry=Registry([]))
    await loopback.start()
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientConnectionError):
                await http.get(f"http://[::1]:{port}/healthz")
    finally:
        await loopback.stop()


COMPONENT = textwrap.dedent("""
    import argparse, asyncio, os, sys
    from controller_runtime import process

    async def run(args, ctx):
        print("started", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(float(os.environ.get("CLEANUP_SECONDS", "0")))
            print("cleaned up", flush=True)

    parser = argparse.ArgumentParser(prog="demo", description="a demo component")
    process.add_logging_flags(parser)
    process.add_http_flags(parser)
    process.add_kube_flags(parser)
    process.add_leader_election_flags(parser)
    process.main(parser, run)
""")

# The same component on threads (controller_runtime.process_threads: node-driver-registrar's and
# livenessprobe's entry), which must take its signals alike.
THREADED_COMPONENT = textwrap.dedent("""
    import argparse, os, sys, time
    from controller_runtime import process, process_threads
    from controller_runtime.logs import setup_logging

    def run(args, ctx):
        print("started", flush=True)
        try:
            ctx.stopping.wait()
        finally:
            time.sleep(float(os.environ.get("CLEANUP_SECONDS", "0")))
            print("cleaned up", flush=True)

    parser = argparse.ArgumentParser(prog="demo", description="a demo component")
    process.add_logging_flags(parser)
    process.add_http_flags(parser)
    args = process.parse_args(parser)
    setup_logging(args.log_format, args.verbosity)
    sys.exit(process_threads.serve(run, args))
""")
COMPONENTS = [pytest.param(COMPONENT, id="asyncio"), pytest.param(THREADED_COMPONENT, id="threads")]


async def start_component(
    tmp_path: Path,
    *args: str,
    cleanup_seconds: float = 0,
    hangup: signal.Handlers = signal.SIG_DFL,
    component: str = COMPONENT,
) -> asyncio.subprocess.Process:
    """The demo component, its clean-up taking `cleanup_seconds`, started with SIGHUP at `hangup`."""
    script = tmp_path / "component.py"
    script.write_text(component)
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        *args,
        cwd=REPO_ROOT,
        env={**os.environ, "CLEANUP_SECONDS": str(cleanup_seconds)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup),
    )


@pytest.mark.parametrize(
    ("stop", "hangup"),
    [
        pytest.param(signal.SIGTERM, signal.SIG_DFL, id="SIGTERM"),
        # A hang-up (the terminal of `make up` closed) is a stop, also for a process started with
        # SIGHUP ignored, as `nohup` or a harness may start it.
        pytest.param(signal.SIGHUP, signal.SIG_IGN, id="SIGHUP-started-ignored"),
    ],
)
@pytest.mark.parametrize("component", COMPONENTS)
async def test_a_stop_signal_runs_cleanup_and_exits_zero(
    tmp_path: Path, stop: signal.Signals, hangup: signal.Handlers, component: str
) -> None:
    proc = await start_component(tmp_path, "--log-format=json", hangup=hangup, component=component)
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"started\n"
    proc.send_signal(stop)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert b"cleaned up" in out
    assert f'"msg": "shutting down", "signal": "{stop.name}"'.encode() in err, "json logs"


@pytest.mark.parametrize(
    ("repeat", "code", "cleaned_up"),
    [
        pytest.param(signal.SIGTERM, 0, True, id="SIGTERM"),
        pytest.param(signal.SIGHUP, 0, True, id="SIGHUP"),
        pytest.param(signal.SIGINT, 1, False, id="SIGINT"),
    ],
)
@pytest.mark.parametrize("component", COMPONENTS)
async def test_a_repeated_signal_waits_for_the_clean_up_but_a_second_ctrl_c_exits_at_once(
    tmp_path: Path, repeat: signal.Signals, code: int, cleaned_up: bool, component: str
) -> None:
    """make passes its SIGTERM on to its child, shells and sudo a hang-up: a repeat must not cut the
    clean-up short. A person pressing Ctrl-C again means it."""
    proc = await start_component(tmp_path, cleanup_seconds=1.5, component=component)
    assert proc.stdout is not None and proc.stderr is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"started\n"
    proc.send_signal(signal.SIGTERM)
    while b"shutting down" not in (line := await asyncio.wait_for(proc.stderr.readline(), 30)):
        assert line, "stderr ended before the component logged its shutdown"
    proc.send_signal(repeat)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == code, err.decode()
    assert (b"cleaned up" in out) == cleaned_up, out


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
