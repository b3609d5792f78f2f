/* Structures shared by bpf/sched.bpf.c and agent/probe/layout.py.
 * Every field is naturally aligned and padded explicitly so the layout is the
 * same for clang (BPF) and ctypes; tests/kernel/test_probe.py checks it.
 *
 * Counting maps (hists, blame, cgroups) are drained by user space every
 * interval. Their keys carry a generation: programs count into the current
 * one (ctl.gen); the agent flips it, waits for programs that read the old
 * value to finish (the fence map in sched.bpf.c: a grace period, not a
 * guess, as a virtual CPU can stall for milliseconds inside a program),
 * then reads and deletes the old generation's entries.
 * Entries of dead cgroups therefore vanish within one interval, and no count
 * is lost between reading and deleting (docs/maps.md). */
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
#define HIST_RUNQ_LIMIT 2  /* the run-queue waits of HIST_RUNQ that a CPU limit held in part: counted twice, not tallied */
#define NR_HIST_KINDS 3

/* Kernel threads share the root cgroup with host processes; they are counted
 * under this pseudo cgroup id instead (no real cgroup has it: ids are inode
 * numbers). A task is a kernel thread when kthreadd forked it, or when user
 * space marked it at start-up (TF_KTHREAD in task_info.flags). */
#define KERNEL_CGID 0xfffffffffffffffeULL
#define KTHREADD_PID 2
#define TF_KTHREAD 1
#define TF_THR_START 2  /* the task's CPU limit held it when its current wait began */
#define TF_PEND_YIELD 8 /* its pending merged waits (task_info.pend_*) are yields */

/* task_info.state */
#define TS_UNKNOWN 0
#define TS_RUNNING 1
#define TS_RUNNABLE 2   /* woken or new */
#define TS_PREEMPTED 3  /* switched out while runnable; preemptor_cgid is set */
#define TS_SLEEPING 4
#define TS_BLOCKED 5    /* uninterruptible sleep (D state) */
#define TS_EXITING 6    /* switch-out of an exiting task: never stored */

/* Index in the errors array: updates that failed outright, with no cgroup
 * to charge them to (the per-cgroup loss counters live in cgroup_val). */
#define ERR_TASK 0        /* task map update failed */
#define ERR_HIST 1        /* histogram map update failed (full) */
#define ERR_PAIR 2        /* blame map update failed (full) */
#define ERR_CGROUP 3      /* per-cgroup counter map update failed (full): the loss is uncounted per cgroup */
#define ERR_EVENTS 4      /* event ring buffer full */
#define ERR_EVENT_RATE 5  /* event dropped by the per-CPU rate limit */
#define NR_ERRORS 6

/* Waits as the programs saw them, per generation and CPU (array "tally",
 * entry `gen * NR_TALLY + kind`), counted where each wait enters the
 * histogram path. The agent compares them with what reached it through the
 * caches and maps (hists, plus the losses counted per cgroup): any gap is a
 * loss between the programs and the agent, which no figure would show. */
#define TALLY_RUNQ 0
#define TALLY_IOWAIT 1
#define NR_TALLY 2

/* sched_event.kind */
#define EV_RUNQ 0         /* run-queue wait after a wakeup; other_cgid = last holder of the CPU */
#define EV_PREEMPTED 1    /* run-queue wait after a preemption; other_cgid = preemptor */
#define EV_IOWAIT 2       /* uninterruptible sleep until wakeup */
#define EV_MIGRATE 3      /* migration (start == end) */
#define EV_LIMIT 4        /* the part of a run-queue wait its CPU limit held (other_cgid: the waiter's own);
                           * the rest of the wait is an event of its own: when the wait began throttled,
                           * an EV_RUNQ after it (other_cgid: whoever held the CPU when it ended), else
                           * the wait's own kind, before it */
#define EV_YIELD 5        /* run-queue wait after the task yielded (sched_yield: a loop polling for work
                           * another thread makes); other_cgid = who ran instead. Told where the programs
                           * can read the task's system call (SyscallSite, agent/probe/btf.py), else
                           * such waits are EV_PREEMPTED */
