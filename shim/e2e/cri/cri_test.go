package cri

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/kubeletvol"
	"github.com/kvfs/kvfs/internal/testing/shimtest"
	"github.com/kvfs/kvfs/sandbox/network"
	"github.com/kvfs/kvfs/sandbox/serverproc"
)

// The CRI's sandboxers: containerd's pause-container one (its default), and the Sandbox API
// of the shim, which needs no pause image.
const (
	podSandboxer  = "podsandbox"
	shimSandboxer = "shim"
)

// criSandboxers are the sandboxers the CRI tests run under, each as a subtest.
var criSandboxers = []string{podSandboxer, shimSandboxer}

// checkNoPause fails the test unless the pod ran the way its sandboxer runs it: a pause
// container (with the pause image) under "podsandbox", none under "shim".
func checkNoPause(t *testing.T, e *shimtest.Env, sandboxer, podID string) {
	t.Helper()
	out := e.C.Ctr(t, "--namespace", ctrd.CRINamespace, "containers", "ls")
	pause := strings.Contains(out, podID) || strings.Contains(out, ctrd.PauseImage)
	if want := sandboxer == podSandboxer; pause != want {
		t.Errorf("sandboxer %s: a pause container %v, want %v; containerd's containers:\n%s", sandboxer, pause, want, out)
	}
}

// pod is a CRI pod of the test: its config files and ids.
type pod struct {
	e      *shimtest.Env
	dir    string // pod.json, the containers' configs, the logs
	config string // pod.json
	id     string
}

// runPod writes pod.json (with more fields from extra) and runs the pod through the kvfs
// runtime handler.
func runPod(t *testing.T, e *shimtest.Env, name string, extra map[string]any) *pod {
	t.Helper()
	dir := t.TempDir()
	cfg := map[string]any{
		"metadata":      map[string]any{"name": name, "namespace": "default", "uid": name + "-uid"},
		"hostname":      name,
		"log_directory": filepath.Join(dir, "logs"),
	}
	for k, v := range extra {
		cfg[k] = v
	}
	p := &pod{e: e, dir: dir, config: filepath.Join(dir, "pod.json")}
	writeJSON(t, p.config, cfg)
	p.id = strings.TrimSpace(e.C.Crictl(t, "runp", "--runtime", shimtest.CRIHandler, p.config))
	return p
}

// container creates and starts container name of the pod: the test image running sh -c script,
// with the CRI mounts given (container_path, host_path, readonly, propagation).
func (p *pod) container(t *testing.T, name, script string, mounts ...map[string]any) string {
	t.Helper()
	return p.containerWith(t, name, script, nil, mounts...)
}

// containerWith is container with more fields of the container config from extra.
func (p *pod) containerWith(t *testing.T, name, script string, extra map[string]any, mounts ...map[string]any) string {
	t.Helper()
	cfg := map[string]any{
		"metadata": map[string]any{"name": name},
		"image":    map[string]any{"image": p.e.Image},
		"command":  []string{"sh", "-c", script},
		"log_path": name + ".log",
		"mounts":   mounts,
	}
	for k, v := range extra {
		cfg[k] = v
	}
	path := filepath.Join(p.dir, name+".json")
	writeJSON(t, path, cfg)
	id := strings.TrimSpace(p.e.C.Crictl(t, "create", p.id, path, p.config))
	p.e.C.Crictl(t, "start", id)
	return id
}

// waitLog waits until the container's log (crictl logs) has want, and returns it.
func (p *pod) waitLog(t *testing.T, id, want string) string {
	t.Helper()
	var logs string
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		r := p.e.C.RunCrictl(t, "logs", id)
		if logs = r.Stdout + r.Stderr; strings.Contains(logs, want) {
			return logs
		}
	}
	t.Fatalf("container %s: no %q in its log after 2 minutes:\n%s", id, want, logs)
	return ""
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// processesOf counts the containerd's processes whose command line has s.
func processesOf(t *testing.T, c *ctrdtest.Containerd, s string) int {
	n := 0
	for _, p := range c.Snapshot(t).Processes {
		if strings.Contains(p.Cmdline, s) {
			n++
		}
	}
	return n
}

// TestCRIPod: hostNetwork and hostPID pods are refused; a pod through crictl is one VM (one
// QEMU, one shim) with containers that share a volume; the pod's IP is the guest's, and a
// server in it answers ping and TCP from beside the pod's veth; QEMU runs in the pod's
// network namespace; a read-only hostPath refuses writes in the guest and on the host's bind;
// a symlink in a hostPath does not reach the host file it names; a container's memory limit
// is its guest cgroup's; /etc/hosts, /etc/resolv.conf and /etc/hostname are the CRI's; the
// pod's sysctls are its containers'; containers share the pod's PID namespace, or have their
// own, as the CRI says; a set-user-ID program raises privileges; read-only and
// recursively read-only volumes are as runc makes them; a mount the host makes in a
// HostToContainer volume reaches the container; a privileged container makes bridges, veths,
// tun devices, VXLANs, nftables NAT chains and legacy iptables tables; a container stopped
// as its process exits is stopped; the pod's resources size the VM, whose share has a
// request queue per vCPU; exec, logs and container
// stats work; QEMU and kvfsd run in the pod's cgroup under its cgroup parent, whose use
// crictl statsp reports; containerd's delete action on a removed container's bundle ends at
// once; stopp and rmp leave nothing. It runs under both sandboxers; under
// "shim" no pause container is made, and the pod's stats come through SandboxMetrics.
func TestCRIPod(t *testing.T) {
	for _, sb := range criSandboxers {
		t.Run(sb, func(t *testing.T) { testCRIPod(t, sb) })
	}
}

