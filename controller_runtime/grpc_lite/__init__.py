"""Unary gRPC over unix sockets without grpcio, asyncio or protobuf, for the two node sidecars that
make a call now and then: node-driver-registrar and livenessprobe (issue 49).

grpcio and asyncio alone hold 30 MiB of RSS, more than the Go sidecars' 18.6 MiB; the pure-Python
HTTP/2 library `h2` on blocking sockets and threads holds about 6 over the bare interpreter. What is
here is only what those two exchange: `wire` (the protocol-buffers wire format), `messages` (their
eight messages), `status` (gRPC codes and errors worded as grpcio's), `framing` (the gRPC message
frame and the HTTP/2 settings both ends use), `client` (one unary call with a deadline) and
`server` (kubelet's plugin-registration socket).

`aio` is the asyncio counterpart of `client` for the processes that run on the event loop: the
sidecars' CSI connection (controller_runtime.csi_client) calls drivers through it, many calls at once
on one connection, with grpcio's error class and wording. The CSI driver keeps grpcio's server.
"""
