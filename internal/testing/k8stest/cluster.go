// Package k8stest is the harness of the Kubernetes tests (shim/e2e/k8s): a real single-node
// cluster per test — etcd, kube-apiserver, kube-controller-manager, kube-scheduler and a
// kubelet, built from the Go module proxy (build/build.sh) — on a private containerd
// (ctrdtest) whose CRI has the runtime handlers runc (its default) and kvfs, installed as a
// node's installer installs it, with the RuntimeClass kvfs of packaging/kubernetes.
//
// Nothing of the host changes. Every part runs in the containerd's own mount and network
// namespaces (ctrd), where the API server and the kubelet listen on their usual ports and the
// node's address is on the loopback device. What the kubelet writes that its configuration
// cannot move — /var/lib/kubelet/device-plugins, the links in /var/log/containers, the
// kernel's sysctls it tunes (kernel.panic, vm.overcommit_memory and others) — lands in an
// overlay of /var/lib and /var/log and in files bound over those sysctls, all in that mount
// namespace, which goes with the containerd's last process. Its cgroups are under the
// containerd's namespace's, removed at the end. The end checks the host's sysctls and
// directories are as they were.
package k8stest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/installtest"
	"github.com/kvfs/kvfs/internal/testing/shimtest"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// NodeName is the cluster's one node, NodeIP its address (on the loopback device of the
// containerd's network namespace, beside the CNI bridge of the pods).
const (
	NodeName = "kvfs-node"
	NodeIP   = "10.98.0.1"
)

// The ports, in the cluster's network namespace: Kubernetes' own defaults.
const (
	etcdPort      = 2379
	etcdPeerPort  = 2380
	apiserverPort = 6443
)

// serviceRange is the cluster's service addresses; the first is the API server's.
const serviceRange = "10.96.0.0/24"

// token is the one static bearer token every client of the API server uses, in the group
// system:masters (the API server authorizes every request: AlwaysAllow).
const token = "kvfs-test-token"

// kubeletSysctls are the sysctls the kubelet sets at start (unless protectKernelDefaults,
// with which it refuses to start when they differ): each is a file bound over it in the
// cluster's mount namespace, holding the host's value, which the kubelet reads and writes.
var kubeletSysctls = []string{
	"vm/overcommit_memory",
	"vm/panic_on_oom",
	"kernel/panic",
	"kernel/panic_on_oops",
	"kernel/keys/root_maxkeys",
	"kernel/keys/root_maxbytes",
}

// hostPaths are the host directories a kubelet writes when not confined: each must be after
// the test as it was before (absent, on these machines).
var hostPaths = []string{"/var/lib/kubelet", "/var/log/pods", "/var/log/containers", "/usr/libexec/kubernetes", "/etc/kubernetes"}

// Cluster is a running single-node cluster of a test.
type Cluster struct {
	Env        *shimtest.Env // the containerd, its kvfs handler's configuration and test image
	dir        string
	bins       string
	kubeconfig string
	parts      []*part
	started    bool // every part started, the node Ready
}

