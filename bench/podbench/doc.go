// Package podbench measures a pod through containerd: kvfs's shim (io.containerd.kvfs.v2,
// each pod a QEMU VM whose root file system the pod's confined kvfsd serves) against
// containerd's runc shim, side by side in one run, interleaved round by round.
//
// Method. A private containerd, started as the tests start theirs
// (internal/testing/ctrdtest/ctrd: its own directory under /tmp, namespace, mount namespace
// and cgroup), imports the busybox image
// (internal/ociimage). Each round runs, for kvfs and then runc, `ctr run --rm ... true` (wall
// time) and `ctr run -d ... sleep 3600`, whose shim and its descendants (QEMU; the
// container's processes) have their memory read from /proc (VmRSS, and smaps_rollup's Rss and
// Pss). At the end containerd's log gives second readings: each run's span from "connecting to
// shim" to "shim disconnected", and the kvfs shim's "the guest agent answers" line, whose
// boot_* fields split QEMU's start to the agent's answer into QEMU+firmware, kernel boot and
// agent start-up (the agent's Ping times, guest CLOCK_BOOTTIME). Before each kvfs run, the
// floor (floor.go): the same QEMU and kernel booted to an /init that powers off at once, timed
// around QEMU. After the rounds (Config.Density) that many sleep pods of each runtime run at
// once, read together: their memory per pod, with what they share split among them in PSS.
// Section renders medians, ranges and per-round ratios kvfs ÷ runc and kvfs ÷ floor as the
// pod-level section of docs/measurements/benchmarks.md.
//
// With Config.CRI (RunCRI, CRISection) the containerd has its CRI on, in a network namespace
// of its own with a CNI bridge, and each round runs a pod through crictl with the runtime
// handler kvfs, then one with runc: runp, create and start of a busybox container that prints
// a line, timed to that line in its CRI log file; the memory of the pod's shim and its
// descendants (QEMU; pause and the container for runc) and their CPU time, idle included;
// stopp and rmp. containerd's log gives the second readings (RunPodSandbox received to
// StartContainer returned, and to the line's CRI timestamp).
package podbench
