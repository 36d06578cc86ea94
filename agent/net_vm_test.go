package agent_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

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
// Endpoint.AgentRequest. Root in the guest (an exec with CAP_NET_ADMIN and CAP_NET_RAW) then
// pings the client from an IPv4 and an IPv6 address the pod does not have and from a MAC
// not the NIC's: a packet socket on the client's end of the veth sees none of those frames
// (the tap's guard drops them), only the NIC's MAC and the pod's addresses, and the guest's
// own ping is answered. Then, from the client namespace, the guest's addresses answer ping
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

	// Root in the guest forges its source: an address the pod does not have (IPv4 and
	// IPv6), then a MAC not the NIC's. The tap's guard drops all of it: the client's side of
	// the veth sees only the NIC's MAC and the pod's addresses, and the guest, its own again,
	// still reaches the client.
	capture := captureFrames(t, clientNS, "veth-pod")
	spoof := fmt.Sprintf(`ip addr add 10.77.1.99/24 dev eth0
ip -6 addr add fd77:1::99/64 dev eth0
i=0; while ip -6 addr show dev eth0 | grep fd77:1::99 | grep -q tentative && [ $i -lt 40 ]; do sleep 0.5; i=$((i+1)); done
ip -6 addr show dev eth0 | grep fd77:1::99 | grep -vq tentative; echo ipv6-ready $?
ping -c 2 -W 3 -I 10.77.1.99 10.77.1.1 >/dev/null; echo forged-ipv4 $?
ping -6 -c 2 -W 3 -I fd77:1::99 fd77:1::1 >/dev/null; echo forged-ipv6 $?
ip addr del 10.77.1.99/24 dev eth0
ip -6 addr del fd77:1::99/64 dev eth0
ip link set eth0 address 02:00:00:00:00:99; echo set-mac $?
ping -c 2 -W 3 10.77.1.1 >/dev/null; echo forged-mac $?
ip link set eth0 address %s; echo reset-mac $?
ping -c 2 -W 10 10.77.1.1 >/dev/null; echo own $?
`, ep.Interface.MAC)
	forger := process("sh", "-c", spoof)
	netCaps := []string{"CAP_NET_ADMIN", "CAP_NET_RAW"}
	forger.Capabilities = &specs.LinuxCapabilities{Bounding: netCaps, Effective: netCaps, Permitted: netCaps}
	forgerJSON, err := json.Marshal(forger)
	if err != nil {
		t.Fatal(err)
	}
	_, err = ag.ExecProcess(rctx, &apiv1.ExecProcessRequest{
		ContainerId: "srv", ExecId: "spoof", Process: forgerJSON, Stdio: &apiv1.Stdio{Stdout: true},
	})
	call("exec spoof", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "srv", ExecId: "spoof"})
	call("start spoof", err)
	spoofOut := readAll(t, rctx, ag.ReadStdout, "srv", "spoof")
	frames := capture()
	t.Logf("the guest's forging:\n%s", spoofOut)
	for _, want := range []string{"forged-ipv4 1", "ipv6-ready 0", "forged-ipv6 1", "set-mac 0", "forged-mac 1", "reset-mac 0", "own 0"} {
		if !strings.Contains(spoofOut, want+"\n") {
			t.Errorf("the guest's forging printed no %q (1: the ping got no answer)", want)
		}
	}
	mac := ep.Interface.MAC
	linkLocal := netip.AddrFrom16([16]byte{0: 0xfe, 1: 0x80, 8: mac[0] ^ 2, 9: mac[1], 10: mac[2], 11: 0xff, 12: 0xfe, 13: mac[3], 14: mac[4], 15: mac[5]})
	var own int
	for _, f := range frames {
		switch {
		case f.mac.String() != mac.String():
			t.Errorf("a frame from a forged MAC reached the client: %v", f)
		case f.src.IsValid() && !slices.Contains([]netip.Addr{pod4.Addr(), pod6.Addr(), linkLocal, netip.IPv6Unspecified()}, f.src):
			t.Errorf("a frame from a forged address reached the client: %v", f)
		case f.src == pod4.Addr():
			own++
		}
	}
	if own == 0 {
		t.Errorf("no frame from the guest's own MAC and address reached the client (%d frames)", len(frames))
	}
	_, err = ag.DeleteProcess(rctx, &apiv1.DeleteProcessRequest{ContainerId: "srv", ExecId: "spoof"})
	call("delete spoof", err)

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

// capturedFrame is what captureFrames records of a frame: its source MAC, and its source
// address (IPv4, IPv6 or ARP's sender protocol address; none for other frames).
type capturedFrame struct {
	mac       net.HardwareAddr
	etherType uint16
	src       netip.Addr
}

func (f capturedFrame) String() string {
	return fmt.Sprintf("%v type %#04x from %v", f.mac, f.etherType, f.src)
}

// captureFrames records the frames arriving on the interface named iface in ns (a packet
// socket) until the function it returns is called, which returns them.
func captureFrames(t *testing.T, ns *nettest.NS, iface string) func() []capturedFrame {
	t.Helper()
	const ethPAll = 0x0300 // htons(ETH_P_ALL)
	var fd int
	err := ns.Do(func() error {
		l, err := net.InterfaceByName(iface)
		if err != nil {
			return err
		}
		if fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, ethPAll); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: ethPAll, Ifindex: l.Index})
	})
	if err != nil {
		t.Fatalf("a packet socket on %s: %v", iface, err)
	}
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 200000}); err != nil {
		t.Fatal(err)
	}
	var stop atomic.Bool
	done := make(chan []capturedFrame)
	go func() {
		defer unix.Close(fd)
		var frames []capturedFrame
		buf := make([]byte, 65536)
		for !stop.Load() {
			n, from, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				continue // the timeout, to look at stop
			}
			if ll, ok := from.(*unix.SockaddrLinklayer); (ok && ll.Pkttype == unix.PACKET_OUTGOING) || n < 14 {
				continue
			}
			b := buf[:n]
			f := capturedFrame{mac: slices.Clone(net.HardwareAddr(b[6:12])), etherType: binary.BigEndian.Uint16(b[12:14])}
			switch {
			case f.etherType == unix.ETH_P_IP && n >= 34:
				f.src, _ = netip.AddrFromSlice(b[26:30])
			case f.etherType == unix.ETH_P_ARP && n >= 42:
				f.src, _ = netip.AddrFromSlice(b[28:32])
			case f.etherType == unix.ETH_P_IPV6 && n >= 54:
				f.src, _ = netip.AddrFromSlice(b[22:38])
			}
			frames = append(frames, f)
		}
		done <- frames
	}()
	return func() []capturedFrame {
		stop.Store(true)
		return <-done
	}
}
