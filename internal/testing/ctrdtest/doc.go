// Package ctrdtest runs a private containerd for a test, with ctr to drive it, the busybox test
// image, and a check that nothing it ran outlives what the test meant it to.
//
//	c := ctrdtest.Start(t, ctrdtest.Options{ShimDirs: []string{dirOfTheKvfsShim}})
//	image := ctrdtest.ImportBusybox(t, c)
//	cfg := filepath.Join(c.Dir(), "kvfs.toml") // a runtime config with base_dir = c.SandboxBaseDir()
//	before := c.Snapshot(t)
//	r := c.RunCtr(t, "run", "--rm", "--runtime", "io.containerd.kvfs.v2",
//		"--runtime-config-path", cfg, image, "t1", "echo", "hello")
//	// r.Stdout == "hello\n", r.ExitCode == 0
//	c.CheckNoLeaks(t, before)
//
// Each containerd has its own directory under /tmp (config.toml, containerd.log, root/,
// state/, the gRPC and ttrpc sockets) and its own namespace (kvfstest-XXXXXXXX): runc's state
// (/run/containerd/runc/NAMESPACE) and ctr's cgroups (/NAMESPACE/ID) are shared by every
// containerd on the machine, and the namespace keeps tests running at once apart. Its config
// (package ctrdconf writes it) disables the CRI (no CNI needed; Options.CRI turns it on) and
// NRI, and points every path containerd would otherwise take on the machine
// (/var/lib/containerd, /run/containerd/containerd.sock, /opt/containerd,
// /etc/containerd/conf.d) into the directory. The shims' sockets are containerd's usual
// /run/containerd/s/HASH, the hash taken over the containerd's address.
//
// containerd runs in a private mount namespace of its own, which its shims inherit: the
// containers' root file systems and the sandboxes' binds are mounted there, out of the
// machine's mount table (where other tests count mounts), and go when its last process does.
// A test that looks at such a mount from outside does so through /proc/PID/root or nsenter
// with PID().
//
// The binaries are scripts/deps.sh's (Binaries): containerd ContainerdVersion, ctr and the
// runc shim in ${KVFS_CACHE:-/var/cache/kvfs}/bin; runc is Debian's.
//
// containerd starts in a cgroup (v2) of its own, which every process it starts inherits:
// the leak check finds its processes there even once orphaned and renamed, and the next
// Start on the machine kills what a test binary that died before its cleanup left (see
// cgroup.go). With CRI, its network namespace has no name: it goes with the last of the
// containerd's processes, which the cleanup kills.
//
// What leaks is whatever the containerd holds after the test that it did not hold at the
// start: the processes of its cgroup, its shims and their descendants (container processes,
// VMs) and any process naming its directory or a LeakDir, mounts under them (in the test's mount namespace and in
// containerd's), cgroups and runc state in its namespace,
// entries of the LeakDirs, and more of containerd's open descriptors of a kind. CheckNoLeaks
// checks that against a Snapshot during the test (after a series of runs, say); Start's
// cleanup checks it against the start once containerd is stopped, fails the test for each
// leak, and takes back what it found.
package ctrdtest
