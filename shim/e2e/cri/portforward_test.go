package cri

import (
	"bufio"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/shimtest"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
)

// TestCRIPortForward: crictl port-forward, as kubectl port-forward goes through the kubelet,
// reaches the pod's servers in the guest through containerd's CRI, which dials the pod's
// localhost on the host: a web server bound to the guest's 127.0.0.1 alone serves its page,
// a line server on every address answers its line, and a port nothing listens on in the guest
// fails the forwarded connection with an error. It runs under both sandboxers.
func TestCRIPortForward(t *testing.T) {
	for _, sb := range criSandboxers {
		t.Run(sb, func(t *testing.T) { testCRIPortForward(t, sb) })
	}
}

func testCRIPortForward(t *testing.T, sandboxer string) {
	e := shimtest.Start(t, "", sandboxer)
	before := e.C.Snapshot(t)
	p := runPod(t, e, "pf", nil)
	web := p.container(t, "web", `mkdir -p /www && echo hello-from-httpd > /www/index.html
busybox httpd -p 127.0.0.1:8080 -h /www && echo web-started
exec busybox nc -ll -p 9090 -e sh -c 'read l; echo "echo $l"'`)
	p.waitLog(t, web, "web-started")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fwd := e.C.CrictlCmd(ctx, "port-forward", p.id, "18080:8080", "19090:9090", "19999:9999")
	stdout, err := fwd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr syncbuf.Buffer
	fwd.Stderr = &stderr
	if err := fwd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cancel()
		fwd.Wait()
	}()
	// crictl says "Forwarding from 127.0.0.1:LOCAL -> PORT" for each port once it listens.
	lines := bufio.NewScanner(stdout)
	var out []string
	for listening := 0; listening < 3 && lines.Scan(); {
		out = append(out, lines.Text())
		if strings.HasPrefix(lines.Text(), "Forwarding from 127.0.0.1:") {
			listening++
		}
	}
	if len(out) == 0 || !strings.Contains(strings.Join(out, "\n"), "127.0.0.1:19999") {
		t.Fatalf("crictl port-forward does not listen: %q\n%s", out, stderr.String())
	}
	go io.Copy(io.Discard, stdout)

	// The server bound to the guest's loopback alone.
	if got, err := e.C.InNetNS(ctx, "busybox", "wget", "-q", "-O", "-", "http://127.0.0.1:18080/").CombinedOutput(); err != nil || string(got) != "hello-from-httpd\n" {
		t.Errorf("the guest's 127.0.0.1:8080 through port-forward: %q, %v; want hello-from-httpd\n%s", got, err, stderr.String())
	}
	// A server on every address, a line protocol. The client's input stays open until the
	// answer has come: containerd ends a forwarded connection a second after either side's
	// end of file, as it does for runc, and a server the guest forks under TCG may take
	// longer to answer. The server's end reaches the client (nc ends with it).
	if got, err := e.C.InNetNS(ctx, "sh", "-c", "(echo ping; sleep 5) | busybox nc 127.0.0.1 19090").CombinedOutput(); err != nil || string(got) != "echo ping\n" {
		t.Errorf("the guest's port 9090 through port-forward: %q, %v; want \"echo ping\"\n%s", got, err, stderr.String())
	}
	// Nothing listens on 9999 in the guest: the forwarded connection fails, and crictl says so
	// (the relay's reset, where runc's pod would have refused containerd's dial).
	if got, err := e.C.InNetNS(ctx, "busybox", "wget", "-q", "-O", "-", "http://127.0.0.1:19999/").CombinedOutput(); err == nil {
		t.Errorf("port 9999, where nothing listens in the guest, answered through port-forward: %q", got)
	}
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(stderr.String(), "port 9999"); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Errorf("crictl port-forward reported no error for port 9999:\n%s", stderr.String())
			break
		}
	}
	if !strings.Contains(stderr.String(), "connection reset by peer") {
		t.Errorf("crictl port-forward's error for port 9999 is not the relay's reset:\n%s", stderr.String())
	}
	cancel()
	fwd.Wait()

	e.C.Crictl(t, "stopp", p.id)
	e.C.Crictl(t, "rmp", p.id)
	e.C.CheckNoLeaks(t, before)
}
