#!/bin/sh
# The guest half of the guest benchmark (package bench/guestbench): run by the bench image's
# /init from the control share, which also holds bench.conf. It mounts every share under test,
# runs every workload on every mount in interleaved order for $RUNS runs, rotating the order of
# the mounts from run to run, and prints one line per result on the console:
#
#   GB run=R mount=M test=T value=V    a result (IOPS, MiB/s or seconds: see workloads.go)
#   GB-ERR run=R mount=M test=T ...    a workload that failed; the rest goes on
#   GB-READY                           everything is prepared, measurements start in 1 s
#   GB-DONE                            the last line of a complete run
#
# bench.conf sets: RUNS FIO_RUNTIME FIO_MIB META_FILES DD_MIB MOUNTS KP_MOUNTS NINEP_TAG
# NINEP_OPTS. MOUNTS are the compared mounts, KP_MOUNTS the killpriv_v2 pair; each name is
# also its virtio-fs tag, except $NINEP_TAG, which is mounted as 9p with $NINEP_OPTS.
# shellcheck disable=SC2086 # $MOUNTS, $KP_MOUNTS and $order are lists of words
set -u
# shellcheck source=/dev/null # written by the host
. ./bench.conf

B=/bench
fail=0

err() {
	echo "GB-ERR run=$run mount=$m test=$1 $2" | tr '\n' ' '
	echo
	fail=1
}

result() {
	echo "GB run=$run mount=$m test=$1 value=$2"
}

now() {
	kvfs-gbench now
}

mount_all() {
	for m in $MOUNTS $KP_MOUNTS; do
		mkdir -p "$B/$m"
		if [ "$m" = "$NINEP_TAG" ]; then
			out=$(mount -t 9p -o "$NINEP_OPTS" "$m" "$B/$m" 2>&1)
		else
			out=$(mount -t virtiofs "$m" "$B/$m" 2>&1)
		fi || {
			echo "GB-FATAL cannot mount $m: $out"
			exit 1
		}
	done
}

# fio_run TEST RW ENGINE BS DEPTH DIRECT: one time-based fio job on $m's data file; the result
# is IOPS, or MiB/s for 1 MiB blocks.
fio_run() {
	out=$(fio --name="$1" --filename="$B/$m/fio.dat" --size="${FIO_MIB}M" --rw="$2" \
		--ioengine="$3" --bs="$4" --iodepth="$5" --direct="$6" --fallocate=none \
		--runtime="$FIO_RUNTIME" --time_based --output-format=terse --terse-version=3 2>&1)
	line=$(echo "$out" | grep '^3;fio-' | tail -n 1)
	if [ -z "$line" ]; then
		err "$1" "$out"
		return
	fi
	# Terse v3: field 7/48 are read/write KiB/s, 8/49 read/write IOPS, 5 the error.
	v=$(echo "$line" | awk -F';' -v bs="$4" '$5 != 0 { exit 1 }
		{ if (bs == "1M") printf "%.3f\n", ($7 + $48) / 1024; else printf "%.1f\n", $8 + $49 }') || {
		err "$1" "$line"
		return
	}
	result "$1" "$v"
}

meta() {
	out=$(kvfs-gbench meta "$B/$m/meta" "$META_FILES" 2>&1) || {
		err meta "$out"
		rm -rf "$B/$m/meta"
		return
	}
	for kv in $out; do
		result "${kv%%=*}" "${kv#*=}"
	done
}

dd_run() {
	f=$B/$m/dd.dat
	t0=$(now)
	out=$(dd if=/dev/zero of="$f" bs=1M count="$DD_MIB" conv=fsync 2>&1) || {
		err dd-write "$out"
		return
	}
	t1=$(now)
	result dd-write "$(echo "$t0 $t1" | awk '{ printf "%.6f", $2 - $1 }')"
	kvfs-gbench drop
	t0=$(now)
	out=$(dd if="$f" of=/dev/null bs=1M 2>&1) || {
		err dd-read "$out"
		return
	}
	t1=$(now)
	result dd-read "$(echo "$t0 $t1" | awk '{ printf "%.6f", $2 - $1 }')"
	rm -f "$f"
}

# cbuild compiles the C sources the host put in cbuild/ one by one with tcc, links them and
# runs the program, from cold caches.
cbuild() {
	d=$B/$m/cbuild
	rm -f "$d"/*.o "$d/prog"
	kvfs-gbench drop
	t0=$(now)
	out=$( (cd "$d" && for c in *.c; do tcc -c "$c" || exit 1; done && tcc -o prog ./*.o && ./prog) 2>&1) || {
		err cbuild "$out"
		return
	}
	t1=$(now)
	[ "$out" = "cbuild ok" ] || {
		err cbuild "unexpected output: $out"
		return
	}
	result cbuild "$(echo "$t0 $t1" | awk '{ printf "%.6f", $2 - $1 }')"
}

# rotate N WORDS...: the words rotated left by N.
rotate() {
	n=$1
	shift
	cnt=$#
	n=$((n % cnt))
	i=0
	while [ $i -lt $n ]; do
		first=$1
		shift
		set -- "$@" "$first"
		i=$((i + 1))
	done
	echo "$@"
}

run=0
m=-
mount_all
echo "GB-CONFIG runs=$RUNS fio_runtime=$FIO_RUNTIME fio_mib=$FIO_MIB meta_files=$META_FILES dd_mib=$DD_MIB"

# Lay the data files out once, before anything is measured.
for m in $MOUNTS $KP_MOUNTS; do
	out=$(dd if=/dev/zero of="$B/$m/fio.dat" bs=1M count="$FIO_MIB" conv=fsync 2>&1) || {
		echo "GB-FATAL laying out $B/$m/fio.dat: $out"
		exit 1
	}
done
sync
echo GB-READY
sleep 1

run=1
while [ $run -le "$RUNS" ]; do
	order=$(rotate $((run - 1)) $MOUNTS)
	kporder=$(rotate $((run - 1)) $KP_MOUNTS)
	echo "GB-RUN run=$run order=$(echo $order | tr ' ' ,) t=$(now)"
	# 4 KiB: psync and libaio with O_DIRECT (every I/O reaches the server), mmap through the
	# page cache (the only way it works).
	for rw in read randread write randwrite; do
		for engine in psync libaio mmap; do
			case $engine in
			psync) depth=1 direct=1 ;;
			libaio) depth=16 direct=1 ;;
			mmap) depth=1 direct=0 ;;
			esac
			for m in $order; do
				fio_run "$rw-$engine-4k" "$rw" "$engine" 4k "$depth" "$direct"
			done
		done
	done
	for m in $order; do
		fio_run read-psync-1m read psync 1M 1 1
	done
	for m in $order; do
		meta
	done
	for m in $order; do
		dd_run
	done
	for m in $order; do
		cbuild
	done
	for m in $kporder; do
		fio_run killpriv-randwrite-psync-4k randwrite psync 4k 1 0
	done
	run=$((run + 1))
done
m=-
echo "GB-DONE t=$(now)"
cd /
for m in $MOUNTS $KP_MOUNTS; do
	umount "$B/$m" 2>/dev/null
done
exit $fail
