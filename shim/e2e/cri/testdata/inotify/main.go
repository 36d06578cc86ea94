// Command inotify watches a directory as an application that reloads its configuration on
// change does: it prints "watching", then a line per inotify event on the directory, "event
// NAME MASK", until it is killed. TestCRIPod runs it on a configMap-like volume.
package main

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

func main() {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if _, err := unix.InotifyAddWatch(fd, os.Args[1], unix.IN_CREATE|unix.IN_DELETE|unix.IN_MOVED_FROM|unix.IN_MOVED_TO|unix.IN_MODIFY|unix.IN_ATTRIB); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("watching")
	buf := make([]byte, 64<<10)
	for {
		n, err := unix.Read(fd, buf)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			var ev unix.InotifyEvent
			binary.Read(bytes.NewReader(buf[off:off+unix.SizeofInotifyEvent]), binary.NativeEndian, &ev)
			name := bytes.TrimRight(buf[off+unix.SizeofInotifyEvent:off+unix.SizeofInotifyEvent+int(ev.Len)], "\x00")
			fmt.Printf("event %s %#x\n", name, ev.Mask)
			off += unix.SizeofInotifyEvent + int(ev.Len)
		}
	}
}
