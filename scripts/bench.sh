#!/bin/bash
# The benchmarks; writes docs/measurements/benchmarks.md and its charts.
#
# 1. Server level (bench/serverbench): kvfsd against the C virtiofsd through the in-repo
#    front-end, interleaved in rounds, and a "limit" row of the same system calls made directly
#    on the host. Writes docs/measurements/benchmarks.md and
#    docs/measurements/benchmarks-server.png; about 16 minutes on 2 cores. Arguments are passed on
#    to kvfsbench, after the defaults below:
#      scripts/bench.sh -rounds 2 -duration 300ms -run 'READ|WRITE'   # a quick look
#    Each QD1 row is also read as a share of the "floor" row, a two-process eventfd ping-pong
#    measured in the same slices. -slices 1 measures each server alone for a whole cell (the
#    others connected but idle) instead of in interleaved slices.
# 2. Guest level (bench/guestbench): one QEMU guest with kvfsd, the C virtiofsd and 9p mounted
#    at once, fio, dd, a metadata workload, a C build of generated sources and a parallel build
#    of Lua 5.4.4 (make -j with tcc; its source is downloaded once, checksum pinned) in it, and
#    kvfsd's KILLPRIV_V2 on and off. Adds its section to docs/measurements/benchmarks.md and writes
#    docs/measurements/benchmarks-guest.png; about 15 minutes under TCG. The guest image is built
#    into ${KVFS_CACHE:-/var/cache/kvfs}/guest-bench. $GUEST_ARGS are passed on to kvfsguestbench.
# 3. Pod level (bench/podbench): a private containerd runs busybox with ctr through kvfs's shim
#    (io.containerd.kvfs.v2, a QEMU VM per pod) and through containerd's runc shim, interleaved:
#    `ctr run --rm ... true`, the memory of a pod running sleep (alone, then per pod with 10 of
#    each at once: kvfspodbench -density), and kvfs's boot split. Adds its
#    section to docs/measurements/benchmarks.md; about 20 minutes under TCG. $POD_ARGS are passed
#    on to kvfspodbench; the agent guest image is built (packaging/guest/build.sh --agent) if
#    needed.
# 4. Pod level through the CRI (kvfspodbench -cri): the same containerd with its CRI on, in a
#    network namespace of its own with a CNI bridge, runs pods with crictl through the runtime
#    handlers kvfs and runc, interleaved: runp + create + start to the container's first log
#    line, the memory and CPU of a running pod's host processes, stopp and rmp. Adds its section
#    to docs/measurements/benchmarks.md; about 15 minutes under TCG. $CRI_ARGS are passed on to
#    kvfspodbench.
# 5. A user-namespaced pod's metadata cost (kvfspodbench -cri -userns): the same containerd, a
#    kvfs pod with a user namespace and one without, a metadata workload run in each with crictl
#    exec, interleaved. Adds its section to docs/measurements/benchmarks.md; about 5 minutes under
#    TCG. $USERNS_ARGS are passed on to kvfspodbench.
#
# BENCH_ONLY=server, guest, pod, cri or userns runs one part only; the others' sections stay as
# they are.
#   BENCH_ONLY=guest GUEST_ARGS='-runs 1 -fio-runtime 1 -files 200' scripts/bench.sh   # a quick look
#   BENCH_ONLY=guest GUEST_ARGS='-run luabuild -runs 5 -out /tmp/lua.md -chart /tmp/lua.png' scripts/bench.sh
#   BENCH_ONLY=pod POD_ARGS='-runs 2' scripts/bench.sh
#   BENCH_ONLY=cri CRI_ARGS='-runs 2' scripts/bench.sh
#   BENCH_ONLY=userns USERNS_ARGS='-runs 3' scripts/bench.sh
# Runs as root (both servers and the guest's 9p passthrough need it); scripts/deps.sh installs the
# C virtiofsd, QEMU, fio, tcc and make.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v go >/dev/null && [ -x /usr/local/go/bin/go ]; then
	export PATH=/usr/local/go/bin:$PATH
fi
if [ "$(id -u)" != 0 ]; then
	echo "bench.sh: run as root: kvfsd's passthrough and the C virtiofsd need it" >&2
	exit 1
fi
virtiofsd=/usr/lib/qemu/virtiofsd
if [ ! -x "$virtiofsd" ]; then
	echo "bench.sh: $virtiofsd is missing: run scripts/deps.sh (qemu-system-common)" >&2
	exit 1
fi

mkdir -p bin docs
go build -o bin/ ./cmd/kvfsd ./cmd/containerd-shim-kvfs-v2
# The benchmarks are a module of their own, in bench/.
(cd bench && go build -o ../bin/ ./cmd/kvfsbench ./cmd/kvfsguestbench ./cmd/kvfspodbench)

# What the report records: how the benchmark was started, and kvfsd's source revision.
how=scripts/bench.sh
[ -n "${MAKELEVEL:-}" ] && how="make bench"
[ $# -gt 0 ] && how+=$(printf ' %q' "$@")
rev=$(git describe --always --dirty 2>/dev/null || echo unknown)

only=${BENCH_ONLY:-}
case $only in
"" | server | guest | pod | cri | userns) ;;
*)
	echo "bench.sh: BENCH_ONLY must be server, guest, pod, cri or userns, not $only" >&2
	exit 1
	;;
