package vmtest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

var testGuest = Guest{Kernel: "/g/vmlinuz", Initrd: "/g/initramfs.gz"}

func TestQEMUArgs(t *testing.T) {
	base := []string{
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-machine", "q35,accel=tcg", "-cpu", "max", "-smp", "2", "-m", "1G",
		"-object", "memory-backend-memfd,id=mem,size=1G,share=on",
		"-numa", "node,memdev=mem",
	}
	boot := func(cmdline string) []string {
		return []string{"-kernel", "/g/vmlinuz", "-initrd", "/g/initramfs.gz", "-append", cmdline, "-serial", "stdio"}
	}
	const defCmdline = "console=ttyS0 quiet panic=-1 kvfs.tag=kvfs"

	tests := []struct {
		name  string
		o     Options
		accel string
		want  []string
	}{
		{
			name:  "no share",
			o:     Options{},
			accel: AccelTCG,
			want:  slices.Concat(base, boot(defCmdline)),
		},
		{
			name:  "share with defaults",
			o:     Options{Socket: "/run/s.sock", Run: "guestcheck.sh"},
			accel: AccelTCG,
			want: slices.Concat(base,
				[]string{
					"-chardev", "socket,id=vhostfs,path=/run/s.sock",
					"-device", "vhost-user-fs-pci,chardev=vhostfs,tag=kvfs,queue-size=1024",
				},
				boot(defCmdline+" kvfs.run=guestcheck.sh")),
		},
		{
			name: "everything set",
			o: Options{
				Socket: "/tmp/a,b/s.sock", Tag: "myfs", MemSize: "512M", SMP: 4, QueueSize: 128,
				Cmdline: " loglevel=7 ", Run: "dir/t.sh", ExtraArgs: []string{"-d", "guest_errors"},
			},
			accel: AccelKVM,
			want: []string{
				"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
				"-machine", "q35,accel=kvm", "-cpu", "max", "-smp", "4", "-m", "512M",
				"-object", "memory-backend-memfd,id=mem,size=512M,share=on",
				"-numa", "node,memdev=mem",
				"-chardev", "socket,id=vhostfs,path=/tmp/a,,b/s.sock",
				"-device", "vhost-user-fs-pci,chardev=vhostfs,tag=myfs,queue-size=128",
				"-kernel", "/g/vmlinuz", "-initrd", "/g/initramfs.gz",
				"-append", "console=ttyS0 quiet panic=-1 kvfs.tag=myfs kvfs.run=dir/t.sh loglevel=7",
				"-serial", "stdio",
				"-d", "guest_errors",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.o.QEMUArgs(testGuest, tt.accel)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("QEMUArgs:\n got %q\nwant %q", got, tt.want)
			}
		})
	}
}

