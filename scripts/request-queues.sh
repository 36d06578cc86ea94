#!/bin/bash
# What one virtio-fs request queue per vCPU buys a multi-vCPU guest: the guest kernel (Linux
# 6.11 and later) sends each CPU's FUSE requests down its own queue, and kvfsd serves each queue
# on a thread of its own. Boots the test guest (packaging/guest/build.sh) with KERNEL (default:
# the agent image's kernel, Linux 6.12) under QEMU (default qemu-system-x86_64), TCG, SMP vCPUs
# (default 2), 512 MiB, its share served by bin/kvfsd, alternately with one request queue and
# with SMP of them, ROUNDS times each (default 4).
#
#   scripts/request-queues.sh [-q QEMU] [-k KERNEL] [-s SMP] [-r ROUNDS]
#
# In each boot, two workloads in the share, each with 1 worker and then SMP workers at once:
# "meta": each worker makes 400 files in a directory of its own, lists them with ls -l, reads
# them and removes them, three times; "read": each worker reads a 64 MiB file of its own (the
# guest's page cache dropped first). Each line: the boot's queues, the workload, its workers and
# its time in seconds of the guest's uptime (10 ms steps). Run as root, after make build and the
# guest images.
set -euo pipefail
# shellcheck source=scripts/lib/test-guest.sh
. "$(dirname "$0")/lib/test-guest.sh"

qemu=qemu-system-x86_64
cache=${KVFS_CACHE:-/var/cache/kvfs}
kernel=$cache/agent-guest/vmlinux
smp=2
rounds=4
while getopts q:k:s:r: opt; do
	case $opt in
	q) qemu=$OPTARG ;;
	k) kernel=$OPTARG ;;
	s) smp=$OPTARG ;;
	r) rounds=$OPTARG ;;
	*) exit 2 ;;
	esac
done
for f in "$kernel" "$cache/guest/initramfs.gz"; do
	[ -e "$f" ] || { echo "request-queues.sh: no $f" >&2; exit 1; }
done

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
share=$dir/share
mkdir -p "$share"
for w in $(seq 0 $((smp - 1))); do
	dd if=/dev/urandom of="$share/big$w" bs=1M count=64 status=none
done
cat >"$share/run.sh" <<EOF
echo "guest: \$(uname -r), \$(nproc) CPUs, \$(cat /sys/fs/virtiofs/0/mqs/*/name | grep -c '^requests') request queues"
t() { cut -d' ' -f1 /proc/uptime; }
work_meta() {
	d=\$KVFS_MNT/w\$1; rm -rf \$d; mkdir \$d
	for p in 1 2 3; do
		i=0; while [ \$i -lt 400 ]; do echo x > \$d/f\$i; i=\$((i+1)); done
		ls -l \$d > /dev/null; cat \$d/* > /dev/null; rm -f \$d/*
	done
	rmdir \$d
}
work_read() { cat \$KVFS_MNT/big\$1 > /dev/null; }
for work in meta read; do
	for n in 1 $smp; do
		sync; echo 3 > /proc/sys/vm/drop_caches
		t0=\$(t)
		w=0; while [ \$w -lt \$n ]; do work_\$work \$w & w=\$((w+1)); done
		wait
		t1=\$(t)
		echo "result \$work workers \$n seconds \$(awk "BEGIN {print \$t1 - \$t0}")"
	done
done
EOF

for r in $(seq "$rounds"); do
	for q in 1 "$smp"; do
		test_guest_boot "$qemu" "$kernel" "$smp" "$q" "$share" run.sh |
			sed -n "s/^guest: /round $r queues $q guest: /p; s/^result /round $r queues $q /p"
	done
done
