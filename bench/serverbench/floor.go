package serverbench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// floorEchoEnv, set in kvfsbench's environment, makes it the echo side of the floor (floorEcho)
// instead of the benchmark: the floor target starts its own executable that way.
const floorEchoEnv = "KVFSBENCH_FLOOR_ECHO"

// The echo process's descriptors: the eventfd it waits on and the one it answers on.
const (
	floorPingFD = 3
	floorPongFD = 4
)

// floorDriver is the "floor" target: a two-process eventfd ping-pong. Each operation is one round
// trip: this process writes the ping eventfd, then waits for the pong eventfd with poll(2) and
// reads it; the echo process (kvfsbench itself, re-executed with floorEchoEnv) waits for the
// ping with poll(2), reads it and writes the pong. Those are the two cross-process wake-ups, and
// nothing else, that every request at queue depth 1 costs a vhost-user server and its front-end
// (the kick, then the call), so no server can beat this rate at QD1. It runs the queue-depth-1
// workloads only, whatever they are: its operation is always the round trip. Its CPU figures are
// the echo process's, as a server's are the server's.
type floorDriver struct {
	cmd        *exec.Cmd
	exited     chan struct{}
	ping, pong *os.File // our ends: we write ping and read pong
}

func startFloor() (_ *floorDriver, err error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	var fds [2]*os.File
	for i := range fds {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		if err != nil {
			for _, f := range fds[:i] {
				f.Close()
			}
			return nil, fmt.Errorf("eventfd: %w", err)
		}
		fds[i] = os.NewFile(uintptr(fd), "eventfd")
	}
	f := &floorDriver{ping: fds[0], pong: fds[1], exited: make(chan struct{})}
	defer func() {
		if err != nil {
			f.ping.Close()
			f.pong.Close()
		}
	}()
	f.cmd = exec.Command(exe)
	f.cmd.Env = append(os.Environ(), floorEchoEnv+"=1")
	f.cmd.ExtraFiles = []*os.File{f.ping, f.pong} // floorPingFD, floorPongFD
	f.cmd.Stderr = os.Stderr
	f.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := f.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the echo process: %w", err)
	}
	go func() {
		f.cmd.Wait()
		close(f.exited)
	}()
	// A first round trip: the echo process is up and answering.
	if err := f.roundTrip(); err != nil {
		f.close()
		return nil, fmt.Errorf("echo process: %w", err)
	}
	return f, nil
}

// roundTrip is one ping and its pong.
func (f *floorDriver) roundTrip() error {
	var b [8]byte
	binary.NativeEndian.PutUint64(b[:], 1)
	if _, err := unix.Write(int(f.ping.Fd()), b[:]); err != nil {
		return fmt.Errorf("write ping: %w", err)
	}
	fds := []unix.PollFd{{Fd: int32(f.pong.Fd()), Events: unix.POLLIN}}
	for {
		_, err := unix.Poll(fds, 1000)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("poll pong: %w", err)
		}
		if fds[0].Revents&unix.POLLIN != 0 {
			break
		}
		select {
		case <-f.exited:
			return errors.New("the echo process exited")
		default:
		}
	}
	if _, err := unix.Read(int(f.pong.Fd()), b[:]); err != nil {
		return fmt.Errorf("read pong: %w", err)
	}
	return nil
}

func (f *floorDriver) pingPong(m *meter) error {
	defer m.stop()
	for {
		start := time.Now()
		if err := f.roundTrip(); err != nil {
			return err
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

func (f *floorDriver) lookupGetattr(_ context.Context, m *meter) error { return f.pingPong(m) }
func (f *floorDriver) relookup(_ context.Context, m *meter) error      { return f.pingPong(m) }
func (f *floorDriver) lookupForget(_ context.Context, m *meter, _ uint64, _ int) error {
	return f.pingPong(m)
}
func (f *floorDriver) createReleaseUnlink(_ context.Context, m *meter, _ int) error {
	return f.pingPong(m)
}
func (f *floorDriver) readdirplus(_ context.Context, m *meter) error         { return f.pingPong(m) }
func (f *floorDriver) readdirPages(_ context.Context, m *meter, _ int) error { return f.pingPong(m) }
func (f *floorDriver) io(_ context.Context, m *meter, _ ioParams, _ uint64) error {
	return f.pingPong(m)
}
func (f *floorDriver) ioForgets(_ context.Context, m *meter, _ ioParams, _ uint64) error {
	return f.pingPong(m)
}

func (f *floorDriver) usage() (usage, error) { return processUsage(f.cmd.Process.Pid) }

func (f *floorDriver) close() error {
	f.cmd.Process.Kill()
	<-f.exited
	f.ping.Close()
	f.pong.Close()
	return nil
}

// floorEcho is the echo process: poll(2) on the ping eventfd, read it, write the pong, until
// killed (or its parent dies: Pdeathsig).
func floorEcho() int {
	fds := []unix.PollFd{{Fd: floorPingFD, Events: unix.POLLIN}}
	var b, one [8]byte
	binary.NativeEndian.PutUint64(one[:], 1)
	for {
		if _, err := unix.Poll(fds, -1); err != nil {
			if err == unix.EINTR {
				continue
			}
			fmt.Fprintf(os.Stderr, "kvfsbench floor echo: poll: %v\n", err)
			return 1
		}
		if _, err := unix.Read(floorPingFD, b[:]); err != nil {
			fmt.Fprintf(os.Stderr, "kvfsbench floor echo: read: %v\n", err)
			return 1
		}
		if _, err := unix.Write(floorPongFD, one[:]); err != nil {
			fmt.Fprintf(os.Stderr, "kvfsbench floor echo: write: %v\n", err)
			return 1
		}
	}
}
