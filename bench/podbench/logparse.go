package podbench

import (
	"bufio"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ParseLogLine reads a logrus text line (key=value pairs, values quoted with Go's quoting
// when they need it) into its fields.
func ParseLogLine(line string) (map[string]string, error) {
	f := map[string]string{}
	s := strings.TrimSpace(line)
	for s != "" {
		eq := strings.IndexByte(s, '=')
		if eq <= 0 || strings.ContainsAny(s[:eq], " \"") {
			return nil, fmt.Errorf("no key=value at %q", s)
		}
		key := s[:eq]
		s = s[eq+1:]
		var val string
		if strings.HasPrefix(s, `"`) {
			q, err := strconv.QuotedPrefix(s)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", key, err)
			}
			if val, err = strconv.Unquote(q); err != nil {
				return nil, fmt.Errorf("%s: %w", key, err)
			}
			s = s[len(q):]
		} else {
			end := strings.IndexByte(s, ' ')
			if end < 0 {
				end = len(s)
			}
			val, s = s[:end], s[end:]
		}
		f[key] = val
		s = strings.TrimLeft(s, " ")
	}
	return f, nil
}

// ShimEvents are what containerd's log (with its shims' lines) says of one container's run.
type ShimEvents struct {
	Connect, Disconnect time.Time // "connecting to shim ID", "shim disconnected" id=ID
	// Answer is the kvfs shim's "the guest agent answers" for sandbox ID, and Boot its boot_*
	// fields (total, qemu, kernel, agent); zero for runc.
	Answer time.Time
	Boot   map[string]time.Duration
}

// Span is Disconnect − Connect: containerd's view of the shim's life.
func (e ShimEvents) Span() time.Duration {
	if e.Connect.IsZero() || e.Disconnect.IsZero() {
		return 0
	}
	return e.Disconnect.Sub(e.Connect)
}

// ParseEvents collects the ShimEvents of every container in log; lines that are not logrus
// text lines are skipped. A container seen twice keeps its first connect and last disconnect.
func ParseEvents(log string) (map[string]*ShimEvents, error) {
	out := map[string]*ShimEvents{}
	get := func(id string) *ShimEvents {
		e := out[id]
		if e == nil {
			e = &ShimEvents{}
			out[id] = e
		}
		return e
	}
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
		msg := f["msg"]
		var id string
		switch {
		case strings.HasPrefix(msg, "connecting to shim "):
			id = strings.TrimPrefix(msg, "connecting to shim ")
		case msg == "shim disconnected":
			id = f["id"]
		case msg == "the guest agent answers":
			id = f["sandbox"]
		default:
			continue
		}
		if id == "" {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, f["time"])
		if err != nil {
			return nil, fmt.Errorf("%q: time: %w", sc.Text(), err)
		}
		e := get(id)
		switch msg {
		case "shim disconnected":
			e.Disconnect = t
		case "the guest agent answers":
			e.Answer = t
			e.Boot = map[string]time.Duration{}
			for _, k := range []string{"total", "qemu", "kernel", "agent"} {
				if v, ok := f["boot_"+k]; ok {
					d, err := time.ParseDuration(v)
					if err != nil {
						return nil, fmt.Errorf("%q: boot_%s: %w", sc.Text(), k, err)
					}
					e.Boot[k] = d
				}
			}
		default:
			if e.Connect.IsZero() {
				e.Connect = t
			}
		}
	}
	return out, sc.Err()
}
