package cmdline

import (
	"bytes"
	"errors"
	"log/syslog"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	lsyslog "github.com/sirupsen/logrus/hooks/syslog"
)

func TestConfigureLoggerLevels(t *testing.T) {
	for level, want := range map[string]logrus.Level{
		LogError: logrus.ErrorLevel,
		LogWarn:  logrus.WarnLevel,
		LogInfo:  logrus.InfoLevel,
		LogDebug: logrus.DebugLevel,
		LogTrace: logrus.TraceLevel,
	} {
		t.Run(level, func(t *testing.T) {
			var out bytes.Buffer
			l := logrus.New()
			l.SetOutput(&out)
			if err := ConfigureLogger(l, &Options{LogLevel: level}); err != nil {
				t.Fatal(err)
			}
			if l.GetLevel() != want {
				t.Errorf("level = %v, want %v", l.GetLevel(), want)
			}
			l.Log(want, "visible")
			l.Log(want+1, "hidden")
			if got := out.String(); !strings.Contains(got, "visible") || strings.Contains(got, "hidden") {
				t.Errorf("output %q", got)
			}
		})
	}
}

func TestConfigureLoggerOff(t *testing.T) {
	var out bytes.Buffer
	l := logrus.New()
	l.SetOutput(&out)
	dialed := false
	err := configureLogger(l, &Options{LogLevel: LogOff, Syslog: true}, func() (logrus.Hook, error) {
		dialed = true
		return nil, errors.New("unexpected")
	})
	if err != nil {
		t.Fatal(err)
	}
	l.Error("nobody hears this")
	if out.Len() != 0 || dialed {
		t.Errorf("off logged %q, dialed syslog: %v", out.String(), dialed)
	}
}

// TestConfigureLoggerSyslog logs through a fake syslog daemon on a datagram socket.
func TestConfigureLoggerSyslog(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	daemon, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer daemon.Close()

	var out bytes.Buffer
	l := logrus.New()
	l.SetOutput(&out)
	err = configureLogger(l, &Options{LogLevel: LogDebug, Syslog: true}, func() (logrus.Hook, error) {
		return lsyslog.NewSyslogHook("unixgram", path, syslog.LOG_DAEMON|syslog.LOG_INFO, SyslogTag)
	})
	if err != nil {
		t.Fatal(err)
	}
	l.Debug("Waiting for vhost-user socket connection...")

	daemon.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 4096)
	n, err := daemon.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	msg := string(buf[:n])
	// <31> is facility daemon (3), severity debug (7).
	for _, want := range []string{"<31>", " kvfsd[", "Waiting for vhost-user socket connection..."} {
		if !strings.Contains(msg, want) {
			t.Errorf("syslog message %q does not contain %q", msg, want)
		}
	}
	if strings.Contains(msg, "time=") {
		t.Errorf("syslog message %q carries a timestamp of its own", msg)
	}
	if out.Len() != 0 {
		t.Errorf("with syslog, the logger still wrote %q", out.String())
	}
}

func TestConfigureLoggerNoSyslog(t *testing.T) {
	var out bytes.Buffer
	l := logrus.New()
	l.SetOutput(&out)
	err := configureLogger(l, &Options{LogLevel: LogWarn, Syslog: true}, func() (logrus.Hook, error) {
		return nil, errors.New("no /dev/log")
	})
	if !errors.Is(err, ErrNoSyslog) || !strings.Contains(err.Error(), "no /dev/log") {
		t.Fatalf("error = %v, want ErrNoSyslog with the cause", err)
	}
	l.Warn("still here")
	if l.GetLevel() != logrus.WarnLevel || !strings.Contains(out.String(), "still here") {
		t.Errorf("level %v, output %q: want warn, logging to the old output", l.GetLevel(), out.String())
	}
}
