/* One-pass normalize for stoker.transforms: records of a stored dtype in, float32/float64 out.
 *
 * Each record is read once (through a crop window, with an optional reversal of one axis)
 * and written once, the first Normalize op computed on the way; any further ops run on the
 * just-written values while they are in L1.
 * The arithmetic is the same IEEE operations numpy's reference does, in the same order
 * ((x - mean) / std or x * scale + offset, op after op), and the build keeps the compiler
 * from fusing multiply-add (-ffp-contract=off), so results are bit-identical to numpy's.
 * The Python side (stoker.transforms) validates every address and size before calling.
 *
 * A record is O rows of M units of I elements; row o starts row_stride bytes after row o-1
 * and is contiguous in the source; a flipped record has its units in reverse order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define STOKER_X86 1
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* One build, the widest vectors the CPU has (chosen once at load time). */
#define STOKER_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define STOKER_CLONES
#endif

#if defined(__GNUC__) || defined(__clang__)
#define STOKER_ALIGNED __attribute__((aligned(64)))
#else
#define STOKER_ALIGNED
#endif

/* Which hand-written loops may run (set_isa, for tests and A/B runs): ISA_ALL takes the widest
 * the CPU has; ISA_AVX2 what a CPU without AVX512_BF16 runs (the AVX2 and F16C loops); ISA_NONE
 * none of them (the generic kernels and numpy, as on a CPU without AVX2). The generic kernels'
 * target_clones are picked once at load time and are not affected. */
enum { ISA_NONE = 0, ISA_AVX2 = 1, ISA_ALL = 2 };
static int isa_limit = ISA_ALL;

#ifdef STOKER_X86
static inline int has_avx2(void) { return isa_limit >= ISA_AVX2 && __builtin_cpu_supports("avx2"); }
static inline int has_f16c(void) { return has_avx2() && __builtin_cpu_supports("f16c"); }
static inline int has_bf16ne(void) {
    return isa_limit >= ISA_ALL && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl");
}
#endif

#define MAX_OPS 8
#define BLOCK 2048 /* elements: a block of float64 is 16 KiB, in L1 while the ops run */

typedef struct {
    int divide;         /* (x - first) / second, else x * first + second */
    int vector;         /* parameters per element of a unit (length I), else one value */
    const void *first;
    const void *second;
} op_t;

typedef struct {
    const char *src;
    Py_ssize_t n, rec_stride, row_stride, O, M, I;
    const int64_t *extra; /* per-record byte offset of the window, or NULL */
    const uint8_t *flips; /* per record: reverse the units, or NULL */
    const int64_t *rows;  /* per record: its row of dst (a scatter), or NULL for row r */
    char *dst;            /* contiguous (n, O, M, I), or (rows, O, M, I) with rows */
    int stream;           /* write dst with streaming stores (see stream_bytes) */
    int nops;
    op_t ops[MAX_OPS];
} job_t;

/* Copy len bytes to dst past the cache where the CPU can (non-temporal stores).
 * A batch is read by its consumer later, not now: ordinary stores would first pull each of
 * its cache lines in (a read for ownership) only to write it whole and evict it, doubling
 * the memory traffic (measured: benchmarks/results/w1_history.md). The caller ends the call with stream_fence(). */
static void stream_bytes(char *dst, const char *src, size_t len) {
#ifdef STOKER_X86
    /* A load whose address matches a pending streaming store's modulo 4 KiB waits for it to
     * drain, so four loads come first, then the four stores of the same 64-byte line: stored
     * right after each load, a source just past the destination's page offset stalled on every
     * store (measured: benchmarks/results/w1_history.md). */
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > len) head = len;
    memcpy(dst, src, head);
    dst += head, src += head, len -= head;
    const size_t k = len / 64;
    for (size_t i = 0; i < k; i++) {
        const __m128i *s = (const __m128i *)(src + 64 * i);
        __m128i *d = (__m128i *)(dst + 64 * i);
        const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
        const __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
        _mm_stream_si128(d, a);
        _mm_stream_si128(d + 1, b);
        _mm_stream_si128(d + 2, c);
        _mm_stream_si128(d + 3, e);
    }
    memcpy(dst + 64 * k, src + 64 * k, len - 64 * k);
#else
    memcpy(dst, src, len);
#endif
}

/* Where to build a block bound for dst: half a page off dst's page offset (see stream_bytes). */
static inline void *away_from(char *buf, const void *dst) {
    return buf + ((((uintptr_t)dst & 4095) + 2048) & 4095 & ~(uintptr_t)63);
}

/* Streaming stores are weakly ordered: fence them before the batch is handed on. */
static void stream_fence(void) {
#ifdef STOKER_X86
    _mm_sfence();
#endif
}

/* x[i] = op0(src value), the first op fused into the converting copy (one pass for one op). */
#define CONVERT(T, x, len, SRC, off)                                                   \
    if (j->nops == 0) {                                                                \
        for (Py_ssize_t i = 0; i < (len); i++) x[i] = (T)(SRC);                        \
    } else {                                                                           \
        const op_t *op_ = &j->ops[0];                                                  \
        const T *f_ = (const T *)op_->first, *g_ = (const T *)op_->second;             \
        if (op_->vector) {                                                             \
            f_ += (off);                                                               \
            g_ += (off);                                                               \
            if (op_->divide)                                                           \
                for (Py_ssize_t i = 0; i < (len); i++) x[i] = ((T)(SRC) - f_[i]) / g_[i]; \
            else                                                                       \
                for (Py_ssize_t i = 0; i < (len); i++) x[i] = (T)(SRC) * f_[i] + g_[i]; \
        } else {                                                                       \
            const T a_ = f_[0], b_ = g_[0];                                            \
            if (op_->divide)                                                           \
                for (Py_ssize_t i = 0; i < (len); i++) x[i] = ((T)(SRC) - a_) / b_;    \
            else                                                                       \
                for (Py_ssize_t i = 0; i < (len); i++) x[i] = (T)(SRC) * a_ + b_;      \
        }                                                                              \
    }

/* The ops after the first, each a pass over x while it is in L1. */
#define APPLY_OPS(T, x, len, off)                                                      \
    for (int k_ = 1; k_ < j->nops; k_++) {                                             \
        const op_t *op_ = &j->ops[k_];                                                 \
        const T *f_ = (const T *)op_->first, *g_ = (const T *)op_->second;             \
        if (op_->vector) {                                                             \
            f_ += (off);                                                               \
            g_ += (off);                                                               \
            if (op_->divide)                                                           \
                for (Py_ssize_t i_ = 0; i_ < (len); i_++) x[i_] = (x[i_] - f_[i_]) / g_[i_]; \
            else                                                                       \
                for (Py_ssize_t i_ = 0; i_ < (len); i_++) x[i_] = x[i_] * f_[i_] + g_[i_]; \
        } else {                                                                       \
            const T a_ = f_[0], b_ = g_[0];                                            \
            if (op_->divide)                                                           \
                for (Py_ssize_t i_ = 0; i_ < (len); i_++) x[i_] = (x[i_] - a_) / b_;   \
            else                                                                       \
                for (Py_ssize_t i_ = 0; i_ < (len); i_++) x[i_] = x[i_] * a_ + b_;     \
        }                                                                              \
    }

#define DEFINE_KERNEL(NAME, S, T)                                                      \
    STOKER_CLONES static void NAME(const job_t *j) {                                   \
        const Py_ssize_t O = j->O, M = j->M, I = j->I;                                 \
        char tmp[BLOCK * sizeof(T) + 4096] STOKER_ALIGNED; /* a streamed block, built in L1 */ \
        /* Streamed in pieces of 4 KiB or more: short rows (a flip along W of 128-wide frames \
         * writes 512 bytes at a time) ran slower streamed one call per row. */         \
        const int stream = j->stream && (I == 1 ? M : I) * (Py_ssize_t)sizeof(T) >= 4096; \
        /* Short rows of one value per unit (a flip along W) are packed, several rows to a    \
         * block (a record's rows are contiguous in dst), and the block is streamed at once. */ \
        const Py_ssize_t pack = (j->stream && !stream && I == 1 && M <= BLOCK) ? BLOCK / M : 0; \
        for (Py_ssize_t r = 0; r < j->n; r++) {                                        \
            const char *rec = j->src + r * j->rec_stride + (j->extra ? j->extra[r] : 0); \
            const int flip = j->flips ? j->flips[r] : 0;                               \
            T *drec = (T *)j->dst + (j->rows ? j->rows[r] : r) * O * M * I;            \
            for (Py_ssize_t o0 = 0; pack && o0 < O; o0 += pack) {                      \
                const Py_ssize_t k = (O - o0 < pack) ? O - o0 : pack;                  \
                T *base = (T *)away_from(tmp, drec + o0 * M);                          \
                for (Py_ssize_t o = o0; o < o0 + k; o++) {                             \
                    const S *s = (const S *)(rec + o * j->row_stride);                 \
                    T *x = base + (o - o0) * M;                                        \
                    if (flip) {                                                        \
                        const S *t = s + (M - 1);                                      \
                        CONVERT(T, x, M, t[-i], 0)                                     \
                    } else {                                                           \
                        const S *t = s;                                                \
                        CONVERT(T, x, M, t[i], 0)                                      \
                    }                                                                  \
                    APPLY_OPS(T, x, M, 0)                                              \
                }                                                                      \
                stream_bytes((char *)(drec + o0 * M), (const char *)base, k * M * sizeof(T)); \
            }                                                                          \
            for (Py_ssize_t o = 0; !pack && o < O; o++) {                              \
                const S *s = (const S *)(rec + o * j->row_stride);                     \
                T *d = drec + o * M * I;                                               \
                if (I == 1) {                                                          \
                    for (Py_ssize_t b = 0; b < M; b += BLOCK) {                        \
                        const Py_ssize_t len = (M - b < BLOCK) ? M - b : BLOCK;        \
                        T *x = stream ? (T *)away_from(tmp, d + b) : d + b;         \
                        if (flip) {                                                    \
                            const S *t = s + (M - 1 - b);                              \
                            CONVERT(T, x, len, t[-i], 0)                               \
                        } else {                                                       \
                            const S *t = s + b;                                        \
                            CONVERT(T, x, len, t[i], 0)                                \
                        }                                                              \
                        APPLY_OPS(T, x, len, 0)                                        \
                        if (stream) stream_bytes((char *)(d + b), (const char *)x, len * sizeof(T)); \
                    }                                                                  \
                } else {                                                               \
                    for (Py_ssize_t m = 0; m < M; m++) {                               \
                        const S *t = s + m * I;                                        \
                        T *u = d + (flip ? M - 1 - m : m) * I;                         \
                        for (Py_ssize_t b = 0; b < I; b += BLOCK) {                    \
                            const Py_ssize_t len = (I - b < BLOCK) ? I - b : BLOCK;    \
                            T *x = stream ? (T *)away_from(tmp, u + b) : u + b;     \
                            CONVERT(T, x, len, t[b + i], b)                            \
                            APPLY_OPS(T, x, len, b)                                    \
                            if (stream) stream_bytes((char *)(u + b), (const char *)x, len * sizeof(T)); \
                        }                                                              \
                    }                                                                  \
                }                                                                      \
            }                                                                          \
        }                                                                              \
    }

