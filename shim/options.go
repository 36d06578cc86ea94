package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	runcoptions "github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/kvfs/kvfs/sandbox"
)

// Version is the shim's version, answered by Connect and -info.
const Version = "0.1.0"

// CRI's annotations that group a pod's containers.
const (
	AnnotationSandboxID     = "io.kubernetes.cri.sandbox-id"
	AnnotationContainerType = "io.kubernetes.cri.container-type"
	containerTypeSandbox    = "sandbox"
	containerTypeContainer  = "container"
)

// SandboxID decides which pod a container belongs to, from its spec's annotations: the
// sandbox CRI names, or, without CRI's annotations (ctr, nerdctl), a pod of its own named
// after the container. A CRI container (type "container") without a sandbox id is an error.
func SandboxID(containerID string, annotations map[string]string) (string, error) {
	typ := annotations[AnnotationContainerType]
	sb := annotations[AnnotationSandboxID]
	switch {
	case typ == containerTypeSandbox && sb != "" && sb != containerID:
		return "", fmt.Errorf("sandbox container %s names another sandbox %q", containerID, sb)
	case sb != "":
		return sb, nil
	case typ == containerTypeContainer:
		return "", fmt.Errorf("container %s is a CRI container (%s=%s) without %s", containerID, AnnotationContainerType, typ, AnnotationSandboxID)
	case typ != "" && typ != containerTypeSandbox:
		return "", fmt.Errorf("container %s: unknown %s %q", containerID, AnnotationContainerType, typ)
	}
	return containerID, nil
}

// ConfigSource decodes Create's options: a runtimeoptions.Options (what ctr
// --runtime-config-path and CRI's ConfigPath send) gives the path of the sandbox
// configuration, or its body. No options: both empty. runc's options with nothing but IoUid
// and IoGid, which containerd's CRI gives a user-namespaced container's task when its runtime
// handler has no options, are as none: the owner of the stdio they set is runc's shim's
// concern, the kvfs shim's stdio is its own on the host. (containerd's Sandbox API adds
// TaskApiAddress and TaskApiVersion to them, the sandbox's own task API, which is this shim.)
func ConfigSource(opts *anypb.Any) (path string, body []byte, err error) {
	if opts == nil || (opts.GetTypeUrl() == "" && len(opts.GetValue()) == 0) {
		return "", nil, nil
	}
	v, err := typeurl.UnmarshalAny(opts)
	if err != nil {
		return "", nil, fmt.Errorf("runtime options (%s): %v", opts.GetTypeUrl(), err)
	}
	if rc, ok := v.(*runcoptions.Options); ok {
		taken := &runcoptions.Options{IoUid: rc.GetIoUid(), IoGid: rc.GetIoGid(), TaskApiAddress: rc.GetTaskApiAddress(), TaskApiVersion: rc.GetTaskApiVersion()}
		if !proto.Equal(rc, taken) {
			return "", nil, fmt.Errorf("runc's runtime options %v: only IoUid and IoGid are taken (and ignored)", rc)
		}
		return "", nil, nil
	}
	ro, ok := v.(*runtimeoptions.Options)
	if !ok {
		return "", nil, fmt.Errorf("runtime options of type %s: want %s (ConfigPath)", opts.GetTypeUrl(), "runtimeoptions.v1.Options")
	}
	if p := ro.GetConfigPath(); p != "" && !filepath.IsAbs(p) {
		return "", nil, fmt.Errorf("runtime options: ConfigPath %q is not an absolute path", p)
	}
	return ro.GetConfigPath(), ro.GetConfigBody(), nil
}

// bundleRecord is what a container's bundle tells the delete action (Manager.Stop), which
// runs after the shim died: which sandbox to clean up.
type bundleRecord struct {
	SandboxID string `json:"sandbox_id"`
	BaseDir   string `json:"base_dir"`
	// Cgroup is the pod's host cgroup the shim joined (PodRequest.Cgroup), if any: removed
	// once the sandbox is.
	Cgroup string `json:"cgroup,omitempty"`
}

const bundleRecordName = "kvfs-sandbox.json"

func writeBundleRecord(bundle string, r bundleRecord) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(bundle, bundleRecordName), b, 0o600)
}

func readBundleRecord(bundle string) (*bundleRecord, error) {
	b, err := os.ReadFile(filepath.Join(bundle, bundleRecordName))
	if err != nil {
		return nil, err
	}
	var r bundleRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(bundle, bundleRecordName), err)
	}
	if r.SandboxID == "" || r.BaseDir == "" {
		return nil, errors.New(filepath.Join(bundle, bundleRecordName) + ": incomplete")
	}
	return &r, nil
}

// runtimeOptionsName is where the start action keeps, in the bundle, the runtime options
// containerd started the shim with (BootstrapParams' runtimeoptions.v1.Options extension):
// the Sandbox API's CreateSandbox does not carry them, and the sandbox's configuration
// (ConfigPath) is there.
const runtimeOptionsName = "kvfs-runtime-options.binpb"

// keepRuntimeOptions writes params' runtime options into bundle, if it has any.
func keepRuntimeOptions(bundle string, params *bootapi.BootstrapParams) error {
	var ro runtimeoptions.Options
	found, err := params.FindExtension(&ro)
	if err != nil {
		return fmt.Errorf("the bootstrap's runtime options: %w", err)
	}
	if !found {
		return nil
	}
	b, err := proto.Marshal(&ro)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(bundle, runtimeOptionsName), b, 0o600)
}

// readRuntimeOptions reads what keepRuntimeOptions kept in bundle, as the Any ConfigSource
// decodes; none kept is no options.
func readRuntimeOptions(bundle string) (*anypb.Any, error) {
	b, err := os.ReadFile(filepath.Join(bundle, runtimeOptionsName))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("the shim's runtime options: %w", err)
	}
	var ro runtimeoptions.Options
	if err := proto.Unmarshal(b, &ro); err != nil {
		return nil, fmt.Errorf("the shim's runtime options %s: %w", filepath.Join(bundle, runtimeOptionsName), err)
	}
	return typeurl.MarshalAnyToProto(&ro)
}

// DefaultConfigPath is where the node's sandbox configuration is, if it has one.
const DefaultConfigPath = "/etc/kvfs/configuration.toml"

// ConfigFileEnv is the environment variable that names the sandbox configuration in place of
// DefaultConfigPath, for a runtime handler without options: set in containerd's environment,
// its shims inherit it. Such a handler is what runs user-namespaced CRI pods: containerd's
// CRI (v2.4) gives their tasks runc's options (IoUid, IoGid), and fails on a handler whose
// options are of another type, as ConfigPath's are.
const ConfigFileEnv = "KVFS_CONFIG_FILE"

// loadConfig reads the sandbox configuration runtime options give (runtimeoptions'
// ConfigBody, else ConfigPath), else the file $KVFS_CONFIG_FILE names (ConfigFileEnv), else
// defaultPath if it exists, else the defaults.
func loadConfig(path string, body []byte, defaultPath string) (*sandbox.Config, error) {
	switch {
	case len(body) > 0:
		return sandbox.ParseConfig(body)
	case path != "":
		return sandbox.LoadConfig(path)
	}
	if env := os.Getenv(ConfigFileEnv); env != "" {
		if !filepath.IsAbs(env) {
			return nil, fmt.Errorf("%s=%q: not an absolute path", ConfigFileEnv, env)
		}
		return sandbox.LoadConfig(env)
	}
	if _, err := os.Stat(defaultPath); err == nil {
		return sandbox.LoadConfig(defaultPath)
	}
	return sandbox.DefaultConfig(), nil
}
