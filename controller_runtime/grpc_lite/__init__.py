"""Unary gRPC over unix sockets without grpcio, asyncio or protobuf, for the two node sidecars that
make a call now and then: node-driver-registrar and livenessprobe (issue 49).

grpcio and asyncio alone hold 30 MiB of RSS, more than the Go sidecars' 18.6 MiB; the pure-Python
HTTP/2 library `h2` on blocking sockets and threads holds about 6 over the bare interpreter. What is
here is only what those two exchange: `wire` (the protocol-buffers wire format), `messages` (their
eight messages), `status` (gRPC codes and errors worded as grpcio's), `framing` (the gRPC message
frame and the HTTP/2 settings both ends use), `client` (one unary call with a deadline) and
`server` (kubelet's plugin-registration socket). The CSI driver and the controllers keep grpcio.
"""
