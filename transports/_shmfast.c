/* transports._shmfast: the shm transport's small-message hot path on raw addresses.
 *
 * Why C: the Python path of one small all_reduce is a dozen NumPy/memoryview calls of 0.3-1 us each;
 * here staging, publishing the epoch, waiting, checking the signature digests and reducing are one
 * call. The layout is the one transports/shm.py documents; this module only holds addresses (it never
 * owns or keeps the mapping alive: the transport drops its Group before unmapping).
 *
 * Reductions are bitwise identical to transports._host.reduce_into (NumPy ufuncs in rank order; 16-bit
 * floats through float32 and one rounding as torch does it), so a rank on this path and a rank on the
 * Python path agree bit for bit. Built with -ffp-contract=off -fno-fast-math (setup.py): a contracted
 * multiply-add or a reassociated sum would change results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <sched.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define HAVE_FUTEX 1
#endif

/* Bumped whenever a signature below changes; transports/_native.py refuses a stale build. */
#define API_VERSION 7  /* 2: pull(); 3: reduce_scatter(); 4: a2a_post(), a2a_pull(), counts/addr words; 5: sleep();
                         6: a2a_post() into y -> DONE; 7: publish(), spin() */

/* Control block words (transports/shm.py: _EPOCH, _SIG0, _META0; base.META_LEN). */
#define W_EPOCH 0
#define W_SIG0 2
#define W_META0 4
#define META_LEN 16

enum { ARRIVED = 0, PENDING = 1, MISMATCH = 2, DONE = 3 };  /* DONE: ARRIVED, and the call finished the collective */

/* transports.base.DTYPE_CODES and ReduceOp */
enum { DT_F64 = 1, DT_F32 = 2, DT_F16 = 3, DT_BF16 = 4, DT_I64 = 5, DT_I32 = 6, DT_U8 = 7, DT_BOOL = 8 };
enum { OP_SUM = 1, OP_AVG = 2, OP_MAX = 3, OP_MIN = 4, OP_PROD = 5 };

/* Reductions run in blocks of this many accumulator bytes: small enough to stay in L1 between the
 * passes over the ranks, and the unit in which an aliased output is written only after every source
 * of the block was read. */
#define ACC_BYTES 4096

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

/* ---- 16-bit float conversions ------------------------------------------------------------------
 * Own code (no _Float16): the oracle is torch on x86 (F16C / AVX-512 conversions), proven
 * exhaustively for half->float and on random and edge patterns for float->half/bfloat16 in
 * tests/test_shm_native.py. */
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) /* inf, NaN: payload kept, a signalling NaN comes out quiet (as vcvtph2ps) */
        return bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0));
    if (e) /* normal: rebias 15 -> 127 */
        return bits_f32(sign | ((e + 112) << 23) | (m << 13));
    /* subnormal or zero: m * 2^-24, exact in float */
    return bits_f32(sign | f32_bits((float)m * 0x1p-24f));
}

static inline uint16_t f2h(float f) {
    uint32_t x = f32_bits(f), ax = x & 0x7fffffffu;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    if (ax > 0x7f800000u) /* NaN: top payload bits, quiet bit set (vcvtps2ph) */
        return sign | 0x7e00u | (uint16_t)((ax >> 13) & 0x3ffu);
    if (ax >= 0x477ff000u) /* >= 65520 (halfway above 65504, the largest half) rounds to inf */
        return sign | 0x7c00u;
    if (ax >= 0x38800000u) { /* a normal half (>= 2^-14): round the 13 dropped bits to nearest even */
        uint32_t r = (ax + 0x0fffu + ((ax >> 13) & 1u)) >> 13;
        return sign | (uint16_t)(r - (112u << 10));
    }
    /* subnormal half: adding 0.5 makes the float's ulp 2^-24, the half subnormal unit, so the FPU
     * rounds to nearest even for us; the mantissa is the result (0x400 = the smallest normal). */
    return sign | (uint16_t)(f32_bits(bits_f32(ax) + 0.5f) - 0x3f000000u);
}

static inline float bf2f(uint16_t b) { return bits_f32((uint32_t)b << 16); }

static inline uint16_t f2bf(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return 0xffffu; /* torch's vectorized conversion on x86 maps every NaN to 0xffff */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16); /* nearest even; overflow carries to inf */
}

/* ---- element kernels ---------------------------------------------------------------------------
 * first: d = op(a, b); acc: d = op(d, b). Separate forms so every pointer can be restrict (the
 * vectorizer then needs no runtime alias checks); the caller never passes overlapping ranges. */
typedef void (*first_fn)(void *d, const void *a, const void *b, Py_ssize_t k);
typedef void (*acc_fn)(void *d, const void *b, Py_ssize_t k);
typedef void (*wide_fn)(float *acc, const uint16_t *s, Py_ssize_t k);

/* NumPy's maximum/minimum on float32/float64 (its SIMD loops, measured): NaN propagates from either
 * side, and equal values (+0 vs -0) give the second operand. */
#define FMAX(x, y) (((x) > (y) || (x) != (x)) ? (x) : (y))
#define FMIN(x, y) (((x) < (y) || (x) != (x)) ? (x) : (y))
#define IMAX(x, y) ((x) > (y) ? (x) : (y))
#define IMIN(x, y) ((x) < (y) ? (x) : (y))
/* NumPy's float16 maximum/minimum (npy_half_ge/le, scalar): ties give the FIRST operand's bits. */
#define HMAX(x, y) ((h2f(x) >= h2f(y) || h2f(x) != h2f(x)) ? (x) : (y))
#define HMIN(x, y) ((h2f(x) <= h2f(y) || h2f(x) != h2f(x)) ? (x) : (y))

