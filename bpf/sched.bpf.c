/* slatrace: per-cgroup scheduler accounting on the sched tracepoints.
 *
 * Three attachments share one state machine: BTF-typed tracepoints (TP_BTF,
 * with RAW_TP) where the kernel has task-local storage, raw tracepoints
 * (RAW_TP) where the kernel's BTF gives task_struct's layout, classic
 * tracepoints elsewhere. None reads a kernel struct through compiled-in
 * headers: the classic path takes its argument layout from the live tracefs
 * format files, the others read task fields at offsets from the running
 * kernel's BTF, so the programs stay correct when compiled against another
 * kernel's headers.
 *
 * Compile-time options (-D, built and validated by agent/probe/features.py):
 *   TP_BTF        (with RAW_TP) BTF-typed tracepoints and task-local storage;
 *                 with TASK_CGROUPS_OFF, CSS_SET_DFL_CGRP_OFF, CGROUP_KN_OFF
 *                 and KERNFS_NODE_ID_OFF (agent/probe/btf.py CgroupChain)
 *                 the cgroup id is read with plain loads: current_cgroup_id()
 *   RAW_TP        raw tracepoints, with TASK_PID_OFF and TASK_FLAGS_OFF, the
 *                 offsets of task_struct.pid and .flags, and TASK_STATE_OFF
 *                 (that of its state) where sched_switch passes no prev_state
 *   PREEMPT_BIT   sched_switch prev_state bit of an involuntary switch
 *   STATE_D       prev_state bit of uninterruptible sleep
 *   STATE_DEAD    prev_state bits of an exiting task (X | Z)
 *   MAX_TASKS, MAX_HIST, MAX_BLAME, MAX_CGROUPS, MAX_WATCHED   map sizes
 *   HIST_CACHE, BLAME_CACHE   per-CPU cache entries per generation (sched.h)
 *   EVENT_PAGES     ring buffer size in pages (a power of two)
 *   MAX_EVENT_RATE  events per CPU per ~1.07 s (2^30 ns) window
 *   TASK_LAST_QUEUED_OFF, TASK_SE_CFS_RQ_OFF, CFS_RQ_RQ_OFF, RQ_CLOCK_OFF
 *                 (raw only, where the BTF has them) the scheduler's own
 *                 enqueue time of a task and its run queue's clock
 *                 (agent/probe/btf.py QueueClock): missed_enqueue()
 *   THR_SE_CFS_RQ_OFF, THR_CFS_RQ_RQ_OFF, THR_SINCE_OFF, THR_TOTAL_OFF,
 *   THR_CLOCK_OFF, and THR_BY_SINCE or THR_COUNT_OFF, THR_CLOCK_LESS_OFF
 *                 (raw only, where the BTF has them) where the scheduler
 *                 keeps how long a CFS run queue was throttled and the
 *                 clock it counts on (agent/probe/btf.py LimitClock):
 *                 limit_clock()
 *   TASK_STACK_OFF, STACK_SYSCALL_NR_OFF, NR_SCHED_YIELD
 *                 (raw only, x86_64) where a task's system call number is
 *                 saved (agent/probe/btf.py SyscallSite): yielding()
 *   TASK_TGID_OFF (raw only) where a task's process id is: on_waking()
 *   SKIP_WAKEUPS  tests only: ignore about one wake-up in that many, as if
 *                 the kernel had skipped the program
 */
#include "sched.h"

/* Per-task state machine. On BTF-typed tracepoints it lives in the task
 * itself (task-local storage, 5.11+): found from the task pointer in a few
 * loads, freed with the task, never full. Elsewhere a map keyed by
 * task_key_t (the task's address on raw tracepoints, its tid on classic
 * ones), LRU so that exits we miss and address or PID reuse can never fill
 * it. */
#ifdef TP_BTF
BPF_TASK_STORAGE(tasks, struct task_info);
#else
BPF_TABLE("lru_hash", task_key_t, struct task_info, tasks, MAX_TASKS);
#endif
/* Counting maps, drained every interval (see sched.h). Shared between CPUs and
 * bumped with atomic adds: per-CPU values would multiply their memory by the
 * number of possible CPUs (64 x 16 bytes per histogram slot), which a node
 * with a thousand services cannot afford. */
BPF_TABLE("hash", struct hist_key, struct hist_val, hists, MAX_HIST);
BPF_TABLE("percpu_array", u32, struct hist_slot, hist_cache, 2 * HIST_CACHE);
_Static_assert(HIST_CACHE && !(HIST_CACHE & (HIST_CACHE - 1)), "HIST_CACHE must be a power of two");
_Static_assert(BLAME_CACHE && !(BLAME_CACHE & (BLAME_CACHE - 1)), "BLAME_CACHE must be a power of two");
BPF_TABLE("hash", struct blame_key, struct blame_val, blame, MAX_BLAME);
BPF_TABLE("percpu_array", u32, struct blame_slot, blame_cache, 2 * BLAME_CACHE);
BPF_TABLE("hash", struct cgroup_key, struct cgroup_val, cgroups, MAX_CGROUPS);
BPF_TABLE("percpu_array", u32, u64, errors, NR_ERRORS);
BPF_TABLE("percpu_array", u32, u64, tally, 2 * NR_TALLY);
BPF_TABLE("array", u32, struct ctl, ctl, 1);
/* The drain's fence (sched.h): no program touches these maps. User space
 * writes fence_inner's fd into fence after flipping ctl.gen, and the kernel
 * returns from an update of a map of maps only after every program then
 * running has finished (an RCU grace period), so none still counts into the
 * generation about to be read. */
