package vmtest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/guestimage"
)

// Guest is a bootable guest: a kernel and its root, an initramfs (the test guests: /init is
// packaging/guest/init) or the agent image's erofs image (sandbox.VM.Root: /init is
// kvfs-agent). One of Initrd and Root is empty.
type Guest struct {
	Kernel string
	Initrd string
	Root   string
}

// DefaultCacheDir is where Image keeps the guest unless $KVFS_CACHE says
// otherwise. It outlives test runs so that the kernel is downloaded once.
const DefaultCacheDir = "/var/cache/kvfs/guest"

// DefaultAgentCacheDir is where AgentImage keeps the agent's guest unless
// $KVFS_CACHE says otherwise.
const DefaultAgentCacheDir = "/var/cache/kvfs/agent-guest"

// DefaultFaultsCacheDir is where FaultsAgentImage keeps its guest unless
// $KVFS_CACHE says otherwise.
const DefaultFaultsCacheDir = "/var/cache/kvfs/agent-guest-faults"

// imageMu serialises builds within one test binary; build.sh itself takes a
// lock for builds from several test binaries at once.
var imageMu sync.Mutex

// Image returns the test guest, building it with packaging/guest/build.sh
// when the cached build is missing or older than its inputs. A guest that
// cannot be built fails the test with the build's output: these tests are
// meant to run in CI, so they never skip.
func Image(t testing.TB) Guest {
	t.Helper()
	return build(t, cacheDir())
}

// AgentImage returns the pod VM's guest, whose /init is kvfs-agent: built with
// "packaging/guest/build.sh --agent" into $KVFS_CACHE/agent-guest (default
// /var/cache/kvfs/agent-guest), rebuilt when the agent, runc or the script
// changed. Like Image, it fails the test when the guest cannot be built.
func AgentImage(t testing.TB) Guest {
	t.Helper()
	return build(t, agentCacheDir(), "--agent")
}

// FaultsAgentImage returns the pod VM's guest with an agent built with the
// kvfsfaults tag, whose fault modes kvfs.fault= on the kernel command line
// chooses (agent/fault.go): built with "packaging/guest/build.sh --agent-faults"
// into $KVFS_CACHE/agent-guest-faults (default
// /var/cache/kvfs/agent-guest-faults), with the kernel AgentImage's build made
// and reusing the runtime packages it downloaded. Only tests build it; nothing ships it. Like Image, it fails the
// test when the guest cannot be built.
func FaultsAgentImage(t testing.TB) Guest {
	t.Helper()
	dir := faultsCacheDir()
	linkRuntimeDebs(t, dir)
	return build(t, dir, "--agent-faults")
}

// linkRuntimeDebs links the container runtime's packages AgentImage downloaded (crun and
// its libraries, trixie's) into dir/runtime-debs, when dir has none, so that a build there
// downloads only on a machine without them.
func linkRuntimeDebs(t testing.TB, dir string) {
	t.Helper()
	if have, _ := filepath.Glob(filepath.Join(dir, "runtime-debs", "*.deb")); len(have) > 0 {
		return
	}
	if err := os.MkdirAll(filepath.Join(dir, "runtime-debs"), 0o755); err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	debs, _ := filepath.Glob(filepath.Join(agentCacheDir(), "runtime-debs", "*.deb"))
	for _, d := range debs {
		dest := filepath.Join(dir, "runtime-debs", filepath.Base(d))
		if _, err := os.Lstat(dest); err == nil {
			continue
		}
		if err := os.Link(d, dest); err != nil {
			t.Logf("vmtest: not reusing %s: %v", d, err)
		}
	}
}

// BuildAgentImage builds the pod VM's guest afresh into dir, an empty directory, with env
// added to build.sh's environment (SOURCE_DATE_EPOCH, KVFS_VERSION). The runtime packages
// AgentImage downloaded are linked into dir/runtime-debs first, so that only a machine
// without them downloads; the kernel is the one AgentImage's build made.
func BuildAgentImage(t testing.TB, dir string, env ...string) Guest {
	t.Helper()
	linkRuntimeDebs(t, dir)
	return buildEnv(t, dir, env, "--agent")
}

func build(t testing.TB, dir string, flags ...string) Guest {
	t.Helper()
	return buildEnv(t, dir, nil, flags...)
}

func buildEnv(t testing.TB, dir string, env []string, flags ...string) Guest {
	t.Helper()
	imageMu.Lock()
	defer imageMu.Unlock()

	root, err := RepoRoot()
	if err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	script := filepath.Join(root, "packaging", "guest", "build.sh")
	args := append(append([]string{script}, flags...), dir)
	start := time.Now()
	cmd := exec.Command("bash", args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("vmtest: building the guest image failed (bash %s): %v\n%s", strings.Join(args, " "), err, out)
	}
	g := Guest{Kernel: filepath.Join(dir, guestimage.KernelFile)}
	g.Root, g.Initrd = guestimage.RootIn(dir)
	for _, f := range []string{g.Kernel, g.Initrd + g.Root} {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("vmtest: build.sh succeeded but %v\n%s", err, out)
		}
	}
	if d := time.Since(start); d > time.Second {
		t.Logf("vmtest: guest image built in %v:\n%s", d.Round(time.Millisecond), out)
	}
	return g
}

// agentCacheDir is $KVFS_CACHE/agent-guest, else DefaultAgentCacheDir.
func agentCacheDir() string {
	if d := os.Getenv("KVFS_CACHE"); d != "" {
		return filepath.Join(d, "agent-guest")
	}
	return DefaultAgentCacheDir
}

// faultsCacheDir is $KVFS_CACHE/agent-guest-faults, else DefaultFaultsCacheDir.
func faultsCacheDir() string {
	if d := os.Getenv("KVFS_CACHE"); d != "" {
		return filepath.Join(d, "agent-guest-faults")
	}
	return DefaultFaultsCacheDir
}

// cacheDir is $KVFS_CACHE/guest (as for the Makefile, demo.sh and deps.sh,
// $KVFS_CACHE is the parent of every cache), else DefaultCacheDir when it can
// be created, else a directory under the user's cache directory.
func cacheDir() string {
	if d := os.Getenv("KVFS_CACHE"); d != "" {
		return filepath.Join(d, "guest")
	}
	if err := os.MkdirAll(DefaultCacheDir, 0o755); err == nil {
		return DefaultCacheDir
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "kvfs", "guest")
	}
	return filepath.Join(os.TempDir(), "kvfs-guest")
}

// RepoRoot returns the directory holding the go.mod of module github.com/kvfs/kvfs (not
// bench/'s, a module of its own), found by walking up from the working directory (a package
// directory under go test).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && slices.Contains(strings.Split(string(b), "\n"), "module github.com/kvfs/kvfs") {
			return dir, nil
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", err
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod of github.com/kvfs/kvfs above the working directory")
		}
		dir = parent
	}
}
