/* slatrace: per-cgroup scheduler accounting on classic sched tracepoints.
 *
 * Only tracepoint arguments and stable helpers are read, never kernel structs:
 * BCC takes the argument layout from the live tracefs format files, so the
 * programs stay correct even when compiled against another kernel's headers.
 *
 * Compile-time options (-D, built and validated by agent/probe/features.py):
 *   PREEMPT_BIT   sched_switch prev_state bit of an involuntary switch
 *   STATE_D       prev_state bit of uninterruptible sleep
 *   STATE_DEAD    prev_state bits of an exiting task (X | Z)
 *   MAX_TASKS, MAX_HIST, MAX_PAIRS, MAX_CGROUPS   map sizes
 *   EVENT_PAGES     ring buffer size in pages (a power of two)
 *   MAX_EVENT_RATE  events per CPU per ~1.07 s (2^30 ns) window
 */
#include "sched.h"

/* Per-task state machine, keyed by tid. LRU so that exits we miss and PID
 * reuse can never fill it. */
BPF_TABLE("lru_hash", u32, struct task_info, tasks, MAX_TASKS);
/* Counters: per CPU, so the hot path needs no atomics. User space sums CPUs. */
BPF_TABLE("percpu_hash", struct hist_key, struct hist_val, hists, MAX_HIST);
BPF_TABLE("percpu_hash", struct pair_key, struct pair_val, pairs, MAX_PAIRS);
/* Waits after a wakeup, by the cgroup that held the CPU until the waiter got
 * it (victim_cgid, holder as preemptor_cgid; 0 = the CPU was idle). */
BPF_TABLE("percpu_hash", struct pair_key, struct pair_val, holders, MAX_PAIRS);
BPF_TABLE("percpu_hash", u64, struct cgroup_val, cgroups, MAX_CGROUPS);
BPF_TABLE("percpu_array", u32, u64, errors, NR_ERRORS);

/* Exact per-wait events, only for cgroups user space watches. watch_on[0] is
 * zero until something is watched, so hosts without request spans pay one
 * array lookup (inlined by the verifier) per wait and nothing more. */
BPF_TABLE("array", u32, u32, watch_on, 1);
BPF_TABLE("hash", u64, u8, watched, MAX_WATCHED);
BPF_TABLE("percpu_array", u32, struct event_rate, event_rates, 1);
BPF_RINGBUF_OUTPUT(events, EVENT_PAGES);

static __always_inline void count_error(u32 which)
{
    u64 *e = errors.lookup(&which);
    if (e)
        (*e)++;
}

static __always_inline u32 hist_slot(u64 v)
{
    if (v < (1ULL << HIST_MIN_SHIFT))
        return 0;
    u32 k = bpf_log2l(v) - 1; /* bpf_log2l returns floor(log2(v)) + 1 */
    if (k > HIST_MAX_SHIFT)
        return HIST_SLOTS - 1;
    u32 sub = (v >> (k - HIST_SUB_SHIFT)) & (HIST_SUB - 1);
    return 1 + (k - HIST_MIN_SHIFT) * HIST_SUB + sub;
}

static __always_inline void hist_add(u64 cgid, u32 kind, u64 v)
{
    struct hist_key key = {.cgid = cgid, .kind = kind, .slot = hist_slot(v)};
    struct hist_val *val = hists.lookup(&key);
    if (val) {
        val->count++;
        val->sum_ns += v;
        return;
    }
    struct hist_val init = {.count = 1, .sum_ns = v};
    if (hists.update(&key, &init))
        count_error(ERR_HIST);
}

/* pairs and holders share key and value types; BCC's map objects cannot be
 * passed as arguments, hence one small function per map. */
static __always_inline void pair_add(u64 victim, u64 preemptor, u64 wait)
{
    struct pair_key key = {.victim_cgid = victim, .preemptor_cgid = preemptor};
    struct pair_val *val = pairs.lookup(&key);
    if (val) {
        val->count++;
        val->wait_ns += wait;
        return;
    }
    struct pair_val init = {.count = 1, .wait_ns = wait};
    if (pairs.update(&key, &init))
        count_error(ERR_PAIR);
}

static __always_inline void holder_add(u64 victim, u64 holder, u64 wait)
{
    struct pair_key key = {.victim_cgid = victim, .preemptor_cgid = holder};
    struct pair_val *val = holders.lookup(&key);
    if (val) {
        val->count++;
        val->wait_ns += wait;
        return;
    }
    struct pair_val init = {.count = 1, .wait_ns = wait};
    if (holders.update(&key, &init))
        count_error(ERR_PAIR);
}

/* field: offset of a __u64 in struct cgroup_val, in units of __u64 */
static __always_inline void cgroup_count(u64 cgid, u32 field)
{
    struct cgroup_val *val = cgroups.lookup(&cgid);
    if (val) {
        ((u64 *)val)[field & 3]++;
        return;
    }
    struct cgroup_val init = {};
    ((u64 *)&init)[field & 3] = 1;
    if (cgroups.update(&cgid, &init))
        count_error(ERR_CGROUP);
}

static __always_inline bool is_watched(u64 cgid)
{
    u32 zero = 0;
    u32 *on = watch_on.lookup(&zero);
    if (!on || !*on)
        return false;
    return watched.lookup(&cgid) != NULL;
}

static __always_inline bool rate_ok(u64 now)
{
    u32 zero = 0;
    struct event_rate *r = event_rates.lookup(&zero);
    if (!r)
        return false;
    u64 window = now >> 30;
    if (r->window != window) {
        r->window = window;
        r->count = 0;
    }
    if (r->count >= MAX_EVENT_RATE) {
        count_error(ERR_EVENT_RATE);
        return false;
    }
    r->count++;
    return true;
}