BPF_ARRAY(fence_inner, u32, 1);
BPF_ARRAY_OF_MAPS(fence, "fence_inner", 1);

/* Exact per-wait events, only for cgroups user space watches. ctl.watch_on is
 * zero until something is watched, so hosts without request spans pay
 * nothing more than the ctl lookup every program does anyway. */
BPF_TABLE("hash", u64, u8, watched, MAX_WATCHED);
BPF_TABLE("percpu_array", u32, struct event_rate, event_rates, 1);
BPF_RINGBUF_OUTPUT(events, EVENT_PAGES);

static __always_inline void count_error(u32 which)
{
    u64 *e = errors.lookup(&which);
    if (e)
        (*e)++;
}

/* The task's state, NULL if it has none yet. */
static __always_inline struct task_info *task_get(task_key_t task)
{
#ifdef TP_BTF
    return tasks.task_storage_get((struct task_struct *)task, 0, 0);
#else
    return tasks.lookup(&task);
#endif
}

/* Gives the task this state; false when there is no room for it. */
static __always_inline bool task_put(task_key_t task, struct task_info *init)
{
#ifdef TP_BTF
    struct task_info *t = tasks.task_storage_get((struct task_struct *)task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!t)
        return false;
    *t = *init;
    return true;
#else
    return tasks.update(&task, init) == 0;
#endif
}

static __always_inline void task_drop(task_key_t task)
{
#ifdef TP_BTF
    tasks.task_storage_delete((struct task_struct *)task);
#else
    tasks.delete(&task);
#endif
}

/* The control word. An array lookup with a constant key: the verifier inlines
 * it into a pointer computation. Never NULL for index 0, checked anyway. */
