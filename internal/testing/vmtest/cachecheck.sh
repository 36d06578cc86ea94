#!/bin/sh
# Guest side of TestGuestCacheModes (cache_test.go). Runs from the control
# share (served with cache=never, so marker files cross immediately in both
# directions) and mounts one extra share per cache mode, tag kvfs-MODE, on
# /cache/MODE. Each share holds a file f; the host changes it between phases.
#
# Protocol: the guest touches PHASE.go in the control share; the host changes
# every share's f and touches PHASE.done; the guest then reports what it sees
# at once, after a wait longer than cache=auto's 1 s timeout, and after
# dropping its caches. Report lines:
#
#   CACHE <mode> <phase>.<when> data=<content of f> size=<stat size> new=<yes|no>
#
# "new" says whether a file the host created in the phase is visible. The
# writeback share also gets a file written with O_WRONLY then O_APPEND
# (WB-DONE when synced). The last line is CACHE-END.

modes=${KVFS_CACHE_MODES:-"never metadata auto always wb"}

report() { # phase.when
	for m in $modes; do
		d=/cache/$m
		data=$(cat "$d/f" 2>&1)
		size=$(stat -c %s "$d/f" 2>&1)
		new=no
		[ -e "$d/new-$1" ] && new=yes
		echo "CACHE $m $2 data=$data size=$size new=$new"
	done
}

# handshake PHASE: ask the host to change the files and wait until it has.
handshake() {
	: >"$1.go"
	i=0
	while [ ! -e "$1.done" ]; do
		i=$((i + 1))
		if [ $i -gt 300 ]; then
			echo "CACHE-ERROR host did not answer $1"
			exit 1
		fi
		sleep 0.1
	done
}

for m in $modes; do
	mkdir -p "/cache/$m"
	if ! err=$(mount -t virtiofs "kvfs-$m" "/cache/$m" 2>&1); then
		echo "CACHE-ERROR mount kvfs-$m: $err"
		exit 1
	fi
done

case " $modes " in *" wb "*)
	# Partial-page writes through a write-only and an O_APPEND descriptor:
	# with a writeback cache the guest fills the page from the host first.
	echo hello >/cache/wb/w
	echo world >>/cache/wb/w
	sync
	echo "WB-DONE"
	;;
esac

# Cache f (data and attributes) and a negative entry for each new-* name.
report p1 p0.before
handshake p1
report p1 p1.now
sleep 1.5
report p1 p1.wait
echo 3 >/proc/sys/vm/drop_caches
report p1 p1.drop

# f is cached again by the read after the drop; now the host changes its size.
handshake p2
report p2 p2.now
sleep 1.5
report p2 p2.wait
echo 3 >/proc/sys/vm/drop_caches
report p2 p2.drop

for m in $modes; do
	umount "/cache/$m"
done
echo "CACHE-END"