#define PLAIN(name, T, EXPR)                                                               \
    static void name##_first(void *dv, const void *av, const void *bv, Py_ssize_t k) {    \
        T *restrict d = (T *)dv;                                                          \
        const T *restrict a = (const T *)av, *restrict b = (const T *)bv;                 \
        for (Py_ssize_t i = 0; i < k; i++) { T x = a[i], y = b[i]; d[i] = (T)(EXPR); }    \
    }                                                                                     \
    static void name##_acc(void *dv, const void *bv, Py_ssize_t k) {                      \
        T *restrict d = (T *)dv;                                                          \
        const T *restrict b = (const T *)bv;                                              \
        for (Py_ssize_t i = 0; i < k; i++) { T x = d[i], y = b[i]; d[i] = (T)(EXPR); }    \
    }

PLAIN(f64_add, double, x + y)   PLAIN(f64_mul, double, x * y)
PLAIN(f64_max, double, FMAX(x, y)) PLAIN(f64_min, double, FMIN(x, y))
PLAIN(f32_add, float, x + y)    PLAIN(f32_mul, float, x * y)
PLAIN(f32_max, float, FMAX(x, y)) PLAIN(f32_min, float, FMIN(x, y))
/* integers wrap as NumPy's do: add and multiply in unsigned types (signed overflow is UB in C) */
PLAIN(i64_add, uint64_t, x + y) PLAIN(i64_mul, uint64_t, x * y)
PLAIN(i64_max, int64_t, IMAX(x, y)) PLAIN(i64_min, int64_t, IMIN(x, y))
PLAIN(i32_add, uint32_t, x + y) PLAIN(i32_mul, uint32_t, x * y)
PLAIN(i32_max, int32_t, IMAX(x, y)) PLAIN(i32_min, int32_t, IMIN(x, y))
PLAIN(u8_add, uint8_t, x + y)   PLAIN(u8_mul, uint8_t, x * y)
PLAIN(u8_max, uint8_t, IMAX(x, y)) PLAIN(u8_min, uint8_t, IMIN(x, y))
/* NumPy on bool: add and maximum are "or", multiply and minimum are "and" */
PLAIN(bool_or, uint8_t, (x | y) != 0) PLAIN(bool_and, uint8_t, (x != 0) & (y != 0))
PLAIN(f16_max, uint16_t, HMAX(x, y)) PLAIN(f16_min, uint16_t, HMIN(x, y))

static void f64_div(void *dv, Py_ssize_t n, Py_ssize_t k) {
    double *d = (double *)dv, q = (double)n;
    for (Py_ssize_t i = 0; i < k; i++) d[i] = d[i] / q;  /* np.divide: a true division, not * 1/n */
}
static void f32_div(void *dv, Py_ssize_t n, Py_ssize_t k) {
    float *d = (float *)dv, q = (float)n;
    for (Py_ssize_t i = 0; i < k; i++) d[i] = d[i] / q;
}

/* 16-bit floats reduce_into-style: a float32 accumulator, one rounding at the end (torch ops). */
#define WIDE(name, CVT, EXPR)                                                              \
    static void name(float *restrict acc, const uint16_t *restrict s, Py_ssize_t k) {     \
        for (Py_ssize_t i = 0; i < k; i++) { float x = acc[i], y = CVT(s[i]); acc[i] = (EXPR); } \
    }
WIDE(f16_wadd, h2f, x + y) WIDE(f16_wmul, h2f, x * y)
WIDE(bf16_wadd, bf2f, x + y) WIDE(bf16_wmul, bf2f, x * y)
/* torch.maximum's vector loop: NaN from either side (then 0xffff after rounding), ties give the second */
WIDE(bf16_wmax, bf2f, FMAX(x, y)) WIDE(bf16_wmin, bf2f, FMIN(x, y))

typedef struct {
    Py_ssize_t itemsize;
    int wide;            /* 0: plain kernels on the dtype itself; DT_F16/DT_BF16: float32 accumulator */
    first_fn first;
    acc_fn acc;
    void (*div)(void *, Py_ssize_t, Py_ssize_t); /* AVG only */
    wide_fn wacc;
} Plan;

