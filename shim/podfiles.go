package shim

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// The files CRI's podsandbox sandboxer makes on the host for a pod's containers, which the
// Sandbox API leaves to the sandbox: the shim writes them on a small tmpfs of their own in the
// sandbox's bundle and binds them into each container.

// podShm is where a container and the guest have their /dev/shm.
const podShm = "/dev/shm"

// podFilesDir is the directory, in the sandbox's bundle, of its pod files.
const podFilesDir = "pod-files"

// podFiles are the files CRI's podsandbox sandboxer makes on the host for a pod's containers
// and the Sandbox API leaves to the sandbox: the container path, the file's name in
// podFilesDir.
var podFiles = [...][2]string{{"/etc/hostname", "hostname"}, {"/etc/hosts", "hosts"}, {"/etc/resolv.conf", "resolv.conf"}}

// podFilesSize is the size of the tmpfs that holds a Sandbox-API pod's files. Its containers
// get them read-write, as runc containers do (kubelet's /etc/hosts is writable), so root in
// the guest can write them through kvfsd for as long as the pod lives: on containerd's state
// directory, a tmpfs (/run), they would take the host's memory and, once /run is full, every
// pod's and containerd's. Bound read-only, they would differ from runc's. So they live on a
// tmpfs of their own, this big for all three (the host's /etc/hosts, which the pod's copies,
// is a few KiB), where a write past it fails with ENOSPC. CRI's podsandbox sandboxer makes its
// own (the pause container's): those are not the shim's to bound.
const podFilesSize = 256 << 10

// mountPodFiles mounts a tmpfs of podFilesSize, a few inodes and no devices, set-id bits or
// executables at dir, made if need be, for the pod files.
func mountPodFiles(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	opts := fmt.Sprintf("size=%d,nr_inodes=16,mode=0755", podFilesSize)
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return fmt.Errorf("a tmpfs for the pod files at %s: %w", dir, err)
	}
	return nil
}

// unmountPodFiles detaches what mountPodFiles mounted at dir (nothing if it is not mounted
// there), leaving dir, empty, for containerd to remove with the bundle. The containers' binds
// of the files go with the sandbox's share.
func unmountPodFiles(dir string) error {
	for {
		err := unix.Unmount(dir, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
		switch {
		case err == nil:
			continue // one more below, if CreateSandbox ran twice here
		case err == unix.EINVAL || err == unix.ENOENT:
			return nil // not a mount point (any more), or no directory
		default:
			return fmt.Errorf("unmount the pod files at %s: %w", dir, err)
		}
	}
}

// writePodFiles writes the pod files into dir from the pod's config, as CRI writes them for a
// pause container: the pod's hostname (else the host's), the host's /etc/hosts, a
// resolv.conf from the pod's DNS config (else the host's).
func writePodFiles(dir string, pc *criapi.PodSandboxConfig) error {
	hostname := pc.GetHostname()
	if hostname == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("the pod's hostname: %w", err)
		}
		hostname = h
	}
	hosts, err := os.ReadFile("/etc/hosts")
	if err != nil {
		return fmt.Errorf("the pod's /etc/hosts: %w", err)
	}
	var resolv []byte
	if dns := pc.GetDnsConfig(); dns != nil {
		var b strings.Builder
		if len(dns.Searches) > 0 {
			fmt.Fprintf(&b, "search %s\n", strings.Join(dns.Searches, " "))
		}
		for _, s := range dns.Servers {
			fmt.Fprintf(&b, "nameserver %s\n", s)
		}
		if len(dns.Options) > 0 {
			fmt.Fprintf(&b, "options %s\n", strings.Join(dns.Options, " "))
		}
		resolv = []byte(b.String())
	} else if resolv, err = os.ReadFile("/etc/resolv.conf"); err != nil {
		return fmt.Errorf("the pod's /etc/resolv.conf: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for name, data := range map[string][]byte{"hostname": []byte(hostname + "\n"), "hosts": hosts, "resolv.conf": resolv} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			return fmt.Errorf("the pod's %s: %w", name, err)
		}
	}
	return nil
}

// withPodFiles adds to a container's spec a bind of each pod file in dir at its path, unless
// the spec mounts something there already (the CRI's own mounts win); read-only with a
// read-only root, and idmapped as the container's user namespace maps ids if it has one, as
// CRI binds them.
func withPodFiles(spec *specs.Spec, dir string) {
	opts := []string{"rbind", "rprivate", "rw"}
	if spec.Root != nil && spec.Root.Readonly {
		opts = []string{"rbind", "rprivate", "ro"}
	}
	var uids, gids []specs.LinuxIDMapping
	if hasNamespace(spec, specs.UserNamespace) {
		uids, gids = spec.Linux.UIDMappings, spec.Linux.GIDMappings
	}
	for _, f := range podFiles {
		if !slices.ContainsFunc(spec.Mounts, func(m specs.Mount) bool { return filepath.Clean(m.Destination) == f[0] }) {
			spec.Mounts = append(spec.Mounts, specs.Mount{Destination: f[0], Type: "bind", Source: filepath.Join(dir, f[1]), Options: opts,
				UIDMappings: uids, GIDMappings: gids})
		}
	}
}

// withPodShm makes the guest spec's /dev/shm the pod's: a bind of the guest's own /dev/shm, a
// tmpfs of the VM (which is the pod's alone), in place of the tmpfs of the container's own the
// spec mounts there. So the pod's containers share their /dev/shm, as CRI's podsandbox
// sandboxer gives them the pause container's. Its size is the guest's tmpfs default (half
// the VM's memory): CRI's pod config gives no /dev/shm size (podsandbox's is a fixed 64 MiB).
// A /dev/shm the CRI's own mounts give (a bind) stays.
func withPodShm(g *specs.Spec) {
	for i, m := range g.Mounts {
		if filepath.Clean(m.Destination) != podShm || m.Type != "tmpfs" {
			continue
		}
		opts := []string{"rbind", "rprivate", "nosuid", "nodev"}
		for _, o := range m.Options {
			if o == "noexec" || o == "ro" {
				opts = append(opts, o)
			}
		}
		g.Mounts[i] = specs.Mount{Destination: podShm, Type: "bind", Source: podShm, Options: opts}
	}
}
