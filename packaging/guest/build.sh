#!/bin/bash
# Build the kvfs test guest: Debian 12's kernel and a small initramfs made of
# static busybox, the virtio-fs modules, a static helper and packaging/guest/init.
#
#   packaging/guest/build.sh [--bench|--agent|--agent-faults] OUTDIR
#
# Writes OUTDIR/vmlinux and OUTDIR/initramfs.gz (--agent: rootfs.erofs, below). The
# kernel is the uncompressed ELF (Debian's taken out of its bzImage), which QEMU starts
# at its PVH entry point: the guest does not decompress it, which under TCG takes 0.3 s
# of the kvfs kernel's boot and 3 s of Debian's. Does nothing when both are newer than
# this script, init and tools/*.c (and bench/*.c for --bench), or
# were built from inputs with the same contents (OUTDIR/inputs.sha256).
# Downloaded kernel packages are kept in OUTDIR/debs. Missing host packages,
# QEMU included, are installed with apt-get (as root); apt-get update runs only
# when an apt-get command needs it. Concurrent runs on the same OUTDIR wait for
# each other.
#
# --bench builds the guest benchmark's image (bench/guestbench) instead, into an
# OUTDIR of its own: the same, plus the 9p modules, fio, tcc and GNU make with
# the shared libraries they load, glibc's headers, start files and libm for tcc,
# and the static helpers in bench/*.c. The default image does not change.
#
# --agent builds the pod VM's image, into an OUTDIR of its own: kvfs's guest kernel
# (packaging/guest/kernel: everything the pod needs built in, no modules; built
# once into $KVFS_CACHE/guest-kernel, default /var/cache/kvfs/guest-kernel, and
# copied here as vmlinux), static busybox with its applets in /bin, the container
# runtime crun (Debian trixie's, downloaded with a private apt state into
# OUTDIR/runtime-debs and kept there) with the shared libraries and dynamic loader
# it needs, trixie's, pod-init.c built static
# as /bin/kvfs-pod-init (the init of a pod's shared PID namespace), and kvfs-agent built
# from this repository (CGO_ENABLED=0 go build -trimpath -ldflags="-s -w") as /init. Neither init
# nor tools/*.c go in. Its root is not an initramfs but OUTDIR/rootfs.erofs, a read-only erofs
# image (mkfs.erofs, erofs-utils) padded to a multiple of 2 MiB, which the pod VM maps from
# the host (virtio-pmem, DAX: sandbox.VM.Root) instead of unpacking it into guest RAM.
# With KVFS_GUEST_KERNEL=debian the kernel is Debian's, as
# for the test guest, with the virtio, virtio-fs, virtio-serial, vsock, virtio-net
# and balloon modules loaded at boot (listed in /etc/kvfs/modules, with their
# dependencies) and the modules the guest kernel loads on demand through busybox's
# modprobe (networking, netfilter and overlayfs: see ondemand below). It is rebuilt
# when the contents of build.sh, pod-init.c, the agent binary, crun's packages
# or the kernel (its inputs, or Debian's package) change (the check
# builds the agent first: go's build cache makes that quick). The archive is
# reproducible: every file's time is SOURCE_DATE_EPOCH (default 0), cpio's input
# sorted and --reproducible, gzip -n. The image describes itself in
# /etc/kvfs/image.json (kernel, agent, runtime and busybox versions, what the
# runtime supports (crun features), KVFS_VERSION, default "devel"), also written beside
# it as OUTDIR/image.json, and OUTDIR/SHA256SUMS holds the checksums of vmlinux,
# the root (rootfs.erofs, or initramfs.gz with Debian's kernel, which has no driver built in
# to mount the image) and image.json (sha256sum -c SHA256SUMS; kvfsctl image info).
#
# --agent-faults is --agent with kvfs-agent built with the kvfsfaults tag: its test
# fault modes (agent/fault.go) are chosen by kvfs.fault= on the kernel command line.
# For the tests of the host against a hostile guest only (internal/testing/vmtest
# FaultsAgentImage), into an OUTDIR of its own; no make target ships it. Its
# image.json says "tags": "kvfsfaults" in "agent".
set -euo pipefail

prog=build.sh
# rootfile is the guest's root in OUTDIR: an initramfs, or the agent image's erofs image.
rootfile=initramfs.gz
die() {
	echo "$prog: error: $*" >&2
	exit 1
}
# say reports progress on stderr: stdout of some functions is captured.
say() {
	echo "$prog: $*" >&2
}

