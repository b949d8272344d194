#!/usr/bin/env bash
# Builds the Go binaries kubeloop runs beside itself (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, etcdctl, csi-sanity) through the Go module proxy at the versions
# pinned in tools/versions.env, and caches them by version:
#   ${KUBELOOP_CACHE:-~/.cache/kubeloop}/bin/<component>-<version>/
# A second run finds every binary in place and does nothing. Usage: build-binaries.sh [group...]
# where a group is kubernetes, kind (the kind node image's binaries), e2e (the e2e.test suite binary and
# agnhost, for tools/kind-e2e), csi-mock (the e2e suite's mock CSI driver as a command, for its CSI Mock
# specs), etcd, csi-sanity, external-provisioner, external-attacher,
# external-resizer, snapshotter (external-snapshotter's controller, sidecar and VolumeSnapshot CRDs,
# for the kind cluster), snapshot-metadata (external-snapshot-metadata's sidecar, its CRD and its
# Kubernetes-facing schema.proto, for the kind cluster), prometheus (prometheus and promtool, for
# deploy/prometheus) or helm (for deploy/helm) (default: kubernetes, etcd, csi-sanity).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
# shellcheck source=versions.env
source "$here/versions.env"
cache=${KUBELOOP_CACHE:-$HOME/.cache/kubeloop}
# GOFLAGS from the caller is kept after -mod=mod (GOFLAGS=-p=1 builds one package at a time).
export CGO_ENABLED=0 GOFLAGS="-mod=mod${GOFLAGS:+ $GOFLAGS}" GOTOOLCHAIN=local