DEFINE_KERNEL(k_i8_f32, int8_t, float)
DEFINE_KERNEL(k_u8_f32, uint8_t, float)
DEFINE_KERNEL(k_i16_f32, int16_t, float)
DEFINE_KERNEL(k_u16_f32, uint16_t, float)
DEFINE_KERNEL(k_f32_f32, float, float)
DEFINE_KERNEL(k_i8_f64, int8_t, double)
DEFINE_KERNEL(k_u8_f64, uint8_t, double)
DEFINE_KERNEL(k_i16_f64, int16_t, double)
DEFINE_KERNEL(k_u16_f64, uint16_t, double)
DEFINE_KERNEL(k_f32_f64, float, double)
DEFINE_KERNEL(k_f64_f64, double, double)

typedef void (*kernel_t)(const job_t *);

/* Source codes (numpy dtype chars): b int8, B uint8, h int16, H uint16, f float32, d float64. */
static kernel_t pick(int src, int out) {
    if (out == 'f') {
        switch (src) {
        case 'b': return k_i8_f32;
        case 'B': return k_u8_f32;
        case 'h': return k_i16_f32;
        case 'H': return k_u16_f32;
        case 'f': return k_f32_f32;
        }
    } else if (out == 'd') {
        switch (src) {
        case 'b': return k_i8_f64;
        case 'B': return k_u8_f64;
        case 'h': return k_i16_f64;
        case 'H': return k_u16_f64;
        case 'f': return k_f32_f64;
        case 'd': return k_f64_f64;
        }
    }
    return NULL;
}

/* pick(), or NULL with a ValueError set. */
static kernel_t pick_or_raise(int src, int out) {
    kernel_t kernel = pick(src, out);
    if (kernel == NULL) PyErr_Format(PyExc_ValueError, "no kernel from dtype %c to %c", src, out);
    return kernel;
}

/* Bytes per value of a dtype code, for sizing only (8 for a code this file does not copy). */
static size_t value_bytes(int code) {
    switch (code) {
    case 'b': case 'B': case '?': return 1;
    case 'h': case 'H': case 'e': case 'E': return 2;
    case 'i': case 'I': case 'f': return 4;
    }
    return 8;
}

/* Wake-ups: a Signal is the semaphore a consumer sleeps on while workers fill its batches.
 *
 * A worker that finishes the batch the consumer waits for could wake it at once, but it holds
 * the GIL then and keeps it for the Python that starts its next batch: the consumer wakes only
 * to sleep again on the GIL, and is woken a second time when the worker gives it up. Each
 * wake-up costs both threads CPU (a futex wake, on a VM an interrupt). post_later() instead
 * leaves the wake-up with the worker's thread, to be sent by the next kernel that gives the
 * GIL up (just after giving it up: the consumer wakes to a free GIL), or by flush(). */
typedef struct {
    PyObject_HEAD
    sem_t sem;
} SignalObject;

static __thread SignalObject *deferred_ = NULL; /* this thread's wake-up not yet sent (a reference) */

static void signal_send(SignalObject *s) {
    int v = 0;
    if (sem_getvalue(&s->sem, &v) == 0 && v > 0) return; /* one is pending already: a wake-up, not a count */
    sem_post(&s->sem);
}

/* Takes this thread's deferred wake-up; the caller sends it and drops the reference. */
static SignalObject *take_deferred(void) {
    SignalObject *d = deferred_;
    deferred_ = NULL;
    return d;
}

/* Sends this thread's deferred wake-up now, if any (GIL held: it drops the reference). */
static void send_deferred(void) {
    SignalObject *d = take_deferred();
    if (d != NULL) {
        signal_send(d);
        Py_DECREF(d);
    }
}

/* Small jobs keep the GIL. Given up, it goes to whichever thread wants it, and taking it back
 * waits out that thread's Python, far longer than a small copy takes. Jobs this size or larger give it up while they run,
 * and send the thread's deferred wake-up once it is given up. */
#define GIL_FREE_BYTES ((size_t)64 << 10)
/* volatile: a guarded copy (GUARD_BEGIN) that faults returns through siglongjmp, and these
 * must come back as they were. */
#define RELEASE_GIL_IF_BIG(bytes)                                                  \
    SignalObject *volatile woke_ = NULL;                                           \
    PyThreadState *volatile gil_ = NULL;                                           \
    if ((size_t)(bytes) >= GIL_FREE_BYTES) {                                       \
        woke_ = take_deferred();                                                   \
        gil_ = PyEval_SaveThread();                                                \
        if (woke_ != NULL) signal_send(woke_);                                     \
    }
#define TAKE_GIL_BACK()                            \
    do {                                           \
        if (gil_ != NULL) PyEval_RestoreThread(gil_); \
        Py_XDECREF(woke_);                         \
    } while (0)

/* Faults in reads from memory maps. A file cut short under its map (truncated by another
 * process between stoker's size check and its copy) raises SIGBUS at the first read of a page
 * past its new end, which would kill the process. Every kernel reading memory the caller hands
 * it runs under its thread's guard: a SIGBUS while the guard is set jumps back to it
 * (siglongjmp; the loops hold no lock and allocate nothing), and the call raises MapFault, with
 * the faulting address, once it holds the GIL again; stoker's record reads turn that into the
 * CorruptDataError naming the file. A SIGBUS anywhere else is handed to the handler that was
 * there before (faulthandler's, or the default: the process dies as it would have).
 * guard_maps(), which stoker calls before it maps a file, installs the handler, and installs it
 * again over any handler set since (Ray's and TensorFlow's C++ runtimes set their own when they
 * start, chaining to ours), so a fault in a kernel always reaches the guard first. Since such a
 * handler may pass a signal back to ours, a signal passed on comes back at most once: then it
 * ends the process, as the default action does, instead of going round the chain again. */
static __thread sigjmp_buf *guard_ = NULL; /* where this thread's fault jumps, while set */
static __thread uintptr_t fault_at_ = 0;   /* the address of its last fault (0: not known) */
static volatile sig_atomic_t armed_ = 0;   /* guards set in all threads: none, no thread-local read */
static volatile sig_atomic_t passing_ = 0; /* a SIGBUS outside every guard was handed on */
static struct sigaction before_;           /* the SIGBUS handler before ours */
static struct sigaction ours_;             /* ours, to install again */
static pthread_mutex_t guard_lock_ = PTHREAD_MUTEX_INITIALIZER;
static PyObject *MapFault = NULL;

static void end_as_default(int sig, int sent) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (sent) raise(sig); /* a fault recurs once the handler returns */
}

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)context;
    sigjmp_buf *env = armed_ ? guard_ : NULL;
    if (env != NULL) {
        guard_ = NULL; /* a second fault before the guard is left goes on to the previous handler */
        fault_at_ = info != NULL && info->si_code > 0 ? (uintptr_t)info->si_addr : 0;
        siglongjmp(*env, 1);
    }
    const int sent = info == NULL || info->si_code <= 0; /* by kill() or raise(), not by a fault */
    if (passing_) { /* handed on before, and back: end it */
        end_as_default(sig, sent);
        return;
    }
    /* Hand it on as the previous handler's own installation would get it: a fault recurs into it
     * once this returns; a sent signal is sent again, and where that handler returns, the process
     * goes on and ours is installed again. */
    passing_ = 1;
    sigaction(sig, &before_, NULL);
    if (sent) {
        raise(sig);
        sigaction(sig, &ours_, NULL);
        passing_ = 0;
    }
}

static void install_guard(void) {
    struct sigaction now;
    pthread_mutex_lock(&guard_lock_);
    if (sigaction(SIGBUS, NULL, &now) == 0 && !((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)) {
        memset(&ours_, 0, sizeof ours_);
        ours_.sa_sigaction = on_sigbus;
        /* SA_NODEFER: the jump leaves the handler without restoring the signal mask (sigsetjmp
         * saves none: a system call per kernel call), so SIGBUS must not be blocked in it. */
        ours_.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&ours_.sa_mask);
        sigaction(SIGBUS, &ours_, &before_);
        passing_ = 0;
    }
    pthread_mutex_unlock(&guard_lock_);
}

/* The guard this thread had (nested calls restore it); the thread-local is touched here, outside
 * any handler, so the handler's read of it allocates nothing. */
static inline sigjmp_buf *guard_enter(void) {
    sigjmp_buf *outer = guard_;
    __atomic_add_fetch(&armed_, 1, __ATOMIC_SEQ_CST);
    return outer;
}

static inline void guard_leave(sigjmp_buf *outer) {
    guard_ = outer;
    __atomic_sub_fetch(&armed_, 1, __ATOMIC_SEQ_CST);
}

/* GUARD_BEGIN(); loops reading caller memory; GUARD_END(); then, once the GIL is held,
 * `if (faulted_) return map_fault();`. One pair per block. */
#define GUARD_BEGIN()                                   \
    volatile int faulted_ = 0;                          \
    sigjmp_buf env_;                                    \
    sigjmp_buf *const outer_ = guard_enter();           \
    if (sigsetjmp(env_, 0) != 0) {                      \
        faulted_ = 1;                                   \
    } else {                                            \
        guard_ = &env_;
#define GUARD_END()                                     \
    }                                                   \
    guard_leave(outer_);

/* guard_maps(): install the SIGBUS handler of the guard, unless it is the one installed (one
 * system call to look). */
static PyObject *guard_maps(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    install_guard();
    Py_RETURN_NONE;
}

/* Raises MapFault for this thread's last fault (GIL held); NULL. */
static PyObject *map_fault(void) {
    char text[96];
    snprintf(text, sizeof text, "bus error reading mapped memory at 0x%llx", (unsigned long long)fault_at_);
    PyObject *e = PyObject_CallFunction(MapFault, "is", EIO, text);
    if (e == NULL) return NULL;
    PyObject *at = PyLong_FromUnsignedLongLong((unsigned long long)fault_at_);
    if (at == NULL || PyObject_SetAttrString(e, "address", at) < 0) {
        Py_XDECREF(at);
        Py_DECREF(e);
        return NULL;
    }
    Py_DECREF(at);
    PyErr_SetObject(MapFault, e);
    Py_DECREF(e);
    return NULL;
}

/* Bytes per value of a dtype code the plain copies take, or 0 with a ValueError set. */
static size_t copy_size(int code) {
    switch (code) {
    case 'b': case 'B': return 1;
    case 'h': case 'H': case 'e': case 'E': return 2;
    case 'f': return 4;
    case 'd': return 8;
    }
    PyErr_Format(PyExc_ValueError, "no copy for dtype %c", code);
    return 0;
}

