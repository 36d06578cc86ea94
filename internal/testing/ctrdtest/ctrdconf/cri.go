package ctrdconf

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// The CRI's network: a CNI bridge network whose bridge is in the containerd's own network
// namespace (the caller's to make and enter), so its addresses and traffic stay there.
const (
	// PodSubnet is where the pods' addresses come from.
	PodSubnet = "10.99.0.0/24"
	// PodGateway is the bridge's address.
	PodGateway = "10.99.0.1"
	// cniNetwork is the network's name, cniBridge its bridge's.
	cniNetwork = "kvfstest"
	cniBridge  = "kvfsbr0"
	// cniBinDir is where Debian's containernetworking-plugins installs the plugins.
	cniBinDir = "/usr/lib/cni"
)

// CRINamespace is the containerd namespace of everything the CRI makes.
const CRINamespace = "k8s.io"

// PauseImage is the pod sandbox image the CRI is pinned to; the caller imports it into
// CRINamespace (there is no registry to pull the real pause image from).
const PauseImage = "localhost/pause:kvfs-test"

// The CRI's files and directories in the containerd's directory.
const (
	cniConfDir  = "cni/net.d"
	cniDataDir  = "cni/ipam"
	crictlYAML  = "crictl.yaml"
	runcRootDir = "runc"
)

// criConfig is the CRI's part of the config.toml of a containerd in dir: CNI from cniBinDir
// with the network WriteCRIFiles writes in dir, network namespaces under the containerd's
// state directory (not the machine's /var/run/netns), the OOM score restricted (these
// machines lack CAP_SYS_RESOURCE), the streaming server on a free loopback port, the sandbox
// image pinned to PauseImage, and the runtime handler runc (io.containerd.runc.v2) with its
// state under dir. Other runtimes are the caller's to add in Config's extra
// ([plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.NAME]).
func criConfig(dir string) map[string]any {
	return map[string]any{"plugins": map[string]any{
		"io.containerd.cri.v1.runtime": map[string]any{
			"enable_selinux":               false,
			"restrict_oom_score_adj":       true,
			"netns_mounts_under_state_dir": true,
			"cni": map[string]any{
				"bin_dirs":     []any{cniBinDir},
				"conf_dir":     filepath.Join(dir, cniConfDir),
				"max_conf_num": int64(1),
			},
			"containerd": map[string]any{
				"default_runtime_name": "runc",
				"runtimes": map[string]any{
					"runc": map[string]any{
						"runtime_type": "io.containerd.runc.v2",
						"options":      map[string]any{"Root": filepath.Join(dir, runcRootDir)},
					},
				},
			},
		},
		"io.containerd.cri.v1.images": map[string]any{
			"snapshotter":   "overlayfs",
			"pinned_images": map[string]any{"sandbox": PauseImage},
		},
		"io.containerd.grpc.v1.cri": map[string]any{
			"disable_tcp_service":   true,
			"stream_server_address": "127.0.0.1",
			"stream_server_port":    "0",
		},
	}}
}

// cniConfList is the CRI's network: a bridge (the pods' gateway), host-local addresses from
// PodSubnet kept in dir, a default route through the bridge.
func cniConfList(dir string) ([]byte, error) {
	return json.MarshalIndent(map[string]any{
		"cniVersion": "1.0.0",
		"name":       cniNetwork,
		"plugins": []any{map[string]any{
			"type":      "bridge",
			"bridge":    cniBridge,
			"isGateway": true,
			"ipMasq":    false,
			"ipam": map[string]any{
				"type":    "host-local",
				"ranges":  []any{[]any{map[string]any{"subnet": PodSubnet, "gateway": PodGateway}}},
				"routes":  []any{map[string]any{"dst": "0.0.0.0/0"}},
				"dataDir": filepath.Join(dir, cniDataDir),
			},
		}},
	}, "", "  ")
}

// CrictlConfig is the path of crictl's config (crictl --config) for the containerd in dir.
func CrictlConfig(dir string) string { return filepath.Join(dir, crictlYAML) }

// WriteCRIFiles writes, for a CRI containerd in dir, the CNI network's config and crictl's
// config (CrictlConfig: the containerd's socket, each call bounded by timeout, no image
// pulls).
func WriteCRIFiles(dir string, timeout time.Duration) error {
	conf, err := cniConfList(dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, cniConfDir), 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, cniConfDir, "10-"+cniNetwork+".conflist"), conf, 0o600); err != nil {
		return err
	}
	endpoint := "unix://" + filepath.Join(dir, GRPCSocket)
	yaml := fmt.Sprintf("runtime-endpoint: %s\nimage-endpoint: %s\ntimeout: %d\npull-image-on-create: false\n",
		endpoint, endpoint, int(timeout.Seconds()))
	return os.WriteFile(CrictlConfig(dir), []byte(yaml), 0o600)
}

// KvfsRuntime is the TOML of a CRI runtime handler for the kvfs shim (runtime_type
// io.containerd.kvfs.v2) with the sandbox configuration at configPath and pods started by
// sandboxer ("podsandbox" or "shim", which needs no pause image), for Config's extra TOML.
// With configPath "", the handler has no options: the shim reads the configuration
// $KVFS_CONFIG_FILE names in containerd's environment (shim.ConfigFileEnv), as it must for
// containerd's CRI to run user-namespaced pods.
func KvfsRuntime(handler, configPath, sandboxer string) string {
	s := fmt.Sprintf(`
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.%s]
  runtime_type = 'io.containerd.kvfs.v2'
  sandboxer = %q
  disable_pause_image_pull = %v
`, handler, sandboxer, sandboxer == "shim")
	if configPath != "" {
		s += fmt.Sprintf(`  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.%s.options]
    ConfigPath = %q
`, handler, configPath)
	}
	return s
}
