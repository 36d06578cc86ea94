// Package ctrd runs a private containerd, with ctr and crictl to drive it, the busybox test
// image, and a check that nothing it ran outlives what its user meant it to. Tests use it
// through internal/testing/ctrdtest, which fails the test where this package returns an error; the
// pod benchmarks (bench/podbench) use it as it is.
//
//	c, err := ctrd.Start(ctrd.Options{ShimDirs: []string{dirOfTheKvfsShim}, Logf: log.Printf})
//	image, err := c.ImportBusybox()
//	cfg := filepath.Join(c.Dir(), "kvfs.toml") // a runtime config with base_dir = c.SandboxBaseDir()
//	before, err := c.Snapshot()
//	r, err := c.RunCtr(ctx, "run", "--rm", "--runtime", "io.containerd.kvfs.v2",
//		"--runtime-config-path", cfg, image, "t1", "echo", "hello")
//	// r.Stdout == "hello\n", r.ExitCode == 0
//	leaks, err := c.Leaks(before, 10*time.Second)
//	leaks, err = c.Stop() // what it held then that it did not hold at the start, taken back
//	err = c.Remove()
//
// Each containerd has its own directory under /tmp (config.toml, containerd.log, root/,
// state/, the gRPC and ttrpc sockets) and its own namespace (kvfstest-XXXXXXXX): runc's state
// (/run/containerd/runc/NAMESPACE) and ctr's cgroups (/NAMESPACE/ID) are shared by every
// containerd on the machine, and the namespace keeps containerds running at once apart. Its
// config (package ctrdconf writes it) disables the CRI (no CNI needed; Options.CRI turns it on)
// and NRI, and points every path containerd would otherwise take on the machine
// (/var/lib/containerd, /run/containerd/containerd.sock, /opt/containerd,
// /etc/containerd/conf.d) into the directory. The shims' sockets are containerd's usual
// /run/containerd/s/HASH, the hash taken over the containerd's address.
//
// containerd runs in a private mount namespace of its own, which its shims inherit: the
// containers' root file systems and the sandboxes' binds are mounted there, out of the
// machine's mount table (where tests count mounts), and go when its last process does. A
// user that looks at such a mount from outside does so through /proc/PID/root or nsenter with
// PID().
//
// The binaries are scripts/deps.sh's (Binaries): containerd ContainerdVersion, ctr and the
// runc shim in ${KVFS_CACHE:-/var/cache/kvfs}/bin; runc is Debian's.
//
// containerd starts in a cgroup (v2) of its own, which every process it starts inherits:
// the leak check finds its processes there even once orphaned and renamed, and the next
// Start on the machine kills what a process that died before stopping its containerd left
// (see cgroup.go). With CRI, its network namespace has no name: it goes with the last of the
// containerd's processes, which Stop kills.
//
// What leaks is whatever the containerd holds at the end that it did not hold at the start:
// the processes of its cgroup, its shims and their descendants (container processes, VMs) and
// any process naming its directory or a LeakDir, mounts under them (in the caller's mount
// namespace and in containerd's), cgroups and runc state in its namespace, entries of the
// LeakDirs, and more of containerd's open descriptors of a kind. Leaks finds that against a
// Snapshot taken before (after a series of runs, say); Stop finds it against the start once
// containerd is stopped, and takes back what it found.
package ctrd