static kernel_t pick_rows(int src, int out, const job_t *j, int whole_units);

static PyObject *normalize(PyObject *self, PyObject *args) {
    (void)self;
    int src_code, out_code;
    unsigned long long src, extra, flips, dst;
    job_t j = {0};
    PyObject *ops;
    j.stream = 0;
    if (!PyArg_ParseTuple(args, "CCKnnKnnnnKKO!|p", &src_code, &out_code, &src, &j.n, &j.rec_stride, &extra,
                          &j.row_stride, &j.O, &j.M, &j.I, &flips, &dst, &PyTuple_Type, &ops, &j.stream))
        return NULL;
    /* float16 ('e') and bfloat16 ('E') only by the row kernels: False where they do not apply. */
    kernel_t kernel = (out_code == 'e' || out_code == 'E') ? NULL : pick_or_raise(src_code, out_code);
    if (kernel == NULL && out_code != 'e' && out_code != 'E') return NULL;
    j.src = (const char *)(uintptr_t)src;
    j.extra = (const int64_t *)(uintptr_t)extra;
    j.flips = (const uint8_t *)(uintptr_t)flips;
    j.dst = (char *)(uintptr_t)dst;
    j.nops = (int)PyTuple_GET_SIZE(ops);
    if (j.nops > MAX_OPS) {
        PyErr_Format(PyExc_ValueError, "at most %d ops", MAX_OPS);
        return NULL;
    }
    for (int k = 0; k < j.nops; k++) {
        unsigned long long first, second;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(ops, k), "iiKK", &j.ops[k].divide, &j.ops[k].vector, &first, &second))
            return NULL;
        j.ops[k].first = (const void *)(uintptr_t)first;
        j.ops[k].second = (const void *)(uintptr_t)second;
    }
    /* One unit a row (no flip axis planned, or one unit to reverse, which changes nothing):
     * the same job as rows of I values of one element each. */
    job_t one = j;
    const int whole_units = one.M == 1;
    if (whole_units) {
        one.M = one.I;
        one.I = 1;
        one.flips = NULL;
    }
    kernel_t rows = pick_rows(src_code, out_code, &one, whole_units);
    if (rows != NULL) {
        kernel = rows;
        j = one;
    }
    if (kernel == NULL) Py_RETURN_FALSE;
    RELEASE_GIL_IF_BIG((size_t)j.n * (size_t)(j.O * j.M * j.I) * value_bytes(out_code));
    GUARD_BEGIN();
    kernel(&j);
    GUARD_END();
    if (j.stream) stream_fence();
    TAKE_GIL_BACK();
    if (faulted_) return map_fault();
    Py_RETURN_TRUE;
}

#ifdef STOKER_X86
/* int8/uint8 -> float32 streamed, 16 values a step (W1's cast: the widest common case). */
#define DEFINE_BYTES_TO_F32(NAME, WIDEN)                                                 \
    __attribute__((target("avx2"))) static void NAME(const void *src, float *d, Py_ssize_t n) { \
        const uint8_t *s = (const uint8_t *)src;                                       \
        Py_ssize_t i = 0;                                                              \
        for (; i < n && ((uintptr_t)(d + i) & 31); i++) d[i] = (float)WIDEN##_SCALAR(s[i]); \
        for (; i + 16 <= n; i += 16) {                                                 \
            const __m128i v = _mm_loadu_si128((const __m128i *)(s + i));               \
            _mm256_stream_ps(d + i, _mm256_cvtepi32_ps(WIDEN(v)));                     \
            _mm256_stream_ps(d + i + 8, _mm256_cvtepi32_ps(WIDEN(_mm_srli_si128(v, 8)))); \
        }                                                                              \
        for (; i < n; i++) d[i] = (float)WIDEN##_SCALAR(s[i]);                         \
    }
#define I8_WIDEN(v) _mm256_cvtepi8_epi32(v)
#define I8_WIDEN_SCALAR(x) ((int8_t)(x))
#define U8_WIDEN(v) _mm256_cvtepu8_epi32(v)
#define U8_WIDEN_SCALAR(x) ((uint8_t)(x))
DEFINE_BYTES_TO_F32(i8_f32_avx2, I8_WIDEN)
DEFINE_BYTES_TO_F32(u8_f32_avx2, U8_WIDEN)

/* int16/uint16 -> float32 streamed, 16 values a step. */
#define DEFINE_SHORTS_TO_F32(NAME, T, WIDEN)                                             \
    __attribute__((target("avx2"))) static void NAME(const void *src, float *d, Py_ssize_t n) { \
        const T *s = (const T *)src;                                                   \
        Py_ssize_t i = 0;                                                              \
        for (; i < n && ((uintptr_t)(d + i) & 31); i++) d[i] = (float)s[i];            \
        for (; i + 16 <= n; i += 16) {                                                 \
            const __m128i a = _mm_loadu_si128((const __m128i *)(s + i));               \
            const __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 8));           \
            _mm256_stream_ps(d + i, _mm256_cvtepi32_ps(WIDEN(a)));                     \
            _mm256_stream_ps(d + i + 8, _mm256_cvtepi32_ps(WIDEN(b)));                 \
        }                                                                              \
        for (; i < n; i++) d[i] = (float)s[i];                                         \
    }
DEFINE_SHORTS_TO_F32(i16_f32_avx2, int16_t, _mm256_cvtepi16_epi32)
DEFINE_SHORTS_TO_F32(u16_f32_avx2, uint16_t, _mm256_cvtepu16_epi32)

/* Loads of 8 values as float32 (integers exact in it), for the 16-bit loops below. */
#define LOAD8_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LOAD8_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LOAD8_I16(p) _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define LOAD8_U16(p) _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define LOAD8_F32(p) _mm256_loadu_ps((const float *)(p))

/* -> float16 (mixed-precision training's cast), 8 values a step: F16C rounds each float32 to
 * the nearest float16, ties to even, as numpy's cast does (int16/uint16 values past 2048 round;
 * uint16 past 65519 becomes inf), where numpy converts one value at a time. Streamed (16-byte stores that skip the cache) when `stream`, as
 * the float32 loops. From float32 a quiet NaN keeps its sign and the top of its payload, as
 * numpy's cast; a signalling NaN comes out quiet, where numpy keeps it signalling, so that loop
 * serves values computed here, which are never signalling NaNs (computed_to_float16). */
#define DEFINE_TO_F16(NAME, T, LOAD8)                                                     \
    __attribute__((target("avx2,f16c"))) static void NAME(const void *src, uint16_t *d, Py_ssize_t n, int stream) { \
        const T *s = (const T *)src;                                                   \
        Py_ssize_t i = 0;                                                              \
        for (; i < n && ((uintptr_t)(d + i) & 15); i++) d[i] = _cvtss_sh((float)s[i], 0); \
        if (stream) {                                                                  \
            for (; i + 8 <= n; i += 8)                                                 \
                _mm_stream_si128((__m128i *)(d + i), _mm256_cvtps_ph(LOAD8(s + i), 0)); \
        } else {                                                                       \
            for (; i + 8 <= n; i += 8)                                                 \
                _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(LOAD8(s + i), 0)); \
        }                                                                              \
        for (; i < n; i++) d[i] = _cvtss_sh((float)s[i], 0);                           \
    }
DEFINE_TO_F16(i8_f16_f16c, int8_t, LOAD8_I8)
DEFINE_TO_F16(u8_f16_f16c, uint8_t, LOAD8_U8)
DEFINE_TO_F16(i16_f16_f16c, int16_t, LOAD8_I16)
DEFINE_TO_F16(u16_f16_f16c, uint16_t, LOAD8_U16)
DEFINE_TO_F16(f32_f16_f16c, float, LOAD8_F32)

/* The float16 loop for an integer source code, or NULL (no F16C, or not such a source). */
static void (*pick_f16(int src))(const void *, uint16_t *, Py_ssize_t, int) {
    if (!has_f16c()) return NULL;
    switch (src) {
    case 'b': return i8_f16_f16c;
    case 'B': return u8_f16_f16c;
    case 'h': return i16_f16_f16c;
    case 'H': return u16_f16_f16c;
    }
    return NULL;
}
#endif


/* Whether convert_run casts src_code into out_code (a plain copy when they are equal). */
static int converts(int src_code, int out_code) {
    if (src_code == out_code || pick(src_code, out_code) != NULL) return 1;
#ifdef STOKER_X86
    if (out_code == 'e' && pick_f16(src_code) != NULL) return 1;
#endif
    return 0;
}

/* n contiguous values of dtype src_code at src cast into dtype out_code at dst (numpy's C
 * casts: a float32 copy of an int8 is exact), or copied when the dtypes are equal; 0, or -1
 * with an exception set. */
static int convert_run(int src_code, int out_code, const char *src, char *dst, Py_ssize_t n, int stream) {
    if (src_code == out_code) {
        const size_t size = copy_size(src_code);
        if (size == 0) return -1;
        RELEASE_GIL_IF_BIG((size_t)n * size);
        GUARD_BEGIN();
        if (stream)
            stream_bytes(dst, src, (size_t)n * size);
        else
            memcpy(dst, src, (size_t)n * size);
        GUARD_END();
        if (stream) stream_fence();
        TAKE_GIL_BACK();
        return faulted_ ? (map_fault(), -1) : 0;
    }
#ifdef STOKER_X86
    if (out_code == 'e') {
        void (*half)(const void *, uint16_t *, Py_ssize_t, int) = pick_f16(src_code);
        if (half == NULL) {
            PyErr_Format(PyExc_ValueError, "no kernel from dtype %c to e", src_code);
            return -1;
        }
        RELEASE_GIL_IF_BIG((size_t)n * 2);
        GUARD_BEGIN();
        half(src, (uint16_t *)dst, n, stream);
        GUARD_END();
        if (stream) stream_fence();
        TAKE_GIL_BACK();
        return faulted_ ? (map_fault(), -1) : 0;
    }
#endif
    kernel_t kernel = pick_or_raise(src_code, out_code);
    if (kernel == NULL) return -1;
    RELEASE_GIL_IF_BIG((size_t)n * value_bytes(out_code));
    GUARD_BEGIN();
#ifdef STOKER_X86
    if (stream && out_code == 'f' && (src_code == 'b' || src_code == 'B') && has_avx2()) {
        (src_code == 'b' ? i8_f32_avx2 : u8_f32_avx2)(src, (float *)dst, n);
    } else if (stream && out_code == 'f' && (src_code == 'h' || src_code == 'H') && has_avx2()) {
        (src_code == 'h' ? i16_f32_avx2 : u16_f32_avx2)(src, (float *)dst, n);
    } else
#endif
    {
        job_t j = {0};
        j.src = src;
        j.n = 1, j.O = 1, j.M = n, j.I = 1;
        j.dst = dst;
        j.stream = stream;
        kernel(&j);
    }
    GUARD_END();
    if (stream) stream_fence();
    TAKE_GIL_BACK();
    return faulted_ ? (map_fault(), -1) : 0;
}

