"""What the CSI servers stand on: the pool of backing files, loop devices, filesystems, mounts and
the durable state store. Every call that can block runs as an asyncio subprocess or in a thread."""
