/*
 * kvfs-mmap: a small static helper for the guest conformance suite
 * (internal/testing/vmtest/guestcheck.sh). Busybox has no way to drive mmap(2) or
 * fsync(2) on a chosen file, so this does it.
 *
 *   kvfs-mmap mmap    FILE SIZE  create FILE, grow it to SIZE, fill it through a
 *                                MAP_SHARED mapping, msync, unmap, then check the
 *                                contents with read(2)
 *   kvfs-mmap fsync   FILE SIZE  create FILE, fill it with write(2), fsync and
 *                                fdatasync, then check the contents with read(2)
 *   kvfs-mmap verify  FILE SIZE  check FILE with read(2)
 *   kvfs-mmap mapread FILE SIZE  check FILE through a read-only shared mapping
 *   kvfs-mmap xattr   FILE       set user.kvfs=hello-xattr on FILE and read it
 *                                back, list it, set and remove user.gone, and
 *                                check that it is gone (busybox has no setfattr)
 *   kvfs-mmap killpriv FILE [HOW,...]
 *                                as root, for each HOW of write, ftruncate and
 *                                otrunc (open(O_TRUNC); default all three):
 *                                make FILE.HOW set-user-ID,
 *                                set-group-ID, group-executable, writable by all
 *                                and carrying security.capability, do HOW to it
 *                                as user and group 1000 (no CAP_FSETID), and check
 *                                that the set-id bits and security.capability
 *                                are gone, as on a local file system
 *
 * Every mode writes or expects the same position-dependent byte pattern, so a
 * file written by one mode can be checked by another (for example after the
 * guest dropped its page cache). Exit status 0 on success, 1 with a message on
 * standard error otherwise.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

static const char *prog = "kvfs-mmap";

static void die(const char *what, const char *file)
{
	fprintf(stderr, "%s: %s %s: %s\n", prog, what, file, strerror(errno));
	exit(1);
}

static void fail(const char *file, const char *msg, uint64_t off)
{
	fprintf(stderr, "%s: %s: %s at offset %llu\n", prog, file, msg,
		(unsigned long long)off);
	exit(1);
}

/* pattern returns the byte expected at offset off. It changes within a page
 * and between pages so that misplaced pages are detected. */
static unsigned char pattern(uint64_t off)
{
	return (unsigned char)(off ^ (off >> 8) ^ (off >> 16) ^ 0x5a);
}

static void fill(unsigned char *buf, uint64_t off, size_t n)
{
	for (size_t i = 0; i < n; i++)
		buf[i] = pattern(off + i);
}

static void check_size(int fd, const char *file, uint64_t size)
{
	struct stat st;

	if (fstat(fd, &st) != 0)
		die("fstat", file);
	if ((uint64_t)st.st_size != size) {
		fprintf(stderr, "%s: %s: size %lld, want %llu\n", prog, file,
			(long long)st.st_size, (unsigned long long)size);
		exit(1);
	}
}

static void verify_read(const char *file, uint64_t size)
{
	static unsigned char buf[1 << 16];
	uint64_t off = 0;
	int fd = open(file, O_RDONLY);

	if (fd < 0)
		die("open", file);
	check_size(fd, file, size);
	for (;;) {
		ssize_t n = read(fd, buf, sizeof(buf));

		if (n < 0) {
			if (errno == EINTR)
				continue;
			die("read", file);
		}
		if (n == 0)
			break;
		for (ssize_t i = 0; i < n; i++)
			if (buf[i] != pattern(off + i))
				fail(file, "read(2) returned a wrong byte", off + i);
		off += n;
	}
	if (off != size)
		fail(file, "read(2) ended early", off);
	if (close(fd) != 0)
		die("close", file);
}

static void verify_map(const char *file, uint64_t size)
{
	int fd = open(file, O_RDONLY);
	unsigned char *p;

	if (fd < 0)
		die("open", file);
	check_size(fd, file, size);
	p = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		die("mmap", file);
	for (uint64_t i = 0; i < size; i++)
		if (p[i] != pattern(i))
			fail(file, "mapping holds a wrong byte", i);
	if (munmap(p, size) != 0)
		die("munmap", file);
	if (close(fd) != 0)
		die("close", file);
}