/* The dtype code of a buffer this file converts (native order, one of b B h H e f d), or 0. */
static int buffer_code(const Py_buffer *view) {
    const char *f = view->format;
    if (f == NULL) return 0;
    /* Native byte order, stated or not: numpy exports a dtype given as '<f4' (every Field of
     * byte_order="little") as "<f" even where that order is the machine's. */
#if PY_LITTLE_ENDIAN
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
#else
    if (f[0] == '>' || f[0] == '=' || f[0] == '@' || f[0] == '!') f++;
#endif
    if (f[0] == '\0' || f[1] != '\0') return 0;
    switch (f[0]) {
    case 'b': case 'B': case 'h': case 'H': case 'e': case 'f': case 'd':
        return (size_t)view->itemsize == copy_size(f[0]) ? f[0] : 0;
    }
    return 0;
}

/* cast_into(dst, src, stream_min_bytes) -> bool: copy and cast src into dst when both are
 * C-contiguous buffers of the same shape in dtypes with a kernel, dst writable (streamed when
 * dst holds at least stream_min_bytes). False, with nothing written, where it does not apply:
 * the caller falls back to numpy. One call, one buffer request per array, in place of the Python checks
 * and two __array_interface__ lookups that cost a worker a noticeable share of its time. */
static PyObject *cast_arrays(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dst_obj, *src_obj;
    Py_ssize_t stream_min;
    if (!PyArg_ParseTuple(args, "OOn", &dst_obj, &src_obj, &stream_min)) return NULL;
    Py_buffer d, s;
    if (PyObject_GetBuffer(dst_obj, &d, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    if (PyObject_GetBuffer(src_obj, &s, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&d);
        Py_RETURN_FALSE;
    }
    int ok = d.ndim == s.ndim;
    for (int i = 0; ok && i < d.ndim; i++) ok = d.shape[i] == s.shape[i];
    const int src_code = ok ? buffer_code(&s) : 0, out_code = ok ? buffer_code(&d) : 0;
    ok = src_code && out_code && converts(src_code, out_code);
    int rc = 0;
    if (ok && d.len > 0)
        rc = convert_run(src_code, out_code, (const char *)s.buf, (char *)d.buf, s.len / s.itemsize,
                         d.len >= stream_min);
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    if (rc < 0) return NULL;
    return PyBool_FromLong(ok);
}

/* willneed_records(fds, offsets, length): POSIX_FADV_WILLNEED on records of `length` bytes,
 * record k at offset offsets[k] of file fds[k] (int64 buffers of one length; a record that
 * follows the one before in the same file shares its call), the GIL given up for the system
 * calls: the disk is asked for all of a batch's records, of every file, at once instead of one
 * page fault at a time. Advice only: returns how many calls failed. */
static PyObject *willneed_records(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer fds, offsets;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "y*y*n", &fds, &offsets, &length)) return NULL;
    PyObject *result = NULL;
    if (length < 0 || fds.len != offsets.len || fds.len % 8) {
        PyErr_SetString(PyExc_ValueError, "willneed_records: negative length, or fds and offsets differ in length");
    } else {
        const int64_t *fd = (const int64_t *)fds.buf, *off = (const int64_t *)offsets.buf;
        const Py_ssize_t n = offsets.len / 8;
        Py_ssize_t failed = 0;
        RELEASE_GIL_IF_BIG(GIL_FREE_BYTES);
        for (Py_ssize_t k = 0; k < n;) {
            const int64_t f = fd[k], start = off[k];
            int64_t end = start + length;
            for (k++; k < n && fd[k] == f && off[k] == end; k++) end += length;
            if (posix_fadvise((int)f, start, end - start, POSIX_FADV_WILLNEED) != 0) failed++;
        }
        TAKE_GIL_BACK();
        result = PyLong_FromSsize_t(failed);
    }
    PyBuffer_Release(&fds);
    PyBuffer_Release(&offsets);
    return result;
}

/* The fastest loop this CPU has from dtype code src (b B h H f) into bfloat16, or NULL. */
typedef void (*bf16_loop_t)(const void *, uint16_t *, Py_ssize_t);
static bf16_loop_t pick_bf16(int src);
static void widen_bf16(const uint16_t *s, uint32_t *d, Py_ssize_t n, int stream);

/* Entry k, cnt[k] records (1 each where cnt is NULL) of elems values of dtype src_code lying back
 * to back from memory address addr[k], cast or copied into rows row[k].. of dst (dtype out_code):
 * gathers, one pass, no staging array (the body of gather_records and gather_runs). An entry of
 * many records goes to the loop in one call, which is faster than record by record (measured:
 * benchmarks/results/w1_history.md). */
static PyObject *gather_at(int src_code, int out_code, const int64_t *addr, const int64_t *row, const int64_t *cnt,
                           Py_ssize_t n, Py_ssize_t elems, uintptr_t dst, int stream) {
    Py_ssize_t records = n;
    if (cnt != NULL) {
        records = 0;
        for (Py_ssize_t k = 0; k < n; k++) records += (Py_ssize_t)cnt[k];
    }
#define ENTRY_VALUES(k) (elems * (cnt != NULL ? (Py_ssize_t)cnt[k] : 1))
    if (out_code == 'E') { /* ml_dtypes' bfloat16 (its type code; numpy has none of its own) */
        bf16_loop_t loop = pick_bf16(src_code);
        if (loop == NULL) {
            PyErr_Format(PyExc_ValueError, "no bfloat16 kernel from dtype %c", src_code);
            return NULL;
        }
        RELEASE_GIL_IF_BIG((size_t)records * (size_t)elems * 2);
        GUARD_BEGIN();
        for (Py_ssize_t k = 0; k < n; k++)
            loop((const char *)(uintptr_t)addr[k], (uint16_t *)(uintptr_t)dst + (size_t)row[k] * (size_t)elems,
                 ENTRY_VALUES(k));
        GUARD_END();
        TAKE_GIL_BACK();
        if (faulted_) return map_fault();
        Py_RETURN_NONE;
    }
    if (src_code == 'E' && out_code == 'f') { /* bfloat16 records widened into float32 (see bf16_f32) */
        RELEASE_GIL_IF_BIG((size_t)records * (size_t)elems * 4);
        GUARD_BEGIN();
        for (Py_ssize_t k = 0; k < n; k++)
            widen_bf16((const uint16_t *)((const char *)(uintptr_t)addr[k]),
                       (uint32_t *)(uintptr_t)dst + (size_t)row[k] * (size_t)elems, ENTRY_VALUES(k), stream);
        GUARD_END();
        if (stream) stream_fence();
        TAKE_GIL_BACK();
        if (faulted_) return map_fault();
        Py_RETURN_NONE;
    }
#ifdef STOKER_X86
    if (out_code == 'e' && src_code != 'e') { /* integers into float16: the F16C loop, record by record */
        void (*half)(const void *, uint16_t *, Py_ssize_t, int) = pick_f16(src_code);
        if (half == NULL) {
            PyErr_Format(PyExc_ValueError, "no kernel from dtype %c to e", src_code);
            return NULL;
        }
        RELEASE_GIL_IF_BIG((size_t)records * (size_t)elems * 2);
        GUARD_BEGIN();
        for (Py_ssize_t k = 0; k < n; k++)
            half((const char *)(uintptr_t)addr[k], (uint16_t *)(uintptr_t)dst + (size_t)row[k] * (size_t)elems,
                 ENTRY_VALUES(k), stream);
        GUARD_END();
        if (stream) stream_fence();
        TAKE_GIL_BACK();
        if (faulted_) return map_fault();
        Py_RETURN_NONE;
    }
#endif
    if (src_code == out_code) {
        const size_t size = copy_size(src_code);
        if (size == 0) return NULL;
        const size_t rec = size * (size_t)elems;
        RELEASE_GIL_IF_BIG((size_t)records * rec);
        GUARD_BEGIN();
        for (Py_ssize_t k = 0; k < n; k++) {
            char *d = (char *)(uintptr_t)dst + (size_t)row[k] * rec;
            const char *s = (const char *)(uintptr_t)addr[k];
            const size_t bytes = size * (size_t)ENTRY_VALUES(k);
            if (stream)
                stream_bytes(d, s, bytes);
            else
                memcpy(d, s, bytes);
        }
        GUARD_END();
        if (stream) stream_fence();
        TAKE_GIL_BACK();
        if (faulted_) return map_fault();
        Py_RETURN_NONE;
    }
    kernel_t kernel = pick_or_raise(src_code, out_code);
    if (kernel == NULL) return NULL;
#ifdef STOKER_X86
    /* 8/16-bit integers into float32, streamed: convert_run's direct loop, record by record,
     * where the general kernel converts each block into L1 and streams it out from there. */
    void (*wide)(const void *, float *, Py_ssize_t) = NULL;
    if (stream && out_code == 'f' && has_avx2())
        wide = src_code == 'b' ? i8_f32_avx2 : src_code == 'B' ? u8_f32_avx2
             : src_code == 'h' ? i16_f32_avx2 : src_code == 'H' ? u16_f32_avx2 : NULL;
    if (wide != NULL) {
        RELEASE_GIL_IF_BIG((size_t)records * (size_t)elems * 4);
        GUARD_BEGIN();
        for (Py_ssize_t k = 0; k < n; k++)
            wide((const char *)(uintptr_t)addr[k], (float *)(uintptr_t)dst + (size_t)row[k] * (size_t)elems,
                 ENTRY_VALUES(k));
        GUARD_END();
        stream_fence();
        TAKE_GIL_BACK();
        if (faulted_) return map_fault();
        Py_RETURN_NONE;
    }
#endif
    /* The general kernels take a record at a time: an entry of many records is spelled out. */
    int64_t *each_addr = NULL, *each_row = NULL;
    if (cnt != NULL) {
        each_addr = PyMem_Malloc(sizeof(int64_t) * (size_t)(records ? records : 1));
        each_row = PyMem_Malloc(sizeof(int64_t) * (size_t)(records ? records : 1));
        if (each_addr == NULL || each_row == NULL) {
            PyMem_Free(each_addr);
            PyMem_Free(each_row);
            return PyErr_NoMemory();
        }
        const int64_t rec = (int64_t)(value_bytes(src_code) * (size_t)elems);
        Py_ssize_t at = 0;
        for (Py_ssize_t k = 0; k < n; k++)
            for (int64_t i = 0; i < cnt[k]; i++, at++) {
                each_addr[at] = addr[k] + i * rec;
                each_row[at] = row[k] + i;
            }
        addr = each_addr, row = each_row;
    }
    job_t j = {0};
    j.src = NULL; /* each record's address is whole in j.extra */
    j.n = records, j.O = 1, j.M = elems, j.I = 1;
    j.extra = addr;
    j.rows = row;
    j.dst = (char *)(uintptr_t)dst;
    j.stream = stream;
    int faulted = 0;
    {
        RELEASE_GIL_IF_BIG((size_t)records * (size_t)elems * value_bytes(out_code));
        GUARD_BEGIN();
        kernel(&j);
        GUARD_END();
        if (stream) stream_fence();
        TAKE_GIL_BACK();
        faulted = faulted_;
    }
    PyMem_Free(each_addr);
    PyMem_Free(each_row);
    if (faulted) return map_fault();
    Py_RETURN_NONE;
#undef ENTRY_VALUES
}

