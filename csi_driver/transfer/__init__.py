"""Node-to-node transfer of backing files (issue 47): one node's driver streams a volume or a
snapshot of its pool to another node's driver over TCP+TLS.

`wire` is the framing (regions of extents with digests), `server` the sending side (a minimal
HTTP/1.1 server, so an operator can read its errors with curl), `client` the receiving side, which
resumes a cut transfer where its durable part ends. `docs/transfer.md` describes the format.
"""
