#!/bin/bash
# Installs what kvfs needs to build, test and run its demo on Debian 12, and nothing that is
# already there. Run as root (apt-get).
#   - QEMU 7.2 and the C virtiofsd (qemu-system-x86, qemu-system-common): guests and the
#     reference server the tests compare against;
#   - busybox-static, cpio, kmod, gcc, libc6-dev: the guest image (packaging/guest/build.sh);
#     busybox-static is also the containers' test image (internal/ociimage);
#   - flex, bison, bc, libelf-dev: the pod VM's guest kernel (packaging/guest/kernel/build.sh,
#     which downloads its source itself);
#   - fio, tcc, make: the guest benchmark's image (packaging/guest/build.sh --bench copies them
#     in), and make for its test that builds the Lua source with tcc on the host;
#   - protobuf-compiler: protoc, for the control API's drift check (scripts/gen-api.sh installs
#     its Go plugins);
#   - runc: the OCI runtime of containerd's own runc shim, which the containerd tests run first;
#   - containernetworking-plugins (in /usr/lib/cni), iproute2: the CNI bridge network and the
#     network namespaces of the CRI tests;
#   - dbus-daemon: the private D-Bus bus of the shim's systemd cgroup driver tests, whose
#     org.freedesktop.systemd1 is the tests' own (no systemd runs on these machines);
#   - a Go toolchain new enough for go.mod;
#   - containerd, ctr and containerd-shim-runc-v2 of the version below, built with
#     go install into ${KVFS_CACHE:-/var/cache/kvfs}/bin (never on the machine's PATH, so a
#     system containerd is not shadowed); internal/testing/ctrdtest/ctrd runs them from there. A
#     stamp file there records the version, so a second run does nothing;
#   - crictl of the version below (sigs.k8s.io/cri-tools), the same way, and critest, cri-tools'
#     CRI validation suite (a Go test binary: go test -c in the module's download);
#   - the Rust virtiofsd of the series below (Debian 13's package, what Kata ships), the
#     reference server the tests also compare against: it needs trixie's C library, so its
#     package and its libraries are downloaded with a private apt state (the machine's sources
#     and packages untouched) and unpacked into ${KVFS_CACHE:-/var/cache/kvfs}/virtiofsd-rust,
#     with bin/virtiofsd-rust there running it through that root's dynamic loader;
#   - QEMU 10 (bookworm-backports, what Kata pins beside the machine's 7.2), the same way into
#     ${KVFS_CACHE:-/var/cache/kvfs}/qemu10, run by bin/qemu-system-x86_64-10 with its own
#     firmware and modules.
set -euo pipefail

# internal/testing/ctrdtest/ctrd's ContainerdVersion and CrictlVersion must name the same versions
# (TestDepsVersion checks them).
containerd_version=v2.4.2
crictl_version=v1.37.0
# The Rust virtiofsd: trixie's package, whatever its Debian revision, of this upstream series.
rust_virtiofsd_series=1.13
# QEMU 10: bookworm-backports' package, of this upstream series.
qemu10_series=10.0

packages="qemu-system-x86 qemu-system-common busybox-static cpio kmod gcc libc6-dev flex bison bc libelf-dev fio tcc make protobuf-compiler runc xz-utils containernetworking-plugins iproute2 dbus-daemon"

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

# containerd: built into a temporary directory, moved into bin/ once all three built, and the
# stamp written last, so an interrupted run leaves no stamp and the next run starts again.
bindir=${KVFS_CACHE:-/var/cache/kvfs}/bin
stamp=$bindir/.containerd-version
ctrd_bins="containerd ctr containerd-shim-runc-v2"
ctrd_ok=1
[ "$(cat "$stamp" 2>/dev/null)" = "$containerd_version" ] || ctrd_ok=0
for b in $ctrd_bins; do
	[ -x "$bindir/$b" ] || ctrd_ok=0
