#!/bin/bash
# Installs what kvfs needs to build, test and run its demo on Debian 12, and nothing that is
# already there. Run as root (apt-get).
#   - QEMU 7.2 and the C virtiofsd (qemu-system-x86, qemu-system-common): guests and the
#     reference server the tests compare against;
#   - busybox-static, cpio, kmod, gcc, libc6-dev: the guest image (packaging/guest/build.sh);
#   - fio, tcc: the guest benchmark's image (packaging/guest/build.sh --bench copies them in);
#   - protobuf-compiler: protoc, for the control API's drift check (scripts/gen-api.sh installs
#     its Go plugins);
#   - a Go toolchain new enough for go.mod.
set -euo pipefail

packages="qemu-system-x86 qemu-system-common busybox-static cpio kmod gcc libc6-dev fio tcc protobuf-compiler"

missing=()
for p in $packages; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	if [ "$(id -u)" != 0 ]; then
		echo "deps.sh: need root to install: ${missing[*]}" >&2
		exit 1
	fi
	echo "deps.sh: installing ${missing[*]}"
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# Go: go.mod names the version; an older go (1.21+) fetches it through the module proxy.
want=$(sed -n 's/^go //p' "$(dirname "$0")/../go.mod")
if ! command -v go >/dev/null; then
	[ -x /usr/local/go/bin/go ] && export PATH=/usr/local/go/bin:$PATH
fi
if ! command -v go >/dev/null; then
	echo "deps.sh: no Go toolchain on PATH; kvfs needs Go $want (install it in /usr/local/go)" >&2
	exit 1
fi
have=$(go env GOVERSION)
echo "deps.sh: ok (go ${have#go}, go.mod wants $want)"
