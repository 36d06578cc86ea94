package cri

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

// usernsHostID is where the test's user-namespaced pod maps its container ids 0-65535.
const usernsHostID = 100000

// TestCRIUserns: a pod with a user namespace (the CRI's userns_options, mode POD: Kubernetes'
// hostUsers: false) runs beside one without. In the first, container root is root to itself,
// /proc/self/uid_map shows the pod's mapping, a file of the image's root is root's and
// readable as the image says, /etc/hosts is root's (the CRI's idmapped bind), and what
// container root writes lands on the host owned by the mapped id, in a volume and in the
// container's own root file system; the second's root is the guest's and writes as host
// root. The second pod asks for mode NODE (no user namespace). Modes CONTAINER and TARGET,
// two mappings and a mapping without container id 0 are refused with an error that says so
// and leave nothing. It runs under both sandboxers.
func TestCRIUserns(t *testing.T) {
	for _, sb := range criSandboxers {
		t.Run(sb, func(t *testing.T) { testCRIUserns(t, sb) })
	}
}

func testCRIUserns(t *testing.T, sandboxer string) {
	e := shimtest.Start(t, "", sandboxer)
	before := e.C.Snapshot(t)

	mapping := func(container, host int) []map[string]any {
		return []map[string]any{{"container_id": container, "host_id": host, "length": 65536}}
	}
	userns := func(mode int, uids, gids []map[string]any) map[string]any {
		return map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{
			"userns_options": map[string]any{"mode": mode, "uids": uids, "gids": gids}}}}
	}
	const modePOD, modeCONTAINER, modeNODE, modeTARGET = 0, 1, 2, 3
	dir := t.TempDir()
	// The CRI refuses the first three itself (under the Sandbox API, the shim refuses the
	// modes first); the shim refuses the last.
	for _, tc := range []struct {
		name  string
		linux map[string]any
		want  []string
	}{
		{"container", userns(modeCONTAINER, nil, nil), []string{"user namespace mode", "CONTAINER"}},
		{"target", userns(modeTARGET, nil, nil), []string{"user namespace mode", "TARGET"}},
		{"two", userns(modePOD, append(mapping(0, usernsHostID), mapping(65536, 300000)...), mapping(0, usernsHostID)), []string{"only one uid mapping, but got 2"}},
		{"nozero", userns(modePOD, mapping(1, usernsHostID), mapping(0, usernsHostID)), []string{"the uid mapping 1:100000:65536 does not map container id 0"}},
	} {
		cfg := filepath.Join(dir, tc.name+".json")
		writeJSON(t, cfg, map[string]any{
			"metadata": map[string]any{"name": tc.name, "namespace": "default", "uid": tc.name + "-uid"},
			"linux":    tc.linux,
		})
		r := e.C.RunCrictl(t, "runp", "--runtime", shimtest.CRIHandler, cfg)
		for _, w := range tc.want {
			if r.ExitCode == 0 || !strings.Contains(r.Stderr, w) {
				t.Errorf("a pod with user namespace %s: %+v, want a refusal with %q", tc.name, r, w)
			}
		}
	}
	e.C.CheckNoLeaks(t, before)

	vol := t.TempDir()
	if err := os.Chmod(vol, 0o777); err != nil {
		t.Fatal(err)
	}
	script := `echo "id $(id -u) $(id -g)"
echo "uid_map $(cat /proc/self/uid_map)"
echo "passwd $(stat -c '%u %g %a' /etc/passwd) $(head -c 5 /etc/passwd)"
echo "hosts $(stat -c '%u' /etc/hosts)"
echo made > /vol/$POD
echo made > /made-by-$POD
echo "made $?"
exec sleep 600`
	ids := map[string]string{}
	for _, pc := range []struct {
		name  string
		linux map[string]any
	}{{"u", userns(modePOD, mapping(0, usernsHostID), mapping(0, usernsHostID))}, {"n", userns(modeNODE, nil, nil)}} {
		var extra map[string]any
		if pc.linux != nil {
			extra = map[string]any{"linux": pc.linux}
		}
		p := runPod(t, e, pc.name, extra)
		id := p.containerWith(t, "c", script, map[string]any{"linux": pc.linux, "envs": []map[string]string{{"key": "POD", "value": pc.name}}},
			map[string]any{"container_path": "/vol", "host_path": vol})
		ids[pc.name] = p.id
		logs := p.waitLog(t, id, "made ")
		want := []string{"id 0 0", "passwd 0 0 644 root:", "hosts 0", "made 0"}
		if pc.name == "u" {
			want = append(want, "uid_map 0 100000 65536")
		} else {
			want = append(want, "uid_map 0 0 4294967295")
		}
		for _, w := range want {
			if !strings.Contains(strings.Join(strings.Fields(logs), " "), w) {
				t.Errorf("pod %s: no %q in the container's log:\n%s", pc.name, w, logs)
			}
		}
	}
	owner := func(p string) int {
		t.Helper()
		st, err := os.Stat(p)
		if err != nil {
			t.Error(err)
			return -1
		}
		return int(st.Sys().(*syscall.Stat_t).Uid)
	}
	for pod, want := range map[string]int{"u": usernsHostID, "n": 0} {
		if got := owner(filepath.Join(vol, pod)); got != want {
			t.Errorf("pod %s: its container root's file in the volume is owned by %d on the host, want %d", pod, got, want)
		}
		made, _ := filepath.Glob(filepath.Join(e.C.Dir(), "root", "io.containerd.snapshotter.v1.overlayfs", "snapshots", "*", "fs", "made-by-"+pod))
		if len(made) != 1 {
			t.Errorf("pod %s: its container root's file in its root file system: %q in the snapshots' upper directories, want one", pod, made)
		} else if got := owner(made[0]); got != want {
			t.Errorf("pod %s: its container root's file in its root file system is owned by %d on the host, want %d", pod, got, want)
		}
	}
	for _, id := range ids {
		e.C.Crictl(t, "stopp", id)
		e.C.Crictl(t, "rmp", id)
	}
	e.C.CheckNoLeaks(t, before)
}
