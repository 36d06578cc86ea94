// Command busybox-image writes the busybox test image (package ociimage) as an OCI image
// layout archive, for `ctr image import`:
//
//	go run ./internal/ociimage/cmd/busybox-image -o busybox.tar
//	ctr --address SOCK image import busybox.tar
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/kvfs/kvfs/internal/ociimage"
)

func main() {
	out := flag.String("o", "", "the archive to write (required)")
	name := flag.String("name", ociimage.BusyboxName, "the image's name")
	busybox := flag.String("busybox", ociimage.BusyboxPath, "a statically linked busybox")
	flag.Parse()
	if *out == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: busybox-image -o FILE [-name NAME] [-busybox PATH]")
		os.Exit(2)
	}
	if err := write(*out, *name, *busybox); err != nil {
		fmt.Fprintf(os.Stderr, "busybox-image: %v\n", err)
		os.Exit(1)
	}
}

func write(out, name, busybox string) error {
	img, err := ociimage.Busybox(name, busybox)
	if err != nil {
		return err
	}
	return img.WriteFile(out)
}