static int make_plan(long long dtype, long long op, Plan *p) {
    static const Py_ssize_t sizes[] = {0, 8, 4, 2, 2, 8, 4, 1, 1};
    memset(p, 0, sizeof *p);
    if (dtype < DT_F64 || dtype > DT_BOOL) {
        PyErr_Format(PyExc_ValueError, "_shmfast: unknown dtype code %lld (transports.base.DTYPE_CODES 1..8)", dtype);
        return -1;
    }
    if (op < OP_SUM || op > OP_PROD) {
        PyErr_Format(PyExc_ValueError, "_shmfast: unknown reduce op code %lld (transports.base.ReduceOp 1..5)", op);
        return -1;
    }
    p->itemsize = sizes[dtype];
    int k = op == OP_SUM || op == OP_AVG ? 0 : op == OP_PROD ? 1 : op == OP_MAX ? 2 : 3;
    if (op == OP_AVG && dtype != DT_F64 && dtype != DT_F32 && dtype != DT_F16 && dtype != DT_BF16) {
        PyErr_SetString(PyExc_ValueError, "_shmfast: avg needs a floating dtype (the communicator rejects it earlier)");
        return -1;
    }
#define SET(a, b, c, d) { first_fn f[] = {a##_first, b##_first, c##_first, d##_first}; \
                          acc_fn g[] = {a##_acc, b##_acc, c##_acc, d##_acc}; p->first = f[k]; p->acc = g[k]; }
    switch (dtype) {
    case DT_F64: SET(f64_add, f64_mul, f64_max, f64_min); p->div = f64_div; break;
    case DT_F32: SET(f32_add, f32_mul, f32_max, f32_min); p->div = f32_div; break;
    case DT_I64: SET(i64_add, i64_mul, i64_max, i64_min); break;
    case DT_I32: SET(i32_add, i32_mul, i32_max, i32_min); break;
    case DT_U8: SET(u8_add, u8_mul, u8_max, u8_min); break;
    case DT_BOOL: SET(bool_or, bool_and, bool_or, bool_and); break;
    case DT_F16:
        if (k >= 2) SET(f16_max, f16_max, f16_max, f16_min) /* reduce_into: NumPy on float16 */
        else { p->wide = DT_F16; p->wacc = k == 0 ? f16_wadd : f16_wmul; }
        break;
    case DT_BF16: {
        wide_fn w[] = {bf16_wadd, bf16_wmul, bf16_wmax, bf16_wmin};
        p->wide = DT_BF16; p->wacc = w[k];
        break;
    }
    }
#undef SET
    return 0;
}

static inline int overlaps(const char *a, const char *b, size_t len) {
    return len && (uintptr_t)a < (uintptr_t)b + len && (uintptr_t)b < (uintptr_t)a + len;
}

/* out[0:count] = op over srcs[0..n-1] in that order (AVG: then / n). out may alias any source: then
 * each block is reduced into a local buffer and written only after all its sources were read. */
static void reduce_srcs(const Plan *p, char *out, char *const *srcs, Py_ssize_t n, Py_ssize_t count, int avg) {
    _Alignas(64) unsigned char buf[ACC_BYTES];
    size_t isz = (size_t)p->itemsize, total = (size_t)count * isz;
    if (p->wide) {
        float *acc = (float *)buf;
        const Py_ssize_t blk = ACC_BYTES / sizeof(float);
        for (Py_ssize_t lo = 0; lo < count; lo += blk) {
            Py_ssize_t k = count - lo < blk ? count - lo : blk, i;
            const uint16_t *s0 = (const uint16_t *)srcs[0] + lo;
            if (p->wide == DT_F16) for (i = 0; i < k; i++) acc[i] = h2f(s0[i]);
            else for (i = 0; i < k; i++) acc[i] = bf2f(s0[i]);
            for (Py_ssize_t r = 1; r < n; r++) p->wacc(acc, (const uint16_t *)srcs[r] + lo, k);
            if (avg && n > 1) f32_div(acc, n, k);
            uint16_t *o = (uint16_t *)out + lo;
            if (p->wide == DT_F16) for (i = 0; i < k; i++) o[i] = f2h(acc[i]);
            else for (i = 0; i < k; i++) o[i] = f2bf(acc[i]);
        }
        return;
    }
    if (n == 1) { /* reduce_into copies; AVG divides only when divisor != 1 */
        if (total && out != srcs[0]) memmove(out, srcs[0], total);
        return;
    }
    /* Accumulate straight into out when that cannot clobber an unread source. */
    int direct = out == srcs[0] || !overlaps(out, srcs[0], total);
    for (Py_ssize_t r = 1; r < n && direct; r++) direct = !overlaps(out, srcs[r], total);
    const Py_ssize_t blk = ACC_BYTES / (Py_ssize_t)isz;
    for (Py_ssize_t lo = 0; lo < count; lo += blk) {
        Py_ssize_t k = count - lo < blk ? count - lo : blk;
        size_t at = (size_t)lo * isz;
        char *d = direct ? out + at : (char *)buf;
        if (d == srcs[0] + at) p->acc(d, srcs[1] + at, k);
        else p->first(d, srcs[0] + at, srcs[1] + at, k);
        for (Py_ssize_t r = 2; r < n; r++) p->acc(d, srcs[r] + at, k);
        if (avg) p->div(d, n, k);
        if (!direct) memcpy(out + at, buf, (size_t)k * isz);
    }
}

/* ---- the Group object ------------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    int64_t *ctrl;        /* rank 0's control block */
    Py_ssize_t ctrl_words, n, rank, slot_bytes;
    long spin, yields;
    char **slot[2];       /* slot[b][r]: rank r's data slot b */
    char **srcs;          /* scratch: the sources of one reduction */
    Py_ssize_t counts0;   /* all_to_all: word of the two parities of n send counts in a control block (-1: none) */
    Py_ssize_t addr0;     /* single copy: word of the two parities of (input, output) addresses (-1: none) */
    Py_ssize_t wait0;     /* word holding the epoch this rank sleeps for in sleep() (0: awake; -1: no sleeping) */
    int64_t *a2a;         /* scratch: n stream starts + n output offsets of one all_to_all */
} Group;

static inline int64_t *block(Group *g, Py_ssize_t r) { return g->ctrl + r * g->ctrl_words; }

/* Parse exactly `want` int arguments of a METH_FASTCALL method. */
static int ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *name, long long *v) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "Group.%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int check_slot(Group *g, long long b, long long off, long long nbytes, const char *what) {
    if (b != 0 && b != 1) {
        PyErr_Format(PyExc_ValueError, "_shmfast: slot index %lld is not 0 or 1", b);
        return -1;
    }
    if (off < 0 || nbytes < 0 || off > g->slot_bytes || nbytes > g->slot_bytes - off) {
        PyErr_Format(PyExc_ValueError, "_shmfast: %s of %lld bytes at slot offset %lld does not fit in a "
                     "slot of %zd bytes", what, nbytes, off, g->slot_bytes);
        return -1;
    }
    return 0;
}

static int check_addr(long long addr, long long nbytes, const char *what) {
    if (nbytes > 0 && addr <= 0) {
        PyErr_Format(PyExc_ValueError, "_shmfast: %s address %lld is not a valid pointer", what, addr);
        return -1;
    }
    return 0;
}

/* count elements of itemsize -> bytes, refusing counts whose bytes overflow or exceed the slot */
static int count_bytes(Group *g, long long count, Py_ssize_t itemsize, long long *nbytes) {
    if (count < 0 || count > g->slot_bytes / itemsize) {
        PyErr_Format(PyExc_ValueError, "_shmfast: %lld elements of %zd bytes do not fit in a slot of %zd bytes",
                     count, itemsize, g->slot_bytes);
        return -1;
    }
    *nbytes = count * itemsize;
    return 0;
}

static int all_arrived(Group *g, int64_t e) {
    for (Py_ssize_t r = 0; r < g->n; r++)
        if (r != g->rank && __atomic_load_n(block(g, r) + W_EPOCH, __ATOMIC_ACQUIRE) < e) return 0;
    return 1;
}