func testCRIPod(t *testing.T, sandboxer string) {
	e := shimtest.Start(t, "", sandboxer)
	before := e.C.Snapshot(t)

	// A pod on the host's network is refused, as Kata refuses it, with an error that says so,
	// and so is one in the host's PID namespace.
	dir := t.TempDir()
	for _, tc := range []struct{ name, ns, want string }{
		{"hostnet", "network", "host networking is not supported"},
		{"hostpid", "pid", "the node's PID (hostPID) namespace: not supported"},
	} {
		cfg := filepath.Join(dir, tc.name+".json")
		writeJSON(t, cfg, map[string]any{
			"metadata": map[string]any{"name": tc.name, "namespace": "default", "uid": tc.name + "-uid"},
			"linux":    map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{tc.ns: 2}}},
		})
		if r := e.C.RunCrictl(t, "runp", "--runtime", shimtest.CRIHandler, cfg); r.ExitCode == 0 || !strings.Contains(r.Stderr, tc.want) {
			t.Errorf("a %s pod: %+v, want a refusal with %q", tc.name, r, tc.want)
		}
	}
	e.C.CheckNoLeaks(t, before)

	vols := t.TempDir()
	shared := filepath.Join(vols, "shared")
	ro := filepath.Join(vols, "ro")
	canary := filepath.Join(vols, "canary")
	for _, d := range []string{shared, ro} {
		if err := os.Mkdir(d, 0o777); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(ro, "data"), []byte("ro-data\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(canary, []byte("host-canary\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(canary, filepath.Join(ro, "escape")); err != nil {
		t.Fatal(err)
	}
	// An emptyDir of medium Memory, as the kubelet makes it: a tmpfs of its sizeLimit in the
	// pod's kubernetes.io~empty-dir directory (mounted where containerd sees it, in its mount
	// namespace, gone with it). Its containers share a tmpfs of that size in the guest, as
	// under runc they share the host's.
	memDir := filepath.Join(vols, "kubelet", "pods", "p1-uid", "volumes", "kubernetes.io~empty-dir", "cache")
	if err := os.MkdirAll(memDir, 0o755); err != nil {
		t.Fatal(err)
	}
	e.InMountNS(t, "mount", "-t", "tmpfs", "-o", "size=8m,mode=777,nosuid,nodev", "kvfs-cri-cache", memDir)
	cache := map[string]any{"container_path": "/cache", "host_path": memDir}

	linux := map[string]any{"resources": map[string]any{
		"cpu_period": 100000, "cpu_quota": 100000, "memory_limit_in_bytes": 256 << 20}}
	// The pod's host cgroup, where containerd's podsandbox reads the pod's stats: the kubelet
	// makes it; here it is in the containerd's namespace's cgroups (covered by its leak check).
	cgroupParent := "/" + e.C.Namespace() + "/kvfs-p1"
	linux["cgroup_parent"] = cgroupParent
	// The pod's sysctls, one safe and one the kubelet calls unsafe, are written in the guest,
	// whose IPC namespace the pod's containers share.
	linux["sysctls"] = map[string]string{"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100"}
	// A privileged container needs a privileged pod.
	linux["security_context"] = map[string]any{"privileged": true}
	p := runPod(t, e, "p1", map[string]any{
		"dns_config": map[string]any{"servers": []string{"10.99.0.53"}, "searches": []string{"kvfs.test"}},
		"linux":      linux,
	})
	if n := processesOf(t, e.C, "qemu-system"); n != 1 {
		t.Errorf("%d QEMU processes for the pod, want 1", n)
	}
	checkNoPause(t, e, sandboxer, p.id)

	a := p.container(t, "a", `echo shm-from-a > /dev/shm/from-a; echo cache-from-a > /cache/from-a; echo hello-from-a > /shared/from-a; ip -4 -o addr show eth0; echo a-started
exec nc -l -p 8080 -e sh -c 'echo pong-from-the-pod; head -n1 > /shared/got'`,
		map[string]any{"container_path": "/shared", "host_path": shared}, cache)
	b := p.containerWith(t, "b", `while [ ! -e /shared/from-a ]; do sleep 0.2; done
echo "b-read $(cat /shared/from-a)"
echo "shm $(cat /dev/shm/from-a 2>&1)"
echo "shm-size $(df -k /dev/shm | awk 'NR==2 {print $2}')k $(grep ' /dev/shm ' /proc/mounts | cut -d' ' -f3)"
echo "cache $(grep ' /cache ' /proc/mounts | cut -d' ' -f3) $(df -k /cache | awk 'NR==2 {print $2}')k $(cat /cache/from-a)"
if echo x > /ro/new 2>/dev/null; then echo ro-writable; else echo ro-refused; fi
echo "ro-file $(cat /ro/data)"
echo "escape $(cat /ro/escape 2>&1)"
echo "resolv $(grep -c 'nameserver 10.99.0.53' /etc/resolv.conf) $(grep -c 'search kvfs.test' /etc/resolv.conf)"
echo "hostname $(cat /etc/hostname) $(hostname)"
echo "hosts $(grep -c localhost /etc/hosts)"
echo "mem $(awk '/MemTotal/ {print $2}' /proc/meminfo) cpus $(nproc)"
echo "fs-queues $(cat /sys/fs/virtiofs/*/mqs/*/name | grep -c '^requests')"
echo "sysctls $(cat /proc/sys/kernel/shm_rmid_forced) $(cat /proc/sys/fs/mqueue/msg_max)"
echo "memory.max $(cat /sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)/memory.max)"
echo "pid1 $(tr '\0' ' ' </proc/1/cmdline)"
echo "sees-a $(pidof nc >/dev/null && echo yes || echo no) sees-agent $(pidof init >/dev/null && echo yes || echo no)"
echo b-done
exec sleep 600`,
		map[string]any{"linux": map[string]any{"resources": map[string]any{"memory_limit_in_bytes": 96 << 20}}},
		map[string]any{"container_path": "/shared", "host_path": shared},
		map[string]any{"container_path": "/ro", "host_path": ro, "readonly": true}, cache)

	aLog := p.waitLog(t, a, "a-started")
	logs := p.waitLog(t, b, "b-done")
	// The pod's containers share its /dev/shm: under "podsandbox" the CRI's (a tmpfs on the
	// host, through the share), under "shim" the guest's (a tmpfs of the pod's VM), both of
	// containerd's size.
	if shm := regexp.MustCompile(`shm-size [^\n]*`).FindString(logs); !strings.HasPrefix(shm, "shm-size 65536k ") {
		t.Errorf("sandboxer %s: b's /dev/shm: %q, want 65536k as containerd makes it", sandboxer, shm)
	}
	// a and b share the pod's PID namespace (the CRI's mode POD, crictl's default), as under
	// runc: each sees the other's processes, and its init is the pod's, not the agent.
	for _, want := range []string{"shm shm-from-a", "b-read hello-from-a", "cache tmpfs 8192k cache-from-a\n", "ro-refused", "ro-file ro-data", "resolv 1 1", "hostname p1 p1", "hosts 1", "sysctls 1 100\n", fmt.Sprintf("memory.max %d\n", 96<<20),
		"pid1 /bin/kvfs-pod-init \n", "sees-a yes sees-agent no\n"} {
		if !strings.Contains(logs, want) {
			t.Errorf("b's log has no %q:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, "host-canary") {
		t.Errorf("a symlink in a hostPath read the host file it names:\n%s", logs)
	}
	if _, err := os.Stat(filepath.Join(ro, "new")); err == nil {
		t.Error("the guest wrote into the read-only hostPath")
	}
	// The memory emptyDir is the guest's: the host's tmpfs is not served.
	e.InMountNS(t, "sh", "-c", fmt.Sprintf(`test "$(stat -f -c %%T %[1]s)" = tmpfs && test ! -e %[1]s/from-a`, memDir))
	// 512M configured + 256M of the pod's limit; one vCPU + the pod's one, within the host's;
	// the share has a request queue per vCPU.
	if m := regexp.MustCompile(`mem (\d+) cpus (\d+)`).FindStringSubmatch(logs); m == nil {
		t.Errorf("no memory and CPUs in b's log:\n%s", logs)
	} else if kb, _ := strconv.Atoi(m[1]); kb < 600<<10 || m[2] != "2" {
		t.Errorf("the guest has %s kB and %s CPUs; want more than 600 MiB (512M + 256M) and 2", m[1], m[2])
	}
	if !strings.Contains(logs, "fs-queues 2\n") {
		t.Errorf("the guest's virtio-fs device has not one request queue per vCPU:\n%s", logs)
	}
	if n := processesOf(t, e.C, "qemu-system"); n != 1 {
		t.Errorf("%d QEMU processes with two containers, want 1", n)
	}
	if n := processesOf(t, e.C, "containerd-shim-kvfs-v2"); n != 1 {
		t.Errorf("%d kvfs shims for the pod, want 1", n)
	}

	// A set-user-ID root program, run by uid 1000 of a container that may gain privileges
	// (CRI's default), runs as root, as under runc: the share's files reach the guest with
	// their mode, and its mounts are not nosuid.
	progs := filepath.Join(vols, "progs")
	euid := buildProgram(t, "euid", progs)
	if err := os.Chown(euid, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(euid, os.ModeSetuid|0o755); err != nil {
		t.Fatal(err)
	}
	buildProgram(t, "netfilter", progs)
	// s has a PID namespace of its own (the CRI's mode CONTAINER): its init is its process.
	sLog := p.waitLog(t, p.containerWith(t, "s", `/progs/euid; echo "pid1 $(tr '\0' ' ' </proc/1/cmdline)"; echo s-done`,
		map[string]any{"linux": map[string]any{"security_context": map[string]any{"run_as_user": map[string]any{"value": 1000},
			"namespace_options": map[string]any{"pid": 1}}}},
		map[string]any{"container_path": "/progs", "host_path": progs}), "s-done")
	if !strings.Contains(sLog, "uid 1000 euid 0\n") {
		t.Errorf("a set-user-ID root program run by uid 1000 says %q, want uid 1000 euid 0", sLog)
	}
	if !strings.Contains(sLog, "pid1 sh -c ") {
		t.Errorf("a container with a PID namespace of its own: %q, want its own process as PID 1", sLog)
	}

	// A configMap volume as the kubelet writes it, updated in place as the kubelet updates it
	// while a container watches it with inotify: the container reads the new content, and
	// its watch sees the update's steps (the new directory, ..data moved into place, the new
	// key's link, the old directory deleted), as a runc container's does.
	cfg := filepath.Join(vols, "kubelet", "pods", "p1-uid", "volumes", "kubernetes.io~configmap", "cfg")
	if err := kubeletvol.Write(cfg, "..2026_12_07_01", map[string]string{"key": "one"}); err != nil {
		t.Fatal(err)
	}
	buildProgram(t, "inotify", progs)
	w := p.container(t, "w", `/progs/inotify /cfg`,
		map[string]any{"container_path": "/cfg", "host_path": cfg, "readonly": true},
		map[string]any{"container_path": "/progs", "host_path": progs})
	p.waitLog(t, w, "watching")
	if err := kubeletvol.Write(cfg, "..2026_12_07_02", map[string]string{"key": "two", "more": "new"}); err != nil {
		t.Fatal(err)
	}
	wLog := p.waitLog(t, w, "event ..2026_12_07_01 ") // the old directory deleted: the last step
	for _, want := range []string{"event ..2026_12_07_02 0x40000100\n", "event ..data 0x80\n", "event more 0x100\n", "event ..2026_12_07_01 0x40000200\n"} {
		if !strings.Contains(wLog, want) {
			t.Errorf("the configMap's watch has no %q:\n%s", want, wLog)
		}
	}
	if r := e.C.RunCrictl(t, "exec", "--sync", w, "cat", "/cfg/key", "/cfg/more"); r.ExitCode != 0 || strings.TrimSpace(r.Stdout) != "twonew" {
		t.Errorf("the updated configMap in the container: %+v, want twonew", r)
	}

	// Read-only volumes with a tmpfs inside (mounted where the shim binds volumes, in the
	// containerd's mount namespace), as runc makes them: readonly makes the volume's own
	// mount read-only, recursive_read_only the tmpfs too (the runtime says it supports it).
	// Then, while the container runs, the host unmounts each tmpfs and removes its directory,
	// as critest's read-only mount specs do: the volumes' binds, in the sandbox's mount
	// namespace, do not keep them busy.
	for _, d := range []string{"rov", "rrov"} {
		e.InMountNS(t, "sh", "-c", fmt.Sprintf("set -e; mkdir -p %[1]s/sub; mount -t tmpfs -o size=1m kvfs-cri %[1]s/sub", filepath.Join(vols, d)))
	}
	rLog := p.waitLog(t, p.container(t, "r", `for d in /rov /rov/sub /rrov /rrov/sub; do
	if touch $d/new 2>/dev/null; then echo "$d writable"; else echo "$d read-only"; fi
done
echo r-done; exec sleep 3600`,
		map[string]any{"container_path": "/rov", "host_path": filepath.Join(vols, "rov"), "readonly": true},
		map[string]any{"container_path": "/rrov", "host_path": filepath.Join(vols, "rrov"), "readonly": true, "recursive_read_only": true}), "r-done")
	for _, want := range []string{"/rov read-only\n", "/rov/sub writable\n", "/rrov read-only\n", "/rrov/sub read-only\n"} {
		if !strings.Contains(rLog, want) {
			t.Errorf("read-only volumes: no %q in\n%s", want, rLog)
		}
	}
	for _, d := range []string{"rov", "rrov"} {
		e.InMountNS(t, "sh", "-c", fmt.Sprintf("set -e; umount %[1]s/sub; rmdir %[1]s/sub", filepath.Join(vols, d)))
	}

	// A volume with HostToContainer propagation (its host path a shared mount, as the CRI
	// wants it) shows a mount the host makes in it after the container started.
	follow := filepath.Join(vols, "follow")
	if err := os.MkdirAll(filepath.Join(follow, "later"), 0o755); err != nil {
		t.Fatal(err)
	}
	e.InMountNS(t, "sh", "-c", fmt.Sprintf("set -e; mount --bind %[1]s %[1]s; mount --make-shared %[1]s", follow))
	h := p.container(t, "h", `ls /follow/later; echo h-waiting
i=0; while [ ! -e /follow/later/file ] && [ $i -lt 600 ]; do sleep 0.2; i=$((i+1)); done
echo "later $(cat /follow/later/file 2>&1)"; echo h-done`,
		map[string]any{"container_path": "/follow", "host_path": follow, "propagation": 1})
	p.waitLog(t, h, "h-waiting")
	e.InMountNS(t, "sh", "-c", fmt.Sprintf("set -e; mount -t tmpfs -o size=1m kvfs-cri %[1]s/later; echo from-the-host > %[1]s/later/file", follow))
	if hLog := p.waitLog(t, h, "h-done"); !strings.Contains(hLog, "later from-the-host\n") {
		t.Errorf("a mount the host made in a HostToContainer volume after the container started:\n%s", hLog)
	}

	// A privileged container uses its own kernel's networking as on a host: a bridge, a veth,
	// a tun device, a VXLAN, an nftables NAT chain and legacy iptables' filter table; the
	// guest's kernel has each built in.
	nLog := p.waitLog(t, p.containerWith(t, "n", `try() { what=$1; shift; if out=$("$@" 2>&1); then echo "$what ok"; else echo "$what failed: $out"; fi; }
try bridge brctl addbr kvfsbr0
try veth ip link add kvfsv0 type veth
try tun tunctl -t kvfstun0
try vxlan ip link add kvfsvx0 type vxlan id 42 dstport 4789
/progs/netfilter
echo n-done`,
		map[string]any{"linux": map[string]any{"security_context": map[string]any{"privileged": true}}},
		map[string]any{"container_path": "/progs", "host_path": progs}), "n-done")
	for _, what := range []string{"bridge", "veth", "tun", "vxlan", "nft-nat", "iptables-legacy"} {
		if !strings.Contains(nLog, what+" ok\n") {
			t.Errorf("a privileged container's %s: no %q in\n%s", what, what+" ok", nLog)
		}
	}

	// A container stopped just after its process exited is stopped, as under runc: the kill
	// that finds the process gone is not an error.
	for i := range 3 {
		x := p.container(t, fmt.Sprintf("x%d", i), "exit 0")
		if r := e.C.RunCrictl(t, "stop", x); r.ExitCode != 0 {
			t.Errorf("crictl stop of a container whose process just exited: %+v", r)
		}
	}

	// The pod's address is the guest's, and answers from beside the pod's veth (in the
	// containerd's network namespace, where the CNI bridge is).
	var inspect struct {
		Status struct{ Network struct{ IP string } }
	}
	if err := json.Unmarshal([]byte(e.C.Crictl(t, "inspectp", "-o", "json", p.id)), &inspect); err != nil || inspect.Status.Network.IP == "" {
		t.Fatalf("crictl inspectp: no pod IP: %+v, %v", inspect, err)
	}
	ip := inspect.Status.Network.IP
	if !strings.Contains(aLog, "inet "+ip+"/") {
		t.Errorf("the guest's eth0 does not have the pod's address %s:\n%s", ip, aLog)
	}
	checkQEMUNetNS(t, e, p.id)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if out, err := e.C.InNetNS(ctx, "busybox", "ping", "-c", "2", "-W", "5", ip).CombinedOutput(); err != nil {
		t.Errorf("ping %s from the containerd's network namespace: %v\n%s", ip, err, out)
	}
	out, err := e.C.InNetNS(ctx, "sh", "-c", "(echo from-the-client; sleep 5) | busybox nc -w 20 "+ip+" 8080").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "pong-from-the-pod") {
		t.Errorf("TCP to the pod's port 8080: %v, %q", err, out)
	}
	if got, err := os.ReadFile(filepath.Join(shared, "got")); err != nil || string(got) != "from-the-client\n" {
		t.Errorf("what the pod's server received (on the host, through the volume): %q, %v", got, err)
	}

	// The read-only bind is read-only on the host too, in the sandbox's mount namespace (the
	// binds' own; pinned in the sandbox directory, in containerd's mount namespace).
	pin := filepath.Join(fmt.Sprintf("/proc/%d/root", e.C.PID()), e.BaseDir, p.id, "mnt.ns")
	write := fmt.Sprintf(`set -- %s/%s-*-ro; test $# = 1 && test -d "$1" && echo x > "$1/host-write"`, filepath.Join(e.BaseDir, p.id, "mounts"), b)
	if out, err := exec.Command("nsenter", "--mount="+pin, "--", "sh", "-c", write).CombinedOutput(); err == nil || !strings.Contains(string(out), "Read-only file system") {
		t.Errorf("writing through the host's read-only bind: %v, %q, want EROFS", err, out)
	}

	if out := e.C.Crictl(t, "exec", "--sync", b, "cat", "/shared/from-a"); strings.TrimSpace(out) != "hello-from-a" {
		t.Errorf("exec: %q", out)
	}
	// crictl reports a failed exec with its status and stderr.
	r := e.C.RunCrictl(t, "exec", "--sync", b, "sh", "-c", "echo err >&2; exit 3")
	if r.ExitCode == 0 || !strings.Contains(r.Stderr, "exited with 3: err") {
		t.Errorf("exec exit 3: %+v", r)
	}

	// containerd restarted under the running pod (same root and state; its shims keep
	// running): it reconnects to the pod's shim, and the pod works on: its containers are as
	// they were (a has served its one connection and exited, b runs), exec and logs work.
	states := func() string {
		var ps struct{ Containers []struct{ ID, State string } }
		out := e.C.Crictl(t, "ps", "-a", "--pod", p.id, "-o", "json")
		if err := json.Unmarshal([]byte(out), &ps); err != nil {
			t.Fatalf("crictl ps -o json: %v\n%s", err, out)
		}
		var l []string
		for _, c := range ps.Containers {
			l = append(l, c.ID+" "+c.State)
		}
		slices.Sort(l)
		return strings.Join(l, "\n")
	}
	was := states()
	e.C.Restart(t)
	if now := states(); now != was {
		t.Errorf("after containerd's restart, the pod's containers are\n%s\nwere\n%s", now, was)
	}
	if !strings.Contains(was, b+" CONTAINER_RUNNING") {
		t.Errorf("b is not running: %s", was)
	}
	if out := e.C.Crictl(t, "pods", "--quiet", "--state", "ready", "--id", p.id); strings.TrimSpace(out) != p.id {
		t.Errorf("after containerd's restart, crictl pods: %q, want the pod ready", out)
	}
	if out := e.C.Crictl(t, "exec", "--sync", b, "sh", "-c", "echo after-restart >> /shared/from-a; cat /shared/from-a"); strings.TrimSpace(out) != "hello-from-a\nafter-restart" {
		t.Errorf("exec after containerd's restart: %q", out)
	}
	// A line on the output of b's init (its sleep) reaches its log through the reopened stdio.
	e.C.Crictl(t, "exec", "--sync", b, "sh", "-c", "for p in $(pidof sleep); do echo b-after-restart > /proc/$p/fd/1; done")
	p.waitLog(t, b, "b-after-restart")
	if n := processesOf(t, e.C, "qemu-system"); n != 1 {
		t.Errorf("%d QEMU processes after containerd's restart, want the pod's 1", n)
	}

	var cs struct {
		Stats []struct {
			Attributes struct{ ID string }
			Memory     struct{ WorkingSetBytes struct{ Value string } }
			CPU        struct{ UsageCoreNanoSeconds struct{ Value string } }
		}
	}
	if err := json.Unmarshal([]byte(e.C.Crictl(t, "stats", "-o", "json", "--id", b)), &cs); err != nil || len(cs.Stats) != 1 ||
		cs.Stats[0].Memory.WorkingSetBytes.Value == "" || cs.Stats[0].Memory.WorkingSetBytes.Value == "0" {
		t.Errorf("crictl stats: %+v, %v", cs, err)
	}
	checkPodCgroup(t, e, p.id, cgroupParent)
	{
		var ps struct {
			Stats []struct {
				Attributes struct{ ID string }
				Linux      struct {
					Memory struct{ WorkingSetBytes struct{ Value string } }
					CPU    struct{ UsageCoreNanoSeconds struct{ Value string } }
				}
			}
		}
		out := e.C.Crictl(t, "statsp", "-o", "json", "--id", p.id)
		if err := json.Unmarshal([]byte(out), &ps); err != nil || len(ps.Stats) != 1 || ps.Stats[0].Attributes.ID != p.id ||
			ps.Stats[0].Linux.Memory.WorkingSetBytes.Value == "" || ps.Stats[0].Linux.Memory.WorkingSetBytes.Value == "0" ||
			ps.Stats[0].Linux.CPU.UsageCoreNanoSeconds.Value == "" || ps.Stats[0].Linux.CPU.UsageCoreNanoSeconds.Value == "0" {
			t.Errorf("crictl statsp: %v\n%s", err, out)
		}
	}
	e.C.Crictl(t, "stopp", p.id)
	e.C.Crictl(t, "rmp", p.id)
	// containerd ran the delete action on each container's bundle as its task went (it does
	// for every closed task connection): each ended at once, the pod's shim serving, none
	// waited for the pod's lock until containerd's deadline killed it.
	if log, err := e.C.Log(); err != nil {
		t.Error(err)
	} else if i := strings.Index(log, "failed to clean up after shim disconnected"); i >= 0 {
		t.Errorf("a delete action failed: %s", log[i:min(len(log), i+600)])
	}
	// The shim removed the pod's cgroup: the parent, the kubelet's, is empty.
	for _, d := range cgroupDirs(t, cgroupParent) {
		if err := os.Remove(d); err != nil {
			t.Errorf("removing the pod's cgroup parent %s after rmp: %v", d, err)
		}
	}
	e.C.CheckNoLeaks(t, before)
}

// buildProgram builds the static program testdata/name into dir/name, and returns its path.
func buildProgram(t *testing.T, name, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/"+name)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building testdata/%s: %v\n%s", name, err, out)
	}
	return bin
}

// slowHook is a prestart hook that containerd's CRI puts in every container spec of the kvfs
// runtime handler (its base_runtime_spec: the honest way, without NRI, for an OCI hook to
// reach the shim through the CRI), that sleeps past its timeout, with a child in its process
// group, for a container named slowHookName, and exits at once for the others.
type slowHook struct {
	dir    string // the hook, its pid files
	path   string
	dropin string // containerd's drop-in: the handler's base_runtime_spec
}

const (
	slowHookName    = "slow-hook"
	slowHookTimeout = 3 // seconds
)

func newSlowHook(t *testing.T) *slowHook {
	t.Helper()
	h := &slowHook{dir: t.TempDir()}
	h.path = filepath.Join(h.dir, "prestart.sh")
	// The hook's environment is only its Env: no PATH.
	script := fmt.Sprintf(`#!/bin/sh
state=$(/bin/cat)
case "$state" in *'"io.kubernetes.cri.container-name":"%s"'*) ;; *) exit 0;; esac
echo $$ > %s/hook.pid
/bin/sleep 600 &
echo $! > %s/child.pid
echo slow-hook-sleeping
wait
`, slowHookName, h.dir, h.dir)
	if err := os.WriteFile(h.path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	// containerd's default spec, as the CRI makes it without a base spec, with the hook.
	spec, err := oci.GenerateSpec(namespaces.WithNamespace(context.Background(), ctrd.CRINamespace), nil, &containers.Container{ID: "base"})
	if err != nil {
		t.Fatal(err)
	}
	timeout := slowHookTimeout
	spec.Hooks = &specs.Hooks{Prestart: []specs.Hook{{Path: h.path, Args: []string{h.path, "prestart"}, Timeout: &timeout}}}
	base := filepath.Join(h.dir, "base-spec.json")
	writeJSON(t, base, spec)
	h.dropin = filepath.Join(h.dir, "hooks.toml")
	dropin := fmt.Sprintf("version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.%s]\n  base_runtime_spec = %q\n", shimtest.CRIHandler, base)
	if err := os.WriteFile(h.dropin, []byte(dropin), 0o644); err != nil {
		t.Fatal(err)
	}
	return h
}

// check creates and starts the container the hook sleeps for in pod p (CRI's create only
// records it: the shim's Create, which runs the hook, comes with crictl start): crictl start
// fails once the hook's timeout has passed, with an error naming the hook, its process group
// is gone, and the container is removed without a trace (the test's leak checks cover the
// rest).
func (h *slowHook) check(t *testing.T, p *pod) {
	t.Helper()
	cfg := filepath.Join(p.dir, slowHookName+".json")
	writeJSON(t, cfg, map[string]any{
		"metadata": map[string]any{"name": slowHookName},
		"image":    map[string]any{"image": p.e.Image},
		"command":  []string{"true"},
		"log_path": slowHookName + ".log",
	})
	id := strings.TrimSpace(p.e.C.Crictl(t, "create", p.id, cfg, p.config))
	start := time.Now()
	r := p.e.C.RunCrictl(t, "start", id)
	took := time.Since(start)
	t.Logf("crictl start with a prestart hook sleeping past its %ds timeout: failed after %v", slowHookTimeout, took.Round(time.Millisecond))
	if r.ExitCode == 0 {
		t.Errorf("crictl start of %s succeeded, want its prestart hook's timeout to fail it", slowHookName)
	} else if want := fmt.Sprintf("prestart hook 0 (%s): timed out after %ds: killed", h.path, slowHookTimeout); !strings.Contains(r.Stderr, want) ||
		!strings.Contains(r.Stderr, "slow-hook-sleeping") {
		t.Errorf("crictl start: %s\nwant an error with %q and the hook's output", r.Stderr, want)
	}
	// The guest container's creation and removal come on top of the timeout (39 s of them
	// measured under TCG at a load of 15); two minutes are still far from a hook left to run
	// its 600 s.
	if took < slowHookTimeout*time.Second || took > slowHookTimeout*time.Second+2*time.Minute {
		t.Errorf("crictl start failed after %v, want about the hook's timeout of %ds", took, slowHookTimeout)
	}
	for _, f := range []string{"hook.pid", "child.pid"} {
		b, err := os.ReadFile(filepath.Join(h.dir, f))
		if err != nil {
			t.Errorf("the hook did not run for %s: %v", slowHookName, err)
			continue
		}
		pid := strings.TrimSpace(string(b))
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			stat, err := os.ReadFile("/proc/" + pid + "/stat")
			if err != nil || strings.Contains(string(stat), ") Z ") {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("the hook's process %s (%s) outlived its timeout: %s", pid, f, stat)
				break
			}
		}
	}
	p.e.C.Crictl(t, "rm", id)
	if out := p.e.C.Crictl(t, "ps", "-a", "-q", "--name", slowHookName); strings.TrimSpace(out) != "" {
		t.Errorf("a container %s is left after its removal: %s", slowHookName, out)
	}
}

// cgroupDirs are the directories of the host cgroup path in each hierarchy that has it: the
// unified one, and the v1 ones on a host with those (hybrid here). Symlinked hierarchy names
// (cpu -> cpu,cpuacct) are left out: their directories are the same.
func cgroupDirs(t *testing.T, path string) []string {
	t.Helper()
	roots, err := filepath.Glob("/sys/fs/cgroup/*")
	if err != nil {
		t.Fatal(err)
	}
	roots = append(roots, "/sys/fs/cgroup")
	var out []string
	for _, r := range roots {
		if fi, err := os.Lstat(r); err != nil || fi.Mode()&os.ModeSymlink != 0 {
			continue
		}
		if _, err := os.Stat(filepath.Join(r, path, "cgroup.procs")); err == nil {
			out = append(out, filepath.Join(r, path))
		}
	}
	return out
}

// checkPodCgroup checks that the pod's QEMU and kvfsd run in the host cgroup of its sandbox
// (parent/id), where the memory and CPU accounting is, and that crictl statsp (containerd's
// podsandbox reads the parent, and so does the shim's SandboxMetrics) reports the VM's use: more CPU than the shim alone spends (the
// guest booted under TCG) and memory as much as the guest's RAM QEMU holds.
func checkPodCgroup(t *testing.T, e *shimtest.Env, id, parent string) {
	t.Helper()
	var qemu, kvfsd []ctrd.Process
	for _, pr := range e.C.Snapshot(t).Processes {
		switch {
		case strings.Contains(pr.Cmdline, "qemu-system"):
			qemu = append(qemu, pr)
		case strings.HasPrefix(pr.Cmdline, serverproc.Argv0):
			kvfsd = append(kvfsd, pr)
		}
	}
	if len(qemu) != 1 || len(kvfsd) == 0 {
		t.Fatalf("the pod's QEMU %v and kvfsd %v", qemu, kvfsd)
	}
	var hierarchies []string
	for _, h := range []string{"memory", "cpuacct", ""} { // v1 (this host), or v2 only
		if b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", h, parent, id, "cgroup.procs")); err == nil {
			hierarchies = append(hierarchies, h)
			for _, pr := range append(qemu, kvfsd...) {
				if !slices.Contains(strings.Fields(string(b)), strconv.Itoa(pr.PID)) {
					t.Errorf("%s is not in the pod's cgroup %s (hierarchy %q): %q", pr, filepath.Join(parent, id), h, b)
				}
			}
		}
	}
	if len(hierarchies) == 0 {
		t.Fatalf("the pod's cgroup %s is in no hierarchy", filepath.Join(parent, id))
	}
	var ps struct {
		Stats []struct {
			Linux struct {
				Memory struct{ WorkingSetBytes struct{ Value string } }
				CPU    struct{ UsageCoreNanoSeconds struct{ Value string } }
			}
		}
	}
	out := e.C.Crictl(t, "statsp", "-o", "json", "--id", id)
	if err := json.Unmarshal([]byte(out), &ps); err != nil || len(ps.Stats) != 1 {
		t.Fatalf("crictl statsp: %v\n%s", err, out)
	}
	mem, _ := strconv.ParseUint(ps.Stats[0].Linux.Memory.WorkingSetBytes.Value, 10, 64)
	cpu, _ := strconv.ParseUint(ps.Stats[0].Linux.CPU.UsageCoreNanoSeconds.Value, 10, 64)
	shmem := rssShmem(t, qemu[0].PID)
	t.Logf("crictl statsp: working set %d MiB (QEMU's RssShmem %d MiB), CPU %v", mem>>20, shmem>>20, time.Duration(cpu))
	if mem < shmem || mem < 64<<20 {
		t.Errorf("crictl statsp: working set %d bytes; want at least the guest's RAM QEMU holds (%d) and 64 MiB\n%s", mem, shmem, out)
	}
	if cpu < uint64(2*time.Second) {
		t.Errorf("crictl statsp: CPU %v; want the VM's boot's, more than 2 s\n%s", time.Duration(cpu), out)
	}
}

