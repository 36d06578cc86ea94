#!/bin/bash
# Runs every fuzz target for a bounded time: FUZZTIME each (default 2m; `make test` uses 20s),
# one target after the other (go test -fuzz takes one target per invocation, and the targets
# would only share the same cores). A crash fails the target, and go test writes the input that
# crashed to the package's testdata/fuzz/<Target>/: fix the bug and commit that file, which then
# runs as a regression test with every go test. All targets run even when one fails; the script
# fails if any did.
#   scripts/fuzz.sh                 every target
#   scripts/fuzz.sh FuzzSession     only the targets named
set -uo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
fuzztime=${FUZZTIME:-2m}

# package target
targets="
./virtiofs/fuse FuzzHandle
./virtiofs/vhostuser FuzzDecode
./virtiofs/vhostuser FuzzSession
./virtiofs/virtq FuzzChainWalk
./virtiofs/passthrough FuzzXattrMap
./virtiofs/passthrough FuzzDAXRules
./virtiofs/passthrough FuzzPassthrough
"

# fuzz_one runs one target. Go 1.26's fuzzing coordinator can fail a target with a bare
# "context deadline exceeded" as -fuzztime ends, while a worker is still running an input
# (go.dev/issue/75804, fixed in Go 1.27): no crash, and no input written. Such a run is tried
# once more; a crash always writes its input to testdata/fuzz/TARGET, and fails at once.
fuzz_one() {
	local pkg=$1 target=$2 out before try
	out=$(mktemp)
	for try in 1 2; do
		before=$(ls "$pkg/testdata/fuzz/$target" 2>/dev/null)
		if "$GO" test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$pkg" 2>&1 | tee "$out"; then
			rm -f "$out"
			return 0
		fi
		if [ "$try" = 2 ] || [ "$(ls "$pkg/testdata/fuzz/$target" 2>/dev/null)" != "$before" ] ||
			! grep -qx '    context deadline exceeded' "$out" || grep -q '^    fuzz_test\|panic:\|Failing input' "$out"; then
			break
		fi
		echo "fuzz: $target ended with Go's \"context deadline exceeded\" and wrote no input (go.dev/issue/75804): once more"
	done
	rm -f "$out"
	return 1
}

failed=()
ran=0
start=$SECONDS
while read -r pkg target; do
	[ -n "$pkg" ] || continue
	if [ $# -gt 0 ] && [[ " $* " != *" $target "* ]]; then
		continue
	fi
	echo "fuzz: $target ($pkg) for $fuzztime"
	t0=$SECONDS
	if ! fuzz_one "$pkg" "$target"; then
		failed+=("$target")
	fi
	echo "fuzz: $target took $((SECONDS - t0))s"
	ran=$((ran + 1))
done <<<"$targets"

if [ "$ran" = 0 ]; then
	echo "fuzz: no target named $*" >&2
	exit 2
fi
echo "fuzz: $ran targets in $((SECONDS - start))s"
if [ ${#failed[@]} -gt 0 ]; then
	echo "fuzz: FAILED: ${failed[*]} (the crashing inputs are in the packages' testdata/fuzz)" >&2
	exit 1
fi
