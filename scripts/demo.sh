#!/bin/bash
# The kvfs demo: a host directory served by kvfsd to a real Linux guest under QEMU.
#
#   scripts/demo.sh        (or: make demo)
#
# It builds the test guest (Debian's 6.1 kernel + a busybox initramfs, packaging/guest/build.sh),
# fills a host directory, starts bin/kvfsd on it, boots the guest with the share mounted, runs
# a short script in the guest, and shows on the host what the guest wrote. Uses KVM when it
# works, TCG otherwise (a boot then takes 10-40 s).
#
# Then a container through containerd: it builds containerd-shim-kvfs-v2 (runtime
# io.containerd.kvfs.v2), kvfsctl, the pod VM's image (build.sh --agent) and the busybox OCI
# archive; starts a private containerd (its own directory under /tmp, sockets and namespace, in
# a private mount namespace, the shim first on its PATH); imports the image; and shows a
# `ctr run --rm` in a VM, a detached container seen by kvfsctl (list, status with the confined
# kvfsd's request counters), a `ctr task exec` in it, its kill and removal. Then a Kubernetes-
# style pod through containerd's CRI with crictl: `crictl runp --runtime kvfs` boots the pod's
# VM, a container is created and started in it, its log read, an exec run, its IP pinged from
# beside the pod's veth, and the pod stopped and removed. containerd runs in a network
# namespace of its own (the CNI bridge's), so no address leaves it. Each VM start is timed.
# containerd is stopped at the end, and the script fails if a process, a mount or a sandbox
# directory of it is left.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${KVFS_CACHE:-/var/cache/kvfs}/guest

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() {
	echo "demo: $*" >&2
	exit 1
}
if ! command -v go >/dev/null && [ -x /usr/local/go/bin/go ]; then
	export PATH=/usr/local/go/bin:$PATH
fi

[ -x bin/kvfsd ] || go build -o bin/ ./cmd/kvfsd
say "guest image"
packaging/guest/build.sh "$cache"

work=$(mktemp -d /tmp/kvfs-demo.XXXXXX)
share=$work/share
sock=$work/vhost-fs.sock
mkdir -p "$share/docs"
echo "Hello from the host, $(date -u +%FT%TZ)" >"$share/hello.txt"
seq 1 1000 >"$share/docs/numbers.txt"
ln -s hello.txt "$share/greeting"
cat >"$share/demo.sh" <<'GUEST'
set -e
echo "--- guest: $(uname -sr), share mounted as:"
grep virtiofs /proc/mounts
echo "--- guest: ls -l"
ls -l
echo "--- guest: cat hello.txt (through the symlink 'greeting')"
cat greeting
echo "--- guest: sum of docs/numbers.txt: $(awk '{s+=$1} END {print s}' docs/numbers.txt)"
echo "--- guest: writing from-guest/ (a directory, a 16 MiB file, a rename)"
mkdir from-guest
echo "written in the guest by uid $(id -u) at $(date -u +%FT%TZ)" >from-guest/note.tmp
mv from-guest/note.tmp from-guest/note.txt
dd if=/dev/zero of=from-guest/zeros bs=1M count=16 2>/dev/null
sync
sha256sum from-guest/zeros
echo "--- guest: df ."
df -h . | tail -1
GUEST

say "starting kvfsd on $share"
bin/kvfsd --socket-path="$sock" -o source="$share" -o cache=auto &
kvfsd=$!
trap 'kill $kvfsd 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
[ -S "$sock" ] || { echo "kvfsd did not create its socket" >&2; exit 1; }

accel=tcg
if [ -w /dev/kvm ] && [ "$(cat "$cache/accel" 2>/dev/null | cut -d' ' -f2)" = kvm ]; then
	accel=kvm
fi
say "booting the guest (QEMU, accel=$accel)"
qemu-system-x86_64 -nodefaults -no-user-config -nographic -no-reboot \
	-machine q35,accel=$accel -cpu max -smp 2 -m 1G \
	-object memory-backend-memfd,id=mem,size=1G,share=on -numa node,memdev=mem \
	-chardev socket,id=vfs,path="$sock" \
	-device vhost-user-fs-pci,chardev=vfs,tag=kvfs,queue-size=1024 \
	-kernel "$cache/vmlinux" -initrd "$cache/initramfs.gz" \
	-append "console=ttyS0 quiet panic=-1 kvfs.tag=kvfs kvfs.run=demo.sh" \
	-serial stdio | tee "$work/console.log" |
	sed -u -e 's/\x1b[[0-9;?]*[a-zA-Z]//g; s/\x1bc//g' | grep --line-buffered -v -e '^\[' -e SeaBIOS -e 'Booting from' || true

