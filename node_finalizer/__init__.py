"""`kubeloop-node-finalizer`: lets a deleted Node go only once the claims and volumes of the
node-local volumes pinned to it are cleaned up (TopoLVM's node finalizer, for
loop.csi.kubeloop.dev in node-local mode)."""
