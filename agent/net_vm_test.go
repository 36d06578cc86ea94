package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/nettest"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/sandbox"
	"github.com/kvfs/kvfs/sandbox/network"
)

// TestNetworkInGuest is the pod network's data path, end to end: a pod namespace with a veth
// (eth0, MTU 1400, an IPv4 and an IPv6 address, a default route) whose peer is in a "client"
// namespace; network.Attach joins it to a tap; QEMU, run in the host's namespace, gets the
// tap's descriptor as a virtio-net NIC with eth0's MAC; the agent configures the guest from
// Endpoint.AgentRequest. Then, from the client namespace, the guest's addresses answer ping
// (IPv4 and IPv6), and a TCP connection to a server in a container (busybox nc, port 8080)
// carries a line each way. All addresses are inside the test's own namespaces.
func TestNetworkInGuest(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces, mounts, QEMU)")
	}
	if testing.Short() {
		t.Skip("boots a guest under QEMU (skipped with -short)")
	}
	g := vmtest.AgentImage(t)
	accel := testAccel(t)
	ctx := context.Background()

	pod4, client4 := netip.MustParsePrefix("10.77.1.2/24"), netip.MustParsePrefix("10.77.1.1/24")
	pod6, client6 := netip.MustParsePrefix("fd77:1::2/64"), netip.MustParsePrefix("fd77:1::1/64")
	podNS, clientNS := nettest.New(t, "kvfs-vmpod"), nettest.New(t, "kvfs-vmclient")
	nettest.Veth(t, podNS, "eth0", []netip.Prefix{pod4, pod6}, clientNS, "veth-pod", []netip.Prefix{client4, client6})
	h := podNS.Handle()
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetMTU(eth0, 1400); err != nil {
		t.Fatal(err)
	}
	if err := h.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: client4.Addr().AsSlice()}); err != nil {
		t.Fatal(err)
	}
	ep, err := network.Attach(podNS.Path, network.TapName("netvm"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ep.Close()
		if err := network.Detach(podNS.Path, ep.Tap, ep.Interface.Name); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	req := ep.AgentRequest()

	s := newSandbox(t, "net", func(c *sandbox.Config) { c.VM.Memory = "512M" })
	root := busyboxRoot(t)
	serve := "#!/bin/sh\necho hello-from-the-guest\nread x\necho \"$x\" > /received\n"
	if err := os.WriteFile(filepath.Join(root, "serve.sh"), []byte(serve), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := s.Bind(root, "srv", 0); err != nil {
		t.Fatal(err)
	}

	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Root = accel, g.Kernel, g.Initrd, g.Root
	vm.NICs = []sandbox.NIC{{Tap: ep.TapFile, MAC: ep.Interface.MAC, MTU: ep.Interface.MTU}}
	start := time.Now()
	ag, diag := bootAgent(t, s, vm)
	rctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	call := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v\n%s", what, err, diag())
		}
	}
	_, err = ag.ConfigureNetwork(rctx, req)
	call("configure the network", err)

	// What the guest has: the containers share the VM's network namespace.
	_, err = ag.CreateContainer(rctx, &apiv1.CreateContainerRequest{
		ContainerId: "srv", Spec: specJSON(t, "srv", "nc", "-l", "-p", "8080", "-e", "/serve.sh"),
	})
	call("create srv", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "srv"})
	call("start srv", err)
	_, err = ag.ExecProcess(rctx, &apiv1.ExecProcessRequest{
		ContainerId: "srv", ExecId: "ip", Process: processJSON(t, "sh", "-c", "ip addr show eth0; ip route; ip -6 route"),
		Stdio: &apiv1.Stdio{Stdout: true},
	})
	call("exec ip", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "srv", ExecId: "ip"})
	call("start ip", err)
	ipOut := readAll(t, rctx, ag.ReadStdout, "srv", "ip")
	for _, want := range []string{"eth0:", "mtu 1400", "link/ether " + ep.Interface.MAC.String(), "inet 10.77.1.2/24",
		"inet6 fd77:1::2/64", "default via 10.77.1.1 dev eth0"} {
		if !strings.Contains(ipOut, want) {
			t.Errorf("the guest's ip output lacks %q:\n%s", want, ipOut)
		}
	}

	// From the client's namespace: ping, IPv4 and IPv6. A child forked by a thread in a
	// namespace starts in it.
	for _, addr := range []string{pod4.Addr().String(), pod6.Addr().String()} {
		var out []byte
		err := clientNS.Do(func() error {
			var err error
			out, err = exec.Command("busybox", "ping", "-c", "3", "-W", "5", addr).CombinedOutput()
			return err
		})
		if err != nil {
			t.Errorf("ping %s from the client namespace: %v\n%s\n%s", addr, err, out, diag())
		} else {
			t.Logf("ping %s:\n%s", addr, out)
		}
	}

	// A TCP connection from the client to the container's server, a line each way.
	var conn net.Conn
	deadline := time.Now().Add(time.Minute)
	for {
		err = clientNS.Do(func() error {
			var err error
			conn, err = net.DialTimeout("tcp", net.JoinHostPort(pod4.Addr().String(), "8080"), 5*time.Second)
			return err
		})
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	call("connect to the guest's port 8080 from the client namespace", err)
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(time.Minute))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || line != "hello-from-the-guest\n" {
		t.Errorf("the server's line: %q, %v", line, err)
	}
	_, err = fmt.Fprintln(conn, "from-the-client")
	call("write to the guest", err)
	w, err := ag.WaitProcess(rctx, &apiv1.WaitProcessRequest{ContainerId: "srv"})
	call("wait srv", err)
	if w.ExitStatus != 0 {
		t.Errorf("the server exited %d", w.ExitStatus)
	}
	if b, err := os.ReadFile(filepath.Join(root, "received")); err != nil || string(b) != "from-the-client\n" {
		t.Errorf("what the server received, read on the host through the share: %q, %v", b, err)
	}
	_, err = ag.DeleteProcess(rctx, &apiv1.DeleteProcessRequest{ContainerId: "srv", ExecId: "ip"})
	call("delete ip", err)
	_, err = ag.DeleteProcess(rctx, &apiv1.DeleteProcessRequest{ContainerId: "srv"})
	call("delete srv", err)

	// This host does not hang up after Shutdown: the agent waits hostHangup for it, then
	// powers off (TestAgentInGuest hangs up).
	_, err = ag.Shutdown(rctx, &apiv1.ShutdownRequest{})
	call("shutdown", err)
	select {
	case <-s.VMExited():
	case <-time.After(time.Minute):
		t.Fatalf("QEMU still runs a minute after Shutdown\n%s", diag())
	}
	t.Logf("done after %v", time.Since(start).Round(time.Millisecond))
}