wait $kvfsd || true
say "back on the host: what the guest left in $share/from-guest"
ls -l "$share/from-guest"
cat "$share/from-guest/note.txt"
sha256sum "$share/from-guest/zeros"
grep -q '^KVFS-EXIT 0' "$work/console.log" || { echo "the guest script failed" >&2; exit 1; }
say "kvfsd exited when QEMU disconnected"

# ---------------------------------------------------------------------------------------------
# Part two: a container through containerd, in a VM whose root filesystem kvfsd serves.

# t0 / took: the seconds since a start, one decimal.
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

say "a container through containerd: building the shim, kvfsctl, the pod VM's image, the busybox image"
go build -o bin/ ./cmd/containerd-shim-kvfs-v2 ./cmd/kvfsctl
# The pod VM boots kvfs's own kernel once it is built (make guest-kernel; make test builds it:
# about 7½ minutes on 2 cores); until then Debian 12's packaged kernel, whose drivers are
# modules loaded from an initramfs root, so that a first demo compiles no kernel.
if packaging/guest/kernel/build.sh --check "${KVFS_CACHE:-/var/cache/kvfs}/guest-kernel"; then
	agentcache=${KVFS_CACHE:-/var/cache/kvfs}/agent-guest
	packaging/guest/build.sh --agent "$agentcache"
	root_line="rootfs = \"$agentcache/rootfs.erofs\""
	echo "the pod VM's kernel: kvfs's own (packaging/guest/kernel), its root an erofs image on virtio-pmem"
else
	agentcache=${KVFS_CACHE:-/var/cache/kvfs}/agent-guest-debian
	KVFS_GUEST_KERNEL=debian packaging/guest/build.sh --agent "$agentcache"
	root_line="rootfs = \"\"
initrd = \"$agentcache/initramfs.gz\""
	echo "the pod VM's kernel: Debian 12's, its drivers loaded from an initramfs root: kvfs's own kernel is not"
	echo "built yet (make guest-kernel, or make test, builds it; demos after that boot it: a pod starts faster)"
fi
ctrdbin=${KVFS_CACHE:-/var/cache/kvfs}/bin
for b in containerd ctr crictl; do
	[ -x "$ctrdbin/$b" ] || die "$ctrdbin/$b is missing: run scripts/deps.sh (make demo does)"
done

# Everything of this containerd is under $ctrd: config, root, state, sockets, ctr's fifos, the
# kvfs configuration, and base_dir, where the shim makes its sandboxes (kvfsctl --base-dir).
# Short: a CRI pod's id is 64 characters, and its sandbox's sockets (base_dir/ID/NAME.sock) must
# fit in the 107 bytes of a Unix socket address.
ctrd=$(mktemp -d /tmp/kvfsdemo.XXXXXX)
chmod 711 "$ctrd"
base=$ctrd/sb
ns=kvfs-demo-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
mkdir -m 700 "$ctrd/tmp" "$ctrd/fifo" "$base"
ctrd_pid=
go run ./internal/ociimage/cmd/busybox-image -o "$ctrd/busybox.tar"
image=localhost/busybox:latest
# The CRI's pod sandbox image (it must be there; kvfs never runs it: the VM is the pod).
go run ./internal/ociimage/cmd/busybox-image -name localhost/pause:kvfs-test -o "$ctrd/pause.tar"

accel=tcg
for f in "$agentcache/accel" "$cache/accel"; do
	if [ -w /dev/kvm ] && [ "$(cut -d' ' -f2 "$f" 2>/dev/null)" = kvm ]; then
		accel=kvm
	fi
done
cfg=$ctrd/kvfs.toml
cat >"$cfg" <<EOF
base_dir = "$base"

[vm]
kernel = "$agentcache/vmlinux"
$root_line
accel = "$accel"
memory = "512M"
EOF

# containerd's own config, as internal/testing/ctrdtest's (package ctrdconf writes both): version 4,
# every path under $ctrd, no NRI (its socket would be the machine's), the CRI on with the
# runtime handler kvfs (this kvfs configuration) and a CNI bridge network, and crictl's config.
go run ./internal/testing/ctrdtest/ctrdconf/cmd/ctrdconf -dir "$ctrd" -cri -kvfs-config "$cfg"
ip netns add "$ns"
netns_made=1
ip -n "$ns" link set lo up