static int peer_sigs_match(Group *g, int64_t e, int64_t sig) {
    for (Py_ssize_t r = 0; r < g->n; r++)
        if (r != g->rank && __atomic_load_n(block(g, r) + W_SIG0 + (e & 1), __ATOMIC_RELAXED) != sig) return 0;
    return 1;
}

/* ---- sleeping waits -----------------------------------------------------------------------------
 * A rank that has spun and yielded long enough sleeps on a futex over the low 32 bits of the
 * epoch word of a peer it waits for, after writing the epoch it waits for into its wait word; a
 * rank that publishes an epoch then wakes the peers whose wait word is set. Both sides order their
 * store before their load with a full fence (Dekker), so either the publisher sees the flag and
 * wakes, or the sleeper sees the new epoch (or the kernel's value check at FUTEX_WAIT fails): no
 * wake-up is lost. Sleeps are bounded, so the caller's timeout and dead-peer checks still run. */
#ifdef HAVE_FUTEX
static inline uint32_t *low_word(int64_t *w) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return (uint32_t *)w;
#else
    return (uint32_t *)w + 1;
#endif
}
#endif

static void wake_sleepers(Group *g) {
#ifdef HAVE_FUTEX
    if (g->wait0 < 0) return;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (Py_ssize_t r = 0; r < g->n; r++)
        if (r != g->rank && __atomic_load_n(block(g, r) + g->wait0, __ATOMIC_RELAXED) != 0) {
            syscall(SYS_futex, low_word(block(g, g->rank) + W_EPOCH), FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
            return; /* one wake reaches every sleeper on our word */
        }
#else
    (void)g;
#endif
}

static int do_arrive(Group *g, int64_t e, int64_t sig, const int64_t *sig_words) {
    int64_t *mine = block(g, g->rank);
    if (sig >= 0) {
        memcpy(mine + W_META0 + (e & 1) * META_LEN, sig_words, META_LEN * sizeof(int64_t));
        __atomic_store_n(mine + W_SIG0 + (e & 1), sig, __ATOMIC_RELAXED);
    }
    /* release: the slot data and signature above are visible to a peer that acquires this epoch */
    __atomic_store_n(mine + W_EPOCH, e, __ATOMIC_RELEASE);
    wake_sleepers(g);
    int done = all_arrived(g, e);
    for (long i = 0; !done && i < g->spin; i++) {
        cpu_relax();
        done = all_arrived(g, e);
    }
    if (!done && g->yields > 0) {
        /* Yielding takes microseconds anyway, so releasing the GIL here is free and lets other
         * threads run; the spin above keeps it (a GIL round trip would cost more than a wait turn). */
        Py_BEGIN_ALLOW_THREADS
        for (long i = 0; !done && i < g->yields; i++) {
            sched_yield();
            done = all_arrived(g, e);
        }
        Py_END_ALLOW_THREADS
    }
    if (!done) return PENDING;
    return sig < 0 || peer_sigs_match(g, e, sig) ? ARRIVED : MISMATCH;
}

static void do_gather(Group *g, int b, char *out, long long nbytes, long long off, long long stride, char *own) {
    if (nbytes <= 0) return; /* a zero-size tensor may have a NULL data pointer */
    for (Py_ssize_t r = 0; r < g->n; r++)
        memmove(out + r * stride, r == g->rank && own ? own : g->slot[b][r] + off, (size_t)nbytes);
}

static int gather_args(Group *g, long long nbytes, long long stride) {
    if (g->n > 1 && stride < nbytes) {
        PyErr_Format(PyExc_ValueError, "_shmfast: gather stride %lld is smaller than a block of %lld bytes",
                     stride, nbytes);
        return -1;
    }
    return 0;
}

static int arrive_args(long long sig, long long sig_words) {
    return sig >= 0 ? check_addr(sig_words, 1, "signature words") : 0;
}

static PyObject *Group_arrive(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[3];
    if (ints(args, nargs, 3, "arrive", v) || arrive_args(v[1], v[2])) return NULL;
    return PyLong_FromLong(do_arrive(g, v[0], v[1], (const int64_t *)(uintptr_t)v[2]));
}

static PyObject *Group_publish(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[1];
    if (ints(args, nargs, 1, "publish", v)) return NULL;
    __atomic_store_n(block(g, g->rank) + W_EPOCH, (int64_t)v[0], __ATOMIC_RELEASE);
    wake_sleepers(g);
    Py_RETURN_NONE;
}

/* Busy-wait (no yield: a core per rank) until every peer reached epoch e or budget_ns passed.
 * The clock is read every 64 turns: a turn is ~10-100 ns, so the budget overshoots by a few us at most. */
static PyObject *Group_spin(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[2];
    if (ints(args, nargs, 2, "spin", v)) return NULL;
    int done = all_arrived(g, v[0]);
#ifdef HAVE_FUTEX
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long long end = (long long)t.tv_sec * 1000000000LL + t.tv_nsec + v[1];
    for (long i = 1; !done; i++) {
        cpu_relax();
        done = all_arrived(g, v[0]);
        if (!done && (i & 63) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((long long)t.tv_sec * 1000000000LL + t.tv_nsec >= end) break;
        }
    }
#endif
    return PyBool_FromLong(done);
}

static PyObject *Group_sigs_match(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[2];
    if (ints(args, nargs, 2, "sigs_match", v)) return NULL;
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the caller saw the epochs with plain loads */
    return PyBool_FromLong(peer_sigs_match(g, v[0], v[1]));
}

static PyObject *Group_stage(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[4]; /* b, src, nbytes, slot_off */
    if (ints(args, nargs, 4, "stage", v) || check_slot(g, v[0], v[3], v[2], "stage") || check_addr(v[1], v[2], "source"))
        return NULL;
    if (v[2] > 0) memmove(g->slot[v[0]][g->rank] + v[3], (const void *)(uintptr_t)v[1], (size_t)v[2]);
    Py_RETURN_NONE;
}

static PyObject *Group_sleep(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[2]; /* e, timeout_us */
    if (ints(args, nargs, 2, "sleep", v)) return NULL;
#ifdef HAVE_FUTEX
    if (g->wait0 < 0 || v[1] < 0) {
        PyErr_SetString(PyExc_ValueError, "_shmfast: sleep() needs a Group made with wait_word and a timeout >= 0");
        return NULL;
    }
    int64_t e = v[0], *flag = block(g, g->rank) + g->wait0;
    Py_ssize_t r = 0;
    for (; r < g->n; r++)
        if (r != g->rank && __atomic_load_n(block(g, r) + W_EPOCH, __ATOMIC_ACQUIRE) < e) break;
    if (r == g->n) Py_RETURN_TRUE;
    int64_t *word = block(g, r) + W_EPOCH;
    __atomic_store_n(flag, e, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int64_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (seen < e) {
        struct timespec ts = {(time_t)(v[1] / 1000000), (long)(v[1] % 1000000) * 1000};
        Py_BEGIN_ALLOW_THREADS
        syscall(SYS_futex, low_word(word), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
        Py_END_ALLOW_THREADS
    }
    __atomic_store_n(flag, 0, __ATOMIC_RELAXED);
    return PyBool_FromLong(all_arrived(g, e));
#else
    (void)g; (void)v;
    PyErr_SetString(PyExc_OSError, "_shmfast: sleep() needs Linux futexes");
    return NULL;
#endif
}

static PyObject *Group_pull(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[5]; /* b, src_rank, slot_off, dst, nbytes */
    if (ints(args, nargs, 5, "pull", v) || check_slot(g, v[0], v[2], v[4], "pull") || check_addr(v[3], v[4], "destination"))
        return NULL;
    if (v[1] < 0 || v[1] >= g->n) {
        PyErr_Format(PyExc_ValueError, "_shmfast: pull from rank %lld of a group of %zd", v[1], g->n);
        return NULL;
    }
    if (v[4] > 0) memmove((void *)(uintptr_t)v[3], g->slot[v[0]][v[1]] + v[2], (size_t)v[4]);
    Py_RETURN_NONE;
}

static PyObject *Group_reduce(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[7], nbytes; /* b, out, count, dtype, op, slot_off, own */
    Plan p;
    if (ints(args, nargs, 7, "reduce", v) || make_plan(v[3], v[4], &p) || count_bytes(g, v[2], p.itemsize, &nbytes) ||
        check_slot(g, v[0], v[5], nbytes, "reduce") || check_addr(v[1], nbytes, "output"))
        return NULL;
    for (Py_ssize_t r = 0; r < g->n; r++) g->srcs[r] = g->slot[v[0]][r] + v[5];
    if (v[6]) g->srcs[g->rank] = (char *)(uintptr_t)v[6];
    reduce_srcs(&p, (char *)(uintptr_t)v[1], g->srcs, g->n, v[2], v[4] == OP_AVG);
    Py_RETURN_NONE;
}

static PyObject *Group_gather(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[6]; /* b, out, nbytes, slot_off, out_stride, own */
    if (ints(args, nargs, 6, "gather", v) || check_slot(g, v[0], v[3], v[2], "gather") ||
        check_addr(v[1], v[2], "output") || gather_args(g, v[2], v[4]))
        return NULL;
    do_gather(g, (int)v[0], (char *)(uintptr_t)v[1], v[2], v[3], v[4], (char *)(uintptr_t)v[5]);
    Py_RETURN_NONE;
}

static PyObject *Group_all_reduce(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[9], nbytes; /* b, e, x, out, count, dtype, op, sig, sig_words */
    Plan p;
    /* every check before the stage: a refused call publishes nothing */
    if (ints(args, nargs, 9, "all_reduce", v) || make_plan(v[5], v[6], &p) || count_bytes(g, v[4], p.itemsize, &nbytes) ||
        check_slot(g, v[0], 0, nbytes, "all_reduce") || check_addr(v[2], nbytes, "input") ||
        check_addr(v[3], nbytes, "output") || arrive_args(v[7], v[8]))
        return NULL;
    char **slots = g->slot[v[0]];
    if (nbytes > 0) memcpy(slots[g->rank], (const void *)(uintptr_t)v[2], (size_t)nbytes);
    int code = do_arrive(g, v[1], v[7], (const int64_t *)(uintptr_t)v[8]);
    if (code == ARRIVED) reduce_srcs(&p, (char *)(uintptr_t)v[3], slots, g->n, v[4], v[6] == OP_AVG);
    return PyLong_FromLong(code);
}

static PyObject *Group_reduce_scatter(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[9], nbytes; /* b, e, x, out, count (of out), dtype, op, sig, sig_words */
    Plan p;
    if (ints(args, nargs, 9, "reduce_scatter", v) || make_plan(v[5], v[6], &p) ||
        count_bytes(g, v[4], p.itemsize, &nbytes))
        return NULL;
    if (nbytes > 0 && g->n > g->slot_bytes / nbytes) {  /* the whole input, n blocks, must fit one slot */
        PyErr_Format(PyExc_ValueError, "_shmfast: reduce_scatter input of %zd x %lld bytes does not fit in a slot of "
                     "%zd bytes", g->n, nbytes, g->slot_bytes);
        return NULL;
    }
    long long in_bytes = nbytes * g->n, off = nbytes * g->rank;
    if (check_slot(g, v[0], 0, in_bytes, "reduce_scatter") || check_addr(v[2], in_bytes, "input") ||
        check_addr(v[3], nbytes, "output") || arrive_args(v[7], v[8]))
        return NULL;
    /* all of x is staged, our block too, so out may alias it; every rank reduces its block */
    if (in_bytes > 0) memcpy(g->slot[v[0]][g->rank], (const void *)(uintptr_t)v[2], (size_t)in_bytes);
    int code = do_arrive(g, v[1], v[7], (const int64_t *)(uintptr_t)v[8]);
    if (code == ARRIVED) {
        for (Py_ssize_t r = 0; r < g->n; r++) g->srcs[r] = g->slot[v[0]][r] + off;
        reduce_srcs(&p, (char *)(uintptr_t)v[3], g->srcs, g->n, v[4], v[6] == OP_AVG);
    }
    return PyLong_FromLong(code);
}

/* ---- all_to_all of one round ------------------------------------------------------------------
 * The layout and protocol of transports/shm.py's all_to_all (and transports/_schedule.py): each rank
 * stages its input without its own block as a stream, publishes its n send counts (rows) and, for
 * single copy, (0, 0) as its addresses, and arrives; receivers pull their rows from the senders'
 * slots. These two calls serve a round whose every sender fits one slot and none reads in single
 * copy; a2a_pull says "not mine" (1) otherwise, before copying anything, and Python goes on. */
static int a2a_pull_core(Group *g, long long b, long long e, long long y, long long y_nbytes, long long row_bytes,
                         long long x, long long own_start, long long own_len, int exact);

static PyObject *Group_a2a_post(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    /* b, e, x, total, own_start, own_len, counts (sequence), sig, sig_words[, y, y_nbytes, row_bytes] */
    if (nargs != 9 && nargs != 12) {
        PyErr_Format(PyExc_TypeError, "Group.a2a_post() takes 9 or 12 arguments (%zd given)", nargs);
        return NULL;
    }
    long long v[11];
    for (int i = 0, k = 0; i < nargs; i++) {
        if (i == 6) continue;
        v[k] = PyLong_AsLongLong(args[i]);
        if (v[k] == -1 && PyErr_Occurred()) return NULL;
        k++;
    }
    long long b = v[0], e = v[1], x = v[2], total = v[3], own_start = v[4], own_len = v[5];
    if (g->counts0 < 0) {
        PyErr_SetString(PyExc_ValueError, "_shmfast: this Group was made without counts_word (no all_to_all)");
        return NULL;
    }
    if (total < 0 || own_start < 0 || own_len < 0 || own_start > total || own_len > total - own_start) {
        PyErr_Format(PyExc_ValueError, "_shmfast: a2a_post own block [%lld, +%lld) outside an input of %lld bytes",
                     own_start, own_len, total);
        return NULL;
    }
    long long stream = total - own_len, w = stream < g->slot_bytes ? stream : g->slot_bytes;
    if (check_slot(g, b, 0, w, "a2a_post") || check_addr(x, total, "input") || arrive_args(v[6], v[7])) return NULL;
    PyObject *seq = PySequence_Fast(args[6], "_shmfast: a2a_post counts must be a sequence of ints");
    if (!seq) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != g->n) {
        PyErr_Format(PyExc_ValueError, "_shmfast: a2a_post got %zd counts for %zd ranks", PySequence_Fast_GET_SIZE(seq), g->n);
        Py_DECREF(seq);
        return NULL;
    }
    int64_t *mine = block(g, g->rank), *counts = mine + g->counts0 + (e & 1) * g->n;
    for (Py_ssize_t r = 0; r < g->n; r++) {
        long long c = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, r));
        if ((c == -1 && PyErr_Occurred()) || c < 0) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "_shmfast: a2a_post count %lld < 0", c);
            Py_DECREF(seq);
            return NULL;
        }
        __atomic_store_n(counts + r, c, __ATOMIC_RELAXED);
    }
    Py_DECREF(seq);
    if (g->addr0 >= 0) { /* staged, not single copy: the peers pull from the slot */
        __atomic_store_n(mine + g->addr0 + 2 * (e & 1), 0, __ATOMIC_RELAXED);
        __atomic_store_n(mine + g->addr0 + 2 * (e & 1) + 1, 0, __ATOMIC_RELAXED);
    }
    char *slot = g->slot[b][g->rank], *src = (char *)(uintptr_t)x;
    long long head = own_start < w ? own_start : w; /* the stream: x before our block, then after it */
    if (head > 0) memcpy(slot, src, (size_t)head);
    if (w > own_start) memcpy(slot + own_start, src + own_start + own_len, (size_t)(w - own_start));
    int code = do_arrive(g, e, v[6], (const int64_t *)(uintptr_t)v[7]);
    if (code == ARRIVED && nargs == 12) { /* the whole round in this call when y is exactly the rows received */
        int pulled = a2a_pull_core(g, b, e, v[8], v[9], v[10], x, own_start, own_len, 1);
        if (pulled < 0) return NULL;
        if (pulled == 0) code = DONE;
    }
    return PyLong_FromLong(code);
}

