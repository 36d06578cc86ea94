package cri

import (
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

// TestCRIHostProcesses checks what a CRI pod is on the host: its VM at the oom_score_adj its
// container's resources ask for (the kubelet's value for the pod's QoS class), not the
// shim's, under both sandboxers; and, under the Sandbox API, the pod files the shim writes
// (a container's /etc/hosts, read-write as runc's) on a tmpfs of their own, which a container
// cannot grow past its cap into /run.
func TestCRIHostProcesses(t *testing.T) {
	for _, sb := range criSandboxers {
		t.Run(sb, func(t *testing.T) { testCRIHostProcesses(t, sb) })
	}
}

func testCRIHostProcesses(t *testing.T, sandboxer string) {
	e := shimtest.Start(t, "", sandboxer)
	before := e.C.Snapshot(t)
	p := runPod(t, e, "hp", nil)
	const adj = 700
	c := p.containerWith(t, "c", "head -c 1048576 /dev/zero >> /etc/hosts; echo grow=$?; sync; echo size=$(wc -c < /etc/hosts); exec sleep 600",
		map[string]any{"linux": map[string]any{"resources": map[string]any{"oom_score_adj": adj}}})
	logs := p.waitLog(t, c, "size=")
	t.Logf("the container's log:\n%s", logs)

	var inspect struct {
		Info struct {
			Pid int `json:"pid"`
		} `json:"info"`
	}
	if err := json.Unmarshal([]byte(e.C.Crictl(t, "inspect", "-o", "json", c)), &inspect); err != nil || inspect.Info.Pid <= 0 {
		t.Fatalf("crictl inspect %s: pid %d, %v", c, inspect.Info.Pid, err)
	}
	// Every task's pid is the VM's.
	b, err := os.ReadFile("/proc/" + strconv.Itoa(inspect.Info.Pid) + "/oom_score_adj")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(b)); got != strconv.Itoa(adj) {
		t.Errorf("the VM (pid %d) has oom_score_adj %s, want the container's %d", inspect.Info.Pid, got, adj)
	}
	// The host's ENOSPC reaches the writer as ENOSPC, or as EIO when the guest's page cache
	// took the write and its writeback failed: either way the append fails and the file
	// stays within the cap.
	if sandboxer == shimSandboxer {
		_, after, _ := strings.Cut(logs, "size=")
		size, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(after, "\n", 2)[0]))
		if strings.Contains(logs, "grow=0") || err != nil || size > 256<<10 {
			t.Errorf("a container appending 1 MiB to its /etc/hosts under the Sandbox API: want a failed write and at most 256 KiB; its log:\n%s", logs)
		}
	}

	e.C.Crictl(t, "stopp", p.id)
	e.C.Crictl(t, "rmp", p.id)
	e.C.CheckNoLeaks(t, before)
}
