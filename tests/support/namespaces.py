"""A namespace a test may use: its `default` ServiceAccount made."""

from __future__ import annotations

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import SERVICE_ACCOUNTS
from tests.support.waits import eventually_async


async def default_service_account(api: ApiClient, namespace: str, timeout: float = 60.0) -> None:
    """The ServiceAccount admission plugin refuses a pod until kcm's serviceaccount controller has
    made the namespace's `default` account, a moment after the namespace exists; the Kubernetes
    e2e framework waits for it in the same way before a test creates pods."""

    async def made() -> bool:
        try:
            await api.get(SERVICE_ACCOUNTS, "default", namespace)
            return True
        except ApiError as err:
            if err.not_found:
                return False
            raise

    await eventually_async(f"kcm to make serviceaccount {namespace}/default", made, timeout)