bench=
agent=
agent_tags=
kernel=debian
case ${1:-} in
--bench)
	bench=1
	shift
	;;
--agent)
	agent=1
	shift
	;;
--agent-faults)
	agent=1
	agent_tags=kvfsfaults
	shift
	;;
esac
[ $# -eq 1 ] || die "usage: $0 [--bench|--agent|--agent-faults] OUTDIR"

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=packaging/debian-apt.sh
. "$here/../debian-apt.sh"
mkdir -p "$1" || die "cannot create output directory $1"
out=$(cd "$1" && pwd)

# The modules the guest loads, in this order; their dependencies are added
# from modules.dep.
modules="virtio_pci_legacy_dev virtio_pci_modern_dev virtio_ring virtio virtio_pci fuse virtiofs virtio_console"
# Debian packages needed on the host: to build the guest, and to boot it
# (qemu-system-x86, whose qemu-system-common also ships the C virtiofsd).
host_packages="busybox-static cpio kmod gcc libc6-dev qemu-system-x86 xz-utils"

inputs=("$here/build.sh" "$here/init" "$here"/tools/*.c)
if [ -n "$bench" ]; then
	modules+=" 9pnet 9pnet_virtio 9p"
	host_packages+=" fio tcc make"
	inputs+=("$here"/bench/*.c)
fi
if [ -n "$agent" ]; then
	# ip_tables and ip6_tables at boot too: legacy iptables finds its tables only once they
	# are loaded (the kernel loads the tables themselves on demand), as on a node where
	# they always are. virtio_balloon: free page reporting (vm.free_page_reporting).
	modules+=" vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport virtio_net ip_tables ip6_tables virtio_balloon"
	host_packages+=" binutils erofs-utils"
	# The guest's container runtime and what it loads, from trixie: crun 1.21 starts a
	# container in a fraction of runc's time under emulation (docs/measurements/benchmarks.md).
	runtime_packages="crun libc6 libcap2 libseccomp2 libsystemd0 libyajl2"
	runtime_debs=$out/runtime-debs
	inputs=("$here/build.sh" "$here/pod-init.c")
	kernel=${KVFS_GUEST_KERNEL:-kvfs}
	case $kernel in
	kvfs) kernel_dir=${KVFS_CACHE:-/var/cache/kvfs}/guest-kernel ;;
	debian) ;;
	*) die "KVFS_GUEST_KERNEL=$kernel: want kvfs (the default) or debian" ;;
	esac
	[ "$kernel" != kvfs ] || rootfile=rootfs.erofs
	repo=$(cd "$here/../.." && pwd)
	epoch=${SOURCE_DATE_EPOCH:-0}
	[[ $epoch =~ ^[0-9]+$ ]] || die "SOURCE_DATE_EPOCH=$epoch is not a number of seconds"
	kvfs_version=${KVFS_VERSION:-devel}
	[[ $kvfs_version =~ ^[A-Za-z0-9._+~-]+$ ]] || die "KVFS_VERSION=$kvfs_version: want letters, digits and ._+~-"
fi

# inputs_hash identifies the contents of the inputs, so that a fresh checkout
# (new modification times, same contents) does not force a rebuild.
inputs_hash() {
	{
		(cd "$here" && sha256sum "${inputs[@]#"$here"/}")
		[ -z "$bench" ] || echo bench
		if [ -n "$agent" ]; then
			echo "agent $(sha256sum <"$agent_bin" | cut -d' ' -f1)"
			dpkg-query -W -f='${Package} ${Version}\n' busybox-static
			(cd "$runtime_debs" && compgen -G '*.deb' | LC_ALL=C sort)
			if [ "$kernel" = kvfs ]; then
				echo "kvfs kernel $(cat "$kernel_dir/inputs.sha256")"
			else
				# The kernel packages in use: their file names carry their versions.
				(cd "$out/debs" 2>/dev/null && compgen -G 'linux-image-*.deb' | LC_ALL=C sort) || echo "no kernel yet"
			fi
			echo "epoch $epoch version $kvfs_version"
		fi
	} | sha256sum | cut -d' ' -f1
}

up_to_date() {
	local f newer=1
	[ -s "$out/vmlinux" ] && [ -s "$out/$rootfile" ] || return 1
	[ -z "$agent" ] || { [ -s "$out/image.json" ] && [ -s "$out/SHA256SUMS" ]; } || return 1
	# The agent image also depends on the agent's sources and the runtime's packages, which
	# have no single file to compare times with: only its hash decides.
	[ -z "$agent" ] || newer=
	for f in "${inputs[@]}"; do
		[ "$out/vmlinux" -nt "$f" ] && [ "$out/$rootfile" -nt "$f" ] || newer=
	done
	[ -n "$newer" ] && return 0
	if [ "$(cat "$out/inputs.sha256" 2>/dev/null)" = "$(inputs_hash)" ]; then
		touch "$out/vmlinux" "$out/$rootfile"
		return 0
	fi
	return 1
}

if command -v flock >/dev/null; then
	exec 9>"$out/.lock"
	flock 9
fi

# --- host tools -------------------------------------------------------------

install_missing "$prog" $host_packages

busybox=
for b in /bin/busybox /usr/bin/busybox; do
	if [ -x "$b" ]; then
		busybox=$b
		break
	fi
done
[ -n "$busybox" ] || die "busybox-static is installed but no busybox binary was found"

if [ -n "$agent" ]; then
	gobin=$(command -v go || true)
	[ -n "$gobin" ] || [ ! -x /usr/local/go/bin/go ] || gobin=/usr/local/go/bin/go
	[ -n "$gobin" ] || die "go is not installed (needed to build kvfs-agent)"
	if ! compgen -G "$runtime_debs/crun_*.deb" >/dev/null; then
		say "downloading $runtime_packages (trixie)"
		rm -rf "$runtime_debs"
		mkdir -p "$runtime_debs"
		debian_download trixie "$runtime_debs" $runtime_packages ||
			die "cannot download $runtime_packages from trixie"
	fi
	agent_bin=$out/kvfs-agent
	say "building kvfs-agent${agent_tags:+ with the tags $agent_tags}"
	# -s -w: no symbol table or DWARF (a panic's trace still names functions and lines); the
	# binary is unpacked into the guest's RAM, 3 MB less of it.
	(cd "$repo" && CGO_ENABLED=0 "$gobin" build -trimpath -buildvcs=false -ldflags="-s -w" -tags "$agent_tags" -o "$agent_bin.tmp" ./cmd/kvfs-agent) >&2 ||
		die "go build ./cmd/kvfs-agent failed"
	mv -f "$agent_bin.tmp" "$agent_bin"
	if [ "$kernel" = kvfs ]; then
		# Up to date in a moment when it is; its inputs' hash is one of the image's. Built at
		# the default SOURCE_DATE_EPOCH whatever the image's, so that one kernel serves every
		# image.
		env -u SOURCE_DATE_EPOCH "$here/kernel/build.sh" "$kernel_dir" ||
			die "cannot build the guest kernel into $kernel_dir"
	fi
fi

if up_to_date; then
	say "up to date: $out"
	exit 0
fi

# --- kernel packages --------------------------------------------------------

# extract_vmlinux BZIMAGE OUT writes the kernel an x86 bzImage carries to OUT: its payload
# (boot protocol 2.08: payload_offset and payload_length at 0x248, from the end of the setup
# sectors), decompressed, is the kernel's ELF with its PVH note. Debian compresses it with xz,
# followed by the 4 bytes of its size.
extract_vmlinux() {
	local setup off len magic
	setup=$(od -An -tu1 -j $((0x1f1)) -N1 "$1" | tr -d ' ')
	[ "$setup" != 0 ] || setup=4
	off=$(od -An -tu4 -j $((0x248)) -N4 "$1" | tr -d ' ')
	len=$(od -An -tu4 -j $((0x24c)) -N4 "$1" | tr -d ' ')
	[ -n "$off" ] && [ -n "$len" ] && [ "$len" -gt 0 ] || die "$1: no payload in its boot header"
	off=$(((setup + 1) * 512 + off))
	magic=$(od -An -tx1 -j "$off" -N6 "$1" | tr -d ' ')
	[ "$magic" = fd377a585a00 ] || die "$1: its payload is not xz-compressed (it starts with $magic)"
	dd if="$1" iflag=skip_bytes,count_bytes skip="$off" count="$len" status=none | xz -dc --single-stream >"$2" ||
		die "$1: cannot decompress its payload"
	[ "$(od -An -tx1 -N4 "$2" | tr -d ' ')" = 7f454c46 ] || die "$1: its payload is not an ELF kernel"
}

work=$out/work
rm -rf "$work"
mkdir -p "$work"

# The kvfs kernel has everything built in; Debian's comes with the modules picked below.
if [ "$kernel" = kvfs ]; then
	kver=$(cat "$kernel_dir/kernel-version")
	vmlinux=$kernel_dir/vmlinux
	order=
	ondemand=
else

	debs=$out/debs
	mkdir -p "$debs"

	# download PKG[=VERSION] into $debs unless a matching .deb is already there.
	download() {
		local name=${1%%=*} have
		have=$(compgen -G "$debs/${name}_*.deb" | head -n 1 || true)
		if [ -n "$have" ]; then
			echo "$have"
			return 0
		fi
		say "apt-get download $1"
		(cd "$debs" && apt_run -o APT::Sandbox::User=root download "$1") ||
			die "apt-get download $1 failed"
		have=$(compgen -G "$debs/${name}_*.deb" | head -n 1 || true)
		[ -n "$have" ] || die "apt-get download $1 left no ${name}_*.deb in $debs"
		echo "$have"
	}

	# versioned_dep META.deb prints linux-image-6.1.0-NN-amd64=VERSION from the
	# Depends of the linux-image-amd64 package.
	versioned_dep() {
		dpkg-deb -f "$1" Depends | tr ',' '\n' |
			sed -n 's/^ *\(linux-image-[0-9][^ ]*-amd64\) *(= *\([^)]*\)).*/\1=\2/p' | head -n 1
	}

	meta=$(download linux-image-amd64)
	dep=$(versioned_dep "$meta")
	[ -n "$dep" ] || die "cannot find the versioned kernel package in the Depends of $meta"
	if ! kdeb=$(download "$dep"); then
		# The cached linux-image-amd64 may name a kernel the archive no longer
		# has: fetch the current one and try once more.
		say "retrying with a fresh linux-image-amd64"
		rm -f "$debs"/linux-image-amd64_*.deb
		meta=$(download linux-image-amd64)
		dep=$(versioned_dep "$meta")
		[ -n "$dep" ] || die "cannot find the versioned kernel package in the Depends of $meta"
		kdeb=$(download "$dep")
	fi

	# --- unpack and pick modules ------------------------------------------------

	say "unpacking $(basename "$kdeb")"
	dpkg-deb -x "$kdeb" "$work/kernel" || die "dpkg-deb -x $kdeb failed"

	kver=$(ls "$work/kernel/lib/modules")
	if [ -z "$kver" ] || [ "$(echo "$kver" | wc -l)" != 1 ]; then
		die "expected one kernel version in $kdeb, found: $kver"
	fi
	[ -f "$work/kernel/boot/vmlinuz-$kver" ] || die "$kdeb has no boot/vmlinuz-$kver"
	vmlinux=$work/vmlinux
	extract_vmlinux "$work/kernel/boot/vmlinuz-$kver" "$vmlinux"
	moddir=$work/kernel/lib/modules/$kver
	depmod -b "$work/kernel" "$kver" || die "depmod -b failed"

	# resolve MODULES prints the modules named and their dependencies, dependencies
	# first, as paths relative to $moddir. Built-in modules are left out.
	resolve() {
		awk -v want="$1" '
		function norm(p) {
			sub(/.*\//, "", p); sub(/\.ko(\.[a-z]+)?$/, "", p); gsub(/-/, "_", p)
			return p
		}
		function visit(m,    n, i, d) {
			if (m in done || m in builtin) return
			if (m in active) { print "dependency cycle at " m > "/dev/stderr"; bad = 1; return }
			if (!(m in path)) { print "module " m " not found" > "/dev/stderr"; bad = 1; return }
			active[m] = 1
			n = split(deps[m], d, " ")
			for (i = 1; i <= n; i++) visit(norm(d[i]))
			delete active[m]
			done[m] = 1
			print path[m]
		}
		FILENAME ~ /modules\.builtin$/ { builtin[norm($0)] = 1; next }
		{
			p = $1; sub(/:$/, "", p)
			m = norm(p); path[m] = p
			$1 = ""; deps[m] = $0
		}
		END {
			n = split(want, w, " ")
			for (i = 1; i <= n; i++) visit(w[i])
			exit bad
		}' "$moddir/modules.builtin" "$moddir/modules.dep"
	}
	order=$(resolve "$modules") || die "cannot resolve modules ($modules) from $moddir/modules.dep"

	# The agent image's modules loaded on demand: the guest kernel asks /sbin/modprobe
	# (busybox's) for them when a container first uses what they provide. They are what
	# a privileged container may use in its own kernel: bridges, veth, tun, dummy,
	# macvlan, ipvlan, VLANs, VXLAN, WireGuard, overlayfs, and netfilter (nftables,
	# iptables' tables, matches and targets, ebtables, ipset, IPVS). Kept
	# xz-compressed; not loaded at boot.
	ondemand=
	if [ -n "$agent" ]; then
		ondemand_dirs="kernel/net/netfilter kernel/net/ipv4/netfilter kernel/net/ipv6/netfilter kernel/net/bridge kernel/net/8021q kernel/drivers/net/ipvlan kernel/drivers/net/vxlan kernel/drivers/net/wireguard kernel/fs/overlayfs"
		# crc32c: nf_tables' libcrc32c asks the crypto API for it, which asks modprobe.
		ondemand_names="veth tun dummy macvlan crc32c_generic crc32c_intel"
		for d in $ondemand_dirs; do
			[ -d "$moddir/$d" ] || die "$kdeb has no $d"
			ondemand_names+=" $(cd "$moddir" && find "$d" -name '*.ko*' -printf '%f\n' | sed 's/\.ko.*//; s/-/_/g' | LC_ALL=C sort | tr '\n' ' ')"
		done
		all=$(resolve "$modules $ondemand_names") || die "cannot resolve the on-demand modules from $moddir/modules.dep"
		for m in $all; do
			echo "$order" | grep -qxF "$m" || ondemand+="$m "
		done
	fi
fi

# --- bench image additions -------------------------------------------------

# copy_host FILE copies a host file to the same path in the initramfs tree,
# following symbolic links (/usr/lib there is a link to /lib).
copy_host() {
	mkdir -p "$(dirname "$root$1")"
	cp -L "$1" "$root$1" || die "cannot copy $1"
}

# copy_with_libs BINARY copies a dynamically linked program to /bin and the
# shared libraries ldd lists for it to their paths.
copy_with_libs() {
	local lib
	cp -L "$1" "$root/bin/$(basename "$1")" || die "cannot copy $1"
	for lib in $(ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
		[ -e "$root$lib" ] || copy_host "$lib"
	done
}

add_bench_tools() {
	local f c name
	mkdir -p "$root/lib64" "$root/usr/include"
	ln -s ../lib "$root/usr/lib"
	copy_with_libs /usr/bin/fio
	copy_with_libs /usr/bin/tcc
	copy_with_libs /usr/bin/make
	# tcc links against the dynamic linker by its name in the library directory.
	ln -sf /lib64/ld-linux-x86-64.so.2 "$root/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
	# tcc's own headers and runtime, and what it needs of glibc's development
	# files to compile and link against libc and libm: headers, start files,
	# libc.so and libm.so (linker scripts; libm.so names libmvec.so.1 too) and
	# libc_nonshared.a. No static libraries otherwise.
	cp -r /usr/lib/x86_64-linux-gnu/tcc "$root/lib/x86_64-linux-gnu/" || die "cannot copy tcc's files"
	while read -r f; do
		[ -f "$f" ] || continue
		case $f in
		/usr/include/* | */crt1.o | */crti.o | */crtn.o | */libc.so | */libm.so | */libc_nonshared.a) copy_host "$f" ;;
		esac
	done < <(dpkg -L libc6-dev linux-libc-dev)
	for f in /lib/x86_64-linux-gnu/libm.so.6 /lib/x86_64-linux-gnu/libmvec.so.1; do
		[ -e "$root$f" ] || copy_host "$f"
	done
	for c in "$here"/bench/*.c; do
		name=$(basename "$c" .c)
		gcc -static -O2 -Wall -Wextra -Werror -o "$root/bin/$name" "$c" ||
			die "cannot build $c (gcc -static)"
	done
}

# add_runtime unpacks crun's packages and copies crun, the libraries it needs (its NEEDED
# entries, and theirs) and the dynamic loader into the initramfs tree.
add_runtime() {
	local deb lib todo f
	runtime_root=$work/runtime
	mkdir -p "$runtime_root" "$root/lib/x86_64-linux-gnu" "$root/lib64"
	for deb in "$runtime_debs"/*.deb; do
		dpkg-deb -x "$deb" "$runtime_root" || die "cannot unpack $deb"
	done
	install -m 0755 "$runtime_root/usr/bin/crun" "$root/bin/crun"
	cp -L "$runtime_root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" "$root/lib64/" ||
		die "trixie's libc6 has no ld-linux-x86-64.so.2"
	todo=("$runtime_root/usr/bin/crun")
	while [ ${#todo[@]} -gt 0 ]; do
		f=${todo[0]}
		todo=("${todo[@]:1}")
		for lib in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
			[ ! -e "$root/lib/x86_64-linux-gnu/$lib" ] || continue
			[ -e "$runtime_root/usr/lib/x86_64-linux-gnu/$lib" ] || die "crun needs $lib, which its packages do not have"
			cp -L "$runtime_root/usr/lib/x86_64-linux-gnu/$lib" "$root/lib/x86_64-linux-gnu/$lib"
			todo+=("$runtime_root/usr/lib/x86_64-linux-gnu/$lib")
		done
	done
}

# --- initramfs tree ---------------------------------------------------------

root=$work/root
mkdir -p "$root"/{bin,dev,etc/kvfs,mnt,proc,run,sys,tmp,usr}
ln -s bin "$root/sbin"
ln -s ../bin "$root/usr/bin"
ln -s ../bin "$root/usr/sbin"
chmod 1777 "$root/tmp"

cp "$busybox" "$root/bin/busybox"
for applet in $("$root/bin/busybox" --list); do
	[ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
done

if [ -n "$agent" ]; then
	install -m 0755 "$agent_bin" "$root/init"
	gcc -static -Os -s -Wall -Wextra -Werror -o "$root/bin/kvfs-pod-init" "$here/pod-init.c" ||
		die "cannot build pod-init.c (gcc -static)"
	add_runtime
else
	install -m 0755 "$here/init" "$root/init"

	for c in "$here"/tools/*.c; do
		name=$(basename "$c" .c)
		gcc -static -O2 -Wall -Wextra -Werror -o "$root/bin/$name" "$c" ||
			die "cannot build $c (gcc -static)"
	done
fi

: >"$root/etc/kvfs/modules"
for m in $order; do
	dest=$root/lib/modules/$kver/${m%.xz}
	mkdir -p "$(dirname "$dest")"
	case $m in
	*.ko) cp "$moddir/$m" "$dest" ;;
	*.ko.xz) xz -dc "$moddir/$m" >"$dest" || die "cannot decompress $m (is xz-utils installed?)" ;;
	*) die "unsupported module file $m" ;;
	esac
	echo "${m%.xz}" >>"$root/etc/kvfs/modules"
done
for m in $ondemand; do
	dest=$root/lib/modules/$kver/${m%.xz}.xz
	mkdir -p "$(dirname "$dest")"
	case $m in
	*.ko) xz --check=crc32 -9 -c "$moddir/$m" >"$dest" || die "cannot compress $m" ;;
	*.ko.xz) cp "$moddir/$m" "$dest" ;;
	*) die "unsupported module file $m" ;;
	esac
done
if [ "$kernel" = debian ]; then
	mkdir -p "$root/lib/modules/$kver"
	cp "$moddir/modules.builtin" "$moddir/modules.builtin.modinfo" "$moddir/modules.order" "$root/lib/modules/$kver/" 2>/dev/null || true
	depmod -b "$root" "$kver" || die "depmod -b on the initramfs tree failed"
fi

if [ -n "$bench" ]; then
	add_bench_tools
fi

# image_json prints the agent image's description: what it was built from.
image_json() {
	local kpkg tags_json= runtime_features
	# What the image's runtime supports (the shim's -info answers from it), on one line: run
	# here by trixie's dynamic loader, with trixie's libraries.
	runtime_features=$("$runtime_root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$runtime_root/usr/lib/x86_64-linux-gnu" \
		"$runtime_root/usr/bin/crun" features | tr '\n' ' ' | tr -s ' ') || die "crun features failed"
	if [ "$kernel" = kvfs ]; then
		kpkg=$(cat "$kernel_dir/source")
	else
		kpkg=$(basename "$kdeb" .deb)
	fi
	[ -z "$agent_tags" ] || tags_json=", \"tags\": \"$agent_tags\""
	cat <<-EOF
		{
		  "kvfs_version": "$kvfs_version",
		  "source_date_epoch": $epoch,
		  "kernel": {"version": "$kver", "package": "${kpkg%%_*}", "package_version": "$(echo "$kpkg" | cut -d_ -f2)", "sha256": "$(sha256sum <"$vmlinux" | cut -d' ' -f1)"},
		  "agent": {"sha256": "$(sha256sum <"$agent_bin" | cut -d' ' -f1)", "go": "$("$gobin" env GOVERSION)"$tags_json},
		  "runtime": {"name": "crun", "package_version": "$(dpkg-deb -f "$runtime_debs"/crun_*.deb Version)", "features": $runtime_features},
		  "busybox": {"package_version": "$(dpkg-query -W -f='${Version}' busybox-static)"},
		  "modules": [$(sed 's/.*\///; s/\.ko$//; s/.*/"&"/' "$root/etc/kvfs/modules" | paste -sd, | sed 's/,/, /g')]
		}
	EOF
}
if [ -n "$agent" ]; then
	say "describing the image in /etc/kvfs/image.json"
	image_json >"$root/etc/kvfs/image.json" || die "cannot write image.json"
fi

# The kernel opens /dev/console for init before /init can mount devtmpfs.
mknod -m 600 "$root/dev/console" c 5 1 2>/dev/null || true

if [ "$rootfile" = rootfs.erofs ]; then
	say "making rootfs.erofs (kernel $kver)"
	find "$root" -exec touch -h -d "@$epoch" {} + || die "cannot set the files' times"
	# Reproducible: every time the epoch, a fixed UUID, every file root's. Uncompressed, data not
	# inlined in the metadata blocks: DAX maps each file's blocks as they are. Padded to a
	# multiple of 2 MiB, which the guest maps the device in.
	rm -f "$out/rootfs.erofs.tmp"
	mkfs.erofs --quiet -Enoinline_data -T "$epoch" -U 00000000-0000-0000-0000-000000000000 --all-root \
		"$out/rootfs.erofs.tmp" "$root" || die "mkfs.erofs failed"
	size=$(stat -c %s "$out/rootfs.erofs.tmp")
	truncate -s $(((size + 2097151) / 2097152 * 2097152)) "$out/rootfs.erofs.tmp" || die "cannot pad rootfs.erofs"
else
	say "packing initramfs ($(echo "$order" | wc -w) modules at boot, $(echo "$ondemand" | wc -w) on demand, kernel $kver)"
	if [ -n "$agent" ]; then
		find "$root" -exec touch -h -d "@$epoch" {} + || die "cannot set the files' times"
		(cd "$root" && find . -print0 | LC_ALL=C sort -z |
			cpio --null --create --format=newc --owner=0:0 --reproducible --quiet) |
			gzip -9 -n >"$out/initramfs.gz.tmp" || die "cpio | gzip failed"
	else
		(cd "$root" && find . -print0 | LC_ALL=C sort -z |
			cpio --null --create --format=newc --owner=0:0 --quiet) |
			gzip -9 >"$out/initramfs.gz.tmp" || die "cpio | gzip failed"
	fi
fi
cp "$vmlinux" "$out/vmlinux.tmp"
mv -f "$out/vmlinux.tmp" "$out/vmlinux"
rm -f "$out/vmlinuz" # an image built before the kernel was the ELF
# The other kind of root, left by a build of the other kind into this directory.
rm -f "$out/initramfs.gz" "$out/rootfs.erofs"
mv -f "$out/$rootfile.tmp" "$out/$rootfile"
echo "$kver" >"$out/kernel-version"
if [ -n "$agent" ]; then
	cp "$root/etc/kvfs/image.json" "$out/image.json"
	touch -d "@$epoch" "$out/image.json"
	say "writing SHA256SUMS"
	(cd "$out" && sha256sum vmlinux "$rootfile" image.json >SHA256SUMS.tmp && mv -f SHA256SUMS.tmp SHA256SUMS) ||
		die "cannot write $out/SHA256SUMS"
fi
inputs_hash >"$out/inputs.sha256"
rm -rf "$work"
say "built $out/vmlinux and $out/$rootfile"
