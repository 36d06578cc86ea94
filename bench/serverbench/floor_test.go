package serverbench

import (
	"os"
	"strconv"
	"testing"
	"time"
)

// TestMain lets the test binary be the floor's echo process, as kvfsbench is (floorEchoEnv).
func TestMain(m *testing.M) {
	if os.Getenv(floorEchoEnv) != "" {
		os.Exit(floorEcho())
	}
	os.Exit(m.Run())
}

func TestFloor(t *testing.T) {
	f, err := startFloor()
	if err != nil {
		t.Fatal(err)
	}
	m := newMeter(time.Minute, f.usage, nil)
	m.maxOps = 2000
	if err := f.pingPong(m); err != nil {
		t.Fatal(err)
	}
	if m.ops != 2000 || len(m.lat) != 2000 {
		t.Errorf("%d round trips timed (%d latencies), want 2000", m.ops, len(m.lat))
	}
	// Every round trip woke the echo process once: its voluntary switches count them.
	if got := m.u1.Switches - m.u0.Switches; got < 1000 {
		t.Errorf("the echo process switched %d times for 2000 round trips", got)
	}
	pid := f.cmd.Process.Pid
	if err := f.close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); err == nil {
		t.Errorf("echo process %d still exists after close", pid)
	}
	// A dead echo is an error, not a hang.
	f, err = startFloor()
	if err != nil {
		t.Fatal(err)
	}
	f.cmd.Process.Kill()
	<-f.exited
	if err := f.roundTrip(); err == nil {
		t.Error("a round trip with the echo process dead succeeded")
	}
	f.ping.Close()
	f.pong.Close()
}
