package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestEnableControllers(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "cgroup.controllers"), []byte("cpuset cpu io memory pids\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := EnableControllers(dir); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control"))
	if err != nil {
		t.Fatal(err)
	}
	if got := string(b); got != "+cpuset +cpu +io +memory +pids" {
		t.Errorf("subtree_control got %q", got)
	}
}

func TestLoadModulesChecksTheList(t *testing.T) {
	dir := t.TempDir()
	list := filepath.Join(dir, "modules")
	if err := LoadModules(list, dir); err != nil {
		t.Errorf("a missing list: %v", err)
	}
	cases := []struct{ content, want string }{
		{"# comment\n\n/abs/virtio.ko\n", "modules:3: \"/abs/virtio.ko\" is not a path below"},
		{"kernel/../../x.ko\n", "modules:1: \"kernel/../../x.ko\" is not a path below"},
		{"kernel/missing.ko\n", "missing.ko: no such file"},
	}
	for _, c := range cases {
		if err := os.WriteFile(list, []byte(c.content), 0o644); err != nil {
			t.Fatal(err)
		}
		err := LoadModules(list, dir)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("list %q: %v, want %q", c.content, err, c.want)
		}
	}
}

func TestFindSerialPort(t *testing.T) {
	sys := t.TempDir()
	for port, name := range map[string]string{"vport0p0": "", "vport1p1": "io.kvfs.agent.0\n", "vport1p2": "org.qemu.guest_agent.0\n"} {
		if err := os.MkdirAll(filepath.Join(sys, port), 0o755); err != nil {
			t.Fatal(err)
		}
		if name != "" {
			if err := os.WriteFile(filepath.Join(sys, port, "name"), []byte(name), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	dev, err := FindSerialPort(sys, "io.kvfs.agent.0")
	if err != nil || dev != "/dev/vport1p1" {
		t.Errorf("FindSerialPort = %q, %v", dev, err)
	}
	if _, err := FindSerialPort(sys, "io.kvfs.agent.1"); err == nil || !strings.Contains(err.Error(), `no virtio-serial port named "io.kvfs.agent.1"`) {
		t.Errorf("a missing port: %v", err)
	}
}
