//go:build !kvfsfaults

package agent

import (
	"strings"
	"testing"
)

// Without the kvfsfaults tag a fault mode is refused, naming the parameter, and no mode is
// the agent as usual.
func TestFaultRefused(t *testing.T) {
	if f, err := faultInterceptor("", nil, nil); f != nil || err != nil {
		t.Errorf("no mode: %v, %v; want no interceptor", f, err)
	}
	_, err := faultInterceptor("stats-silent", nil, nil)
	if err == nil || !strings.Contains(err.Error(), "kvfs.fault=stats-silent: this agent is built without fault injection") {
		t.Errorf("a mode in an agent built without faults: %v, want a refusal naming kvfs.fault", err)
	}
}
