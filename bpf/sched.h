/* Structures shared by bpf/sched.bpf.c and agent/probe/layout.py.
 * Every field is naturally aligned and padded explicitly so the layout is the
 * same for clang (BPF) and ctypes; tests/kernel/test_layout.py checks it. */
#ifndef SLATRACE_SCHED_H
#define SLATRACE_SCHED_H

/* Log-linear histogram: values below 2^HIST_MIN_SHIFT ns go to slot 0; each
 * power of two from 2^HIST_MIN_SHIFT to 2^HIST_MAX_SHIFT ns is split into
 * HIST_SUB linear sub-buckets; anything at or above 2^(HIST_MAX_SHIFT+1) ns goes
 * to the last slot. 256 ns .. 34.4 s with 16 sub-buckets = 434 slots. */
#define HIST_MIN_SHIFT 8
#define HIST_MAX_SHIFT 34
#define HIST_SUB_SHIFT 4
#define HIST_SUB (1 << HIST_SUB_SHIFT)
#define HIST_SLOTS (2 + (HIST_MAX_SHIFT - HIST_MIN_SHIFT + 1) * HIST_SUB)

/* hist_key.kind */
#define HIST_RUNQ 0
#define HIST_IOWAIT 1

/* Kernel threads share the root cgroup with host processes; they are counted
 * under this pseudo cgroup id instead (no real cgroup has it: ids are inode
 * numbers). A task is a kernel thread when kthreadd forked it, or when user
 * space marked it at start-up (TF_KTHREAD in task_info.flags). */
#define KERNEL_CGID 0xfffffffffffffffeULL
#define KTHREADD_PID 2
#define TF_KTHREAD 1

/* task_info.state */
#define TS_UNKNOWN 0
#define TS_RUNNING 1
#define TS_RUNNABLE 2   /* woken or new */
#define TS_PREEMPTED 3  /* switched out while runnable; preemptor_cgid is set */
#define TS_SLEEPING 4
#define TS_BLOCKED 5    /* uninterruptible sleep (D state) */

/* stat_key.counter */
#define ERR_TASK 0        /* task map update failed */
#define ERR_HIST 1        /* histogram map update failed (full) */
#define ERR_PAIR 2        /* preemption or holder map update failed (full) */
#define ERR_CGROUP 3      /* per-cgroup counter map update failed (full) */
#define ERR_EVENTS 4      /* event ring buffer full */
#define ERR_EVENT_RATE 5  /* event dropped by the per-CPU rate limit */
#define NR_ERRORS 6

/* sched_event.kind */
#define EV_RUNQ 0         /* run-queue wait after a wakeup; other_cgid = last holder of the CPU */
#define EV_PREEMPTED 1    /* run-queue wait after a preemption; other_cgid = preemptor */
#define EV_IOWAIT 2       /* uninterruptible sleep until wakeup */
#define EV_MIGRATE 3      /* migration (start == end) */

struct task_info {
    __u64 ts;              /* ns, CLOCK_MONOTONIC, when the current state began */
    __u64 cgid;            /* cgroup v2 id, remembered while the task was current */
    __u64 preemptor_cgid;  /* who took the CPU, when state == TS_PREEMPTED */
    __u32 state;
    __u32 flags;           /* TF_* */
};

struct hist_key {
    __u64 cgid;
    __u32 kind;            /* HIST_RUNQ or HIST_IOWAIT */
    __u32 slot;
};

struct hist_val {
    __u64 count;
    __u64 sum_ns;          /* exact sum of the values that fell into this slot */
};

struct pair_key {
    __u64 victim_cgid;
    __u64 preemptor_cgid;
};

struct pair_val {
    __u64 count;           /* preemptions of victim by preemptor */
    __u64 wait_ns;         /* run-queue wait that followed them */
};

/* Gaps in the event stream. Some context switches are never traced (seen on
 * VMs), so the state machine can find a task in a state the next event cannot
 * follow from; it counts the gap instead of inventing a wait. */
struct cgroup_val {
    __u64 migrations;
    __u64 untraced_switch_in;   /* switch-out of a task still marked runnable */
    __u64 untraced_switch_out;  /* switch-in of a task already marked running */
    __u64 untraced_wakeup;      /* switch-in of a task still marked asleep */
};

/* One wait of a task in a watched cgroup (a service that sends request
 * spans), streamed through a ring buffer so a request's window can be cut
 * exactly rather than from per-interval totals. */
struct sched_event {
    __u64 cgid;
    __u64 other_cgid;
    __u64 start_ns;
    __u64 end_ns;
    __u32 tid;
    __u32 kind;
};

/* Per-CPU rate limit of the event stream (bpf/sched.bpf.c rate_ok()). */
struct event_rate {
    __u64 window;
    __u64 count;
};

#endif