// part is one of the cluster's processes.
type part struct {
	name string
	args []string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// Start starts a cluster for the test and returns once its node is Ready, its default service
// account made and the RuntimeClass kvfs applied. The kvfs runtime is as a node's installer
// leaves it (installedRuntime). The test's cleanup stops the cluster, removes what the kubelet
// made, and fails the test if the host's sysctls or directories changed; the containerd's own
// cleanup then fails it for anything of a pod left.
func Start(t *testing.T) *Cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("runs a Kubernetes node whose pods boot VMs under QEMU (-short)")
	}
	bins := Binaries(t)
	before := hostState(t)
	e := installedRuntime(t)
	c := &Cluster{Env: e, dir: t.TempDir(), bins: bins}
	t.Cleanup(func() { c.stop(t, before) })

	c.confine(t)
	if err := writePKI(c.dir, []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(NodeIP), net.ParseIP("10.96.0.1")}); err != nil {
		t.Fatal(err)
	}
	c.writeFile(t, "tokens.csv", token+",kvfs-test,kvfs-test,system:masters\n")
	c.kubeconfig = c.writeFile(t, "kubeconfig", kubeconfig(filepath.Join(c.dir, caCert)))

	c.run(t, "etcd",
		"--name", NodeName,
		"--data-dir", filepath.Join(c.dir, "etcd"),
		"--listen-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPort),
		"--advertise-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPort),
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeerPort),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeerPort),
		"--initial-cluster", fmt.Sprintf("%s=http://127.0.0.1:%d", NodeName, etcdPeerPort),
		// A test's cluster outlives no crash: what a power cut would lose does not matter.
		"--unsafe-no-fsync")
	c.run(t, "kube-apiserver",
		"--etcd-servers", fmt.Sprintf("http://127.0.0.1:%d", etcdPort),
		"--bind-address", "0.0.0.0",
		"--advertise-address", NodeIP,
		"--secure-port", fmt.Sprint(apiserverPort),
		"--tls-cert-file", filepath.Join(c.dir, apiserverCert),
		"--tls-private-key-file", filepath.Join(c.dir, apiserverKey),
		"--token-auth-file", filepath.Join(c.dir, "tokens.csv"),
		"--authorization-mode", "AlwaysAllow",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", filepath.Join(c.dir, saPub),
		"--service-account-signing-key-file", filepath.Join(c.dir, saKey),
		"--service-cluster-ip-range", serviceRange,
		"--allow-privileged",
		// The node's name is no host name anything resolves: reach its kubelet (exec, logs)
		// by its address.
		"--kubelet-preferred-address-types", "InternalIP",
		"--profiling=false")
	c.waitAPI(t)
	c.run(t, "kube-controller-manager",
		"--kubeconfig", c.kubeconfig,
		"--leader-elect=false",
		"--root-ca-file", filepath.Join(c.dir, caCert),
		"--service-account-private-key-file", filepath.Join(c.dir, saKey),
		"--bind-address", "127.0.0.1",
		"--profiling=false")
	c.run(t, "kube-scheduler",
		"--kubeconfig", c.kubeconfig,
		"--leader-elect=false",
		"--bind-address", "127.0.0.1",
		"--profiling=false")
	c.run(t, "kubelet",
		"--config", c.writeFile(t, "kubelet.json", c.kubeletConfig(t)),
		"--kubeconfig", c.kubeconfig,
		"--root-dir", filepath.Join(c.dir, "kubelet"),
		"--hostname-override", NodeName,
		"--node-ip", NodeIP,
		"--node-labels", "kvfs.io/kvfs-runtime=true")

	c.waitNodeReady(t)
	c.waitFor(t, "the default service account", time.Minute, func() error {
		_, err := c.kubectl(context.Background(), nil, "get", "serviceaccount", "default")
		return err
	})
	root, err := vmtest.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	c.started = true
	c.Kubectl(t, "apply", "-f", filepath.Join(root, "packaging", "kubernetes", "runtimeclass.yaml"))
	return c
}

