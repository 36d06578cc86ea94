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
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
)

// containerd is the benchmark's private containerd: its own directory under /tmp (config,
// log, root, state, sockets), namespace and mount namespace, its config and environment made
// as internal/testing/ctrdtest makes a test's (package ctrdconf); ctrdtest itself is built on
// testing.TB, so it is not linked here: this is the minimum the benchmark needs: start, ctr,
// crictl, stop. With the CRI on, containerd runs in a network namespace of its own, named
// after its namespace, where the CNI network's bridge is.
type containerd struct {
	binDir    string // containerd, ctr and crictl
	dir       string
	namespace string // unique: runc's state and ctr's cgroups are named after it
	cri       bool
	logPath   string
	env       []string
	cmd       *exec.Cmd
	exited    chan struct{}
}

// startContainerd starts containerd from binDir with shimDirs first on its PATH, and returns
// once it answers. With cri, its CRI is on (see ctrdconf.Config). extra, if not nil, is
// given the containerd's directory and returns TOML merged into its config (the CRI's
// runtime handlers beside runc) and variables added to its environment (and its shims').
func startContainerd(binDir string, shimDirs []string, cri bool, extra func(dir string) (string, []string)) (*containerd, error) {
	// Short: the kvfs shim's sockets are in sandboxesDir/SANDBOX_ID, and the CRI's sandbox
	// ids are 64 characters (a Unix socket's path holds 107 bytes).
	dir, err := os.MkdirTemp("/tmp", "kvfspb-")
	if err != nil {
		return nil, err
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, err
	}
	c := &containerd{binDir: binDir, dir: dir, namespace: "kvfspodbench-" + hex.EncodeToString(b[:]), cri: cri,
		logPath: filepath.Join(dir, "containerd.log"), exited: make(chan struct{})}
	c.env = ctrdconf.Environ(dir, append(slices.Clone(shimDirs), binDir))
	netns := false
	fail := func(err error) (*containerd, error) {
		if netns {
			err = errors.Join(err, c.removeNetNS())
		}
		os.RemoveAll(dir)
		return nil, err
	}
	if err := os.Chmod(dir, 0o711); err != nil {
		return fail(err)
	}
	for _, d := range []string{"tmp", sandboxesDir} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			return fail(err)
		}
	}
	more := ""
	if extra != nil {
		var env []string
		more, env = extra(dir)
		c.env = append(c.env, env...)
	}
	cfg, err := ctrdconf.Config(dir, "info", cri, nil, more)
	if err != nil {
		return fail(fmt.Errorf("containerd's config: %w", err))
	}
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		return fail(err)
	}
	c.cmd = exec.Command(filepath.Join(binDir, "containerd"), "--config", cfgPath)
	if cri {
		if err := ctrdconf.WriteCRIFiles(dir, 3*time.Minute); err != nil {
			return fail(err)
		}
		if err := ipCmd("netns", "add", c.namespace); err != nil {
			return fail(err)
		}
		netns = true
		if err := ipCmd("-n", c.namespace, "link", "set", "lo", "up"); err != nil {
			return fail(err)
		}
		// nsenter joins the network namespace and executes containerd in its place.
		c.cmd = exec.Command("nsenter", "--net="+filepath.Join("/run/netns", c.namespace), "--", filepath.Join(binDir, "containerd"), "--config", cfgPath)
	}

	logf, err := os.OpenFile(c.logPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fail(err)
	}
	defer logf.Close()
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
			return fail(fmt.Errorf("containerd exited at start; its log: %s", c.logPath))
		default:
		}
		if time.Now().After(deadline) {
			c.stop("")
			return nil, fmt.Errorf("containerd did not answer within 30 s: %v: %s", err, bytes.TrimSpace(out))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// sandboxesDir is the kvfs shim's base_dir in the containerd's directory.
const sandboxesDir = "sb"

func ipCmd(args ...string) error {
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

func (c *containerd) removeNetNS() error { return ipCmd("netns", "del", c.namespace) }

// ctrNamespace is where ctr works: the CRI's namespace with the CRI on, else the
// benchmark's own.
func (c *containerd) ctrNamespace() string {
	if c.cri {
		return ctrdconf.CRINamespace
	}
	return c.namespace
}

func (c *containerd) ctrCmd(ctx context.Context, args ...string) *exec.Cmd {
	a := append([]string{"--address", filepath.Join(c.dir, ctrdconf.GRPCSocket), "--namespace", c.ctrNamespace()}, args...)
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

// crictl runs crictl with args on the CRI and returns its standard output; a failure's error
// carries its standard error.
func (c *containerd) crictl(ctx context.Context, args ...string) (string, error) {
	var out, errOut bytes.Buffer
	cmd := exec.CommandContext(ctx, filepath.Join(c.binDir, "crictl"), append([]string{"--config", ctrdconf.CrictlConfig(c.dir)}, args...)...)
	cmd.Env, cmd.Dir = c.env, c.dir
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("crictl %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(errOut.Bytes()))
	}
	return out.String(), nil
}

// Log is containerd's log so far (its shims' lines included).
func (c *containerd) log() (string, error) {
	b, err := os.ReadFile(c.logPath)
	return string(b), err
}

// stop removes what is left in the namespace (the CRI's pods, then tasks killed and
// containers removed), stops containerd (SIGTERM, SIGKILL after 10 s) and removes its directory, keeping the log at
// keepLog if that is not empty.
func (c *containerd) stop(keepLog string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var errs []error
	if c.cri {
		if out, err := c.crictl(ctx, "pods", "-q"); err != nil {
			errs = append(errs, err)
		} else {
			for _, id := range strings.Fields(out) {
				if _, err := c.crictl(ctx, "rmp", "-f", id); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
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
	if c.cri {
		if err := c.removeNetNS(); err != nil {
			errs = append(errs, err)
		}
	}
	// runc's state and ctr's cgroups (and the CRI pods' cgroup parent) are named after the
	// namespace, outside the directory.
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
