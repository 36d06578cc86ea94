package agent

import (
	"strings"
	"testing"

	"github.com/sirupsen/logrus"
)

func TestParseCmdline(t *testing.T) {
	good := []struct {
		line string
		want BootParams
	}{
		{"console=ttyS0 quiet panic=-1 kvfs.tag=kataShared kvfs.agent=serial",
			BootParams{Tag: "kataShared", Transport: TransportSerial}},
		{"kvfs.tag=t", BootParams{Tag: "t", Transport: TransportSerial}},
		{"kvfs.tag=t kvfs.agent=vsock", BootParams{Tag: "t", Transport: TransportVsock, VsockPort: 1024}},
		{"kvfs.tag=t kvfs.agent=vsock:5000 kvfs.debug=1\n", BootParams{Tag: "t", Transport: TransportVsock, VsockPort: 5000, Debug: true}},
		{"kvfs.agent=vsock:7 kvfs.agent=serial kvfs.tag=a kvfs.tag=b kvfs.debug=1 kvfs.debug=0 ro",
			BootParams{Tag: "b", Transport: TransportSerial}},
		{"kvfs.tag=t kvfs.hostname=web-0.ns", BootParams{Tag: "t", Transport: TransportSerial, Hostname: "web-0.ns"}},
		{"kvfs.tag=t kvfs.fault=stats-silent", BootParams{Tag: "t", Transport: TransportSerial, Fault: "stats-silent"}},
	}
	for _, g := range good {
		got, err := ParseCmdline(g.line)
		if err != nil || got != g.want {
			t.Errorf("ParseCmdline(%q) = %+v, %v; want %+v", g.line, got, err, g.want)
		}
	}
	bad := []struct{ line, want string }{
		{"console=ttyS0", "no kvfs.tag="},
		{"kvfs.tag=", "kvfs.tag: empty"},
		{"kvfs.tag=t kvfs.agent=tcp", "kvfs.agent=tcp"},
		{"kvfs.tag=t kvfs.agent=serial:3", "kvfs.agent=serial:3"},
		{"kvfs.tag=t kvfs.agent=vsock:0", "kvfs.agent=vsock:0"},
		{"kvfs.tag=t kvfs.agent=vsock:99999999999", "vsock port"},
		{"kvfs.tag=t kvfs.debug=yes", "kvfs.debug=yes"},
		{"kvfs.tag=t kvfs.hostname=", "kvfs.hostname: hostname \"\""},
		{"kvfs.tag=t kvfs.hostname=-x", "kvfs.hostname: hostname \"-x\""},
		{"kvfs.tag=t kvfs.hostname=a_b", "kvfs.hostname: hostname \"a_b\""},
		{"kvfs.tag=t kvfs.hostname=" + strings.Repeat("a", 65), "want 1 to 64 bytes"},
		{"kvfs.tag=t kvfs.fault=", "kvfs.fault: empty mode"},
	}
	for _, b := range bad {
		_, err := ParseCmdline(b.line)
		if err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("ParseCmdline(%q) = %v, want an error saying %q", b.line, err, b.want)
		}
	}
}

func TestLogFormat(t *testing.T) {
	log := logrus.New()
	var b strings.Builder
	log.SetOutput(&b)
	log.SetFormatter(logFormat{})
	log.WithFields(logrus.Fields{"pid": 7, "container": "c1"}).Info("container created")
	if got, want := b.String(), "kvfs-agent: info container created container=c1 pid=7\n"; got != want {
		t.Errorf("log line %q, want %q", got, want)
	}
}