// checkQEMUNetNS checks that the pod's QEMU runs in the pod's network namespace, where its
// tap is, and not in containerd's (where the shim runs).
func checkQEMUNetNS(t *testing.T, e *shimtest.Env, id string) {
	t.Helper()
	var qemu []ctrd.Process
	for _, pr := range e.C.Snapshot(t).Processes {
		if strings.Contains(pr.Cmdline, "qemu-system") {
			qemu = append(qemu, pr)
		}
	}
	if len(qemu) != 1 {
		t.Fatalf("the pod's QEMU: %v", qemu)
	}
	var q, c unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", qemu[0].PID), &q); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", e.C.PID()), &c); err != nil {
		t.Fatal(err)
	}
	if q.Ino == c.Ino {
		t.Errorf("%s runs in containerd's network namespace (%d), not the pod's", qemu[0], q.Ino)
	}
	dev, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/dev", qemu[0].PID))
	if err != nil {
		t.Fatal(err)
	}
	if tap := network.TapName(id); !strings.Contains(string(dev), tap+":") {
		t.Errorf("%s's network namespace has no tap %s: its interfaces\n%s", qemu[0], tap, dev)
	}
}

// rssShmem is the shared memory (the guest's RAM, a memfd) pid has resident.
func rssShmem(t *testing.T, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`RssShmem:\s+(\d+) kB`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("no RssShmem in /proc/%d/status", pid)
	}
	kb, _ := strconv.ParseUint(string(m[1]), 10, 64)
	return kb << 10
}

