package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"strings"
	"time"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
)

// The systemd cgroup driver (containerd's SystemdCgroup = true, the kubelet's cgroupDriver:
// systemd). The pod's cgroup is then named as runc's systemd driver reads it,
// slice:prefix:name: the scope unit prefix-name.scope in the slice unit slice, which systemd
// makes over D-Bus with the processes given (StartTransientUnit with Slice=, PIDs= and
// Delegate=yes) and removes when stopped (StopUnit). On the cgroup file systems the scope is
// then at the slice's expanded path (expandSlice) and the scope's name below it, in every
// hierarchy systemd realizes it in; the shim then joins that path as it joins a cgroupfs one
// (joinPodCgroup), so every v1 hierarchy has it too, as runc does.
//
// systemd is trusted, as containerd is: its answers are not checked beyond their result, but
// every call is bounded (systemdTimeout), so a hung systemd fails the pod's start rather than
// hang it.
//
// How this was checked, no systemd running as PID 1 on the machines the tests run on: the
// calls go over real D-Bus to a private dbus-daemon whose org.freedesktop.systemd1 is the
// tests' own (fakeSystemd in cgroup_systemd_test.go), which places the PIDs at the slice's
// expanded path as systemd does; the unit's name and properties were compared with what runc's
// systemd driver (opencontainers/cgroups/systemd) sends for a container of CRI's, by reading
// it. That systemd itself makes the scope there is its documented behaviour, not run here.
// containerd's cgroups module has a systemd manager too (cgroup2.NewSystemd), not used: v3.1.3
// puts the scope in system.slice whatever slice it is given, and its waits are not bounded.

// systemdTimeout bounds each exchange with systemd: the connection and a call with the job
// it starts.
const systemdTimeout = 30 * time.Second

// systemdBooted is the directory whose presence says systemd is the host's init, as
// sd_booted(3) tests it.
var systemdBooted = "/run/systemd/system"

// systemdScope is a pod cgroup given as a systemd path, slice:prefix:name.
type systemdScope struct {
	slice string // the slice unit: kubepods-besteffort-pod<uid>.slice
	unit  string // the scope unit: cri-containerd-<id>.scope
	fs    string // the scope's cgroupfs path: the slice's expanded path, then unit
}

// isSystemdCgroupPath reports whether p is a systemd cgroup path (slice:prefix:name) rather
// than a cgroupfs one: it has a colon, which a cgroupfs path of the shim's never has.
func isSystemdCgroupPath(p string) bool {
	return strings.Contains(p, ":")
}

// parseSystemdCgroup reads p, a systemd cgroup path slice:prefix:name, as runc's systemd
// driver does: an empty slice is system.slice; the unit is prefix-name.scope (name.scope
// without a prefix). A name that is a slice (runc would make a slice unit) is refused: the
// pod's processes go in a scope.
func parseSystemdCgroup(p string) (systemdScope, error) {
	parts := strings.Split(p, ":")
	if len(parts) != 3 {
		return systemdScope{}, fmt.Errorf("systemd cgroup path %q: want slice:prefix:name", p)
	}
	slice, prefix, name := parts[0], parts[1], parts[2]
	if slice == "" {
		slice = "system.slice"
	}
	dir, err := expandSlice(slice)
	if err != nil {
		return systemdScope{}, fmt.Errorf("systemd cgroup path %q: %w", p, err)
	}
	if name == "" || strings.HasSuffix(name, ".slice") {
		return systemdScope{}, fmt.Errorf("systemd cgroup path %q: want a name for the pod's scope (not a slice)", p)
	}
	unit := name + ".scope"
	if prefix != "" {
		unit = prefix + "-" + unit
	}
	if err := checkUnitName(unit); err != nil {
		return systemdScope{}, fmt.Errorf("systemd cgroup path %q: %w", p, err)
	}
	return systemdScope{slice: slice, unit: unit, fs: path.Join(dir, unit)}, nil
}

// checkUnitName checks that unit is a unit name systemd takes that is one clean path element:
// at most 255 bytes of letters, digits, '-', '_', '.' and '@', not starting with '.'.
func checkUnitName(unit string) error {
	if len(unit) > 255 || strings.HasPrefix(unit, ".") {
		return fmt.Errorf("unit name %q: too long, or starts with a dot", unit)
	}
	for _, r := range unit {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_.@", r)) {
			return fmt.Errorf("unit name %q: %q is not a unit name's character", unit, r)
		}
	}
	return nil
}