/* Our block and every sender's rows for us, from one round of slots, in source order: 0 copied;
 * 1 not handled (a single-copy sender, or a sender needing several rounds; nothing copied); with
 * `exact`, 2 when the rows received would not fill y exactly (nothing copied); -1 with an error set. */
static int a2a_pull_core(Group *g, long long b, long long e, long long y, long long y_nbytes, long long row_bytes,
                         long long x, long long own_start, long long own_len, int exact) {
    if (g->counts0 < 0 || (b != 0 && b != 1) || row_bytes <= 0 || y_nbytes < 0 || own_start < 0 || own_len < 0) {
        PyErr_Format(PyExc_ValueError, "_shmfast: bad a2a_pull arguments (b=%lld, row_bytes=%lld, y_nbytes=%lld, "
                     "own block [%lld, +%lld))", b, row_bytes, y_nbytes, own_start, own_len);
        return -1;
    }
    Py_ssize_t n = g->n, me = g->rank;
    int64_t *start = g->a2a, *at = g->a2a + n;
    long long y_end = 0;
    for (Py_ssize_t s = 0; s < n; s++) {
        const int64_t *row = block(g, s) + g->counts0 + (e & 1) * n;
        if (g->addr0 >= 0 && __atomic_load_n(block(g, s) + g->addr0 + 2 * (e & 1), __ATOMIC_RELAXED) != 0)
            return 1; /* a single-copy sender: Python reads it */
        long long rows = 0, before = 0, len;
        for (Py_ssize_t d = 0; d < n; d++) {
            long long c = __atomic_load_n(row + d, __ATOMIC_RELAXED);
            if (c < 0 || __builtin_add_overflow(rows, c, &rows)) return 1;
            if (d < me) before += c;
        }
        long long staged, mine = __atomic_load_n(row + me, __ATOMIC_RELAXED);
        long long own = __atomic_load_n(row + s, __ATOMIC_RELAXED);
        if (__builtin_mul_overflow(rows - own, row_bytes, &staged) || staged > g->slot_bytes)
            return 1; /* several rounds: Python's schedule */
        /* where our rows sit in the sender's stream (its own block is not in it) */
        start[s] = (before - (s < me ? own : 0)) * row_bytes;
        at[s] = y_end;
        if (__builtin_mul_overflow(mine, row_bytes, &len) || __builtin_add_overflow(y_end, len, &y_end))
            return 1;
    }
    if (exact && y_end != y_nbytes) return 2;
    if (y_end > y_nbytes || check_addr(y, y_end, "output") || check_addr(x, own_start + own_len, "input")) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "_shmfast: a2a_pull receives %lld bytes into an output of %lld", y_end, y_nbytes);
        return -1;
    }
    char *out = (char *)(uintptr_t)y;
    if (own_len > 0) memmove(out + at[me], (const char *)(uintptr_t)x + own_start, (size_t)own_len);
    for (Py_ssize_t s = 0; s < n; s++) {
        long long len = (s + 1 < n ? at[s + 1] : y_end) - at[s];
        if (s != me && len > 0) memcpy(out + at[s], g->slot[b][s] + start[s], (size_t)len);
    }
    return 0;
}

