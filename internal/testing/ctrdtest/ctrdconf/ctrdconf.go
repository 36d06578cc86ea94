// Package ctrdconf writes the files a private containerd runs from, every path of it kept in
// one directory: its config.toml, its environment and, with the CRI on, the CNI test network
// and crictl's config. Package ctrd (internal/testing/ctrdtest/ctrd) starts such a containerd, for
// tests and for the pod benchmarks; scripts/demo.sh writes its containerd's files with
// cmd/ctrdconf.
package ctrdconf

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"

	"github.com/pelletier/go-toml/v2"
)

// Socket names in the containerd's directory.
const (
	GRPCSocket  = "containerd.sock"
	TTRPCSocket = "containerd.sock.ttrpc"
)

// NRIPlugin is off in every private containerd: its socket would be the machine's
// /var/run/nri/nri.sock.
const NRIPlugin = "io.containerd.nri.v1.nri"

// CRIPlugins are the CRI's: its image and runtime services, its gRPC service and the
// pause-container sandbox controller. They are off unless Config's cri, so that a containerd
// needs no CNI.
func CRIPlugins() []string {
	return []string{
		"io.containerd.grpc.v1.cri",
		"io.containerd.cri.v1.images",
		"io.containerd.cri.v1.runtime",
		"io.containerd.podsandbox.controller.v1.podsandbox",
	}
}

// Config is containerd's config.toml for a containerd whose every path is under dir, with
// extra (TOML) merged in: tables are merged key by key, other values replaced. extra may not
// change what keeps the containerd to its directory: the version, root, state, temp,
// imports and the server addresses.
//
// The config is version 4, containerd 2.4's own: version 3 still loads but is migrated at
// each start with a warning (in version 4 the gRPC, ttrpc, debug and metrics servers are
// configured as the plugins io.containerd.server.v1.*).
//
// With cri, the CRI plugins are on and configured as criConfig says. imports are the config's
// imports (none: not the default /etc/containerd/conf.d/*.toml); each must be an absolute path.
func Config(dir, logLevel string, cri bool, imports []string, extra string) ([]byte, error) {
	for _, p := range imports {
		if !filepath.IsAbs(p) {
			return nil, fmt.Errorf("imports: %q is not an absolute path", p)
		}
	}
	disabled := append([]string{NRIPlugin}, CRIPlugins()...)
	if cri {
		disabled = []string{NRIPlugin}
	}
	cfg := map[string]any{
		"version":          int64(4),
		"root":             filepath.Join(dir, "root"),
		"state":            filepath.Join(dir, "state"),
		"temp":             filepath.Join(dir, "tmp"),
		"imports":          toAny(imports), // not the default /etc/containerd/conf.d/*.toml
		"disabled_plugins": toAny(disabled),
		"debug":            map[string]any{"level": logLevel},
		"plugins": map[string]any{
			"io.containerd.server.v1.grpc":           map[string]any{"address": filepath.Join(dir, GRPCSocket)},
			"io.containerd.server.v1.ttrpc":          map[string]any{"address": filepath.Join(dir, TTRPCSocket)},
			"io.containerd.server.v1.debug":          map[string]any{"address": ""},
			"io.containerd.server.v1.metrics":        map[string]any{"address": ""},
			"io.containerd.internal.v1.opt":          map[string]any{"path": filepath.Join(dir, "opt")},
			"io.containerd.image-verifier.v1.bindir": map[string]any{"bin_dir": filepath.Join(dir, "image-verifier")},
		},
	}
	if cri {
		if err := merge(cfg, criConfig(dir), nil); err != nil {
			return nil, err
		}
	}
	fixed := [][]string{
		{"version"}, {"root"}, {"state"}, {"temp"}, {"imports"},
		{"plugins", "io.containerd.server.v1.grpc", "address"},
		{"plugins", "io.containerd.server.v1.ttrpc", "address"},
		{"plugins", "io.containerd.internal.v1.opt", "path"},
	}
	if extra != "" {
		var add map[string]any
		if err := toml.Unmarshal([]byte(extra), &add); err != nil {
			return nil, fmt.Errorf("the extra config: %w", err)
		}
		want := make([]any, len(fixed))
		for i, p := range fixed {
			want[i] = lookup(cfg, p)
		}
		if err := merge(cfg, add, nil); err != nil {
			return nil, fmt.Errorf("the extra config: %w", err)
		}
		for i, p := range fixed {
			if !reflect.DeepEqual(lookup(cfg, p), want[i]) {
				return nil, fmt.Errorf("the extra config may not set %s: it keeps the containerd to its directory", strings.Join(p, "."))
			}
		}
	}
	return toml.Marshal(cfg)
}

// Environ is the environment of a containerd in dir and of its ctr and crictl: this
// process's, with PATH made of first, then this process's PATH (with the system
// directories, where runc is, added if missing), TMPDIR in dir's tmp (which the caller
// makes), and no CONTAINERD_* variables (ctr would take its snapshotter or runtime from
// them).
func Environ(dir string, first []string) []string {
	var env []string
	path := ""
	for _, kv := range os.Environ() {
		switch {
		case strings.HasPrefix(kv, "PATH="):
			path = strings.TrimPrefix(kv, "PATH=")
		case strings.HasPrefix(kv, "TMPDIR="), strings.HasPrefix(kv, "CONTAINERD_"):
		default:
			env = append(env, kv)
		}
	}
	dirs := append(slices.Clone(first), filepath.SplitList(path)...)
	for _, sys := range []string{"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"} {
		if !slices.Contains(dirs, sys) {
			dirs = append(dirs, sys)
		}
	}
	return append(env, "PATH="+strings.Join(dirs, string(filepath.ListSeparator)), "TMPDIR="+filepath.Join(dir, "tmp"))
}

// merge merges src into dst: a table into a table key by key, anything else replaced. A table
// replacing a value that is not one, or the reverse, is an error naming the key.
func merge(dst, src map[string]any, at []string) error {
	for k, v := range src {
		path := append(at[:len(at):len(at)], k)
		old, ok := dst[k]
		if !ok {
			dst[k] = v
			continue
		}
		om, oldTable := old.(map[string]any)
		nm, newTable := v.(map[string]any)
		switch {
		case oldTable && newTable:
			if err := merge(om, nm, path); err != nil {
				return err
			}
		case oldTable != newTable:
			return fmt.Errorf("%s: a table in one config and a value in the other", strings.Join(path, "."))
		default:
			dst[k] = v
		}
	}
	return nil
}

func lookup(m map[string]any, path []string) any {
	var v any = m
	for _, k := range path {
		t, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = t[k]
	}
	return v
}

func toAny(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}
