#!/bin/bash
# Generates the Go code of the control API (api/**/*.proto) into OUT (default: the repository,
# next to each .proto). The generated files are committed; `make check-generate` and
# TestGeneratedUpToDate (api/control/v1) regenerate into a temporary directory and compare.
#
# Needs protoc (Debian's protobuf-compiler, 3.21) and the two plugins at the versions go.mod
# pins; missing plugins are installed into GOBIN (go install).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
cd "$root"

if ! command -v protoc >/dev/null; then
	echo "gen-api.sh: protoc not found (apt-get install -y protobuf-compiler, or scripts/deps.sh)" >&2
	exit 1
fi

gobin=$(go env GOBIN)
[ -n "$gobin" ] || gobin=$(go env GOPATH)/bin
export PATH=$gobin:$PATH

# The plugins' versions are go.mod's: the generated code matches the runtime it links with.
pb_version=$(go list -m -f '{{.Version}}' google.golang.org/protobuf)
ttrpc_version=$(go list -m -f '{{.Version}}' github.com/containerd/ttrpc)
if ! protoc-gen-go --version 2>/dev/null | grep -qx "protoc-gen-go $pb_version"; then
	GOFLAGS= go install "google.golang.org/protobuf/cmd/protoc-gen-go@$pb_version"
fi
stamp=$gobin/.protoc-gen-go-ttrpc.version
if ! command -v protoc-gen-go-ttrpc >/dev/null || [ "$(cat "$stamp" 2>/dev/null)" != "$ttrpc_version" ]; then
	GOFLAGS= go install "github.com/containerd/ttrpc/cmd/protoc-gen-go-ttrpc@$ttrpc_version"
	echo "$ttrpc_version" >"$stamp"
fi

mkdir -p "$out"
find api -name '*.proto' -print0 | sort -z | xargs -0 -r \
	protoc -I . \
	--go_out="$out" --go_opt=paths=source_relative \
	--go-ttrpc_out="$out" --go-ttrpc_opt=paths=source_relative