#define EV_WAKE 6         /* a watched thread woken by a thread of another process of a watched service
                           * (start == end: the wake-up; other_cgid carries the waker's process id, not a
                           * cgroup): which of a service's processes handed work to which. Raw and
                           * BTF-typed tracepoints only (TASK_TGID_OFF) */

/* The causes of a wait, the one vocabulary every figure of delay carries
 * (docs/api.md). The programs decide CAUSE_CPU_LIMIT, the part of a wait
 * during which the CFS bandwidth limit of the waiter's cgroup or an ancestor
 * held its run queue (EV_LIMIT, cgroup_val.limited_runq); user space decides the others
 * from the culprit's cgroup (agent/attribution/causes.py). */
#define CAUSE_NEIGHBOUR 0    /* another service held the CPU */
#define CAUSE_CPU_LIMIT 1    /* the service's own CPU limit (cpu.max, cpu.cfs_quota_us) */
#define CAUSE_OWN_THREADS 2  /* the service's own threads held the CPU */
#define CAUSE_KERNEL 3       /* kernel threads held the CPU */
#define CAUSE_IDLE 4         /* woke to an idle CPU: wake-up latency */
#define CAUSE_UNKNOWN 5      /* no culprit recorded */
#define NR_CAUSES 6

/* Key of the tasks map: the task_struct's address on raw tracepoints (the
 * kernel hands programs the pointer, so no read is needed to find a task),
 * its tid on classic ones. */
typedef __u64 task_key_t;

struct task_info {
    __u64 ts;              /* ns, CLOCK_MONOTONIC, when the current state began */
    __u64 cgid;            /* cgroup v2 id, remembered while the task was current */
    __u64 preemptor_cgid;  /* who took the CPU, when state == TS_PREEMPTED */
    __u32 state;
    __u32 flags;           /* TF_* */
    /* Where the current wait began on the CPU limit's clock (limit_clock() in
     * sched.bpf.c): the task's CFS run queue then (0: not known) and how
     * long the limit had held that run queue, ever. */
    __u64 thr_cfs_rq;
    __u64 thr_ns;
    /* The streamed record of the task's back-to-back short preempted waits
     * not yet sent (pend_n of them, pend_wait ns in all, from pend_start to
     * pend_end, all behind pend_other): stream_wait() in sched.bpf.c. */
    __u64 pend_start;
    __u64 pend_end;
    __u64 pend_other;
    __u32 pend_wait;
    __u32 pend_n;
};

/* Control words written by user space (array "ctl", one element). */
struct ctl {
    __u32 gen;             /* generation programs count into: 0 or 1 */
    __u32 watch_on;        /* non-zero once any cgroup is watched */
};

struct hist_key {
    __u64 cgid;
    __u32 slot;
    __u16 kind;            /* HIST_RUNQ or HIST_IOWAIT */
    __u16 gen;
};

struct hist_val {
    __u64 count;
    __u64 sum_ns;          /* exact sum of the values that fell into this slot */
};

/* Per-CPU write-combining in front of the hists map, as blame_cache is in
 * front of blame (below): a switch-in adds its wait to a direct-mapped
 * per-CPU entry without an atomic or a hash lookup, and reaches the shared
 * map only when another key takes the entry. A cgroup's slots sit at
 * consecutive entries from a hash of (cgroup, kind), and the default
 * HIST_CACHE exceeds HIST_SLOTS, so one busy cgroup never evicts its own; entry
 * `gen * HIST_CACHE + i` belongs to generation gen. */
#ifndef HIST_CACHE
#define HIST_CACHE 512     /* -D from MapSizes.hist_cache; a power of two */
#endif

struct hist_slot {
    struct hist_key key;   /* key.gen is the half's generation */
    struct hist_val val;   /* count == 0: empty */
};

