package cmdline

import (
	"errors"
	"fmt"
	"io"
	"log/syslog"

	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	lsyslog "github.com/sirupsen/logrus/hooks/syslog"
)

// SyslogTag is the tag of kvfsd's syslog messages.
const SyslogTag = "kvfsd"

// ErrNoSyslog is wrapped by ConfigureLogger's error when --syslog was asked for and syslog
// cannot be reached. The logger then still writes to its previous output.
var ErrNoSyslog = errors.New("syslog unavailable")

// ConfigureLogger sets l up as o asks: its level, and with o.Syslog, messages to the local
// syslog daemon (facility daemon, tag SyslogTag) instead of l's output. LogOff discards
// everything.
//
// An error wrapping ErrNoSyslog leaves l logging to its output at the requested level: the
// caller can warn and carry on, as a daemon started with --syslog on a host without syslog
// (a container, say) should still serve.
func ConfigureLogger(l *logrus.Logger, o *Options) error {
	return configureLogger(l, o, func() (logrus.Hook, error) {
		return lsyslog.NewSyslogHook("", "", syslog.LOG_DAEMON|syslog.LOG_INFO, SyslogTag)
	})
}

// configureLogger is ConfigureLogger with the syslog connection made by dial.
func configureLogger(l *logrus.Logger, o *Options, dial func() (logrus.Hook, error)) error {
	l.SetFormatter(&logrus.TextFormatter{TimestampFormat: log.RFC3339NanoFixed, FullTimestamp: true})
	if o.LogLevel == LogOff {
		l.SetLevel(logrus.PanicLevel)
		l.SetOutput(io.Discard)
		return nil
	}
	level, err := logrus.ParseLevel(o.LogLevel)
	if err != nil {
		return fmt.Errorf("log level: %w", err)
	}
	l.SetLevel(level)
	if !o.Syslog {
		return nil
	}
	hook, err := dial()
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNoSyslog, err)
	}
	l.AddHook(hook)
	l.SetOutput(io.Discard)
	// syslog stamps messages itself.
	l.SetFormatter(&logrus.TextFormatter{DisableTimestamp: true})
	return nil
}