// installedRuntime installs kvfs into a scratch root as a node's installer does
// (packaging/install.sh: the shim under test, which shimtest.Main built, and the test guest
// image), and starts a private containerd whose config imports the installed drop-in, as a
// node's imports conf.d/*.toml: its CRI's handler kvfs is the installer's (the installed shim,
// its sandboxer, the pod annotations it passes) and the shim's configuration the installed one,
// with only the operator's one edit (installtest.EditConfig).
func installedRuntime(t *testing.T) *shimtest.Env {
	t.Helper()
	g := vmtest.AgentImage(t)
	root, err := os.MkdirTemp("/tmp", "kvfs-root-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	installtest.Run(t, append([]string{"install", "--bin", shimtest.BinDir, "--guest", filepath.Dir(g.Kernel)}, installtest.Layout(root)...)...)
	// Short, as a node's /run/kvfs/sandboxes: a CRI pod's id is 64 characters, and its
	// sandbox's sockets must fit in the 107 bytes of a Unix socket address. The containerd's
	// leak check covers it.
	base, err := os.MkdirTemp("/tmp", "kvfs-sb-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(base) })
	c := ctrdtest.Start(t, ctrd.Options{
		ShimDirs: []string{filepath.Join(root, "usr", "bin")},
		Imports:  []string{filepath.Join(root, "etc", "containerd", "conf.d", "*.toml")},
		CRI:      true,
		LeakDirs: []string{base},
	})
	config := filepath.Join(root, "etc", "kvfs", "configuration.toml")
	installtest.EditConfig(t, config, base)
	// Registered after the containerd's Start, so it runs before its cleanup stops the pods.
	t.Cleanup(func() {
		if t.Failed() {
			shimtest.PrintConsoles(t, base)
		}
	})
	return &shimtest.Env{C: c, Image: ctrdtest.ImportImage(t, c, "localhost/busybox:cri"), Config: config, BaseDir: base}
}

// confine readies the containerd's namespaces for the kubelet: the node's address on the
// loopback device, the overlays of /var/lib and /var/log, and the sysctls' files.
func (c *Cluster) confine(t *testing.T) {
	t.Helper()
	script := []string{
		"set -e",
		"ip addr add " + NodeIP + "/32 dev lo",
	}
	for _, d := range []string{"/var/lib", "/var/log"} {
		o := filepath.Join(c.dir, "overlay", strings.ReplaceAll(strings.TrimPrefix(d, "/"), "/", "-"))
		script = append(script,
			fmt.Sprintf("mkdir -p %s/upper %s/work", o, o),
			fmt.Sprintf("mount -t overlay overlay -o lowerdir=%s,upperdir=%s/upper,workdir=%s/work %s", d, o, o, d))
	}
	for _, s := range kubeletSysctls {
		f := c.sysctlFile(s)
		script = append(script,
			"mkdir -p "+filepath.Dir(f),
			fmt.Sprintf("cat /proc/sys/%s >%s", s, f),
			fmt.Sprintf("mount --bind %s /proc/sys/%s", f, s))
	}
	c.inNamespaces(t, "sh", "-c", strings.Join(script, "\n"))
	if err := makeCgroupRoot(c.Env.C.Namespace()); err != nil {
		t.Fatal(err)
	}
}

// makeCgroupRoot makes the kubelet's cgroup root, the containerd's namespace's cgroup, in
// every hierarchy (the kubelet wants it in each v1 controller's; ctrd makes it in the v2 one
// only, and removes it from all at its end).
func makeCgroupRoot(namespace string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	for _, l := range strings.Split(string(b), "\n") {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
		f := strings.Fields(l)
		sep := slices.Index(f, "-")
		if sep < 5 || sep+1 >= len(f) || (f[sep+1] != "cgroup" && f[sep+1] != "cgroup2") {
			continue
		}
		if err := os.MkdirAll(filepath.Join(f[4], namespace), 0o755); err != nil {
			return fmt.Errorf("the kubelet's cgroup root: %w", err)
		}
	}
	return nil
}

// inNamespaces runs a command in the containerd's mount and network namespaces.
func (c *Cluster) inNamespaces(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.Command("nsenter", append(c.nsenter(), args...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func (c *Cluster) nsenter() []string {
	pid := c.Env.C.PID()
	return []string{fmt.Sprintf("--mount=/proc/%d/ns/mnt", pid), fmt.Sprintf("--net=/proc/%d/ns/net", pid), "--"}
}

// kubeletConfig is the kubelet's configuration: the private containerd, the cgroupfs driver
// (these machines have no systemd) with the kubelet's cgroups under the containerd's
// namespace's, cgroup v1 allowed, and what it writes in the cluster's directory.
func (c *Cluster) kubeletConfig(t *testing.T) string {
	t.Helper()
	cfg := map[string]any{
		"kind":                     "KubeletConfiguration",
		"apiVersion":               "kubelet.config.k8s.io/v1beta1",
		"containerRuntimeEndpoint": "unix://" + c.Env.C.Address(),
		"cgroupDriver":             "cgroupfs",
		"cgroupRoot":               "/" + c.Env.C.Namespace(),
		"failCgroupV1":             false,
		"failSwapOn":               false,
		"podLogsDir":               filepath.Join(c.dir, "pod-logs"),
		"volumePluginDir":          filepath.Join(c.dir, "volume-plugins"),
		"authentication":           map[string]any{"anonymous": map[string]any{"enabled": true}, "webhook": map[string]any{"enabled": false}},
		"authorization":            map[string]any{"mode": "AlwaysAllow"},
		"readOnlyPort":             0,
		"resolvConf":               "/etc/resolv.conf",
		"serializeImagePulls":      false,
		// How often the kubelet syncs each pod, and so how soon a configMap's update reaches its
		// volume (a minute by default): the same for both runtimes, and tests wait less.
		"syncFrequency":               "10s",
		"imageGCHighThresholdPercent": 100,
		"imageGCLowThresholdPercent":  99,
		// The shared machines' disks may be fuller than the kubelet's defaults allow.
		"evictionHard": map[string]string{"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// kubeconfig is the clients' kubeconfig: the API server at 127.0.0.1, trusted by caPath, and
// the static token.
func kubeconfig(caPath string) string {
	b, _ := json.Marshal(map[string]any{
		"apiVersion":      "v1",
		"kind":            "Config",
		"clusters":        []any{map[string]any{"name": "kvfs", "cluster": map[string]any{"server": fmt.Sprintf("https://127.0.0.1:%d", apiserverPort), "certificate-authority": caPath}}},
		"users":           []any{map[string]any{"name": "kvfs-test", "user": map[string]any{"token": token}}},
		"contexts":        []any{map[string]any{"name": "kvfs", "context": map[string]any{"cluster": "kvfs", "user": "kvfs-test", "namespace": "default"}}},
		"current-context": "kvfs",
	})
	return string(b)
}

func (c *Cluster) writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(c.dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// run starts the cluster's program bin in the containerd's namespaces and cgroup (so a test
// binary killed before its cleanup leaves nothing: the next containerd's start kills what
// its cgroups hold), its output in a log of its own.
func (c *Cluster) run(t *testing.T, bin string, args ...string) {
	t.Helper()
	cg, err := os.Open(c.Env.C.Cgroup())
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	logPath := filepath.Join(c.dir, bin+".log")
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command("nsenter", append(append(c.nsenter(), filepath.Join(c.bins, bin)), args...)...)
	cmd.Dir = c.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL, UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", bin, err)
	}
	p := &part{name: bin, args: args, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		cmd.Wait()
		close(p.done)
	}()
	c.parts = append(c.parts, p)
}

// RestartKubelet stops the kubelet (SIGTERM, as a service manager stops it) and starts it
// again with the same configuration, under the running pods, and returns once it serves each
// pod the API server has Running (its node's Ready condition is no sign: it stays from the
// kubelet before for the node monitor's grace period).
func (c *Cluster) RestartKubelet(t *testing.T) {
	t.Helper()
	i := slices.IndexFunc(c.parts, func(p *part) bool { return p.name == "kubelet" })
	p := c.parts[i]
	if err := p.stop(); err != nil {
		t.Fatal(err)
	}
	c.parts = slices.Delete(c.parts, i, i+1)
	c.run(t, "kubelet", p.args...)
	running := c.podNames(t, "get", "pods", "--field-selector", "status.phase=Running", "-o", "json")
	c.waitFor(t, "the restarted kubelet to serve the running pods", 3*time.Minute, func() error {
		out, err := c.kubectl(context.Background(), nil, "get", "--raw", "/api/v1/nodes/"+NodeName+"/proxy/pods")
		if err != nil {
			return err
		}
		served, err := podNames(out)
		if err != nil {
			return err
		}
		for _, n := range running {
			if !slices.Contains(served, n) {
				return fmt.Errorf("the kubelet serves %v, not yet %s", served, n)
			}
		}
		return nil
	})
}

// podNames runs kubectl with args, whose output is a JSON list of pods, and returns their names.
func (c *Cluster) podNames(t *testing.T, args ...string) []string {
	t.Helper()
	names, err := podNames(c.Kubectl(t, args...))
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// podNames are the names of the pods of a JSON list.
func podNames(list string) ([]string, error) {
	var l struct {
		Items []struct {
			Metadata struct{ Name string }
		}
	}
	if err := json.Unmarshal([]byte(list), &l); err != nil {
		return nil, fmt.Errorf("a pod list: %w", err)
	}
	var names []string
	for _, it := range l.Items {
		names = append(names, it.Metadata.Name)
	}
	return names, nil
}

// stop stops the part (SIGTERM to its process group) and waits for it to go, killing it
// after 20 s.
func (p *part) stop() error {
	syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(20 * time.Second):
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
		return fmt.Errorf("%s did not stop within 20 s of SIGTERM: killed", p.name)
	}
}

// waitNodeReady waits for the node to be Ready.
func (c *Cluster) waitNodeReady(t *testing.T) {
	t.Helper()
	c.waitFor(t, "the node to be Ready", 3*time.Minute, func() error {
		_, err := c.kubectl(context.Background(), nil, "wait", "--for=condition=Ready", "node/"+NodeName, "--timeout=5s")
		return err
	})
}

// waitAPI waits for the API server to be ready.
func (c *Cluster) waitAPI(t *testing.T) {
	t.Helper()
	c.waitFor(t, "the API server to be ready", 2*time.Minute, func() error {
		_, err := c.kubectl(context.Background(), nil, "get", "--raw", "/readyz")
		return err
	})
}

// waitFor calls check until it succeeds or timeout passes (failing the test with its last
// error), or a part of the cluster exits (failing it with that part's log).
func (c *Cluster) waitFor(t *testing.T, what string, timeout time.Duration, check func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return
		}
		for _, p := range c.parts {
			select {
			case <-p.done:
				t.Fatalf("waiting for %s: %s exited: %v\n%s", what, p.name, p.cmd.ProcessState, tail(p.log))
			default:
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: not within %v: %v", what, timeout, err)
		}
		time.Sleep(time.Second)
	}
}

// Kubectl runs kubectl with args on the cluster and returns its standard output; it fails the
// test unless kubectl exits 0 within 3 minutes.
func (c *Cluster) Kubectl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := c.kubectl(context.Background(), nil, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Apply applies the manifest (YAML or JSON) to the cluster.
func (c *Cluster) Apply(t *testing.T, manifest string) {
	t.Helper()
	if _, err := c.kubectl(context.Background(), strings.NewReader(manifest), "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
}

// RunKubectl runs kubectl with args and stdin (if not nil) and returns its standard output and
// an error that has its standard error, for a test that expects it to fail.
func (c *Cluster) RunKubectl(ctx context.Context, stdin io.Reader, args ...string) (string, error) {
	return c.kubectl(ctx, stdin, args...)
}

// KubectlCmd is kubectl with args on the cluster, in its namespaces (where a port-forward
// listens), killed when ctx is done: for a kubectl that runs on while the test goes on.
func (c *Cluster) KubectlCmd(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "nsenter", append(append(c.nsenter(), filepath.Join(c.bins, "kubectl"), "--kubeconfig", c.kubeconfig), args...)...)
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

func (c *Cluster) kubectl(ctx context.Context, stdin io.Reader, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	cmd := c.KubectlCmd(ctx, args...)
	if stdin != nil {
		cmd.Stdin = stdin
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("kubectl %s: %v\n%s%s", strings.Join(args, " "), err, &stdout, &stderr)
	}
	return stdout.String(), nil
}

// stop deletes what the tests left in the cluster (their workloads and pods, with what the
// pods leave: a failed test does not wait for its own), stops the cluster's parts, the kubelet
// first, removes the kubelet's cgroups and checks the host is as it was before.
func (c *Cluster) stop(t *testing.T, before map[string]string) {
	if c.started {
		if _, err := c.kubectl(context.Background(), nil, "delete", "deployments,replicasets,jobs,pods", "--all", "--all-namespaces", "--cascade=foreground", "--wait", "--timeout=3m"); err != nil {
			t.Errorf("deleting what the tests left: %v", err)
		}
	}
	for i := len(c.parts) - 1; i >= 0; i-- {
		p := c.parts[i]
		if err := p.stop(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("%s's log (%s):\n%s", p.name, p.log, tail(p.log))
		}
	}
	// The pods' sandboxes, stopped: the kubelet's garbage collection removes them a minute
	// or so after their pods' deletion.
	if c.started {
		if _, err := c.Env.C.Containerd.Crictl(context.Background(), "rmp", "--all"); err != nil {
			t.Errorf("removing the stopped pods: %v", err)
		}
	}
	if err := removeKubeletCgroups(c.Env.C.Namespace()); err != nil {
		t.Error(err)
	}
	after := hostState(t)
	for k, v := range before {
		if after[k] != v {
			t.Errorf("the host's %s changed: %q, was %q", k, after[k], v)
		}
	}
	// What the kubelet wrote in its stead.
	for _, s := range kubeletSysctls {
		if b, err := os.ReadFile(c.sysctlFile(s)); err == nil && strings.TrimSpace(string(b)) != before["sysctl "+s] {
			t.Logf("the kubelet set %s to %s in the cluster's mount namespace (the host's is %s)", s, bytes.TrimSpace(b), before["sysctl "+s])
		}
	}
}

// sysctlFile is the file bound over the sysctl s in the cluster's mount namespace.
func (c *Cluster) sysctlFile(s string) string {
	return filepath.Join(c.dir, "sysctl", strings.ReplaceAll(s, "/", "."))
}

// hostState reads what a kubelet left unconfined would change: the sysctls it sets, and
// whether the directories it writes exist.
func hostState(t *testing.T) map[string]string {
	t.Helper()
	s := make(map[string]string)
	for _, k := range kubeletSysctls {
		b, err := os.ReadFile("/proc/sys/" + k)
		if err != nil {
			t.Fatal(err)
		}
		s["sysctl "+k] = strings.TrimSpace(string(b))
	}
	for _, p := range hostPaths {
		_, err := os.Lstat(p)
		s["path "+p] = fmt.Sprint(err == nil)
	}
	return s
}

// removeKubeletCgroups removes what the kubelet made under the namespace's cgroup in each
// hierarchy (its kubepods tree, emptied by the pods' end), deepest first.
func removeKubeletCgroups(namespace string) error {
	roots, err := filepath.Glob("/sys/fs/cgroup/*/" + namespace + "/kubepods*")
	if err != nil {
		return err
	}
	more, _ := filepath.Glob("/sys/fs/cgroup/" + namespace + "/kubepods*")
	var errs []error
	for _, r := range append(roots, more...) {
		var dirs []string
		filepath.WalkDir(r, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := os.Remove(dirs[i]); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("the kubelet's cgroup %s: %w", dirs[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

// tail is the end of the file at path.
func tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > 16<<10 {
		b = b[len(b)-16<<10:]
	}
	return string(b)
}