static PyObject *Group_a2a_pull(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[8]; /* b, e, y, y_nbytes, row_bytes, x, own_start, own_len */
    if (ints(args, nargs, 8, "a2a_pull", v)) return NULL;
    int code = a2a_pull_core(g, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], 0);
    return code < 0 ? NULL : PyLong_FromLong(code);
}

static PyObject *Group_all_gather(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    long long v[7]; /* b, e, x, out, nbytes, sig, sig_words */
    if (ints(args, nargs, 7, "all_gather", v) || check_slot(g, v[0], 0, v[4], "all_gather") ||
        check_addr(v[2], v[4], "input") || check_addr(v[3], v[4], "output") || arrive_args(v[5], v[6]))
        return NULL;
    char *x = (char *)(uintptr_t)v[2];
    if (v[4] > 0) memcpy(g->slot[v[0]][g->rank], x, (size_t)v[4]);
    int code = do_arrive(g, v[1], v[5], (const int64_t *)(uintptr_t)v[6]);
    if (code == ARRIVED) do_gather(g, (int)v[0], (char *)(uintptr_t)v[3], v[4], 0, v[4], x);
    return PyLong_FromLong(code);
}

static PyObject *Group_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"ctrl_addr", "ctrl_words", "n", "rank", "slots_addr", "slot_bytes", "spin", "yields",
                            "counts_word", "addr_word", "wait_word", NULL};
    Py_ssize_t ctrl, cw, n, rank, slots, sb, counts0 = -1, addr0 = -1, wait0 = -1;
    long spin, yields;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nnnnnnll|nnn:Group", names, &ctrl, &cw, &n, &rank, &slots, &sb, &spin,
                                     &yields, &counts0, &addr0, &wait0))
        return NULL;
    if ((counts0 >= 0 && counts0 + 2 * n > cw) || (addr0 >= 0 && addr0 + 4 > cw) || wait0 >= cw ||
        (wait0 >= 0 && wait0 <= W_EPOCH)) {
        PyErr_Format(PyExc_ValueError, "_shmfast.Group: counts_word %zd or addr_word %zd outside a control block of "
                     "%zd words", counts0, addr0, cw);
        return NULL;
    }
    if (ctrl <= 0 || slots <= 0 || cw < W_META0 + 2 * META_LEN || n < 1 || rank < 0 || rank >= n || sb < 0 ||
        spin < 0 || yields < 0 || sb > PY_SSIZE_T_MAX / 2 / n) {
        PyErr_Format(PyExc_ValueError, "_shmfast.Group: bad layout (ctrl_words=%zd must be >= %d, n=%zd, rank=%zd, "
                     "slot_bytes=%zd, spin=%ld, yields=%ld, addresses non-zero)", cw, W_META0 + 2 * META_LEN,
                     n, rank, sb, spin, yields);
        return NULL;
    }
    Group *g = (Group *)type->tp_alloc(type, 0);
    if (!g) return NULL;
    g->ctrl = (int64_t *)(uintptr_t)ctrl;
    g->ctrl_words = cw; g->n = n; g->rank = rank; g->slot_bytes = sb; g->spin = spin; g->yields = yields;
    g->counts0 = counts0; g->addr0 = addr0; g->wait0 = wait0;
    g->slot[0] = PyMem_New(char *, 3 * n);
    g->a2a = PyMem_New(int64_t, 2 * n);
    if (!g->slot[0] || !g->a2a) { Py_DECREF(g); return PyErr_NoMemory(); }
    g->slot[1] = g->slot[0] + n;
    g->srcs = g->slot[0] + 2 * n;
    for (Py_ssize_t r = 0; r < n; r++)
        for (int b = 0; b < 2; b++) g->slot[b][r] = (char *)(uintptr_t)slots + (r * 2 + b) * sb;
    return (PyObject *)g;
}

