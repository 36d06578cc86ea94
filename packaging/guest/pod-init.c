/*
 * kvfs-pod-init: the init of a kvfs pod's shared PID namespace, and the holder of its user
 * namespace if it has one (agent/podns.go): what the pause container is to a runc pod. It
 * reaps the processes orphaned in the namespace and otherwise sleeps. Every signal but
 * SIGCHLD keeps its default action: the kernel does not deliver such a signal to a
 * namespace's init from inside the namespace, so no container sharing it can end it.
 */
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>
#include <unistd.h>

static void reap(int sig)
{
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
}

int main(void)
{
	struct sigaction sa = {0};

	sa.sa_handler = reap;
	sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
	if (sigaction(SIGCHLD, &sa, NULL) != 0)
		return 1;
	reap(0);
	for (;;)
		pause();
}
