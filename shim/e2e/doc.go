// Package e2e tests containerd-shim-kvfs-v2 as users run it: a real containerd v2.4 (a private
// instance per test, internal/testing/ctrdtest), ctr and the containerd Go client, the busybox test
// image, and each pod a real QEMU VM (TCG here) booted from the agent guest image, whose
// containers run under crun in the guest with their root file systems served by the pod's
// kvfsd. Package cri below runs pods through containerd's CRI with crictl, in a test binary of
// its own so that both run at once. Both use the harness in internal/testing/shimtest (Env,
// Start, Main); here are only tests.
package e2e
