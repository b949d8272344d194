#!/usr/bin/env bash
# Builds, without any container registry, every image a kubeloop kind cluster runs (`make kind-images`):
#   kubeloop/kind-node:<k8s version>  the node image: Debian bookworm with systemd, containerd (built from
#                                     the Go module proxy), runc and the CNI plugins from Debian, kubelet,
#                                     kubeadm and kubectl at the pinned version, the files under
#                                     tools/kind-node/rootfs, and in /kind/images the images below, which
#                                     each node imports into containerd when it boots;
#   registry.k8s.io/kube-apiserver, -controller-manager, -scheduler, etcd  (tools/build-images.sh)
#   registry.k8s.io/kube-proxy:<version>   Debian + iptables + kube-proxy
#   registry.k8s.io/pause:3.10.1           a static pause binary (tools/kind-node/pause.c)
#   kubeloop/busybox:<version>             Debian's busybox-static, the workload image of tests/kind
#   kubeloop/external-snapshotter:<version>  external-snapshotter's snapshot-controller and csi-snapshotter
#   kubeloop/csi-snapshot-metadata:<version>  external-snapshot-metadata's sidecar
# and the kubeloop image itself (tools/build-images.sh). `kind build node-image` cannot be used here: it
# pulls a base image and the control-plane images from registries.
#
# The node image is rebuilt only when one of its inputs changes (a label holds their digest); the
# debootstrapped root file system is cached under ~/.cache/kubeloop/kind-node/ by package list.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=versions.env
source tools/versions.env
PY=${PYTHON:-$root/.venv/bin/python}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${KUBELOOP_CACHE:-$HOME/.cache/kubeloop}
export DOCKER_BUILDKIT=0
NODE_IMAGE=${KUBELOOP_KIND_NODE_IMAGE:-kubeloop/kind-node:$KUBERNETES_VERSION}
PAUSE_IMAGE=registry.k8s.io/pause:3.10.1
PROXY_IMAGE=registry.k8s.io/kube-proxy:$KUBERNETES_VERSION