unset CONTAINERD_ADDRESS CONTAINERD_NAMESPACE CONTAINERD_SNAPSHOTTER CONTAINERD_RUNTIME
# ctr drops one warning line, at every call, about the host's cgroup v1 (the containers are in
# the VM: the host's cgroups do not matter to them).
ctr() {
	"$ctrdbin/ctr" --address "$ctrd/containerd.sock" --namespace "$ns" "$@" \
		2> >(grep --line-buffered -v 'DEPRECATION: The support for cgroup v1' >&2)
}
kvfsctl() { bin/kvfsctl --base-dir "$base" "$@"; }
# crictl runs in containerd's network namespace, where the streaming server of exec listens.
crictl() { nsenter --net="/run/netns/$ns" "$ctrdbin/crictl" --config "$ctrd/crictl.yaml" "$@"; }

# mine lists the processes this containerd left (its shims, their VMs): every one has $ctrd
# in its command line, and nothing else on the machine has.
mine() { pgrep -f -- "$ctrd/" | grep -vx -e "$$" -e "${ctrd_pid:-0}" || true; }

# cleanup_containerd removes what is left in the namespace, stops containerd, and fails if a
# process, a mount or a sandbox directory outlived it.
cleanup_containerd() {
	set +e
	local bad=0 pid m
	if [ -n "$ctrd_pid" ] && kill -0 "$ctrd_pid" 2>/dev/null; then
		for id in $(crictl pods -q 2>/dev/null); do crictl rmp -f "$id" >/dev/null 2>&1; done
		for id in $(ctr task ls -q 2>/dev/null); do ctr task kill -s SIGKILL "$id" >/dev/null 2>&1; done
		for id in $(ctr task ls -q 2>/dev/null); do ctr task rm -f "$id" >/dev/null 2>&1; done
		for id in $(ctr container ls -q 2>/dev/null); do ctr container rm "$id" >/dev/null 2>&1; done
		# Shims exit shortly after their last task is deleted.
		for _ in $(seq 150); do
			[ -z "$(mine)" ] && break
			sleep 0.1
		done
		# Mounts in containerd's mount namespace go with it: look before it stops.
		m=$(nsenter -t "$ctrd_pid" -m findmnt -rn -o TARGET 2>/dev/null | grep -F "$ctrd/")
		[ -z "$m" ] || { echo "demo: left mounted in containerd's mount namespace: $m" >&2; bad=1; }
		kill -TERM "$ctrd_pid"
		for _ in $(seq 100); do kill -0 "$ctrd_pid" 2>/dev/null || break; sleep 0.1; done
		kill -0 "$ctrd_pid" 2>/dev/null && kill -KILL "$ctrd_pid"
		wait "$ctrd_pid" 2>/dev/null
	fi
	for pid in $(mine); do
		echo "demo: left running: $(ps -o pid=,args= -p "$pid" | cut -c1-160)" >&2
		kill -KILL "$pid" 2>/dev/null
		bad=1
	done
	if [ -n "${netns_made:-}" ]; then
		ip netns del "$ns" || bad=1
		netns_made=
	fi
	m=$(findmnt -rn -o TARGET | grep -F "$ctrd")
	[ -z "$m" ] || { echo "demo: left mounted: $m" >&2; bad=1; }
	if [ -d "$base" ] && [ -n "$(ls -A "$base")" ]; then
		echo "demo: sandbox directories left in $base: $(ls -A "$base")" >&2
		bad=1
	fi
	if [ $bad = 0 ]; then
		rm -rf "$ctrd"
	else
		echo "demo: keeping $ctrd (containerd's log: $ctrd/containerd.log)" >&2
	fi
	return $bad
}
trap 'rc=$?; rm -rf "$work"; cleanup_containerd || rc=1; exit $rc' EXIT

say "starting a private containerd in $ctrd (namespace $ns, its own mount and network namespaces)"
# The shim first on its PATH; containerd's mounts (snapshots, root filesystems, sandboxes'
# binds) stay in a mount namespace of its own and go with it.
unshare -m --propagation private nsenter --net="/run/netns/$ns" \
	env PATH="$root/bin:$ctrdbin:$PATH" TMPDIR="$ctrd/tmp" \
	"$ctrdbin/containerd" --config "$ctrd/config.toml" >"$ctrd/containerd.log" 2>&1 &
