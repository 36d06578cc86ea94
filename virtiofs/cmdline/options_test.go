package cmdline

import (
	"errors"
	"reflect"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/confine"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
	"golang.org/x/sys/unix"
)

// defaults is what Parse returns for "--shared-dir=/s --socket-path=/sock".
func defaults() Options {
	return Options{
		Server:     virtiofs.Config{SharedDir: "/s", Cache: virtiofs.CacheAuto},
		SocketPath: "/sock",
		FD:         -1,
		LogLevel:   LogInfo,
		Sandbox:    DefaultSandbox,
		Seccomp:    DefaultSeccomp,
	}
}

// with returns the arguments a socket and a shared directory, then args.
func with(args ...string) []string {
	return append([]string{"--shared-dir=/s", "--socket-path=/sock"}, args...)
}

func TestParse(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want func(o *Options)
	}{
		// Command lines seen in the wild.
		{
			name: "Kata Go runtime with default extra args",
			args: []string{"--syslog", "--cache=auto", "--shared-dir=/run/kata-containers/shared/sandboxes/abc/shared", "--fd=3", "--thread-pool-size=1", "--announce-submounts"},
			want: func(o *Options) {
				o.Syslog = true
				o.Server = virtiofs.Config{SharedDir: "/run/kata-containers/shared/sandboxes/abc/shared", Cache: virtiofs.CacheAuto, ThreadPoolSize: 1, AnnounceSubmounts: true}
				o.SocketPath, o.FD = "", 3
			},
		},
		{
			name: "Kata Go runtime unit test argv",
			args: []string{"--syslog", "--cache=never", "--shared-dir=/run/kata-shared/foo", "--fd=123"},
			want: func(o *Options) {
				o.Syslog = true
				o.Server = virtiofs.Config{SharedDir: "/run/kata-shared/foo", Cache: virtiofs.CacheNever}
				o.SocketPath, o.FD = "", 123
			},
		},
		{
			name: "Kata runtime-rs",
			args: []string{"--socket-path", "/run/kata/abc/root/virtiofsd.sock", "--shared-dir", "/run/kata-containers/shared/sandboxes/abc/ro", "--cache", "auto", "--thread-pool-size=1", "-o", "announce_submounts", "--xattr"},
			want: func(o *Options) {
				o.SocketPath = "/run/kata/abc/root/virtiofsd.sock"
				o.Server = virtiofs.Config{SharedDir: "/run/kata-containers/shared/sandboxes/abc/ro", Cache: virtiofs.CacheAuto, ThreadPoolSize: 1, AnnounceSubmounts: true, Xattr: true}
			},
		},
		{
			name: "C virtiofsd man page example",
			args: []string{"--socket-path=/tmp/vhostqemu", "-o", "source=/var/lib/fs/vm001", "-o", "cache=always"},
			want: func(o *Options) {
				o.SocketPath = "/tmp/vhostqemu"
				o.Server = virtiofs.Config{SharedDir: "/var/lib/fs/vm001", Cache: virtiofs.CacheAlways}
			},
		},
		{
			name: "C virtiofsd with a comma list",
			args: []string{"--socket-path=/sock", "-o", "source=/x,cache=auto,no_posix_lock"},
			want: func(o *Options) { o.Server.SharedDir = "/x" },
		},
		{
			name: "Rust virtiofsd README",
			args: []string{"--log-level=debug", "--socket-path=/tmp/virtiofs", "--shared-dir=/tmp/shared_dir", "--cache=never", "--sandbox=none", "--seccomp=none"},
			want: func(o *Options) {
				o.LogLevel, o.SocketPath = LogDebug, "/tmp/virtiofs"
				o.Server = virtiofs.Config{SharedDir: "/tmp/shared_dir", Cache: virtiofs.CacheNever}
				o.Sandbox, o.Seccomp = confine.SandboxNone, confine.SeccompNone
			},
		},
		{
			name: "both dialects mixed",
			args: []string{"-o", "source=/a,xattr", "--socket", "/sock", "-f", "--cache", "metadata", "-o", "log_level=warn", "--announce-submounts"},
			want: func(o *Options) {
				o.Server = virtiofs.Config{SharedDir: "/a", Cache: virtiofs.CacheMetadata, Xattr: true, AnnounceSubmounts: true}
				o.Foreground, o.LogLevel = true, LogWarn
			},
		},

		// Defaults and each option.
		{name: "defaults", args: with(), want: func(*Options) {}},
		{name: "shared dir, separate value", args: []string{"--shared-dir", "/d", "--socket-path", "/sock"}, want: func(o *Options) { o.Server.SharedDir = "/d" }},
		{name: "-o source", args: []string{"-o", "source=/d", "--socket-path=/sock"}, want: func(o *Options) { o.Server.SharedDir = "/d" }},
		{name: "-o attached", args: []string{"-osource=/d,cache=always", "--socket-path=/sock"}, want: func(o *Options) { o.Server.SharedDir = "/d"; o.Server.Cache = virtiofs.CacheAlways }},
		{name: "-o escaped comma", args: []string{"-o", `source=/a\,b\\c,xattr`, "--socket-path=/sock"}, want: func(o *Options) { o.Server.SharedDir = `/a,b\c`; o.Server.Xattr = true }},
		{name: "-o empty items", args: with("-o", ",xattr,,"), want: func(o *Options) { o.Server.Xattr = true }},
		{name: "value that is a dash", args: []string{"--shared-dir", "-", "--socket-path=/sock"}, want: func(o *Options) { o.Server.SharedDir = "-" }},
		{name: "--socket alias", args: []string{"--shared-dir=/s", "--socket=/other"}, want: func(o *Options) { o.SocketPath = "/other" }},
		{name: "--fd", args: []string{"--shared-dir=/s", "--fd", "0"}, want: func(o *Options) { o.SocketPath, o.FD = "", 0 }},
		{name: "--socket-group", args: with("--socket-group=kvm"), want: func(o *Options) { o.SocketGroup = "kvm" }},
		{name: "--socket-group separate", args: with("--socket-group", "kvm"), want: func(o *Options) { o.SocketGroup = "kvm" }},
		{name: "--cache never", args: with("--cache=never"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheNever }},
		{name: "--cache none", args: with("--cache=none"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheNever }},
		{name: "--cache metadata", args: with("--cache", "metadata"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheMetadata }},
		{name: "--cache auto", args: with("--cache=always", "--cache=auto"), want: func(*Options) {}},
		{name: "--cache always", args: with("--cache=always"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheAlways }},
		{name: "-o cache=none", args: with("-o", "cache=none"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheNever }},
		{name: "-o cache=never", args: with("-o", "cache=never"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheNever }},
		{name: "-o cache=metadata", args: with("-o", "cache=metadata"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheMetadata }},
		{name: "-o cache=auto", args: with("-o", "cache=auto"), want: func(*Options) {}},
		{name: "-o cache=always", args: with("-o", "cache=always"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheAlways }},
		{name: "--xattr", args: with("--xattr"), want: func(o *Options) { o.Server.Xattr = true }},
		{name: "--readonly", args: with("--readonly"), want: func(o *Options) { o.Server.ReadOnly = true }},
		{name: "--allow-mmap", args: with("--allow-mmap"), want: func(o *Options) { o.Server.AllowMmap = true }},
		{name: "--tag", args: with("--tag=myfs"), want: func(o *Options) { o.Tag = "myfs" }},
		{name: "--preserve-noatime", args: with("--preserve-noatime"), want: func(o *Options) { o.Server.PreserveNoatime = true }},
		{name: "--uid-map and --gid-map", args: with("--uid-map=:0:100000:65536:", "--uid-map", "/65536/5000/1/", "--gid-map=:0:200000:65536:"), want: func(o *Options) {
			o.UIDMap = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 100000, Size: 65536}, {ContainerID: 65536, HostID: 5000, Size: 1}}
			o.GIDMap = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 200000, Size: 65536}}
		}},
		{name: "--translate-uid and --translate-gid", args: with("--translate-uid=map:0:100000:65536", "--translate-uid", "forbid-guest:65536:100",
			"--translate-gid=squash-host:0:0:1000", "--translate-gid=host:1000:1000:1"), want: func(o *Options) {
			o.Server.TranslateUID = []passthrough.IDRule{{Kind: passthrough.IDMap, From: 0, To: 100000, Count: 65536}, {Kind: passthrough.IDForbidGuest, From: 65536, Count: 100}}
			o.Server.TranslateGID = []passthrough.IDRule{{Kind: passthrough.IDSquashHost, From: 0, To: 0, Count: 1000}, {Kind: passthrough.IDHost, From: 1000, To: 1000, Count: 1}}
		}},
		{name: "-o xattr", args: with("-o", "xattr"), want: func(o *Options) { o.Server.Xattr = true }},
		{name: "-o xattrmap", args: with("-o", "xattrmap=:prefix:all::user.virtiofs.::bad:all:::"), want: func(o *Options) {
			o.Server.XattrMap = ":prefix:all::user.virtiofs.::bad:all:::"
		}},
		{name: "--xattrmap", args: with("--xattrmap", "/ok/all///"), want: func(o *Options) { o.Server.XattrMap = "/ok/all///" }},
		{name: "-o no_xattr", args: with("--xattr", "-o", "no_xattr"), want: func(*Options) {}},
		{name: "--dax never", args: with("--dax=never"), want: func(o *Options) { o.Server.DAX.Mode = passthrough.DAXNever }},
		{name: "-o dax=always", args: with("-o", "dax=always"), want: func(o *Options) { o.Server.DAX.Mode = passthrough.DAXAlways }},
		{name: "-o dax=inode", args: with("-o", "dax=always,dax=inode"), want: func(*Options) {}},
		{name: "--dax-rules", args: with("--dax-rules", "on glob=*.so; off size>=1M"), want: func(o *Options) {
			o.Server.DAX.Rules = []passthrough.DAXRule{{Glob: "*.so", DAX: true}, {MinSize: 1 << 20}}
		}},
		{name: "-o dax_rules", args: with("-o", "dax_rules=on glob=lib/*"), want: func(o *Options) {
			o.Server.DAX.Rules = []passthrough.DAXRule{{Glob: "lib/*", DAX: true}}
		}},
		{name: "-o posix_lock", args: with("-o", "posix_lock"), want: func(o *Options) { o.Server.PosixLock = true }},
		{name: "-o no_posix_lock", args: with("-o", "no_posix_lock"), want: func(*Options) {}},
		{name: "-o no_posix_lock after posix_lock", args: with("-o", "posix_lock", "-o", "no_posix_lock"), want: func(*Options) {}},
		{name: "-o flock", args: with("-o", "flock"), want: func(o *Options) { o.Server.Flock = true }},
		{name: "-o no_flock", args: with("-o", "no_flock"), want: func(*Options) {}},
		{name: "-o no_flock after flock", args: with("-o", "flock,no_flock"), want: func(*Options) {}},
		{name: "-o posix_lock,flock", args: with("-o", "posix_lock,flock"), want: func(o *Options) { o.Server.PosixLock, o.Server.Flock = true, true }},
		{name: "-o posix_lock,no_flock", args: with("-o", "no_posix_lock,posix_lock,no_flock"), want: func(o *Options) { o.Server.PosixLock = true }},
		{name: "-o no_writeback", args: with("-o", "no_writeback"), want: func(*Options) {}},
		{name: "-o writeback", args: with("-o", "writeback"), want: func(o *Options) { o.Server.Writeback = true }},
		{name: "--writeback", args: with("--writeback"), want: func(o *Options) { o.Server.Writeback = true }},
		{name: "-o no_writeback after writeback", args: with("-o", "writeback,no_writeback"), want: func(*Options) {}},
		{name: "-o readdirplus", args: with("-o", "readdirplus"), want: func(o *Options) { o.Server.Readdirplus = new(true) }},
		{name: "-o no_readdirplus", args: with("-o", "no_readdirplus"), want: func(o *Options) { o.Server.Readdirplus = new(false) }},
		{name: "--no-readdirplus", args: with("--no-readdirplus"), want: func(o *Options) { o.Server.Readdirplus = new(false) }},
		{name: "-o readdirplus with cache=none", args: with("-o", "cache=none,readdirplus"), want: func(o *Options) {
			o.Server.Cache, o.Server.Readdirplus = virtiofs.CacheNever, new(true)
		}},
		{name: "-o timeout", args: with("-o", "timeout=5"), want: func(o *Options) { o.Server.Timeout = new(5 * time.Second) }},
		{name: "-o timeout fraction", args: with("-o", "timeout=0.25"), want: func(o *Options) { o.Server.Timeout = new(250 * time.Millisecond) }},
		{name: "-o timeout=0", args: with("-o", "cache=always,timeout=0"), want: func(o *Options) {
			o.Server.Cache, o.Server.Timeout = virtiofs.CacheAlways, new(time.Duration(0))
		}},
		{name: "-o no_posix_acl", args: with("-o", "no_posix_acl"), want: func(*Options) {}},
		{name: "-o posix_acl", args: with("-o", "posix_acl"), want: func(o *Options) { o.Server.PosixACL = true }},
		{name: "--posix-acl", args: with("--posix-acl"), want: func(o *Options) { o.Server.PosixACL = true }},
		{name: "-o no_posix_acl after posix_acl", args: with("-o", "posix_acl,no_posix_acl"), want: func(*Options) {}},
		{name: "-o no_security_label", args: with("-o", "no_security_label"), want: func(*Options) {}},
		{name: "-o security_label", args: with("-o", "security_label"), want: func(o *Options) { o.Server.SecurityLabel = true }},
		{name: "--security-label", args: with("--security-label"), want: func(o *Options) { o.Server.SecurityLabel = true }},
		{name: "-o no_killpriv_v2", args: with("-o", "no_killpriv_v2"), want: func(o *Options) { o.Server.KillprivV2 = new(false) }},
		{name: "--no-killpriv-v2", args: with("--no-killpriv-v2"), want: func(o *Options) { o.Server.KillprivV2 = new(false) }},
		{name: "-o killpriv_v2", args: with("-o", "killpriv_v2"), want: func(o *Options) { o.Server.KillprivV2 = new(true) }},
		{name: "--killpriv-v2", args: with("--killpriv-v2"), want: func(o *Options) { o.Server.KillprivV2 = new(true) }},
		{name: "-o xattr,no_killpriv_v2", args: with("-o", "xattr,killpriv_v2,no_killpriv_v2"), want: func(o *Options) {
			o.Server.Xattr, o.Server.KillprivV2 = true, new(false)
		}},
		{name: "--announce-submounts", args: with("--announce-submounts"), want: func(o *Options) { o.Server.AnnounceSubmounts = true }},
		{name: "-o announce_submounts", args: with("-o", "announce_submounts"), want: func(o *Options) { o.Server.AnnounceSubmounts = true }},
		{name: "--no-announce-submounts", args: with("--announce-submounts", "--no-announce-submounts"), want: func(*Options) {}},
		{name: "--thread-pool-size", args: with("--thread-pool-size=4"), want: func(o *Options) { o.Server.ThreadPoolSize = 4 }},
		{name: "--thread-pool-size separate", args: with("--thread-pool-size", "0"), want: func(*Options) {}},
		{name: "--poll-max-ns", args: with("--poll-max-ns=50000"), want: func(o *Options) { o.Server.PollMax = 50 * time.Microsecond }},
		{name: "-o poll_max_ns", args: with("-o", "cache=auto,poll_max_ns=10000000"), want: func(o *Options) { o.Server.PollMax = 10 * time.Millisecond }},
		{name: "--poll-max-ns 0", args: with("--poll-max-ns=32768", "--poll-max-ns", "0"), want: func(*Options) {}},
		{name: "--log-level error", args: with("--log-level=error"), want: func(o *Options) { o.LogLevel = LogError }},
		{name: "--log-level warn", args: with("--log-level", "warn"), want: func(o *Options) { o.LogLevel = LogWarn }},
		{name: "--log-level info", args: with("--log-level=debug", "--log-level=info"), want: func(*Options) {}},
		{name: "--log-level debug", args: with("--log-level=debug"), want: func(o *Options) { o.LogLevel = LogDebug }},
		{name: "--log-level trace", args: with("--log-level=trace"), want: func(o *Options) { o.LogLevel = LogTrace }},
		{name: "--log-level off", args: with("--log-level=off"), want: func(o *Options) { o.LogLevel = LogOff }},
		{name: "-o log_level=err", args: with("-o", "log_level=err"), want: func(o *Options) { o.LogLevel = LogError }},
		{name: "-o log_level=warn", args: with("-o", "log_level=warn"), want: func(o *Options) { o.LogLevel = LogWarn }},
		{name: "-o log_level=debug", args: with("-o", "log_level=debug"), want: func(o *Options) { o.LogLevel = LogDebug }},
		{name: "-o loglevel", args: with("-o", "loglevel=debug"), want: func(o *Options) { o.LogLevel = LogDebug }},
		{name: "-o debug", args: with("-o", "debug"), want: func(o *Options) { o.LogLevel = LogDebug; o.Foreground = true }},
		{name: "-d", args: with("-d"), want: func(o *Options) { o.LogLevel = LogDebug; o.Foreground = true }},
		{name: "-d then log_level", args: with("-d", "-o", "log_level=info"), want: func(o *Options) { o.Foreground = true }},
		{name: "-f", args: with("-f"), want: func(o *Options) { o.Foreground = true }},
		{name: "--syslog", args: with("--syslog"), want: func(o *Options) { o.Syslog = true }},
		{name: "--rlimit-nofile", args: with("--rlimit-nofile=4096"), want: func(o *Options) { o.RlimitNofile, o.RlimitNofileSet = 4096, true }},
		{name: "--rlimit-nofile 0", args: with("--rlimit-nofile", "0"), want: func(o *Options) { o.RlimitNofileSet = true }},
		{name: "--sandbox none", args: with("--sandbox", "none"), want: func(o *Options) { o.Sandbox = confine.SandboxNone }},
		{name: "-o sandbox=none", args: with("-o", "sandbox=none"), want: func(o *Options) { o.Sandbox = confine.SandboxNone }},
		{name: "--sandbox namespace", args: with("--sandbox", "namespace"), want: func(o *Options) { o.Sandbox = confine.SandboxNamespace }},
		{name: "--sandbox chroot", args: with("--sandbox=chroot"), want: func(o *Options) { o.Sandbox = confine.SandboxChroot }},
		{name: "-o sandbox=chroot", args: with("-o", "sandbox=chroot"), want: func(o *Options) { o.Sandbox = confine.SandboxChroot }},
		{name: "--seccomp none", args: with("--seccomp=none"), want: func(o *Options) { o.Seccomp = confine.SeccompNone }},
		{name: "--seccomp kill", args: with("--seccomp=kill"), want: func(o *Options) { o.Seccomp = confine.SeccompKill }},
		{name: "--seccomp log", args: with("--seccomp", "log"), want: func(o *Options) { o.Seccomp = confine.SeccompLog }},
		{name: "--seccomp trap", args: with("--seccomp=trap"), want: func(o *Options) { o.Seccomp = confine.SeccompTrap }},
		{name: "sandbox last wins", args: with("--sandbox=none", "-o", "sandbox=chroot"), want: func(o *Options) { o.Sandbox = confine.SandboxChroot }},
		{name: "--inode-file-handles never", args: with("--inode-file-handles=never"), want: func(*Options) {}},
		{name: "--modcaps", args: with("--modcaps=+sys_admin:-MKNOD"), want: func(o *Options) {
			o.Modcaps = []confine.CapabilityChange{{Cap: unix.CAP_SYS_ADMIN, Add: true}, {Cap: unix.CAP_MKNOD}}
		}},
		{name: "-o modcaps", args: with("-o", "modcaps=-cap_chown"), want: func(o *Options) {
			o.Modcaps = []confine.CapabilityChange{{Cap: unix.CAP_CHOWN}}
		}},
		{name: "--inode-file-handles prefer", args: with("--inode-file-handles=prefer"), want: func(o *Options) { o.Server.InodeFileHandles = passthrough.FileHandlesPrefer }},
		{name: "--inode-file-handles mandatory", args: with("--inode-file-handles", "mandatory"), want: func(o *Options) { o.Server.InodeFileHandles = passthrough.FileHandlesMandatory }},

		// Last wins.
		{name: "duplicate --thread-pool-size", args: with("--thread-pool-size=1", "--thread-pool-size=2"), want: func(o *Options) { o.Server.ThreadPoolSize = 2 }},
		{name: "duplicate cache across dialects", args: with("--cache=never", "-o", "cache=always"), want: func(o *Options) { o.Server.Cache = virtiofs.CacheAlways }},
		{name: "duplicate shared dir across dialects", args: []string{"-o", "source=/a", "--shared-dir=/b", "--socket-path=/sock"}, want: func(o *Options) { o.Server.SharedDir = "/b" }},
		{name: "duplicate socket path", args: with("--socket-path=/other"), want: func(o *Options) { o.SocketPath = "/other" }},

		// Nothing else is needed to print something and exit.
		{name: "--print-capabilities", args: []string{"--print-capabilities"}, want: func(o *Options) {
			*o = Options{FD: -1, LogLevel: LogInfo, Sandbox: DefaultSandbox, Seccomp: DefaultSeccomp, PrintCapabilities: true}
		}},
		{name: "--help", args: []string{"--help"}, want: func(o *Options) {
			*o = Options{FD: -1, LogLevel: LogInfo, Sandbox: DefaultSandbox, Seccomp: DefaultSeccomp, Help: true}
		}},
		{name: "-h", args: []string{"-h"}, want: func(o *Options) {
			*o = Options{FD: -1, LogLevel: LogInfo, Sandbox: DefaultSandbox, Seccomp: DefaultSeccomp, Help: true}
		}},
		{name: "--version", args: []string{"--version"}, want: func(o *Options) {
			*o = Options{FD: -1, LogLevel: LogInfo, Sandbox: DefaultSandbox, Seccomp: DefaultSeccomp, Version: true}
		}},
		{name: "-V", args: []string{"-V"}, want: func(o *Options) {
			*o = Options{FD: -1, LogLevel: LogInfo, Sandbox: DefaultSandbox, Seccomp: DefaultSeccomp, Version: true}
		}},
		{name: "--help with both sockets", args: []string{"--help", "--fd=3", "--socket-path=/s"}, want: func(o *Options) {
			*o = Options{FD: 3, SocketPath: "/s", LogLevel: LogInfo, Sandbox: DefaultSandbox, Seccomp: DefaultSeccomp, Help: true}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.args)
			if err != nil {
				t.Fatalf("Parse(%q): %v", tt.args, err)
			}
			want := defaults()
			tt.want(&want)
			if !reflect.DeepEqual(*got, want) {
				t.Errorf("Parse(%q)\n got %+v\nwant %+v", tt.args, *got, want)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		// want are substrings of the message; is, when set, must be in the error chain.
		want []string
		is   error
	}{
		// Unknown.
		{name: "unknown long", args: with("--bogus"), want: []string{"--bogus: unknown option"}, is: ErrUnknownOption},
		{name: "unknown long with value", args: with("--bogus=1"), want: []string{"--bogus: unknown option"}, is: ErrUnknownOption},
		{name: "unknown short", args: with("-x"), want: []string{"-x: unknown option"}, is: ErrUnknownOption},
		{name: "short options do not combine", args: with("-fd"), want: []string{"-fd: unknown option"}, is: ErrUnknownOption},
		{name: "unknown -o", args: with("-o", "source=/x,bogus"), want: []string{"-o bogus: unknown option"}, is: ErrUnknownOption},
		{name: "double dash", args: with("--"), want: []string{"--: unknown option"}, is: ErrUnknownOption},
		{name: "positional", args: with("/mnt"), want: []string{`unexpected argument "/mnt"`}},

		// Not supported yet: the options the task lists by name.
		{name: "-o timeout negative", args: with("-o", "timeout=-1"), want: []string{`-o timeout: invalid timeout "-1"`}},
		{name: "-o timeout not a number", args: with("-o", "timeout=1s"), want: []string{`-o timeout: invalid timeout "1s"`}},
		{name: "-o timeout NaN", args: with("-o", "timeout=NaN"), want: []string{`-o timeout: invalid timeout "NaN"`}},
		{name: "-o timeout too long", args: with("-o", "timeout=1e300"), want: []string{`-o timeout: invalid timeout "1e300"`}},
		{name: "-o timeout without value", args: with("-o", "timeout"), want: []string{"-o timeout: missing value"}},
		{name: "-o writeback with a value", args: with("-o", "writeback=1"), want: []string{"-o writeback: takes no value"}},
		{name: "-o xattrmap map rule", args: with("-o", "xattrmap=:map::user.virtiofs.:"), want: []string{"-o xattrmap: not supported yet", `"map"`}, is: ErrNotSupported},
		{name: "--xattrmap map rule", args: with("--xattrmap", ":map::user.virtiofs.:"), want: []string{"--xattrmap: not supported yet", `"map"`}, is: ErrNotSupported},
		{name: "--xattrmap bad syntax", args: with("--xattrmap", ":ok:all::"), want: []string{"--xattrmap", "want :type:scope:key:prepend:"}},
		{name: "--dax bad mode", args: with("--dax=sometimes"), want: []string{`--dax: invalid DAX policy "sometimes"`}},
		{name: "-o dax_rules bad glob", args: with("-o", "dax_rules=on glob=["), want: []string{"-o dax_rules", "syntax error in pattern"}},
		{name: "--daemonize", args: with("--daemonize"), want: []string{"--daemonize: not supported yet"}, is: ErrNotSupported},
		{name: "--tag too long", args: with("--tag=" + strings.Repeat("t", 37)), want: []string{"invalid tag", "1 to 36 bytes"}},
		{name: "--uid-map alone", args: with("--uid-map=:0:1000:1:"), want: []string{"--uid-map and --gid-map go together"}},
		{name: "--gid-map bad delimiters", args: with("--gid-map", ":0:1000:1/"), want: []string{"--gid-map", "the delimiter \":\" first and last"}},
		{name: "--uid-map two fields", args: with("--uid-map", ":0:1000:", "--gid-map=:0:1:1:"), want: []string{"--uid-map", "want :INSIDE:OUTSIDE:COUNT:"}},
		{name: "--uid-map zero count", args: with("--uid-map", ":0:1000:0:", "--gid-map=:0:1:1:"), want: []string{"--uid-map", "a count of at least 1"}},
		{name: "--uid-map past 32 bits", args: with("--uid-map", ":0:4294967295:2:", "--gid-map=:0:1:1:"), want: []string{"--uid-map", "within 32-bit ids"}},
		{name: "--uid-map without 0", args: with("--uid-map", ":1:1000:1:", "--gid-map=:0:1:1:"), want: []string{"must each map id 0 inside"}},
		{name: "--uid-map with chroot", args: with("--uid-map=:0:1000:1:", "--gid-map=:0:1000:1:", "--sandbox=chroot"), want: []string{"not --sandbox=chroot"}},
		{name: "--uid-map with mandatory handles", args: with("--uid-map=:0:1000:1:", "--gid-map=:0:1000:1:", "--inode-file-handles=mandatory"),
			want: []string{"--inode-file-handles=mandatory"}},
		{name: "--translate-uid unknown kind", args: with("--translate-uid=swap:0:1000:1"), want: []string{"--translate-uid", `unknown kind "swap"`}},
		{name: "--translate-uid three fields", args: with("--translate-uid=map:0:1000"), want: []string{"--translate-uid", "want map:FROM:TO:COUNT"}},
		{name: "--translate-gid forbid four fields", args: with("--translate-gid=forbid-guest:0:1:2"), want: []string{"--translate-gid", "want forbid-guest:FROM:COUNT"}},
		{name: "--translate-uid not a number", args: with("--translate-uid=guest:0:x:1"), want: []string{"--translate-uid", `"x" is not an id or count`}},
		{name: "--translate-uid overlap", args: with("--translate-uid=forbid-guest:0:1000", "--translate-uid=map:999:5000:2"),
			want: []string{"uid translation", "map:999:5000:2: its range meets that of forbid-guest:0:1000"}},
		{name: "--translate-gid past the last id", args: with("--translate-gid=guest:4294967295:0:2"), want: []string{"gid translation", "past the last id"}},
		{name: "--translate-uid empty", args: with("--translate-uid=host:0:0:0"), want: []string{"uid translation", "an empty range"}},
		{name: "--translate-uid with --posix-acl", args: with("--translate-uid=map:0:1000:1", "--posix-acl"), want: []string{"uid translation and POSIX ACLs together"}},
		{name: "--migration-mode", args: with("--migration-mode=find-paths"), want: []string{"--migration-mode: not supported yet"}, is: ErrNotSupported},
		{name: "--migration-on-error", args: with("--migration-on-error", "abort"), want: []string{"--migration-on-error: not supported yet"}, is: ErrNotSupported},
		{name: "--migration-verify-handles", args: with("--migration-verify-handles"), want: []string{"--migration-verify-handles: not supported yet"}, is: ErrNotSupported},
		{name: "--migration-confirm-paths", args: with("--migration-confirm-paths"), want: []string{"--migration-confirm-paths: not supported yet"}, is: ErrNotSupported},
		{name: "refused even without its value", args: with("--migration-mode"), want: []string{"--migration-mode: not supported yet"}, is: ErrNotSupported},

		// Invalid values.
		{name: "--modcaps unknown", args: with("--modcaps=+sys_admin:+nope"), want: []string{`--modcaps: "+nope": no capability nope`}},
		{name: "-o modcaps without a sign", args: with("-o", "modcaps=sys_admin"), want: []string{`-o modcaps: "sys_admin": want +NAME or -NAME`}},
		{name: "--modcaps chroot", args: with("--sandbox=chroot", "--modcaps=-mknod"), want: []string{"--modcaps: kvfsd drops capabilities only with --sandbox=namespace (not chroot)"}},
		{name: "--cache bogus", args: with("--cache=bogus"), want: []string{"--cache: invalid cache mode"}},
		{name: "-o cache bogus", args: with("-o", "cache=bogus"), want: []string{"-o cache: invalid cache mode"}},
		{name: "--sandbox bogus", args: with("--sandbox=bogus"), want: []string{"--sandbox: invalid sandbox mode"}},
		{name: "--seccomp bogus", args: with("--seccomp=bogus"), want: []string{"--seccomp: invalid seccomp action"}},
		{name: "--inode-file-handles bogus", args: with("--inode-file-handles=bogus"), want: []string{"--inode-file-handles: invalid"}},
		{name: "--log-level bogus", args: with("--log-level=verbose"), want: []string{`--log-level: invalid log level "verbose"`}},
		{name: "-o log_level bogus", args: with("-o", "log_level=verbose"), want: []string{`-o log_level: invalid log level`}},

		// Missing and empty values, values where none is taken.
		{name: "--shared-dir at the end", args: []string{"--socket-path=/sock", "--shared-dir"}, want: []string{"--shared-dir: missing value"}},
		{name: "--socket-path before an option", args: []string{"--shared-dir=/s", "--socket-path", "--fd=3"}, want: []string{"--socket-path: missing value"}},
		{name: "--fd at the end", args: []string{"--shared-dir=/s", "--fd"}, want: []string{"--fd: missing value"}},
		{name: "--cache at the end", args: with("--cache"), want: []string{"--cache: missing value"}},
		{name: "-o at the end", args: with("-o"), want: []string{"-o: missing value"}},
		{name: "-o before an option", args: with("-o", "--xattr"), want: []string{"-o: missing value"}},
		{name: "-o only commas", args: with("-o", ",,"), want: []string{"-o: missing value"}},
		{name: "-o trailing backslash", args: with("-o", `source=/a\`), want: []string{"-o: trailing backslash"}},
		{name: "-o source without value", args: with("-o", "source"), want: []string{"-o source: missing value"}},
		{name: "-o source empty", args: []string{"--socket-path=/sock", "-o", "source="}, want: []string{"-o source: empty value"}},
		{name: "--shared-dir empty", args: []string{"--socket-path=/sock", "--shared-dir="}, want: []string{"--shared-dir: empty value"}},
		{name: "--socket-path empty", args: []string{"--shared-dir=/s", "--socket-path="}, want: []string{"--socket-path: empty value"}},
		{name: "--xattr with value", args: with("--xattr=true"), want: []string{"--xattr: takes no value"}},
		{name: "--syslog with value", args: with("--syslog=1"), want: []string{"--syslog: takes no value"}},
		{name: "-o xattr with value", args: with("-o", "xattr=1"), want: []string{"-o xattr: takes no value"}},

		// Bad numbers.
		{name: "--fd not a number", args: []string{"--shared-dir=/s", "--fd=three"}, want: []string{`--fd: invalid file descriptor "three"`}},
		{name: "--fd negative", args: []string{"--shared-dir=/s", "--fd=-1"}, want: []string{`--fd: invalid file descriptor "-1"`}},
		{name: "--fd negative separate", args: []string{"--shared-dir=/s", "--fd", "-1"}, want: []string{"--fd: missing value"}},
		{name: "--fd too big", args: []string{"--shared-dir=/s", "--fd=4294967296"}, want: []string{"--fd: invalid file descriptor"}},
		{name: "--thread-pool-size negative", args: with("--thread-pool-size=-1"), want: []string{`--thread-pool-size: invalid thread pool size "-1"`}},
		{name: "--thread-pool-size not a number", args: with("--thread-pool-size=many"), want: []string{`--thread-pool-size: invalid thread pool size "many"`}},
		{name: "--thread-pool-size hex", args: with("--thread-pool-size=0x4"), want: []string{"--thread-pool-size: invalid"}},
		{name: "--poll-max-ns negative", args: with("--poll-max-ns=-1"), want: []string{`--poll-max-ns: invalid poll limit "-1": want nanoseconds from 0 to 10000000`}},
		{name: "--poll-max-ns too long", args: with("--poll-max-ns=10000001"), want: []string{`--poll-max-ns: invalid poll limit "10000001"`}},
		{name: "--poll-max-ns unit", args: with("--poll-max-ns=50us"), want: []string{`--poll-max-ns: invalid poll limit "50us"`}},
		{name: "-o poll_max_ns not a number", args: with("-o", "poll_max_ns=fast"), want: []string{`-o poll_max_ns: invalid poll limit "fast"`}},
		{name: "-o poll_max_ns without value", args: with("-o", "poll_max_ns"), want: []string{"-o poll_max_ns: missing value (-o poll_max_ns=NS)"}},
		{name: "--rlimit-nofile negative", args: with("--rlimit-nofile=-5"), want: []string{`--rlimit-nofile: invalid file descriptor limit "-5"`}},
		{name: "--rlimit-nofile suffix", args: with("--rlimit-nofile=1k"), want: []string{`--rlimit-nofile: invalid file descriptor limit "1k"`}},
		{name: "--rlimit-nofile overflow", args: with("--rlimit-nofile=18446744073709551616"), want: []string{"--rlimit-nofile: invalid"}},

		// Combinations.
		{name: "both --socket-path and --fd", args: with("--fd=3"), want: []string{"--socket-path and --fd are mutually exclusive"}},
		{name: "no socket", args: []string{"--shared-dir=/s"}, want: []string{"no vhost-user socket", "--socket-path", "--fd"}},
		{name: "no shared dir", args: []string{"--socket-path=/sock"}, want: []string{"no shared directory", "--shared-dir", "-o source"}},
		{name: "nothing at all", args: nil, want: []string{"no vhost-user socket"}},
		{name: "socket group with --fd", args: []string{"--shared-dir=/s", "--fd=3", "--socket-group=kvm"}, want: []string{"--socket-group applies only"}},
		{name: "--print-capabilities still rejects unknown options", args: []string{"--print-capabilities", "--bogus"}, is: ErrUnknownOption},
		{name: "--help still rejects unsupported options", args: []string{"--help", "-o", "allow_direct_io"}, is: ErrNotSupported},
		{name: "-o posix_lock with a value", args: with("-o", "posix_lock=1"), want: []string{"-o posix_lock: takes no value"}},
		{name: "-o flock with a value", args: with("-o", "flock=yes"), want: []string{"-o flock: takes no value"}},
		{name: "--posix-lock is not a Rust virtiofsd option", args: with("--posix-lock"), want: []string{"--posix-lock: unknown option"}, is: ErrUnknownOption},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.args)
			if err == nil {
				t.Fatalf("Parse(%q) = %+v, want an error", tt.args, *got)
			}
			if got != nil {
				t.Errorf("Parse(%q) returned options with its error", tt.args)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Parse(%q) error %q does not contain %q", tt.args, err, w)
				}
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Errorf("Parse(%q) error %q is not %v", tt.args, err, tt.is)
			}
		})
	}
}

// TestRefusedOptions checks every option the tables refuse, in every spelling, so that none can
// slip through as accepted: the error names the option, wraps ErrNotSupported and says why.
func TestRefusedOptions(t *testing.T) {
	check := func(t *testing.T, display string, args []string) {
		t.Helper()
		_, err := Parse(args)
		if !errors.Is(err, ErrNotSupported) {
			t.Fatalf("Parse(%q) error = %v, want ErrNotSupported", args, err)
		}
		var oe *OptionError
		if !errors.As(err, &oe) || oe.Option != display {
			t.Errorf("Parse(%q) error %q does not name %s", args, err, display)
		}
		if msg := err.Error(); len(msg) < len(display)+len(": not supported yet: ")+10 {
			t.Errorf("Parse(%q) error %q gives no reason", args, err)
		}
	}
	for _, name := range sortedKeys(longOptions) {
		opt := longOptions[name]
		if opt.refused == "" {
			continue
		}
		if opt.value == "" {
			check(t, "--"+name, with("--"+name))
		} else {
			check(t, "--"+name, with("--"+name+"=x"))
			check(t, "--"+name, with("--"+name, "x"))
		}
	}
	for _, name := range sortedKeys(subOptions) {
		opt := subOptions[name]
		if opt.refused == "" {
			continue
		}
		arg := name
		if opt.value != "" {
			arg += "=1"
		}
		check(t, "-o "+name, with("-o", arg))
		check(t, "-o "+name, with("-o", "xattr,"+arg+",no_xattr"))
	}
}

// TestServerCapabilities: what a --sandbox=namespace server keeps, by option.
func TestServerCapabilities(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want []confine.Capability
	}{
		{with(), confine.ServerCapabilities},
		{with("--inode-file-handles=prefer"), append(slices.Clone(confine.ServerCapabilities), unix.CAP_DAC_READ_SEARCH)},
		{with("--modcaps=+sys_admin:-mknod:+mknod:-chown"), []confine.Capability{
			unix.CAP_DAC_OVERRIDE, unix.CAP_FOWNER, unix.CAP_FSETID, unix.CAP_SETUID, unix.CAP_SETGID,
			unix.CAP_SETFCAP, unix.CAP_SYS_ADMIN, unix.CAP_MKNOD}},
	} {
		o, err := Parse(tt.args)
		if err != nil {
			t.Fatal(err)
		}
		if got := o.ServerCapabilities(); !slices.Equal(got, tt.want) {
			t.Errorf("%q: %v, want %v", tt.args, got, tt.want)
		}
	}
}

// TestUsageMentionsEveryOption keeps Usage in step with the option tables.
func TestUsageMentionsEveryOption(t *testing.T) {
	u := Usage()
	for name := range longOptions {
		if !strings.Contains(u, "--"+name) {
			t.Errorf("Usage does not mention --%s", name)
		}
	}
	for name := range subOptions {
		if !strings.Contains(u, name) {
			t.Errorf("Usage does not mention -o %s", name)
		}
	}
	for _, s := range []string{"-h", "-V", "-f", "-d", "last one wins", "does not sandbox itself", "pivot_root"} {
		if !strings.Contains(u, s) {
			t.Errorf("Usage does not mention %q", s)
		}
	}
	for i, line := range strings.Split(u, "\n") {
		if len([]rune(line)) > 80 {
			t.Errorf("Usage line %d is longer than 80 columns: %q", i+1, line)
		}
	}
}

func sortedKeys(m map[string]option) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
