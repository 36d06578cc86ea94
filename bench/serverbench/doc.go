// Package serverbench measures kvfsd against the C virtiofsd at the server level: no guest, the
// in-repo front-end (virtiofs/testing/frontend) plays QEMU and the guest driver, and the FUSE
// client (virtiofs/testing/fuseclient) plays the guest's FUSE layer. Both servers run as separate
// processes on the same shared directory, so the CPU time each spends per request is read from
// its own /proc/PID/stat.
//
// Method. Every server configuration (kvfsd with thread pool 0 and 4, cache auto and none; the C
// virtiofsd with the same settings where it can run) is started once, probed, and kept
// connected. A round runs each workload on every configuration: after a short warm-up each, the
// measured time of each is cut into slices that go round the configurations forwards then
// backwards, kvfsd and the C virtiofsd of a configuration next to each other, so that the two
// see the same moments of a shared, noisy machine. Each figure reported is the median over the
// rounds, and each kvfsd/virtiofsd ratio the median of the per-round ratios. A "limit" target
// makes the same system calls directly from Go on the host, as the cost no server can beat. A
// "floor" target, on the queue-depth-1 workloads, is a two-process eventfd ping-pong (floor.go):
// the two cross-process wake-ups every request at queue depth 1 costs, so each QD1 row also
// reads as a share of it. With -slices 1, each server runs alone for its whole cell.
//
// Memory (named "memory" for -run): each of kvfsd with --inode-file-handles=never and
// =mandatory and the C virtiofsd is started alone and connected; its RSS and descriptors are
// read idle after INIT, and again after the front-end, playing a guest that keeps them cached,
// looked up 100k distinct files; the difference divided by the inodes cached is the bytes per
// cached inode.
//
// The results are written as Markdown (Report) with a PNG chart of the ratios (Chart).
package serverbench
