#!/usr/bin/env bash
# Builds every image docker-compose.yml runs, locally, with no container registry (what `make images`
# runs; tests/compose runs it too):
#   1. the base image BASE_IMAGE (default debian:bookworm-slim), when docker has none by that name:
#      `debootstrap --variant=minbase bookworm` from Debian's archive, then `docker import`;
#   2. build/wheels/: kubeloop's wheel (with the generated gRPC stubs) and every dependency's,
#      downloaded on the host (redownloaded only when pyproject.toml changes);
#   3. the control-plane images under their conventional names (registry.k8s.io/kube-apiserver:v1.36.3,
#      ..., external-snapshotter's registry.k8s.io/sig-storage/snapshot-controller and csi-snapshotter):
#      the Go binaries cached by tools/build-binaries.sh, each in a scratch image (rebuilt only when
#      the binary changes), and external-snapshotter's CRDs into build/crds for the kubeloop image;
#   4. the kubeloop image from Dockerfile (docker's layer cache makes a warm rebuild quick);
#   5. kubeloop/csi-provisioner, csi-attacher, csi-resizer, csi-node-driver-registrar and livenessprobe:
#      that image with one sidecar as entrypoint, for manifests written for upstream's images.
# A daemon is started by tools/docker-env.sh when none answers (and left running: `tools/docker-env.sh
# stop` stops it). Environment: PYTHON (default .venv/bin/python), BASE_IMAGE, DEBIAN_MIRROR.
# `build-images.sh wheels` does step 2 only (what `docker-compose up --build` needs beside a registry).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=versions.env
source tools/versions.env
PY=${PYTHON:-$root/.venv/bin/python}
BASE_IMAGE=${BASE_IMAGE:-debian:bookworm-slim}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${KUBELOOP_CACHE:-$HOME/.cache/kubeloop}
export DOCKER_BUILDKIT=0

