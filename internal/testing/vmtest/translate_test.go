package vmtest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// translateScript is the guest side of TestGuestTranslate: it mounts the share kvfsd exports
// with --translate-uid and --translate-gid, and prints the owners it sees and what its
// changes of owner answer, one TR line each.
const translateScript = `mkdir -p /tr
if ! err=$(mount -t virtiofs kvfs-tr /tr 2>&1); then echo "TR-ERROR mount: $err"; exit 1; fi
echo "TR host-file $(stat -c '%u:%g' /tr/host)"
echo made >/tr/made && echo "TR made $(stat -c '%u:%g' /tr/made)"
chown 7:8 /tr/host && echo "TR chowned $(stat -c '%u:%g' /tr/host)"
if err=$(chown 70000 /tr/made 2>&1); then echo "TR forbidden done"; else echo "TR forbidden refused: $err"; fi
echo TR-END
`

// TestGuestTranslate: through kvfsd with guest ids 0-65535 mapped to host ids 100000-165535
// (users) and 200000-265535 (groups), and guest uids from 65536 forbidden, a real guest sees
// the host's 100005:200005 as 5:5; what guest root creates is the host's 100000:200000; a
// chown to 7:8 in the guest is 100007:200008 on the host; a chown to a forbidden uid fails
// with EPERM and changes nothing.
func TestGuestTranslate(t *testing.T) {
	if os.Getenv("KVFS_SERVER") != "" {
		t.Skip("checks kvfsd's --translate-uid and --translate-gid")
	}
	start := time.Now()
	g := Image(t)
	server := serverBinary(t)
	_, ctlSocket := controlShare(t, server, "translate.sh", []byte(translateScript))
	share := t.TempDir()
	if err := os.Chmod(share, 0o777); err != nil {
		t.Fatal(err)
	}
	host := filepath.Join(share, "host")
	if err := os.WriteFile(host, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(host, 100005, 200005); err != nil {
		t.Fatal(err)
	}
	socket, _ := StartServer(t, server, "--shared-dir="+share, "--translate-uid=map:0:100000:65536", "--translate-uid=forbid-guest:65536:4294901759",
		"--translate-gid=map:0:200000:65536")
	extra := []string{"-chardev", fmt.Sprintf("socket,id=tr,path=%s", qemuEscape(socket)),
		"-device", "vhost-user-fs-pci,chardev=tr,tag=kvfs-tr"}

	res, err := Boot(t.Context(), g, Options{Socket: ctlSocket, Run: "translate.sh", Timeout: 3 * time.Minute, ExtraArgs: extra})
	checkBoot(t, res, err, start)
	if res.ExitStatus != 0 || !strings.Contains(res.Console, "TR-END") {
		t.Fatalf("translate.sh did not finish (exit status %d)", res.ExitStatus)
	}
	for _, want := range []string{"TR host-file 5:5", "TR made 0:0", "TR chowned 7:8", "TR forbidden refused: chown: /tr/made: Operation not permitted"} {
		if !strings.Contains(res.Console, want) {
			t.Errorf("the guest's console has no %q", want)
		}
	}
	for name, want := range map[string][2]uint32{"host": {100007, 200008}, "made": {100000, 200000}} {
		fi, err := os.Lstat(filepath.Join(share, name))
		if err != nil {
			t.Error(err)
			continue
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != want[0] || st.Gid != want[1] {
			t.Errorf("%s on the host: %d:%d, want %d:%d", name, st.Uid, st.Gid, want[0], want[1])
		}
	}
}
