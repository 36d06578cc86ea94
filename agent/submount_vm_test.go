package agent_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/sandbox"
)

// submountCycles is how many short-lived containers TestAgentSubmountExits runs.
const submountCycles = 8

// TestAgentSubmountExits runs containers whose root and volume are submounts of the share
// (host binds, as every container's are) and which exit right after reading part of a large
// file on the volume and writing another. Each must report its exit, and the guest's kernel
// must not stop on "Busy inodes after unmount": the agent holds the submounts in its own mount
// namespace while the container lives, so the container's exit never tears a superblock down
// (see agent/submounts.go; containers without the pins did not hit the kernel's race here in
// 16 rounds, so it is the pins themselves that this test checks). A container sharing the
// agent's PID namespace reads the agent's mounts: the submounts are there while a container
// uses them, and gone once the last one is deleted.
func TestAgentSubmountExits(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (mounts, QEMU)")
	}
	if testing.Short() {
		t.Skip("boots a guest under QEMU (skipped with -short)")
	}
	g := vmtest.AgentImage(t)
	ctx := context.Background()
	s := newSandbox(t, "submounts", func(c *sandbox.Config) { c.VM.VCPUs = 2 }) // the kernel's race needs a second CPU
	vol := t.TempDir()
	big := make([]byte, 8<<20)
	rand.Read(big)
	if err := os.WriteFile(filepath.Join(vol, "big"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	for name, dir := range map[string]string{"reader": busyboxRoot(t), "checker": busyboxRoot(t), "vol": vol} {
		if err := s.Bind(dir, name, 0); err != nil {
			t.Fatal(err)
		}
	}
	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Root = testAccel(t), g.Kernel, g.Initrd, g.Root
	ag, diag := bootAgent(t, s, vm)

	// run creates container id on root with args, starts it, and returns its output and exit
	// status once it has exited; keep leaves it running.
	run := func(id, root string, spec func(*specs.Spec), keep bool, args ...string) (string, uint32) {
		t.Helper()
		rctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		var sp specs.Spec
		if err := json.Unmarshal(specJSON(t, id, args...), &sp); err != nil {
			t.Fatal(err)
		}
		sp.Root.Path = apiv1.SharedDir + "/" + root
		if spec != nil {
			spec(&sp)
		}
		b, err := json.Marshal(&sp)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ag.CreateContainer(rctx, &apiv1.CreateContainerRequest{ContainerId: id, Spec: b, Stdio: &apiv1.Stdio{Stdout: true}}); err != nil {
			t.Fatalf("create %s: %v\n%s", id, err, diag())
		}
		if _, err := ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: id}); err != nil {
			t.Fatalf("start %s: %v\n%s", id, err, diag())
		}
		if keep {
			return "", 0
		}
		out := readAll(t, rctx, ag.ReadStdout, id, "")
		w, err := ag.WaitProcess(rctx, &apiv1.WaitProcessRequest{ContainerId: id})
		if err != nil {
			t.Fatalf("wait %s: %v\n%s", id, err, diag())
		}
		if _, err := ag.DeleteProcess(rctx, &apiv1.DeleteProcessRequest{ContainerId: id}); err != nil {
			t.Fatalf("delete %s: %v\n%s", id, err, diag())
		}
		return out, w.ExitStatus
	}
	// agentMounts counts the agent's mounts of the share's name, as a container in the
	// agent's PID namespace sees them.
	check := 0
	agentMounts := func(name string) int {
		t.Helper()
		check++
		inAgentPID := func(sp *specs.Spec) {
			var ns []specs.LinuxNamespace
			for _, n := range sp.Linux.Namespaces {
				if n.Type != specs.PIDNamespace {
					ns = append(ns, n)
				}
			}
			sp.Linux.Namespaces = ns
		}
		out, status := run(fmt.Sprintf("check%d", check), "checker", inAgentPID, false,
			"sh", "-c", "cut -d' ' -f5 /proc/1/mountinfo | grep -cx "+apiv1.SharedDir+"/"+name+"; true")
		if status != 0 {
			t.Fatalf("the checker exited with %d: %q", status, out)
		}
		n := 0
		fmt.Sscan(out, &n)
		return n
	}

	withVol := func(sp *specs.Spec) {
		sp.Mounts = append(sp.Mounts, specs.Mount{Destination: "/vol", Type: "bind", Source: apiv1.SharedDir + "/vol", Options: []string{"rbind", "rw"}})
	}
	for i := range submountCycles {
		id := fmt.Sprintf("r%d", i)
		if out, status := run(id, "reader", withVol, false, "sh", "-c", "head -c 300000 /vol/big | wc -c; echo "+id+" > /vol/out"); status != 0 || strings.TrimSpace(out) != "300000" {
			t.Fatalf("%s: exit %d, output %q\n%s", id, status, out, diag())
		}
	}
	for _, name := range []string{"reader", "vol"} {
		if n := agentMounts(name); n != 0 {
			t.Errorf("the agent holds %d mounts of %s after its containers were deleted, want 0", n, name)
		}
	}
	run("holder", "reader", withVol, true, "sleep", "600")
	for _, name := range []string{"reader", "vol"} {
		if n := agentMounts(name); n != 1 {
			t.Errorf("the agent holds %d mounts of %s while a container uses it, want 1", n, name)
		}
	}
	console, _ := os.ReadFile(s.ConsolePath())
	if strings.Contains(string(console), "Busy inodes") || strings.Contains(string(console), "kernel BUG") {
		t.Errorf("the guest's kernel stopped on a submount's teardown:\n%s", console)
	}
}