say() { printf '[build-images] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }
step() { say "$1 ($((SECONDS - t0))s)"; t0=$SECONDS; }
t0=$SECONDS
started=$SECONDS

wheels_only=0
[ "${1:-}" = wheels ] && wheels_only=1

build_wheels() {
  [ -x "$PY" ] || die "no Python at $PY; run make python-deps (or set PYTHON)"
  "$PY" proto/generate.py
  local wheels=build/wheels
  # deps/ changes only with pyproject.toml, so the image's dependency layer stays cached.
  local deps_stamp; deps_stamp=$wheels/deps/.stamp-$(sha256sum pyproject.toml | cut -c1-16)
  if [ ! -f "$deps_stamp" ]; then
    say "wheels: downloading kubeloop's dependencies (cp311, binary only)"
    rm -rf "$wheels" && mkdir -p "$wheels/deps"
    local deps
    mapfile -t deps < <("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["dependencies"]))')
    "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.11 \
      --implementation cp --abi cp311 --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d "$wheels/deps" "${deps[@]}"
    touch "$deps_stamp"
  fi
  rm -f "$wheels"/kubeloop-*.whl
  rm -rf build/lib build/bdist.*
  # A fixed timestamp makes the wheel byte-identical while the source is, so docker's cache holds.
  SOURCE_DATE_EPOCH=315532800 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$wheels" . >/dev/null
  "$PY" -c 'import sys, zipfile; n = zipfile.ZipFile(sys.argv[1]).namelist(); sys.exit(0 if any(x.startswith("kubeloop_grpc/csi/") for x in n) else "the kubeloop wheel lacks the gRPC stubs")' "$wheels"/kubeloop-*.whl
  step "wheels ready in $wheels"
}
# The CRDs the image carries (Dockerfile: build/crds): external-snapshotter's, from the build cache.
copy_crds() {
  bash tools/build-binaries.sh snapshotter >/dev/null
  rm -rf build/crds && mkdir -p build/crds
  cp "$cache/bin/external-snapshotter-$EXTERNAL_SNAPSHOTTER_VERSION"/crd/*.yaml build/crds/
}
if [ $wheels_only = 1 ]; then build_wheels; copy_crds; exit 0; fi

bash tools/docker-env.sh start >/dev/null
bash tools/build-binaries.sh kubernetes etcd

# --- 1. base image ----------------------------------------------------------------------------------
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  say "base image $BASE_IMAGE: present"
else
  case $BASE_IMAGE in debian:bookworm*) ;; *) die "no image $BASE_IMAGE, and only debian:bookworm* can be made here (docker pull it)";; esac
  say "base image $BASE_IMAGE: debootstrap --variant=minbase bookworm (about a minute)"
  rootfs=$(mktemp -d /var/tmp/kubeloop-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  PATH=$PATH:/usr/sbin:/sbin debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; die "debootstrap failed (log: $rootfs.log)"; }
  rm -f "$rootfs.log"
  # What Debian's slim images leave out: package caches, lists, documentation.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log
  tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'CMD ["bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"; trap - EXIT
  step "base image $BASE_IMAGE imported"
fi

# --- 2. wheels --------------------------------------------------------------------------------------
build_wheels

# --- 3. control-plane images ------------------------------------------------------------------------
image_of() { "$PY" -c 'import sys; from localstack.compose import images; print(images()[sys.argv[1]])' "$1"; }
scratch_image() { # tag dir-in-image binary-path...
  local tag=$1 dest=$2; shift 2
  local sum; sum=$(cat "$@" | sha256sum | cut -c1-32)
  if [ "$(docker image inspect --format '{{index .Config.Labels "dev.kubeloop.binaries"}}' "$tag" 2>/dev/null)" = "$sum" ]; then
    say "$tag: up to date"; return
  fi
  local ctx; ctx=$(mktemp -d /var/tmp/kubeloop-image.XXXXXX)
  mkdir -p "$ctx/tmp"
  cp "$@" "$ctx/"
  {
    echo "FROM scratch"
    for b in "$@"; do echo "COPY $(basename "$b") $dest/$(basename "$b")"; done
    echo "COPY tmp /tmp"
    echo "ENV PATH=/usr/local/bin:/bin"
    echo "LABEL dev.kubeloop.binaries=$sum"
    echo "ENTRYPOINT [\"$dest/$(basename "$1")\"]"
  } > "$ctx/Dockerfile"
  docker build -q -t "$tag" "$ctx" >/dev/null 2> >(grep -v -e DEPRECATED -e BuildKit -e 'environment-variable' -e '^$' >&2)
  rm -rf "$ctx"
  say "$tag: built"
}
k8s=$cache/bin/kubernetes-$KUBERNETES_VERSION
etcd=$cache/bin/etcd-$ETCD_VERSION
for b in kube-apiserver kube-controller-manager kube-scheduler; do
  scratch_image "$(image_of "$b")" /usr/local/bin "$k8s/$b"
done
scratch_image "$(image_of kubectl)" /bin "$k8s/kubectl"
scratch_image "$(image_of etcd)" /usr/local/bin "$etcd/etcd" "$etcd/etcdctl"
snap=$cache/bin/external-snapshotter-$EXTERNAL_SNAPSHOTTER_VERSION
scratch_image "$(image_of snapshot-controller)" /usr/local/bin "$snap/snapshot-controller"
scratch_image "$(image_of csi-snapshotter)" /usr/local/bin "$snap/csi-snapshotter"
copy_crds
step "control-plane images ready"

# --- 4. the kubeloop image --------------------------------------------------------------------------
kubeloop_image=$("$PY" -c 'from localstack.compose import KUBELOOP_IMAGE; print(KUBELOOP_IMAGE)')
docker build -q --network host --build-arg BASE_IMAGE="$BASE_IMAGE" \
  --build-arg KUBECTL_IMAGE="$(image_of kubectl)" -t "$kubeloop_image" . >/dev/null \
  2> >(grep -v -e DEPRECATED -e BuildKit -e 'environment-variable' -e '^$' >&2)
step "$kubeloop_image built"

# --- 5. the sidecar images --------------------------------------------------------------------------
# kubeloop's image once per upstream sidecar it replaces, the sidecar as entrypoint, so a manifest
# written for upstream's images runs kubeloop's with only the image swapped (localstack/sidecar_images.py).
while read -r tag name; do
  "$PY" -m localstack.sidecar_images dockerfile "$name" | docker build -q -t "$tag" - >/dev/null \
    2> >(grep -v -e DEPRECATED -e BuildKit -e 'environment-variable' -e '^$' >&2)
done < <("$PY" -m localstack.sidecar_images)
step "sidecar images built"

say "all images ready in $((SECONDS - started))s:"
docker image ls --format '  {{.Repository}}:{{.Tag}}\t{{.Size}}' | grep -E "kubeloop|registry.k8s.io|${BASE_IMAGE%%:*}" >&2 || true
