#!/usr/bin/env bash
# The test images the Kubernetes external-storage e2e specs run (localstack/e2e_storage.py), built
# locally, without any registry, under the names tools/kind-e2e/repo-list.yaml maps them to:
#
#   <promoterE2eRegistry>/busybox:<tag>            the default test image of Linux pods: the kind
#                                                  cluster's Debian busybox-static image (kubeloop/busybox)
#                                                  with an /etc/passwd and /etc/group
#   <promoterE2eRegistry>/nginx:<tag>              the same image: the one spec that names nginx ("should
#                                                  allow exec of files on the volume") only runs /bin/sh
#   <promoterE2eRegistry>/agnhost:<tag>            agnhost (built by tools/build-binaries.sh e2e) on that
#                                                  busybox: mounttest and pause for the subPath specs,
#                                                  nsenter and sh for storage/utils' host executor
#   <promoterE2eRegistry>/glibc-dns-testing:<tag>  debian:bookworm-slim: the multi-volume specs read and
#                                                  write with GNU dd (iflag=direct, oflag=nocache) and
#                                                  blockdev, which busybox lacks
#
# Each tag is the one test/utils/image/manifest.go of k8s.io/kubernetes@$KUBERNETES_VERSION pins (read
# from the Go module cache), since a repo list can only change the registry part of a name.
#
# Usage: images.sh list            the image names, one a line
#        images.sh contexts DIR    write one docker build context per image under DIR (no docker needed)
#        images.sh build           write the contexts and build them with docker (skipped when an image
#                                  already carries the digest of its context)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
# shellcheck source=../versions.env
source tools/versions.env
PY=${PYTHON:-$root/.venv/bin/python}
cache=${KUBELOOP_CACHE:-$HOME/.cache/kubeloop}
REPO_LIST=$root/tools/kind-e2e/repo-list.yaml
E2E_BINS=$cache/bin/kubernetes-e2e-$KUBERNETES_VERSION
DEBIAN_BASE=debian:bookworm-slim
export DOCKER_BUILDKIT=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod

say() { printf '[kind-e2e images] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# The registry every image below goes under: promoterE2eRegistry of the repo list.
registry() {
  local r
  r=$(sed -n 's/^promoterE2eRegistry:[[:space:]]*\([^[:space:]#]*\).*/\1/p' "$REPO_LIST")
  [ -n "$r" ] || die "$REPO_LIST sets no promoterE2eRegistry"
  echo "$r"
}

manifest_go() {
  local dir
  dir=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  [ -n "$dir" ] && [ -f "$dir/test/utils/image/manifest.go" ] \
    || die "could not fetch k8s.io/kubernetes@$KUBERNETES_VERSION from the Go module proxy"
  echo "$dir/test/utils/image/manifest.go"
}

# upstream <ImageID>: "name:tag" of an image of manifest.go, which must live in the promoter registry
# (the only one repo-list.yaml maps).
upstream() {
  local line
  line=$(grep -E "^[[:space:]]*configs\[$1\] = Config\{list\.PromoterE2eRegistry, " "$manifest") \
    || die "manifest.go of $KUBERNETES_VERSION has no $1 image in the promoter registry"
  echo "$line" | sed -E 's/.*Config\{list\.PromoterE2eRegistry, "([^"]+)", "([^"]+)"\}.*/\1:\2/'
}

# context:ImageID pairs; an image is built from its context's directory.
IMAGES=(busybox:BusyBox busybox:Nginx agnhost:Agnhost glibc-dns-testing:GlibcDnsTesting)

# name <ImageID>: the full name the suite will ask for.
name() { echo "$(registry)/$(upstream "$1")"; }

write_etc() { # dir [with-test-user]
  mkdir -p "$1/etc"
  {
    echo 'root:x:0:0:root:/root:/bin/sh'
    [ -z "${2:-}" ] || echo 'user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh'
    echo 'nobody:x:65534:65534:nobody:/nonexistent:/bin/false'
  } > "$1/etc/passwd"
  {
    echo 'root:x:0:'
    [ -z "${2:-}" ] || { echo 'user-defined-in-image:x:1000:'; echo 'group-defined-in-image:x:50000:user-defined-in-image'; }
    echo 'nobody:x:65534:'
  } > "$1/etc/group"
}

# contexts <dir>: one build context per image, <dir>/<context>/{Dockerfile,rootfs/}.
contexts() {
  local out=$1 busybox
  busybox=$("$PY" -c 'from localstack.kind import BUSYBOX_IMAGE; print(BUSYBOX_IMAGE)')
  [ -x "$E2E_BINS/agnhost" ] || die "no $E2E_BINS/agnhost: run tools/build-binaries.sh e2e first"
  mkdir -p "$out/busybox/rootfs" "$out/agnhost/rootfs/uploads" "$out/glibc-dns-testing"

  write_etc "$out/busybox/rootfs"
  cat > "$out/busybox/Dockerfile" <<DOCKERFILE
# The e2e suite's busybox (and its stand-in for nginx): Debian's busybox-static, as the kind cluster runs it.
FROM $busybox
COPY rootfs /
ENV PATH=/bin
CMD ["sh"]
DOCKERFILE

  write_etc "$out/agnhost/rootfs" with-test-user
  install -m 0755 "$E2E_BINS/agnhost" "$out/agnhost/rootfs/agnhost"
  # Some specs replace the entrypoint with this second name of the same binary.
  ln -sf agnhost "$out/agnhost/rootfs/agnhost-2"
  cat > "$out/agnhost/Dockerfile" <<DOCKERFILE
# agnhost $KUBERNETES_VERSION (k8s.io/kubernetes/test/images/agnhost) on Debian's busybox-static: /bin/sh
# and nsenter for the specs that run shell commands or reach into the node.
FROM $busybox
COPY rootfs /
ENV PATH=/bin
ENTRYPOINT ["/agnhost"]
CMD ["pause"]
DOCKERFILE

  cat > "$out/glibc-dns-testing/Dockerfile" <<DOCKERFILE
# Debian with GNU coreutils and util-linux: dd with iflag=direct and oflag=nocache, blockdev, sha256sum.
FROM $DEBIAN_BASE
CMD ["sleep", "infinity"]
DOCKERFILE
}

work=
trap '[ -z "$work" ] || rm -rf "$work"' EXIT

build() {
  local ctx id tags inputs base t fresh
  for b in docker go; do command -v "$b" >/dev/null 2>&1 || die "$b is not on PATH"; done
  bash tools/build-binaries.sh e2e
  work=$(mktemp -d)
  contexts "$work"
  for ctx in busybox agnhost glibc-dns-testing; do
    base=$(sed -n 's/^FROM //p' "$work/$ctx/Dockerfile")
    docker image inspect "$base" >/dev/null 2>&1 \
      || die "$base is not in docker (tools/build-kind-node.sh builds kubeloop/busybox; debian:bookworm-slim is pulled once)"
    tags=()
    for pair in "${IMAGES[@]}"; do
      [ "${pair%%:*}" = "$ctx" ] || continue
      id=${pair#*:}
      tags+=("$(name "$id")")
    done
    inputs=$( { (cd "$work/$ctx" && find . -type f -o -type l | sort | xargs sha256sum)
      docker image inspect --format '{{.Id}}' "$base"; } | sha256sum | cut -c1-32)
    fresh=1
    for t in "${tags[@]}"; do
      [ "$(docker image inspect --format '{{index .Config.Labels "dev.kubeloop.inputs"}}' "$t" 2>/dev/null)" = "$inputs" ] || fresh=
    done
    if [ -n "$fresh" ]; then say "${tags[*]}: up to date"; continue; fi
    printf 'LABEL dev.kubeloop.inputs=%s\n' "$inputs" >> "$work/$ctx/Dockerfile"
    local args=()
    for t in "${tags[@]}"; do args+=(-t "$t"); done
    docker build -q --network none "${args[@]}" "$work/$ctx" >/dev/null
    say "${tags[*]}: built"
  done
}

cmd=${1:-}
case $cmd in
  list|contexts|build) ;;
  *) die "usage: images.sh list | contexts DIR | build" ;;
esac
manifest=$(manifest_go)
case $cmd in
  list) for pair in "${IMAGES[@]}"; do name "${pair#*:}"; done ;;
  contexts) [ -n "${2:-}" ] || die "usage: images.sh contexts DIR"; contexts "$2"; say "contexts written under $2" ;;
  build) build ;;
esac