ctrd_pid=$!
for _ in $(seq 300); do
	ctr version >/dev/null 2>&1 && break
	kill -0 "$ctrd_pid" 2>/dev/null || { tail -20 "$ctrd/containerd.log" >&2; die "containerd exited at start"; }
	sleep 0.1
done
ctr version >/dev/null 2>&1 || die "containerd did not answer within 30 s"
echo "containerd $("$ctrdbin/containerd" --version | awk '{print $3}'), pid $ctrd_pid; shim: $root/bin/containerd-shim-kvfs-v2"

say "ctr image import busybox.tar"
ctr image import "$ctrd/busybox.tar"
ctr image ls -q | grep -qx "$image" || die "$image is not in the image list after the import"

echo
echo "kvfs configuration (--runtime-config-path $cfg):"
sed 's/^/    /' "$cfg"

host_release=$(uname -r)
say "ctr run --rm: a container in a VM (host kernel $host_release; VM boots take a few seconds under TCG)"
t0=$(now)
ctr run --rm --fifo-dir "$ctrd/fifo" --runtime io.containerd.kvfs.v2 --runtime-config-path "$cfg" "$image" demo1 \
	sh -c 'echo hello from $(uname -r) in a VM; grep virtiofs /proc/mounts; echo "cpus: $(nproc), memory: $(free -m | awk "/^Mem:/ {print \$2}") MiB"; echo "the root: $(ls / | tr "\n" " ")"' |
	tee "$ctrd/demo1.out"
echo "(ctr run --rm took $(took "$t0") s: VM boot ($accel), the command, VM stop)"
guest_release=$(sed -n 's/^hello from \(.*\) in a VM$/\1/p' "$ctrd/demo1.out")
[ -n "$guest_release" ] || die "demo1 did not print its greeting"
[ "$guest_release" != "$host_release" ] || die "demo1 ran on the host's kernel ($host_release), not in a VM"
grep -q ' / virtiofs ' "$ctrd/demo1.out" || die "demo1's root is not virtio-fs"

say "ctr run -d: a detached container (sleep)"
t0=$(now)
ctr run -d --fifo-dir "$ctrd/fifo" --runtime io.containerd.kvfs.v2 --runtime-config-path "$cfg" "$image" demo2 sleep 3600
echo "(its VM started in $(took "$t0") s, accel=$accel)"
ctr task ls | tee "$ctrd/tasks.out"
grep -Eq '^demo2[[:space:]]+[0-9]+[[:space:]]+RUNNING' "$ctrd/tasks.out" || die "demo2 is not running"

say "kvfsctl list (sandboxes in $base)"
kvfsctl list | tee "$ctrd/list.out"
grep -Eq '^demo2[[:space:]]' "$ctrd/list.out" || die "kvfsctl list does not show demo2"

say "kvfsctl status demo2: the pod and its confined kvfsd's request counters"
kvfsctl status demo2 | tee "$ctrd/status.out"
grep -Eq '^Sandbox:[[:space:]]+demo2$' "$ctrd/status.out" || die "kvfsctl status does not show demo2"
grep -Eq '^LOOKUP[[:space:]]+[1-9]' "$ctrd/status.out" || die "kvfsctl status shows no LOOKUP requests"

say "ctr task exec: a second process in demo2's VM"
ctr task exec --fifo-dir "$ctrd/fifo" --exec-id demo-exec demo2 sh -c 'echo hello from an exec on $(uname -r); ps' | tee "$ctrd/exec.out"
grep -q "^hello from an exec on $guest_release\$" "$ctrd/exec.out" || die "the exec did not print its greeting"
grep -q 'sleep 3600' "$ctrd/exec.out" || die "the exec does not see demo2's sleep"
echo "kvfsd's LOOKUP count, before and after the exec: $(awk '$1 == "LOOKUP" {print $2}' "$ctrd/status.out") -> $(kvfsctl status demo2 | awk '$1 == "LOOKUP" {print $2}')"

say "ctr task kill -s SIGKILL demo2; ctr task rm; ctr container rm"
ctr task kill -s SIGKILL demo2
for _ in $(seq 300); do
	ctr task ls | grep -Eq '^demo2[[:space:]].*STOPPED' && break
	sleep 0.1
