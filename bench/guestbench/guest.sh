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
# NINEP_OPTS TESTS BUILD_JOBS LUA_TOP LUA_MAKE LUA_CHECK LUA_CHECK_OUT. MOUNTS are the compared
# mounts, KP_MOUNTS the killpriv_v2 pair; each name is also its virtio-fs tag, except
# $NINEP_TAG, which is mounted as 9p with $NINEP_OPTS. TESTS are the names of the results to
# measure (a workload runs when one of its results is wanted).
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

# want TEST: whether TEST is among $TESTS.
want() {
	case " $TESTS " in
	*" $1 "*) return 0 ;;
	esac
	return 1
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

# fio_job TEST RW ENGINE BS DEPTH DIRECT appends a job on $m's data file to the job file.
fio_job() {
	cat >>"$jobs" <<-JOB
		[$1@$m]
		filename=$B/$m/fio.dat
		rw=$2
		ioengine=$3
		bs=$4
		iodepth=$5
		direct=$6
	JOB
}

# fio_run runs the job file, one job after the other (fio starts once: loading it and its
# libraries costs seconds under TCG), and prints a result per job: IOPS, or MiB/s for 1 MiB
# blocks.
fio_run() {
	out=$(fio --output-format=terse --terse-version=3 "$jobs" 2>&1)
	status=$?
	# Terse v3: field 3 is the job's name, 5 its error, 7/48 read/write KiB/s, 8/49 IOPS.
	res=$(echo "$out" | awk -F';' -v run="$run" '
		/^3;fio-/ {
			split($3, nm, "@")
			if ($5 != 0) {
				printf "GB-ERR run=%s mount=%s test=%s fio error %s\n", run, nm[2], nm[1], $5
			} else if (nm[1] ~ /-1m$/) {
				printf "GB run=%s mount=%s test=%s value=%.3f\n", run, nm[2], nm[1], ($7 + $48) / 1024
			} else {
				printf "GB run=%s mount=%s test=%s value=%.1f\n", run, nm[2], nm[1], $8 + $49
			}
		}')
	echo "$res"
	case $res in *GB-ERR*) fail=1 ;; esac
	[ $status -eq 0 ] || err fio "exit status $status: $out"
	# A job fio did not report at all.
	for name in $(grep '^\[' "$jobs" | grep -v '^\[global\]' | tr -d '[]'); do
		echo "$out" | grep -q "^3;fio-[^;]*;$name;" || err "$name" "not reported by fio"
	done
}