/* gather_records(src, out, dst, rows, addresses, stream): record k (the values at memory
 * address addresses[k]) cast or copied into row rows[k] of dst, a C-contiguous array of rows;
 * rows and addresses int64 buffers of one length, every row checked against dst here (numpy's
 * min and max and three address lookups cost more than the checks). */
static PyObject *gather_records(PyObject *self, PyObject *args) {
    (void)self;
    int src_code, out_code, stream;
    Py_ssize_t nrows;
    Py_buffer dst, rows, addresses;
    if (!PyArg_ParseTuple(args, "CCw*ny*y*p", &src_code, &out_code, &dst, &nrows, &rows, &addresses, &stream))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = rows.len / 8;
    if (nrows <= 0 || dst.len % nrows || rows.len % 8 || addresses.len != rows.len) {
        PyErr_SetString(PyExc_ValueError, "gather_records: rows and addresses differ in length, or dst has no rows");
        goto done;
    }
    const int64_t *row = (const int64_t *)rows.buf;
    for (Py_ssize_t k = 0; k < n; k++)
        if (row[k] < 0 || row[k] >= nrows) {
            PyErr_Format(PyExc_IndexError, "gather: row %lld outside the %zd rows of the output", (long long)row[k], nrows);
            goto done;
        }
    const size_t size = value_bytes(out_code);
    if (size == 0 || (size_t)(dst.len / nrows) % size) {
        PyErr_Format(PyExc_ValueError, "gather_records: no output dtype %c, or rows of a partial value", out_code);
        goto done;
    }
    result = gather_at(src_code, out_code, (const int64_t *)addresses.buf, row, NULL, n,
                       (Py_ssize_t)((size_t)(dst.len / nrows) / size), (uintptr_t)dst.buf, stream);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&addresses);
    return result;
}

/* gather_runs(src, out, dst, nrows, runs, stream): runs an int64 buffer of (row, address,
 * count, stride) per run: count records, the first at memory address address and each stride
 * bytes after the one before, cast or copied into rows row.. of dst (as gather_records does
 * record by record). A batch of many short runs (small files) is one call, with no per-record
 * arrays to build in Python; every run's rows are checked against dst here. */
static PyObject *gather_runs(PyObject *self, PyObject *args) {
    (void)self;
    int src_code, out_code, stream;
    Py_ssize_t nrows;
    Py_buffer dst, runs;
    if (!PyArg_ParseTuple(args, "CCw*ny*p", &src_code, &out_code, &dst, &nrows, &runs, &stream)) return NULL;
    PyObject *result = NULL;
    int64_t *addr = NULL, *row = NULL, *cnt = NULL;
    const int64_t *run = (const int64_t *)runs.buf;
    const Py_ssize_t nruns = runs.len / 32;
    const size_t size = value_bytes(out_code);
    if (nrows <= 0 || dst.len % nrows || runs.len % 32 || size == 0 || (size_t)(dst.len / nrows) % size) {
        PyErr_Format(PyExc_ValueError, "gather_runs: runs not (row, address, count, stride) int64s, dst without "
                     "rows, or no output dtype %c", out_code);
        goto done;
    }
    const Py_ssize_t elems = (Py_ssize_t)((size_t)(dst.len / nrows) / size);
    const int64_t rec = (int64_t)(value_bytes(src_code) * (size_t)elems);
    Py_ssize_t total = 0;
    int back_to_back = 1; /* every run's records one after the other: each run is one entry */
    for (Py_ssize_t k = 0; k < nruns; k++) {
        const int64_t r = run[4 * k], c = run[4 * k + 2];
        if (c < 0 || r < 0 || r > (int64_t)nrows - c) {
            PyErr_Format(PyExc_IndexError, "gather: rows %lld..%lld outside the %zd rows of the output", (long long)r,
                         (long long)(r + c - 1), nrows);
            goto done;
        }
        total += (Py_ssize_t)c;
        back_to_back &= c < 2 || run[4 * k + 3] == rec;
    }
    const Py_ssize_t entries = back_to_back ? nruns : total;
    addr = PyMem_Malloc(sizeof(int64_t) * (size_t)(entries ? entries : 1));
    row = PyMem_Malloc(sizeof(int64_t) * (size_t)(entries ? entries : 1));
    cnt = back_to_back ? PyMem_Malloc(sizeof(int64_t) * (size_t)(entries ? entries : 1)) : NULL;
    if (addr == NULL || row == NULL || (back_to_back && cnt == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t k = 0; k < nruns; k++) {
        if (back_to_back) {
            row[k] = run[4 * k], addr[k] = run[4 * k + 1], cnt[k] = run[4 * k + 2];
            continue;
        }
        for (int64_t i = 0; i < run[4 * k + 2]; i++, at++) {
            row[at] = run[4 * k] + i;
            addr[at] = run[4 * k + 1] + i * run[4 * k + 3];
        }
    }
    result = total ? gather_at(src_code, out_code, addr, row, cnt, entries, elems, (uintptr_t)dst.buf, stream)
                   : (Py_INCREF(Py_None), Py_None);
done:
    PyMem_Free(addr);
    PyMem_Free(row);
    PyMem_Free(cnt);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&runs);
    return result;
}

/* The bfloat16 nearest a float32, ties to even; a NaN becomes the quiet NaN of its sign: as
 * ml_dtypes' cast gives, bit for bit, for every float32 (and so for every integer below 2^24). */
static inline uint16_t bf16_of(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if (f != f) return (uint16_t)(((b >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

#define DEFINE_TO_BF16(NAME, T)                                                   \
    static void NAME(const void *src, uint16_t *d, Py_ssize_t n) {              \
        const T *s = (const T *)src;                                            \
        for (Py_ssize_t i = 0; i < n; i++) d[i] = bf16_of((float)s[i]);         \
    }
DEFINE_TO_BF16(i8_bf16, int8_t)
DEFINE_TO_BF16(u8_bf16, uint8_t)
DEFINE_TO_BF16(i16_bf16, int16_t)
DEFINE_TO_BF16(u16_bf16, uint16_t)
DEFINE_TO_BF16(f32_bf16, float)

#ifdef STOKER_X86
/* bf16_of on 8 values: rounded in the integer unit, NaNs blended in where the source can hold
 * them (`nans`, a constant: integer sources, which cannot hold NaNs, skip the compare and blend),
 * the high halves packed. */
__attribute__((target("avx2"))) static inline __m128i bf16x8(__m256 v, int nans) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    if (nans) {
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256i quiet = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u)),
                                              _mm256_set1_epi32(0x7fc00000));
        r = _mm256_blendv_epi8(r, quiet, nan);
    }
    r = _mm256_srli_epi32(r, 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* Ordinary stores, unlike the float16 and float32 loops: streamed ones (16-byte stores, or four
 * filling a 64-byte line before the next) ran this loop slower from the files' memory maps
 * (measured: benchmarks/results/transforms_history.md). */
#define DEFINE_TO_BF16_AVX2(NAME, T, LOAD8, NANS)                                        \
    __attribute__((target("avx2"))) static void NAME(const void *src, uint16_t *d, Py_ssize_t n) { \
        const T *s = (const T *)src;                                                   \
        Py_ssize_t i = 0;                                                              \
        for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(d + i), bf16x8(LOAD8(s + i), NANS)); \
        for (; i < n; i++) d[i] = bf16_of((float)s[i]);                                \
    }
DEFINE_TO_BF16_AVX2(i8_bf16_avx2, int8_t, LOAD8_I8, 0)
DEFINE_TO_BF16_AVX2(u8_bf16_avx2, uint8_t, LOAD8_U8, 0)
DEFINE_TO_BF16_AVX2(i16_bf16_avx2, int16_t, LOAD8_I16, 0)
DEFINE_TO_BF16_AVX2(u16_bf16_avx2, uint16_t, LOAD8_U16, 0)
DEFINE_TO_BF16_AVX2(f32_bf16_avx2, float, LOAD8_F32, 1)

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11)
#define STOKER_AVX512BF16 1
/* Integers into bfloat16 by the CPU's own conversion (AVX512_BF16's vcvtneps2bf16: nearest,
 * ties to even, the same bits as bf16_of for every value an integer gives; it differs only on
 * NaNs and float32 subnormals, so float32 sources keep the loop above). */
#define DEFINE_TO_BF16_NE(NAME, T, LOAD8)                                                  \
    __attribute__((target("avx2,avx512f,avx512vl,avx512bf16"))) static void NAME(const void *src, uint16_t *d, Py_ssize_t n) { \
        const T *s = (const T *)src;                                                     \
        Py_ssize_t i = 0;                                                                \
        for (; i + 8 <= n; i += 8) {                                                     \
            const __m128bh h = _mm256_cvtneps_pbh(LOAD8(s + i));                         \
            _mm_storeu_si128((__m128i *)(d + i), (__m128i)h);                            \
        }                                                                                \
        for (; i < n; i++) d[i] = bf16_of((float)s[i]);                                  \
    }
DEFINE_TO_BF16_NE(i8_bf16_ne, int8_t, LOAD8_I8)
DEFINE_TO_BF16_NE(u8_bf16_ne, uint8_t, LOAD8_U8)
DEFINE_TO_BF16_NE(i16_bf16_ne, int16_t, LOAD8_I16)
DEFINE_TO_BF16_NE(u16_bf16_ne, uint16_t, LOAD8_U16)
#endif
#endif

#ifdef STOKER_X86
/* The commonest fused chain by hand: records of rows of M values (one value per unit, M a
 * multiple of 8), one Normalize op with one mean/std or scale/offset (or, in rows never
 * reversed, a parameter per value of the row: per-channel Normalize of a record with no flip,
 * one row per record), each row optionally reversed (RandomFlip along W), 8 values a step
 * written straight into the batch, streamed when asked (the rows of a record are contiguous
 * there). The generic kernel builds each
 * block in L1 and copies it out, about twice the plain cast's time, where this loop runs near
 * it (measured: benchmarks/results/normalize_kernel_history.md). The same IEEE
 * operations in the same order ((x - mean) / std, or x * scale + offset, never fused), so the
 * same bits. A trailing Cast to float16 or bfloat16 narrows each 8 values in registers (F16C;
 * bf16x8, ml_dtypes' rounding and NaNs) instead of through a float32 scratch: the values are
 * computed, never signalling NaNs, so F16C rounds them as numpy does (see computed_to_float16).
 * bfloat16 rows are not streamed (see DEFINE_TO_BF16_AVX2). */
