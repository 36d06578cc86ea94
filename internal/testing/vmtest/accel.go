package vmtest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// probeTimeout bounds the KVM probe boot. A working KVM boots the guest in
// a few seconds even on a busy host.
const probeTimeout = 20 * time.Second

// accelState caches the accelerator choice for this process.
var accelState struct {
	sync.Mutex
	accel, why string // guarded by the mutex; empty until the first choice
}

// chooseAccel picks the accelerator for guests booted from g: $KVFS_ACCEL if
// set; TCG if /dev/kvm cannot be opened; else the verdict of a probe boot
// under KVM, cached in this process and, for the host's current boot, in a
// file next to the kernel.
func chooseAccel(ctx context.Context, g Guest, qemu string) (accel, why string) {
	if v := os.Getenv("KVFS_ACCEL"); v != "" {
		return v, "$KVFS_ACCEL"
	}
	accelState.Lock()
	defer accelState.Unlock()
	if accelState.accel == "" {
		accel, why, final := probeAccel(ctx, g, qemu)
		if !final {
			return accel, why
		}
		accelState.accel, accelState.why = accel, why
	}
	return accelState.accel, accelState.why
}

// probeAccel decides between KVM and TCG. final is false when the decision
// was cut short by ctx and must not be remembered.
func probeAccel(ctx context.Context, g Guest, qemu string) (accel, why string, final bool) {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return AccelTCG, fmt.Sprintf("no usable /dev/kvm (%v)", err), true
	}
	f.Close()

	bootID := readBootID()
	cache := filepath.Join(filepath.Dir(g.Kernel), "accel")
	if b, err := os.ReadFile(cache); err == nil && bootID != "" {
		id, rest, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
		accel, why, _ := strings.Cut(rest, " ")
		if id == bootID && (accel == AccelKVM || accel == AccelTCG) {
			return accel, why + " (cached in " + cache + ")", true
		}
	}

	// Without a share the guest's mount fails at once and it powers off
	// with KVFS-EXIT 99: reaching that line is all the probe asks for.
	o := Options{Tag: "kvfs-probe"}.withDefaults()
	args, err := o.QEMUArgs(g, AccelKVM)
	if err != nil {
		return AccelTCG, fmt.Sprintf("KVM probe not run: %v", err), true
	}
	res, err := run(ctx, qemu, args, probeTimeout, nil)
	if ctx.Err() != nil {
		return AccelTCG, "KVM probe cancelled", false
	}
	if err != nil {
		accel, why = AccelTCG, "a probe boot under KVM failed: "+firstLine(err.Error())
	} else {
		accel, why = AccelKVM, fmt.Sprintf("a probe boot under KVM took %v", res.Duration.Round(time.Millisecond))
	}
	if bootID != "" {
		tmp := cache + ".tmp"
		if os.WriteFile(tmp, []byte(bootID+" "+accel+" "+why+"\n"), 0o644) == nil {
			_ = os.Rename(tmp, cache)
		}
	}
	return accel, why, true
}

// readBootID identifies the host's current boot, or returns "".
func readBootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// Accel answers the accelerator Boot would use for guests of g's kernel, and why: g must be
// an Image guest (the KVM probe boots it). A guest built otherwise, such as AgentImage's,
// takes the verdict reached with Image's guest of the same kernel.
func Accel(ctx context.Context, g Guest) (accel, why string) {
	return chooseAccel(ctx, g, DefaultQEMU)
}
