package syncbuf

import (
	"strings"
	"sync"
	"testing"
)

// TestConcurrent writes from several goroutines while reading: under -race this fails if the
// buffer is not guarded, and every write must be in the result whole.
func TestConcurrent(t *testing.T) {
	var b Buffer
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				b.Write([]byte("line\n"))
			}
		}()
	}
	for range 100 {
		_ = b.String()
	}
	wg.Wait()
	if got := strings.Count(b.String(), "line\n"); got != 400 {
		t.Fatalf("%d lines, want 400", got)
	}
}
