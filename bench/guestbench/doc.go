// Package guestbench measures kvfsd in a real guest: one Debian 12 guest under QEMU (TCG on the
// project's machines) mounts kvfsd, the C virtiofsd and 9p at once, each on a fresh directory
// of one host tmpfs, and runs fio (psync, libaio at depth 16 and mmap at 4 KiB; psync at 1 MiB),
// a metadata workload, a 64 MiB dd write and cold read, a C build of generated sources with
// tcc, and a parallel build of a real C code base (Lua 5.4.4, unmodified: make -jN with tcc, in
// place on the share, from cold caches; lua.go) on every mount. Two more kvfsd shares with
// --xattr, one with KILLPRIV_V2 and one without, take 4 KiB random writes, and their request
// counters show the GETXATTR of security.capability the guest sends before every WRITE without
// it.
//
// Method. The guest image is packaging/guest/build.sh --bench (fio, tcc, GNU make, the 9p
// modules and the helper packaging/guest/bench/kvfs-gbench.c added to the test image, in a
// cache directory of its own). The Lua tarball is downloaded once into a cache directory
// (IMAGE/src) and must match its pinned SHA-256; the host unpacks it onto every compared share.
// guest.sh, on a control share, runs every workload (or those -run selects) on every mount back
// to back, for several runs, rotating the order of the mounts from run to run, and prints one
// "GB" line per result on the serial console; Parse collects them, and the report (Section,
// Chart) gives medians over the runs and the median and range of the per-run ratios, oriented
// so that above 1 is better for kvfsd. kvfsd and the C virtiofsd run as processes, started as
// Kata starts virtiofsd; the KILLPRIV_V2 pair and the control share are served by kvfsd's
// server inside this process, so that their counters can be read.
package guestbench
