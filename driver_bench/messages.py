"""CSI messages by method name, for a proxy that only sees bytes: which request and response types
a full gRPC method name (`/csi.v1.Controller/CreateVolume`) carries, read from the generated
descriptor so every method of the pinned CSI spec is known without a list."""

from __future__ import annotations

from functools import cache
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from kubeloop_grpc.csi import csi_pb2

PACKAGE = "csi.v1"


def full_name(service: str, method: str) -> str:
    return f"/{PACKAGE}.{service}/{method}"


def short_name(method: str) -> str:
    """`/csi.v1.Controller/CreateVolume` -> `CreateVolume`."""
    return method.rsplit("/", 1)[-1]


@cache
def _types() -> dict[str, tuple[type[Message], type[Message]]]:
    out: dict[str, tuple[type[Message], type[Message]]] = {}
    for service in csi_pb2.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            request = getattr(csi_pb2, m.input_type.name)
            response = getattr(csi_pb2, m.output_type.name)
            out[full_name(service.name, m.name)] = (request, response)
    return out


def method_of(short: str) -> str:
    """The full name of a CSI method given its short one."""
    for full in _types():
        if short_name(full) == short:
            return full
    raise KeyError(f"no CSI method {short!r}")


def known(method: str) -> bool:
    return method in _types()


def decode(method: str, data: bytes, response: bool = False) -> Message:
    message = _types()[method][1 if response else 0]()
    message.ParseFromString(data)
    return message


def to_json(method: str, data: bytes, response: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = json_format.MessageToDict(
        decode(method, data, response), preserving_proto_field_name=True
    )
    return doc


def from_json(method: str, doc: dict[str, Any], response: bool = False) -> bytes:
    message = _types()[method][1 if response else 0]()
    json_format.ParseDict(doc, message)
    data: bytes = message.SerializeToString()
    return data
