package sandbox

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// frontendRunner is a VMRunner whose "VM" is the in-repo front-end (virtiofs/testing/frontend), a
// fake guest driver: Run connects it to the socket QEMU would be given, as QEMU's realize and
// start do, and sends the guest kernel's FUSE INIT, then boot's requests. It stands in for a boot
// where hundreds of them are needed (a TCG boot takes 10-20 s here).
type frontendRunner struct {
	opts frontend.Options
	// boot, if set, sends the guest's first requests once INIT is answered.
	boot func(ctx context.Context, c *fuseclient.Client) error

	mu  sync.Mutex
	vms []*frontendVM // guarded by mu
}

func (r *frontendRunner) Run(ctx context.Context, cmd VMCommand) (Process, error) {
	sock, err := vmSocket(cmd.Args)
	if err != nil {
		return nil, err
	}
	fe, err := frontend.Dial(ctx, sock, r.opts)
	if err != nil {
		return nil, err
	}
	c := fuseclient.New(fe)
	if _, err := c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		fe.Close()
		return nil, fmt.Errorf("INIT: %w", err)
	}
	if r.boot != nil {
		if err := r.boot(ctx, c); err != nil {
			fe.Close()
			return nil, fmt.Errorf("boot: %w", err)
		}
	}
	vm := &frontendVM{fe: fe, client: c, exited: make(chan struct{})}
	r.mu.Lock()
	r.vms = append(r.vms, vm)
	r.mu.Unlock()
	return vm, nil
}

// last returns the VM Run started last.
func (r *frontendRunner) last() *frontendVM {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.vms[len(r.vms)-1]
}

// vmSocket returns the vhost-user socket in QEMU's arguments (VM.Args).
func vmSocket(args []string) (string, error) {
	prefix := "socket,id=" + fsCharID + ",path="
	for i := 1; i < len(args); i++ {
		if p, ok := strings.CutPrefix(args[i], prefix); ok && args[i-1] == "-chardev" {
			return p, nil
		}
	}
	return "", fmt.Errorf("no -chardev %s... in %q", prefix, args)
}

// frontendVM is the Process of a frontendRunner's VM: any signal disconnects the front-end,
// as QEMU's exit does.
type frontendVM struct {
	fe     *frontend.Frontend
	client *fuseclient.Client
	once   sync.Once
	exited chan struct{}
}

func (v *frontendVM) Pid() int { return 0 }

func (v *frontendVM) Signal(os.Signal) error {
	if isClosed(v.exited) {
		return os.ErrProcessDone
	}
	v.once.Do(func() {
		v.fe.Close()
		close(v.exited)
	})
	return nil
}

func (v *frontendVM) Exited() <-chan struct{} { return v.exited }
func (v *frontendVM) ExitErr() error          { return nil }