static void write_map(const char *file, uint64_t size)
{
	int fd = open(file, O_RDWR | O_CREAT | O_TRUNC, 0644);
	unsigned char *p;

	if (fd < 0)
		die("open", file);
	if (ftruncate(fd, (off_t)size) != 0)
		die("ftruncate", file);
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		die("mmap", file);
	fill(p, 0, size);
	if (msync(p, size, MS_SYNC) != 0)
		die("msync", file);
	if (munmap(p, size) != 0)
		die("munmap", file);
	if (close(fd) != 0)
		die("close", file);
}

static void write_fsync(const char *file, uint64_t size)
{
	static unsigned char buf[1 << 16];
	uint64_t off = 0;
	int fd = open(file, O_WRONLY | O_CREAT | O_TRUNC, 0644);

	if (fd < 0)
		die("open", file);
	while (off < size) {
		size_t n = sizeof(buf);
		ssize_t w;

		if (size - off < n)
			n = (size_t)(size - off);
		fill(buf, off, n);
		w = write(fd, buf, n);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			die("write", file);
		}
		off += (uint64_t)w;
	}
	if (fsync(fd) != 0)
		die("fsync", file);
	if (fdatasync(fd) != 0)
		die("fdatasync", file);
	if (close(fd) != 0)
		die("close", file);
}

static void usage(void)
{
	fprintf(stderr, "usage: %s mmap|fsync|verify|mapread FILE SIZE\n"
			"       %s xattr FILE\n"
			"       %s killpriv FILE [write,ftruncate,otrunc]\n", prog, prog, prog);
	exit(2);
}

static void check_xattrs(const char *file)
{
	static const char want[] = "hello-xattr";
	char buf[256];
	ssize_t n;
	int found = 0;

	if (setxattr(file, "user.kvfs", want, sizeof(want) - 1, 0) != 0)
		die("setxattr user.kvfs", file);
	n = getxattr(file, "user.kvfs", buf, sizeof(buf));
	if (n < 0)
		die("getxattr user.kvfs", file);
	if ((size_t)n != sizeof(want) - 1 || memcmp(buf, want, n) != 0) {
		fprintf(stderr, "%s: %s: user.kvfs reads back %.*s\n", prog, file, (int)n, buf);
		exit(1);
	}
	if (setxattr(file, "user.gone", "x", 1, XATTR_CREATE) != 0)
		die("setxattr user.gone", file);
	n = listxattr(file, buf, sizeof(buf));
	if (n < 0)
		die("listxattr", file);
	for (char *p = buf; p < buf + n; p += strlen(p) + 1)
		found += strcmp(p, "user.kvfs") == 0 || strcmp(p, "user.gone") == 0;
	if (found != 2) {
		fprintf(stderr, "%s: %s: listxattr found %d of our 2 names\n", prog, file, found);
		exit(1);
	}
	if (removexattr(file, "user.gone") != 0)
		die("removexattr user.gone", file);
	if (getxattr(file, "user.gone", buf, sizeof(buf)) >= 0 || errno != ENODATA) {
		fprintf(stderr, "%s: %s: user.gone still readable after removexattr\n", prog, file);
		exit(1);
	}
}

/* The unprivileged user the killpriv check writes as. */
#define KILLPRIV_ID 1000

/* VFS_CAP_REVISION_2 security.capability granting CAP_NET_RAW, little-endian:
 * magic_etc (revision | effective), then permitted and inheritable, low and
 * high words. */
static const unsigned char file_caps[20] = {
	0x01, 0x00, 0x00, 0x02, 0x00, 0x20, 0x00, 0x00,
};

enum kill_how { KILL_WRITE, KILL_FTRUNCATE, KILL_OTRUNC };

static void killpriv_prepare(const char *file)
{
	struct stat st;
	int fd;

	if (unlink(file) != 0 && errno != ENOENT)
		die("unlink", file);
	fd = open(file, O_WRONLY | O_CREAT | O_EXCL, 0644);
	if (fd < 0)
		die("open", file);
	if (write(fd, "privileged\n", 11) != 11)
		die("write", file);
	if (close(fd) != 0)
		die("close", file);
	if (setxattr(file, "security.capability", file_caps, sizeof(file_caps), 0) != 0)
		die("setxattr security.capability", file);
	if (chmod(file, 06777) != 0)
		die("chmod", file);
	if (stat(file, &st) != 0)
		die("stat", file);
	if ((st.st_mode & 07777) != 06777) {
		fprintf(stderr, "%s: %s: mode %04o after chmod 6777\n", prog, file,
			(unsigned)(st.st_mode & 07777));
		exit(1);
	}
	if (getxattr(file, "security.capability", NULL, 0) < 0)
		die("getxattr security.capability after setting it on", file);
}