done
ctr task ls | grep -Eq '^demo2[[:space:]].*STOPPED' || die "demo2 did not stop within 30 s of SIGKILL"
ctr task rm demo2
ctr container rm demo2
for _ in $(seq 150); do
	[ -z "$(mine)" ] && [ -z "$(ls -A "$base")" ] && break
	sleep 0.1
done
[ -z "$(ls -A "$base")" ] || die "demo2's sandbox directory is still in $base"
[ -z "$(mine)" ] || die "demo2's shim or VM is still running"
kvfsctl list | tee "$ctrd/list.out"
! grep -Eq '^demo2[[:space:]]' "$ctrd/list.out" || die "kvfsctl list still shows demo2"
echo "(no shim, no VM, no sandbox directory left)"

# ---------------------------------------------------------------------------------------------
# Part three: a pod through containerd's CRI, as Kubernetes runs one (runtimeClassName: kvfs).
say "crictl: a pod through containerd's CRI with the runtime handler kvfs"
ctr --namespace k8s.io image import "$ctrd/busybox.tar" >/dev/null
ctr --namespace k8s.io image import "$ctrd/pause.tar" >/dev/null
cat >"$ctrd/pod.json" <<EOF
{"metadata": {"name": "demo-pod", "namespace": "default", "uid": "demo-pod-uid"},
 "hostname": "demo-pod", "log_directory": "$ctrd/pod-logs",
 "dns_config": {"servers": ["10.99.0.53"], "searches": ["demo.test"]}}
EOF
cat >"$ctrd/web.json" <<EOF
{"metadata": {"name": "web"}, "image": {"image": "$image"}, "log_path": "web.log",
 "command": ["sh", "-c", "echo hello from \$(hostname) on \$(uname -r); ip -4 -o addr show eth0; exec nc -ll -p 8080 -e echo served-by-the-pod"]}
EOF
t0=$(now)
echo "$ crictl runp --runtime kvfs pod.json"
pod=$(crictl runp --runtime kvfs "$ctrd/pod.json")
echo "$pod"
echo "(the pod's VM booted in $(took "$t0") s, accel=$accel)"
echo "$ crictl create POD web.json pod.json && crictl start CTR"
web=$(crictl create "$pod" "$ctrd/web.json" "$ctrd/pod.json")
crictl start "$web" >/dev/null
crictl ps --pod "$pod"
for _ in $(seq 600); do
	crictl logs "$web" 2>/dev/null | grep -q 'inet ' && break
	sleep 0.1
done
echo "$ crictl logs CTR"
crictl logs "$web" | tee "$ctrd/web.log"
grep -q "^hello from demo-pod on $guest_release\$" "$ctrd/web.log" || die "the pod's container did not greet from its VM"
echo "$ crictl exec CTR cat /etc/resolv.conf"
crictl exec --sync "$web" cat /etc/resolv.conf | tee "$ctrd/resolv.out"
grep -q 'nameserver 10.99.0.53' "$ctrd/resolv.out" || die "the pod's DNS configuration is not the container's"
ip=$(crictl inspectp -o go-template --template '{{.status.network.ip}}' "$pod")
echo "the pod's IP: $ip (its VM's eth0)"
echo "$ ping and nc from beside the pod's veth (containerd's network namespace)"
nsenter --net="/run/netns/$ns" busybox ping -c 1 -W 5 "$ip"
nsenter --net="/run/netns/$ns" busybox nc -w 10 "$ip" 8080 </dev/null | tee "$ctrd/nc.out"
grep -q served-by-the-pod "$ctrd/nc.out" || die "the pod's server did not answer on $ip:8080"
echo "$ kvfsctl list"
kvfsctl list
echo "$ crictl stopp POD && crictl rmp POD"
crictl stopp "$pod"
crictl rmp "$pod"
for _ in $(seq 150); do
	[ -z "$(mine)" ] && [ -z "$(ls -A "$base")" ] && break
	sleep 0.1
done
[ -z "$(ls -A "$base")" ] || die "the pod's sandbox directory is still in $base"
[ -z "$(mine)" ] || die "the pod's shim or VM is still running"
echo "(no shim, no VM, no sandbox directory left)"

say "stopping containerd"
cleanup_containerd || exit 1
set -e
ctrd_pid=
trap 'rc=$?; rm -rf "$work"; exit $rc' EXIT
say "demo done"