/* One Normalize op on 8 values: (v - f) / g, or v * f + g (two roundings, never fused). */
__attribute__((target("avx2"))) static inline __m256 norm8(__m256 v, __m256 f, __m256 g, int divide) {
    return divide ? _mm256_div_ps(_mm256_sub_ps(v, f), g) : _mm256_add_ps(_mm256_mul_ps(v, f), g);
}

#define STORE_F32(d, v, stream) ((stream) ? _mm256_stream_ps((d), (v)) : _mm256_storeu_ps((d), (v)))
#define STORE_F16(d, v, stream)                                                          \
    ((stream) ? _mm_stream_si128((__m128i *)(d), _mm256_cvtps_ph((v), 0))                \
              : _mm_storeu_si128((__m128i *)(d), _mm256_cvtps_ph((v), 0)))
#define STORE_BF16(d, v, stream) ((void)(stream), _mm_storeu_si128((__m128i *)(d), bf16x8((v), 1)))
/* bfloat16 from values that cannot be NaN (integer records, finite parameters, no zero std):
 * no NaN compare and blend, as in the integer cast loops. */
#define STORE_BF16_NO_NAN(d, v, stream) ((void)(stream), _mm_storeu_si128((__m128i *)(d), bf16x8((v), 0)))
#define DEFINE_ROWS(NAME, TARGET, T, LOAD8, D, STORE)                                    \
    __attribute__((target(TARGET))) static void NAME(const job_t *j) {                  \
        const Py_ssize_t O = j->O, M = j->M;                                            \
        const op_t *op = &j->ops[0];                                                   \
        const float *F = (const float *)op->first, *G = (const float *)op->second;     \
        const __m256 f1 = _mm256_set1_ps(F[0]), g1 = _mm256_set1_ps(G[0]);            \
        const __m256i rev = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);                 \
        const int divide = op->divide, stream = j->stream, vector = op->vector;        \
        for (Py_ssize_t r = 0; r < j->n; r++) {                                        \
            const char *rec = j->src + r * j->rec_stride + (j->extra ? j->extra[r] : 0); \
            const int flip = j->flips ? j->flips[r] : 0;                               \
            D *drec = (D *)j->dst + (j->rows ? j->rows[r] : r) * O * M;                \
            for (Py_ssize_t o = 0; o < O; o++) {                                       \
                const T *s = (const T *)(rec + o * j->row_stride);                     \
                D *d = drec + o * M;                                                   \
                for (Py_ssize_t i = 0; i < M; i += 8) {                                \
                    const __m256 v = flip ? _mm256_permutevar8x32_ps(LOAD8(s + M - 8 - i), rev) : LOAD8(s + i); \
                    const __m256 f = vector ? _mm256_loadu_ps(F + i) : f1;             \
                    const __m256 g = vector ? _mm256_loadu_ps(G + i) : g1;             \
                    STORE(d + i, norm8(v, f, g, divide), stream);                      \
                }                                                                      \
            }                                                                          \
        }                                                                              \
    }
#define DEFINE_ROWS_ALL(SRC, T, LOAD8)                                                     \
    DEFINE_ROWS(rows_##SRC##_f32, "avx2", T, LOAD8, float, STORE_F32)                    \
    DEFINE_ROWS(rows_##SRC##_f16, "avx2,f16c", T, LOAD8, uint16_t, STORE_F16)            \
    DEFINE_ROWS(rows_##SRC##_bf16, "avx2", T, LOAD8, uint16_t, STORE_BF16)               \
    DEFINE_ROWS(rows_##SRC##_bf16i, "avx2", T, LOAD8, uint16_t, STORE_BF16_NO_NAN)
DEFINE_ROWS_ALL(i8, int8_t, LOAD8_I8)
DEFINE_ROWS_ALL(u8, uint8_t, LOAD8_U8)
DEFINE_ROWS_ALL(i16, int16_t, LOAD8_I16)
DEFINE_ROWS_ALL(u16, uint16_t, LOAD8_U16)
DEFINE_ROWS_ALL(f32, float, LOAD8_F32)

/* Rows of M units of I > 1 values (RGB frames flipped along W), one Normalize op, float32
 * out: each row computed front to back into an L1 buffer, 8 values a step, with the
 * parameters tiled along the row once per call, then its units copied out in reverse order
 * where the record is flipped. The generic kernel goes unit by unit, many times the plain
 * cast's time (measured: benchmarks/results/normalize_kernel_history.md). */
#define UNITS_MAX 4096 /* values in a row: 16 KiB of float32 */

/* Reversing the order of units of I values (I <= 8), a block of lcm(8, I) values (U units,
 * V vectors) at a time: dst vector v lane l takes src vector src_vec[v][l] lane idx[v][l]. */
typedef struct {
    int U, V;
    __m256i idx[8];
    __m256i from[8][8]; /* lanes of dst vector v taken from src vector w: all ones */
} reversal_t;

__attribute__((target("avx2"))) static void plan_reversal(reversal_t *rv, Py_ssize_t I) {
    int P = 8;
    while (I <= 8 && P % I) P += 8;
    rv->V = I <= 8 ? P / 8 : 0;
    rv->U = I <= 8 ? P / (int)I : 0;
    for (int v = 0; v < rv->V; v++) {
        int idx[8], w_of[8];
        for (int l = 0; l < 8; l++) {
            const int t = 8 * v + l, k = t / (int)I, c = t % (int)I, src = (int)I * (rv->U - 1 - k) + c;
            idx[l] = src % 8;
            w_of[l] = src / 8;
        }
        rv->idx[v] = _mm256_setr_epi32(idx[0], idx[1], idx[2], idx[3], idx[4], idx[5], idx[6], idx[7]);
        for (int w = 0; w < rv->V; w++) {
            int m[8];
            for (int l = 0; l < 8; l++) m[l] = w_of[l] == w ? -1 : 0;
            rv->from[v][w] = _mm256_setr_epi32(m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]);
        }
    }
}

/* d = the M units of I values in row, in reverse order. */
__attribute__((target("avx2"))) static void reverse_units(const float *row, float *d, Py_ssize_t M, Py_ssize_t I,
                                                          const reversal_t *rv) {
    Py_ssize_t m = 0;
    for (; rv->V && m + rv->U <= M; m += rv->U) { /* units m .. m+U-1 go to M-m-U .. M-m-1, reversed */
        __m256 S[8];
        for (int w = 0; w < rv->V; w++) S[w] = _mm256_loadu_ps(row + m * I + 8 * w);
        float *out = d + (M - m - rv->U) * I;
        for (int v = 0; v < rv->V; v++) {
            __m256 acc = _mm256_setzero_ps();
            for (int w = 0; w < rv->V; w++)
                acc = _mm256_blendv_ps(acc, _mm256_permutevar8x32_ps(S[w], rv->idx[v]), _mm256_castsi256_ps(rv->from[v][w]));
            _mm256_storeu_ps(out + 8 * v, acc);
        }
    }
    for (; m < M; m++) memcpy(d + (M - 1 - m) * I, row + m * I, (size_t)I * sizeof(float));
}
#define DEFINE_UNITS_F32(NAME, T, LOAD8)                                                 \
    __attribute__((target("avx2"))) static void NAME(const job_t *j) {                  \
        const Py_ssize_t O = j->O, M = j->M, I = j->I, L = M * I;                      \
        const op_t *op = &j->ops[0];                                                   \
        const float *F = (const float *)op->first, *G = (const float *)op->second;     \
        float tf[UNITS_MAX] STOKER_ALIGNED, tg[UNITS_MAX] STOKER_ALIGNED, row[UNITS_MAX] STOKER_ALIGNED; \
        for (Py_ssize_t k = 0; k < L; k++) {                                           \
            tf[k] = op->vector ? F[k % I] : F[0];                                      \
            tg[k] = op->vector ? G[k % I] : G[0];                                      \
        }                                                                              \
        const int divide = op->divide;                                                 \
        reversal_t rv;                                                                 \
        plan_reversal(&rv, I);                                                         \
        for (Py_ssize_t r = 0; r < j->n; r++) {                                        \
            const char *rec = j->src + r * j->rec_stride + (j->extra ? j->extra[r] : 0); \
            const int flip = j->flips ? j->flips[r] : 0;                               \
            float *drec = (float *)j->dst + (j->rows ? j->rows[r] : r) * O * L;        \
            for (Py_ssize_t o = 0; o < O; o++) {                                       \
                const T *s = (const T *)(rec + o * j->row_stride);                     \
                float *d = drec + o * L, *x = flip ? row : d;                          \
                Py_ssize_t i = 0;                                                      \
                for (; i + 8 <= L; i += 8) {                                           \
                    _mm256_storeu_ps(x + i, norm8(LOAD8(s + i), _mm256_load_ps(tf + i), _mm256_load_ps(tg + i), divide)); \
                }                                                                      \
                for (; i < L; i++) {                                                   \
                    const float v = (float)s[i];                                       \
                    x[i] = divide ? (v - tf[i]) / tg[i] : v * tf[i] + tg[i];           \
                }                                                                      \
                if (flip) reverse_units(row, d, M, I, &rv);                            \
            }                                                                          \
        }                                                                              \
    }
DEFINE_UNITS_F32(units_i8_f32, int8_t, LOAD8_I8)
DEFINE_UNITS_F32(units_u8_f32, uint8_t, LOAD8_U8)
DEFINE_UNITS_F32(units_i16_f32, int16_t, LOAD8_I16)
DEFINE_UNITS_F32(units_u16_f32, uint16_t, LOAD8_U16)
DEFINE_UNITS_F32(units_f32_f32, float, LOAD8_F32)
#endif

/* Whether job j's one op can give no NaN from a finite value: finite parameters and, to
 * divide, a std that is not zero ((x - mean) / 0 is NaN at x == mean). */
static int gives_no_nan(const job_t *j) {
    const op_t *op = &j->ops[0];
    const float *f = (const float *)op->first, *g = (const float *)op->second;
    for (Py_ssize_t i = 0; i < (op->vector ? j->M : 1); i++)
        if (!isfinite(f[i]) || !isfinite(g[i]) || (op->divide && g[i] == 0.0f)) return 0;
    return 1;
}

/* The hand-written row kernel for job j where it applies, else NULL (the generic kernel; for
 * float16 ('e') and bfloat16 ('E') outputs, the caller's float32 scratch). `whole_units`: each
 * row is one whole unit, so a parameter vector (one value per element of a unit) lines up with
 * the row. */
static kernel_t pick_rows(int src, int out, const job_t *j, int whole_units) {
#ifdef STOKER_X86
    if (j->nops == 1 && j->I > 1 && j->M * j->I <= UNITS_MAX && out == 'f' && has_avx2()) {
        switch (src) {
        case 'b': return units_i8_f32;
        case 'B': return units_u8_f32;
        case 'h': return units_i16_f32;
        case 'H': return units_u16_f32;
        case 'f': return units_f32_f32;
        }
    }
    if (j->nops != 1 || (j->ops[0].vector && !whole_units) || j->I != 1 || j->M < 8 || j->M % 8 != 0) return NULL;
    if (j->stream && ((uintptr_t)j->dst & 31) != 0) return NULL; /* streamed stores need aligned rows */
    if (!has_avx2() || (out == 'e' && !has_f16c())) return NULL;
    const int exact_ints = src != 'f' && gives_no_nan(j); /* integers, exact in float32, are finite */
#define ROWS_BY_OUT(SRC)                                                                   \
    return out == 'f' ? rows_##SRC##_f32 : out == 'e' ? rows_##SRC##_f16                   \
         : out == 'E' ? (exact_ints ? rows_##SRC##_bf16i : rows_##SRC##_bf16) : NULL
    switch (src) {
    case 'b': ROWS_BY_OUT(i8);
    case 'B': ROWS_BY_OUT(u8);
    case 'h': ROWS_BY_OUT(i16);
    case 'H': ROWS_BY_OUT(u16);
    case 'f': ROWS_BY_OUT(f32);
    }
#undef ROWS_BY_OUT
#else
    (void)src, (void)out, (void)j, (void)whole_units;
#endif
    return NULL;
}

static bf16_loop_t pick_bf16(int src_code) {
    bf16_loop_t loop = NULL;
    switch (src_code) {
    case 'b': loop = i8_bf16; break;
    case 'B': loop = u8_bf16; break;
    case 'h': loop = i16_bf16; break;
    case 'H': loop = u16_bf16; break;
    case 'f': loop = f32_bf16; break;
    }
#ifdef STOKER_X86
    if (has_avx2()) {
        switch (src_code) {
        case 'b': loop = i8_bf16_avx2; break;
        case 'B': loop = u8_bf16_avx2; break;
        case 'h': loop = i16_bf16_avx2; break;
        case 'H': loop = u16_bf16_avx2; break;
        case 'f': loop = f32_bf16_avx2; break;
        }
    }
#ifdef STOKER_AVX512BF16
    if (has_bf16ne()) {
        switch (src_code) {
        case 'b': loop = i8_bf16_ne; break;
        case 'B': loop = u8_bf16_ne; break;
        case 'h': loop = i16_bf16_ne; break;
        case 'H': loop = u16_bf16_ne; break;
        }
    }
#endif
#endif
    return loop;
}

/* bfloat16(src_code, src_addr, n, dst_addr): n values of dtype src_code (b B h H f) into
 * bfloat16, as ml_dtypes' cast (see bf16_of). The caller checks the arrays: numpy exports no
 * buffer for ml_dtypes' bfloat16, so cast_into cannot (stoker.kernels.cast_into for integer
 * and float32 records; the transforms' scratch goes through it too). */
static PyObject *to_bfloat16(PyObject *self, PyObject *args) {
    (void)self;
    int src_code;
    unsigned long long src, dst;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "CKnK", &src_code, &src, &n, &dst)) return NULL;
    bf16_loop_t loop = pick_bf16(src_code);
    if (loop == NULL || n < 0) {
        PyErr_Format(PyExc_ValueError, "no bfloat16 kernel from dtype %c (n=%zd)", src_code, n);
        return NULL;
    }
    RELEASE_GIL_IF_BIG((size_t)n * 2);
    GUARD_BEGIN();
    loop((const void *)(uintptr_t)src, (uint16_t *)(uintptr_t)dst, n);
    GUARD_END();
    TAKE_GIL_BACK();
    if (faulted_) return map_fault();
    Py_RETURN_NONE;
}

/* bfloat16 records into float32: exact, each value's 16 bits become the float32's top half
 * (NaN payloads and signs kept, as ml_dtypes' cast does). ml_dtypes converts one value at a
 * time through its own loop. Streamed where the output is a batch (see cast_into). */
static void bf16_f32(const uint16_t *s, uint32_t *d, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
}
#ifdef STOKER_X86
__attribute__((target("avx2"))) static void bf16_f32_avx2(const uint16_t *s, uint32_t *d, Py_ssize_t n, int stream) {
    Py_ssize_t i = 0;
    while (i < n && ((uintptr_t)(d + i) & 31)) i++;
    bf16_f32(s, d, i); /* to an aligned output */
    for (; i + 16 <= n; i += 16) {
        const __m256i a = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i))), 16);
        const __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i + 8))), 16);
        if (stream) {
            _mm256_stream_si256((__m256i *)(d + i), a);
            _mm256_stream_si256((__m256i *)(d + i + 8), b);
        } else {
            _mm256_store_si256((__m256i *)(d + i), a);
            _mm256_store_si256((__m256i *)(d + i + 8), b);
        }
    }
    bf16_f32(s + i, d + i, n - i);
}
#endif