static __always_inline struct ctl read_ctl(void)
{
    u32 zero = 0;
    struct ctl *c = ctl.lookup(&zero);
    struct ctl out = {};
    if (c)
        out = *c;
    return out;
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

/* Adds n and v to fields `field` and `field + 1` of the cgroup's counters
 * (field + 1 only when it is a loss pair). A full cgroups map leaves only the
 * global error count. */
static __always_inline void cgroup_add_n(u64 cgid, u32 gen, u32 field, u64 n, u64 v)
{
    struct cgroup_key key = {.cgid = cgid, .gen = gen};
    struct cgroup_val zero = {};
    struct cgroup_val *val = cgroups.lookup_or_try_init(&key, &zero);
    if (!val) {
        count_error(ERR_CGROUP);
        return;
    }
    u64 *f = (u64 *)val;
    if (field >= CG_INDEX(lost_runq) && field + 1 < CG_COUNT) {
        __sync_fetch_and_add(&f[field], n);
        __sync_fetch_and_add(&f[field + 1], v);
    } else if (field < CG_COUNT) {
        __sync_fetch_and_add(&f[field], n);
    }
}

static __always_inline void cgroup_add(u64 cgid, u32 gen, u32 field, u64 v)
{
    cgroup_add_n(cgid, gen, field, 1, v);
}

static __always_inline void hist_flush(struct hist_key *key, u64 count, u64 sum)
{
    struct hist_val zero = {};
    struct hist_val *val = hists.lookup_or_try_init(key, &zero);
    if (!val) {
        count_error(ERR_HIST);
        cgroup_add_n(key->cgid, key->gen, key->kind == HIST_RUNQ ? CG_INDEX(lost_runq) : CG_INDEX(lost_iowait),
                     count, sum);
        return;
    }
    __sync_fetch_and_add(&val->count, count);
    __sync_fetch_and_add(&val->sum_ns, sum);
}

/* Per-CPU write-combining in front of a shared counting map (hist_cache
 * before hists, blame_cache before blame; sched.h): adds one wait of v ns
 * under key to e, this CPU's cache entry for it (NULL: none). Programs that
 * touch a cache run with interrupts off on their CPU (the scheduler's wakeup
 * and switch paths), so plain adds are safe. The entry's own key adds into
 * it; another key flushes the entry to the shared map first and takes it
 * over; without an entry the wait goes to the map directly. same(a, b)
 * compares two keys but for gen (the cache's half is the generation),
 * flush(key, count, sum) adds to the shared map, sum names the value's field
 * of nanoseconds. A macro over the entry, not over the map: BCC rewrites map
 * calls only where they are written, never inside a macro. */
#define CACHE_ADD(e, k, same, flush, sum, v)                                  \
    do {                                                                      \
        if (!(e)) {                                                           \
            flush(&(k), 1, (v));                                              \
            break;                                                            \
        }                                                                     \
        if ((e)->val.count) {                                                 \
            if (same(&(e)->key, &(k))) {                                      \
                (e)->val.count++;                                             \
                (e)->val.sum += (v);                                          \
                break;                                                        \
            }                                                                 \
            flush(&(e)->key, (e)->val.count, (e)->val.sum);                   \
        }                                                                     \
        (e)->key = (k);                                                       \
        (e)->val.count = 1;                                                   \
        (e)->val.sum = (v);                                                   \
    } while (0)

static __always_inline bool hist_key_same(struct hist_key *a, struct hist_key *b)
{
    return a->cgid == b->cgid && a->slot == b->slot && a->kind == b->kind;
}

/* Adds one wait to its slot's entry of this CPU's hist_cache (see sched.h). */
static __always_inline void hist_add(u64 cgid, u32 gen, u32 kind, u64 v)
{
    /* The self-check's count (sched.h, tally); kind is HIST_RUNQ or HIST_IOWAIT,
     * which are TALLY_RUNQ and TALLY_IOWAIT. HIST_RUNQ_LIMIT counts waits
     * HIST_RUNQ holds already. */
    if (kind != HIST_RUNQ_LIMIT) {
        u32 t = (gen & 1) * NR_TALLY + (kind & 1);
        u64 *seen = tally.lookup(&t);
        if (seen)
            (*seen)++;
    }
    u32 slot = hist_slot(v);
    u32 base = (u32)(((cgid ^ kind) * 0x9E3779B97F4A7C15ULL) >> 32);
    u32 idx = (gen & 1) * HIST_CACHE + ((base + slot) & (HIST_CACHE - 1));
    struct hist_key key = {.cgid = cgid, .slot = slot, .kind = kind, .gen = gen};
    struct hist_slot *e = hist_cache.lookup(&idx);
    CACHE_ADD(e, key, hist_key_same, hist_flush, sum_ns, v);
}

static __always_inline void blame_flush(struct blame_key *key, u64 count, u64 wait)
{
    struct blame_val zero = {};
    struct blame_val *val = blame.lookup_or_try_init(key, &zero);
    if (!val) {
        count_error(ERR_PAIR);
        cgroup_add_n(key->victim_cgid, key->gen, CG_INDEX(lost_blame), count, wait);
        return;
    }
    __sync_fetch_and_add(&val->count, count);
    __sync_fetch_and_add(&val->wait_ns, wait);
}

static __always_inline bool blame_key_same(struct blame_key *a, struct blame_key *b)
{
    return a->victim_cgid == b->victim_cgid && a->culprit_cgid == b->culprit_cgid && a->kind == b->kind;
}

/* Adds one wait to the pair's entry of this CPU's blame_cache (see sched.h). */
static __always_inline void blame_add(u64 victim, u64 culprit, u32 kind, u32 gen, u64 wait)
{
    /* kind goes in before the last product, whose high bits mix every input
     * bit: the two kinds of one pair (a service waiting behind itself, both
     * after wake-ups and after preemptions) must not share an entry, or each
     * wait would flush the other's. BLAME_CACHE is a power of two. */
    u64 h = ((victim * 0x9E3779B97F4A7C15ULL) ^ (culprit * 0xC2B2AE3D27D4EB4FULL) ^ kind) * 0x9E3779B97F4A7C15ULL;
    u32 idx = (gen & 1) * BLAME_CACHE + ((u32)(h >> 32) & (BLAME_CACHE - 1));
    struct blame_key key = {.victim_cgid = victim, .culprit_cgid = culprit, .kind = kind, .gen = gen};
    struct blame_slot *e = blame_cache.lookup(&idx);
    CACHE_ADD(e, key, blame_key_same, blame_flush, wait_ns, wait);
}

#ifdef RAW_TP
/* Raw tracepoints pass task pointers: the tasks map is keyed by them, so the
 * hot paths read nothing from the task. The pid and flags are read, at
 * offsets from the running kernel's BTF (agent/probe/btf.py), only where a
 * pid must leave the kernel (an event, a fork's parent) and at a task's first
 * switch-out. */
#define PF_KTHREAD 0x00200000           /* include/linux/sched.h, unchanged since 2.6 */

static __always_inline u32 task_pid(u64 task)
{
    u32 pid = 0;
    bpf_probe_read_kernel(&pid, sizeof(pid), (void *)(task + TASK_PID_OFF));
    return pid;
}

static __always_inline u32 key_tid(task_key_t key)
{
    return task_pid(key);
}

/* The cgroup v2 id of the current task, `task`: what
 * bpf_get_current_cgroup_id() returns (task->cgroups->dfl_cgrp->kn->id),
 * read on BTF-typed tracepoints with plain loads at offsets from the
 * kernel's BTF (agent/probe/btf.py CgroupChain), which the verifier checks
 * against the types and turns into fault-safe loads: no helper call on every
 * switch-out. */
static __always_inline u64 current_cgroup_id(task_key_t task)
{
#if defined(TP_BTF) && defined(TASK_CGROUPS_OFF)
    u64 cset = *(u64 *)(task + TASK_CGROUPS_OFF);
    u64 cgrp = *(u64 *)(cset + CSS_SET_DFL_CGRP_OFF);
    u64 kn = *(u64 *)(cgrp + CGROUP_KN_OFF);
    return *(u64 *)(kn + KERNFS_NODE_ID_OFF);
#else
    return bpf_get_current_cgroup_id();
#endif
}

/* TF_KTHREAD for a kernel thread, read once, when its entry is created. */
static __always_inline u32 current_flags(void)
{
    u32 flags = 0;
    bpf_probe_read_kernel(&flags, sizeof(flags), (void *)(bpf_get_current_task() + TASK_FLAGS_OFF));
    return (flags & PF_KTHREAD) ? TF_KTHREAD : 0;
}
#else
static __always_inline u32 key_tid(task_key_t key)
{
    return (u32)key;
}

static __always_inline u64 current_cgroup_id(task_key_t task)
{
    return bpf_get_current_cgroup_id();
}

/* Kernel threads that existed before the programs were attached are marked
 * by user space (Probe.mark_kernel_threads). */
static __always_inline u32 current_flags(void)
{
    return 0;
}
#endif

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

static __always_inline bool watched_cgroup(struct ctl c, u64 cgid)
{
    return c.watch_on && watched.lookup(&cgid);
}

/* Sends one record: `waits` waits of `wait` ns in all between start and end. */
static __always_inline void send(u64 cgid, u32 kind, u64 start, u64 end, u64 other, task_key_t task, u64 wait,
                                 u32 waits)
{
    if (!rate_ok(end))
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
    e->wait_ns = wait;
    e->tid = key_tid(task);
    e->kind = kind;
    e->waits = waits;
    events.ringbuf_submit(e, 0);
}

static __always_inline void emit(struct ctl c, u64 cgid, u32 kind, u64 start, u64 end, u64 other, task_key_t task)
{
    if (watched_cgroup(c, cgid))
        send(cgid, kind, start, end, other, task, end - start, 1);
}

/* A spinning loop (a reader polling a queue and yielding the CPU between
 * polls) makes hundreds of thousands of short waits a second, each a
 * preemption with a few µs of running before the next. One record each
 * would flood the stream past its rate limit; instead a thread's preempted
 * waits shorter than MERGE_WAIT_NS, one after the other behind the same
 * culprit, with no sleep between them and within MERGE_SPAN_NS of the
 * first, go out as one record of their count and sum. A wait after a sleep
 * is never merged (the sleep sends what is pending), nor is a long one, nor
 * a yield with a preemption (their kinds differ), so
 * a neighbour's slices and every wake-up keep their exact edges. The
 * counting maps still take every wait. */
#define MERGE_WAIT_NS 100000ULL
#define MERGE_SPAN_NS 1000000ULL

static __always_inline void flush_pending(struct task_info *t, task_key_t task)
{
    if (!t->pend_n)
        return;
    send(t->cgid, (t->flags & TF_PEND_YIELD) ? EV_YIELD : EV_PREEMPTED, t->pend_start, t->pend_end,
         t->pend_other, task, t->pend_wait, t->pend_n);
    t->pend_n = 0;
}

/* A run-queue wait (or its part) of a task in a watched cgroup, `t` its
 * state; `whole`: not a part of a wait the CPU limit held in part (those
 * keep their own records, which touch). */
static __always_inline void stream_wait(struct task_info *t, u64 cgid, u32 kind, u64 start, u64 end, u64 other,
                                        task_key_t task, bool whole)
{
    u64 wait = end - start;
    bool yield = kind == EV_YIELD;
    bool short_preempted = whole && (kind == EV_PREEMPTED || yield) && wait < MERGE_WAIT_NS;
    if (t->pend_n) {
        if (short_preempted && other == t->pend_other && start >= t->pend_end &&
            end - t->pend_start <= MERGE_SPAN_NS && t->pend_n < 0xffff &&
            yield == !!(t->flags & TF_PEND_YIELD)) {
            t->pend_end = end;
            t->pend_wait += wait;
            t->pend_n++;
            return;
        }
        flush_pending(t, task);
    }
    if (short_preempted) {
        t->flags = yield ? (t->flags | TF_PEND_YIELD) : (t->flags & ~TF_PEND_YIELD);
        t->pend_start = start;
        t->pend_end = end;
        t->pend_other = other;
        t->pend_wait = wait;
        t->pend_n = 1;
        return;
    }
    send(cgid, kind, start, end, other, task, wait, 1);
}

/* Whether a task switched out runnable left the CPU inside sched_yield: its
 * wait is then a loop polling for work another thread makes, not work held
 * back (user space tells the two apart: agent/attribution/critical_path.py).
 * The system call number is in the user registers saved at the top of the
 * task's kernel stack, which stay as they were until the task runs again and
 * returns to user space: read at switch-in, and only for the waits of watched
 * services, so no other task's switch pays for it. */
#if defined(RAW_TP) && defined(TASK_STACK_OFF)
static __always_inline bool yielding(task_key_t task)
{
    u64 stack = 0;
    long nr = -1;
    bpf_probe_read_kernel(&stack, sizeof(stack), (void *)(task + TASK_STACK_OFF));
    if (!stack)
        return false;
    bpf_probe_read_kernel(&nr, sizeof(nr), (void *)(stack + STACK_SYSCALL_NR_OFF));
    return nr == NR_SCHED_YIELD;
}
#else
static __always_inline bool yielding(task_key_t task)
{
    return false;  /* classic tracepoints: no layout to find the registers by */
}
#endif

/* When the scheduler enqueued a task whose wake-up the programs never saw,
 * on the programs' clock. The kernel skips a tracepoint's program when it
 * fires inside a program already running on that CPU (recursion_misses; an
 * interrupt that wakes tasks while a task's own wake-up is being traced), so a
 * switch-in can find its task still asleep. The scheduler stamps the task's
 * sched_info.last_queued with its run queue's clock at enqueue and clears it
 * only after this tracepoint: the run queue's clock minus that stamp is the
 * wait, a few µs short (the clock was read when __schedule began). A stamp
 * older than the sleep the programs saw is not this wait's: false. */
#if defined(RAW_TP) && defined(TASK_LAST_QUEUED_OFF)
static __always_inline bool missed_enqueue(task_key_t task, u64 slept_at, u64 now, u64 *queued)
{
    u64 last = 0, cfs_rq = 0, rq = 0, clock = 0;
    bpf_probe_read_kernel(&last, sizeof(last), (void *)(task + TASK_LAST_QUEUED_OFF));
    bpf_probe_read_kernel(&cfs_rq, sizeof(cfs_rq), (void *)(task + TASK_SE_CFS_RQ_OFF));
    if (!last || !cfs_rq)
        return false;
    bpf_probe_read_kernel(&rq, sizeof(rq), (void *)(cfs_rq + CFS_RQ_RQ_OFF));
    if (!rq)
        return false;
    bpf_probe_read_kernel(&clock, sizeof(clock), (void *)(rq + RQ_CLOCK_OFF));
    if (clock < last || clock - last > now - slept_at)
        return false;
    *queued = now - (clock - last);
    return true;
}
#else
static __always_inline bool missed_enqueue(task_key_t task, u64 slept_at, u64 now, u64 *queued)
{
    return false;  /* classic tracepoints pass no task pointer to read it from */
}
#endif

/* How long the CFS bandwidth limit of a task's cgroup, or of an ancestor,
 * has held the task's run queue on this CPU, ever, a throttle in progress
 * included (ns on the scheduler's clock); *cfs_rq gets that run queue, *on
 * whether a throttle is in progress. At a wait's two ends on one run queue
 * the difference is the part of the wait the limit held: a throttled run
 * queue is not picked, so its tasks wait whatever else the CPU does. The
 * scheduler keeps the total per run queue, on every level below the
 * throttled one: throttled_clock_self(_time) from 6.7 (rq clock, counted
 * while the run queue holds tasks), throttled_clock_pelt(_time) before
 * (PELT clock) and throttled_clock_task(_time) before 5.19 (task clock; both
 * run with the rq clock while the CPU is idle, as it is when a throttled run
 * queue is alone on it). The last was taken at the scheduler's last clock
 * update, which __schedule() and a wake-up make just before their
 * tracepoints. */
#if defined(RAW_TP) && defined(THR_TOTAL_OFF)
/* A kernel field at `addr`: on BTF-typed tracepoints a plain load, which the
 * verifier checks against the task's type and makes fault-safe; elsewhere the
 * helper. */
#ifdef TP_BTF
#define KLOAD(type, addr) (*(type *)(addr))
#else
#define KLOAD(type, addr) ({ type __v = 0; bpf_probe_read_kernel(&__v, sizeof(__v), (void *)(addr)); __v; })
#endif

static __always_inline u64 limit_clock(task_key_t task, u64 *cfs_rq, bool *on)
{
    u64 q = KLOAD(u64, task + THR_SE_CFS_RQ_OFF);
    *cfs_rq = q;
    *on = false;
    if (!q)
        return 0;
#if !defined(TP_BTF) && defined(THR_BLOCK_LEN)
    /* The helper reads the run queue's fields in one call: they sit within
     * THR_BLOCK_LEN bytes of each other (agent/probe/btf.py). */
    u64 block[THR_BLOCK_LEN / 8] = {};
    bpf_probe_read_kernel(block, sizeof(block), (void *)(q + THR_BLOCK_OFF));
#define THR_FIELD(type, off) (*(type *)((char *)block + ((off) - THR_BLOCK_OFF)))
#else
#define THR_FIELD(type, off) KLOAD(type, q + (off))
#endif
    u64 total = THR_FIELD(u64, THR_TOTAL_OFF);
    u64 since = THR_FIELD(u64, THR_SINCE_OFF);
#ifdef THR_BY_SINCE
    *on = since != 0;          /* zeroed when the throttle ends */
#else
    *on = THR_FIELD(u32, THR_COUNT_OFF) != 0;   /* throttled levels at or above this one */
#endif
#undef THR_FIELD
    if (!*on)
        return total;
    u64 rq = KLOAD(u64, q + THR_CFS_RQ_RQ_OFF);
    if (!rq)
        return total;
    u64 clock = KLOAD(u64, rq + THR_CLOCK_OFF);
#ifdef THR_CLOCK_LESS_OFF
    clock -= KLOAD(u64, rq + THR_CLOCK_LESS_OFF);   /* rq_clock_pelt() = clock_pelt - lost_idle_time */
#endif
    return clock > since ? total + (clock - since) : total;
}
#else
static __always_inline u64 limit_clock(task_key_t task, u64 *cfs_rq, bool *on)
{
    *cfs_rq = 0;  /* classic tracepoints pass no task pointer: the limit's part is not told */
    *on = false;
    return 0;
}
#endif

/* A wait begins: where it stands on its CPU limit's clock. */
static __always_inline void limit_start(task_key_t task, struct task_info *t)
{
    bool on;
    t->thr_ns = limit_clock(task, &t->thr_cfs_rq, &on);
    t->flags = on ? (t->flags | TF_THR_START) : (t->flags & ~TF_THR_START);
}

/* The part of a wait of `wait` ns, now ending, that the task's CPU limit
 * held; 0 when it began on another run queue (the task moved) or its start
 * is not known. */
static __always_inline u64 limit_part(task_key_t task, struct task_info *t, u64 wait)
{
    if (!t->thr_cfs_rq)
        return 0;
    u64 q;
    bool on;
    u64 now = limit_clock(task, &q, &on);
    if (q != t->thr_cfs_rq || now <= t->thr_ns)
        return 0;
    u64 held = now - t->thr_ns;
    return held < wait ? held : wait;
}

/* A D-state sleep that ended at `end`: the I/O wait. */
static __always_inline void iowait_end(struct ctl c, struct task_info *t, task_key_t task, u64 end)
{
    hist_add(t->cgid, c.gen, HIST_IOWAIT, end - t->ts);
    emit(c, t->cgid, EV_IOWAIT, t->ts, end, 0, task);
}

/* The state machine, shared by both attachments below. */

/* prev and next are 0 for the idle task where the attachment knows it
 * cheaply; an idle task's key is never in the map anyway. */
static __always_inline int on_switch(task_key_t prev, task_key_t next, u32 out_state)
{
    u64 now = bpf_ktime_get_ns();
    struct ctl c = read_ctl();
    u64 next_cgid = 0;

    /* The current task is prev: the one that held the CPU until now. */
    struct task_info *p = prev ? task_get(prev) : NULL;
    u64 cgid = 0;
    u32 flags = 0;
    if (prev) {
        flags = p ? p->flags : current_flags();
        cgid = (flags & TF_KTHREAD) ? KERNEL_CGID : current_cgroup_id(prev);
    }

    /* Switch-in: the run-queue wait ends. */
    if (next) {
        struct task_info *n = task_get(next);
        if (n) {
            next_cgid = n->cgid;
            u32 st = n->state;
            u64 since = n->ts;
            if (st == TS_SLEEPING || st == TS_BLOCKED) {
                cgroup_add(next_cgid, c.gen, CG_INDEX(untraced_wakeup), 0);
                if (missed_enqueue(next, n->ts, now, &since)) {
                    cgroup_add(next_cgid, c.gen, CG_INDEX(recovered_wakeup), 0);
                    if (st == TS_BLOCKED)
                        iowait_end(c, n, next, since);
                    st = TS_RUNNABLE;
                }
            }
            if (st == TS_RUNNABLE || st == TS_PREEMPTED) {
                u64 wait = now - since;
                hist_add(next_cgid, c.gen, HIST_RUNQ, wait);
                /* Blame: a preempted wait on its preemptor, a wait after a
                 * wakeup on whoever held the CPU until it ended. */
                bool preempted = st == TS_PREEMPTED;
                u64 culprit = preempted ? n->preemptor_cgid : cgid;
                bool watched = watched_cgroup(c, next_cgid);
                u32 kind = !preempted ? EV_RUNQ : (watched && yielding(next)) ? EV_YIELD : EV_PREEMPTED;
                u64 start = since;
                u64 limit = limit_part(next, n, wait);
                if (limit) {
                    /* The limit's part is its own cause. A wait that began
                     * throttled has it first, and the rest came after the
                     * limit lifted, which put the task back on its run queue
                     * as a wake-up would (no neighbour preempted it):
                     * whoever held the CPU until it ran kept it. One
                     * throttled on the way has it last. */
                    hist_add(next_cgid, c.gen, HIST_RUNQ_LIMIT, wait);
                    cgroup_add_n(next_cgid, c.gen, CG_INDEX(limited_runq), 1, limit);
                    if (n->flags & TF_THR_START) {
                        preempted = false;
                        kind = EV_RUNQ;
                        culprit = cgid;
                        if (watched)
                            stream_wait(n, next_cgid, EV_LIMIT, since, since + limit, next_cgid, next, false);
                        start = since + limit;
                    } else if (watched) {
                        stream_wait(n, next_cgid, EV_LIMIT, now - limit, now, next_cgid, next, false);
                    }
                }
                blame_add(next_cgid, culprit, preempted ? BLAME_PREEMPTED : BLAME_HOLDER, c.gen, wait - limit);
                if (watched)
                    stream_wait(n, next_cgid, kind, start, start + wait - limit, culprit, next, !limit);
            } else if (st == TS_RUNNING) {
                cgroup_add(next_cgid, c.gen, CG_INDEX(untraced_switch_out), 0);
            }
            n->state = TS_RUNNING;
            n->ts = now;
        }
    }

    if (!prev)
        return 0;         /* idle */
    if (out_state == TS_EXITING) {
        /* sched_process_exit dropped the entry, but a preemption between it
         * and this last switch makes a new one, whose merged waits go now. */
        if (p) {
            flush_pending(p, prev);
            task_drop(prev);
        }
        return 0;
    }

    /* Switch-out: the current task is prev, so its cgroup is at hand. */
    if (p) {
        if (p->state == TS_RUNNABLE || p->state == TS_PREEMPTED)
            cgroup_add(cgid, c.gen, CG_INDEX(untraced_switch_in), 0);
        /* Merged waits end at a sleep, or where the task changes cgroup. */
        if (p->pend_n && (out_state != TS_PREEMPTED || p->cgid != cgid))
            flush_pending(p, prev);
        p->ts = now;
        p->cgid = cgid;
        p->preemptor_cgid = next_cgid;
        p->state = out_state;
        if (out_state == TS_PREEMPTED)
            limit_start(prev, p);
        else
            p->thr_cfs_rq = 0;
        return 0;
    }
    struct task_info init = {.ts = now, .cgid = cgid, .preemptor_cgid = next_cgid, .state = out_state,
                             .flags = flags};
    if (out_state == TS_PREEMPTED)
        limit_start(prev, &init);
    if (!task_put(prev, &init))
        count_error(ERR_TASK);
    return 0;
}

/* A wake-up that crosses processes of watched services goes out as an
 * EV_WAKE: an API server handing a request to the engine core that serves
 * it, the engine core's outputs coming back. User space follows a request to
 * the processes that served it by them (agent/attribution/request_sched.py);
 * an engine core that never exchanged one with the request's front end did
 * not serve it. Read at sched_waking, which the kernel fires in the waker's
 * context: sched_wakeup of a task whose CPU is idle fires on that CPU, from
 * its wake list, in an interrupt under the idle task, where the waker is
 * gone. A wake-up the kernel makes in an interrupt (a timer's) names
 * whoever ran, a process that did not serve, which only widens what user
 * space counts. The woken task's process is read from it, so only on raw
 * and BTF-typed tracepoints. */
static __always_inline int on_waking(task_key_t task)
{
#ifdef TASK_TGID_OFF
    struct ctl c = read_ctl();
    if (!c.watch_on)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = 0;
    bpf_probe_read_kernel(&tgid, sizeof(tgid), (void *)(task + TASK_TGID_OFF));
    if (!(u32)id || (u32)(id >> 32) == tgid)
        return 0;
    struct task_info *t = task_get(task);
    if (!t || !watched.lookup(&t->cgid))
        return 0;
    u64 waker_cgid = bpf_get_current_cgroup_id();
    if (!watched.lookup(&waker_cgid))
        return 0;
    u64 now = bpf_ktime_get_ns();
    send(t->cgid, EV_WAKE, now, now, id >> 32, task, 0, 1);
#endif
    return 0;
}

static __always_inline int on_wakeup(task_key_t task)
{
#ifdef SKIP_WAKEUPS
    if (bpf_get_prandom_u32() % SKIP_WAKEUPS == 0)
        return 0;
#endif
    struct task_info *t = task_get(task);
    if (!t)
        return 0; /* never seen on a CPU: its cgroup is unknown */
    u32 st = t->state;
    /* A wakeup of a running or already queued task changes nothing: the
     * enqueue time of a queued task stays the first one. */
    if (st == TS_RUNNING || st == TS_RUNNABLE || st == TS_PREEMPTED)
        return 0;
    u64 now = bpf_ktime_get_ns();
    if (st == TS_BLOCKED)
        iowait_end(read_ctl(), t, task, now);
    t->state = TS_RUNNABLE;
    t->ts = now;
    limit_start(task, t);
    return 0;
}

static __always_inline int on_migrate(task_key_t task)
{
    struct task_info *t = task_get(task);
    if (t) {
        struct ctl c = read_ctl();
        cgroup_add(t->cgid, c.gen, CG_INDEX(migrations), 0);
        u64 now = bpf_ktime_get_ns();
        emit(c, t->cgid, EV_MIGRATE, now, now, 0, task);
    }
    return 0;
}

/* An exiting task sends its merged waits before its state goes. */
static __always_inline void on_task_exit(task_key_t task)
{
    struct task_info *t = task_get(task);
    if (t && t->pend_n)
        flush_pending(t, task);
    task_drop(task);
}

/* The child starts in its parent's cgroup; the parent is current here.
 * Children of kthreadd are kernel threads. */
static __always_inline int on_fork(u32 parent, task_key_t child)
{
    struct task_info init = {.state = TS_SLEEPING};
    if (parent == KTHREADD_PID) {
        init.cgid = KERNEL_CGID;
        init.flags = TF_KTHREAD;
    } else {
        init.cgid = bpf_get_current_cgroup_id();
    }
    if (!task_put(child, &init))
        count_error(ERR_TASK);
    return 0;
}

#ifdef RAW_TP
/* Raw tracepoints: the kernel passes its own arguments (task pointers and
 * the raw task state) instead of filling a record first, which is most of
 * what a classic tracepoint costs on a context switch. Raw states
 * (include/linux/sched.h, stable since 4.14): */
#define RAW_TASK_REPORT 0x7f           /* the bits the classic tracepoint reports */
#define RAW_TASK_UNINTERRUPTIBLE 0x2
#define RAW_TASK_DEAD 0x80
#define RAW_TASK_NOLOAD 0x400           /* with UNINTERRUPTIBLE: TASK_IDLE, reported "I", not "D" */

/* BTF-typed tracepoints (TP_BTF) take the same arguments as raw ones, but
 * the verifier knows them as task pointers, which task-local storage needs.
 * BCC cannot load these: agent/probe/tracing.py loads the tp_btf__ programs
 * it compiled. */
#ifdef TP_BTF
#define SCHED_PROBE(event) int tp_btf__##event(struct bpf_raw_tracepoint_args *ctx)
#else
#define SCHED_PROBE(event) RAW_TRACEPOINT_PROBE(event)
#endif

/* prev's raw state: the tracepoint's fourth argument from 5.18
 * (sched_switch(bool preempt, prev, next, unsigned int prev_state)); before,
 * the tracepoint passes (preempt, prev, next) only and the state is read from
 * prev itself, at TASK_STATE_OFF (`__state` from 5.14, the low half of the
 * long `state` before). The kernel's classic tracepoint reads the same field
 * at the same moment. */
static __always_inline u32 switch_prev_state(struct bpf_raw_tracepoint_args *ctx)
{
#ifdef TASK_STATE_OFF
    u32 state = 0;
    bpf_probe_read_kernel(&state, sizeof(state), (void *)(ctx->args[1] + TASK_STATE_OFF));
    return state;
#else
    return ctx->args[3];
#endif
}

SCHED_PROBE(sched_switch)
{
    bool preempt = ctx->args[0];
    u32 state = switch_prev_state(ctx);
    u32 st;
    /* As the classic path: runnable at switch-out (or preempted while going
     * to sleep) is an involuntary switch. */
    if (preempt || ((state & RAW_TASK_REPORT) == 0 && !(state & RAW_TASK_DEAD)))
        st = TS_PREEMPTED;
    else if (state & RAW_TASK_DEAD)
        st = TS_EXITING;
    else if ((state & RAW_TASK_UNINTERRUPTIBLE) && !(state & RAW_TASK_NOLOAD))
        st = TS_BLOCKED;
    else
        st = TS_SLEEPING;
    /* prev is the current task; its pid from a helper says whether it is idle. */
#ifdef TP_BTF
    task_key_t prev = (u32)bpf_get_current_pid_tgid() ? ctx->args[1] : 0;
#else
    task_key_t prev = (u32)bpf_get_current_pid_tgid() ? bpf_get_current_task() : 0;
#endif
    return on_switch(prev, ctx->args[2], st);
}

SCHED_PROBE(sched_waking)
{
    return on_waking(ctx->args[0]);
}

SCHED_PROBE(sched_wakeup)
{
    return on_wakeup(ctx->args[0]);
}

SCHED_PROBE(sched_wakeup_new)
{
    return on_wakeup(ctx->args[0]);
}

SCHED_PROBE(sched_migrate_task)
{
    return on_migrate(ctx->args[0]);
}

SCHED_PROBE(sched_process_fork)
{
    return on_fork(task_pid(ctx->args[0]), ctx->args[1]);
}

SCHED_PROBE(sched_process_exit)
{
    on_task_exit(ctx->args[0]);
    return 0;
}

#else
/* Classic tracepoints: BCC builds `args` from the live format files, so this
 * path needs nothing from the kernel's BTF. */

TRACEPOINT_PROBE(sched, sched_switch)
{
    long prev_state = args->prev_state;
    /* Still runnable at switch-out = an involuntary switch, as the kernel's
     * nivcsw counts it. PREEMPT_BIT ("R+") marks only preemption inside the
     * kernel; a task preempted on its way back to user space (the common case
     * for CPU-bound user code) or yielding is switched out as plain "R". */
    u32 st;
    if ((prev_state & (PREEMPT_BIT - 1)) == 0)
        st = TS_PREEMPTED;
    else if (prev_state & STATE_DEAD)
        st = TS_EXITING;
    else if (prev_state & STATE_D)
        st = TS_BLOCKED;
    else
        st = TS_SLEEPING;
    return on_switch(args->prev_pid, args->next_pid, st);
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
    return on_migrate(args->pid);
}

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    return on_fork(args->parent_pid, args->child_pid);
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    on_task_exit(args->pid);
    return 0;
}
#endif
