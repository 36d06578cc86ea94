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
	if ! "$GO" test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$pkg"; then
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
