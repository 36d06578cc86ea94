package deploy_test

import (
	"bufio"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/fstree"
	"github.com/kvfs/kvfs/packaging/kubernetes/deploy"
)

// bins holds the payload's binaries and kvfs-deploy, statically linked, built by TestMain.
var bins string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "kvfs-deploy-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bins = dir
	cmd := exec.Command("go", "build", "-o", dir+"/", "../../../cmd/containerd-shim-kvfs-v2", "../../../cmd/kvfsd",
		"../../../cmd/kvfsctl", "../cmd/kvfs-deploy")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// payload is the image's PayloadDir on the test's machine: the binaries, a guest image with
// made-up contents (the installer checks only its SHA256SUMS) and install.sh.
func payload(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.Symlink(bins, filepath.Join(dir, "bin")); err != nil {
		t.Fatal(err)
	}
	guest := filepath.Join(dir, "guest")
	if err := os.Mkdir(guest, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"vmlinux", "rootfs.erofs", "image.json"} {
		if err := os.WriteFile(filepath.Join(guest, f), []byte(f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("sh", "-c", "sha256sum vmlinux rootfs.erofs image.json >SHA256SUMS")
	cmd.Dir = guest
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	data, err := os.ReadFile("../../install.sh")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "install.sh"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// hostRoot is a scratch host root with a file of the host's own in /etc.
func hostRoot(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/hostname"), []byte("node-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return root
}

// apiServer is a TLS server that answers node label patches as the API server would, and
// records them; sa is a service account directory for it (token, ca.crt).
type apiServer struct {
	mu      sync.Mutex
	patches []string // "METHOD PATH CONTENT-TYPE AUTHORIZATION BODY"
	sa      string
	env     []string
}

func newAPIServer(t *testing.T) *apiServer {
	t.Helper()
	a := &apiServer{sa: t.TempDir()}
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		a.mu.Lock()
		a.patches = append(a.patches, strings.Join([]string{r.Method, r.URL.Path, r.Header.Get("Content-Type"), r.Header.Get("Authorization"), string(body)}, " "))
		a.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"kind":"Node","apiVersion":"v1"}`)
	}))
	t.Cleanup(srv.Close)
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if err := os.WriteFile(filepath.Join(a.sa, "ca.crt"), ca, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(a.sa, "token"), []byte("tok-123\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	a.env = []string{"KUBERNETES_SERVICE_HOST=" + u.Hostname(), "KUBERNETES_SERVICE_PORT=" + u.Port()}
	return a
}

func (a *apiServer) got() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.patches)
}

const (
	labelPatch   = `PATCH /api/v1/nodes/node-1 application/merge-patch+json Bearer tok-123 {"metadata":{"labels":{"kvfs.io/kvfs-runtime":"true"}}}`
	unlabelPatch = `PATCH /api/v1/nodes/node-1 application/merge-patch+json Bearer tok-123 {"metadata":{"labels":{"kvfs.io/kvfs-runtime":null}}}`
)

func deployCmd(args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(bins, deploy.Command), args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVFS_") && !strings.HasPrefix(kv, "KUBERNETES_") && !strings.HasPrefix(kv, "NODE_NAME=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	return cmd
}

// TestEntrypoint runs kvfs-deploy install as the DaemonSet does, against a scratch host root
// and a TLS API server: the files, the containerd drop-in and the configuration with the
// host's paths, the restart command run, the node labelled with the service account's token;
// then SIGTERM with cleanup on exit: the label removed, the restart command run again, and
// the host root as it was.
func TestEntrypoint(t *testing.T) {
	root := hostRoot(t)
	before := fstree.List(t, root)
	api := newAPIServer(t)
	restarts := filepath.Join(t.TempDir(), "restarts")
	cmd := deployCmd("install", "-host-root", root, "-payload", payload(t), "-service-account", api.sa,
		"-restart", "echo restarted >>"+restarts)
	cmd.Env = append(cmd.Env, api.env...)
	cmd.Env = append(cmd.Env, "NODE_NAME=node-1", "KVFS_CLEANUP_ON_EXIT=true")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	lines := make(chan string, 1000)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	var out []string
	timeout := time.After(2 * time.Minute)
wait:
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("kvfs-deploy install exited before it waited:\n%s", strings.Join(out, "\n"))
			}
			out = append(out, l)
			if l == "kvfs-deploy: waiting for SIGTERM" {
				break wait
			}
		case <-timeout:
			t.Fatalf("kvfs-deploy install did not finish in 2 minutes:\n%s", strings.Join(out, "\n"))
		}
	}
	t.Logf("kvfs-deploy install:\n%s", strings.Join(out, "\n"))

	for _, f := range []string{"opt/kvfs/bin/containerd-shim-kvfs-v2", "opt/kvfs/bin/kvfsd", "opt/kvfs/bin/kvfsctl",
		"opt/kvfs/share/kvfs/guest/vmlinux", "opt/kvfs/share/kvfs/guest/SHA256SUMS", "var/lib/kvfs/install.manifest"} {
		if _, err := os.Stat(filepath.Join(root, f)); err != nil {
			t.Errorf("not installed: %v", err)
		}
	}
	dropin, err := os.ReadFile(filepath.Join(root, "etc/containerd/conf.d/kvfs.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if want := "runtime_path = '/opt/kvfs/bin/containerd-shim-kvfs-v2'"; !strings.Contains(string(dropin), want) {
		t.Errorf("the drop-in has no %q (the host's paths, not the host root's):\n%s", want, dropin)
	}
	// The configuration is the shim's default, /etc/kvfs/configuration.toml on the host: no
	// options, which user-namespaced pods need.
	if strings.Contains(string(dropin), "ConfigPath") {
		t.Errorf("the drop-in names a ConfigPath:\n%s", dropin)
	}
	config, err := os.ReadFile(filepath.Join(root, "etc/kvfs/configuration.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(config), `"/opt/kvfs/share/kvfs/guest/vmlinux"`) {
		t.Errorf("the configuration does not name the installed guest image /opt/kvfs/share/kvfs/guest:\n%s", config)
	}
	if imports, err := os.ReadFile(filepath.Join(root, "etc/containerd/config.toml")); err != nil ||
		!strings.Contains(string(imports), "imports = ['/etc/containerd/conf.d/*.toml']") {
		t.Errorf("containerd's config.toml: %v\n%s", err, imports)
	}
	if got, _ := os.ReadFile(restarts); string(got) != "restarted\n" {
		t.Errorf("the restart command ran: %q, want once", got)
	}
	if got := api.got(); !slices.Equal(got, []string{labelPatch}) {
		t.Errorf("API requests %q, want %q", got, labelPatch)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for l := range lines {
		out = append(out, l)
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("kvfs-deploy after SIGTERM: %v\n%s", err, strings.Join(out, "\n"))
	}
	t.Logf("kvfs-deploy:\n%s", strings.Join(out, "\n"))
	if got, _ := os.ReadFile(restarts); string(got) != "restarted\nrestarted\n" {
		t.Errorf("the restart command ran: %q, want twice", got)
	}
	if got := api.got(); !slices.Equal(got, []string{labelPatch, unlabelPatch}) {
		t.Errorf("API requests %q, want %q", got, []string{labelPatch, unlabelPatch})
	}
	fstree.Same(t, "after SIGTERM with cleanup, compared with before install", fstree.List(t, root), before)
}

// TestEntrypointNotImported: a host whose containerd config.toml does not import the
// drop-in gets the files, but no restart and no label, and the entrypoint fails saying why;
// kvfs-deploy uninstall then leaves the root as it was, config.toml untouched.
func TestEntrypointNotImported(t *testing.T) {
	root := hostRoot(t)
	if err := os.MkdirAll(filepath.Join(root, "etc/containerd"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/containerd/config.toml"), []byte("version = 3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	before := fstree.List(t, root)
	api := newAPIServer(t)
	restarts := filepath.Join(t.TempDir(), "restarts")
	p := payload(t)
	args := []string{"-host-root", root, "-payload", p, "-service-account", api.sa, "-node", "node-1",
		"-restart", "echo restarted >>" + restarts}
	cmd := deployCmd(append([]string{"install"}, args...)...)
	cmd.Env = append(cmd.Env, api.env...)
	out, err := cmd.CombinedOutput()
	t.Logf("kvfs-deploy install:\n%s", out)
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 {
		t.Fatalf("kvfs-deploy install: %v, want exit status 1", err)
	}
	if !strings.Contains(string(out), "does not import the kvfs drop-in") || !strings.Contains(string(out), "imports = [\"/etc/containerd/conf.d/*.toml\"]") {
		t.Errorf("the output does not say what to add to config.toml")
	}
	if _, err := os.Stat(filepath.Join(root, "etc/containerd/conf.d/kvfs.toml")); err != nil {
		t.Errorf("the drop-in: %v", err)
	}
	if _, err := os.Stat(restarts); err == nil {
		t.Errorf("the restart command ran")
	}
	if got := api.got(); len(got) != 0 {
		t.Errorf("API requests %q, want none", got)
	}

	cmd = deployCmd(append([]string{"uninstall", "-wait=false"}, args...)...)
	cmd.Env = append(cmd.Env, api.env...)
	out, err = cmd.CombinedOutput()
	t.Logf("kvfs-deploy uninstall:\n%s", out)
	if err != nil {
		t.Fatalf("kvfs-deploy uninstall: %v", err)
	}
	if got := api.got(); !slices.Equal(got, []string{unlabelPatch}) {
		t.Errorf("API requests %q, want %q", got, unlabelPatch)
	}
	fstree.Same(t, "after uninstall, compared with before install", fstree.List(t, root), before)

	// A second uninstall finds nothing to do, and says so.
	cmd = deployCmd(append([]string{"uninstall", "-wait=false"}, args...)...)
	cmd.Env = append(cmd.Env, api.env...)
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "nothing to uninstall") {
		t.Errorf("a second kvfs-deploy uninstall: %v\n%s", err, out)
	}
}
