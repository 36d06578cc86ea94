package vmtest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// readOnlyScript is the guest side of TestGuestReadOnly: it mounts the share that kvfsd
// exports with --readonly, reads it, and tries every kind of change, one RO line each.
const readOnlyScript = `mkdir -p /ro
if ! err=$(mount -t virtiofs kvfs-ro /ro 2>&1); then echo "RO-ERROR mount: $err"; exit 1; fi
try() { what=$1; shift; if err=$("$@" 2>&1); then echo "RO $what done"; else echo "RO $what refused: $err"; fi; }
echo "RO read $(cat /ro/f)"
try create sh -c 'echo x >/ro/new'
try append sh -c 'echo x >>/ro/f'
try truncate sh -c ': >/ro/f'
try mkdir mkdir /ro/newdir
try remove rm /ro/f
try rmdir rmdir /ro/d
try rename mv /ro/f /ro/g
try chmod chmod 600 /ro/f
try symlink ln -s f /ro/link
echo RO-END
`

// TestGuestReadOnly: a guest's mount of a share kvfsd exports with --readonly reads the
// host's files, and every change it tries fails with EROFS ("Read-only file system") and
// leaves the host's directory as it was.
func TestGuestReadOnly(t *testing.T) {
	if os.Getenv("KVFS_SERVER") != "" {
		t.Skip("checks kvfsd's --readonly")
	}
	start := time.Now()
	g := Image(t)
	server := serverBinary(t)
	_, ctlSocket := controlShare(t, server, "readonly.sh", []byte(readOnlyScript))
	share := t.TempDir()
	if err := os.WriteFile(filepath.Join(share, "f"), []byte("host-data\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(share, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	roSocket, _ := StartServer(t, server, "--shared-dir="+share, "--readonly")
	extra := []string{"-chardev", fmt.Sprintf("socket,id=ro,path=%s", qemuEscape(roSocket)),
		"-device", "vhost-user-fs-pci,chardev=ro,tag=kvfs-ro"}

	res, err := Boot(t.Context(), g, Options{Socket: ctlSocket, Run: "readonly.sh", Timeout: 3 * time.Minute, ExtraArgs: extra})
	checkBoot(t, res, err, start)
	if res.ExitStatus != 0 || !strings.Contains(res.Console, "RO-END") {
		t.Fatalf("readonly.sh did not finish (exit status %d)", res.ExitStatus)
	}
	if !strings.Contains(res.Console, "RO read host-data") {
		t.Errorf("the guest did not read the host's file")
	}
	for _, what := range []string{"create", "append", "truncate", "mkdir", "remove", "rmdir", "rename", "chmod", "symlink"} {
		line := "RO " + what + " refused: "
		i := strings.Index(res.Console, line)
		if i < 0 || !strings.Contains(res.Console[i:min(len(res.Console), i+200)], "Read-only file system") {
			t.Errorf("%s: not refused with EROFS", what)
		}
	}
	ents, err := os.ReadDir(share)
	if b, _ := os.ReadFile(filepath.Join(share, "f")); err != nil || len(ents) != 2 || string(b) != "host-data\n" {
		t.Errorf("the host's directory changed: %v, f %q", ents, b)
	}
	if fi, err := os.Stat(filepath.Join(share, "f")); err != nil || fi.Mode().Perm() != 0o644 {
		t.Errorf("f's mode on the host: %v, %v", fi, err)
	}
}
