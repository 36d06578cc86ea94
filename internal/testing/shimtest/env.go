// Package shimtest is the harness of the kvfs shim's end-to-end tests (shim/e2e and
// shim/e2e/cri): the binaries under test built once per test binary (Main), and a private
// containerd per test (Env) with the kvfs shim first on its PATH, the busybox image imported
// and, for CRI tests, the runtime handler kvfs with a CNI network.
package shimtest

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/shim"
)

// RuntimeType is what ctr and containerd's runtime classes name the kvfs shim by.
const RuntimeType = "io.containerd.kvfs.v2"

// CRIHandler is the CRI runtime handler of the kvfs shim in the tests' containerd (crictl
// runp --runtime kvfs), as packaging's containerd drop-in names it.
const CRIHandler = "kvfs"

// BinDir holds the binaries under test, built once by Main: containerd-shim-kvfs-v2
// (containerd finds it on its PATH), kvfsd (an external server) and kvfsctl.
var BinDir string

// Main is the TestMain of a package of these tests: it builds the binaries into BinDir (not
// with -short, which skips every test that would use them), runs the tests and removes them.
func Main(m *testing.M) int {
	flag.Parse()
	if testing.Short() {
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "kvfs-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if err := build(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	BinDir = dir
	return m.Run()
}

func build(dir string) error {
	root, err := vmtest.RepoRoot()
	if err != nil {
		return err
	}
	cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/containerd-shim-kvfs-v2", "./cmd/kvfsd", "./cmd/kvfsctl")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %v\n%s", err, out)
	}
	for _, b := range []string{"containerd-shim-kvfs-v2", "kvfsd", "kvfsctl"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return err
		}
	}
	return nil
}

// Env is a private containerd with the kvfs shim first on its PATH, the busybox image
// imported, and a kvfs configuration whose sandboxes live in a directory of the test's own.
type Env struct {
	C       *ctrdtest.Containerd
	Image   string
	Config  string // the kvfs configuration (--runtime-config-path)
	BaseDir string // where its sandboxes are made
}

// Start starts the containerd for the test. extra is TOML added at the top of the kvfs
// configuration (before its [vm] table). With a CRI sandboxer ("podsandbox" or "shim"), the
// containerd's CRI is on, with the runtime handler CRIHandler for the kvfs shim, this
// configuration and that sandboxer, and the image is imported for it.
func Start(t *testing.T, extra, sandboxer string) *Env {
	t.Helper()
	return StartWith(t, extra, sandboxer, nil)
}

// StartWith is Start with drop-ins of containerd's config (ctrd.Options.Imports): a CRI
// runtime handler's base_runtime_spec, say.
func StartWith(t *testing.T, extra, sandboxer string, imports []string) *Env {
	t.Helper()
	return start(t, extra, "", sandboxer, imports)
}

// StartQEMU is Start (without CRI) with the pods' VMs run by the QEMU binary qemu
// (vm.qemu).
func StartQEMU(t *testing.T, qemu string) *Env {
	t.Helper()
	return start(t, "", qemu, "", nil)
}

func start(t *testing.T, extra, qemu, sandboxer string, imports []string) *Env {
	t.Helper()
	if testing.Short() {
		t.Skip("boots VMs under QEMU (-short)")
	}
	g := vmtest.AgentImage(t)
	accel, why := vmtest.Accel(context.Background(), vmtest.Image(t))
	t.Logf("accelerator %s: %s", accel, why)
	// Short: a CRI pod's id is 64 characters, and its sandbox's sockets must fit in the 107
	// bytes of a Unix socket address.
	dir, err := os.MkdirTemp("/tmp", "kvfs-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	e := &Env{Config: filepath.Join(dir, "configuration.toml"), BaseDir: filepath.Join(dir, "sb")}
	// kvfs.debug=1: the agent logs every request on the guest's console, which a failed test
	// prints.
	cfg := fmt.Sprintf("base_dir = %q\n%s\n[vm]\nkernel = %q\nrootfs = %q\ninitrd = %q\naccel = %q\nmemory = \"512M\"\nkernel_params = \"kvfs.debug=1\"\n",
		e.BaseDir, extra, g.Kernel, g.Root, g.Initrd, accel)
	if qemu != "" {
		cfg += fmt.Sprintf("qemu = %q\n", qemu)
	}
	if err := os.WriteFile(e.Config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	// Registered before Start, so it runs after the containerd's own cleanup (its leak check).
	t.Cleanup(func() { checkBaseDirEmpty(t, e.BaseDir) })
	opts := ctrd.Options{ShimDirs: []string{BinDir}, LeakDirs: []string{e.BaseDir}, Imports: imports}
	cri := sandboxer != ""
	if cri {
		// The handler has no options, as the installed one: the shims find the
		// configuration by $KVFS_CONFIG_FILE, which they inherit from the containerd.
		opts.CRI = true
		opts.Config = ctrdconf.KvfsRuntime(CRIHandler, "", sandboxer)
		opts.Env = append(opts.Env, shim.ConfigFileEnv+"="+e.Config)
	}
	e.C = ctrdtest.Start(t, opts)
	// Registered after Start, so it runs before the containerd's cleanup stops the pods.
	t.Cleanup(func() {
		if t.Failed() {
			PrintConsoles(t, e.BaseDir)
		}
	})
	if cri {
		e.Image = ctrdtest.ImportImage(t, e.C, "localhost/busybox:cri")
	} else {
		e.Image = ctrdtest.ImportBusybox(t, e.C)
	}
	return e
}

// InMountNS runs a command in the containerd's mount namespace, where its shims bind the
// containers' volumes: a mount the test makes inside a volume must be made there.
func (e *Env) InMountNS(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.Command("nsenter", append([]string{"--target", fmt.Sprint(e.C.PID()), "--mount", "--"}, args...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nsenter %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// PrintConsoles logs the guest console of every pod still in dir.
func PrintConsoles(t *testing.T, dir string) {
	logs, _ := filepath.Glob(filepath.Join(dir, "*", "console.log"))
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		t.Logf("%s:\n%s", l, b)
	}
}

// checkBaseDirEmpty fails the test if a sandbox directory outlived the test.
func checkBaseDirEmpty(t *testing.T, dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Error(err)
	}
	for _, ent := range ents {
		t.Errorf("sandbox directory %s left behind", filepath.Join(dir, ent.Name()))
	}
}

// ShellQuote quotes args for sh -c.
func ShellQuote(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}

// Alive are the processes of ps that still run (the same pid and start time, not a zombie).
func Alive(ps []ctrd.Process) []ctrd.Process {
	var out []ctrd.Process
	for _, p := range ps {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.PID))
		if err != nil {
			continue
		}
		f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
		if len(f) > 19 && f[0] != "Z" && f[19] == strconv.FormatUint(p.Start, 10) {
			out = append(out, p)
		}
	}
	return out
}
