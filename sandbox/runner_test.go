package sandbox

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestQEMURunnerExtraFiles runs a shell in QEMU's place: the files of VMCommand.ExtraFiles are
// its descriptors 3 and 4, in order (VM.Args names NIC i's tap fd=3+i).
func TestQEMURunnerExtraFiles(t *testing.T) {
	dir := t.TempDir()
	var files []*os.File
	for _, content := range []string{"first\n", "second\n"} {
		p := filepath.Join(dir, content[:len(content)-1])
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		files = append(files, f)
	}
	logPath := filepath.Join(dir, "qemu.log")
	p, err := QEMURunner{}.Run(context.Background(), VMCommand{
		Path: "/bin/sh", Args: []string{"-c", "cat <&3; cat <&4"}, LogPath: logPath, ExtraFiles: files,
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Exited():
	case <-time.After(30 * time.Second):
		t.Fatal("the shell did not exit")
	}
	if err := p.ExitErr(); err != nil {
		t.Fatalf("the shell: %v", err)
	}
	if b, _ := os.ReadFile(logPath); string(b) != "first\nsecond\n" {
		t.Errorf("descriptors 3 and 4 read %q, want the extra files in order", b)
	}
}