/* blame_key.kind */
#define BLAME_PREEMPTED 0  /* culprit preempted the victim */
#define BLAME_HOLDER 1     /* victim woke up and waited while culprit held the CPU (0 = idle) */

struct blame_key {
    __u64 victim_cgid;
    __u64 culprit_cgid;
    __u16 kind;            /* BLAME_* */
    __u16 gen;
    __u32 pad;
};

struct blame_val {
    __u64 count;           /* waits of victim blamed on culprit */
    __u64 wait_ns;         /* their run-queue wait */
};

/* Per-CPU write-combining in front of the blame map: most switch-ins on a
 * CPU blame the same few (victim, culprit) pairs, so they add into a small
 * direct-mapped per-CPU table without atomics and reach the shared map only
 * when another pair takes their entry. BLAME_CACHE entries per generation
 * (a power of two); entry `gen * BLAME_CACHE + i` belongs to generation gen,
 * and the agent drains and zeroes the old generation's half with the maps. */
#ifndef BLAME_CACHE
#define BLAME_CACHE 64     /* -D from MapSizes.blame_cache */
#endif

struct blame_slot {
    struct blame_key key;  /* key.gen is the half's generation */
    struct blame_val val;  /* count == 0: empty */
};

struct cgroup_key {
    __u64 cgid;
    __u32 gen;
    __u32 pad;
};

/* Gaps in the event stream. Some context switches are never traced (seen on
 * VMs), so the state machine can find a task in a state the next event cannot
 * follow from; it counts the gap instead of inventing a wait. */
struct cgroup_val {
    __u64 migrations;
    __u64 untraced_switch_in;   /* switch-out of a task still marked runnable */
    __u64 untraced_switch_out;  /* switch-in of a task already marked running */
    __u64 untraced_wakeup;      /* switch-in of a task still marked asleep */
    __u64 recovered_wakeup;     /* of those, waits recovered from the kernel's enqueue time */
    /* What the full hists or blame map could not take, so a reader knows the
     * share of waits its figures cover instead of reading low quantiles.
     * Pairs of a count and its ns, last: cgroup_add_n() adds to both halves
     * of every field from lost_runq on, so a plain counter goes above. */
    __u64 lost_runq;            /* run-queue waits missing from hists */
    __u64 lost_runq_ns;
    __u64 lost_iowait;          /* D-state sleeps missing from hists */
    __u64 lost_iowait_ns;
    __u64 lost_blame;           /* run-queue waits missing from blame */
    __u64 lost_blame_ns;
    /* Run-queue waits the cgroup's CPU limit (or an ancestor's) held in part,
     * and the ns it held them (limit_part() in sched.bpf.c): that part is in
     * no blame pair; the rest of each such wait is. */
    __u64 limited_runq;
    __u64 limited_runq_ns;
};

/* A cgroup_val field as the index programs add to: the struct is the one list
 * of counters, agent/probe/layout.py's CGROUP_FIELDS its mirror. */
#define CG_INDEX(field) (__builtin_offsetof(struct cgroup_val, field) / sizeof(__u64))
#define CG_COUNT (sizeof(struct cgroup_val) / sizeof(__u64))

/* One wait of a task in a watched cgroup (a service that sends request
 * spans), streamed through a ring buffer so a request's window can be cut
 * exactly rather than from per-interval totals. A record may hold several
 * back-to-back short preempted waits of one thread behind the same culprit
 * (a spinning loop's): then `waits` of them, `wait_ns` in all, between
 * start_ns and end_ns; for one wait, wait_ns == end_ns - start_ns. */
struct sched_event {
    __u64 cgid;
    __u64 other_cgid;
    __u64 start_ns;
    __u64 end_ns;
    __u64 wait_ns;
    __u32 tid;
    __u16 kind;
    __u16 waits;
};

/* Per-CPU rate limit of the event stream (bpf/sched.bpf.c rate_ok()). */
struct event_rate {
    __u64 window;
    __u64 count;
};

#endif