esac

# kvfsbench rewrites the whole document: with BENCH_ONLY=server keep the guest and pod sections
# (always the last ones, in that order: guest, pod, CRI, user namespace) and put them back after.
guest_section=
if [ "$only" = server ] && [ -f docs/measurements/benchmarks.md ]; then
	guest_section=$(sed -n '/^## Guest level: /,$p' docs/measurements/benchmarks.md)
fi

if [ "$only" = "" ] || [ "$only" = server ]; then
	bin/kvfsbench -invoked "$how" -rev "$rev" \
		-kvfsd bin/kvfsd -virtiofsd "$virtiofsd" \
		-rounds 8 -duration 750ms -slices 6 -warmup 150ms -files 10000 -data-mib 64 \
		-out docs/measurements/benchmarks.md -chart docs/measurements/benchmarks-server.png "$@"
fi
if [ -n "$guest_section" ]; then
	printf '\n%s\n' "$guest_section" >>docs/measurements/benchmarks.md
fi

if [ "$only" = "" ] || [ "$only" = guest ]; then
	ghow=$how
	[ -n "$only" ] && ghow="BENCH_ONLY=$only $ghow"
	[ -n "${GUEST_ARGS:-}" ] && ghow="GUEST_ARGS='$GUEST_ARGS' $ghow"
	# shellcheck disable=SC2086 # GUEST_ARGS is a list of arguments
	bin/kvfsguestbench -invoked "$ghow" -rev "$rev" -image "${KVFS_CACHE:-/var/cache/kvfs}/guest-bench" \
		-kvfsd bin/kvfsd -virtiofsd "$virtiofsd" \
		-runs 3 -fio-runtime 2 -fio-mib 64 -files 2000 -dd-mib 64 -c-files 24 \
		-out docs/measurements/benchmarks.md -chart docs/measurements/benchmarks-guest.png ${GUEST_ARGS:-}
fi

# $AGENT_GUEST: another directory for the agent guest image (one this branch's agent is built into).
agent_guest=${AGENT_GUEST:-${KVFS_CACHE:-/var/cache/kvfs}/agent-guest}
# The test guest, which kvfspodbench boots once under KVM to find whether KVM works here
# (/dev/kvm can open where KVM boots fail); the verdict is cached beside it for this boot.
probe_guest=${KVFS_CACHE:-/var/cache/kvfs}/guest

if [ "$only" = "" ] || [ "$only" = pod ]; then
	phow=$how
	[ -n "$only" ] && phow="BENCH_ONLY=$only $phow"
	[ -n "${POD_ARGS:-}" ] && phow="POD_ARGS='$POD_ARGS' $phow"
	[ -n "${AGENT_GUEST:-}" ] && phow="AGENT_GUEST=$AGENT_GUEST $phow"
	packaging/guest/build.sh --agent "$agent_guest"
	packaging/guest/build.sh "$probe_guest"
	# shellcheck disable=SC2086 # POD_ARGS is a list of arguments
	bin/kvfspodbench -invoked "$phow" -rev "$rev" -shim-dir bin -guest "$agent_guest" -probe-guest "$probe_guest" \
		-runs 10 -mem 512M -vcpus 1 -out docs/measurements/benchmarks.md ${POD_ARGS:-}
fi

if [ "$only" = "" ] || [ "$only" = cri ]; then
	chow=$how
	[ -n "$only" ] && chow="BENCH_ONLY=$only $chow"
	[ -n "${CRI_ARGS:-}" ] && chow="CRI_ARGS='$CRI_ARGS' $chow"
	[ -n "${AGENT_GUEST:-}" ] && chow="AGENT_GUEST=$AGENT_GUEST $chow"
	packaging/guest/build.sh --agent "$agent_guest"
	packaging/guest/build.sh "$probe_guest"
	# shellcheck disable=SC2086 # CRI_ARGS is a list of arguments
	bin/kvfspodbench -cri -invoked "$chow" -rev "$rev" -shim-dir bin -guest "$agent_guest" -probe-guest "$probe_guest" \
		-runs 10 -mem 512M -vcpus 1 -settle 2s -idle 5s -out docs/measurements/benchmarks.md ${CRI_ARGS:-}
fi

if [ "$only" = "" ] || [ "$only" = userns ]; then
	uhow=$how
	[ -n "$only" ] && uhow="BENCH_ONLY=$only $uhow"
	[ -n "${USERNS_ARGS:-}" ] && uhow="USERNS_ARGS='$USERNS_ARGS' $uhow"
	[ -n "${AGENT_GUEST:-}" ] && uhow="AGENT_GUEST=$AGENT_GUEST $uhow"
	packaging/guest/build.sh --agent "$agent_guest"
	packaging/guest/build.sh "$probe_guest"
	# shellcheck disable=SC2086 # USERNS_ARGS is a list of arguments
	bin/kvfspodbench -cri -userns -invoked "$uhow" -rev "$rev" -shim-dir bin -guest "$agent_guest" -probe-guest "$probe_guest" \
		-runs 5 -mem 512M -vcpus 1 -out docs/measurements/benchmarks.md ${USERNS_ARGS:-}
fi
