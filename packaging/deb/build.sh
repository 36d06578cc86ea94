#!/bin/bash
# Build the Debian package kvfs_VERSION_amd64.deb with dpkg-deb.
#
#   packaging/deb/build.sh --bin DIR --guest DIR --version VERSION --out DIR
#
# --bin holds the built binaries, --guest the guest image (packaging/guest/build.sh --agent),
# as for packaging/install.sh, whose `stage` writes the package's files (PREFIX /usr): the
# binaries, the guest image, install.sh, the Kata fragment, and /etc/kvfs/configuration.toml,
# the package's one conffile (dpkg keeps a user's edit across upgrades and removals, and
# removes the file at purge). The maintainer scripts run install.sh: postinst `configure
# --packaged` (containerd's drop-in, a config.toml importing it when there was none, the
# manifest); postrm, at remove and at purge, `uninstall` with the manifest's copy of the
# script, since the package's files are gone by then. VERSION is make's (git describe):
# a tag's v is dropped, a bare commit becomes 0~gitCOMMIT, anything else not starting with a
# digit 0~VERSION. The package's path is printed on stdout.
set -euo pipefail

die() {
	echo "build.sh: error: $*" >&2
	exit 1
}

bin= guest= version= out=
while [ $# -gt 0 ]; do
	case $1 in
	--bin | --guest | --version | --out) [ $# -ge 2 ] || die "$1 needs a value" ;;
	*) die "unknown option $1 (usage: $0 --bin DIR --guest DIR --version VERSION --out DIR)" ;;
	esac
	case $1 in
	--bin) bin=$2 ;;
	--guest) guest=$2 ;;
	--version) version=$2 ;;
	--out) out=$2 ;;
	esac
	shift 2
done
[ -n "$bin" ] && [ -n "$guest" ] && [ -n "$version" ] && [ -n "$out" ] ||
	die "usage: $0 --bin DIR --guest DIR --version VERSION --out DIR"
case $version in
v[0-9]*) version=${version#v} ;; # a tag
esac
if [[ $version =~ ^[0-9a-f]{7,40}$ && $version =~ [a-f] ]]; then
	version=0~git$version # a bare commit (git describe --always without a tag)
elif [[ ! $version =~ ^[0-9] ]]; then
	version=0~$version
fi
[[ $version =~ ^[0-9][A-Za-z0-9.+~-]*$ ]] || die "--version $version: not a Debian version"

here=$(cd "$(dirname "$0")" && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
chmod 0755 "$stage"
"$here/../install.sh" stage --bin "$bin" --guest "$guest" --destdir "$stage" \
	--prefix /usr --sysconfdir /etc --localstatedir /var >&2

mkdir -m 0755 "$stage/DEBIAN"
size=$(du -sk "$stage" | cut -f1)
cat >"$stage/DEBIAN/control" <<-EOF
	Package: kvfs
	Version: $version
	Architecture: amd64
	Maintainer: kvfs developers <kvfs@localhost>
	Installed-Size: $size
	Depends: qemu-system-x86
	Section: admin
	Priority: optional
	Description: containerd runtime running each pod in a QEMU VM, with a virtio-fs server
	 containerd-shim-kvfs-v2 (runtime io.containerd.kvfs.v2, CRI handler kvfs) boots one
	 VM per pod from the guest image in /usr/share/kvfs/guest and serves the pod's files
	 to it with kvfsd, a virtio-fs server. kvfsd can also be Kata Containers' virtio-fs
	 daemon: see /usr/share/kvfs/kata/kvfsd.toml.
EOF
echo /etc/kvfs/configuration.toml >"$stage/DEBIAN/conffiles"
cat >"$stage/DEBIAN/postinst" <<-'EOF'
	#!/bin/sh
	# containerd's drop-in and the manifest of it (configuration.toml is a conffile).
	set -e
	if [ "$1" = configure ]; then
		/usr/share/kvfs/install.sh configure --packaged --prefix /usr --sysconfdir /etc --localstatedir /var
	fi
EOF
cat >"$stage/DEBIAN/postrm" <<-'EOF'
	#!/bin/sh
	# What postinst added, with the copy of install.sh beside its manifest. At remove a
	# drop-in the user edited is kept; purge removes it too.
	set -e
	manifest=/var/lib/kvfs/install.manifest
	case "$1" in
	remove)
		[ ! -f $manifest ] || /var/lib/kvfs/install.sh uninstall --prefix /usr --sysconfdir /etc --localstatedir /var
		;;
	purge)
		[ ! -f $manifest ] || /var/lib/kvfs/install.sh uninstall --purge --prefix /usr --sysconfdir /etc --localstatedir /var
		;;
	esac
EOF
chmod 0755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/postrm"
(cd "$stage" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | LC_ALL=C sort |
	grep -vx etc/kvfs/configuration.toml | xargs md5sum) >"$stage/DEBIAN/md5sums"

# gzip -1: on this project's loaded 2-CPU machine dpkg-deb took 30 s with gzip -9 and 216 s
# with xz, against 7 s, for a package 3 % larger (xz's 7 % smaller): the guest image is
# compressed already.
mkdir -p "$out"
deb=$out/kvfs_${version}_amd64.deb
dpkg-deb --root-owner-group -Zgzip -z1 --build "$stage" "$deb" >&2
echo "$deb"
