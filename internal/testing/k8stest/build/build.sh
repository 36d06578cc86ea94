#!/bin/bash
# Builds the single-node Kubernetes of the Kubernetes tests (internal/testing/k8stest) from
# the Go module proxy:
#
#   internal/testing/k8stest/build/build.sh OUTDIR
#
# OUTDIR gets kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl of
# k8s.io/kubernetes, and etcd (go.etcd.io/etcd/server/v3's etcdmain), at the versions this
# directory's go.mod pins: k8s.io/kubernetes cannot be go-installed (its go.mod replaces its
# staging modules with its own directories), so this module requires it, replaces each staging
# module with its release of the same Kubernetes version, and names the five commands as its
# tools; go.sum holds every module's checksum.
#
# Nothing is done when OUTDIR holds a build of the same inputs (go.mod, go.sum, etcd/main.go,
# this script and the Go version: OUTDIR/inputs.sha256, written last, so an interrupted build
# leaves none). The first build takes about 14 CPU-minutes (most of Kubernetes compiled); Go's
# build cache makes the next one (after a change of this script, say) take seconds. Concurrent
# runs wait for each other.
set -euo pipefail

prog=k8stest/build/build.sh
die() {
	echo "$prog: error: $*" >&2
	exit 1
}
[ $# -eq 1 ] || die "usage: $0 OUTDIR"
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1" || die "cannot create output directory $1"
out=$(cd "$1" && pwd)
command -v go >/dev/null || export PATH=/usr/local/go/bin:$PATH

exec 9>"$out/.lock"
flock 9

bins="kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl etcd"
hash=$({
	cd "$here" && sha256sum go.mod go.sum etcd/main.go build.sh
	go env GOVERSION
} | sha256sum | cut -d' ' -f1)
ok=1
[ "$(cat "$out/inputs.sha256" 2>/dev/null)" = "$hash" ] || ok=0
for b in $bins; do
	[ -x "$out/$b" ] || ok=0
done
if [ $ok = 1 ]; then
	exit 0
fi

rm -f "$out/inputs.sha256"
version=$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
echo "$prog: building Kubernetes $version and etcd into $out (minutes the first time)" >&2
tmp=$(mktemp -d "$out/.new.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# The version the binaries report (kubectl version, the node's kubeletVersion): Kubernetes'
# own build sets it the same way.
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1"
ldflags="$ldflags -X k8s.io/component-base/version.gitMinor=$(echo "$version" | cut -d. -f2)"
ldflags="$ldflags -X k8s.io/component-base/version.gitTreeState=clean"
(cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$tmp/" tool ./etcd)
for b in $bins; do
	mv -f "$tmp/$b" "$out/$b"
done
echo "$hash" >"$out/inputs.sha256"
echo "$prog: built $("$out/kubelet" --version)" >&2
