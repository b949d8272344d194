"""The messages node-driver-registrar and livenessprobe exchange, written and read by hand on the
wire format (the generated stubs need google.protobuf, 3 MiB of RSS). Field numbers are those of
the CSI spec's csi.proto and kubelet's pluginregistration api.proto; tests/unit/test_grpc_lite.py
holds every encoding against the generated stubs byte for byte.

Each message reads with `decode(bytes)`, skipping fields it does not know, and writes with
`encode()`, leaving out what proto3 leaves out (empty strings, false bools)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import wire


@dataclass(frozen=True)
class Empty:
    """A message with no fields of interest: GetPluginInfoRequest, ProbeRequest, InfoRequest,
    RegistrationStatusResponse. Decoding still checks that the bytes are a message."""

    def encode(self) -> bytes:
        return b""

    @classmethod
    def decode(cls, data: bytes) -> Empty:
        for _ in wire.fields(data):
            pass
        return cls()


@dataclass(frozen=True)
class GetPluginInfoResponse:
    """csi.v1.GetPluginInfoResponse."""

    name: str = ""
    vendor_version: str = ""
    manifest: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        # A map is a repeated message of key (1) and value (2), both written even when empty, as
        # protobuf writes map entries.
        entries = b"".join(
            wire.length_delimited(
                3, wire.length_delimited(1, key.encode()) + wire.length_delimited(2, value.encode())
            )
            for key, value in sorted(self.manifest.items())
        )
        return wire.string(1, self.name) + wire.string(2, self.vendor_version) + entries

    @classmethod
    def decode(cls, data: bytes) -> GetPluginInfoResponse:
        name, version, manifest = "", "", {}
        for number, _, value in wire.fields(data):
            if number == 1:
                name = wire.as_str(number, value)
            elif number == 2:
                version = wire.as_str(number, value)
            elif number == 3:
                key = entry = ""
                for sub, _, item in wire.fields(wire.as_bytes(number, value)):
                    if sub == 1:
                        key = wire.as_str(sub, item)
                    elif sub == 2:
                        entry = wire.as_str(sub, item)
                manifest[key] = entry  # a later entry for a key wins, as in protobuf
        return cls(name, version, manifest)


@dataclass(frozen=True)
class ProbeResponse:
    """csi.v1.ProbeResponse; `ready` is a google.protobuf.BoolValue, None when unset."""

    ready: bool | None = None

    def encode(self) -> bytes:
        if self.ready is None:
            return b""
        return wire.length_delimited(1, wire.boolean(1, self.ready))

    @classmethod
    def decode(cls, data: bytes) -> ProbeResponse:
        ready: bool | None = None
        for number, _, value in wire.fields(data):
            if number == 1:
                ready = False  # present: the wrapper's value, false unless it says true
                for sub, _, item in wire.fields(wire.as_bytes(number, value)):
                    if sub == 1:
                        ready = wire.as_bool(sub, item)
        return cls(ready)

    def is_ready(self) -> bool:
        """Ready unless it says `ready: false` (an unset field is ready), as csi_client.probe_ready."""
        return self.ready is not False


@dataclass(frozen=True)
class PluginInfo:
    """pluginregistration.PluginInfo, GetInfo's answer."""

    type: str = ""
    name: str = ""
    endpoint: str = ""
    supported_versions: tuple[str, ...] = ()

    def encode(self) -> bytes:
        versions = b"".join(wire.length_delimited(4, v.encode()) for v in self.supported_versions)
        return (
            wire.string(1, self.type) + wire.string(2, self.name) + wire.string(3, self.endpoint) + versions
        )

    @classmethod
    def decode(cls, data: bytes) -> PluginInfo:
        strings = {1: "", 2: "", 3: ""}
        versions: list[str] = []
        for number, _, value in wire.fields(data):
            if number in strings:
                strings[number] = wire.as_str(number, value)
            elif number == 4:
                versions.append(wire.as_str(number, value))
        return cls(strings[1], strings[2], strings[3], tuple(versions))


@dataclass(frozen=True)
class RegistrationStatus:
    """pluginregistration.RegistrationStatus, what kubelet reports after GetInfo."""

    plugin_registered: bool = False
    error: str = ""

    def encode(self) -> bytes:
        return wire.boolean(1, self.plugin_registered) + wire.string(2, self.error)

    @classmethod
    def decode(cls, data: bytes) -> RegistrationStatus:
        registered, error = False, ""
        for number, _, value in wire.fields(data):
            if number == 1:
                registered = wire.as_bool(number, value)
            elif number == 2:
                error = wire.as_str(number, value)
        return cls(registered, error)
