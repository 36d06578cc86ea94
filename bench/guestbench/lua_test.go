package guestbench

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/fstree"
)

func TestFetchPinned(t *testing.T) {
	body := []byte("the tarball")
	sum := sha256.Sum256(body)
	want := hex.EncodeToString(sum[:])
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if r.URL.Path != "/pool/x.tar.gz" {
			http.NotFound(w, r)
			return
		}
		w.Write(body)
	}))
	defer srv.Close()
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "src")

	got, err := fetchPinned(ctx, dir, srv.URL+"/pool/x.tar.gz", want)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(got); got != filepath.Join(dir, "x.tar.gz") || !bytes.Equal(b, body) {
		t.Fatalf("fetched %s holding %q", got, b)
	}
	// Kept: the second call does not download.
	if _, err := fetchPinned(ctx, dir, srv.URL+"/pool/x.tar.gz", want); err != nil || hits.Load() != 1 {
		t.Fatalf("second fetch: %v, %d requests, want 1", err, hits.Load())
	}
	// A kept file that does not match is an error naming it, and stays for the user to look at.
	if err := os.WriteFile(got, []byte("changed"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := fetchPinned(ctx, dir, srv.URL+"/pool/x.tar.gz", want); err == nil || !strings.Contains(err.Error(), got+": SHA-256") {
		t.Errorf("changed file: %v, want an error naming %s", err, got)
	}
	// A download that does not match is an error, and nothing is kept.
	other := strings.Repeat("0", 64)
	dir2 := filepath.Join(t.TempDir(), "src")
	if _, err := fetchPinned(ctx, dir2, srv.URL+"/pool/x.tar.gz", other); err == nil || !strings.Contains(err.Error(), "as downloaded from") {
		t.Errorf("bad download: %v", err)
	}
	if ents, _ := os.ReadDir(dir2); len(ents) != 0 {
		t.Errorf("bad download left %v", ents)
	}
	if _, err := fetchPinned(ctx, dir2, srv.URL+"/pool/missing.tar.gz", want); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("missing file: %v", err)
	}
}

