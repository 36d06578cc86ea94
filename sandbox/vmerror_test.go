package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeQEMUEnv makes the test binary play QEMU on a PVM host (see runFakeQEMU): set by
// TestVMError, inherited through QEMURunner.
const fakeQEMUEnv = "KVFS_SANDBOX_FAKE_QEMU"

// runFakeQEMU does what QEMU 7.2 does under a PVM host's KVM with a stock kernel, and what a
// hostile guest's console adds: it opens the console's file of its arguments as QEMU's file
// chardev does, writes console lines with control bytes in them, then complains on stderr
// as QEMU does, and exits 1 (QEMU aborts: a Go program cannot die of SIGABRT).
func runFakeQEMU(args []string) int {
	var path string
	for i, a := range args {
		if p, ok := strings.CutPrefix(a, "file,id="+consoleID+",path="); ok && i > 0 && args[i-1] == "-chardev" {
			path, _, _ = strings.Cut(p, ",append=on")
		}
	}
	if path == "" {
		fmt.Fprintln(os.Stderr, "fake qemu: no console in the arguments")
		return 2
	}
	console, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake qemu:", err)
		return 2
	}
	fmt.Fprint(console, "\x1b[2J\x1b[31mearly console\r\n")
	for i := range 50 {
		fmt.Fprintf(console, "guest line %d\r\n", i)
	}
	fmt.Fprint(console, "Kernel panic - not syncing: \x00\xff\x07 attempted to kill init!\r\n")
	fmt.Fprint(os.Stderr, "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69\n"+
		"qemu-system-x86_64: ../../target/i386/kvm/kvm.c:2893: kvm_buf_set_msrs: Assertion `ret == cpu->kvm_msr_buf->nmsrs' failed.\n")
	return 1
}

// TestVMError starts the fake QEMU through QEMURunner and checks what VMError says once it
// exited: how QEMU exited, its own last lines, the console's last lines sanitized, and, only
// when vm.accel = "" chose KVM, that accel = "tcg" is the way out. After VMExited the logs
// on disk are complete and sanitized.
func TestVMError(t *testing.T) {
	requireRoot(t)
	t.Setenv(fakeQEMUEnv, "1")
	base := testBase(t)
	ctx := context.Background()
	for _, tt := range []struct {
		name, config, vm string
		hint             bool
	}{
		{"accel auto chose kvm", "", AccelKVM, true},
		{"accel kvm configured", AccelKVM, AccelKVM, false},
		{"accel auto chose tcg", "", AccelTCG, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := testConfig(base)
			c.VM.QEMU, c.VM.Accel = os.Args[0], tt.config
			s, err := Create(ctx, "boot-"+strings.ReplaceAll(tt.name, " ", "-"), Options{Config: c})
			if err != nil {
				t.Fatal(err)
			}
			stopOnCleanup(t, s)
			vm := s.DefaultVM()
			vm.Accel = tt.vm // what DetectAccel would answer
			if err := s.Start(ctx, vm); err != nil {
				t.Fatal(err)
			}
			select {
			case <-s.VMExited():
			case <-time.After(time.Minute):
				t.Fatal("the fake QEMU did not exit")
			}
			why := errors.New("the VM exited before the agent answered")
			err = s.VMError(why)
			msg := err.Error()
			t.Logf("VMError:\n%s", msg)
			var be *VMError
			if !errors.Is(err, why) || !errors.As(err, &be) || be.Exit != "exit status 1" || be.AutoKVM != tt.hint {
				t.Errorf("VMError = %#v", err)
			}
			for _, want := range []string{
				"the VM exited before the agent answered; QEMU exited (exit status 1)",
				"\nQEMU's output, last lines:\n    qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69\n" +
					"    qemu-system-x86_64: ../../target/i386/kvm/kvm.c:2893: kvm_buf_set_msrs: Assertion `ret == cpu->kvm_msr_buf->nmsrs' failed.\n" +
					"the guest's console, last lines:\n",
				"\n    guest line 49\n    Kernel panic - not syncing: \\x00\\xff\\x07 attempted to kill init!",
			} {
				if !strings.Contains(msg, want) {
					t.Errorf("the message lacks %q", want)
				}
			}
			if n := strings.Count(msg, "\n    guest line "); n > tailLines-1 {
				t.Errorf("%d console lines quoted, want at most %d", n+1, tailLines)
			}
			if strings.ContainsAny(msg, "\x1b\x00\x07\r") || strings.Contains(msg, "\xff") {
				t.Error("a control byte of the console reached the message")
			}
			if hint := strings.Contains(msg, `set accel = "tcg" in the [vm] section`); hint != tt.hint {
				t.Errorf("the accel hint is there: %v, want %v", hint, tt.hint)
			}
			console := readFile(t, s.ConsolePath())
			if !strings.HasPrefix(console, `\x1b[2J\x1b[31mearly console`+"\n") ||
				!strings.HasSuffix(console, `Kernel panic - not syncing: \x00\xff\x07 attempted to kill init!`+"\n") {
				t.Errorf("console.log:\n%s", console)
			}
			if q := readFile(t, filepath.Join(s.Dir(), qemuLogName)); !strings.Contains(q, "failed to set MSR 0x10a") {
				t.Errorf("qemu.log:\n%s", q)
			}
		})
	}
}

// TestVMErrorNotStarted: before a VM runs, VMError only wraps the reason.
func TestVMErrorNotStarted(t *testing.T) {
	requireRoot(t)
	s, err := Create(context.Background(), "boot-none", Options{Config: testConfig(testBase(t))})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	why := errors.New("no answer")
	if got := s.VMError(why).Error(); got != "no answer\nQEMU's output: nothing\nthe guest's console: nothing" {
		t.Errorf("VMError = %q", got)
	}
}