/* The widest of the two loops this CPU may run (see set_isa); the caller fences a streamed one. */
static void widen_bf16(const uint16_t *s, uint32_t *d, Py_ssize_t n, int stream) {
#ifdef STOKER_X86
    if (has_avx2()) {
        bf16_f32_avx2(s, d, n, stream);
        return;
    }
#endif
    bf16_f32(s, d, n);
}

/* from_bfloat16(src_addr, n, dst_addr, stream): n bfloat16 values into float32 (see bf16_f32). */
static PyObject *from_bfloat16(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long src, dst;
    Py_ssize_t n;
    int stream;
    if (!PyArg_ParseTuple(args, "KnKp", &src, &n, &dst, &stream)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "negative count");
        return NULL;
    }
    RELEASE_GIL_IF_BIG((size_t)n * 4);
    GUARD_BEGIN();
    widen_bf16((const uint16_t *)(uintptr_t)src, (uint32_t *)(uintptr_t)dst, n, stream);
    GUARD_END();
    if (stream) stream_fence();
    TAKE_GIL_BACK();
    if (faulted_) return map_fault();
    Py_RETURN_NONE;
}

/* computed_to_float16(src_addr, n, dst_addr, stream) -> bool: n float32 values computed by
 * stoker (never signalling NaNs) into float16, by F16C; False, with nothing written, where the
 * build or the CPU has no F16C. The transforms' one-pass kernel computes in float32 and narrows
 * its scratch with this: numpy converts one value at a time. */
static PyObject *computed_to_float16(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long src, dst;
    Py_ssize_t n;
    int stream;
    if (!PyArg_ParseTuple(args, "KnKp", &src, &n, &dst, &stream)) return NULL;
#ifdef STOKER_X86
    if (n >= 0 && has_f16c()) {
        RELEASE_GIL_IF_BIG((size_t)n * 2);
        f32_f16_f16c((const void *)(uintptr_t)src, (uint16_t *)(uintptr_t)dst, n, stream);
        if (stream) stream_fence();
        TAKE_GIL_BACK();
        Py_RETURN_TRUE;
    }
#else
    (void)src, (void)dst, (void)n, (void)stream;
#endif
    Py_RETURN_FALSE;
}

/* set_isa(level) -> int: the hand-written loops allowed from now on (ISA_NONE, ISA_AVX2,
 * ISA_ALL); returns the level before (-1: only that). For tests and A/B runs, no batch in flight. */
static PyObject *set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const long level = PyLong_AsLong(arg);
    if (level == -1 && PyErr_Occurred()) return NULL;
    if (level == -1) return PyLong_FromLong(isa_limit); /* a query */
    if (level < ISA_NONE || level > ISA_ALL) {
        PyErr_Format(PyExc_ValueError, "set_isa: level %ld is not 0, 1 or 2", level);
        return NULL;
    }
    const int before = isa_limit;
    isa_limit = (int)level;
    return PyLong_FromLong(before);
}

/* file_size(fd) -> int: fstat's st_size, with the GIL held. os.fstat gives the GIL up for a
 * call that takes a microsecond, and taking it back waits out whichever thread took it, on every
 * size check before a copy from a memory map. */
static PyObject *file_size(PyObject *self, PyObject *arg) {
    (void)self;
    const int fd = PyObject_AsFileDescriptor(arg);
    if (fd < 0) return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLongLong((long long)st.st_size);
}

/* permute(keys, half, n, positions, out) -> int: stoker.order.Permutation evaluated at each
 * int64 position into out (int64): a Feistel network of len(keys) rounds of splitmix64's
 * finalizer over [0, 2**(2*half)), walked again while >= n. The same values as its numpy
 * code, bit for bit (tests compare them); the numpy calls of every round of a batch, made
 * under the dispatcher's lock, become one call. Returns the index of the first
 * position outside [0, n), out filled up to it, or -1. */
static inline uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static PyObject *permute(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer keys, pos, out;
    int half;
    unsigned long long n;
    if (!PyArg_ParseTuple(args, "y*iKy*w*", &keys, &half, &n, &pos, &out)) return NULL;
    Py_ssize_t bad = -1;
    const Py_ssize_t count = pos.len / 8, rounds = keys.len / 8;
    if (half < 1 || half > 31 || pos.len % 8 || keys.len % 8 || out.len != pos.len) {
        PyErr_SetString(PyExc_ValueError, "permute: bad half width or buffer sizes");
        bad = -2;
    } else {
        const uint64_t *k = (const uint64_t *)keys.buf;
        const int64_t *p = (const int64_t *)pos.buf;
        int64_t *o = (int64_t *)out.buf;
        const uint64_t mask = (1ULL << half) - 1;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (p[i] < 0 || (uint64_t)p[i] >= n) {
                bad = i;
                break;
            }
            uint64_t y = (uint64_t)p[i];
            do {
                uint64_t left = y >> half, right = y & mask;
                for (Py_ssize_t r = 0; r < rounds; r++) {
                    const uint64_t t = left ^ (mix64(right ^ k[r]) & mask);
                    left = right;
                    right = t;
                }
                y = (left << half) | right;
            } while (y >= n);
            o[i] = (int64_t)y;
        }
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&out);
    if (bad == -2) return NULL;
    return PyLong_FromSsize_t(bad);
}

/* file_sizes(fds) -> list: file_size of each descriptor in a list, in one call: a global
 * shuffle's batch checks every file it reads from (up to hundreds), and a Python call each cost
 * more than the system call. The GIL is given up for long lists only (see file_size). */