done
if [ $ctrd_ok = 0 ]; then
	echo "deps.sh: installing containerd $containerd_version into $bindir (a few minutes)"
	mkdir -p "$bindir"
	rm -f "$stamp"
	tmp=$(mktemp -d "$bindir/.new.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	pkgs=()
	for b in $ctrd_bins; do
		pkgs+=("github.com/containerd/containerd/v2/cmd/$b@$containerd_version")
	done
	GOBIN=$tmp go install "${pkgs[@]}"
	for b in $ctrd_bins; do
		mv -f "$tmp/$b" "$bindir/$b"
	done
	rm -rf "$tmp"
	trap - EXIT
	echo "$containerd_version" >"$stamp"
fi

# crictl, the same way.
crictl_stamp=$bindir/.crictl-version
if [ "$(cat "$crictl_stamp" 2>/dev/null)" != "$crictl_version" ] || [ ! -x "$bindir/crictl" ]; then
	echo "deps.sh: installing crictl $crictl_version into $bindir"
	mkdir -p "$bindir"
	rm -f "$crictl_stamp"
	tmp=$(mktemp -d "$bindir/.new.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	GOBIN=$tmp go install "sigs.k8s.io/cri-tools/cmd/crictl@$crictl_version"
	mv -f "$tmp/crictl" "$bindir/crictl"
	rm -rf "$tmp"
	trap - EXIT
	echo "$crictl_version" >"$crictl_stamp"
fi
# critest, of the same cri-tools: a test binary, built with go test -c in the module's
# read-only download (its own go.mod and go.sum pin what it builds from).
critest_stamp=$bindir/.critest-version
if [ "$(cat "$critest_stamp" 2>/dev/null)" != "$crictl_version" ] || [ ! -x "$bindir/critest" ]; then
	echo "deps.sh: installing critest $crictl_version into $bindir"
	mkdir -p "$bindir"
	rm -f "$critest_stamp"
	src=$(go mod download -json "sigs.k8s.io/cri-tools@$crictl_version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
	if [ ! -d "$src/cmd/critest" ]; then
		echo "deps.sh: go mod download of sigs.k8s.io/cri-tools@$crictl_version gave no cmd/critest (its directory: \"$src\")" >&2
		exit 1
	fi
	tmp=$(mktemp -d "$bindir/.new.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	(cd "$src" && go test -c -o "$tmp/critest" ./cmd/critest)
	mv -f "$tmp/critest" "$bindir/critest"
	rm -rf "$tmp"
	trap - EXIT
	echo "$crictl_version" >"$critest_stamp"
fi
# debian_download and unpack_debs: packages of other Debian suites, the machine's apt untouched.
# shellcheck source=packaging/debian-apt.sh
. "$(dirname "$0")/../packaging/debian-apt.sh"

# check_version WHAT SERIES OUTPUT: fails unless OUTPUT (a --version's first line) names SERIES.
check_version() {
	case $3 in
	*" $2".*) ;;
	*)
		echo "deps.sh: $1 is \"$3\", not $2" >&2
		exit 1
		;;
	esac
}

# The Rust virtiofsd, run through its root's dynamic loader; the stamp last.
rust_root=${KVFS_CACHE:-/var/cache/kvfs}/virtiofsd-rust
rust_stamp=$rust_root/.version
if ! grep -q "^virtiofsd $rust_virtiofsd_series\." "$rust_stamp" 2>/dev/null || [ ! -x "$bindir/virtiofsd-rust" ]; then
	echo "deps.sh: installing the Rust virtiofsd $rust_virtiofsd_series (Debian trixie) into $rust_root"
	unpack_debs trixie "$rust_root" virtiofsd libc6 libcap-ng0 libseccomp2 libgcc-s1
	mkdir -p "$bindir"
	cat >"$bindir/virtiofsd-rust" <<-EOF
		#!/bin/sh
		# The Rust virtiofsd (Debian trixie's), with trixie's C library: written by scripts/deps.sh.
		exec $rust_root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path $rust_root/usr/lib/x86_64-linux-gnu $rust_root/usr/libexec/virtiofsd "\$@"
	EOF
	chmod 755 "$bindir/virtiofsd-rust"
	version=$("$bindir/virtiofsd-rust" --version)
	check_version "trixie's virtiofsd" "$rust_virtiofsd_series" "$version"
	echo "$version" >"$rust_stamp"
fi

# QEMU 10 (bookworm-backports, whose dependencies are all bookworm's), with its firmware and
# modules, beside the machine's 7.2; the stamp last.
qemu10_root=${KVFS_CACHE:-/var/cache/kvfs}/qemu10
qemu10_stamp=$qemu10_root/.version
if ! grep -q "version $qemu10_series\." "$qemu10_stamp" 2>/dev/null || [ ! -x "$bindir/qemu-system-x86_64-10" ]; then
	echo "deps.sh: installing QEMU $qemu10_series (Debian bookworm-backports) into $qemu10_root"
	unpack_debs bookworm-backports "$qemu10_root" qemu-system-x86 qemu-system-common qemu-system-data
	mkdir -p "$bindir"
	cat >"$bindir/qemu-system-x86_64-10" <<-EOF
		#!/bin/sh
		# QEMU 10 (Debian bookworm-backports'), its firmware and modules its own: written by scripts/deps.sh.
		QEMU_MODULE_DIR=$qemu10_root/usr/lib/x86_64-linux-gnu/qemu exec $qemu10_root/usr/bin/qemu-system-x86_64 -L $qemu10_root/usr/share/qemu "\$@"
	EOF
	chmod 755 "$bindir/qemu-system-x86_64-10"
	version=$("$bindir/qemu-system-x86_64-10" --version | head -n1)
	check_version "bookworm-backports' QEMU" "$qemu10_series" "$version"
	echo "$version" >"$qemu10_stamp"
fi
echo "deps.sh: ok (go ${have#go}, go.mod wants $want; containerd $containerd_version, crictl and critest $crictl_version in $bindir; $(cat "$rust_stamp"); $(cat "$qemu10_stamp"))"
