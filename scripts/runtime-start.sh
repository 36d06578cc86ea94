#!/bin/bash
# The guest's container runtimes side by side: runc (Debian 12's, the host's) against crun (the
# agent image's, trixie's), each creating, starting and deleting a busybox container that runs
# `true`, in one guest, interleaved round by round.
#
#   scripts/runtime-start.sh [-q QEMU] [-k KERNEL] [-r ROUNDS]
#
# The guest is the test guest (packaging/guest/build.sh; its /init runs a script from the
# share) booted with KERNEL (default: the agent image's kernel) under QEMU (default
# qemu-system-x86_64), TCG, 1 vCPU, 512 MiB, its share served by bin/kvfsd. Both runtimes and
# their libraries are copied to the guest's tmpfs first, the bundle's root is on the share, both
# run with --no-pivot (the test guest's root is the initramfs). Each line is one round of one
# runtime: create, start (to the container's exit), delete, in milliseconds of the guest's
# uptime (10 ms steps). Run as root, after make build and the guest images.
set -euo pipefail
# shellcheck source=scripts/lib/test-guest.sh
. "$(dirname "$0")/lib/test-guest.sh"

qemu=qemu-system-x86_64
cache=${KVFS_CACHE:-/var/cache/kvfs}
kernel=$cache/agent-guest/vmlinux
rounds=8
while getopts q:k:r: opt; do
	case $opt in
	q) qemu=$OPTARG ;;
	k) kernel=$OPTARG ;;
	r) rounds=$OPTARG ;;
	*) exit 2 ;;
	esac
done
repo=$(cd "$(dirname "$0")/.." && pwd)
guest=$cache/guest
debs=$cache/agent-guest/runtime-debs
for f in "$kernel" "$guest/initramfs.gz" "$repo/bin/kvfsd" /usr/sbin/runc /bin/busybox; do
	[ -e "$f" ] || { echo "runtime-start.sh: no $f" >&2; exit 1; }
done
compgen -G "$debs/crun_*.deb" >/dev/null || { echo "runtime-start.sh: no crun package in $debs (packaging/guest/build.sh --agent)" >&2; exit 1; }

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
share=$dir/share
mkdir -p "$share/crun" "$share/runc" "$share/bundle/rootfs/bin"
for d in "$debs"/*.deb; do dpkg-deb -x "$d" "$share/crun"; done
cp /usr/sbin/runc "$share/runc/"
cp -L /lib/x86_64-linux-gnu/libseccomp.so.2 "$share/runc/"
cp /bin/busybox "$share/bundle/rootfs/bin/"
ln -s busybox "$share/bundle/rootfs/bin/true"
mkdir -p "$share/bundle/rootfs/"{proc,dev,sys,tmp}
(cd "$share/bundle" && runc spec && sed -i 's/"terminal": true/"terminal": false/; s/"sh"$/"true"/' config.json)
cat >"$share/run.sh" <<EOF
mount -t cgroup2 none /sys/fs/cgroup
mount -t tmpfs none /tmp
# Trixie's C library serves both: runc, built for Debian 12's, runs on the newer one.
mkdir -p /lib64 /lib/x86_64-linux-gnu /tmp/bin
cp -a \$KVFS_MNT/crun/usr/lib/x86_64-linux-gnu/* /lib/x86_64-linux-gnu/
cp \$KVFS_MNT/runc/libseccomp.so.2 /lib/x86_64-linux-gnu/
ln -sf /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 /lib64/ld-linux-x86-64.so.2
cp \$KVFS_MNT/crun/usr/bin/crun \$KVFS_MNT/runc/runc /tmp/bin/
ms() { read -r u _ </proc/uptime; echo \$(( \${u%.*}\${u#*.} * 10 )); }
echo "guest: \$(uname -r), \$(/tmp/bin/runc --version | head -1), \$(/tmp/bin/crun --version | head -1)"
for i in \$(seq $rounds); do
	for rt in runc crun; do
		t0=\$(ms); /tmp/bin/\$rt --root /tmp/\$rt create --no-pivot --bundle \$KVFS_MNT/bundle c\$i
		t1=\$(ms); /tmp/bin/\$rt --root /tmp/\$rt start c\$i
		while /tmp/bin/\$rt --root /tmp/\$rt state c\$i 2>/dev/null | grep -q '"running"'; do :; done
		t2=\$(ms); /tmp/bin/\$rt --root /tmp/\$rt delete -f c\$i
		t3=\$(ms)
		echo "round \$i \$rt create \$((t1-t0)) start \$((t2-t1)) delete \$((t3-t2)) total \$((t3-t0))"
	done
done
EOF

test_guest_boot "$qemu" "$kernel" 1 1 "$share" run.sh | grep -E '^(guest:|round |KVFS-EXIT)'
