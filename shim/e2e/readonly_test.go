package e2e

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

// tryScript defines try for sh -c: `try WHAT CMD ARGS...` runs CMD and prints "WHAT: done" or
// "WHAT: refused: ITS ERROR".
const tryScript = `try() { what=$1; shift; if err=$("$@" 2>&1); then echo "$what: done"; else echo "$what: refused: $err"; fi; }
`

// outcomes parses try's lines: what each try did, "done" or the error it printed.
func outcomes(stdout string) map[string]string {
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
		what, result, ok := strings.Cut(line, ": ")
		if !ok {
			continue
		}
		got[what] = strings.TrimPrefix(result, "refused: ")
	}
	return got
}

// wantOutcomes checks that each try in want was done (want "done") or refused with an error
// containing want.
func wantOutcomes(t *testing.T, r string, want map[string]string) {
	t.Helper()
	got := outcomes(r)
	for what, w := range want {
		switch g, ok := got[what]; {
		case !ok:
			t.Errorf("%s: not tried; the container's output:\n%s", what, r)
		case w == "done" && g != "done", w != "done" && (g == "done" || !strings.Contains(g, w)):
			t.Errorf("%s: %q, want %q", what, g, w)
		}
	}
}

const erofs = "Read-only file system"

// TestReadOnlyRoot: `ctr run --read-only`. The root is bound read-only on the host, so a write
// to it fails in the guest, and still fails once root in the container (privileged) has made
// its root read-write again: the host's bind refuses it (kvfsd answers EROFS). The mount point
// of a volume the image lacks was made on the host beforehand (crun in the guest cannot), and
// the volume is writable. The container's snapshot on the host holds nothing but mount points.
func TestReadOnlyRoot(t *testing.T) {
	e := newEnv(t, "")
	vol := t.TempDir()
	script := tryScript + `try create sh -c 'echo x >/from-guest'
try mkdir mkdir /dir-from-guest
try remove rm /bin/ls
try chmod chmod 700 /bin
try remount mount -o remount,bind,rw /
try create-rw sh -c 'echo x >/from-guest'
try mkdir-rw mkdir /dir-from-guest
try remove-rw rm /bin/ls
try chmod-rw chmod 700 /bin
try volume sh -c 'echo vol >/data/in/from-guest'
`
	r := run(t, e, []string{"--read-only", "--privileged", "--mount", "type=bind,src=" + vol + ",dst=/data/in,options=rbind:rw"}, "ro-root", "sh", "-c", script)
	if r.ExitCode != 0 {
		t.Fatalf("ctr run --read-only: exit %d, stdout %q, stderr %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	t.Logf("the container's tries:\n%s", r.Stdout)
	wantOutcomes(t, r.Stdout, map[string]string{
		"create": erofs, "mkdir": erofs, "remove": erofs, "chmod": erofs,
		"remount":   "done",
		"create-rw": erofs, "mkdir-rw": erofs, "remove-rw": erofs, "chmod-rw": erofs,
		"volume": "done",
	})
	if b, err := os.ReadFile(filepath.Join(vol, "from-guest")); err != nil || string(b) != "vol\n" {
		t.Errorf("the volume's file on the host: %q, %v", b, err)
	}

	// The container's own snapshot (its overlayfs upper directory) holds only mount points:
	// the spec's mount destinations and their parents, empty.
	allowed := map[string]bool{}
	var info struct {
		Spec struct {
			Mounts []struct {
				Destination string `json:"destination"`
			} `json:"mounts"`
		}
	}
	if err := json.Unmarshal([]byte(e.C.Ctr(t, "container", "info", "ro-root")), &info); err != nil {
		t.Fatal(err)
	}
	for _, m := range info.Spec.Mounts {
		for p := path.Clean(m.Destination); p != "/"; p = path.Dir(p) {
			allowed[p] = true
		}
	}
	upper := upperDir(t, e, "ro-root")
	err := filepath.WalkDir(upper, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == upper {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		rel := "/" + strings.TrimPrefix(p, upper+"/")
		if !allowed[rel] || !fi.IsDir() && !(fi.Mode().IsRegular() && fi.Size() == 0) {
			t.Errorf("the read-only container's snapshot holds %s (%v), not an empty mount point", rel, fi.Mode())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !t.Failed() {
		t.Logf("the snapshot's upper directory: only mount points")
	}
	e.C.Ctr(t, "container", "rm", "ro-root")
}

// upperDir is the overlayfs upper directory of container id's snapshot.
func upperDir(t *testing.T, e *shimtest.Env, id string) string {
	t.Helper()
	out := e.C.Ctr(t, "snapshots", "mounts", "/mnt", id)
	m := regexp.MustCompile(`upperdir=([^,\s]+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("ctr snapshots mounts %s: no upperdir in %q", id, out)
	}
	return m[1]
}

// TestReadOnlyBinds: a bind mount with rro is read-only on the host, every mount of it: the
// guest's tries to create, modify and remove files fail, in the bind and in a tmpfs mounted
// inside its source, and still fail once root in the container (privileged) has remounted
// them read-write; the host's directories are unchanged. With ro, only the bind's own mount
// is read-only, on the host and in the guest, as runc makes it: the tmpfs inside takes the
// guest's writes (the agent mounts it, a virtio-fs submount, before runc binds the volume, so
// that the bind carries it with its own flags).
func TestReadOnlyBinds(t *testing.T) {
	e := newEnv(t, "")
	// The host's directories, each with a tmpfs inside, mounted in the containerd's mount
	// namespace (where its shims bind the volumes).
	dirs := map[string]string{"rro": t.TempDir(), "ro": t.TempDir()}
	for _, d := range dirs {
		e.InMountNS(t, "sh", "-c", fmt.Sprintf(`set -e; cd %s; mkdir sub; mount -t tmpfs -o size=1m kvfs-e2e sub
for x in . sub; do for f in keep gone gone-rw; do echo host >$x/$f; done; done`, d))
	}
	script := tryScript + `for d in /rro /rro/sub /ro /ro/sub; do
	try "$d create" sh -c "echo x >$d/new"
	try "$d modify" sh -c "echo x >>$d/keep"
	try "$d remove" rm $d/gone
done
for d in /rro /rro/sub /ro /ro/sub; do
	try "$d remount" mount -o remount,bind,rw $d
	try "$d create-rw" sh -c "echo x >$d/new-rw"
	try "$d modify-rw" sh -c "echo x >>$d/keep"
	try "$d remove-rw" rm $d/gone-rw
done
`
	r := run(t, e, []string{"--rm", "--privileged",
		"--mount", "type=bind,src=" + dirs["rro"] + ",dst=/rro,options=rbind:rro",
		"--mount", "type=bind,src=" + dirs["ro"] + ",dst=/ro,options=rbind:ro"}, "ro-binds", "sh", "-c", script)
	if r.ExitCode != 0 {
		t.Fatalf("ctr run: exit %d, stdout %q, stderr %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	t.Logf("the container's tries:\n%s", r.Stdout)
	want := map[string]string{}
	for _, d := range []string{"/rro", "/rro/sub", "/ro", "/ro/sub"} {
		want[d+" remount"] = "done"
		for _, op := range []string{"create", "modify", "remove"} {
			want[d+" "+op] = erofs
			want[d+" "+op+"-rw"] = erofs
			if d == "/ro/sub" {
				want[d+" "+op] = "done"
				want[d+" "+op+"-rw"] = "done"
			}
		}
	}
	wantOutcomes(t, r.Stdout, want)

	// On the host (through the containerd's mount namespace, where the tmpfs is).
	root := fmt.Sprintf("/proc/%d/root", e.C.PID())
	untouched := "gone=host\ngone-rw=host\nkeep=host\n"
	for d, want := range map[string]string{
		dirs["rro"]:                       untouched + "sub/\n",
		filepath.Join(dirs["rro"], "sub"): untouched,
		dirs["ro"]:                        untouched + "sub/\n",
		filepath.Join(dirs["ro"], "sub"):  "keep=host\nx\nx\nnew=x\nnew-rw=x\n", // ro's submount: the guest's changes
	} {
		if got := listing(t, filepath.Join(root, d)); got != want {
			t.Errorf("%s on the host: %q, want %q", d, got, want)
		}
	}
}

// listing lists the entries of dir, each regular file's with its content after "=", a
// directory's with a "/".
func listing(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, ent := range ents {
		if ent.IsDir() {
			fmt.Fprintf(&b, "%s/\n", ent.Name())
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, ent.Name()))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "%s=%s", ent.Name(), data)
	}
	return b.String()
}