say() { printf '[build-binaries] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

command -v go >/dev/null 2>&1 || die "the Go toolchain is not on PATH; install Go >= 1.26 (https://go.dev/doc/install) and run again"

csi_mock_dir() {
  echo "$cache/bin/csi-mock-driver-$KUBERNETES_VERSION-$(sha256sum "$root/tools/kind-e2e/csi-mock-driver/main.go" | cut -c1-12)"
}

have_all() { # dir binary...
  local dir=$1; shift
  for b in "$@"; do [ -x "$dir/$b" ] || return 1; done
}

# Runs a build in a throw-away wrapper module and moves the results into place only when all succeed,
# so an interrupted build never leaves a half-filled cache directory that looks complete.
build_in_wrapper() { # dest gomod_text ldflags name=pkg...
  local dest=$1 gomod=$2 ldflags=$3; shift 3
  local work; work=$(mktemp -d)
  printf '%s\n' "$gomod" > "$work/go.mod"
  mkdir -p "$work/out"
  # A package given as ./DIR is this repository's own source, built inside the wrapper module.
  for spec in "$@"; do
    case ${spec#*=} in ./*) mkdir -p "$work/${spec#*=./}" && cp -r "$root/${spec#*=./}"/. "$work/${spec#*=./}/" ;; esac
  done
  (
    cd "$work"
    say "  resolving modules (first run downloads from the Go module proxy)"
    if ! go mod download 2>"$work/download.err"; then
      cat "$work/download.err" >&2
      die "could not download modules; check that the Go module proxy ($(go env GOPROXY)) is reachable"
    fi
    for spec in "$@"; do
      # Each argument is name=package, naming the binary explicitly (etcd's packages end in /v3).
      # A name ending in .test is the package's test binary (go test -c) rather than its command.
      local name=${spec%%=*} pkg=${spec#*=}
      say "  compiling $name (a cold build takes several minutes)"
      local start=$SECONDS
      case $name in
        *.test) go test -c -trimpath -ldflags "$ldflags" -o "out/$name" "$pkg" ;;
        *) go build -trimpath -ldflags "$ldflags" -o "out/$name" "$pkg" ;;
      esac
      say "  built $name in $((SECONDS - start))s"
    done
  )
  mkdir -p "$dest"
  mv "$work"/out/* "$dest"/
  rm -rf "$work"
}

# build_kubernetes <dest-dir> <name=package>...: packages of k8s.io/kubernetes at the pinned version,
# built in one wrapper module (a name ending in .test is a test binary, see build_in_wrapper).
build_kubernetes() {
  local dest=$1; shift
  local specs=("$@") bins=() spec
  for spec in "${specs[@]}"; do bins+=("${spec%%=*}"); done
  if have_all "$dest" "${bins[@]}"; then say "kubernetes $KUBERNETES_VERSION: cached in $dest"; return; fi
  say "kubernetes $KUBERNETES_VERSION: building ${bins[*]}"
  # k8s.io/kubernetes replaces its staging modules with ./staging paths, which a dependency cannot
  # use; point each of them at its published v0.x release instead.
  local modfile
  modfile=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  [ -n "$modfile" ] || die "could not fetch k8s.io/kubernetes@$KUBERNETES_VERSION from the Go module proxy"
  local replaces
  replaces=$(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#replace \1 => \1 '"$KUBERNETES_STAGING_VERSION"'#p' "$modfile")
  local gomod="module kubeloop.local/kubernetes-binaries

go 1.26

require k8s.io/kubernetes $KUBERNETES_VERSION

$replaces"
  local minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
  local pkgver=k8s.io/component-base/version clientver=k8s.io/client-go/pkg/version
  local ld="-s -w"
  for p in $pkgver $clientver; do
    ld+=" -X $p.gitVersion=$KUBERNETES_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  build_in_wrapper "$dest" "$gomod" "$ld" "${specs[@]}"
}

# build_kubernetes_cmds <dest-dir> <cmd>...: commands under k8s.io/kubernetes/cmd.
build_kubernetes_cmds() {
  local dest=$1; shift
  local specs=() b
  for b in "$@"; do specs+=("$b=k8s.io/kubernetes/cmd/$b"); done
  build_kubernetes "$dest" "${specs[@]}"
}

build_etcd() {
  local dest=$cache/bin/etcd-$ETCD_VERSION
  if have_all "$dest" etcd etcdctl; then say "etcd $ETCD_VERSION: cached in $dest"; return; fi
  say "etcd $ETCD_VERSION: building etcd, etcdctl"
  local gomod="module kubeloop.local/etcd-binaries

go 1.26

require (
	go.etcd.io/etcd/server/v3 $ETCD_VERSION
	go.etcd.io/etcd/etcdctl/v3 $ETCD_VERSION
)"
  build_in_wrapper "$dest" "$gomod" "-s -w" etcd=go.etcd.io/etcd/server/v3 etcdctl=go.etcd.io/etcd/etcdctl/v3
}

build_csi_sanity() {
  local dest=$cache/bin/csi-test-$CSI_TEST_VERSION
  if have_all "$dest" csi-sanity; then say "csi-sanity $CSI_TEST_VERSION: cached in $dest"; return; fi
  say "csi-sanity $CSI_TEST_VERSION: building"
  local tmp; tmp=$(mktemp -d)
  GOFLAGS= GOBIN=$tmp go install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_TEST_VERSION"
  mkdir -p "$dest" && mv "$tmp/csi-sanity" "$dest/" && rm -rf "$tmp"
}

# What a kind node image holds beyond the control plane (tools/build-kind-node.sh): kind itself,
# kubelet, kubeadm and kube-proxy, and containerd (2.x: kubelet v1.36 needs the CRI RuntimeConfig
# call). containerd's go.mod carries replace and exclude directives, so it is built in a wrapper
# module that repeats them.
build_kind() {
  build_kubernetes_cmds "$cache/bin/kubernetes-node-$KUBERNETES_VERSION" kubelet kubeadm kube-proxy
  local dest=$cache/bin/kind-$KIND_VERSION
  if have_all "$dest" kind; then say "kind $KIND_VERSION: cached in $dest"; else
    say "kind $KIND_VERSION: building"
    local tmp; tmp=$(mktemp -d)
    GOFLAGS= GOBIN=$tmp go install "sigs.k8s.io/kind@$KIND_VERSION"
    mkdir -p "$dest" && mv "$tmp/kind" "$dest/" && rm -rf "$tmp"
  fi
  dest=$cache/bin/containerd-$CONTAINERD_VERSION
  if have_all "$dest" containerd ctr containerd-shim-runc-v2; then say "containerd $CONTAINERD_VERSION: cached in $dest"; return; fi
  say "containerd $CONTAINERD_VERSION: building containerd, ctr, containerd-shim-runc-v2"
  local module=github.com/containerd/containerd/v2 modfile
  modfile=$(go mod download -json "$module@$CONTAINERD_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  [ -n "$modfile" ] || die "could not fetch $module@$CONTAINERD_VERSION from the Go module proxy"
  local gomod="module kubeloop.local/containerd-binaries

go 1.26

require $module $CONTAINERD_VERSION

$(grep -E '^(replace|exclude) ' "$modfile")"
  local ld="-s -w -X $module/version.Version=$CONTAINERD_VERSION"
  GOFLAGS="$GOFLAGS -tags=no_btrfs,no_devmapper,no_zfs" build_in_wrapper "$dest" "$gomod" "$ld" \
    containerd=$module/cmd/containerd ctr=$module/cmd/ctr containerd-shim-runc-v2=$module/cmd/containerd-shim-runc-v2
}

# A kubernetes-csi sidecar. external-provisioner, -attacher and -resizer are built only for the
# benchmarks' side-by-side runs against kubeloop's (bench/provisioning.py, bench/attach.py,
# bench/expansion.py); external-snapshotter's snapshot-controller and csi-snapshotter run in the kind
# cluster, where kubeloop has no snapshotter of its own (docs/kind.md). A sidecar's go.mod pins
# modules with replace directives, which `go install pkg@version` refuses; a wrapper module copies them.
#   build_sidecar <group> <module> <version> <binary>...
build_sidecar() {
  local group=$1 module=$2 version=$3; shift 3
  local dest=$cache/bin/$group-$version modfile b specs=()
  if have_all "$dest" "$@"; then say "$group $version: cached in $dest"; return; fi
  say "$group $version: building $*"
  modfile=$(go mod download -json "$module@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  [ -n "$modfile" ] || die "could not fetch $module@$version from the Go module proxy"
  local gomod="module kubeloop.local/$group-binaries

go 1.26

require $module $version

$(replaces "$modfile" | grep -v ' => \.')
$(replaces "$modfile" | local_replaces "${LOCAL_MODULES_VERSION:-$version}")"
  for b in "$@"; do specs+=("$b=$module/cmd/$b"); done
  build_in_wrapper "$dest" "$gomod" "-s -w -X main.version=$version" "${specs[@]}"
}

# A replace pointing into the module's own tree (external-snapshotter's `client/v8 => ./client`) has
# no directory in a wrapper module; it becomes the same module published at the same release (or at
# LOCAL_MODULES_VERSION where the proxy lacks that one).
local_replaces() { # version, reading replaces' lines
  sed -n 's#^replace \([^ ]*\) => \./.*#replace \1 => \1 '"$1"'#p'
}

# A go.mod's replace directives one per line, the block form `replace ( ... )` included.
replaces() { # modfile
  awk '/^replace \($/ { block = 1; next }
       block && /^\)/ { block = 0; next }
       block && NF { sub(/^[ \t]+/, ""); print "replace " $0; next }
       /^replace / { print }' "$1"
}

# The VolumeSnapshot and VolumeGroupSnapshot CRDs (snapshot.storage.k8s.io, groupsnapshot.storage.k8s.io)
# as external-snapshotter's client module publishes them, next to its binaries: crd/*.yaml, applied by
# localstack (make up), compose's setup and localstack/kind.py.
snapshot_crds() {
  local dest=$cache/bin/external-snapshotter-$EXTERNAL_SNAPSHOTTER_VERSION/crd dir
  if compgen -G "$dest/snapshot.storage.k8s.io_*.yaml" >/dev/null &&
    compgen -G "$dest/groupsnapshot.storage.k8s.io_*.yaml" >/dev/null; then return; fi
  dir=$(go mod download -json "github.com/kubernetes-csi/external-snapshotter/client/v8@$EXTERNAL_SNAPSHOTTER_VERSION" |
    sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  [ -d "$dir/config/crd" ] || die "external-snapshotter's client module has no config/crd at $EXTERNAL_SNAPSHOTTER_VERSION"
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  cp "$dir"/config/crd/snapshot.storage.k8s.io_*.yaml "$dir"/config/crd/groupsnapshot.storage.k8s.io_*.yaml "$dest.tmp/"
  chmod -R u+w "$dest.tmp" && rm -rf "$dest" && mv "$dest.tmp" "$dest"
  say "external-snapshotter $EXTERNAL_SNAPSHOTTER_VERSION: CRDs in $dest"
}

# external-snapshot-metadata's SnapshotMetadataService CRD (cbt.storage.k8s.io, from its client module)
# and the Kubernetes-facing gRPC schema a backup application speaks to the sidecar (proto/schema.proto,
# compiled by proto/generate.py for the tests' client), next to the sidecar's binary.
snapshot_metadata_files() {
  local dest=$cache/bin/external-snapshot-metadata-$EXTERNAL_SNAPSHOT_METADATA_VERSION/api dir cdir
  if [ -f "$dest/schema.proto" ] && [ -f "$dest/cbt.storage.k8s.io_snapshotmetadataservices.yaml" ]; then return; fi
  local module=github.com/kubernetes-csi/external-snapshot-metadata
  dir=$(go mod download -json "$module@$EXTERNAL_SNAPSHOT_METADATA_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  cdir=$(go mod download -json "$module/client@$EXTERNAL_SNAPSHOT_METADATA_CLIENT_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  [ -f "$dir/proto/schema.proto" ] || die "$module@$EXTERNAL_SNAPSHOT_METADATA_VERSION has no proto/schema.proto"
  [ -f "$cdir/config/crd/cbt.storage.k8s.io_snapshotmetadataservices.yaml" ] ||
    die "$module/client@$EXTERNAL_SNAPSHOT_METADATA_CLIENT_VERSION has no config/crd/cbt.storage.k8s.io_snapshotmetadataservices.yaml"
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  cp "$dir/proto/schema.proto" "$cdir/config/crd/cbt.storage.k8s.io_snapshotmetadataservices.yaml" "$dest.tmp/"
  chmod -R u+w "$dest.tmp" && rm -rf "$dest" && mv "$dest.tmp" "$dest"
  say "external-snapshot-metadata $EXTERNAL_SNAPSHOT_METADATA_VERSION: CRD and schema.proto in $dest"
}

# helm's version lives in ldflags, as its Makefile sets them: its own, and the Kubernetes version
# `helm template` and `helm lint` assume (the minor of the client-go it is built with; without it,
# v1.20, which a chart's kubeVersion constraint refuses).
build_helm() {
  local dest=$cache/bin/helm-$HELM_VERSION
  if have_all "$dest" helm; then say "helm $HELM_VERSION: cached in $dest"; return; fi
  say "helm $HELM_VERSION: building"
  local module=helm.sh/helm/v3 modfile minor
  modfile=$(go mod download -json "$module@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  [ -n "$modfile" ] || die "could not fetch $module@$HELM_VERSION from the Go module proxy"
  minor=$(sed -n 's#^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$modfile")
  [ -n "$minor" ] || die "no k8s.io/client-go requirement in $module@$HELM_VERSION's go.mod"
  local gomod="module kubeloop.local/helm-binaries

go 1.26

require $module $HELM_VERSION"
  local ld="-s -w -X $module/internal/version.version=$HELM_VERSION" p
  for p in pkg/lint/rules pkg/chartutil; do
    ld+=" -X $module/$p.k8sVersionMajor=1 -X $module/$p.k8sVersionMinor=$minor"
  done
  build_in_wrapper "$dest" "$gomod" "$ld" helm=$module/cmd/helm
}

groups=("$@")
# The default (`make binaries`, what `make up` needs): the control plane, csi-sanity, and
# external-snapshotter for the local stack's VolumeSnapshots.
[ ${#groups[@]} -gt 0 ] || groups=(kubernetes etcd csi-sanity snapshotter)
for g in "${groups[@]}"; do
  case $g in
    kubernetes)
      build_kubernetes_cmds "$cache/bin/kubernetes-$KUBERNETES_VERSION" kube-apiserver kube-controller-manager \
        kube-scheduler kubectl ;;
    kind) build_kind ;;
    # The Kubernetes e2e suite (e2e.test, run directly, no ginkgo CLI) and agnhost, the test image
    # binary tools/kind-e2e puts in an image; both from the same wrapper module as the commands.
    e2e)
      build_kubernetes "$cache/bin/kubernetes-e2e-$KUBERNETES_VERSION" \
        e2e.test=k8s.io/kubernetes/test/e2e agnhost=k8s.io/kubernetes/test/images/agnhost ;;
    etcd) build_etcd ;;
    csi-sanity) build_csi_sanity ;;
    external-provisioner)
      build_sidecar external-provisioner github.com/kubernetes-csi/external-provisioner/v6 \
        "$EXTERNAL_PROVISIONER_VERSION" csi-provisioner ;;
    external-attacher)
      build_sidecar external-attacher github.com/kubernetes-csi/external-attacher/v4 \
        "$EXTERNAL_ATTACHER_VERSION" csi-attacher ;;
    external-resizer)
      build_sidecar external-resizer github.com/kubernetes-csi/external-resizer/v2 \
        "$EXTERNAL_RESIZER_VERSION" csi-resizer ;;
    snapshotter)
      build_sidecar external-snapshotter github.com/kubernetes-csi/external-snapshotter/v8 \
        "$EXTERNAL_SNAPSHOTTER_VERSION" snapshot-controller csi-snapshotter
      snapshot_crds ;;
    # The e2e suite's mock CSI driver as a command (tools/kind-e2e/csi-mock-driver, for the CSI Mock
    # specs: localstack/csi_mock.py), cached per version of its source.
    csi-mock)
      build_kubernetes "$(csi_mock_dir)" csi-mock-driver=./tools/kind-e2e/csi-mock-driver ;;
    snapshot-metadata)
      LOCAL_MODULES_VERSION=$EXTERNAL_SNAPSHOT_METADATA_CLIENT_VERSION \
        build_sidecar external-snapshot-metadata github.com/kubernetes-csi/external-snapshot-metadata \
        "$EXTERNAL_SNAPSHOT_METADATA_VERSION" csi-snapshot-metadata
      snapshot_metadata_files ;;
    helm) build_helm ;;
    # Without the cloud service discoveries (static and file targets are what the local stack needs):
    # a build of minutes and a binary a tenth the size.
    prometheus)
      GOFLAGS="$GOFLAGS -tags=remove_all_sd" \
        build_sidecar prometheus github.com/prometheus/prometheus "$PROMETHEUS_VERSION" prometheus promtool ;;
    *) die "unknown group '$g' (expected kubernetes, kind, e2e, csi-mock, etcd, csi-sanity, external-provisioner, external-attacher, external-resizer, snapshotter, snapshot-metadata, prometheus or helm)" ;;
  esac
done
say "binaries ready under $cache/bin"