/* killpriv_child drops to KILLPRIV_ID, which lacks CAP_FSETID, and modifies
 * file; it exits 0 on success. */
static void killpriv_child(const char *file, enum kill_how how)
{
	int fd;

	if (setgroups(0, NULL) != 0 ||
	    setresgid(KILLPRIV_ID, KILLPRIV_ID, KILLPRIV_ID) != 0 ||
	    setresuid(KILLPRIV_ID, KILLPRIV_ID, KILLPRIV_ID) != 0)
		die("drop to uid 1000 for", file);
	fd = open(file, O_WRONLY | (how == KILL_OTRUNC ? O_TRUNC : 0));
	if (fd < 0)
		die("open as uid 1000", file);
	if (how == KILL_WRITE && pwrite(fd, "unprivileged\n", 13, 0) != 13)
		die("write as uid 1000", file);
	if (how == KILL_FTRUNCATE && ftruncate(fd, 3) != 0)
		die("ftruncate as uid 1000", file);
	if (close(fd) != 0)
		die("close as uid 1000", file);
	_exit(0);
}

static void check_killpriv(const char *base, const char *hows)
{
	static const char *const names[] = {"write", "ftruncate", "otrunc"};
	char file[4096];
	struct statx stx;
	int status, done = 0;
	pid_t pid;

	if (geteuid() != 0) {
		fprintf(stderr, "%s: killpriv must run as root\n", prog);
		exit(1);
	}
	for (int how = KILL_WRITE; how <= KILL_OTRUNC; how++) {
		size_t n = strlen(names[how]);
		const char *p = hows;

		/* Is names[how] an element of the comma-separated hows? */
		while (p != NULL && !(strncmp(p, names[how], n) == 0 && (p[n] == ',' || p[n] == '\0'))) {
			p = strchr(p, ',');
			if (p != NULL)
				p++;
		}
		if (p == NULL)
			continue;
		done++;
		snprintf(file, sizeof(file), "%s.%s", base, names[how]);
		killpriv_prepare(file);
		pid = fork();
		if (pid < 0)
			die("fork for", file);
		if (pid == 0)
			killpriv_child(file, how);
		if (waitpid(pid, &status, 0) != pid)
			die("waitpid for", file);
		if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			fprintf(stderr, "%s: %s: the unprivileged %s failed\n", prog, file, names[how]);
			exit(1);
		}
		/* Ask the server, not the guest's attribute cache. */
		if (statx(AT_FDCWD, file, AT_STATX_FORCE_SYNC, STATX_MODE, &stx) != 0)
			die("statx", file);
		if ((stx.stx_mode & 07777) != 0777) {
			fprintf(stderr, "%s: %s: mode %04o after an unprivileged %s, want 0777\n",
				prog, file, (unsigned)(stx.stx_mode & 07777), names[how]);
			exit(1);
		}
		if (getxattr(file, "security.capability", NULL, 0) >= 0 || errno != ENODATA) {
			fprintf(stderr, "%s: %s: security.capability survived an unprivileged %s\n",
				prog, file, names[how]);
			exit(1);
		}
	}
	if (done == 0)
		usage();
}

int main(int argc, char **argv)
{
	const char *mode, *file;
	char *end;
	unsigned long long size;

	if (argc == 3 && strcmp(argv[1], "xattr") == 0) {
		check_xattrs(argv[2]);
		return 0;
	}
	if ((argc == 3 || argc == 4) && strcmp(argv[1], "killpriv") == 0) {
		check_killpriv(argv[2], argc == 4 ? argv[3] : "write,ftruncate,otrunc");
		return 0;
	}
	if (argc != 4)
		usage();
	mode = argv[1];
	file = argv[2];
	errno = 0;
	size = strtoull(argv[3], &end, 10);
	if (errno != 0 || *end != '\0' || end == argv[3] || size == 0 ||
	    size > (1ULL << 32))
		usage();

	if (strcmp(mode, "mmap") == 0) {
		write_map(file, size);
		verify_read(file, size);
	} else if (strcmp(mode, "fsync") == 0) {
		write_fsync(file, size);
		verify_read(file, size);
	} else if (strcmp(mode, "verify") == 0) {
		verify_read(file, size);
	} else if (strcmp(mode, "mapread") == 0) {
		verify_map(file, size);
	} else {
		usage();
	}
	return 0;
}
