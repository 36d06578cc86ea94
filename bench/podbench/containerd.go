package podbench

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// containerd is the benchmark's private containerd: its own directory under /tmp (config,
// log, root, state, sockets), namespace and mount namespace, as internal/ctrdtest makes one for
// tests (that package is built on testing.TB, so it is not linked here; this is the minimum
// the benchmark needs: start, ctr, stop).
type containerd struct {
	binDir    string // containerd and ctr
	dir       string
	namespace string
	logPath   string
	env       []string
	cmd       *exec.Cmd
	exited    chan struct{}
}

// containerdConfig is the config.toml of a containerd kept to dir: version 4, the CRI and NRI
// off (no CNI, no machine-wide NRI socket), every path containerd would take on the machine
// pointed into dir.
func containerdConfig(dir, logLevel string) string {
	p := func(name string) string { return filepath.Join(dir, name) }
	return fmt.Sprintf(`version = 4
root = %q
state = %q
temp = %q
imports = []
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime", "io.containerd.podsandbox.controller.v1.podsandbox", "io.containerd.nri.v1.nri"]

[debug]
level = %q

[plugins."io.containerd.server.v1.grpc"]
address = %q
[plugins."io.containerd.server.v1.ttrpc"]
address = %q
[plugins."io.containerd.server.v1.debug"]
address = ""
[plugins."io.containerd.server.v1.metrics"]
address = ""
[plugins."io.containerd.internal.v1.opt"]
path = %q
[plugins."io.containerd.image-verifier.v1.bindir"]
bin_dir = %q
`, p("root"), p("state"), p("tmp"), logLevel, p("containerd.sock"), p("containerd.sock.ttrpc"), p("opt"), p("image-verifier"))
}

// startContainerd starts containerd from binDir with shimDirs first on its PATH, and returns
// once it answers.
func startContainerd(binDir string, shimDirs []string) (*containerd, error) {
	dir, err := os.MkdirTemp("/tmp", "kvfspodbench-")
	if err != nil {
		return nil, err
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, err
	}
	c := &containerd{binDir: binDir, dir: dir, namespace: "kvfspodbench-" + hex.EncodeToString(b[:]),
		logPath: filepath.Join(dir, "containerd.log"), exited: make(chan struct{})}
	fail := func(err error) (*containerd, error) {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := os.Chmod(dir, 0o711); err != nil {
		return fail(err)
	}
	for _, d := range []string{"tmp", "sandboxes"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			return fail(err)
		}
	}
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(containerdConfig(dir, "info")), 0o600); err != nil {
		return fail(err)
	}
	var env []string
	path := ""
	for _, kv := range os.Environ() {
		switch {
		case strings.HasPrefix(kv, "PATH="):
			path = strings.TrimPrefix(kv, "PATH=")
		case strings.HasPrefix(kv, "TMPDIR="), strings.HasPrefix(kv, "CONTAINERD_"):
		default:
			env = append(env, kv)
		}
	}
	dirs := append(append(shimDirs[:len(shimDirs):len(shimDirs)], binDir), filepath.SplitList(path)...)
	dirs = append(dirs, "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
	c.env = append(env, "PATH="+strings.Join(dirs, ":"), "TMPDIR="+filepath.Join(dir, "tmp"))

	logf, err := os.OpenFile(c.logPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fail(err)
	}
	defer logf.Close()
	c.cmd = exec.Command(filepath.Join(binDir, "containerd"), "--config", cfgPath)
	c.cmd.Dir, c.cmd.Env = dir, c.env
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	// Its own mount namespace, so that the containers' and sandboxes' mounts stay out of the
	// machine's table; its own process group; killed with the benchmark.
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := c.cmd.Start(); err != nil {
		return fail(fmt.Errorf("starting containerd: %w", err))
	}
	go func() {
		c.cmd.Wait()
		close(c.exited)
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		out, err := c.ctrCmd(ctx, "version").CombinedOutput()
		cancel()
		if err == nil {
			return c, nil
		}
		select {
		case <-c.exited:
			os.RemoveAll(dir)
			return nil, fmt.Errorf("containerd exited at start; its log: %s", c.logPath)
		default:
		}
		if time.Now().After(deadline) {
			c.stop("")
			return nil, fmt.Errorf("containerd did not answer within 30 s: %v: %s", err, bytes.TrimSpace(out))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (c *containerd) ctrCmd(ctx context.Context, args ...string) *exec.Cmd {
	a := append([]string{"--address", filepath.Join(c.dir, "containerd.sock"), "--namespace", c.namespace}, args...)
	cmd := exec.CommandContext(ctx, filepath.Join(c.binDir, "ctr"), a...)
	cmd.Env = c.env
	cmd.Dir = c.dir
	return cmd
}

// ctr runs ctr with args and returns its standard output; a failure's error carries its
// standard error.
func (c *containerd) ctr(ctx context.Context, args ...string) (string, error) {
	var out, errOut bytes.Buffer
	cmd := c.ctrCmd(ctx, args...)
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(errOut.Bytes()))
	}
	return out.String(), nil
}

// Log is containerd's log so far (its shims' lines included).
func (c *containerd) log() (string, error) {
	b, err := os.ReadFile(c.logPath)
	return string(b), err
}

// stop removes what is left in the namespace (tasks killed, containers removed), stops
// containerd (SIGTERM, SIGKILL after 10 s) and removes its directory, keeping the log at
// keepLog if that is not empty.
func (c *containerd) stop(keepLog string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var errs []error
	if out, err := c.ctr(ctx, "containers", "list", "-q"); err == nil {
		for _, id := range strings.Fields(out) {
			c.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
			c.ctr(ctx, "tasks", "delete", "-f", id)
			if _, err := c.ctr(ctx, "containers", "delete", id); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		errs = append(errs, err)
	}
	select {
	case <-c.exited:
	case <-time.After(10 * time.Second):
		c.cmd.Process.Kill()
		<-c.exited
	}
	// runc's state and ctr's cgroups are named after the namespace, outside the directory.
	dirs := []string{filepath.Join("/run/containerd/runc", c.namespace)}
	for _, p := range []string{"/sys/fs/cgroup/" + c.namespace, "/sys/fs/cgroup/*/" + c.namespace} {
		m, _ := filepath.Glob(p)
		dirs = append(dirs, m...)
	}
	for _, d := range dirs {
		if err := removeEmptyDirs(d); err != nil {
			errs = append(errs, err)
		}
	}
	if keepLog != "" {
		if b, err := os.ReadFile(c.logPath); err != nil {
			errs = append(errs, err)
		} else if err := os.WriteFile(keepLog, b, 0o644); err != nil {
			errs = append(errs, err)
		}
	}
	if err := os.RemoveAll(c.dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// removeEmptyDirs removes dir and the directories under it, deepest first, with rmdir only
// (cgroups cannot be removed otherwise; a file left is an error). A missing dir is fine.
func removeEmptyDirs(dir string) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	for _, e := range ents {
		if e.IsDir() {
			if err := removeEmptyDirs(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	return syscall.Rmdir(dir)
}
