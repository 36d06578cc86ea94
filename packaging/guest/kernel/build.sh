#!/bin/bash
# Build the pod VM's guest kernel from Debian's kernel source package and kvfs.config.
#
#   packaging/guest/kernel/build.sh [--check] OUTDIR
#
# --check builds and downloads nothing: it exits 0 if OUTDIR holds a kernel built from this
# script's current inputs (below), 1 if not (make demo then boots Debian's kernel instead).
#
# Writes OUTDIR/vmlinux (the uncompressed kernel, which QEMU starts at its PVH entry point),
# OUTDIR/bzImage (the same kernel for loaders that want a bzImage), OUTDIR/config (the whole
# configuration), OUTDIR/kernel-version and OUTDIR/source (the source package's file name,
# which carries its version). The source is trixie's linux-source-6.12,
# downloaded with a private apt state (the machine's apt untouched) into OUTDIR/debs and kept
# there. The configuration is `make allnoconfig` with kvfs.config applied; the build fails,
# naming them, if any option kvfs.config sets to y is not set in the result.
#
# Nothing is done when OUTDIR was built from inputs with the same contents (this script,
# kvfs.config's options, the source package's version and the compiler's:
# OUTDIR/inputs.sha256). The
# build is reproducible for the same inputs: the kernel's build time, user and host are fixed
# (SOURCE_DATE_EPOCH, default 0). It takes 10 to 20 minutes on 2 cores and about 1.5 GB in
# OUTDIR/work, removed afterwards. Missing host packages (flex, bison, bc, libelf-dev, gcc,
# make, xz-utils) are installed with apt-get (as root). Concurrent runs on the same OUTDIR
# wait for each other.
set -euo pipefail

prog=kernel/build.sh
die() {
	echo "$prog: error: $*" >&2
	exit 1
}
say() {
	echo "$prog: $*" >&2
}

check=
if [ "${1:-}" = --check ]; then
	check=1
	shift
fi
[ $# -eq 1 ] || die "usage: $0 [--check] OUTDIR"
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "$check" ] && [ ! -d "$1" ]; then
	exit 1
fi
mkdir -p "$1" || die "cannot create output directory $1"
out=$(cd "$1" && pwd)
# shellcheck source=packaging/debian-apt.sh
. "$here/../../debian-apt.sh"

suite=trixie
source_package=linux-source-6.12
fragment=$here/kvfs.config
epoch=${SOURCE_DATE_EPOCH:-0}
[[ $epoch =~ ^[0-9]+$ ]] || die "SOURCE_DATE_EPOCH=$epoch is not a number of seconds"

if [ -z "$check" ]; then
	exec 9>"$out/.lock"
	flock 9
	host_packages="flex bison bc libelf-dev gcc make xz-utils"
	install_missing "$prog" $host_packages
fi

# The source package: the one in OUTDIR/debs, else the suite's current one.
debs=$out/debs
src_deb=$(compgen -G "$debs/${source_package}_*.deb" | head -n 1 || true)
if [ -z "$src_deb" ]; then
	[ -z "$check" ] || exit 1
	mkdir -p "$debs"
	say "downloading $source_package ($suite)"
	debian_download "$suite" "$debs" "$source_package" || die "cannot download $source_package from $suite"
	src_deb=$(compgen -G "$debs/${source_package}_*.deb" | head -n 1 || true)
	[ -n "$src_deb" ] || die "the download left no ${source_package}_*.deb in $debs"
fi

# kvfs.config counts by its options only (kconfig's "# CONFIG_X is not set" lines included):
# a comment changed does not rebuild the kernel.
inputs_hash() {
	{
		(cd "$here" && sha256sum build.sh)
		awk '/^# CONFIG_[A-Z0-9_]+ is not set$/ || !/^[[:space:]]*(#|$)/' "$fragment" | sha256sum
		basename "$src_deb"
		gcc --version | head -n 1
		echo "epoch $epoch"
	} | sha256sum | cut -d' ' -f1
}
hash=$(inputs_hash)
if [ -s "$out/vmlinux" ] && [ -s "$out/bzImage" ] && [ -s "$out/source" ] && [ "$(cat "$out/inputs.sha256" 2>/dev/null)" = "$hash" ]; then
	[ -n "$check" ] || say "up to date: $out"
	exit 0
fi
[ -z "$check" ] || exit 1

work=$out/work
rm -rf "$work"
mkdir -p "$work"
say "unpacking $(basename "$src_deb")"
dpkg-deb --fsys-tarfile "$src_deb" | tar -x -C "$work" --wildcards '*.tar.xz' ||
	die "cannot unpack $src_deb"
tarball=$(compgen -G "$work/usr/src/linux-source-*.tar.xz" | head -n 1 || true)
[ -n "$tarball" ] || die "$src_deb has no usr/src/linux-source-*.tar.xz"
tar -x -C "$work" -f "$tarball" || die "cannot unpack $tarball"
rm -rf "$work/usr"
src=$(compgen -G "$work/linux-source-*" | head -n 1)

kmake() {
	make -C "$src" -s KBUILD_BUILD_TIMESTAMP="@$epoch" KBUILD_BUILD_USER=kvfs KBUILD_BUILD_HOST=kvfs "$@"
}
say "configuring: allnoconfig with $(basename "$fragment")"
kmake allnoconfig KCONFIG_ALLCONFIG="$fragment" >&2 || die "make allnoconfig failed"
lost=$(grep -E '^CONFIG_[A-Z0-9_]+=y$' "$fragment" | while read -r line; do
	grep -qxF "$line" "$src/.config" || echo "${line%=y}"
done)
[ -z "$lost" ] || die "kvfs.config asks for options the configuration does not have (a dependency missing, or not in this source): $(echo "$lost" | paste -sd' ')"

say "building $(kmake -s kernelrelease) with $(nproc) jobs"
kmake -j"$(nproc)" vmlinux bzImage >&2 || die "the kernel build failed"

release=$(kmake kernelrelease)
cp "$src/vmlinux" "$out/vmlinux.tmp"
strip --strip-debug "$out/vmlinux.tmp"
cp "$src/arch/x86/boot/bzImage" "$out/bzImage.tmp"
cp "$src/.config" "$out/config"
mv -f "$out/vmlinux.tmp" "$out/vmlinux"
mv -f "$out/bzImage.tmp" "$out/bzImage"
echo "$release" >"$out/kernel-version"
basename "$src_deb" .deb >"$out/source"
echo "$hash" >"$out/inputs.sha256"
rm -rf "$work"
say "built $release: $out/vmlinux, $out/bzImage"