// tarball writes a gzipped tar of hdrs (a regular file's content is its name) to a file.
func tarball(t *testing.T, hdrs ...*tar.Header) string {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for _, h := range hdrs {
		var body []byte
		if h.Typeflag == tar.TypeReg {
			body = []byte(h.Name)
			h.Size = int64(len(body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	name := filepath.Join(t.TempDir(), "t.tar.gz")
	if err := os.WriteFile(name, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return name
}

func TestUntar(t *testing.T) {
	old := time.Date(2022, 1, 26, 12, 0, 0, 0, time.UTC)
	tb := tarball(t,
		&tar.Header{Name: "top/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: old},
		&tar.Header{Name: "top/src/", Typeflag: tar.TypeDir, Mode: 0o750, ModTime: old},
		&tar.Header{Name: "top/src/a.c", Typeflag: tar.TypeReg, Mode: 0o644, ModTime: old},
		&tar.Header{Name: "top/run.sh", Typeflag: tar.TypeReg, Mode: 0o755, ModTime: old},
	)
	dir := filepath.Join(t.TempDir(), "x")
	if err := untar(tb, dir); err != nil {
		t.Fatal(err)
	}
	for name, mode := range map[string]os.FileMode{"top": 0o755 | os.ModeDir, "top/src": 0o750 | os.ModeDir, "top/src/a.c": 0o644, "top/run.sh": 0o755} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode() != mode || !fi.ModTime().Equal(old) {
			t.Errorf("%s: mode %v, time %v; want %v, %v", name, fi.Mode(), fi.ModTime(), mode, old)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "top/src/a.c")); string(b) != "top/src/a.c" {
		t.Errorf("top/src/a.c holds %q", b)
	}
	if err := untar(tb, dir); err == nil {
		t.Error("unpacked into an existing directory")
	}
	for _, bad := range []*tar.Header{
		{Name: "../evil", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "/etc/evil", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "top/link", Typeflag: tar.TypeSymlink, Linkname: "/etc"},
	} {
		err := untar(tarball(t, bad), filepath.Join(t.TempDir(), "x"))
		if err == nil || !strings.Contains(err.Error(), bad.Name) {
			t.Errorf("%s: %v, want an error naming it", bad.Name, err)
		}
	}
}

// TestLuaBuildsWithTcc builds the pinned Lua source on the host as guest.sh builds it in the
// guest (make -j2 with LuaMake, tcc), checks that the interpreter prints LuaCheckOut, and that
// make clean leaves exactly the unpacked tree, which the guest relies on for a cold next run.
// It downloads the tarball once into the bench image's source cache.
func TestLuaBuildsWithTcc(t *testing.T) {
	cache := filepath.Join(defaultImageDir(), "src")
	if err := os.MkdirAll(cache, 0o755); err != nil {
		cache = filepath.Join(t.TempDir(), "src")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tb, err := luaTarball(ctx, cache)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "luabuild")
	if err := untar(tb, dir); err != nil {
		t.Fatal(err)
	}
	pristine := fstree.List(t, dir)
	top := filepath.Join(dir, LuaTop)
	sh := func(cmd string) {
		t.Helper()
		c := exec.CommandContext(ctx, "sh", "-c", cmd)
		c.Dir = top
		if out, err := c.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", cmd, err, out)
		}
	}
	sh("make -j2 " + LuaMake)
	out, err := exec.CommandContext(ctx, filepath.Join(top, "src", "lua"), "-e", LuaCheck).CombinedOutput()
	if err != nil || strings.TrimSuffix(string(out), "\n") != LuaCheckOut {
		t.Fatalf("lua -e LuaCheck: %v, printed %q, want %q", err, out, LuaCheckOut)
	}
	if _, err := os.Stat(filepath.Join(top, "src", "luac")); err != nil {
		t.Fatal(err)
	}
	objs, _ := filepath.Glob(filepath.Join(top, "src", "*.o"))
	if len(objs) != 34 {
		t.Errorf("%d objects, want 34 (the method text says so)", len(objs))
	}
	sh("make clean")
	fstree.Same(t, "the Lua tree after make clean", fstree.List(t, dir), pristine)
}

func TestSelected(t *testing.T) {
	all, kp := Selected(nil)
	if len(all) != len(Tests) || !kp {
		t.Errorf("no -run: %d tests, killpriv %v", len(all), kp)
	}
	ts, kp := Selected(regexp.MustCompile("^luabuild$"))
	if len(ts) != 1 || ts[0].Name != "luabuild" || kp {
		t.Errorf("-run ^luabuild$: %v, killpriv %v", ts, kp)
	}
	ts, kp = Selected(regexp.MustCompile("build"))
	if names := testNames(ts); !slices.Equal(names, []string{"cbuild", "luabuild"}) || kp {
		t.Errorf("-run build: %v, killpriv %v", names, kp)
	}
	ts, kp = Selected(regexp.MustCompile("^killpriv"))
	if len(ts) != 0 || !kp {
		t.Errorf("-run ^killpriv: %v, killpriv %v", ts, kp)
	}
}

func testNames(ts []Test) []string {
	var out []string
	for _, t := range ts {
		out = append(out, t.Name)
	}
	return out
}

// TestBenchConf sources the configuration in sh, as guest.sh does, and checks that the values
// with quotes and spaces arrive whole.
func TestBenchConf(t *testing.T) {
	cfg := Config{Runs: 3, FioRuntime: 2, FioMiB: 64, MetaFiles: 10, DDMiB: 8, SMP: 2}
	conf := filepath.Join(t.TempDir(), "bench.conf")
	if err := os.WriteFile(conf, []byte(cfg.benchConf([]string{"cbuild", "luabuild"})), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("sh", "-c", `. "$1" && printf '%s|' "$RUNS" "$MOUNTS" "$TESTS" "$BUILD_JOBS" "$LUA_MAKE" "$LUA_CHECK" "$LUA_CHECK_OUT" "$NINEP_OPTS"`, "sh", conf).CombinedOutput()
	if err != nil {
		t.Fatalf("sourcing %s: %v\n%s", conf, err, out)
	}
	want := strings.Join([]string{"3", "kvfsd virtiofsd 9p", "cbuild luabuild", "2", LuaMake, LuaCheck, LuaCheckOut, NinePOptions}, "|") + "|"
	if string(out) != want {
		t.Errorf("sourced:\n%s\nwant\n%s", out, want)
	}
	cfg.BuildJobs = 4
	if !strings.Contains(cfg.benchConf(nil), "BUILD_JOBS='4'\n") {
		t.Errorf("-build-jobs 4 not passed on:\n%s", cfg.benchConf(nil))
	}
}

func TestMainRejectsRun(t *testing.T) {
	for arg, want := range map[string]string{"(": "-run: error parsing regexp", "nothing-matches": `-run "nothing-matches" matches no workload`} {
		var stdout, stderr bytes.Buffer
		if code := Main([]string{"kvfsguestbench", "-run", arg}, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), want) {
			t.Errorf("-run %q: exit %d, stderr %q; want 2 and %q", arg, code, stderr.String(), want)
		}
	}
}
