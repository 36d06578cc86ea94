// Package ctrdtest runs a private containerd (package ctrd, which says what it is and how it
// is kept apart) for a test, with ctr to drive it, the busybox test image, and a check that
// nothing it ran outlives what the test meant it to. Where ctrd returns an error, ctrdtest
// fails the test.
//
//	c := ctrdtest.Start(t, ctrd.Options{ShimDirs: []string{dirOfTheKvfsShim}})
//	image := ctrdtest.ImportBusybox(t, c)
//	cfg := filepath.Join(c.Dir(), "kvfs.toml") // a runtime config with base_dir = c.SandboxBaseDir()
//	before := c.Snapshot(t)
//	r := c.RunCtr(t, "run", "--rm", "--runtime", "io.containerd.kvfs.v2",
//		"--runtime-config-path", cfg, image, "t1", "echo", "hello")
//	// r.Stdout == "hello\n", r.ExitCode == 0
//	c.CheckNoLeaks(t, before)
//
// CheckNoLeaks fails the test for each leak (ctrd.Containerd.Leaks) against a Snapshot taken
// during the test (after a series of runs, say); Start's cleanup stops the containerd
// (ctrd.Containerd.Stop), fails the test for each leak against the start, and takes back what
// it found.
package ctrdtest
