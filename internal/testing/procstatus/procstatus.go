// Package procstatus reads a process's or a thread's /proc/.../status: its capabilities, its
// memory, its PID in each namespace.
package procstatus

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Status is the fields of one status file, by name, with the value's surrounding blanks
// trimmed ("VmRSS" → "1234 kB").
type Status map[string]string

// Read reads /proc/WHO/status; WHO is a PID, "self", "thread-self" or "PID/task/TID".
func Read(who string) (Status, error) {
	b, err := os.ReadFile("/proc/" + who + "/status")
	if err != nil {
		return nil, err
	}
	return Parse(string(b)), nil
}

// ReadPID reads /proc/PID/status.
func ReadPID(pid int) (Status, error) { return Read(strconv.Itoa(pid)) }

// Parse splits a status file's text into its fields.
func Parse(text string) Status {
	s := Status{}
	for _, line := range strings.Split(text, "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			s[k] = strings.TrimSpace(v)
		}
	}
	return s
}

// Bytes returns a memory field ("VmRSS", "RssAnon", ...), given in kB, in bytes.
func (s Status) Bytes(field string) (int64, error) {
	v, ok := s[field]
	if !ok {
		return 0, fmt.Errorf("status has no %s", field)
	}
	kb, err := strconv.ParseInt(strings.TrimSuffix(v, " kB"), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("status: %s: %q is not a size in kB", field, v)
	}
	return kb << 10, nil
}
