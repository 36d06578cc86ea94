/*
 * kvfs-gbench: timing helpers for the guest benchmark (bench/guestbench), built
 * statically into the bench image only. busybox's date has no sub-second clock
 * and a shell loop would time the shell, not the file system.
 *
 *   kvfs-gbench now            print CLOCK_MONOTONIC in seconds
 *   kvfs-gbench drop           sync and drop the page, dentry and inode caches
 *   kvfs-gbench meta DIR N     in DIR (which must not exist): create N empty
 *                              files, then (caches dropped) stat each of them,
 *                              list the directory, unlink them all; prints
 *                              "create=S stat=S list=S delete=S", seconds
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what, const char *arg)
{
	fprintf(stderr, "kvfs-gbench: %s %s: %s\n", what, arg, strerror(errno));
	exit(1);
}

static void drop_caches(void)
{
	int fd;

	sync();
	fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
	if (fd < 0 || write(fd, "3\n", 2) != 2)
		die("drop caches", "/proc/sys/vm/drop_caches");
	close(fd);
}

static int meta(const char *dir, long n)
{
	char path[4096];
	struct stat st;
	struct dirent *de;
	DIR *d;
	double t0, t1, t2, t3, t4, create;
	long i, seen = 0;

	if (mkdir(dir, 0755) < 0)
		die("mkdir", dir);
	t0 = now();
	for (i = 0; i < n; i++) {
		int fd;

		snprintf(path, sizeof path, "%s/f%ld", dir, i);
		fd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0644);
		if (fd < 0)
			die("create", path);
		close(fd);
	}
	create = now() - t0;
	drop_caches(); /* not part of any phase: stat then finds nothing cached */
	t1 = now();
	for (i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%ld", dir, i);
		if (stat(path, &st) < 0)
			die("stat", path);
	}
	t2 = now();
	d = opendir(dir);
	if (!d)
		die("opendir", dir);
	while ((de = readdir(d)) != NULL)
		if (de->d_name[0] == 'f')
			seen++;
	closedir(d);
	t3 = now();
	if (seen != n) {
		fprintf(stderr, "kvfs-gbench: listed %ld files in %s, want %ld\n", seen, dir, n);
		return 1;
	}
	for (i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%ld", dir, i);
		if (unlink(path) < 0)
			die("unlink", path);
	}
	t4 = now();
	if (rmdir(dir) < 0)
		die("rmdir", dir);
	printf("create=%.6f stat=%.6f list=%.6f delete=%.6f\n", create, t2 - t1, t3 - t2, t4 - t3);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "now") == 0) {
		printf("%.6f\n", now());
		return 0;
	}
	if (argc == 2 && strcmp(argv[1], "drop") == 0) {
		drop_caches();
		return 0;
	}
	if (argc == 4 && strcmp(argv[1], "meta") == 0) {
		char *end;
		long n = strtol(argv[3], &end, 10);

		if (*end != '\0' || n < 1 || n > 1000000) {
			fprintf(stderr, "kvfs-gbench: bad file count %s\n", argv[3]);
			return 2;
		}
		return meta(argv[2], n);
	}
	fprintf(stderr, "usage: kvfs-gbench now | drop | meta DIR N\n");
	return 2;
}
