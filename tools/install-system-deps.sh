#!/usr/bin/env bash
# Installs the Debian packages kubeloop's driver and stack need, when a tool is missing:
# losetup/mount/blkid (util-linux, mount), mkfs.ext4/resize2fs (e2fsprogs), mkfs.xfs/xfs_growfs
# (xfsprogs), fio (bench.datapath, the loop data path's benchmark), strace (the interrupted-grow
# test kills resize2fs at a chosen write), openssl-free by design
# (certificates are made in Python). Does nothing when all are here.
set -euo pipefail
declare -A pkg_of=(
  [losetup]=util-linux [blkid]=util-linux [findmnt]=util-linux [mount]=mount
  [mkfs.ext4]=e2fsprogs [resize2fs]=e2fsprogs [mkfs.xfs]=xfsprogs [xfs_growfs]=xfsprogs
  [fio]=fio [strace]=strace
)
missing=()
for tool in "${!pkg_of[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || PATH=$PATH:/sbin:/usr/sbin command -v "$tool" >/dev/null 2>&1 || missing+=("${pkg_of[$tool]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
pkgs=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" -ne 0 ]; then
  echo "kubeloop needs these Debian packages: $pkgs; run: sudo apt-get install -y $pkgs" >&2
  exit 1
fi
echo "[install-system-deps] installing $pkgs" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq $pkgs >/dev/null