static PyObject *file_sizes(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "file_sizes: a list of descriptors");
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(arg);
    long long *sizes = PyMem_Malloc(sizeof(long long) * (size_t)(n ? n : 1));
    int *fds = PyMem_Malloc(sizeof(int) * (size_t)(n ? n : 1));
    PyObject *out = NULL;
    if (sizes == NULL || fds == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++)
        if ((fds[k] = PyObject_AsFileDescriptor(PyList_GET_ITEM(arg, k))) < 0) goto done;
    int error = 0;
    RELEASE_GIL_IF_BIG(n >= 32 ? GIL_FREE_BYTES : 0);
    for (Py_ssize_t k = 0; k < n && !error; k++) {
        struct stat st;
        if (fstat(fds[k], &st) != 0)
            error = errno;
        else
            sizes[k] = (long long)st.st_size;
    }
    TAKE_GIL_BACK();
    if (error) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if ((out = PyList_New(n)) == NULL) goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromLongLong(sizes[k]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, k, v);
    }
done:
    PyMem_Free(sizes);
    PyMem_Free(fds);
    return out;
}

static PyObject *signal_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if ((kwds != NULL && PyDict_GET_SIZE(kwds)) || !PyArg_ParseTuple(args, ":Signal")) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Signal() takes no arguments");
        return NULL;
    }
    SignalObject *self = (SignalObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if (sem_init(&self->sem, 0, 0) != 0) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void signal_dealloc(SignalObject *self) {
    sem_destroy(&self->sem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *signal_post(SignalObject *self, PyObject *unused) {
    (void)unused;
    signal_send(self);
    Py_RETURN_NONE;
}

static PyObject *signal_post_later(SignalObject *self, PyObject *unused) {
    (void)unused;
    if (deferred_ != self) {
        send_deferred();
        Py_INCREF(self);
        deferred_ = self;
    }
    Py_RETURN_NONE;
}

/* wait(timeout) -> bool: take the wake-up, sleeping up to timeout seconds without the GIL.
 * A signal handler that interrupts the sleep runs (a Ctrl-C raises KeyboardInterrupt here). */
static PyObject *signal_wait(SignalObject *self, PyObject *arg) {
    const double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (sem_trywait(&self->sem) == 0) Py_RETURN_TRUE;
    struct timespec until;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
    clock_gettime(CLOCK_MONOTONIC, &until);
#else
    clock_gettime(CLOCK_REALTIME, &until);
#endif
    const double secs = timeout > 0 ? timeout : 0;
    until.tv_sec += (time_t)secs;
    until.tv_nsec += (long)((secs - (double)(time_t)secs) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    for (;;) {
        int rc, err;
        Py_BEGIN_ALLOW_THREADS
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
        rc = sem_clockwait(&self->sem, CLOCK_MONOTONIC, &until);
#else
        rc = sem_timedwait(&self->sem, &until); /* the deadline is then on CLOCK_REALTIME */
#endif
        err = errno;
        Py_END_ALLOW_THREADS
        if (rc == 0) Py_RETURN_TRUE;
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0) return NULL;
            continue;
        }
        if (err == ETIMEDOUT) Py_RETURN_FALSE;
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

static PyMethodDef signal_methods[] = {
    {"post", (PyCFunction)signal_post, METH_NOARGS, "post(): wake the waiter now (at most one wake-up is pending)"},
    {"post_later", (PyCFunction)signal_post_later, METH_NOARGS,
     "post_later(): wake the waiter when this thread next gives the GIL up in a kernel, or at flush()"},
    {"wait", (PyCFunction)signal_wait, METH_O, "wait(timeout) -> bool: take the wake-up, sleeping up to timeout s"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SignalType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stoker._kernels.Signal",
    .tp_basicsize = sizeof(SignalObject),
    .tp_dealloc = (destructor)signal_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A wake-up for one waiting thread; see stoker.engine.",
    .tp_methods = signal_methods,
    .tp_new = signal_new,
};

/* FileMap(fd, size): a read-only shared memory map of a file's first size bytes that keeps no
 * file descriptor (Python's mmap.mmap keeps a duplicate of fd open until it is closed). A loader
 * keeps the maps of the files it has read between its passes, so the next pass (the next epoch
 * of a PyTorch loop, of a Keras fit) finds their pages mapped, without holding a file open. The
 * buffer is read-only; close() refuses while a buffer exported from it is alive (as mmap does),
 * and the map is unmapped when the object goes. */
typedef struct {
    PyObject_HEAD
    void *addr;
    Py_ssize_t size;
    Py_ssize_t exports;
} FileMapObject;

static PyObject *filemap_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", "size", NULL};
    int fd;
    Py_ssize_t size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in:FileMap", kwlist, &fd, &size)) return NULL;
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "FileMap: size=%zd must be positive", size);
        return NULL;
    }
    FileMapObject *self = (FileMapObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    void *addr = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) {
        const int err = errno;
        Py_DECREF(self);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->addr = addr;
    self->size = size;
    self->exports = 0;
    return (PyObject *)self;
}

static void filemap_dealloc(FileMapObject *self) {
    if (self->addr != NULL) munmap(self->addr, (size_t)self->size);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int filemap_getbuffer(FileMapObject *self, Py_buffer *view, int flags) {
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "FileMap is closed");
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->addr, self->size, 1, flags) < 0) return -1;
    self->exports++;
    return 0;
}

static void filemap_releasebuffer(FileMapObject *self, Py_buffer *view) {
    (void)view;
    self->exports--;
}

static PyObject *filemap_close(FileMapObject *self, PyObject *unused) {
    (void)unused;
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError, "cannot close a FileMap while a buffer exported from it is alive");
        return NULL;
    }
    if (self->addr != NULL) {
        munmap(self->addr, (size_t)self->size);
        self->addr = NULL;
    }
    Py_RETURN_NONE;
}

/* madvise(advice, start=0, length=to the end): advice on a page-aligned range of the map. */
static PyObject *filemap_madvise(FileMapObject *self, PyObject *args) {
    int advice;
    Py_ssize_t start = 0, length = -1;
    if (!PyArg_ParseTuple(args, "i|nn:madvise", &advice, &start, &length)) return NULL;
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "FileMap is closed");
        return NULL;
    }
    if (start < 0 || start >= self->size) {
        PyErr_Format(PyExc_ValueError, "madvise: start=%zd is outside the map (%zd bytes)", start, self->size);
        return NULL;
    }
    if (length < 0 || length > self->size - start) length = self->size - start;
    if (madvise((char *)self->addr + start, (size_t)length, advice) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *filemap_closed(FileMapObject *self, void *unused) {
    (void)unused;
    return PyBool_FromLong(self->addr == NULL);
}

static Py_ssize_t filemap_len(FileMapObject *self) { return self->size; }

static PyBufferProcs filemap_as_buffer = {
    (getbufferproc)filemap_getbuffer,
    (releasebufferproc)filemap_releasebuffer,
};

static PySequenceMethods filemap_as_sequence = {.sq_length = (lenfunc)filemap_len};

static PyMethodDef filemap_methods[] = {
    {"close", (PyCFunction)filemap_close, METH_NOARGS, "close(): unmap now (BufferError while a buffer is exported)"},
    {"madvise", (PyCFunction)filemap_madvise, METH_VARARGS, "madvise(advice, start=0, length=-1): advise a range"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef filemap_getset[] = {
    {"closed", (getter)filemap_closed, NULL, "whether the map has been closed", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FileMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stoker._kernels.FileMap",
    .tp_basicsize = sizeof(FileMapObject),
    .tp_dealloc = (destructor)filemap_dealloc,
    .tp_as_sequence = &filemap_as_sequence,
    .tp_as_buffer = &filemap_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "FileMap(fd, size): a read-only map of a file's first size bytes holding no descriptor.",
    .tp_methods = filemap_methods,
    .tp_getset = filemap_getset,
    .tp_new = filemap_new,
};

/* flush(): send this thread's deferred wake-up now. */
static PyObject *flush(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    send_deferred();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"flush", flush, METH_NOARGS, "flush(): send this thread's deferred wake-up (Signal.post_later) now"},
    {"file_size", file_size, METH_O, "file_size(fd) -> int (fstat's st_size, GIL held)"},
    {"guard_maps", guard_maps, METH_NOARGS, "guard_maps(): install the SIGBUS handler that turns faults in kernels into MapFault (again, if another replaced it)"},
    {"set_isa", set_isa, METH_O, "set_isa(level) -> int: hand-written loops allowed (0 none, 1 AVX2/F16C, 2 all; -1 asks); the level before"},
    {"normalize", normalize, METH_VARARGS,
     "normalize(src, out, src_addr, n, rec_stride, extra_addr, row_stride, O, M, I, flips_addr, dst_addr, ops[, stream])"
     " -> bool (False, nothing written: no row kernel for a float16 'e' or bfloat16 'E' output)"},
    {"cast_into", cast_arrays, METH_VARARGS, "cast_into(dst, src, stream_min_bytes) -> bool"},
    {"from_bfloat16", from_bfloat16, METH_VARARGS, "from_bfloat16(src_addr, n, dst_addr, stream): bfloat16 values into float32"},
    {"bfloat16", to_bfloat16, METH_VARARGS, "bfloat16(src_code, src_addr, n, dst_addr): b B h H f values into bfloat16"},
    {"computed_to_float16", computed_to_float16, METH_VARARGS,
     "computed_to_float16(src_addr, n, dst_addr, stream) -> bool: float32 values computed here into float16"},
    {"willneed_records", willneed_records, METH_VARARGS, "willneed_records(fds, offsets, length) -> calls failed"},
    {"file_sizes", file_sizes, METH_O, "file_sizes(fds) -> list (fstat's st_size of each)"},
    {"permute", permute, METH_VARARGS, "permute(keys, half, n, positions, out) -> int (first bad position, or -1)"},
    {"gather_records", gather_records, METH_VARARGS, "gather_records(src, out, dst, nrows, rows, addresses, stream)"},
    {"gather_runs", gather_runs, METH_VARARGS, "gather_runs(src, out, dst, nrows, runs, stream)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "stoker._kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    if (PyType_Ready(&SignalType) < 0 || PyType_Ready(&FileMapType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&SignalType);
    if (PyModule_AddObject(m, "Signal", (PyObject *)&SignalType) < 0) {
        Py_DECREF(&SignalType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&FileMapType);
    if (PyModule_AddObject(m, "FileMap", (PyObject *)&FileMapType) < 0) {
        Py_DECREF(&FileMapType);
        Py_DECREF(m);
        return NULL;
    }
    MapFault = PyErr_NewExceptionWithDoc(
        "stoker._kernels.MapFault",
        "A bus error (SIGBUS) in a kernel's read of caller memory, such as a map of a file cut short; "
        "`.address` is where.",
        PyExc_OSError, NULL);
    if (MapFault == NULL || PyModule_AddObjectRef(m, "MapFault", MapFault) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
