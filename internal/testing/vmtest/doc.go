// Package vmtest boots a real Linux guest under QEMU against a vhost-user-fs
// server, for tests that need the guest kernel's virtio-fs driver on the
// other end of the rings.
//
// The pieces, each usable on its own:
//
//   - [Image] builds (or reuses) the guest: Debian 12's kernel and an
//     initramfs made by packaging/guest/build.sh. The guest's /init mounts the
//     share, runs one script from it, prints "KVFS-EXIT <status>" on the
//     serial console and powers off.
//   - [AgentImage] builds the pod VM's guest ("build.sh --agent"): the same
//     kernel, kvfs-agent as /init, runc and busybox. [Accel] answers the
//     accelerator choice for guests of that kernel.
//   - [StartServer] runs a virtiofsd-compatible server (the C virtiofsd or
//     kvfsd) on a temporary socket.
//   - [Boot] turns [Options] into a QEMU command line ([Options.QEMUArgs] is
//     pure and table-tested), runs it and collects the console.
//
// The conformance suite (guestcheck.sh, run by TestGuestConformance) uses all
// three. Which server it tests comes from $KVFS_SERVER; without it the test
// builds ./cmd/kvfsd.
//
// Environment:
//
//	KVFS_SERVER  server binary for TestGuestConformance
//	KVFS_CACHE   Image keeps the guest in $KVFS_CACHE/guest (default /var/cache/kvfs/guest);
//	             AgentImage uses $KVFS_CACHE/agent-guest (default /var/cache/kvfs/agent-guest)
//	KVFS_ACCEL   "kvm" or "tcg" to skip the accelerator probe in Boot
//
// KVM: an openable /dev/kvm is not proof that KVM works (on some nested
// hosts the guest kernel hangs early under KVM), so Boot first boots the
// guest once under KVM with a short deadline and falls back to TCG if it does
// not come up. The verdict is cached next to the kernel for the host's boot.
package vmtest