// TestCRILifecycle: in a running pod, a prestart hook past its timeout fails a container's
// start (slowHook), exec -it gets a terminal that takes the size asked (containerd's CRI
// resizes it only once the process has started, so the process polls for it), crictl attach reaches a
// container's stdin and output, a container stopped and removed is created again and runs,
// and the pod's shim SIGKILLed is cleaned up after; then runp/stopp/rmp cycles (criCycles of the sandboxer) leave no process,
// mount, network namespace file, descriptor or sandbox directory behind. It runs under both
// sandboxers.
func TestCRILifecycle(t *testing.T) {
	for _, sb := range criSandboxers {
		t.Run(sb, func(t *testing.T) { testCRILifecycle(t, sb) })
	}
}

func testCRILifecycle(t *testing.T, sandboxer string) {
	hook := newSlowHook(t)
	e := shimtest.StartWith(t, "", sandboxer, []string{hook.dropin})
	before := e.C.Snapshot(t)
	p := runPod(t, e, "p2", nil)
	checkNoPause(t, e, sandboxer, p.id)
	c1 := p.container(t, "c", "echo run; exec sleep 600")
	p.waitLog(t, c1, "run")
	hook.check(t, p)

	script, err := exec.LookPath("script")
	if err != nil {
		t.Fatalf("script(1) (util-linux) is needed to give crictl a terminal: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// containerd's CRI sends the terminal's size after starting the process (as under runc): the
	// first look may see 0 0, so the process polls, for 10 s at most.
	crictl := e.C.CrictlCmd(ctx, "exec", "-it", c1, "sh", "-c",
		`tty; i=0; until [ "$(stty size 2>/dev/null)" = "33 101" ] || [ $i = 100 ]; do i=$((i+1)); sleep 0.1; done; echo "size $(stty size) after $i polls"`)
	cmd := exec.CommandContext(ctx, script, "-qec", "stty rows 33 cols 101; exec "+shimtest.ShellQuote(crictl.Args), "/dev/null")
	cmd.Env = crictl.Env
	out, err := cmd.Output()
	tty := strings.ReplaceAll(string(out), "\r", "")
	if err != nil || !strings.Contains(tty, "/dev/pts/") || !strings.Contains(tty, "size 33 101 after") {
		t.Errorf("crictl exec -it: %v, output %q; want a /dev/pts tty and the size 33 101", err, tty)
	}
	t.Logf("crictl exec -it: %q", tty)

	// crictl attach: a line to the stdin of a container reading it, its answer back.
	reader := p.containerWith(t, "reader", "echo ready; read line; echo got $line; exec sleep 600", map[string]any{"stdin": true})
	p.waitLog(t, reader, "ready")
	// Its stdin stays open until the answer has come: crictl ends the attach at its EOF.
	attach := e.C.CrictlCmd(ctx, "attach", "--stdin", reader)
	stdin, err := attach.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := attach.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var attachErr strings.Builder
	attach.Stderr = &attachErr
	if err := attach.Start(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(stdin, "hello-attach\n"); err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	go func() {
		var b strings.Builder
		buf := make([]byte, 256)
		for !strings.Contains(b.String(), "got hello-attach") {
			n, err := stdout.Read(buf)
			b.Write(buf[:n])
			if err != nil {
				break
			}
		}
		got <- b.String()
	}()
	select {
	case out := <-got:
		if !strings.Contains(out, "got hello-attach") {
			t.Errorf("crictl attach: %q, want the container's answer; stderr %s", out, attachErr.String())
		}
	case <-time.After(time.Minute):
		t.Errorf("crictl attach: no answer within a minute; stderr %s", attachErr.String())
	}
	stdin.Close()
	attach.Process.Kill()
	attach.Wait()
	p.waitLog(t, reader, "got hello-attach")
	e.C.Crictl(t, "stop", reader)
	e.C.Crictl(t, "rm", reader)

	// A container of the running pod restarted, as the kubelet does: stopped, removed,
	// created again under its name.
	e.C.Crictl(t, "stop", c1)
	e.C.Crictl(t, "rm", c1)
	c2 := p.container(t, "c", "echo run again; exec sleep 600")
	p.waitLog(t, c2, "run again")
	if n := processesOf(t, e.C, "qemu-system"); n != 1 {
		t.Errorf("%d QEMU processes after the restart, want the pod's 1", n)
	}

	// The pod's shim SIGKILLed under the running pod: containerd sees it die and runs the
	// shim binary's delete action, which stops the VM and the pod's kvfsd and removes the
	// sandbox; the container is reported exited, and stopp and rmp remove the rest.
	var shim, pod []ctrd.Process
	for _, pr := range e.C.Snapshot(t).Processes {
		switch {
		case strings.Contains(pr.Cmdline, "containerd-shim-kvfs-v2 -namespace"):
			shim = append(shim, pr)
		case strings.Contains(pr.Cmdline, "qemu-system"), strings.HasPrefix(pr.Cmdline, serverproc.Argv0):
			pod = append(pod, pr)
		}
	}
	if len(shim) != 1 || len(pod) < 2 {
		t.Fatalf("the pod's shim %v and its QEMU and kvfsd %v: want one shim, one QEMU and a kvfsd", shim, pod)
	}
	if err := syscall.Kill(shim[0].PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for ; time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		state := e.C.Crictl(t, "ps", "-a", "--quiet", "--state", "exited", "--id", c2)
		if strings.TrimSpace(state) == c2 && len(shimtest.Alive(pod)) == 0 && len(sandboxDirs(t, e)) == 0 {
			break
		}
	}
	if out := e.C.Crictl(t, "ps", "-a", "--quiet", "--state", "exited", "--id", c2); strings.TrimSpace(out) != c2 {
		t.Errorf("the shim killed: container %s is not reported exited (crictl ps -a --state exited: %q)", c2, out)
	}
	if left := shimtest.Alive(pod); len(left) > 0 {
		t.Errorf("the shim killed: the pod's processes still run 2 minutes later: %v", left)
	}
	if dirs := sandboxDirs(t, e); len(dirs) > 0 {
		t.Errorf("the shim killed: the sandbox directory is left: %q", dirs)
	}
	e.C.Crictl(t, "stopp", p.id)
	e.C.Crictl(t, "rmp", p.id)
	e.C.CheckNoLeaks(t, before)

	start := time.Now()
	cycles := criCycles[sandboxer]
	var runp time.Duration // the pod starts' share of the cycles
	for i := range cycles {
		t0 := time.Now()
		id := strings.TrimSpace(e.C.Crictl(t, "runp", "--runtime", shimtest.CRIHandler, p.config))
		runp += time.Since(t0)
		e.C.Crictl(t, "stopp", id)
		e.C.Crictl(t, "rmp", id)
		if i == 0 {
			e.C.CheckNoLeaks(t, before)
		}
	}
	t.Logf("sandboxer %s: %d runp/stopp/rmp cycles in %v; runp %v a pod", sandboxer, cycles,
		time.Since(start).Round(time.Millisecond), (runp / time.Duration(cycles)).Round(time.Millisecond))
	e.C.CheckNoLeaks(t, before)
}

// sandboxDirs are the sandbox directories in the kvfs configuration's base_dir.
func sandboxDirs(t *testing.T, e *shimtest.Env) []string {
	ents, err := os.ReadDir(e.BaseDir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, ent := range ents {
		out = append(out, ent.Name())
	}
	return out
}

// criCycles is how many pods TestCRILifecycle runs one after the other, by sandboxer: 30
// with containerd's default; 10 with the shim's. Both boot and stop the same kvfs pod, and 20
// more cycles would add some three minutes to make test's budget.
var criCycles = map[string]int{podSandboxer: 30, shimSandboxer: 10}
