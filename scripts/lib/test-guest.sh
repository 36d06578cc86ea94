# Sourced by scripts that time something in the test guest (packaging/guest/build.sh), whose
# /init runs a script from its virtio-fs share and powers off.

# test_guest_boot QEMU KERNEL SMP QUEUES SHARE SCRIPT: serves SHARE with bin/kvfsd (unconfined,
# its log in SHARE/../kvfsd.log), boots the test guest's initramfs with KERNEL under QEMU (TCG,
# SMP vCPUs, 512 MiB, QUEUES virtio-fs request queues), which runs SCRIPT (relative to SHARE),
# and prints the guest's console.
test_guest_boot() {
	local qemu=$1 kernel=$2 smp=$3 queues=$4 share=$5 script=$6
	local repo cache sock dev server rc=0
	repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
	cache=${KVFS_CACHE:-/var/cache/kvfs}
	sock=$share/../kvfsd.sock
	rm -f "$sock"
	"$repo/bin/kvfsd" --socket-path="$sock" --shared-dir="$share" --sandbox=none 2>"$share/../kvfsd.log" &
	server=$!
	for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
	dev=vhost-user-fs-pci,chardev=fs,tag=kvfs
	[ "$queues" -le 1 ] || dev=$dev,num-request-queues=$queues
	"$qemu" -nodefaults -no-user-config -display none -no-reboot -machine q35,accel=tcg -cpu max \
		-smp "$smp" -m 512M -object memory-backend-memfd,id=mem,size=512M,share=on -numa node,memdev=mem \
		-chardev socket,id=fs,path="$sock" -device "$dev" \
		-kernel "$kernel" -initrd "$cache/guest/initramfs.gz" \
		-append "console=ttyS0 quiet panic=-1 kvfs.run=$script" -serial stdio || rc=$?
	kill "$server" 2>/dev/null || true
	wait "$server" 2>/dev/null || true
	return "$rc"
}