meta() {
	out=$(kvfs-gbench meta "$B/$m/meta" "$META_FILES" 2>&1) || {
		err meta "$out"
		rm -rf "$B/$m/meta"
		return
	}
	for kv in $out; do
		! want "${kv%%=*}" || result "${kv%%=*}" "${kv#*=}"
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
	! want dd-write || result dd-write "$(echo "$t0 $t1" | awk '{ printf "%.6f", $2 - $1 }')"
	kvfs-gbench drop
	t0=$(now)
	out=$(dd if="$f" of=/dev/null bs=1M 2>&1) || {
		err dd-read "$out"
		return
	}
	t1=$(now)
	! want dd-read || result dd-read "$(echo "$t0 $t1" | awk '{ printf "%.6f", $2 - $1 }')"
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

# luabuild builds Lua from the unmodified source tree the host unpacked in luabuild/$LUA_TOP,
# in place (the objects go to the share, as a developer's build writes them), with GNU make
# -j$BUILD_JOBS and tcc, from cold caches; the interpreter must then print $LUA_CHECK_OUT.
# make clean leaves the tree as it was for the next run.
luabuild() {
	d=$B/$m/luabuild/$LUA_TOP
	kvfs-gbench drop
	t0=$(now)
	out=$(cd "$d" && eval "make -j$BUILD_JOBS $LUA_MAKE" 2>&1)
	status=$?
	t1=$(now)
	if [ $status -ne 0 ]; then
		err luabuild "make exit status $status: $(echo "$out" | tail -n 5)"
	elif ! got=$("$d/src/lua" -e "$LUA_CHECK" 2>&1); then
		err luabuild "the built lua failed: $got"
	elif [ "$got" != "$LUA_CHECK_OUT" ]; then
		err luabuild "the built lua printed $got, want $LUA_CHECK_OUT"
	elif [ ! -x "$d/src/luac" ]; then
		err luabuild "make built no src/luac"
	else
		result luabuild "$(echo "$t0 $t1" | awk '{ printf "%.6f", $2 - $1 }')"
	fi
	out=$(cd "$d" && make clean 2>&1) || err luabuild "make clean: $out"
	# What make clean must remove: a leftover would make the next build warm.
	left=$(cd "$d/src" && ls ./*.o ./*.a lua luac 2>/dev/null)
	[ -z "$left" ] || {
		err luabuild "left after make clean: $left"
		(cd "$d/src" && rm -f $left)
	}
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
echo "GB-CONFIG runs=$RUNS fio_runtime=$FIO_RUNTIME fio_mib=$FIO_MIB meta_files=$META_FILES dd_mib=$DD_MIB build_jobs=$BUILD_JOBS tests=$(echo $TESTS | tr ' ' ,)"

# Lay the data files out once, before anything is measured, if fio runs: all its tests are
# named *-4k or *-1m.
case " $TESTS " in
*"-4k "* | *"-1m "*)
	for m in $MOUNTS $KP_MOUNTS; do
		out=$(dd if=/dev/zero of="$B/$m/fio.dat" bs=1M count="$FIO_MIB" conv=fsync 2>&1) || {
			echo "GB-FATAL laying out $B/$m/fio.dat: $out"
			exit 1
		}
	done
	;;
esac
sync
echo GB-READY
sleep 1

run=1
while [ $run -le "$RUNS" ]; do
	order=$(rotate $((run - 1)) $MOUNTS)
	kporder=$(rotate $((run - 1)) $KP_MOUNTS)
	echo "GB-RUN run=$run order=$(echo $order | tr ' ' ,) t=$(now)"
	jobs=/tmp/fio-run$run.job
	printf '[global]\nsize=%sM\nfallocate=none\nruntime=%s\ntime_based\nstonewall\n' "$FIO_MIB" "$FIO_RUNTIME" >"$jobs"
	# 4 KiB: psync and libaio with O_DIRECT (every I/O reaches the server), mmap through the
	# page cache (the only way it works).
	for rw in read randread write randwrite; do
		for engine in psync libaio mmap; do
			case $engine in
			psync) depth=1 direct=1 ;;
			libaio) depth=16 direct=1 ;;
			mmap) depth=1 direct=0 ;;
			esac
			want "$rw-$engine-4k" || continue
			for m in $order; do
				fio_job "$rw-$engine-4k" "$rw" "$engine" 4k "$depth" "$direct"
			done
		done
	done
	if want read-psync-1m; then
		for m in $order; do
			fio_job read-psync-1m read psync 1M 1 1
		done
	fi
	# KILLPRIV_V2: buffered writes, as an application makes them.
	if want killpriv-randwrite-psync-4k; then
		for m in $kporder; do
			fio_job killpriv-randwrite-psync-4k randwrite psync 4k 1 0
		done
	fi
	m=-
	! grep -q '^\[.*@' "$jobs" || fio_run
	if want create || want stat || want list || want delete; then
		for m in $order; do
			meta
		done
	fi
	if want dd-write || want dd-read; then
		for m in $order; do
			dd_run
		done
	fi
	if want cbuild; then
		for m in $order; do
			cbuild
		done
	fi
	if want luabuild; then
		for m in $order; do
			luabuild
		done
	fi
	run=$((run + 1))
done
m=-
echo "GB-DONE t=$(now)"
cd /
for m in $MOUNTS $KP_MOUNTS; do
	umount "$B/$m" 2>/dev/null
done
exit $fail
