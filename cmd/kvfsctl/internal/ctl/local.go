package ctl

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/sandbox"
)

// DefaultConfigPath is the node's sandbox configuration, as for the shim (shim.DefaultConfigPath).
const DefaultConfigPath = "/etc/kvfs/configuration.toml"

// localCommand is a subcommand that reads or writes local files and dials nothing.
type localCommand struct {
	usage string
	run   func(o options, args []string, w io.Writer) error
}

var localCommands = map[string]localCommand{
	"config": {"config default [--guest DIR]", runConfig},
	"image":  {"image info [--config PATH | --kernel FILE --initrd FILE]", runImage},
}

// subFlags is a flag set for a local subcommand; its errors are usage errors.
func subFlags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// runConfig is `config default`: DefaultConfig rendered with every key documented, with the
// guest image in --guest DIR (the installer's share/kvfs/guest) when given.
func runConfig(_ options, args []string, w io.Writer) error {
	if len(args) == 0 || args[0] != "default" {
		return errWrongArgs
	}
	fs := subFlags("config default")
	guest := fs.String("guest", "", "the directory of the guest image ("+guestimage.KernelFile+", "+guestimage.RootfsFile+" or "+guestimage.InitrdFile+")")
	if err := fs.Parse(args[1:]); err != nil {
		return usagef("config default: %v", err)
	}
	if fs.NArg() != 0 {
		return errWrongArgs
	}
	c := sandbox.DefaultConfig()
	if *guest != "" {
		dir := filepath.Clean(*guest)
		c.VM.Kernel = filepath.Join(dir, guestimage.KernelFile)
		c.VM.Rootfs, c.VM.Initrd = guestimage.RootIn(dir)
	}
	if err := c.Validate(); err != nil {
		return usagef("config default --guest %s: %v", *guest, err)
	}
	_, err := w.Write(sandbox.RenderConfig(c))
	return err
}

// runImage is `image info`: which guest image a host has. Without --kernel and its root
// (--rootfs or --initrd) it is the one the configuration names (--config, default
// DefaultConfigPath if it exists, else the built-in defaults).
func runImage(o options, args []string, w io.Writer) error {
	if len(args) == 0 || args[0] != "info" {
		return errWrongArgs
	}
	fs := subFlags("image info")
	config := fs.String("config", "", "the sandbox configuration whose vm.kernel and vm.rootfs (or vm.initrd) to describe (default "+DefaultConfigPath+" if it exists)")
	kernel := fs.String("kernel", "", "the guest kernel")
	rootfs := fs.String("rootfs", "", "the guest's root image (erofs)")
	initrd := fs.String("initrd", "", "the guest initramfs, the root of an image built with Debian's kernel")
	if err := fs.Parse(args[1:]); err != nil {
		return usagef("image info: %v", err)
	}
	switch {
	case fs.NArg() != 0:
		return errWrongArgs
	case *rootfs != "" && *initrd != "":
		return usagef("image info: --rootfs or --initrd, not both")
	case (*kernel == "") != (*rootfs+*initrd == ""):
		return usagef("image info: --kernel and its root (--rootfs or --initrd) go together")
	case *kernel != "" && *config != "":
		return usagef("image info: --config or --kernel and its root, not both")
	}
	root := *rootfs + *initrd
	if *kernel == "" {
		c, err := loadConfig(*config)
		if err != nil {
			return err
		}
		*kernel, root = c.VM.Kernel, c.VM.Root()
		if root == "" {
			return fmt.Errorf("the configuration has neither vm.rootfs nor vm.initrd: not a kvfs guest image")
		}
	}
	info, err := guestimage.Read(*kernel, root)
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(w, info)
	}
	return printImage(w, info)
}

// loadConfig loads path, or DefaultConfigPath if path is "" and it exists, or the defaults.
func loadConfig(path string) (*sandbox.Config, error) {
	if path != "" {
		return sandbox.LoadConfig(path)
	}
	if _, err := os.Stat(DefaultConfigPath); errors.Is(err, os.ErrNotExist) {
		return sandbox.DefaultConfig(), nil
	}
	return sandbox.LoadConfig(DefaultConfigPath)
}

func printImage(w io.Writer, info *guestimage.Info) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	check := func(f guestimage.File) string {
		switch {
		case f.Listed == "":
			return "(not in a " + guestimage.SumsFile + " beside it)"
		case f.Matches():
			return "(matches " + guestimage.SumsFile + ")"
		}
		return "(MISMATCH: " + guestimage.SumsFile + " lists " + f.Listed + ")"
	}
	fmt.Fprintf(tw, "kernel\t%s\n", info.Kernel.Path)
	fmt.Fprintf(tw, "  version\t%s\n", info.KernelVersion)
	fmt.Fprintf(tw, "  sha256\t%s %s\n", info.Kernel.SHA256, check(info.Kernel))
	fmt.Fprintf(tw, "root\t%s\n", info.Root.Path)
	fmt.Fprintf(tw, "  sha256\t%s %s\n", info.Root.SHA256, check(info.Root))
	if d := info.Description; d != nil {
		fmt.Fprintf(tw, "kvfs version\t%s\n", d.KVFSVersion)
		fmt.Fprintf(tw, "built from\t%s %s, %s %s, busybox %s\n", d.Kernel.Package, d.Kernel.PackageVersion, d.Runtime.Name, d.Runtime.PackageVersion, d.Busybox.PackageVersion)
		fmt.Fprintf(tw, "agent\tsha256 %s (%s)\n", d.Agent.SHA256, d.Agent.Go)
		if d.Agent.Tags != "" {
			fmt.Fprintf(tw, "  build tags\t%s (a test image: not for production)\n", d.Agent.Tags)
		}
		fmt.Fprintf(tw, "modules\t%s\n", strings.Join(d.Modules, " "))
		fmt.Fprintf(tw, "source date\t%d\n", d.SourceDateEpoch)
	} else {
		fmt.Fprintf(tw, "description\tnone (no /%s in the initramfs: not built by packaging/guest/build.sh --agent)\n", guestimage.DescriptionPath)
	}
	return tw.Flush()
}
