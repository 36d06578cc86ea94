package agent

import (
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// TestSetSysctls writes sysctls into a stand-in for /proc/sys: by dotted and by slashed name,
// and refuses, before writing anything, a request with one bad name or value; a sysctl the
// kernel lacks is NotFound; a symlink in the tree does not lead out of it.
func TestSetSysctls(t *testing.T) {
	fx := newFixture(t)
	dir := t.TempDir()
	fx.svc.cfg.SysctlDir = dir
	files := map[string]string{"kernel/shm_rmid_forced": "0\n", "fs/mqueue/msg_max": "10\n", "net/ipv4/conf/eth0.100/rp_filter": "1\n"}
	for p, v := range files {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, p), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	outside := filepath.Join(t.TempDir(), "outside")
	os.WriteFile(outside, []byte("untouched"), 0o644)
	os.Symlink(outside, filepath.Join(dir, "kernel", "escape"))
	read := func(p string) string {
		b, _ := os.ReadFile(filepath.Join(dir, p))
		return string(b)
	}

	_, err := fx.svc.SetSysctls(fx.ctx, &apiv1.SetSysctlsRequest{Sysctls: map[string]string{
		"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100", "net/ipv4/conf/eth0.100/rp_filter": "2"}})
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{"kernel/shm_rmid_forced": "1", "fs/mqueue/msg_max": "100", "net/ipv4/conf/eth0.100/rp_filter": "2"} {
		if got := read(p); got != want {
			t.Errorf("%s = %q, want %q", p, got, want)
		}
	}

	for _, bad := range []map[string]string{
		{"kernel.shm_rmid_forced": "0", "kernel..x": "1"},
		{"kernel.shm_rmid_forced": "0", "net/ipv4/../../x": "1"},
		{"kernel.shm_rmid_forced": "0", "kernel.x y": "1"},
		{"kernel.shm_rmid_forced": "0", "fs.mqueue.msg_max": "1\n2"},
	} {
		_, err := fx.svc.SetSysctls(fx.ctx, &apiv1.SetSysctlsRequest{Sysctls: bad})
		wantCode(t, "a bad sysctl", err, codes.InvalidArgument, "sysctl")
		if got := read("kernel/shm_rmid_forced"); got != "1" {
			t.Errorf("a refused request wrote kernel.shm_rmid_forced = %q", got)
		}
	}
	_, err = fx.svc.SetSysctls(fx.ctx, &apiv1.SetSysctlsRequest{Sysctls: map[string]string{"kernel.nope": "1"}})
	wantCode(t, "an unknown sysctl", err, codes.NotFound, "kernel.nope")
	_, err = fx.svc.SetSysctls(fx.ctx, &apiv1.SetSysctlsRequest{Sysctls: map[string]string{"kernel.escape": "1"}})
	if err == nil {
		t.Error("a symlink out of the sysctl tree was written through")
	}
	if b, _ := os.ReadFile(outside); string(b) != "untouched" {
		t.Errorf("the file outside the tree is %q", b)
	}
}