func TestQEMUArgsRejects(t *testing.T) {
	tests := []struct {
		name  string
		g     Guest
		o     Options
		accel string
		want  string // part of the error
	}{
		{"unknown accel", testGuest, Options{}, "hvf", "unknown accelerator"},
		{"no accel", testGuest, Options{}, "", "unknown accelerator"},
		{"no kernel", Guest{Initrd: "x"}, Options{}, AccelTCG, "no kernel"},
		{"negative smp", testGuest, Options{SMP: -1}, AccelTCG, "SMP"},
		{"queue not a power of two", testGuest, Options{QueueSize: 100}, AccelTCG, "queue size"},
		{"queue too big", testGuest, Options{QueueSize: 2048}, AccelTCG, "queue size"},
		{"memory with comma", testGuest, Options{MemSize: "1G,share=off"}, AccelTCG, "memory size"},
		{"tag with space", testGuest, Options{Tag: "my fs"}, AccelTCG, "tag"},
		{"tag too long", testGuest, Options{Tag: strings.Repeat("t", 37)}, AccelTCG, "longer than 36"},
		{"run with quote", testGuest, Options{Run: `a"b`}, AccelTCG, "run"},
		{"run with newline", testGuest, Options{Run: "a\nb"}, AccelTCG, "run"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.o.QEMUArgs(tt.g, tt.accel)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("QEMUArgs error = %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestExitStatus(t *testing.T) {
	tests := []struct {
		console string
		want    int
	}{
		{"", -1},
		{"KVFS: booted\nno exit line\n", -1},
		{"KVFS-EXIT 0\n", 0},
		{"KVFS: mounted\nKVFS-EXIT 99\n[ 4.05] reboot: Power down\n", 99},
		{"script says KVFS-EXIT 3\nKVFS-EXIT 7\n", 7},
		{"KVFS-EXIT 5\nKVFS-EXIT x\n", 5},                // a malformed later line is skipped
		{"KVFS-EXIT 12345678901234567890\n", -1},         // not a status
		{"[    1.0] kvm: msg KVFS-EXIT 1\n", 1},          // kernel output on the same line
		{"KVFS-EXIT 2\nKVFS-EXIT 2000000000000000\n", 2}, // overlong status skipped
	}
	for _, tt := range tests {
		if got := ExitStatus(tt.console); got != tt.want {
			t.Errorf("ExitStatus(%q) = %d, want %d", tt.console, got, tt.want)
		}
	}
}

func TestParseGuestChecks(t *testing.T) {
	console := strings.Join([]string{
		"KVFS: running guestcheck.sh",
		"CHECK ok create",
		"CHECK-TIME create 0.01",
		"CHECK FAIL rename: old name still exists: x",
		"CHECK-TIME rename 0.20",
		"[   3.1] some kernel line",
		"  CHECK ok append  ",
		"CHECK FAIL bare",
		"CHECK ok rename",
		"CHECK-NOTE xattr not checked",
		"CHECK-SUMMARY passed=2 failed=2",
	}, "\n")
	rep := parseGuestChecks(console)
	if want := []string{"create", "rename", "append", "bare"}; !slices.Equal(rep.order, want) {
		t.Errorf("order = %q, want %q", rep.order, want)
	}
	wantResults := map[string]string{
		"create": "", "append": "", "bare": "(no detail)",
		"rename": "old name still exists: x", // a later ok does not hide the failure
	}
	for name, want := range wantResults {
		if got, ok := rep.results[name]; !ok || got != want {
			t.Errorf("results[%s] = %q, %v; want %q", name, got, ok, want)
		}
	}
	if !rep.haveSummary || rep.passed != 2 || rep.failed != 2 {
		t.Errorf("summary = %v %d %d, want true 2 2", rep.haveSummary, rep.passed, rep.failed)
	}
	if got, want := rep.timesLine(), "create=0.01 rename=0.20 append= bare="; got != want {
		t.Errorf("timesLine = %q, want %q", got, want)
	}
	if got := parseGuestChecks("CHECK-SUMMARY passed=x failed=0"); got.passed != -1 {
		t.Errorf("malformed summary parsed as passed=%d, want -1", got.passed)
	}
}

func TestGuestChecksMatchScript(t *testing.T) {
	// The list in guest_test.go and the check calls in guestcheck.sh must
	// agree, in order, without booting anything.
	script, err := os.ReadFile("guestcheck.sh")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, line := range strings.Split(string(script), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "check" && f[2] == "t_"+f[1] {
			names = append(names, f[1])
		}
	}
	if !slices.Equal(names, guestChecks) {
		t.Errorf("guestcheck.sh runs %q,\nguestChecks lists %q", names, guestChecks)
	}
}

// fakeQEMU writes a shell script standing in for QEMU and returns its path.
func fakeQEMU(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "qemu")
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestBootFakeQEMU(t *testing.T) {
	argsFile := filepath.Join(t.TempDir(), "args")
	tests := []struct {
		name       string
		body       string
		timeout    time.Duration
		wantErr    string // empty: no error
		wantStatus int
	}{
		{
			name:       "clean exit",
			body:       `printf '%s\n' "$@" >` + argsFile + `; printf 'KVFS: hi\r\nKVFS-EXIT 3\r\n'`,
			wantStatus: 3,
		},
		{
			name:       "no exit line",
			body:       `echo 'Kernel panic - not syncing'`,
			wantErr:    "without printing KVFS-EXIT",
			wantStatus: -1,
		},
		{
			name:       "qemu fails",
			body:       `echo 'qemu: cannot open socket' >&2; exit 1`,
			wantErr:    "cannot open socket",
			wantStatus: -1,
		},
		{
			name:       "timeout",
			body:       `echo KVFS: booted; exec sleep 60`,
			timeout:    300 * time.Millisecond,
			wantErr:    "still running after 300ms",
			wantStatus: -1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var console strings.Builder
			o := Options{QEMU: fakeQEMU(t, tt.body), Accel: AccelTCG, Socket: "/s", Timeout: tt.timeout, Console: &console}
			start := time.Now()
			res, err := Boot(t.Context(), testGuest, o)
			if time.Since(start) > 10*time.Second {
				t.Errorf("Boot took %v", time.Since(start))
			}
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("Boot: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("Boot error = %v, want one containing %q", err, tt.wantErr)
			}
			if res == nil {
				t.Fatal("no Result")
			}
			if res.ExitStatus != tt.wantStatus {
				t.Errorf("ExitStatus = %d, want %d", res.ExitStatus, tt.wantStatus)
			}
			if strings.Contains(res.Console, "\r") {
				t.Errorf("Console keeps carriage returns: %q", res.Console)
			}
			if got := strings.ReplaceAll(console.String(), "\r", ""); got != res.Console {
				t.Errorf("streamed console %q differs from Result.Console %q", got, res.Console)
			}
			if res.Accel != AccelTCG {
				t.Errorf("Accel = %q", res.Accel)
			}
		})
	}

	// The fake of the first case recorded its arguments.
	b, err := os.ReadFile(argsFile)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := Options{Socket: "/s"}.QEMUArgs(testGuest, AccelTCG)
	if got := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n"); !slices.Equal(got, want) {
		t.Errorf("QEMU got args %q, want %q", got, want)
	}
}

func TestBootCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(200*time.Millisecond, cancel)
	o := Options{QEMU: fakeQEMU(t, "exec sleep 60"), Accel: AccelTCG}
	res, err := Boot(ctx, testGuest, o)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Boot error = %v, want context.Canceled", err)
	}
	if res == nil || res.Duration > 10*time.Second {
		t.Errorf("Result = %+v", res)
	}
}
