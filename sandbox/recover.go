package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// RecoverReport is what Recover found in a base directory.
type RecoverReport struct {
	// Adopted are sandboxes whose external server (and VM, if one was started) still run:
	// this process owns them now.
	Adopted []*Sandbox
	// Cleaned are sandboxes that were torn down: processes stopped (only those whose identity
	// was verified), mounts and directory removed.
	Cleaned []Cleaned
	// Skipped are entries left alone.
	Skipped []Skipped
}

// Cleaned is a sandbox Recover tore down.
type Cleaned struct {
	ID     string
	Reason string
	// Err is what went wrong tearing it down, if anything; the directory then stays, for
	// another attempt.
	Err error
}

// Skipped is a base directory entry Recover left alone.
type Skipped struct {
	Name   string
	Reason string
}

// Recover finds the sandboxes under baseDir left by an owner that exited without stopping them
// (a crash, an upgrade) and either adopts or cleans up each one:
//
//   - adopted, when its server is a confined server or an external daemon that still runs, and
//     its VM, if it was started, still runs too. Processes are recognised by pid and start time, and held by
//     pidfd, so a pid reused by another process is never signalled. The adopted sandbox
//     monitors both again with its failure policy, and can be stopped as usual; a thread of
//     this process joins its mount namespace (from its pin, mnt.ns) for Bind and Unbind.
//   - cleaned up otherwise: what still runs of it is stopped, mounts are detached, the
//     directory is removed. A sandbox whose server was in-process always ends here: the server
//     died with its owner, so the VM's share is dead.
//
// Sandboxes locked by a live owner (another process) are skipped, as are entries that are not
// sandbox directories; symlinks are never followed.
func Recover(ctx context.Context, baseDir string) (*RecoverReport, error) {
	rep := &RecoverReport{}
	if err := checkAbsPath(baseDir); err != nil {
		return nil, fmt.Errorf("recover: base directory %q: %w", baseDir, err)
	}
	base, err := filepath.EvalSymlinks(baseDir)
	if errors.Is(err, fs.ErrNotExist) {
		return rep, nil
	}
	if err != nil {
		return nil, fmt.Errorf("recover: %w", err)
	}
	entries, err := os.ReadDir(base)
	if err != nil {
		return nil, fmt.Errorf("recover: %w", err)
	}
	for _, e := range entries {
		name := e.Name()
		switch {
		case e.Type()&fs.ModeSymlink != 0:
			rep.Skipped = append(rep.Skipped, Skipped{name, "a symlink (never followed)"})
			continue
		case !e.IsDir():
			rep.Skipped = append(rep.Skipped, Skipped{name, "not a directory"})
			continue
		case checkID(name) != nil:
			rep.Skipped = append(rep.Skipped, Skipped{name, "not a sandbox id"})
			continue
		}
		recoverOne(ctx, filepath.Join(base, name), name, rep)
	}
	return rep, nil
}

func recoverOne(ctx context.Context, dir, id string, rep *RecoverReport) {
	logger := log.G(ctx).WithField("sandbox", id)
	lock, err := os.OpenFile(filepath.Join(dir, lockName), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		rep.Skipped = append(rep.Skipped, Skipped{id, "cannot open its lock: " + err.Error()})
		return
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		rep.Skipped = append(rep.Skipped, Skipped{id, "in use by a live owner (" + err.Error() + ")"})
		return
	}

	st, err := readState(dir)
	if err != nil {
		rep.Cleaned = append(rep.Cleaned, cleanupRecovered(id, dir, lock, nil, nil, "no usable state: "+err.Error()))
		logger.WithError(err).Warn("recover: cleaned up a sandbox without usable state")
		return
	}

	srv, srvErr := adoptServer(ctx, st, dir)
	var vm *adoptedProcess
	var vmErr error
	if st.VM != nil && st.VM.Process != nil {
		vm, vmErr = adopt(*st.VM.Process)
	}

	var reason string
	switch {
	case st.Phase != PhaseCreated && st.Phase != PhaseRunning:
		reason = fmt.Sprintf("it was %s", st.Phase)
	case st.Server == nil:
		reason = "no server recorded"
	case st.Server.Daemon == InProcessUnconfined:
		reason = "its server ran in-process and ended with the previous owner"
	case srvErr != nil:
		reason = "its server is gone: " + srvErr.Error()
	case st.Phase == PhaseRunning && (st.VM == nil || st.VM.Process == nil):
		reason = "its VM was not a local process and cannot be adopted"
	case st.Phase == PhaseRunning && vmErr != nil:
		reason = "its VM is gone: " + vmErr.Error()
	}
	var mnt *mountNS
	if reason == "" {
		if mnt, err = joinMountNS(filepath.Join(dir, pinName)); err != nil {
			reason = "its mount namespace is gone: " + err.Error()
		}
	}
	if reason != "" {
		var sp, vp Process
		if srv != nil {
			sp = srv.process()
		}
		if vm != nil {
			vp = vm
		}
		c := cleanupRecovered(id, dir, lock, vp, sp, reason)
		rep.Cleaned = append(rep.Cleaned, c)
		logger.WithField("reason", reason).WithError(c.Err).Info("recover: cleaned up")
		return
	}

	dax, err := st.DAX.policy()
	if err != nil {
		logger.WithError(err).Warn("recover: dropping an unusable recorded DAX policy")
		dax = nil
	}
	oomAdj := st.OOMScoreAdj
	if oomAdj != nil && CheckOOMScoreAdj(*oomAdj) != nil {
		logger.WithField("oom_score_adj", *oomAdj).Warn("recover: dropping an unusable recorded oom_score_adj")
		oomAdj = nil
	}
	s := &Sandbox{
		id: id, dir: dir, cfg: st.Config, runner: QEMURunner{}, lock: lock, mnt: mnt, dax: dax, oomAdj: oomAdj,
		ctx:     log.WithLogger(context.WithoutCancel(ctx), logger),
		created: st.Created, phase: st.Phase, srv: srv, vmRec: st.VM, restarts: st.Restarts,
		done: make(chan struct{}),
	}
	if vm != nil {
		// Its console and QEMU's output went to the previous owner's pipes: they are lost
		// from now on (QEMU's writes fail and are dropped).
		s.vm, s.vmExited = vm, make(chan struct{})
	}
	s.mu.Lock()
	err = s.persistLocked()
	s.mu.Unlock()
	if err != nil {
		logger.WithError(err).Warn("recover: recording the new owner")
	}
	s.wg.Add(1)
	go s.watchServer(srv)
	if vm != nil {
		s.wg.Add(1)
		go s.watchVM(vm, nil, s.vmExited)
	}
	rep.Adopted = append(rep.Adopted, s)
	logger.WithField("server", srv.describe()).Info("recover: adopted")
}