say() { printf '[build-kind-node] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }
started=$SECONDS
quiet_build() { docker build -q "$@" >/dev/null 2> >(grep -v -e DEPRECATED -e BuildKit -e 'environment-variable' -e '^$' >&2); }
label_of() { docker image inspect --format "{{index .Config.Labels \"$2\"}}" "$1" 2>/dev/null || true; }

PYTHON=$PY bash tools/build-images.sh
bash tools/build-binaries.sh kubernetes etcd kind snapshotter snapshot-metadata
k8s=$cache/bin/kubernetes-$KUBERNETES_VERSION
node_bins=$cache/bin/kubernetes-node-$KUBERNETES_VERSION
containerd_bins=$cache/bin/containerd-$CONTAINERD_VERSION
work=$(mktemp -d /var/tmp/kubeloop-kind-node.XXXXXX)
trap 'rm -rf "$work"' EXIT

# --- small images -------------------------------------------------------------------------------------
sum=$(sha256sum "$node_bins/kube-proxy" | cut -c1-32)
if [ "$(label_of "$PROXY_IMAGE" dev.kubeloop.binaries)" != "$sum" ]; then
  mkdir -p "$work/proxy" && cp "$node_bins/kube-proxy" "$work/proxy/"
  cat > "$work/proxy/Dockerfile" <<DOCKERFILE
FROM debian:bookworm-slim
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      iptables conntrack ipset kmod >/dev/null && rm -rf /var/lib/apt/lists/* /usr/share/doc/*
COPY kube-proxy /usr/local/bin/kube-proxy
LABEL dev.kubeloop.binaries=$sum
ENTRYPOINT ["/usr/local/bin/kube-proxy"]
DOCKERFILE
  quiet_build --network host -t "$PROXY_IMAGE" "$work/proxy"
  say "$PROXY_IMAGE: built"
else say "$PROXY_IMAGE: up to date"; fi

sum=$(sha256sum tools/kind-node/pause.c | cut -c1-32)
if [ "$(label_of "$PAUSE_IMAGE" dev.kubeloop.source)" != "$sum" ]; then
  mkdir -p "$work/pause"
  gcc -static -Os -s -o "$work/pause/pause" tools/kind-node/pause.c || die "could not compile pause.c (needs gcc and libc6-dev)"
  printf 'FROM scratch\nCOPY pause /pause\nLABEL dev.kubeloop.source=%s\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' "$sum" > "$work/pause/Dockerfile"
  quiet_build -t "$PAUSE_IMAGE" "$work/pause"
  say "$PAUSE_IMAGE: built"
else say "$PAUSE_IMAGE: up to date"; fi

busybox_image=$("$PY" -c 'from localstack.kind import BUSYBOX_IMAGE; print(BUSYBOX_IMAGE)')
if ! docker image inspect "$busybox_image" >/dev/null 2>&1; then
  mkdir -p "$work/busybox/rootfs/bin" "$work/busybox/rootfs/tmp"
  (cd "$work/busybox" && apt-get download -qq busybox-static >/dev/null 2>&1) \
    || { apt-get update -qq && (cd "$work/busybox" && apt-get download -qq busybox-static); } \
    || die "could not download Debian's busybox-static"
  dpkg-deb -x "$work"/busybox/busybox-static_*.deb "$work/busybox/x"
  cp "$work/busybox/x/bin/busybox" "$work/busybox/rootfs/bin/"
  for applet in $("$work/busybox/rootfs/bin/busybox" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$work/busybox/rootfs/bin/$applet"
  done
  printf 'FROM scratch\nCOPY rootfs /\nENV PATH=/bin\nCMD ["sh"]\n' > "$work/busybox/Dockerfile"
  quiet_build -t "$busybox_image" "$work/busybox"
  say "$busybox_image: built"
else say "$busybox_image: present"; fi

# Upstream's static Go binaries the cluster runs (deploy/kubernetes), each set in a scratch image
# labelled with the binaries' digest, rebuilt only when they change.
#   go_image <image> <dir> <binary>...
go_image() {
  local image=$1 dir=$2; shift 2
  local sum ctx=$work/$(basename "$dir")
  sum=$(cd "$dir" && cat "$@" | sha256sum | cut -c1-32)
  if [ "$(label_of "$image" dev.kubeloop.binaries)" = "$sum" ]; then say "$image: up to date"; return; fi
  mkdir -p "$ctx" && (cd "$dir" && cp "$@" "$ctx/")
  printf 'FROM scratch\nCOPY %s /\nLABEL dev.kubeloop.binaries=%s\n' "$*" "$sum" > "$ctx/Dockerfile"
  quiet_build -t "$image" "$ctx"
  say "$image: built"
}
# external-snapshotter's snapshot-controller and csi-snapshotter, external-snapshot-metadata's sidecar.
mapfile -t go_images < <("$PY" -c 'from localstack.kind import SNAPSHOTTER_IMAGE, SNAPSHOT_METADATA_IMAGE
print(SNAPSHOTTER_IMAGE); print(SNAPSHOT_METADATA_IMAGE)')
go_image "${go_images[0]}" "$cache/bin/external-snapshotter-$EXTERNAL_SNAPSHOTTER_VERSION" snapshot-controller csi-snapshotter
go_image "${go_images[1]}" "$cache/bin/external-snapshot-metadata-$EXTERNAL_SNAPSHOT_METADATA_VERSION" csi-snapshot-metadata

# --- the node image -----------------------------------------------------------------------------------
packages=systemd,systemd-sysv,dbus,iproute2,iptables,mount,util-linux,e2fsprogs,procps,kmod,ca-certificates,python3,runc,containernetworking-plugins,socat,conntrack,openssh-server
mapfile -t control_plane_images < <("$PY" -c 'from localstack.compose import images
i = images()
print("\n".join(i[n] for n in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd")))')
node_images=("$PROXY_IMAGE" "$PAUSE_IMAGE")
inner_images=("${control_plane_images[@]}" "${node_images[@]}")
inputs=$( {
  echo "$packages $KUBERNETES_VERSION $CONTAINERD_VERSION"
  find tools/kind-node tools/docker/runc-wrapper deploy/storageclasses.yaml tools/build-kind-node.sh -type f | sort | xargs sha256sum
  sha256sum "$node_bins"/kubelet "$node_bins"/kubeadm "$k8s"/kubectl "$containerd_bins"/*
  for i in "${inner_images[@]}"; do docker image inspect --format '{{.Id}}' "$i"; done
} | sha256sum | cut -c1-32)
if [ "$(label_of "$NODE_IMAGE" dev.kubeloop.inputs)" = "$inputs" ]; then
  say "$NODE_IMAGE: up to date ($((SECONDS - started))s)"
  exit 0
fi

rootfs_cache=$cache/kind-node/rootfs-bookworm-$(echo "$packages" | sha256sum | cut -c1-16).tar
if [ ! -f "$rootfs_cache" ]; then
  say "node root file system: debootstrap bookworm with $packages (a few minutes, once)"
  mkdir -p "$work/debootstrap" "$(dirname "$rootfs_cache")"
  PATH=$PATH:/usr/sbin:/sbin debootstrap --variant=minbase --include="$packages" bookworm "$work/debootstrap" \
    "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
  rm -rf "$work"/debootstrap/var/cache/apt/archives/*.deb "$work"/debootstrap/var/lib/apt/lists/* \
    "$work"/debootstrap/usr/share/doc/* "$work"/debootstrap/usr/share/man/* "$work"/debootstrap/var/log/*.log
  tar --numeric-owner -C "$work/debootstrap" -cf "$rootfs_cache.tmp" . && mv "$rootfs_cache.tmp" "$rootfs_cache"
  rm -rf "$work/debootstrap"
  say "node root file system cached in $rootfs_cache"
fi
rfs=$work/rootfs
mkdir -p "$rfs"
tar --numeric-owner -C "$rfs" -xf "$rootfs_cache"
cp -a tools/kind-node/rootfs/. "$rfs/"
install -m 0755 "$node_bins/kubelet" "$node_bins/kubeadm" "$k8s/kubectl" "$rfs/usr/bin/"
install -m 0755 "$containerd_bins"/* "$rfs/usr/local/bin/"
install -D -m 0755 tools/docker/runc-wrapper "$rfs/usr/local/sbin/runc-wrapper"
mkdir -p "$rfs/kind/images/node" "$rfs/kind/images/control-plane" "$rfs/kind/manifests" "$rfs/etc/kubernetes/manifests" "$rfs/var/lib/kubelet" \
  "$rfs/etc/cni/net.d" "$rfs/opt/cni"
echo "$KUBERNETES_VERSION" > "$rfs/kind/version"
# kind applies these two while it creates a cluster: the default StorageClass is kubeloop's (its driver
# arrives with `make kind-up`); the pod network needs no manifest (kubeloop-pod-network on each node).
cp deploy/storageclasses.yaml "$rfs/kind/manifests/default-storage.yaml"
cat > "$rfs/kind/manifests/default-cni.yaml" <<'YAML'
# kubeloop's kind nodes set up their pod network themselves (kubeloop-pod-network.service); this
# ConfigMap only says so to whoever looks for a CNI manifest.
apiVersion: v1
kind: ConfigMap
metadata:
  name: kubeloop-pod-network
  namespace: kube-system
data:
  description: "bridge cni0 per node, 10.244.<last byte of the node address>.0/24, static routes between nodes"
YAML
for i in "${control_plane_images[@]}"; do
  docker save "$i" -o "$rfs/kind/images/control-plane/$(echo "${i##*/}" | tr ':' '_').tar"
