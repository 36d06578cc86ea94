package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/plugins/snapshots/overlay/overlayutils"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/defaults"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	cshim "github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"

	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/sandbox"
)

// RuntimeName is the runtime type containerd knows the shim by.
const RuntimeName = "io.containerd.kvfs.v2"

// Manager is the shim's bootstrap side (containerd's pkg/shim.Shim): the short-lived start
// and delete actions, and -info.
type Manager struct {
	name string
	// defaultConfig is the sandbox configuration -info reads when its options name none
	// (DefaultConfigPath).
	defaultConfig string
}

var _ cshim.Shim = Manager{}

// NewManager returns the manager of runtime name.
func NewManager(name string) Manager { return Manager{name: name, defaultConfig: DefaultConfigPath} }

// Name implements shim.Shim.
func (m Manager) Name() string { return m.name }

// groupAnnotations is the part of a bundle's config.json Start reads.
type groupAnnotations struct {
	Annotations map[string]string `json:"annotations,omitempty"`
}

// Start implements shim.Shim: one shim per pod. The container's sandbox (SandboxID) names
// the shim's socket; if a shim already serves it, its address is the answer, else a new shim
// process is started on a new socket, in a session of its own, the listening socket passed as
// fd 3.
func (m Manager) Start(ctx context.Context, params *bootapi.BootstrapParams) (_ *bootapi.BootstrapResult, retErr error) {
	id := params.GetInstanceID()
	var spec groupAnnotations
	switch b, err := os.ReadFile("config.json"); {
	case errors.Is(err, os.ErrNotExist):
		// A sandbox of containerd's Sandbox API (CRI's sandboxer "shim") has no spec: the
		// shim is the pod's, named by its id.
	case err != nil:
		return nil, fmt.Errorf("the bundle's spec: %w", err)
	default:
		if err := json.Unmarshal(b, &spec); err != nil {
			return nil, fmt.Errorf("the bundle's spec: %w", err)
		}
	}
	if err := keepRuntimeOptions(".", params); err != nil {
		return nil, err
	}
	grouping, err := SandboxID(id, spec.Annotations)
	if err != nil {
		return nil, err
	}
	socketDir := params.GetSocketDir()
	if socketDir == "" {
		socketDir = filepath.Join(defaults.DefaultStateDir, "s")
	}
	address, err := cshim.CreateSocketAddress(ctx, socketDir, params.GetContainerdGrpcAddress(), grouping, false)
	if err != nil {
		return nil, err
	}
	result := &bootapi.BootstrapResult{Version: 3, Protocol: "ttrpc", Address: address}

	l, err := cshim.NewSocket(address)
	if err != nil {
		if !cshim.SocketEaddrinuse(err) {
			return nil, fmt.Errorf("create the shim socket: %w", err)
		}
		if cshim.CanConnect(address) {
			// The pod's shim serves already: this container joins it.
			if err := os.WriteFile("address", []byte(address), 0o600); err != nil {
				return nil, err
			}
			return result, nil
		}
		if err := cshim.RemoveSocket(address); err != nil {
			return nil, fmt.Errorf("remove a stale shim socket: %w", err)
		}
		if l, err = cshim.NewSocket(address); err != nil {
			return nil, fmt.Errorf("create the shim socket: %w", err)
		}
	}
	// This process exits soon; closing its copy of the listener must not unlink the socket the
	// shim serves.
	l.SetUnlinkOnClose(false)
	defer func() {
		l.Close()
		if retErr != nil {
			_ = cshim.RemoveSocket(address)
		}
	}()
	f, err := l.File()
	if err != nil {
		return nil, err
	}
	defer f.Close()

	cmd, err := shimCommand(ctx, id, params)
	if err != nil {
		return nil, err
	}
	cmd.ExtraFiles = []*os.File{f}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the shim: %w", err)
	}
	defer func() {
		if retErr != nil {
			_ = cmd.Process.Kill()
		}
	}()
	go func() { _ = cmd.Wait() }()
	if err := os.WriteFile("address", []byte(address), 0o600); err != nil {
		return nil, err
	}
	if err := cshim.AdjustOOMScore(cmd.Process.Pid); err != nil {
		log.G(ctx).WithError(err).Warn("adjusting the shim's OOM score")
	}
	return result, nil
}

func shimCommand(ctx context.Context, id string, params *bootapi.BootstrapParams) (*exec.Cmd, error) {
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cwd, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	args := []string{"-namespace", ns, "-id", id, "-address", params.GetContainerdGrpcAddress()}
	if params.GetLogLevel() <= bootapi.LogLevel_LOG_LEVEL_DEBUG {
		args = append(args, "-debug")
	}
	cmd := exec.Command(self, args...)
	cmd.Dir = cwd
	cmd.Env = append(os.Environ(), "GOMAXPROCS=2")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	return cmd, nil
}

// Stop implements shim.Shim: the delete action, run in a bundle after its shim died. It
// unmounts the container's rootfs, cleans up the sandbox the bundle names (its VM killed,
// mounts detached, directory removed) unless a live shim still owns it, removes the dead
// shim's socket, and answers exit status 137 (SIGKILL), as runc's shim does.
func (m Manager) Stop(ctx context.Context, id string) (cshim.StopStatus, error) {
	cwd, err := os.Getwd()
	if err != nil {
		return cshim.StopStatus{}, err
	}
	bundle := filepath.Join(filepath.Dir(cwd), id)
	if err := Cleanup(ctx, bundle); err != nil {
		log.G(ctx).WithError(err).Warn("cleaning up after the shim")
	}
	// A shim that was killed left its socket: remove it unless a shim serves it.
	if addr, err := bundleShimAddress(bundle); err == nil && !cshim.CanConnect(addr) {
		if err := cshim.RemoveSocket(addr); err != nil && !errors.Is(err, os.ErrNotExist) {
			log.G(ctx).WithError(err).Warn("removing the dead shim's socket")
		}
	}
	return cshim.StopStatus{ExitedAt: time.Now(), ExitStatus: 128 + int(syscall.SIGKILL)}, nil
}

