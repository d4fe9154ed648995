/* The pod sandbox's pause process, built static so its image is one file: it holds the pod's
 * namespaces open, reaps the zombies of processes that share its PID namespace, and exits on
 * SIGTERM or SIGINT (which is how the runtime stops a sandbox). */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signal_number) {
    (void)signal_number;
    _exit(0);
}

static void reap(int signal_number) {
    (void)signal_number;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction on_stop = {.sa_handler = stop};
    struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGTERM, &on_stop, NULL) || sigaction(SIGINT, &on_stop, NULL) ||
        sigaction(SIGCHLD, &on_child, NULL)) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
