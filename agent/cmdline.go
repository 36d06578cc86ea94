package agent

import (
	"fmt"
	"strconv"
	"strings"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// Transports.
const (
	TransportSerial = "serial"
	TransportVsock  = "vsock"
)

// BootParams are the agent's settings from the kernel command line.
type BootParams struct {
	// Tag is the virtio-fs tag mounted at apiv1.SharedDir (kvfs.tag=); required.
	Tag string
	// Transport is TransportSerial (the default) or TransportVsock (kvfs.agent=).
	Transport string
	// VsockPort is the port listened on with TransportVsock.
	VsockPort uint32
	// Debug is kvfs.debug=1.
	Debug bool
	// Hostname is the guest's hostname (kvfs.hostname=), if given.
	Hostname string
	// Fault is the test fault mode (kvfs.fault=), if given: only an agent built with the
	// kvfsfaults tag knows the modes (fault.go); any other refuses to boot with one
	// (fault_off.go).
	Fault string
}

// ParseCmdline reads the agent's parameters from a kernel command line (/proc/cmdline);
// other words are left alone. A bad value is an error naming the parameter.
func ParseCmdline(cmdline string) (BootParams, error) {
	p := BootParams{Transport: TransportSerial}
	for _, w := range strings.Fields(cmdline) {
		key, val, ok := strings.Cut(w, "=")
		if !ok {
			continue
		}
		switch key {
		case apiv1.CmdlineTag:
			if val == "" {
				return p, fmt.Errorf("%s: empty tag", apiv1.CmdlineTag)
			}
			p.Tag = val
		case apiv1.CmdlineTransport:
			kind, port, hasPort := strings.Cut(val, ":")
			switch {
			case kind == TransportSerial && !hasPort:
				p.Transport, p.VsockPort = TransportSerial, 0
			case kind == TransportVsock:
				p.Transport, p.VsockPort = TransportVsock, apiv1.DefaultVsockPort
				if hasPort {
					n, err := strconv.ParseUint(port, 10, 32)
					if err != nil || n == 0 {
						return p, fmt.Errorf("%s=%s: want a vsock port from 1 to %d", apiv1.CmdlineTransport, val, uint32(1<<32-1))
					}
					p.VsockPort = uint32(n)
				}
			default:
				return p, fmt.Errorf("%s=%s: want serial or vsock[:PORT]", apiv1.CmdlineTransport, val)
			}
		case apiv1.CmdlineHostname:
			if err := apiv1.CheckHostname(val); err != nil {
				return p, fmt.Errorf("%s: %w", apiv1.CmdlineHostname, err)
			}
			p.Hostname = val
		case apiv1.CmdlineFault:
			if val == "" {
				return p, fmt.Errorf("%s: empty mode", apiv1.CmdlineFault)
			}
			p.Fault = val
		case apiv1.CmdlineDebug:
			switch val {
			case "1", "true", "on":
				p.Debug = true
			case "0", "false", "off":
				p.Debug = false
			default:
				return p, fmt.Errorf("%s=%s: want 1 or 0", apiv1.CmdlineDebug, val)
			}
		}
	}
	if p.Tag == "" {
		return p, fmt.Errorf("no %s= on the kernel command line", apiv1.CmdlineTag)
	}
	return p, nil
}