// cleanupWait bounds the delete action's wait for another delete action holding the
// sandbox, and for the sandbox's killed processes to leave its cgroup.
const cleanupWait = 10 * time.Second

// shimServes reports whether a shim answers at the address recorded in bundle.
func shimServes(bundle string) bool {
	addr, err := bundleShimAddress(bundle)
	return err == nil && cshim.CanConnect(addr)
}

// bundleShimAddress is the address of the shim that serves bundle's task. The bundle of a
// shim containerd started has its "address" (the shim writes it); the bundle of a container
// that joined its pod's shim (a shim of version 3, as ours) has none, only containerd's
// bootstrap.json, with the pod shim's address.
func bundleShimAddress(bundle string) (string, error) {
	addr, err := cshim.ReadAddress(filepath.Join(bundle, "address"))
	if !errors.Is(err, os.ErrNotExist) {
		return addr, err
	}
	data, err := os.ReadFile(filepath.Join(bundle, "bootstrap.json"))
	if err != nil {
		return "", err
	}
	var params struct {
		Address string `json:"address"`
	}
	if err := json.Unmarshal(data, &params); err != nil {
		return "", fmt.Errorf("%s: %w", filepath.Join(bundle, "bootstrap.json"), err)
	}
	if params.Address == "" {
		return "", fmt.Errorf("%s: %w", filepath.Join(bundle, "bootstrap.json"), cshim.ErrNoAddress)
	}
	return params.Address, nil
}

// Cleanup undoes on the host what a dead shim left of the container in bundle: the rootfs
// mount, a Sandbox-API sandbox's pod files, and the sandbox the bundle names, unless its
// owner lives.
func Cleanup(ctx context.Context, bundle string) error {
	var errs []error
	if err := mount.UnmountRecursive(filepath.Join(bundle, "rootfs"), 0); err != nil {
		errs = append(errs, fmt.Errorf("unmount the rootfs: %w", err))
	}
	if err := unmountPodFiles(filepath.Join(bundle, podFilesDir)); err != nil {
		errs = append(errs, err)
	}
	rec, err := readBundleRecord(bundle)
	switch {
	case errors.Is(err, os.ErrNotExist):
		// Create never got as far as the sandbox.
	case err != nil:
		errs = append(errs, err)
	default:
		err := sandbox.Cleanup(ctx, rec.BaseDir, rec.SandboxID)
		// containerd runs the delete action of each of a dead shim's containers at once: the
		// sandbox's lock may be another one's, cleaning up. Wait for it while no shim serves
		// the pod.
		for deadline := time.Now().Add(cleanupWait); errors.Is(err, sandbox.ErrInUse) && !shimServes(bundle) && time.Now().Before(deadline); {
			time.Sleep(100 * time.Millisecond)
			err = sandbox.Cleanup(ctx, rec.BaseDir, rec.SandboxID)
		}
		switch {
		case errors.Is(err, sandbox.ErrInUse):
		case err != nil:
			errs = append(errs, err)
		case rec.Cgroup != "":
			// The sandbox's processes are killed: its cgroup goes once they are gone (a
			// systemd scope is stopped).
			err := removePodCgroup(ctx, rec.Cgroup)
			for deadline := time.Now().Add(cleanupWait); err != nil && time.Now().Before(deadline); {
				time.Sleep(100 * time.Millisecond)
				err = removePodCgroup(ctx, rec.Cgroup)
			}
			if err != nil {
				errs = append(errs, err)
			}
		}
		_ = os.Remove(filepath.Join(bundle, bundleRecordName))
	}
	return errors.Join(errs...)
}

// Info implements shim.Shim: the runtime's name and version, the options it was given, and
// its features (podFeatures) from the guest image the sandbox configuration the options
// name (or the node's, or the defaults) boots. Without an image description to read them
// from, the answer has no features, and says why in the log.
func (m Manager) Info(ctx context.Context, optionsR io.Reader) (*types.RuntimeInfo, error) {
	info := &types.RuntimeInfo{Name: m.name, Version: &types.RuntimeVersion{Version: Version}}
	data, err := io.ReadAll(optionsR)
	if err != nil {
		return nil, fmt.Errorf("read the runtime options: %w", err)
	}
	var opts *anypb.Any
	if len(data) > 0 {
		opts = &anypb.Any{}
		if err := proto.Unmarshal(data, opts); err != nil {
			return nil, fmt.Errorf("read the runtime options: %w", err)
		}
		info.Options = opts
	}
	path, body, err := ConfigSource(opts)
	if err != nil {
		return nil, err
	}
	cfg, err := loadConfig(path, body, m.defaultConfig)
	if err != nil {
		return nil, err
	}
	root := cfg.VM.Root()
	desc, err := guestimage.ReadDescription(root)
	switch {
	case err != nil:
		log.G(ctx).WithError(err).Warn("no features: cannot read the guest image's description")
	case desc.Runtime.Features == nil:
		log.G(ctx).WithField("root", root).Warn("no features: the guest image does not say what its runtime supports (an image built before kvfs recorded it)")
	default:
		idmapped, err := overlayutils.SupportsIDMappedMounts()
		if err != nil {
			log.G(ctx).WithError(err).Warn("no idmapped mounts: cannot tell whether the kernel makes them")
		}
		if info.Features, err = typeurl.MarshalAnyToProto(podFeatures(desc.Runtime.Features, idmapped)); err != nil {
			return nil, err
		}
	}
	return info, nil
}