static void Group_dealloc(Group *g) {
    PyMem_Free(g->slot[0]);
    PyMem_Free(g->a2a);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))Group_##name, METH_FASTCALL, doc}
static PyMethodDef Group_methods[] = {
    FAST(arrive, "arrive(e, sig_value, sig_words_addr) -> 0 ARRIVED | 1 PENDING | 2 MISMATCH\n"
                 "Publish epoch e (with the signature when sig_value >= 0), then wait spin + yields turns."),
    FAST(publish, "publish(e): publish epoch e (release store) and wake the peers sleeping on it; no wait"),
    FAST(spin, "spin(e, budget_ns) -> bool: busy-wait up to budget_ns for every peer to reach epoch e (Linux; "
               "elsewhere one look); whether they all did"),
    FAST(sigs_match, "sigs_match(e, sig_value) -> bool: every peer's digest of epoch e equals sig_value"),
    FAST(stage, "stage(b, src_addr, nbytes, slot_off): copy into this rank's slot b"),
    FAST(pull, "pull(b, src_rank, slot_off, dst_addr, nbytes): copy out of rank src_rank's slot b"),
    FAST(sleep, "sleep(e, timeout_us) -> bool: sleep (futex, GIL released) until a peer this rank waits for "
                "publishes a new epoch or the timeout passes; whether every peer has reached epoch e"),
    FAST(reduce, "reduce(b, out_addr, count, dtype_code, op_code, slot_off, own_addr): out = op over ranks in order"),
    FAST(gather, "gather(b, out_addr, nbytes, slot_off, out_stride, own_addr): every rank's block, in rank order"),
    FAST(all_reduce, "all_reduce(b, e, x_addr, out_addr, count, dtype_code, op_code, sig_value, sig_words_addr) -> code\n"
                     "stage + arrive + (if ARRIVED) reduce"),
    FAST(a2a_post, "a2a_post(b, e, x_addr, total, own_start, own_len, counts, sig_value, sig_words_addr"
                   "[, y_addr, y_nbytes, row_bytes]) -> code\n"
                   "stage the first window of x without its own block, publish the send counts, arrive; given y, "
                   "and ARRIVED with a one-round exchange whose rows for us fill y_nbytes exactly, a2a_pull into "
                   "y too and return DONE (3)"),
    FAST(a2a_pull, "a2a_pull(b, e, y_addr, y_nbytes, row_bytes, x_addr, own_start, own_len) -> 0 done | 1 not handled\n"
                   "our block and every sender's rows for us from one round of slots, in source order"),
    FAST(reduce_scatter, "reduce_scatter(b, e, x_addr, out_addr, count, dtype_code, op_code, sig_value, "
                         "sig_words_addr) -> code\nstage all of x + arrive + (if ARRIVED) reduce this rank's block"),
    FAST(all_gather, "all_gather(b, e, x_addr, out_addr, nbytes, sig_value, sig_words_addr) -> code\n"
                     "stage + arrive + (if ARRIVED) gather"),
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Group_members[] = {
    {"n", T_PYSSIZET, offsetof(Group, n), READONLY, "ranks in the group"},
    {"rank", T_PYSSIZET, offsetof(Group, rank), READONLY, "this rank"},
    {"slot_bytes", T_PYSSIZET, offsetof(Group, slot_bytes), READONLY, "bytes per data slot"},
    {"spin", T_LONG, offsetof(Group, spin), READONLY, "busy-poll turns of a wait"},
    {"yields", T_LONG, offsetof(Group, yields), READONLY, "sched_yield turns after the spin"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject GroupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "transports._shmfast.Group",
    .tp_basicsize = sizeof(Group),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Group(ctrl_addr, ctrl_words, n, rank, slots_addr, slot_bytes, spin, yields): one rank's view of "
              "an shm segment's layout (addresses only; the caller keeps the mapping alive)",
    .tp_new = Group_new,
    .tp_dealloc = (destructor)Group_dealloc,
    .tp_methods = Group_methods,
    .tp_members = Group_members,
};

/* convert(src_addr, src_code, dst_addr, dst_code, count): float32 <-> float16/bfloat16 with the
 * conversions above, so tests can prove them against torch directly. */
static PyObject *convert(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    long long v[5];
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "convert() takes 5 arguments (%zd given)", nargs);
    for (int i = 0; i < 5; i++)
        if ((v[i] = PyLong_AsLongLong(args[i])) == -1 && PyErr_Occurred()) return NULL;
    if (v[4] < 0 || check_addr(v[0], v[4], "source") || check_addr(v[2], v[4], "destination")) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "convert: negative count");
        return NULL;
    }
    const void *s = (const void *)(uintptr_t)v[0];
    void *d = (void *)(uintptr_t)v[2];
    Py_ssize_t k = v[4];
    if (v[1] == DT_F16 && v[3] == DT_F32) for (Py_ssize_t i = 0; i < k; i++) ((float *)d)[i] = h2f(((const uint16_t *)s)[i]);
    else if (v[1] == DT_BF16 && v[3] == DT_F32) for (Py_ssize_t i = 0; i < k; i++) ((float *)d)[i] = bf2f(((const uint16_t *)s)[i]);
    else if (v[1] == DT_F32 && v[3] == DT_F16) for (Py_ssize_t i = 0; i < k; i++) ((uint16_t *)d)[i] = f2h(((const float *)s)[i]);
    else if (v[1] == DT_F32 && v[3] == DT_BF16) for (Py_ssize_t i = 0; i < k; i++) ((uint16_t *)d)[i] = f2bf(((const float *)s)[i]);
    else return PyErr_Format(PyExc_ValueError, "convert: no conversion from dtype code %lld to %lld", v[1], v[3]);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"convert", (PyCFunction)(void (*)(void))convert, METH_FASTCALL,
     "convert(src_addr, src_code, dst_addr, dst_code, count): float32 <-> float16 / bfloat16"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transports._shmfast",
    "The shm transport's small-message hot path in C (see transports/_shmfast.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__shmfast(void) {
    if (PyType_Ready(&GroupType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&GroupType);
    if (PyModule_AddObject(m, "Group", (PyObject *)&GroupType) < 0 ||
        PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "ARRIVED", ARRIVED) < 0 || PyModule_AddIntConstant(m, "PENDING", PENDING) < 0 ||
        PyModule_AddIntConstant(m, "MISMATCH", MISMATCH) < 0 || PyModule_AddIntConstant(m, "DONE", DONE) < 0 ||
#ifdef HAVE_FUTEX
        PyModule_AddIntConstant(m, "HAS_FUTEX", 1) < 0) {
#else
        PyModule_AddIntConstant(m, "HAS_FUTEX", 0) < 0) {
#endif
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
