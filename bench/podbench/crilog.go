package podbench

import (
	"bufio"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// CRILogLine is a line of a container's log file as containerd's CRI writes it:
// "TIMESTAMP STREAM TAG MESSAGE", the timestamp RFC 3339 with nanoseconds, when the CRI read
// the output from the shim; the tag F for a full line, P for part of one.
type CRILogLine struct {
	Time    time.Time
	Stream  string // stdout or stderr
	Partial bool
	Msg     string
}

// ParseCRILogLine reads one line (without its newline) of a CRI container log.
func ParseCRILogLine(line string) (CRILogLine, error) {
	f := strings.SplitN(line, " ", 4)
	if len(f) < 3 {
		return CRILogLine{}, fmt.Errorf("CRI log line %q: not TIMESTAMP STREAM TAG MESSAGE", line)
	}
	t, err := time.Parse(time.RFC3339Nano, f[0])
	if err != nil {
		return CRILogLine{}, fmt.Errorf("CRI log line %q: %w", line, err)
	}
	if f[1] != "stdout" && f[1] != "stderr" {
		return CRILogLine{}, fmt.Errorf("CRI log line %q: stream %q", line, f[1])
	}
	l := CRILogLine{Time: t, Stream: f[1]}
	switch tag, _, _ := strings.Cut(f[2], ":"); tag {
	case "F":
	case "P":
		l.Partial = true
	default:
		return CRILogLine{}, fmt.Errorf("CRI log line %q: tag %q", line, f[2])
	}
	if len(f) == 4 {
		l.Msg = f[3]
	}
	return l, nil
}

// FirstCRILine is the first full line of a CRI container log (the file's text so far) whose
// message is want; ok is false while there is none.
func FirstCRILine(log, want string) (l CRILogLine, ok bool, err error) {
	for _, s := range strings.SplitAfter(log, "\n") {
		if !strings.HasSuffix(s, "\n") { // being written
			break
		}
		if l, err = ParseCRILogLine(strings.TrimSuffix(s, "\n")); err != nil {
			return l, false, err
		}
		if !l.Partial && l.Msg == want {
			return l, true, nil
		}
	}
	return CRILogLine{}, false, nil
}

// CRIEvents are what containerd's log says of the CRI calls: when each RunPodSandbox was
// received, by pod name, and when each StartContainer returned, by container id.
type CRIEvents struct {
	RunPodSandbox  map[string]time.Time
	StartContainer map[string]time.Time
}

var (
	runPodRe   = regexp.MustCompile(`^RunPodSandbox for name:"([^"]*)"`)
	startCtrRe = regexp.MustCompile(`^StartContainer for "([^"]+)" returns successfully$`)
)

// ParseCRIEvents reads containerd's log for the CRI's lines "RunPodSandbox for name:"NAME"
// uid:... namespace:..." (the request received, not its "... returns sandbox id" or
// "... failed"; the first of a name counts) and "StartContainer for "ID" returns
// successfully"; other lines are skipped.
func ParseCRIEvents(log string) (CRIEvents, error) {
	ev := CRIEvents{RunPodSandbox: map[string]time.Time{}, StartContainer: map[string]time.Time{}}
	sc := bufio.NewScanner(strings.NewReader(log))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if !strings.HasPrefix(sc.Text(), "time=") {
			continue
		}
		f, err := ParseLogLine(sc.Text())
		if err != nil {
			continue
		}
		pod := runPodRe.FindStringSubmatch(f["msg"])
		if pod != nil && (strings.Contains(f["msg"], "\" returns ") || strings.Contains(f["msg"], "\" failed")) {
			pod = nil
		}
		ctr := startCtrRe.FindStringSubmatch(f["msg"])
		if pod == nil && ctr == nil {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, f["time"])
		if err != nil {
			return ev, fmt.Errorf("%q: time: %w", sc.Text(), err)
		}
		if pod != nil {
			if _, seen := ev.RunPodSandbox[pod[1]]; !seen {
				ev.RunPodSandbox[pod[1]] = t
			}
		} else {
			ev.StartContainer[ctr[1]] = t
		}
	}
	return ev, sc.Err()
}

// ParseCPUTicks is the CPU time in /proc/PID/stat's text: utime + stime + cutime + cstime,
// the process's own and that of its children it has waited for, in clock ticks.
func ParseCPUTicks(stat string) (int64, error) {
	end := strings.LastIndexByte(stat, ')')
	if end < 0 {
		return 0, fmt.Errorf("stat %q: no (comm)", stat)
	}
	f := strings.Fields(stat[end+1:])
	// After the name: state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt
	// cmajflt utime stime cutime cstime.
	if len(f) < 15 {
		return 0, fmt.Errorf("stat %q: %d fields after the name, want at least 15", stat, len(f))
	}
	var sum int64
	for _, s := range f[11:15] {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("stat: CPU times: %w", err)
		}
		sum += n
	}
	return sum, nil
}
