"""The local stack behind `make up`: certificates, the real Kubernetes control plane as processes,
the registry of kubeloop components, and a test helper. See docs/local-stack.md."""

from controller_runtime.certs import Identity

from .certs import ADMIN, service_account_identity
from .components import REGISTRY, Component, ComponentContext, Components
from .controlplane import ControlPlane, Ports, default_home
from .testing import start_test_control_plane

__all__ = [
    "ADMIN",
    "REGISTRY",
    "Component",
    "ComponentContext",
    "Components",
    "ControlPlane",
    "Identity",
    "Ports",
    "default_home",
    "service_account_identity",
    "start_test_control_plane",
]
