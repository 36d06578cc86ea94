package shim

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/containerd/log"
)

// What the guest can cause to be logged, and its text in the shim's lines and errors, bounded:
// a log line of each kind at most every guestLogInterval (guestLogger), the guest's text
// escaped and cut (guestText).

const (
	// guestLogInterval is the least time between two log lines of one kind that the guest can
	// cause at will.
	guestLogInterval = 10 * time.Second
	// guestTextMax bounds the guest's text (an error's message) the shim passes on.
	guestTextMax = 1024
)

// guestLogger lets through at most one log line of each kind per guestLogInterval, saying how
// many it held back: what the guest can cause to be logged must not flood containerd's log.
// It is the one way the guest's misbehaviour reaches the log (the door's violations, the
// frames the agent connection drops, failed output reads and waits, OOM reports); the guest's
// text in its lines goes through guestText.
type guestLogger struct {
	mu   sync.Mutex
	last map[string]time.Time // guarded by mu; kinds are the shim's constants, a few
	held map[string]int       // guarded by mu
}

func (g *guestLogger) warn(kind string, e *log.Entry, msg string) {
	g.mu.Lock()
	if g.last == nil {
		g.last, g.held = map[string]time.Time{}, map[string]int{}
	}
	if time.Since(g.last[kind]) < guestLogInterval {
		g.held[kind]++
		g.mu.Unlock()
		return
	}
	held := g.held[kind]
	g.last[kind], g.held[kind] = time.Now(), 0
	g.mu.Unlock()
	if held > 0 {
		e = e.WithField("held_back", held)
	}
	e.Warn(msg)
}

// guestText is s, text from the guest, made fit for a log line or an error: every character
// that is not printable (control characters, invalid UTF-8, the format characters that turn
// text around) escaped as Go quotes it, and the result cut to guestTextMax bytes.
func guestText(s string) string {
	var b strings.Builder
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		piece := s[:n]
		switch {
		case r == utf8.RuneError && n == 1:
			piece = fmt.Sprintf(`\x%02x`, s[0])
		case !unicode.IsPrint(r):
			q := strconv.QuoteRune(r)
			piece = q[1 : len(q)-1]
		}
		if b.Len()+len(piece) > guestTextMax {
			return b.String() + "…"
		}
		b.WriteString(piece)
		s = s[n:]
	}
	return b.String()
}