// adoptServer takes hold of the server process st records: a confined server or an external
// daemon. It returns nil, nil when the server was in-process (or none is recorded).
func adoptServer(ctx context.Context, st *state, dir string) (fsServer, error) {
	switch {
	case st.Server == nil || st.Server.Daemon == InProcessUnconfined:
		return nil, nil
	case st.Server.Daemon == Confined:
		s, err := adoptConfined(ctx, *st.Server, filepath.Join(dir, channelName))
		if err != nil {
			return nil, err
		}
		return s, nil
	}
	s, err := adoptExternal(*st.Server)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// cleanupRecovered stops the verified processes vm and srv (either may be nil), tears the
// directory down and releases the lock.
func cleanupRecovered(id, dir string, lock *os.File, vm, srv Process, reason string) Cleaned {
	var errs []error
	if vm != nil {
		if err := terminate(vm, vmStopGrace); err != nil {
			errs = append(errs, fmt.Errorf("stopping the VM: %w", err))
		}
	}
	if srv != nil {
		if err := terminate(srv, serverStopGrace); err != nil {
			errs = append(errs, fmt.Errorf("stopping the server: %w", err))
		}
	}
	if len(errs) == 0 {
		// The namespace is let go, not joined: with the pin unmounted, it ends with the
		// processes just stopped, its mounts with it.
		if err := teardown(dir, nil); err != nil {
			errs = append(errs, err)
		}
	}
	lock.Close()
	return Cleaned{ID: id, Reason: reason, Err: errors.Join(errs...)}
}

// ErrInUse is returned by Cleanup for a sandbox whose owner is alive.
var ErrInUse = errors.New("in use by a live owner")

// Cleanup tears down the sandbox id under baseDir that its owner left behind (a shim that
// died): the VM and a confined or external server, if still running and recognised as the recorded
// processes (pid, start time, boot id: a reused pid is never signalled), are stopped; the
// mounts are detached and the directory removed, as Stop does. It is Recover for one sandbox
// that never adopts. A sandbox whose owner.lock is held by a live owner is left alone
// (ErrInUse); one that does not exist is nothing to do (nil).
func Cleanup(ctx context.Context, baseDir, id string) error {
	if err := checkAbsPath(baseDir); err != nil {
		return fmt.Errorf("cleanup: base directory %q: %w", baseDir, err)
	}
	if err := checkID(id); err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	base, err := filepath.EvalSymlinks(baseDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	dir := filepath.Join(base, id)
	fi, err := os.Lstat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return fmt.Errorf("cleanup sandbox %s: %w", id, err)
	case !fi.IsDir():
		return fmt.Errorf("cleanup sandbox %s: %s is not a directory (symlinks are never followed)", id, dir)
	}
	lock, err := os.OpenFile(filepath.Join(dir, lockName), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("cleanup sandbox %s: %w", id, err)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		return fmt.Errorf("cleanup sandbox %s: %w (%v)", id, ErrInUse, err)
	}
	var vm, srv Process
	reason := "its owner is gone"
	if st, err := readState(dir); err != nil {
		reason = "no usable state: " + err.Error()
	} else {
		if p, err := adoptServer(ctx, st, dir); err == nil && p != nil {
			srv = p.process()
		}
		if st.VM != nil && st.VM.Process != nil {
			if p, err := adopt(*st.VM.Process); err == nil {
				vm = p
			}
		}
	}
	c := cleanupRecovered(id, dir, lock, vm, srv, reason)
	log.G(ctx).WithField("sandbox", id).WithField("reason", reason).WithError(c.Err).Info("cleanup")
	if c.Err != nil {
		return fmt.Errorf("cleanup sandbox %s: %w", id, c.Err)
	}
	return nil
}