static __always_inline void emit(u64 cgid, u32 kind, u64 start, u64 end, u64 other, u32 tid)
{
    if (!is_watched(cgid) || !rate_ok(end))
        return;
    struct sched_event *e = events.ringbuf_reserve(sizeof(struct sched_event));
    if (!e) {
        count_error(ERR_EVENTS);
        return;
    }
    e->cgid = cgid;
    e->other_cgid = other;
    e->start_ns = start;
    e->end_ns = end;
    e->tid = tid;
    e->kind = kind;
    events.ringbuf_submit(e, 0);
}

#define CG_MIGRATIONS 0
#define CG_UNTRACED_SWITCH_IN 1
#define CG_UNTRACED_SWITCH_OUT 2
#define CG_UNTRACED_WAKEUP 3

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev_pid = args->prev_pid;
    u32 next_pid = args->next_pid;
    long prev_state = args->prev_state;
    u64 next_cgid = 0;

    /* The current task is prev: the one that held the CPU until now. */
    struct task_info *p = prev_pid ? tasks.lookup(&prev_pid) : NULL;
    u64 cgid = 0;
    if (prev_pid)
        cgid = (p && (p->flags & TF_KTHREAD)) ? KERNEL_CGID : bpf_get_current_cgroup_id();

    /* Switch-in: the run-queue wait ends. pid 0 is the per-CPU idle task. */
    if (next_pid) {
        struct task_info *n = tasks.lookup(&next_pid);
        if (n) {
            next_cgid = n->cgid;
            u32 st = n->state;
            if (st == TS_RUNNABLE || st == TS_PREEMPTED) {
                u64 wait = now - n->ts;
                hist_add(next_cgid, HIST_RUNQ, wait);
                /* Blame: a preempted wait on its preemptor, a wait after a
                 * wakeup on whoever held the CPU until it ended. */
                if (st == TS_PREEMPTED)
                    pair_add(next_cgid, n->preemptor_cgid, wait);
                else
                    holder_add(next_cgid, cgid, wait);
                emit(next_cgid, st == TS_PREEMPTED ? EV_PREEMPTED : EV_RUNQ, n->ts, now,
                     st == TS_PREEMPTED ? n->preemptor_cgid : cgid, next_pid);
            } else if (st == TS_RUNNING) {
                cgroup_count(next_cgid, CG_UNTRACED_SWITCH_OUT);
            } else if (st == TS_SLEEPING || st == TS_BLOCKED) {
                cgroup_count(next_cgid, CG_UNTRACED_WAKEUP);
            }
            n->state = TS_RUNNING;
            n->ts = now;
        }
    }

    if (!prev_pid)
        return 0;

    /* Switch-out: the current task is prev, so its cgroup is at hand. */
    /* Still runnable at switch-out = an involuntary switch, as the kernel's
     * nivcsw counts it. PREEMPT_BIT ("R+") marks only preemption inside the
     * kernel; a task preempted on its way back to user space (the common case
     * for CPU-bound user code) or yielding is switched out as plain "R". */
    u32 st;
    if ((prev_state & (PREEMPT_BIT - 1)) == 0)
        st = TS_PREEMPTED;
    else if (prev_state & STATE_DEAD)
        return 0;         /* exiting: sched_process_exit dropped the entry */
    else if (prev_state & STATE_D)
        st = TS_BLOCKED;
    else
        st = TS_SLEEPING;

    if (p) {
        if (p->state == TS_RUNNABLE || p->state == TS_PREEMPTED)
            cgroup_count(cgid, CG_UNTRACED_SWITCH_IN);
        p->ts = now;
        p->cgid = cgid;
        p->preemptor_cgid = next_cgid;
        p->state = st;
        return 0;
    }
    struct task_info init = {.ts = now, .cgid = cgid, .preemptor_cgid = next_cgid, .state = st};
    if (tasks.update(&prev_pid, &init))
        count_error(ERR_TASK);
    return 0;
}

static __always_inline int on_wakeup(u32 pid)
{
    struct task_info *t = tasks.lookup(&pid);
    if (!t)
        return 0; /* never seen on a CPU: its cgroup is unknown */
    u32 st = t->state;
    /* A wakeup of a running or already queued task changes nothing: the
     * enqueue time of a queued task stays the first one. */
    if (st == TS_RUNNING || st == TS_RUNNABLE || st == TS_PREEMPTED)
        return 0;
    u64 now = bpf_ktime_get_ns();
    if (st == TS_BLOCKED) {
        hist_add(t->cgid, HIST_IOWAIT, now - t->ts);
        emit(t->cgid, EV_IOWAIT, t->ts, now, 0, pid);
    }
    t->state = TS_RUNNABLE;
    t->ts = now;
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    return on_wakeup(args->pid);
}

TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    return on_wakeup(args->pid);
}

TRACEPOINT_PROBE(sched, sched_migrate_task)
{
    u32 pid = args->pid;
    struct task_info *t = tasks.lookup(&pid);
    if (t) {
        cgroup_count(t->cgid, CG_MIGRATIONS);
        u64 now = bpf_ktime_get_ns();
        emit(t->cgid, EV_MIGRATE, now, now, 0, pid);
    }
    return 0;
}

/* The child starts in its parent's cgroup; the parent is current here.
 * Children of kthreadd are kernel threads. */
TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 child = args->child_pid;
    struct task_info init = {.state = TS_SLEEPING};
    if (args->parent_pid == KTHREADD_PID) {
        init.cgid = KERNEL_CGID;
        init.flags = TF_KTHREAD;
    } else {
        init.cgid = bpf_get_current_cgroup_id();
    }
    if (tasks.update(&child, &init))
        count_error(ERR_TASK);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u32 pid = args->pid;
    tasks.delete(&pid);
    return 0;
}
