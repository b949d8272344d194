"""Shared fixtures: one real control plane per test session, an admin API client, and a fresh
namespace per test. The control plane runs the cached Go binaries; when they are missing the tests
that need them fail (never skip) with the command that builds them."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient
from controller_runtime.resources import NAMESPACES
from localstack.controlplane import ControlPlane
from localstack.testing import start_test_control_plane
from tests.support.namespaces import default_service_account


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def control_plane(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ControlPlane]:
    home = Path(tmp_path_factory.mktemp("controlplane"))
    cp = await start_test_control_plane(home, with_kcm=True, with_scheduler=True)
    try:
        yield cp
    finally:
        await cp.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def api(control_plane: ControlPlane) -> AsyncIterator[ApiClient]:
    client = await ApiClient.from_kubeconfig(
        str(control_plane.admin_kubeconfig), qps=0, burst=1, user_agent="kubeloop-tests"
    )
    try:
        yield client
    finally:
        await client.close()


@pytest_asyncio.fixture(loop_scope="session")
async def namespace(api: ApiClient) -> AsyncIterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    await api.create(NAMESPACES, {"metadata": {"name": name}})
    try:
        await default_service_account(api, name)
        yield name
    finally:
        await api.delete(NAMESPACES, name)
