/* A token ring: N processes, each blocked reading its own pipe, pass one byte
 * around L times. Pinned to one CPU, every hop is a wakeup and a context
 * switch to another of the N tasks, so the run is dense in switches (unlike
 * hackbench, whose copies dominate its time) and touches as many distinct
 * tasks as hackbench's groups: the tools' per-task state is spread over N
 * entries, not the pipe benchmark's two.
 *
 * Usage: ring TASKS LAPS; prints "<usecs> usecs/hop" (TASKS * LAPS hops).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what)
{
    perror(what);
    exit(1);
}

int main(int argc, char **argv)
{
    if (argc != 3 || atoi(argv[1]) < 2 || atol(argv[2]) < 1) {
        fprintf(stderr, "usage: ring TASKS LAPS (TASKS >= 2, LAPS >= 1)\n");
        return 2;
    }
    int n = atoi(argv[1]);
    long laps = atol(argv[2]);
    int (*p)[2] = calloc(n, sizeof *p);
    if (!p)
        die("calloc");
    for (int i = 0; i < n; i++)
        if (pipe(p[i]))
            die("pipe");
    for (int i = 1; i < n; i++) {
        pid_t pid = fork();
        if (pid < 0)
            die("fork");
        if (pid == 0) {
            /* Nothing outlives a killed benchmark. */
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            char c;
            for (long l = 0; l < laps; l++) {
                if (read(p[i][0], &c, 1) != 1 || write(p[(i + 1) % n][1], &c, 1) != 1)
                    _exit(1);
            }
            _exit(0);
        }
    }
    struct timespec a, b;
    char c = 'x';
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long l = 0; l < laps; l++) {
        if (write(p[1][1], &c, 1) != 1 || read(p[0][0], &c, 1) != 1)
            die("ring");
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    int status, failed = 0;
    while (wait(&status) > 0)
        failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    if (failed) {
        fprintf(stderr, "ring: a task of the ring failed\n");
        return 1;
    }
    double s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    printf("%.3f usecs/hop\n", s * 1e6 / ((double)laps * n));
    return 0;
}