done
for i in "${node_images[@]}"; do
  docker save "$i" -o "$rfs/kind/images/node/$(echo "${i##*/}" | tr ':' '_').tar"
done
: > "$rfs/etc/machine-id"
rm -f "$rfs/var/lib/dbus/machine-id"
# What a container does not need or cannot run.
for unit in getty.target systemd-udevd.service systemd-udev-trigger.service systemd-modules-load.service \
  systemd-remount-fs.service systemd-firstboot.service systemd-networkd.service systemd-resolved.service \
  systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service \
  fstrim.timer sys-kernel-debug.mount sys-kernel-tracing.mount sys-kernel-config.mount dev-hugepages.mount \
  systemd-binfmt.service proc-sys-fs-binfmt_misc.automount; do
  ln -sf /dev/null "$rfs/etc/systemd/system/$unit"
done
mkdir -p "$rfs/etc/systemd/system/multi-user.target.wants"
for unit in containerd kubelet kubeloop-import-images kubeloop-pod-network; do
  ln -sf "/etc/systemd/system/$unit.service" "$rfs/etc/systemd/system/multi-user.target.wants/$unit.service"
done
ln -sf /lib/systemd/system/multi-user.target "$rfs/etc/systemd/system/default.target"
# sshd only when an e2e run starts it (tools/kind-node/rootfs/etc/systemd/system/ssh.service.d), with
# host keys of its own node.
rm -f "$rfs"/etc/ssh/ssh_host_* "$rfs/etc/systemd/system/multi-user.target.wants/ssh.service" \
  "$rfs/etc/systemd/system/sshd.service" "$rfs/etc/systemd/system/sockets.target.wants/ssh.socket"

say "$NODE_IMAGE: importing"
tar --numeric-owner -C "$rfs" -c . | docker import \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' \
  --change 'ENV container=docker' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change "LABEL dev.kubeloop.inputs=$inputs" - "$NODE_IMAGE" >/dev/null
say "$NODE_IMAGE: built ($(docker image inspect --format '{{.Size}}' "$NODE_IMAGE" | awk '{printf "%d MB", $1/1e6}')) in $((SECONDS - started))s"
