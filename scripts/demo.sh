#!/bin/bash
# The kvfs demo: a host directory served by kvfsd to a real Linux guest under QEMU.
#
#   scripts/demo.sh        (or: make demo)
#
# It builds the test guest (Debian's 6.1 kernel + a busybox initramfs, packaging/guest/build.sh),
# fills a host directory, starts bin/kvfsd on it, boots the guest with the share mounted, runs
# a short script in the guest, and shows on the host what the guest wrote. Uses KVM when it
# works, TCG otherwise (a boot then takes 10-40 s).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${KVFS_CACHE:-/var/cache/kvfs}/guest

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

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
	-kernel "$cache/vmlinuz" -initrd "$cache/initramfs.gz" \
	-append "console=ttyS0 quiet panic=-1 kvfs.tag=kvfs kvfs.run=demo.sh" \
	-serial stdio | tee "$work/console.log" |
	sed -u -e 's/\x1b[[0-9;?]*[a-zA-Z]//g; s/\x1bc//g' | grep --line-buffered -v -e '^\[' -e SeaBIOS -e 'Booting from' || true

wait $kvfsd || true
say "back on the host: what the guest left in $share/from-guest"
ls -l "$share/from-guest"
cat "$share/from-guest/note.txt"
sha256sum "$share/from-guest/zeros"
grep -q '^KVFS-EXIT 0' "$work/console.log" || { echo "the guest script failed" >&2; exit 1; }
say "kvfsd exited when QEMU disconnected; demo done"