// expandSlice is the cgroupfs path of slice unit slice: each dash opens a level, the slice
// a-b-c.slice being /a.slice/a-b.slice/a-b-c.slice; -.slice is the root.
func expandSlice(slice string) (string, error) {
	base, ok := strings.CutSuffix(slice, ".slice")
	if !ok || base == "" || strings.Contains(slice, "/") {
		return "", fmt.Errorf("slice %q: want a name.slice", slice)
	}
	if err := checkUnitName(slice); err != nil {
		return "", err
	}
	if base == "-" {
		return "/", nil
	}
	var b strings.Builder
	prefix := ""
	for part := range strings.SplitSeq(base, "-") {
		if part == "" {
			return "", fmt.Errorf("slice %q: an empty level (a leading, trailing or double dash)", slice)
		}
		b.WriteString("/" + prefix + part + ".slice")
		prefix += part + "-"
	}
	return b.String(), nil
}

// checkSystemdRunning says, naming cgroup, why its scope cannot be made when systemd is not
// the host's init: the shim never runs the pod outside the cgroup it was given.
func checkSystemdRunning(cgroup string) error {
	if fi, err := os.Lstat(systemdBooted); err != nil || !fi.IsDir() {
		return fmt.Errorf("the pod's cgroup %q is a systemd one (slice:prefix:name, containerd's SystemdCgroup = true), "+
			"but systemd is not running on this host (no %s): no scope can be made for the pod; "+
			"use the cgroupfs driver (SystemdCgroup = false, the kubelet's cgroupDriver: cgroupfs)", cgroup, systemdBooted)
	}
	return nil
}

// systemdConn connects to systemd over the system bus (or, for root, its private socket), as
// runc's systemd driver does.
func systemdConn(ctx context.Context) (*sdbus.Conn, error) {
	conn, err := sdbus.NewWithContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("connect to systemd over D-Bus: %w", err)
	}
	return conn, nil
}

// systemdJob runs a systemd call that starts a job (start passes it the channel of its
// result) and waits for the job's end within ctx: an error unless it is done.
func systemdJob(ctx context.Context, what string, start func(chan<- string) error) error {
	done := make(chan string, 1) // the job's result, sent once
	if err := start(done); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	select {
	case r := <-done:
		if r != "done" {
			return fmt.Errorf("%s: the job's result is %q", what, r)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%s: no end of the job: %w", what, ctx.Err())
	}
}

// dbusErrorName is the D-Bus error name of err, if it is one.
func dbusErrorName(err error) string {
	var e dbus.Error
	if errors.As(err, &e) {
		return e.Name
	}
	var pe *dbus.Error
	if errors.As(err, &pe) {
		return pe.Name
	}
	return ""
}

// startScope asks systemd for the pod's scope s in its slice with pid in it, delegated (the
// shim then makes the scope's cgroup in the hierarchies systemd leaves alone), accounted for
// CPU, memory and tasks. A unit of the same name left failed is reset and the start tried
// once more; one still there is an error.
func startScope(ctx context.Context, s systemdScope, pid int) error {
	ctx, cancel := context.WithTimeout(ctx, systemdTimeout)
	defer cancel()
	conn, err := systemdConn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	props := []sdbus.Property{
		sdbus.PropDescription("kvfs pod " + s.unit),
		sdbus.PropSlice(s.slice),
		sdbus.PropPids(uint32(pid)),
		{Name: "Delegate", Value: dbus.MakeVariant(true)},
		{Name: "DefaultDependencies", Value: dbus.MakeVariant(false)},
		{Name: "CPUAccounting", Value: dbus.MakeVariant(true)},
		{Name: "MemoryAccounting", Value: dbus.MakeVariant(true)},
		{Name: "TasksAccounting", Value: dbus.MakeVariant(true)},
	}
	what := "start the pod's scope " + s.unit + " in " + s.slice
	err = systemdJob(ctx, what, func(ch chan<- string) error {
		_, err := conn.StartTransientUnitContext(ctx, s.unit, "replace", props, ch)
		return err
	})
	if dbusErrorName(err) == "org.freedesktop.systemd1.UnitExists" {
		_ = conn.ResetFailedUnitContext(ctx, s.unit)
		err = systemdJob(ctx, what, func(ch chan<- string) error {
			_, err := conn.StartTransientUnitContext(ctx, s.unit, "replace", props, ch)
			return err
		})
	}
	return err
}

// stopScope asks systemd to stop the pod's scope unit, which kills what is left in it and
// removes its cgroup, and to forget it if it failed. A unit already gone (systemd collects an
// empty scope itself) is no error. It is the pod's cleanup: a cancelled ctx does not cut it
// short, systemdTimeout bounds it.
func stopScope(ctx context.Context, unit string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), systemdTimeout)
	defer cancel()
	conn, err := systemdConn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	err = systemdJob(ctx, "stop the pod's scope "+unit, func(ch chan<- string) error {
		_, err := conn.StopUnitContext(ctx, unit, "replace", ch)
		return err
	})
	if dbusErrorName(err) == "org.freedesktop.systemd1.NoSuchUnit" {
		return nil
	}
	if err != nil {
		return err
	}
	_ = conn.ResetFailedUnitContext(ctx, unit) // an error: it did not fail, or is gone
	return nil
}
