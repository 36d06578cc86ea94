#!/bin/bash
# The server-level benchmark (bench/serverbench): kvfsd against the C virtiofsd through the
# in-repo front-end, interleaved in rounds, and a "limit" row of the same system calls made
# directly on the host. Writes docs/benchmarks.md and its chart docs/benchmarks-server.png.
# Takes about 8 minutes on 2 cores. Runs as root (both servers need it); scripts/deps.sh
# installs the C virtiofsd. Arguments are passed on to kvfsbench, after the defaults below:
#   scripts/bench.sh -rounds 2 -duration 300ms -run 'READ|WRITE'   # a quick look
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
go build -o bin/ ./cmd/kvfsd ./bench/cmd/kvfsbench

# What the report records: how the benchmark was started, and kvfsd's source revision.
how=scripts/bench.sh
[ -n "${MAKELEVEL:-}" ] && how="make bench"
[ $# -gt 0 ] && how+=$(printf ' %q' "$@")
rev=$(git describe --always --dirty 2>/dev/null || echo unknown)

exec bin/kvfsbench -invoked "$how" -rev "$rev" \
	-kvfsd bin/kvfsd -virtiofsd "$virtiofsd" \
	-rounds 8 -duration 750ms -slices 6 -warmup 150ms -files 10000 -data-mib 64 \
	-out docs/benchmarks.md -chart docs/benchmarks-server.png "$@"
