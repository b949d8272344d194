#!/usr/bin/env bash
# The docker environment kubeloop's images and compose tests need, set up the same way by
# `make images`, `make compose-test` and tests/compose:
#
#   tools/docker-env.sh install   Debian's docker.io, containerd, runc, docker-compose (1.29) and
#                                 debootstrap, when a tool is missing
#   tools/docker-env.sh start     make sure a docker daemon answers; when none does, start one
#                                 (below) and print "started", otherwise print "running"
#   tools/docker-env.sh stop      stop the daemon that `start` started (and only that one)
#   tools/docker-env.sh status    exit 0 when a daemon answers
#   tools/docker-env.sh nsenter CMD...   run CMD in the daemon's mount namespace (tests look for
#                                 leftover mounts there)
#
# The daemon `start` runs is local-only: no iptables rules (--iptables=false), no default bridge
# (--bridge=none), so containers use host networking. It runs in a mount namespace of its own whose
# mounts are shared (a sandbox's / is often private, and `rshared` bind mounts need a shared
# source): mounts made in containers propagate between containers and into that namespace, never to
# the host, and they vanish with it when the daemon stops. Its default runtime is
# tools/docker/runc-wrapper, which drops CAP_SYS_RESOURCE and the OOM score adjustment from each
# container's OCI spec, so `privileged: true` works in a sandbox that lacks that capability.
# BuildKit is not used with it (DOCKER_BUILDKIT=0).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
state=${KUBELOOP_DOCKER_STATE:-/run/kubeloop-docker}
pidfile=$state/dockerd.pid
log=$state/dockerd.log

say() { printf '[docker-env] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

install() {
  local missing=()
  command -v docker >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v runc >/dev/null 2>&1 || missing+=(runc)
  command -v containerd >/dev/null 2>&1 || missing+=(containerd)
  command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
  command -v debootstrap >/dev/null 2>&1 || PATH=$PATH:/usr/sbin command -v debootstrap >/dev/null 2>&1 \
    || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "needs these Debian packages: ${missing[*]}; run: sudo apt-get install -y ${missing[*]}"
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d keeps the packages' scripts from starting a system daemon behind our back.
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; created_policy=1; fi
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || { [ $created_policy -eq 0 ] || rm -f "$policy"; die "apt-get install failed"; }
  [ $created_policy -eq 0 ] || rm -f "$policy"
}

answers() { timeout 10 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

ours_running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

start() {
  # "started" only when this call started the daemon: a caller that stops what it started must not
  # stop a daemon another run (a parallel test session, a kind cluster being used) relies on.
  if answers; then echo running; return 0; fi
  [ "$(id -u)" -eq 0 ] || die "no docker daemon answers and starting one needs root"
  install
  command -v unshare >/dev/null || die "unshare (util-linux) is missing"
  mkdir -p "$state"
  ! ours_running || die "dockerd $(cat "$pidfile") from a previous start does not answer; see $log"
  say "starting a local-only dockerd (log: $log)"
  # A new mount namespace whose mounts are shared among themselves but not with the host.
  setsid unshare --mount --propagation private -- sh -c '
    mount --make-rshared / &&
    exec dockerd --host=unix:///var/run/docker.sock --pidfile="$1" \
      --iptables=false --ip6tables=false --ip-masq=false --bridge=none \
      --add-runtime=kubeloop-runc="$2" --default-runtime=kubeloop-runc \
      --log-level=warn' sh "$pidfile" "$here/docker/runc-wrapper" >"$log" 2>&1 < /dev/null &
  for _ in $(seq 1 120); do
    if answers; then echo started; return 0; fi
    sleep 0.5
  done
  tail -20 "$log" >&2 || true
  die "dockerd did not answer within 60s"
}

stop() {
  if ! ours_running; then say "no dockerd of ours runs"; rm -f "$pidfile"; return 0; fi
  local pid; pid=$(cat "$pidfile")
  say "stopping dockerd $pid"
  kill -TERM "$pid"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then say "dockerd $pid ignored SIGTERM for 30s; killing it"; kill -KILL "$pid"; fi
  rm -f "$pidfile" /var/run/docker.sock
}

case ${1:-} in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) answers ;;
  nsenter)
    shift
    if ours_running; then exec nsenter --target "$(cat "$pidfile")" --mount -- "$@"; else exec "$@"; fi ;;
  *) die "usage: $0 install|start|stop|status|nsenter CMD..." ;;
esac
