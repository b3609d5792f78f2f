/* A tiny busy service for scale tests and benchmarks: join a cgroup, then
 * loop "compute ~WORK_US, sleep ~SLEEP_US" until SECONDS have passed.
 *
 * usage: busy_worker WORK_US SLEEP_US SECONDS [CGROUP_DIR]
 *
 * Each sleep ends in a wakeup, so beside other workers the task collects real
 * run-queue waits. Work and sleep vary by +-50% (a per-process xorshift), so
 * the waits spread over many histogram slots as a real service's do. It moves
 * itself into CGROUP_DIR before doing any work, dies with its parent
 * (PR_SET_PDEATHSIG) and exits by itself after SECONDS: nothing outlives the
 * run that started it.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t rng;

static uint64_t jitter(uint64_t ns)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return ns / 2 + rng % (ns + 1); /* uniform in [ns/2, 3ns/2] */
}

static int join_cgroup(const char *dir)
{
    char path[4096], pid[32];
    int fd, len, ok;

    if (snprintf(path, sizeof(path), "%s/cgroup.procs", dir) >= (int)sizeof(path))
        return -1;
    fd = open(path, O_WRONLY);
    if (fd < 0)
        return -1;
    len = snprintf(pid, sizeof(pid), "%d\n", getpid());
    ok = write(fd, pid, len) == len;
    close(fd);
    return ok ? 0 : -1;
}

int main(int argc, char **argv)
{
    uint64_t work_ns, sleep_ns, end, stop;
    pid_t parent = getppid();

    if (argc < 4 || argc > 5) {
        fprintf(stderr, "usage: %s WORK_US SLEEP_US SECONDS [CGROUP_DIR]\n", argv[0]);
        return 2;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) /* the parent died before the prctl */
        return 1;
    if (argc == 5 && join_cgroup(argv[4]) != 0) {
        perror("busy_worker: joining the cgroup");
        return 126;
    }
    work_ns = (uint64_t)(strtod(argv[1], NULL) * 1e3);
    sleep_ns = (uint64_t)(strtod(argv[2], NULL) * 1e3);
    end = now_ns(CLOCK_MONOTONIC) + (uint64_t)(strtod(argv[3], NULL) * 1e9);
    rng = now_ns(CLOCK_MONOTONIC) ^ ((uint64_t)getpid() << 32) ^ 0x9e3779b97f4a7c15ull;

    while (now_ns(CLOCK_MONOTONIC) < end) {
        /* CPU time, not wall time: the work per round does not shrink
         * however long the task waits on the run queue meanwhile. */
        stop = now_ns(CLOCK_THREAD_CPUTIME_ID) + jitter(work_ns);
        while (now_ns(CLOCK_THREAD_CPUTIME_ID) < stop)
            ;
        if (sleep_ns) {
            uint64_t s = jitter(sleep_ns);
            struct timespec ts = {.tv_sec = s / 1000000000ull, .tv_nsec = s % 1000000000ull};
            nanosleep(&ts, NULL);
        }
    }
    return 0;
}
