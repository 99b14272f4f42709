/*
 * sparrowd.codec._native: the loops numpy cannot fuse. Every function has a
 * numpy twin that gives the same result (the fallback where no compiler was
 * found at install time); the tests hold the two to each other.
 *
 * diff_into(old, new, itemsize, start, end, idx_out, old_out, new_out, portable=False, update=False,
 *           hash_old=None, hash_new=None, rank=None) -> (count, stop)
 *
 * Compares the raw bit patterns of two equally long byte buffers holding
 * elements of `itemsize` bytes (1, 2, 4 or 8), elements [start, end), and
 * writes each differing element's flat index (int64) and its old and new bit
 * patterns into the three output buffers, in one pass over memory: numpy
 * needs a compare pass, a mask, a nonzero pass and two gathers. It stops
 * when the outputs have no room for the next block and returns how many it
 * wrote and the element it stopped at, so the caller can go on with larger
 * buffers; `stop` equals `end` when the scan is complete. Block by block,
 * while each is still in cache, it feeds the scanned range of each side to
 * the XXH3-128 state given for it (`hasher()`, read with `digest()`), and
 * with `update` overwrites the differing elements of `old` with the new bits
 * (a kept copy brought up to date), the fingerprint of `old` taken first.
 * With `rank` (parse_ranking, below) it also does ulp2's class scan of `old`
 * (class_ranks) block by block, before the update, while the block is in cache.
 *
 * The scan only looks inside a step of 32 or 64 bytes whose compare found a
 * difference, so at RL densities (about 1% of elements) it runs at memory
 * speed. An AVX2 scan is chosen at import where the CPU has it (`SIMD` names
 * the one in use); `portable` forces the plain C one. The GIL is released
 * while any of these loops run.
 *
 * rice_index, ulp_encode and ulp_streams (below) are the hot loops of encoding.
 *
 * class_ranks and class_positions are the two scans of the ulp2 value mode
 * (docs/FORMAT.md): an element's class is the exponent field of its base bit
 * pattern relative to the segment's `lo`, clamped to 16 classes, and a changed
 * position is coded as its rank among the elements of its class in the
 * segment. Both make one pass over the base bits of the segment with a counter
 * per class (AVX2: byte-lane counters per block of 256 elements; AVX-512:
 * 64-bit compare masks per class and popcounts), and diff_into can do the
 * encoder's as it diffs. class_sort and ulp2_pack then build and range-code
 * the stream, ulp2_unpack decodes it.
 *
 * No numpy headers: everything goes through the buffer protocol.
 */
#ifndef SPARROWD_SOURCE
#define SPARROWD_SOURCE "" /* setup.py passes the digest of this file (blake2b, 8 bytes, hex) */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h" /* vendored: vendor/xxhash (BSD-2-Clause) */
#ifdef SPARROWD_XXH_DISPATCH
#include "xxh_x86dispatch.h" /* the widest XXH3 kernel this CPU runs, chosen at run time */
#define HASH_UPDATE XXH3_128bits_update_dispatch
#else
#define HASH_UPDATE XXH3_128bits_update
#endif

/*
 * What a scan does with each block once it is compared, while the block is
 * still in cache: feed both sides to their fingerprints (either may be
 * NULL), and with `update` write the new bits of the block's changes into
 * `old`. `done` (elements) and `written` (changes) say how far it got, so a
 * scan that stops early for room has settled exactly what it scanned.
 */
#define NCLASS 16 /* classes: the exponent relative to the segment's `lo`, clamped to [0, 15] */

struct classing {
    const void *base;
    const void *old; /* class_ranks: the base's bits at the indices, when `base` holds new bits there */
    int isz, shift;
    uint64_t mask;
    int64_t lo;
};

/*
 * class_ranks' scan done by diff_into as it settles each block, while the block is in cache: the
 * block's changes (the entries of idx it just wrote) get their classes and ranks, and the census
 * its rows. Nothing is scanned until the range shows its first change (a tensor that did not change
 * costs nothing); the stretch before it is scanned then. Its state outlives a diff_into call that
 * stops for room (`state`: int64 [done, seen, counts...]).
 */
struct ranking {
    struct classing k;
    int simd;
    Py_ssize_t start, every, done, j; /* j: the entries of this call's idx already ranked */
    int seen;
    uint8_t *cls;
    int64_t *rank, *census, counts[NCLASS];
    /* An ulp2 change history's positions (sorted; hm of them, hj classed so far): each one's class in
       the base goes to hcls as its block is scanned, rather than by a read of the base per entry later
       (at a few percent of elements, a read per cache line: a second pass over memory). */
    const int64_t *hpos;
    Py_ssize_t hm, hj;
    uint8_t *hcls;
};

static void rank_to(struct ranking *r, Py_ssize_t upto, const int64_t *idx, Py_ssize_t c);

struct settle {
    XXH3_state_t *ho, *hn;
    int update;
    Py_ssize_t done, written;
    struct ranking *rk; /* with one, each block is also class-scanned, before its update */
};

static void settle_to(struct settle *x, const char *o, const char *n, size_t isz, Py_ssize_t upto,
                      const int64_t *idx, const char *nv, Py_ssize_t c) {
    if (x->rk) rank_to(x->rk, upto, idx, c);
    if (upto > x->done) {
        if (x->ho) HASH_UPDATE(x->ho, o + x->done * isz, (size_t)(upto - x->done) * isz);
        if (x->hn) HASH_UPDATE(x->hn, n + x->done * isz, (size_t)(upto - x->done) * isz);
        x->done = upto;
    }
    if (x->update)
        for (Py_ssize_t j = x->written; j < c; j++) memcpy((char *)o + idx[j] * isz, nv + j * isz, isz);
    x->written = c;
}
#define SETTLE(T) settle_to(x, (const char *)o, (const char *)n, sizeof(T), e, idx, (const char *)nv, c)

/*
 * Lane masks: the top bit of each lane of a 64-bit word is set iff that lane
 * of `x` is non-zero (the SWAR test: adding 0x7F.. carries into the top bit
 * of any lane with a low bit set; OR-ing x catches the top bit itself).
 */
static inline uint64_t lanes_nonzero(uint64_t x, uint64_t low) { return (((x & low) + low) | x) & ~low; }

#define BLOCK_GROUPS 2048 /* 64 KiB of each side per block: the second look hits L2 */

/*
 * One scan per element width. Elements before the first 32-byte group
 * boundary and after the last one go one at a time. The groups in between go
 * block by block, in two branch-free passes, because at RL densities about
 * one 32-byte group in six differs, at random, and a branch per group would
 * mispredict on each of them:
 *   1. each group's four 64-bit words are XOR-ed; the group's number is
 *      written to a list and the list grows only if the XOR is non-zero;
 *   2. for each listed group, each word's lane mask gives its first changed
 *      element, written out unconditionally, the count growing only for words
 *      that differ; the rare word with two or more changes loops for the rest.
 * A block is cut to what the output has room for (every element of it
 * changed), which keeps every restart point on a block boundary.
 */
/* Elements [e, limit) one at a time (the ragged ends); stops when the output is full. */
#define ONE_BY_ONE(limit)                                                                                    \
    for (; e < (limit); e++) {                                                                               \
        if (o[e] != n[e]) {                                                                                  \
            if (c == cap) goto out;                                                                          \
            idx[c] = e, ov[c] = o[e], nv[c] = n[e], c++;                                                     \
        }                                                                                                    \
    }

/* The ragged tail one at a time, then what every scan does on leaving: settle what it scanned. */
#define SCAN_END(T)                                                                                          \
    ONE_BY_ONE(total);                                                                                       \
    out:                                                                                                     \
    SETTLE(T);                                                                                               \
    *count = c;                                                                                              \
    return e

#define DEFINE_SCAN(T, NAME, LOW, SHIFT)                                                                     \
    static Py_ssize_t NAME(const T *o, const T *n, Py_ssize_t total, Py_ssize_t e, int64_t *idx, T *ov,     \
                           T *nv, Py_ssize_t cap, Py_ssize_t *count, struct settle *x) {                     \
        const Py_ssize_t per_word = 8 / (Py_ssize_t)sizeof(T), per_group = 4 * per_word;                     \
        uint32_t touched[BLOCK_GROUPS], words[4 * BLOCK_GROUPS];                                             \
        uint64_t masks[4 * BLOCK_GROUPS];                                                                    \
        Py_ssize_t c = *count;                                                                               \
        Py_ssize_t head = ((e + per_group - 1) / per_group) * per_group;                                     \
        Py_ssize_t body = (total / per_group) * per_group;                                                   \
        if (head > total) head = total;                                                                      \
        if (body < head) body = head;                                                                        \
        ONE_BY_ONE(head);                                                                                    \
        while (e < body) {                                                                                   \
            Py_ssize_t groups = (body - e) / per_group;                                                      \
            if (groups > BLOCK_GROUPS) groups = BLOCK_GROUPS;                                                \
            if (groups > (cap - c) / per_group) groups = (cap - c) / per_group; /* as much as fits */         \
            if (groups == 0) goto out;                                                                       \
            Py_ssize_t nt = 0;                                                                               \
            for (Py_ssize_t g = 0; g < groups; g++) {                                                        \
                uint64_t a[4], b[4];                                                                         \
                memcpy(a, o + e + g * per_group, 32);                                                        \
                memcpy(b, n + e + g * per_group, 32);                                                        \
                touched[nt] = (uint32_t)g;                                                                   \
                nt += ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3])) != 0;                  \
            }                                                                                                \
            Py_ssize_t nw = 0;                                                                               \
            for (Py_ssize_t t = 0; t < nt; t++) {                                                            \
                const Py_ssize_t g = touched[t];                                                             \
                for (int w = 0; w < 4; w++) {                                                                \
                    uint64_t a, b;                                                                           \
                    memcpy(&a, o + e + g * per_group + w * per_word, 8);                                     \
                    memcpy(&b, n + e + g * per_group + w * per_word, 8);                                     \
                    words[nw] = (uint32_t)(4 * g + w);                                                       \
                    masks[nw] = lanes_nonzero(a ^ b, LOW);                                                   \
                    nw += a != b;                                                                            \
                }                                                                                            \
            }                                                                                                \
            for (Py_ssize_t t = 0; t < nw; t++) {                                                            \
                const Py_ssize_t base = e + (Py_ssize_t)words[t] * per_word;                                 \
                uint64_t m = masks[t];                                                                       \
                Py_ssize_t k = base + (__builtin_ctzll(m) >> SHIFT);                                         \
                idx[c] = k, ov[c] = o[k], nv[c] = n[k], c++;                                                 \
                m &= m - 1;                                                                                  \
                while (__builtin_expect(m != 0, 0)) {                                                        \
                    k = base + (__builtin_ctzll(m) >> SHIFT);                                                \
                    idx[c] = k, ov[c] = o[k], nv[c] = n[k], c++;                                             \
                    m &= m - 1;                                                                              \
                }                                                                                            \
            }                                                                                                \
            e += groups * per_group;                                                                         \
            SETTLE(T);                                                                                       \
        }                                                                                                    \
        SCAN_END(T);                                                                                         \
    }

DEFINE_SCAN(uint8_t, scan8, 0x7F7F7F7F7F7F7F7FULL, 3)
DEFINE_SCAN(uint16_t, scan16, 0x7FFF7FFF7FFF7FFFULL, 4)
DEFINE_SCAN(uint32_t, scan32, 0x7FFFFFFF7FFFFFFFULL, 5)
DEFINE_SCAN(uint64_t, scan64, 0x7FFFFFFFFFFFFFFFULL, 6)

typedef Py_ssize_t (*scan_fn)(const void *, const void *, Py_ssize_t, Py_ssize_t, int64_t *, void *, void *,
                              Py_ssize_t, Py_ssize_t *, struct settle *);
#define AS_SCAN(f) ((scan_fn)(void *)(f))
static scan_fn portable[4] = {AS_SCAN(scan8), AS_SCAN(scan16), AS_SCAN(scan32), AS_SCAN(scan64)};
static scan_fn chosen[4] = {AS_SCAN(scan8), AS_SCAN(scan16), AS_SCAN(scan32), AS_SCAN(scan64)};

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
/*
 * The same two passes with AVX2, chosen at import when the CPU has it. Pass 1
 * compares 64 bytes of each side per step with one equality compare per 32
 * bytes; movemask gives one bit per byte, so the step's 64-bit mask of
 * unequal bytes is already a per-element mask (all of an element's bytes set
 * together). Steps with a non-zero mask are listed branch-free; pass 2 walks
 * each listed mask with tzcnt. Numpy's own compare is vectorised the same
 * way, so this scan keeps pace with the read-and-compare baseline.
 */
#define BLOCK_STEPS 64 /* 4 KiB of each side per block: settled (hashed, class-scanned) while the hardware
                          prefetcher still streams the next; 128 KiB blocks made the encode 5-8% slower */
/* Each step also asks for the lines 2 KiB ahead of it on both sides, one a step rather than a burst
   (which stalls on the core's fill buffers): the loads of the block after this one are under way
   while this one settles. The 512 MiB pair's diff on one thread went from 102 to 79-85 ms (one core
   reading 10.5 -> 13 GB/s), with both fingerprints from 105 to 87-90; 1 and 4 KiB ahead did worse. */
#define PF_DIST 2048
#define DEFINE_SCAN_AVX2(T, NAME, CMPEQ)                                                                    \
    __attribute__((target("avx2,bmi"))) static Py_ssize_t NAME(const T *o, const T *n, Py_ssize_t total,     \
                                                              Py_ssize_t e, int64_t *idx, T *ov, T *nv,      \
                                                              Py_ssize_t cap, Py_ssize_t *count,             \
                                                              struct settle *x) {                            \
        const Py_ssize_t per_step = 64 / (Py_ssize_t)sizeof(T);                                              \
        const uint64_t lane = sizeof(T) == 8 ? 0xFFULL : ((1ULL << sizeof(T)) - 1);                          \
        uint64_t masks[BLOCK_STEPS];                                                                         \
        uint32_t steps[BLOCK_STEPS];                                                                         \
        Py_ssize_t c = *count;                                                                               \
        const Py_ssize_t body = e + ((total - e) / per_step) * per_step;                                     \
        while (e < body) {                                                                                   \
            Py_ssize_t k = (body - e) / per_step;                                                            \
            if (k > BLOCK_STEPS) k = BLOCK_STEPS;                                                            \
            if (k > (cap - c) / per_step) k = (cap - c) / per_step; /* as much as fits */                    \
            if (k == 0) goto out;                                                                            \
            const char *po = (const char *)(o + e), *pn = (const char *)(n + e);                             \
            Py_ssize_t nt = 0;                                                                               \
            for (Py_ssize_t s = 0; s < k; s++) {                                                             \
                _mm_prefetch(po + 64 * s + PF_DIST, _MM_HINT_T0);                                            \
                _mm_prefetch(pn + 64 * s + PF_DIST, _MM_HINT_T0);                                            \
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(po + 64 * s));                      \
                const __m256i a1 = _mm256_loadu_si256((const __m256i *)(po + 64 * s + 32));                 \
                const __m256i b0 = _mm256_loadu_si256((const __m256i *)(pn + 64 * s));                      \
                const __m256i b1 = _mm256_loadu_si256((const __m256i *)(pn + 64 * s + 32));                 \
                const uint64_t eq = (uint32_t)_mm256_movemask_epi8(CMPEQ(a0, b0)) |                          \
                                    (uint64_t)(uint32_t)_mm256_movemask_epi8(CMPEQ(a1, b1)) << 32;           \
                masks[nt] = ~eq;                                                                             \
                steps[nt] = (uint32_t)s;                                                                     \
                nt += eq != ~0ULL;                                                                           \
            }                                                                                                \
            for (Py_ssize_t t = 0; t < nt; t++) {                                                            \
                const Py_ssize_t base = e + (Py_ssize_t)steps[t] * per_step;                                 \
                uint64_t m = masks[t];                                                                       \
                do {                                                                                         \
                    const int bit = __builtin_ctzll(m);                                                      \
                    const Py_ssize_t at = base + bit / (int)sizeof(T);                                       \
                    idx[c] = at, ov[c] = o[at], nv[c] = n[at], c++;                                          \
                    m &= ~(lane << bit);                                                                     \
                } while (m);                                                                                 \
            }                                                                                                \
            e += k * per_step;                                                                               \
            SETTLE(T);                                                                                       \
        }                                                                                                    \
        SCAN_END(T);                                                                                         \
    }

DEFINE_SCAN_AVX2(uint8_t, scan8_avx2, _mm256_cmpeq_epi8)
DEFINE_SCAN_AVX2(uint16_t, scan16_avx2, _mm256_cmpeq_epi16)
DEFINE_SCAN_AVX2(uint32_t, scan32_avx2, _mm256_cmpeq_epi32)
DEFINE_SCAN_AVX2(uint64_t, scan64_avx2, _mm256_cmpeq_epi64)

static int pick_simd(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("bmi")) return 0;
    chosen[0] = AS_SCAN(scan8_avx2), chosen[1] = AS_SCAN(scan16_avx2);
    chosen[2] = AS_SCAN(scan32_avx2), chosen[3] = AS_SCAN(scan64_avx2);
    return 1;
}
#else
static int pick_simd(void) { return 0; }
#endif

#define HASHER "sparrowd.xxh3_128"

static void hasher_free(PyObject *cap) { XXH3_freeState(PyCapsule_GetPointer(cap, HASHER)); }

/* hasher() -> a fresh XXH3-128 state (seed 0) for diff_into; digest(h) -> its 16 canonical bytes. */
static PyObject *hasher(PyObject *self, PyObject *unused) {
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) return PyErr_NoMemory();
    XXH3_128bits_reset(st);
    PyObject *cap = PyCapsule_New(st, HASHER, hasher_free);
    if (cap == NULL) XXH3_freeState(st);
    return cap;
}

static XXH3_state_t *hasher_state(PyObject *o) {
    if (o == Py_None) return NULL;
    return PyCapsule_GetPointer(o, HASHER); /* NULL with an exception set when o is not a hasher */
}

static PyObject *digest(PyObject *self, PyObject *o) {
    XXH3_state_t *st = PyCapsule_GetPointer(o, HASHER);
    if (st == NULL) return NULL;
    XXH128_canonical_t out;
    XXH128_canonicalFromHash(&out, XXH3_128bits_digest(st));
    return PyBytes_FromStringAndSize((const char *)out.digest, sizeof out.digest);
}

static int parse_ranking(struct ranking *r, PyObject *spec, const Py_buffer *ob, int isz, Py_ssize_t start,
                         Py_ssize_t cap, Py_buffer bufs[6]);

static PyObject *diff_into(PyObject *self, PyObject *args) {
    Py_buffer ob = {0}, nb, ib, vb, wb, rbufs[6] = {{0}};
    PyObject *old, *ho = Py_None, *hn = Py_None, *spec = Py_None;
    int isz, plain = 0, update = 0;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "Oy*innw*w*w*|ppOOO", &old, &nb, &isz, &start, &end, &ib, &vb, &wb, &plain, &update,
                          &ho, &hn, &spec))
        return NULL;
    PyObject *result = NULL;
    struct ranking rk;
    struct settle x = {NULL, NULL, update, start, 0, NULL};
    if ((ho != Py_None && (x.ho = hasher_state(ho)) == NULL) || (hn != Py_None && (x.hn = hasher_state(hn)) == NULL))
        goto done;
    if (PyObject_GetBuffer(old, &ob, update ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) goto done;
    if (isz != 1 && isz != 2 && isz != 4 && isz != 8) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 1, 2, 4 or 8");
        goto done;
    }
    if (ob.len != nb.len || ob.len % isz != 0) {
        PyErr_SetString(PyExc_ValueError, "old and new must be equally long, whole elements");
        goto done;
    }
    if (start < 0 || end < start || end > ob.len / isz) {
        PyErr_SetString(PyExc_ValueError, "element range out of bounds");
        goto done;
    }
    Py_ssize_t cap = ib.len / (Py_ssize_t)sizeof(int64_t);
    if (vb.len / isz < cap) cap = vb.len / isz;
    if (wb.len / isz < cap) cap = wb.len / isz;
    if (((uintptr_t)ob.buf | (uintptr_t)nb.buf | (uintptr_t)vb.buf | (uintptr_t)wb.buf) % isz ||
        (uintptr_t)ib.buf % sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "buffers must be aligned to their element size");
        goto done;
    }
    if (spec != Py_None) {
        if (!parse_ranking(&rk, spec, &ob, isz, start, cap, rbufs)) goto done;
        x.rk = &rk;
    }
    Py_ssize_t count = 0, stop = start;
    int64_t *idx = (int64_t *)ib.buf;
    Py_BEGIN_ALLOW_THREADS
    const int which = isz == 1 ? 0 : isz == 2 ? 1 : isz == 4 ? 2 : 3;
    stop = (plain ? portable : chosen)[which](ob.buf, nb.buf, end, start, idx, vb.buf, wb.buf, cap, &count, &x);
    Py_END_ALLOW_THREADS
    if (x.rk) { /* what the next call (after more room) goes on from */
        int64_t *st = rbufs[3].buf;
        st[0] = rk.done, st[1] = rk.seen;
        memcpy(st + 2, rk.counts, sizeof rk.counts);
    }
    result = Py_BuildValue("nn", count, stop);
done:
    for (int i = 0; i < 6; i++)
        if (rbufs[i].obj != NULL) PyBuffer_Release(&rbufs[i]);
    if (ob.obj != NULL) PyBuffer_Release(&ob);
    PyBuffer_Release(&nb);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&wb);
    return result;
}

/* MSB-first bit packing: `held` (< 32 between calls) pending bits in `acc`. */
struct bit_writer {
    uint64_t acc;
    int held;
    uint8_t *out;
};

static inline void put_bits(struct bit_writer *w, uint64_t v, int nbits) { /* 1 <= nbits <= 32 */
    /* Branch-free: the next four bytes are stored every time (the buffer has
     * four bytes of slack) and kept only once 32 bits are complete, because
     * whether they are depends on the data and would mispredict. */
    w->acc = (w->acc << nbits) | v;
    w->held += nbits;
    const int full = w->held >= 32;
    w->held -= full << 5;
    const uint32_t x = __builtin_bswap32((uint32_t)(w->acc >> w->held));
    memcpy(w->out, &x, 4);
    w->out += full << 2;
}

/* The last partial byte, zero-padded. */
static inline void flush_bits(struct bit_writer *w) {
    while (w->held >= 8) w->held -= 8, *w->out++ = (uint8_t)(w->acc >> w->held);
    if (w->held) *w->out++ = (uint8_t)(w->acc << (8 - w->held)), w->held = 0;
}

/*
 * rice_index(indices, start, kmin, kmax) -> (k, unary, rem)
 *
 * The Rice code of a sparse segment's positions (docs/FORMAT.md): gaps
 * g[i] = p[i] - p[i-1] - 1 with p[-1] = start - 1, each as g >> k zero bits
 * and a one bit (`unary`), and its low k bits (`rem`), both MSB-first. k is
 * the cheapest in [kmin, kmax] (the smallest on a tie), costed exactly, the
 * same rule as bits.rice_k; the caller picks the range from the mean gap.
 * Positions must be int64, increasing, and at or after `start`.
 */
/* The gaps g of sorted positions p (g = p[i] - p[i-1] - 1, with p[-1] = start - 1): into sums[j]
   the sum of g >> (kmin + j) for each candidate Rice parameter from kmin to kmax (at most 8), whose
   exact cost is then n * (k + 1) + sums (rice_pick). Returns whether the positions increase from
   `start` (the same pass checks it). */
static int rice_sums(const int64_t *p, Py_ssize_t n, int64_t start, int kmin, int kmax, uint64_t sums[8]) {
    if (!n) return 1;
    const int nk = kmax - kmin + 1;
    int ordered = p[0] >= start;
    for (int j = 0; j < nk; j++) sums[j] = (uint64_t)(p[0] - start) >> (kmin + j);
    for (int j = 0; j < nk; j += 2) { /* two candidates per pass: a loop the compiler vectorises */
        const int k0 = kmin + j, k1 = j + 1 < nk ? k0 + 1 : 63;
        uint64_t s0 = 0, s1 = 0, bad = 0;
        for (Py_ssize_t i = 1; i < n; i++) {
            const uint64_t g = (uint64_t)(p[i] - p[i - 1] - 1);
            bad |= g;
            s0 += g >> k0;
            s1 += g >> k1;
        }
        ordered &= (int64_t)bad >= 0; /* a gap below 0 (out of order) sets the top bit */
        sums[j] += s0;
        if (j + 1 < nk) sums[j + 1] += s1;
    }
    return ordered;
}

/* The cheapest of the candidates rice_sums costed (the smallest on a tie). */
static int rice_pick(Py_ssize_t n, int kmin, int kmax, const uint64_t sums[8]) {
    uint64_t best = 0;
    int k = kmin;
    for (int j = 0; j <= kmax - kmin; j++) {
        const uint64_t cost = (uint64_t)n * (uint64_t)(kmin + j + 1) + sums[j];
        if (j == 0 || cost < best) best = cost, k = kmin + j;
    }
    return k;
}

static PyObject *rice_index(PyObject *self, PyObject *args) {
    Py_buffer ib;
    Py_ssize_t start;
    int kmin, kmax;
    if (!PyArg_ParseTuple(args, "y*nii", &ib, &start, &kmin, &kmax)) return NULL;
    PyObject *result = NULL, *unary = NULL, *rem = NULL;
    const Py_ssize_t n = ib.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *p = (const int64_t *)ib.buf;
    if (ib.len % (Py_ssize_t)sizeof(int64_t) || (uintptr_t)ib.buf % sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "indices must be an aligned int64 buffer");
        goto done;
    }
    if (kmin < 0 || kmax < kmin || kmax > 40 || kmax - kmin > 7) {
        PyErr_SetString(PyExc_ValueError, "Rice parameters must lie in [0, 40], at most 8 of them");
        goto done;
    }
    uint64_t sums[8] = {0};
    int k, ordered;
    Py_BEGIN_ALLOW_THREADS
    ordered = rice_sums(p, n, start, kmin, kmax, sums);
    k = rice_pick(n, kmin, kmax, sums);
    Py_END_ALLOW_THREADS
    if (!ordered) {
        PyErr_SetString(PyExc_ValueError, "indices must increase and start at or after `start`");
        goto done;
    }
    const uint64_t ubits = sums[k - kmin] + (uint64_t)n;
    const Py_ssize_t ulen = (Py_ssize_t)((ubits + 7) / 8), rlen = (Py_ssize_t)(((uint64_t)n * (uint64_t)k + 7) / 8);
    const Py_ssize_t uwords = ulen / 8 + 1; /* the unary stream is built in whole 64-bit words */
    unary = PyBytes_FromStringAndSize(NULL, uwords * 8);
    rem = PyBytes_FromStringAndSize(NULL, rlen + 4); /* + the writer's slack */
    if (unary == NULL || rem == NULL) goto done;
    {
        uint8_t *u = (uint8_t *)PyBytes_AS_STRING(unary);
        struct bit_writer rw = {0, 0, (uint8_t *)PyBytes_AS_STRING(rem)};
        Py_BEGIN_ALLOW_THREADS
        /* Unary: each value's one bit lands at a position that only grows; the word holding it
         * is kept in a register and stored (big-endian) when the position leaves it. Words
         * skipped by a long run of zeros stay as the memset left them. */
        memset(u, 0, (size_t)uwords * 8);
        uint64_t at = 0, word = 0, held_word = 0;
        const uint64_t low = k ? (~0ULL >> (64 - k)) : 0;
        int64_t prev = (int64_t)start - 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t g = (uint64_t)(p[i] - prev - 1);
            prev = p[i];
            at += g >> k; /* g >> k zeros, then the one */
            if ((at >> 6) != held_word) {
                const uint64_t be = __builtin_bswap64(word);
                memcpy(u + 8 * held_word, &be, 8);
                held_word = at >> 6, word = 0;
            }
            word |= 0x8000000000000000ULL >> (at & 63);
            at++;
            if (k > 32) put_bits(&rw, g >> 32 & low >> 32, k - 32); /* gaps of billions */
            if (k) put_bits(&rw, g & 0xFFFFFFFFu & low, k > 32 ? 32 : k);
        }
        const uint64_t be = __builtin_bswap64(word);
        memcpy(u + 8 * held_word, &be, 8);
        flush_bits(&rw);
        Py_END_ALLOW_THREADS
    }
    if (_PyBytes_Resize(&unary, ulen) < 0 || _PyBytes_Resize(&rem, rlen) < 0) goto done;
    result = Py_BuildValue("iOO", k, unary, rem);
done:
    Py_XDECREF(unary);
    Py_XDECREF(rem);
    PyBuffer_Release(&ib);
    return result;
}

/*
 * rice_positions(unary, rem, n, k, start, stop, out) -> (status, ones)
 *
 * The inverse of rice_index, to positions in one pass: each one bit of `unary` ends a gap whose
 * high part is the zero bits before it and whose low k bits come next from `rem` (both MSB-first);
 * p[i] = p[i-1] + g + 1 from p[-1] = start - 1, into out (int64, n of them). `rem` must hold
 * (n * k + 7) / 8 bytes (the caller checks). Status, in the order bits.rice_decode and a sparse
 * segment's decoder check: 0 all well; 1 the unary stream holds `ones` values rather than n, or
 * ends in a byte with no one bit; 2 a gap reaches stop - start; 3 a position reaches stop. Nothing
 * beyond out's n entries is written whatever the input.
 */
static PyObject *rice_positions(PyObject *self, PyObject *args) {
    Py_buffer ub, rb, ob;
    Py_ssize_t n;
    int k;
    long long start, stop;
    if (!PyArg_ParseTuple(args, "y*y*niLLw*", &ub, &rb, &n, &k, &start, &stop, &ob)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || k < 0 || k > 56 || stop < start || ob.len != n * 8 || (uintptr_t)ob.buf % 8 ||
        rb.len < (Py_ssize_t)(((uint64_t)n * (uint64_t)k + 7) / 8)) {
        PyErr_SetString(PyExc_ValueError, "rice_positions: bad count, parameter, range or buffers");
        goto done;
    }
    const uint8_t *u = ub.buf, *r = rb.buf;
    const Py_ssize_t ulen = ub.len, rlen = rb.len;
    int64_t *out = ob.buf;
    const uint64_t span = (uint64_t)(stop - start);
    Py_ssize_t ones = 0, last = -1; /* last: the byte of the last one bit */
    int gap_bad = 0, beyond = 0;
    Py_BEGIN_ALLOW_THREADS
    uint64_t q = 0, rbit = 0, taken = 0; /* taken: positions used from start, p[i] - start + 1 */
    for (Py_ssize_t i = 0; i < ulen; i++) {
        unsigned b = u[i];
        if (!b) {
            q += 8;
            continue;
        }
        last = i;
        int used = 0; /* bits of this byte already read, from the top */
        while (b) {
            const int at = __builtin_clz(b) - (int)(8 * sizeof(unsigned) - 8); /* the next one bit, 0 = MSB */
            q += (uint64_t)(at - used);
            b &= ~(0x80u >> at);
            used = at + 1;
            if (ones < n && !gap_bad && !beyond) {
                uint64_t low = 0;
                if (k) { /* k bits at rbit, MSB-first, through an 8-byte big-endian window */
                    const Py_ssize_t byte = (Py_ssize_t)(rbit >> 3);
                    uint64_t w = 0;
                    if (rlen - byte >= 8) {
                        memcpy(&w, r + byte, 8);
                        w = __builtin_bswap64(w);
                    } else {
                        for (Py_ssize_t j = 0; j < 8; j++) w = w << 8 | (byte + j < rlen ? r[byte + j] : 0);
                    }
                    low = (w << (rbit & 7)) >> (64 - k);
                    rbit += (uint64_t)k;
                }
                if (q > (span >> k)) { /* q << k alone passes the span (and might not fit) */
                    gap_bad = 1;
                } else {
                    const uint64_t g = q << k | low;
                    if (g >= span) gap_bad = 1;
                    else if (taken + g + 1 > span) beyond = 1;
                    else taken += g + 1, out[ones] = start + (int64_t)taken - 1;
                }
            }
            ones++;
            q = 0;
        }
        q += (uint64_t)(8 - used);
    }
    Py_END_ALLOW_THREADS
    const int status = ones != n || (n && last != ulen - 1) ? 1 : gap_bad ? 2 : beyond ? 3 : 0;
    result = Py_BuildValue("(in)", status, ones);
done:
    PyBuffer_Release(&ub);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&ob);
    return result;
}

/*
 * ulp_encode(old, new, itemsize, out): the zigzag-coded ulp distance from
 * each old to each new bit pattern (bits.ulp_encode), in one pass: the order
 * key of a sign-magnitude float flips every bit of a negative and only the
 * sign bit of a positive, the distance is the difference of keys modulo
 * 2**bits read as signed, and zigzag maps it to an unsigned code.
 *
 * ulp_streams(codes, itemsize) -> (signs, narrow, escapes): a ulp segment's
 * value streams (docs/FORMAT.md): with zm = code - 1, the bits zm & 1 packed
 * MSB-first, one byte min(zm >> 1, 255) per element, and for each byte at 255
 * the little-endian integer (zm >> 1) - 255 (the caller cuts it into planes).
 */
#define DEFINE_ULP(T, NAME, STREAMS)                                                                        \
    static void NAME(const T *o, const T *n, T *z, Py_ssize_t count) {                                       \
        const int top = 8 * (int)sizeof(T) - 1;                                                              \
        const T sign = (T)((T)1 << top);                                                                     \
        for (Py_ssize_t i = 0; i < count; i++) {                                                             \
            const T ko = o[i] ^ (T)((o[i] >> top) ? (T)~(T)0 : sign);                                        \
            const T kn = n[i] ^ (T)((n[i] >> top) ? (T)~(T)0 : sign);                                        \
            const T d = (T)(kn - ko);                                                                        \
            z[i] = (T)((T)(d << 1) ^ (T)((d >> top) ? (T)~(T)0 : 0));                                        \
        }                                                                                                    \
    }                                                                                                        \
    __attribute__((noinline)) static Py_ssize_t STREAMS(const T *z, Py_ssize_t count, uint8_t *signs,           \
                                                        uint8_t *narrow, T *esc) {                             \
        /* Three simple loops the compiler vectorises; escapes are rare, so their loop only runs when needed. */ \
        Py_ssize_t ne = 0;                                                                                   \
        for (Py_ssize_t i = 0; i < count; i++) {                                                             \
            const T mag = (T)((T)(z[i] - 1) >> 1);                                                           \
            narrow[i] = mag < 255 ? (uint8_t)mag : 255;                                                      \
            ne += mag >= 255;                                                                                \
        }                                                                                                    \
        for (Py_ssize_t b = 0; b < count / 8; b++) {                                                         \
            unsigned bits = 0;                                                                               \
            for (int j = 0; j < 8; j++) bits |= (unsigned)((T)(z[8 * b + j] - 1) & 1) << (7 - j);           \
            signs[b] = (uint8_t)bits;                                                                        \
        }                                                                                                    \
        if (count & 7) {                                                                                     \
            unsigned bits = 0;                                                                               \
            for (Py_ssize_t i = count & ~(Py_ssize_t)7; i < count; i++)                                      \
                bits |= (unsigned)((T)(z[i] - 1) & 1) << (7 - (i & 7));                                      \
            signs[count >> 3] = (uint8_t)bits;                                                               \
        }                                                                                                    \
        if (ne) {                                                                                            \
            ne = 0;                                                                                          \
            for (Py_ssize_t i = 0; i < count; i++) {                                                         \
                const T mag = (T)((T)(z[i] - 1) >> 1);                                                       \
                if (mag >= 255) esc[ne++] = (T)(mag - 255);                                                  \
            }                                                                                                \
        }                                                                                                    \
        return ne;                                                                                           \
    }

DEFINE_ULP(uint8_t, ulp8, streams8)
DEFINE_ULP(uint16_t, ulp16, streams16)
DEFINE_ULP(uint32_t, ulp32, streams32)
DEFINE_ULP(uint64_t, ulp64, streams64)

/*
 * ulp_codes(signs, narrow, escapes, itemsize, out) -> None
 *
 * The inverse of ulp_streams: each element's zigzag code from its magnitude byte (255: the next
 * escape, from the byte planes of `escapes`, plus 255) and its sign bit, z = 2 * mag + sign + 1
 * (modulo 2**bits, as numpy's). `escapes` must hold exactly one itemsize-wide value per 255 byte
 * (ValueError otherwise, before anything is written); signs (count + 7) / 8 bytes.
 */
#define DEFINE_UNULP(T, NAME)                                                                               \
    static void NAME(const uint8_t *signs, const uint8_t *narrow, const uint8_t *esc, Py_ssize_t ne,       \
                     Py_ssize_t count, T *z) {                                                              \
        Py_ssize_t j = 0;                                                                                   \
        for (Py_ssize_t i = 0; i < count; i++) {                                                            \
            T mag = narrow[i];                                                                              \
            if (narrow[i] == 255) {                                                                         \
                T e = 0;                                                                                    \
                for (int p = 0; p < (int)sizeof(T); p++) e |= (T)((T)esc[p * ne + j] << (8 * p));          \
                mag = (T)(e + 255);                                                                         \
                j++;                                                                                        \
            }                                                                                               \
            z[i] = (T)((T)(mag << 1) + (T)((signs[i >> 3] >> (7 - (i & 7))) & 1) + 1);                    \
        }                                                                                                   \
    }

DEFINE_UNULP(uint8_t, unulp8)
DEFINE_UNULP(uint16_t, unulp16)
DEFINE_UNULP(uint32_t, unulp32)
DEFINE_UNULP(uint64_t, unulp64)

static int check_width(int isz) {
    if (isz == 1 || isz == 2 || isz == 4 || isz == 8) return 1;
    PyErr_SetString(PyExc_ValueError, "itemsize must be 1, 2, 4 or 8");
    return 0;
}

static PyObject *ulp_codes(PyObject *self, PyObject *args) {
    Py_buffer sb, nb, eb, zb;
    int isz;
    if (!PyArg_ParseTuple(args, "y*y*y*iw*", &sb, &nb, &eb, &isz, &zb)) return NULL;
    PyObject *result = NULL;
    if (!check_width(isz)) goto done;
    const Py_ssize_t count = nb.len;
    if (zb.len != count * isz || (uintptr_t)zb.buf % isz || sb.len != (count + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "ulp_codes: signs, magnitudes and out do not match");
        goto done;
    }
    const uint8_t *narrow = nb.buf;
    Py_ssize_t ne = 0;
    for (Py_ssize_t i = 0; i < count; i++) ne += narrow[i] == 255;
    if (eb.len != ne * isz) {
        PyErr_Format(PyExc_ValueError, "escapes hold %zd bytes, expected %zd", eb.len, ne * isz);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    switch (isz) {
    case 1: unulp8(sb.buf, narrow, eb.buf, ne, count, zb.buf); break;
    case 2: unulp16(sb.buf, narrow, eb.buf, ne, count, zb.buf); break;
    case 4: unulp32(sb.buf, narrow, eb.buf, ne, count, zb.buf); break;
    default: unulp64(sb.buf, narrow, eb.buf, ne, count, zb.buf); break;
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&nb);
    PyBuffer_Release(&eb);
    PyBuffer_Release(&zb);
    return result;
}

static PyObject *ulp_encode(PyObject *self, PyObject *args) {
    Py_buffer ob, nb, zb;
    int isz;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &ob, &nb, &isz, &zb)) return NULL;
    PyObject *result = NULL;
    if (!check_width(isz)) goto done;
    if (ob.len != nb.len || ob.len != zb.len || ob.len % isz ||
        ((uintptr_t)ob.buf | (uintptr_t)nb.buf | (uintptr_t)zb.buf) % isz) {
        PyErr_SetString(PyExc_ValueError, "old, new and out must be equally long aligned arrays of whole elements");
        goto done;
    }
    const Py_ssize_t count = ob.len / isz;
    Py_BEGIN_ALLOW_THREADS
    switch (isz) {
    case 1: ulp8(ob.buf, nb.buf, zb.buf, count); break;
    case 2: ulp16(ob.buf, nb.buf, zb.buf, count); break;
    case 4: ulp32(ob.buf, nb.buf, zb.buf, count); break;
    default: ulp64(ob.buf, nb.buf, zb.buf, count); break;
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&ob);
    PyBuffer_Release(&nb);
    PyBuffer_Release(&zb);
    return result;
}

static PyObject *ulp_streams(PyObject *self, PyObject *args) {
    Py_buffer zb;
    int isz;
    if (!PyArg_ParseTuple(args, "y*i", &zb, &isz)) return NULL;
    PyObject *result = NULL, *signs = NULL, *narrow = NULL, *esc = NULL;
    if (!check_width(isz)) goto done;
    if (zb.len % isz || (uintptr_t)zb.buf % isz) {
        PyErr_SetString(PyExc_ValueError, "codes must be an aligned array of whole elements");
        goto done;
    }
    const Py_ssize_t count = zb.len / isz;
    signs = PyBytes_FromStringAndSize(NULL, (count + 7) / 8);
    narrow = PyBytes_FromStringAndSize(NULL, count);
    esc = PyBytes_FromStringAndSize(NULL, count * isz);
    if (signs == NULL || narrow == NULL || esc == NULL) goto done;
    Py_ssize_t ne = 0;
    uint8_t *sp = (uint8_t *)PyBytes_AS_STRING(signs), *np_ = (uint8_t *)PyBytes_AS_STRING(narrow);
    void *ep = PyBytes_AS_STRING(esc);
    Py_BEGIN_ALLOW_THREADS
    switch (isz) {
    case 1: ne = streams8(zb.buf, count, sp, np_, ep); break;
    case 2: ne = streams16(zb.buf, count, sp, np_, ep); break;
    case 4: ne = streams32(zb.buf, count, sp, np_, ep); break;
    default: ne = streams64(zb.buf, count, sp, np_, ep); break;
    }
    Py_END_ALLOW_THREADS
    if (_PyBytes_Resize(&esc, ne * isz) < 0) goto done;
    result = PyTuple_Pack(3, signs, narrow, esc);
done:
    Py_XDECREF(signs);
    Py_XDECREF(narrow);
    Py_XDECREF(esc);
    PyBuffer_Release(&zb);
    return result;
}


static inline unsigned klass(uint64_t bits, int shift, uint64_t mask, int64_t lo) {
    const int64_t e = (int64_t)((bits >> shift) & mask) - lo;
    return e < 0 ? 0 : e > NCLASS - 1 ? NCLASS - 1 : (unsigned)e;
}

static inline uint64_t load_at(const void *b, int isz, Py_ssize_t i) {
    switch (isz) {
    case 1: return ((const uint8_t *)b)[i];
    case 2: return ((const uint16_t *)b)[i];
    case 4: return ((const uint32_t *)b)[i];
    default: return ((const uint64_t *)b)[i];
    }
}


/* Scalar scans, element by element (any width; the tails of the vector scans). */
#define RANKS_SCALAR(T)                                                                                      \
    static Py_ssize_t ranks_##T(const struct classing *k, Py_ssize_t p, Py_ssize_t end, const int64_t *idx, \
                                Py_ssize_t j, Py_ssize_t n, uint8_t *cls, int64_t *rank, int64_t *counts) { \
        const T *b = (const T *)k->base, *old = (const T *)k->old;                                           \
        for (; p < end; p++) {                                                                               \
            if (j < n && p == idx[j]) {                                                                      \
                const unsigned c = klass(old ? old[j] : b[p], k->shift, k->mask, k->lo);                     \
                cls[j] = (uint8_t)c, rank[j] = counts[c]++, j++;                                             \
            } else {                                                                                         \
                counts[klass(b[p], k->shift, k->mask, k->lo)]++;                                             \
            }                                                                                                \
        }                                                                                                    \
        return j;                                                                                            \
    }
RANKS_SCALAR(uint8_t)
RANKS_SCALAR(uint16_t)
RANKS_SCALAR(uint32_t)
RANKS_SCALAR(uint64_t)

static Py_ssize_t ranks_scalar(const struct classing *k, Py_ssize_t p, Py_ssize_t end, const int64_t *idx,
                               Py_ssize_t j, Py_ssize_t n, uint8_t *cls, int64_t *rank, int64_t *counts) {
    if (p >= end) return j;
    switch (k->isz) {
    case 1: return ranks_uint8_t(k, p, end, idx, j, n, cls, rank, counts);
    case 2: return ranks_uint16_t(k, p, end, idx, j, n, cls, rank, counts);
    case 4: return ranks_uint32_t(k, p, end, idx, j, n, cls, rank, counts);
    default: return ranks_uint64_t(k, p, end, idx, j, n, cls, rank, counts);
    }
}

/* A positions scan: per class the next wanted rank (-1: none left) and where it sits in `ranks`;
   `skip`: sorted positions the ranks do not count (an ulp2 segment's history elements). */
struct wanted {
    const int64_t *ranks;
    int64_t first[NCLASS], last[NCLASS], want[NCLASS], seen[NCLASS];
    int64_t *pos, *perm;
    Py_ssize_t found, n;
    const int64_t *skip;
    Py_ssize_t nskip, si;
};

static inline void hit(struct wanted *w, unsigned c, Py_ssize_t p) {
    const int64_t k = w->first[c]++;
    w->pos[w->found] = p, w->perm[w->found] = k, w->found++;
    w->want[c] = w->first[c] < w->last[c] ? w->ranks[w->first[c]] : -1;
}

static Py_ssize_t positions_scalar(const struct classing *k, struct wanted *w, Py_ssize_t p, Py_ssize_t stop) {
    for (; p < stop && w->found < w->n; p++) {
        if (w->si < w->nskip && w->skip[w->si] == p) {
            w->si++;
            continue;
        }
        const unsigned c = klass(load_at(k->base, k->isz, p), k->shift, k->mask, k->lo);
        if (w->seen[c]++ == w->want[c]) hit(w, c, p);
    }
    return p;
}

#if defined(__GNUC__) && defined(__x86_64__)
/*
 * Two-byte floats (bf16, f16) with AVX2, a block of 256 elements at a time. The block's classes
 * are computed 16 lanes at a time and packed to bytes (cb, in element order); a class's count over
 * the block is a byte-lane accumulator of compares (8 classes per pass, in registers) summed with
 * psadbw. Only a class that has a changed (or wanted) element in the block looks inside it again:
 * a rank is the class's count before the block plus the popcount of its compare mask before the
 * element; a wanted rank is found with pdep.
 */
#define BLOCK 256

__attribute__((target("avx2"))) static inline void block_classes(const uint16_t *b, const struct classing *k,
                                                                   uint8_t cb[BLOCK]) {
    const __m128i sh = _mm_cvtsi32_si128(k->shift);
    const __m256i mask = _mm256_set1_epi16((short)k->mask), lo = _mm256_set1_epi16((short)k->lo);
    const __m256i zero = _mm256_setzero_si256(), top = _mm256_set1_epi16(NCLASS - 1);
    for (int s = 0; s < BLOCK; s += 32) {
        __m256i c0 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + s)), sh), mask);
        __m256i c1 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + s + 16)), sh), mask);
        c0 = _mm256_min_epi16(_mm256_max_epi16(_mm256_sub_epi16(c0, lo), zero), top);
        c1 = _mm256_min_epi16(_mm256_max_epi16(_mm256_sub_epi16(c1, lo), zero), top);
        _mm256_store_si256((__m256i *)(cb + s), _mm256_permute4x64_epi64(_mm256_packus_epi16(c0, c1), 0xD8));
    }
}

__attribute__((target("avx2"))) static inline int64_t sum_bytes(__m256i v) {
    const __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());
    const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
}

/* How many of the block's elements fall in each class. */
__attribute__((target("avx2"))) static inline void block_counts(const uint8_t cb[BLOCK], int64_t cnt[NCLASS]) {
    for (int h = 0; h < NCLASS; h += 8) {
        __m256i acc[8];
        for (int q = 0; q < 8; q++) acc[q] = _mm256_setzero_si256();
        for (int s = 0; s < BLOCK; s += 32) {
            const __m256i c = _mm256_load_si256((const __m256i *)(cb + s));
            for (int q = 0; q < 8; q++) acc[q] = _mm256_sub_epi8(acc[q], _mm256_cmpeq_epi8(c, _mm256_set1_epi8((char)(h + q))));
        }
        for (int q = 0; q < 8; q++) cnt[h + q] = sum_bytes(acc[q]);
    }
}

/* The 32-bit mask of class q among the block's elements [32s, 32s + 32). */
__attribute__((target("avx2"))) static inline uint32_t step_mask(const uint8_t cb[BLOCK], int s, unsigned q) {
    return (uint32_t)_mm256_movemask_epi8(
        _mm256_cmpeq_epi8(_mm256_load_si256((const __m256i *)(cb + 32 * s)), _mm256_set1_epi8((char)q)));
}

__attribute__((target("avx2,bmi,bmi2,popcnt"))) static Py_ssize_t ranks_avx2(const struct classing *k,
                                                                              Py_ssize_t p, Py_ssize_t end,
                                                                              const int64_t *idx, Py_ssize_t n,
                                                                              uint8_t *cls, int64_t *rank,
                                                                              int64_t *counts) {
    Py_ssize_t j = 0;
    const uint16_t *b = (const uint16_t *)k->base, *old = (const uint16_t *)k->old;
    _Alignas(32) uint8_t cb[BLOCK];
    int64_t cnt[NCLASS];
    for (; p + BLOCK <= end; p += BLOCK) {
        block_classes(b + p, k, cb);
        Py_ssize_t stop = j;
        while (stop < n && idx[stop] < p + BLOCK) stop++;
        if (old) /* the block's changed elements belong to their base bits' class, not the new bits' */
            for (Py_ssize_t i = j; i < stop; i++) cb[idx[i] - p] = (uint8_t)klass(old[i], k->shift, k->mask, k->lo);
        for (; j < stop; j++) {
            const int off = (int)(idx[j] - p), step = off >> 5;
            const unsigned c = cb[off];
            int64_t r = counts[c];
            for (int s = 0; s < step; s++) r += __builtin_popcount(step_mask(cb, s, c));
            cls[j] = (uint8_t)c;
            rank[j] = r + __builtin_popcount(step_mask(cb, step, c) & ((1u << (off & 31)) - 1));
        }
        block_counts(cb, cnt);
        for (int q = 0; q < NCLASS; q++) counts[q] += cnt[q];
    }
    return ranks_scalar(k, p, end, idx, j, n, cls, rank, counts);
}

__attribute__((target("avx2,bmi,bmi2,popcnt"))) static Py_ssize_t positions_avx2(const struct classing *k,
                                                                                  struct wanted *w, Py_ssize_t p,
                                                                                  Py_ssize_t stop) {
    const uint16_t *b = (const uint16_t *)k->base;
    _Alignas(32) uint8_t cb[BLOCK];
    int64_t cnt[NCLASS], slot[BLOCK];
    for (; p + BLOCK <= stop && w->found < w->n; p += BLOCK) {
        block_classes(b + p, k, cb);
        while (w->si < w->nskip && w->skip[w->si] < p + BLOCK) cb[w->skip[w->si++] - p] = 0xFF; /* in no class */
        block_counts(cb, cnt);
        uint64_t hits[BLOCK / 64] = {0};
        for (int q = 0; q < NCLASS; q++) {
            if (w->want[q] >= 0 && w->want[q] < w->seen[q] + cnt[q]) {
                int64_t seen = w->seen[q];
                for (int s = 0; s < BLOCK / 32 && w->want[q] >= 0 && w->want[q] < w->seen[q] + cnt[q]; s++) {
                    const uint32_t m = step_mask(cb, s, (unsigned)q);
                    const int64_t pc = __builtin_popcount(m);
                    while (w->want[q] >= 0 && w->want[q] < seen + pc) {
                        if (w->want[q] < seen) { /* ranks not ascending: corrupt, the class stops here */
                            w->want[q] = -1;
                            break;
                        }
                        const int off = 32 * s + __builtin_ctz((uint32_t)_pdep_u32(1u << (w->want[q] - seen), m));
                        hits[off >> 6] |= 1ull << (off & 63), slot[off] = w->first[q]++;
                        w->want[q] = w->first[q] < w->last[q] ? w->ranks[w->first[q]] : -1;
                    }
                    seen += pc;
                }
            }
            w->seen[q] += cnt[q];
        }
        /* the block's hits came class by class: write them out in position order */
        for (int h = 0; h < BLOCK / 64; h++)
            for (uint64_t bits = hits[h]; bits; bits &= bits - 1) {
                const int off = 64 * h + __builtin_ctzll(bits);
                w->pos[w->found] = p + off, w->perm[w->found] = slot[off], w->found++;
            }
    }
    return positions_scalar(k, w, p, stop);
}

/*
 * The same with AVX-512 (BW), 64 elements a vector. The block's classes are computed 32 lanes at a
 * time and packed to bytes; each class's compare over each 64 elements is a 64-bit mask, kept, so
 * that a class's count over the block and a change's rank inside it are popcounts of those masks.
 */
__attribute__((target("avx512f,avx512bw,bmi,bmi2,popcnt"))) static Py_ssize_t ranks_avx512(
    const struct classing *k, Py_ssize_t p, Py_ssize_t end, const int64_t *idx, Py_ssize_t n, uint8_t *cls,
    int64_t *rank, int64_t *counts) {
    Py_ssize_t j = 0;
    const uint16_t *b = (const uint16_t *)k->base, *old = (const uint16_t *)k->old;
    const __m128i sh = _mm_cvtsi32_si128(k->shift);
    const __m512i mask = _mm512_set1_epi16((short)k->mask), lo = _mm512_set1_epi16((short)k->lo);
    const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi16(NCLASS - 1);
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7); /* packus works within 128-bit lanes */
    _Alignas(64) uint8_t cb[BLOCK];
    uint64_t m[NCLASS][BLOCK / 64];
    int64_t before[NCLASS][BLOCK / 64]; /* per class, its count before each 64 elements of the block */
    for (; p + BLOCK <= end; p += BLOCK) {
        __m512i cv[BLOCK / 64];
        for (int s = 0; s < BLOCK / 64; s++) {
            __m512i c0 = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(b + p + 64 * s), sh), mask);
            __m512i c1 = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(b + p + 64 * s + 32), sh), mask);
            c0 = _mm512_min_epi16(_mm512_max_epi16(_mm512_sub_epi16(c0, lo), zero), top);
            c1 = _mm512_min_epi16(_mm512_max_epi16(_mm512_sub_epi16(c1, lo), zero), top);
            cv[s] = _mm512_permutexvar_epi64(order, _mm512_packus_epi16(c0, c1));
        }
        Py_ssize_t stop = j;
        while (stop < n && idx[stop] < p + BLOCK) stop++;
        for (int s = 0; s < BLOCK / 64; s++) _mm512_store_si512(cb + 64 * s, cv[s]);
        if (old && stop > j) { /* the block's changed elements belong to their base bits' class */
            for (Py_ssize_t i = j; i < stop; i++) cb[idx[i] - p] = (uint8_t)klass(old[i], k->shift, k->mask, k->lo);
            for (int s = 0; s < BLOCK / 64; s++) cv[s] = _mm512_load_si512(cb + 64 * s);
        }
        for (int q = 0; q < NCLASS; q++) {
            const __m512i qv = _mm512_set1_epi8((char)q);
            int64_t c = counts[q];
            for (int s = 0; s < BLOCK / 64; s++) {
                m[q][s] = _mm512_cmpeq_epi8_mask(cv[s], qv);
                before[q][s] = c, c += __builtin_popcountll(m[q][s]);
            }
            counts[q] = c;
        }
        for (; j < stop; j++) { /* without a branch on where in the block a change sits */
            const int off = (int)(idx[j] - p), step = off >> 6;
            const unsigned c = cb[off];
            cls[j] = (uint8_t)c;
            rank[j] = before[c][step] + __builtin_popcountll(_bzhi_u64(m[c][step], (unsigned)(off & 63)));
        }
    }
    return ranks_scalar(k, p, end, idx, j, n, cls, rank, counts);
}

/*
 * With AVX-512 VPOPCNTDQ and VBMI, a span of 512 elements at a time and no compare per class. Each
 * 64 elements' exponents are gathered into bytes (two shifts and one vpermt2b), clamped to classes
 * with saturating byte arithmetic, and give the four bits of every class as four 64-bit masks
 * (vptestmb), stored: the span's bit k of all its elements is then one register. Class q's elements
 * in the span are a logic function of those four registers (one vpternlog and one and/andnot), and
 * their count per 64 elements one vpopcntq. Per change, its rank is the class's count before the
 * call, the counts of the spans before (a vector per class, lane t: the 64 elements t of each span),
 * those of the span's earlier steps, and a popcount inside its own 64. A changed element counts in
 * its base bits' class (`old`): its four bits are set so in the stored masks before the span is
 * counted. (Classes in 16-bit lanes, 32 elements a step, took 12-17% more: in cache, 23 against 20.6
 * ms per 512 MiB without changes, 32.2 against 27.6 with 1%.)
 * Needs 0 <= lo and the exponent field in a byte; ranks_avx512 takes the rest.
 */
#define SPAN 512
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vpopcntdq,bmi,bmi2,popcnt"))) static Py_ssize_t
ranks_avx512pop(const struct classing *k, Py_ssize_t p, Py_ssize_t end, const int64_t *idx, Py_ssize_t n,
                uint8_t *cls, int64_t *rank, int64_t *counts) {
    if (k->lo < 0 || k->lo > 255 || k->mask > 0xFF) return ranks_avx512(k, p, end, idx, n, cls, rank, counts);
    Py_ssize_t j = 0;
    const uint16_t *b = (const uint16_t *)k->base, *old = (const uint16_t *)k->old;
    const __m128i sh = _mm_cvtsi32_si128(k->shift);
    const __m512i mask = _mm512_set1_epi8((char)k->mask), lo = _mm512_set1_epi8((char)k->lo);
    const __m512i top = _mm512_set1_epi8(NCLASS - 1);
    _Alignas(64) uint8_t evens[64];
    for (int i = 0; i < 64; i++) evens[i] = (uint8_t)(2 * i); /* byte i: the low byte of 16-bit lane i of (a, b) */
    const __m512i even = _mm512_load_si512(evens);
    _Alignas(64) uint64_t plane[4][SPAN / 64];
    _Alignas(64) uint8_t cb[SPAN];                /* the span's classes, for its changes */
    _Alignas(64) uint64_t in[NCLASS][SPAN / 64];  /* class q's elements in each 64 of the span */
    _Alignas(64) int64_t step[NCLASS][SPAN / 64]; /* and how many */
    __m512i acc[NCLASS];                          /* the spans before, per class, lane by lane */
    for (int q = 0; q < NCLASS; q++) acc[q] = _mm512_setzero_si512();
    for (; p + SPAN <= end; p += SPAN) {
        for (int s = 0; s < SPAN / 64; s++) {
            const __m512i x = _mm512_srl_epi16(_mm512_loadu_si512(b + p + 64 * s), sh);
            const __m512i y = _mm512_srl_epi16(_mm512_loadu_si512(b + p + 64 * s + 32), sh);
            __m512i c = _mm512_and_si512(_mm512_permutex2var_epi8(x, even, y), mask);
            c = _mm512_min_epu8(_mm512_subs_epu8(c, lo), top); /* below lo saturates to 0 */
            _mm512_store_si512(cb + 64 * s, c);
            for (int t = 0; t < 4; t++) plane[t][s] = _mm512_test_epi8_mask(c, _mm512_set1_epi8((char)(1 << t)));
        }
        Py_ssize_t stop = j;
        while (stop < n && idx[stop] < p + SPAN) stop++;
        if (old)
            for (Py_ssize_t i = j; i < stop; i++) {
                const unsigned c = klass(old[i], k->shift, k->mask, k->lo), off = (unsigned)(idx[i] - p);
                for (int t = 0; t < 4; t++)
                    plane[t][off >> 6] = (plane[t][off >> 6] & ~(1ull << (off & 63))) | ((uint64_t)(c >> t & 1u) << (off & 63));
                cb[off] = (uint8_t)c;
            }
        const __m512i p0 = _mm512_load_si512(plane[0]), p1 = _mm512_load_si512(plane[1]);
        const __m512i p2 = _mm512_load_si512(plane[2]), p3 = _mm512_load_si512(plane[3]);
#define CLASS_IN(q, IMM)                                                                                     \
    do {                                                                                                     \
        const __m512i low3 = _mm512_ternarylogic_epi64(p2, p1, p0, IMM);                                    \
        const __m512i m = (q) & 8 ? _mm512_and_si512(low3, p3) : _mm512_andnot_si512(p3, low3);              \
        _mm512_store_si512(in[q], m);                                                                        \
        _mm512_store_si512(step[q], _mm512_popcnt_epi64(m));                                                 \
    } while (0)
        /* vpternlog's table: bit (a << 2 | b << 1 | c) for operands (a, b, c) = (p2, p1, p0) */
        CLASS_IN(0, 0x01); CLASS_IN(1, 0x02); CLASS_IN(2, 0x04); CLASS_IN(3, 0x08);
        CLASS_IN(4, 0x10); CLASS_IN(5, 0x20); CLASS_IN(6, 0x40); CLASS_IN(7, 0x80);
        CLASS_IN(8, 0x01); CLASS_IN(9, 0x02); CLASS_IN(10, 0x04); CLASS_IN(11, 0x08);
        CLASS_IN(12, 0x10); CLASS_IN(13, 0x20); CLASS_IN(14, 0x40); CLASS_IN(15, 0x80);
#undef CLASS_IN
        for (; j < stop; j++) {
            const unsigned off = (unsigned)(idx[j] - p), t = off >> 6, c = cb[off];
            const __m512i before = _mm512_add_epi64(acc[c], _mm512_maskz_load_epi64((__mmask8)((1u << t) - 1), step[c]));
            cls[j] = (uint8_t)c;
            rank[j] = counts[c] + _mm512_reduce_add_epi64(before) + __builtin_popcountll(_bzhi_u64(in[c][t], off & 63));
        }
        for (int q = 0; q < NCLASS; q++) acc[q] = _mm512_add_epi64(acc[q], _mm512_load_si512(step[q]));
    }
    for (int q = 0; q < NCLASS; q++) counts[q] += _mm512_reduce_add_epi64(acc[q]);
    struct classing rest = *k; /* the last, short span: 256 at a time, then one by one */
    if (old) rest.old = old + j;
    return j + ranks_avx512(&rest, p, end, idx + j, n - j, cls + j, rank + j, counts);
}

/* The widest class scan this CPU runs: 3 (AVX-512 with VPOPCNTDQ and VBMI), 2 (AVX-512), 1 (AVX2)
   or 0 (portable). */
static int class_simd(void) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
                     __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    if (!avx2) return 0;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return 1;
    return __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("avx512vbmi") ? 3 : 2;
}
#else
static int class_simd(void) { return 0; }
#endif

/* A class scan of [p, end) with the widest scan allowed (`simd`: as class_simd). */
static void ranks_any(const struct classing *k, int simd, Py_ssize_t p, Py_ssize_t end, const int64_t *idx,
                      Py_ssize_t n, uint8_t *cls, int64_t *rank, int64_t *counts) {
#if defined(__GNUC__) && defined(__x86_64__)
    if (k->isz == 2 && simd == 3)
        ranks_avx512pop(k, p, end, idx, n, cls, rank, counts);
    else if (k->isz == 2 && simd == 2)
        ranks_avx512(k, p, end, idx, n, cls, rank, counts);
    else if (k->isz == 2 && simd == 1)
        ranks_avx2(k, p, end, idx, n, cls, rank, counts);
    else
#endif
        ranks_scalar(k, p, end, idx, 0, n, cls, rank, counts);
}


static void rank_to(struct ranking *r, Py_ssize_t upto, const int64_t *idx, Py_ssize_t c) {
    if (!r->seen && c == 0) return; /* no change yet: nothing to rank, and maybe nothing ever */
    r->seen = 1;
    while (r->done < upto) {
        const Py_ssize_t row = (r->done - r->start) / r->every, at = r->start + row * r->every;
        if (at == r->done) memcpy(r->census + NCLASS * row, r->counts, sizeof r->counts);
        const Py_ssize_t end = at + r->every < upto ? at + r->every : upto;
        Py_ssize_t m = r->j;
        while (m < c && idx[m] < end) m++;
        ranks_any(&r->k, r->simd, r->done, end, idx + r->j, m - r->j, r->cls + r->j, r->rank + r->j, r->counts);
        for (; r->hj < r->hm && r->hpos[r->hj] < end; r->hj++) /* the block is in cache */
            r->hcls[r->hj] = (uint8_t)klass(load_at(r->k.base, r->k.isz, r->hpos[r->hj]), r->k.shift, r->k.mask, r->k.lo);
        r->j = m, r->done = end;
    }
}

static int parse_classing(struct classing *k, Py_buffer *bb, int isz, int shift, unsigned long long mask,
                          long long lo) {
    if (!check_width(isz)) return 0;
    if (shift < 0 || shift >= 64 || mask > 0xFFFF || bb->len % isz || (uintptr_t)bb->buf % isz) {
        PyErr_SetString(PyExc_ValueError, "classes: bad base buffer, shift or mask");
        return 0;
    }
    k->base = bb->buf, k->old = NULL, k->isz = isz, k->shift = shift, k->mask = mask, k->lo = lo;
    return 1;
}

/*
 * class_ranks(base, itemsize, shift, mask, lo, start, stop, indices, cls_out, rank_out, census_out, every,
 *             old=None, widest=-1)
 * Scans base[start:stop). For each sorted position p in `indices` (int64, all in [start, stop)), its
 * class (uint8 into cls_out) and how many elements of that class lie in [start, p) (int64 into
 * rank_out). census_out (int64, 16 per row) gets the class counts over [start, start + r * every) in
 * row r, for every r with r * every < stop - start, and over all of [start, stop) in the last row
 * (`every`: a positive multiple of 256). `old`, when given, holds the base's bits at the indices,
 * for a `base` that already holds the new bits there (a kept copy the diff brought up to date).
 * `widest` caps the scan (2: AVX-512, 1: AVX2, 0: portable; -1: the widest this CPU runs, CLASS_SIMD).
 * `hasher` (from hasher()), when given, is fed base[start:stop) as the scan goes, each 64 Ki elements
 * just after they are scanned: a fingerprint of the range in the same read of memory.
 * `hist_pos` (int64, sorted, unique, in [start, stop)) and `hist_cls_out` (uint8, as long), when
 * given: the class of the base at each of those positions (from `old` where one is a changed
 * position), taken as each block is scanned (an ulp2 change history's classes; diff_into's way).
 */
static PyObject *class_ranks(PyObject *self, PyObject *args) {
    Py_buffer bb, ib, cb, rb, sb, ob = {0}, hb = {0}, kb = {0};
    int isz, shift, widest = -1;
    unsigned long long mask;
    long long lo;
    Py_ssize_t start, stop, every;
    PyObject *hasher_obj = Py_None, *hcls_obj = Py_None;
    if (!PyArg_ParseTuple(args, "y*iiKLnny*w*w*w*n|z*iOz*O", &bb, &isz, &shift, &mask, &lo, &start, &stop, &ib, &cb,
                          &rb, &sb, &every, &ob, &widest, &hasher_obj, &hb, &hcls_obj))
        return NULL;
    PyObject *result = NULL;
    struct classing k;
    XXH3_state_t *hs = NULL;
    if (hasher_obj != Py_None && (hs = hasher_state(hasher_obj)) == NULL) goto done;
    if ((hb.buf != NULL) != (hcls_obj != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "class_ranks: hist_pos and hist_cls_out go together");
        goto done;
    }
    if (hcls_obj != Py_None && PyObject_GetBuffer(hcls_obj, &kb, PyBUF_WRITABLE) < 0) goto done;
    if (!parse_classing(&k, &bb, isz, shift, mask, lo)) goto done;
    const Py_ssize_t nb = bb.len / isz, n = ib.len / 8;
    const Py_ssize_t rows = start < stop && every > 0 ? (stop - start + every - 1) / every + 1 : 1;
    if (ib.len % 8 || (uintptr_t)ib.buf % 8 || cb.len != n || rb.len != n * 8 || (uintptr_t)rb.buf % 8 || start < 0 ||
        stop < start || stop > nb || every <= 0 || every % 256 || sb.len != rows * NCLASS * 8 ||
        (uintptr_t)sb.buf % 8 || (ob.buf != NULL && (ob.len != n * isz || (uintptr_t)ob.buf % isz))) {
        PyErr_SetString(PyExc_ValueError, "class_ranks: bad buffer sizes, alignment, range or census interval");
        goto done;
    }
    const int64_t *idx = ib.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (idx[j] < start || idx[j] >= stop || (j && idx[j] <= idx[j - 1])) {
            PyErr_SetString(PyExc_ValueError, "class_ranks: indices must be sorted, unique and inside the range");
            goto done;
        }
    }
    const int64_t *hpos = hb.buf;
    const Py_ssize_t hm = hb.len / 8;
    uint8_t *hcls = kb.buf;
    if (hpos != NULL) {
        if (hb.len % 8 || (uintptr_t)hb.buf % 8 || kb.len != hm) {
            PyErr_SetString(PyExc_ValueError, "class_ranks: hist_pos must be int64 and hist_cls_out as long (uint8)");
            goto done;
        }
        for (Py_ssize_t i = 0; i < hm; i++)
            if (hpos[i] < start || hpos[i] >= stop || (i && hpos[i] <= hpos[i - 1])) {
                PyErr_SetString(PyExc_ValueError, "class_ranks: hist_pos must be sorted, unique and inside the range");
                goto done;
            }
    }
    int64_t counts[NCLASS] = {0}, *census = sb.buf;
    uint8_t *cls = cb.buf;
    const int best = class_simd(), simd = widest < 0 || widest > best ? best : widest;
    int64_t *rank = rb.buf;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t j = 0, r = 0, hj = 0;
    for (Py_ssize_t p = start; p < stop; p += every) { /* one census interval at a time */
        const Py_ssize_t end = p + every < stop ? p + every : stop;
        Py_ssize_t m = j;
        while (m < n && idx[m] < end) m++;
        struct classing kk = k;
        kk.old = ob.buf != NULL ? (const char *)ob.buf + j * isz : NULL;
        memcpy(census + NCLASS * r++, counts, sizeof counts);
        ranks_any(&kk, simd, p, end, idx + j, m - j, cls + j, rank + j, counts);
        for (Py_ssize_t q = j; hj < hm && hpos[hj] < end; hj++) { /* the block is in cache */
            while (q < m && idx[q] < hpos[hj]) q++;
            const int changed = ob.buf != NULL && q < m && idx[q] == hpos[hj];
            hcls[hj] = (uint8_t)klass(changed ? load_at(ob.buf, isz, q) : load_at(bb.buf, isz, hpos[hj]), shift, mask,
                                      lo);
        }
        if (hs) HASH_UPDATE(hs, (const char *)bb.buf + p * isz, (size_t)(end - p) * isz); /* while in cache */
        j = m;
    }
    memcpy(census + NCLASS * r, counts, sizeof counts);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&bb);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&sb);
    if (ob.buf != NULL) PyBuffer_Release(&ob);
    if (hb.buf != NULL) PyBuffer_Release(&hb);
    if (kb.buf != NULL) PyBuffer_Release(&kb);
    return result;
}

/*
 * diff_into's `rank` argument: (shift, mask, lo, cls_out, rank_out, census_out, every, state, widest
 * [, hist_pos, hist_cls_out]). cls_out and rank_out run beside the call's idx_out (as long);
 * census_out is class_ranks' census for all of the buffers, from element 0 (its last row, the
 * totals, is the caller's: state's counts at the end); state (int64[2 + 16]) is [done, seen,
 * counts], zeros before the first call (which starts at element 0) and carried from call to call,
 * each starting where the last stopped. hist_pos (int64, sorted, inside the buffers) and
 * hist_cls_out (uint8, as long): the class of the old side at each of those positions, filled in
 * as far as the scan got (all of them once it ends, if anything changed).
 */
static int parse_ranking(struct ranking *r, PyObject *spec, const Py_buffer *ob, int isz, Py_ssize_t start,
                         Py_ssize_t cap, Py_buffer bufs[6]) {
    int shift, widest;
    unsigned long long mask;
    long long lo;
    Py_ssize_t every;
    if (!PyTuple_Check(spec)) {
        PyErr_SetString(PyExc_TypeError, "diff_into: rank must be a tuple (or None)");
        return 0;
    }
    if (!PyArg_ParseTuple(spec, "iKLw*w*w*nw*i|y*w*", &shift, &mask, &lo, &bufs[0], &bufs[1], &bufs[2], &every,
                          &bufs[3], &widest, &bufs[4], &bufs[5]))
        return 0;
    Py_buffer bb = *ob;
    if (!parse_classing(&r->k, &bb, isz, shift, mask, lo)) return 0;
    const Py_ssize_t n = ob->len / isz, rows = (n + every - 1) / every + 1;
    const int64_t *st = bufs[3].buf;
    if (bufs[0].len < cap || bufs[1].len < cap * 8 || (uintptr_t)bufs[1].buf % 8 || every <= 0 || every % 256 ||
        bufs[2].len != rows * NCLASS * 8 || (uintptr_t)bufs[2].buf % 8 || bufs[3].len != (2 + NCLASS) * 8 ||
        (uintptr_t)bufs[3].buf % 8 || st[0] > start || (st[1] != 0 && st[0] != start)) {
        PyErr_SetString(PyExc_ValueError, "diff_into: bad rank buffers, census interval or state");
        return 0;
    }
    const int best = class_simd();
    r->simd = widest < 0 || widest > best ? best : widest;
    r->start = 0, r->every = every, r->done = st[0], r->seen = st[1] != 0, r->j = 0;
    r->cls = bufs[0].buf, r->rank = bufs[1].buf, r->census = bufs[2].buf;
    memcpy(r->counts, st + 2, sizeof r->counts);
    r->hpos = NULL, r->hm = r->hj = 0, r->hcls = NULL;
    if (bufs[4].obj != NULL) {
        const int64_t *hp = bufs[4].buf;
        const Py_ssize_t hm = bufs[4].len / 8;
        if (bufs[4].len % 8 || (uintptr_t)bufs[4].buf % 8 || bufs[5].obj == NULL || bufs[5].len != hm) {
            PyErr_SetString(PyExc_ValueError, "diff_into: hist_pos must be int64 and hist_cls_out as long (uint8)");
            return 0;
        }
        for (Py_ssize_t i = 0; i < hm; i++)
            if (hp[i] < 0 || hp[i] >= n || (i && hp[i] <= hp[i - 1])) {
                PyErr_SetString(PyExc_ValueError, "diff_into: hist_pos must be sorted, unique and inside the buffers");
                return 0;
            }
        Py_ssize_t a = 0, b = hm; /* the entries before where this call's scan starts are classed */
        while (a < b) {
            const Py_ssize_t mid = a + (b - a) / 2;
            if (hp[mid] < r->done) a = mid + 1; else b = mid;
        }
        r->hpos = hp, r->hm = hm, r->hj = a, r->hcls = bufs[5].buf;
    }
    return 1;
}

/*
 * class_positions(base, itemsize, shift, mask, lo, start, stop, counts, ranks, pos_out, perm_out, skip,
 *                 portable=False) -> found
 * The inverse: `counts` (int64, one per class) say how many ranks each class has; `ranks` (int64)
 * holds them class after class, each class's ascending. Scanning base[start:stop), the elements
 * whose class-rank is wanted are written in position order: their position into pos_out and the
 * index of their rank in `ranks` into perm_out. The elements at `skip` (int64, sorted, unique, in
 * [start, stop)) count in no class. Returns how many were found (all, unless a rank lies beyond
 * its class's elements: the caller treats that as corrupt input or a wrong base).
 */
static PyObject *class_positions(PyObject *self, PyObject *args) {
    Py_buffer bb, cnb, rb, pb, qb, sb;
    int isz, shift, portable_ = 0;
    unsigned long long mask;
    long long lo;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "y*iiKLnny*y*w*w*y*|p", &bb, &isz, &shift, &mask, &lo, &start, &stop, &cnb, &rb, &pb,
                          &qb, &sb, &portable_))
        return NULL;
    PyObject *result = NULL;
    struct classing k;
    struct wanted w;
    if (!parse_classing(&k, &bb, isz, shift, mask, lo)) goto done;
    const Py_ssize_t nb = bb.len / isz, n = rb.len / 8;
    if (start < 0 || stop < start || stop > nb || cnb.len != NCLASS * 8 || (uintptr_t)cnb.buf % 8 || rb.len % 8 ||
        (uintptr_t)rb.buf % 8 || pb.len != n * 8 || (uintptr_t)pb.buf % 8 || qb.len != n * 8 ||
        (uintptr_t)qb.buf % 8 || sb.len % 8 || (uintptr_t)sb.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "class_positions: bad buffer sizes, alignment or range");
        goto done;
    }
    w.skip = sb.buf, w.nskip = sb.len / 8, w.si = 0;
    for (Py_ssize_t i = 0; i < w.nskip; i++)
        if (w.skip[i] < start || w.skip[i] >= stop || (i && w.skip[i] <= w.skip[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "class_positions: skipped positions must be sorted, unique, in range");
            goto done;
        }
    const int64_t *counts = cnb.buf;
    int64_t total = 0;
    for (int q = 0; q < NCLASS; q++) {
        if (counts[q] < 0 || counts[q] > n - total) {
            PyErr_SetString(PyExc_ValueError, "class_positions: the counts do not fit the ranks given");
            goto done;
        }
        w.first[q] = total, total += counts[q], w.last[q] = total, w.seen[q] = 0;
    }
    if (total != n) {
        PyErr_SetString(PyExc_ValueError, "class_positions: the counts do not add up to the ranks given");
        goto done;
    }
    w.ranks = rb.buf, w.pos = pb.buf, w.perm = qb.buf, w.found = 0, w.n = n;
    for (int q = 0; q < NCLASS; q++) w.want[q] = w.first[q] < w.last[q] ? w.ranks[w.first[q]] : -1;
    Py_BEGIN_ALLOW_THREADS
#if defined(__GNUC__) && defined(__x86_64__)
    if (isz == 2 && !portable_ && class_simd())
        positions_avx2(&k, &w, start, stop);
    else
#endif
        positions_scalar(&k, &w, start, stop);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(w.found);
done:
    PyBuffer_Release(&bb);
    PyBuffer_Release(&cnb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&qb);
    PyBuffer_Release(&sb);
    return result;
}

/*
 * The ulp2 segment body (docs/FORMAT.md): one stream of an adaptive binary range coder (LZMA's:
 * 32-bit range, carries resolved through a one-byte cache, a modelled bit's probability a 15-bit
 * estimate moved towards each bit seen: by 1/2, 1/4, ... while the context is young, then by 1/32).
 * It holds the class table (which classes have changes, how many, and their gap parameters), then,
 * class after class, the gaps between the ranks of a class's changes, then every change's ulp code
 * in the same order.
 *
 * The table: for each of the 16 classes, whether it has changes (context: whether the class below
 * had); if so, its count less one in Elias gamma (contexts by place) and its gap parameter k as the
 * zigzag of its difference from the k of the class listed before it (from 0 for the first), in
 * Elias gamma too (its own contexts).
 *
 * A gap g of a class whose parameter is k: q = g >> k in unary (1s then a 0; the i-th bit's context
 * is min(i, 3)), then the top two bits of the k-bit remainder (contexts: the bits above them) and
 * its other bits as they are. A code z (zigzag, >= 1): a = (z - 1) >> 1, the ulps beyond the first,
 * and s = (z - 1) & 1, the direction. Whether a > 0 is one bit (context: the class); then a in Elias
 * gamma (its bit length less one in unary, contexts by place, then the bits below the top one as
 * they are); then s (context: whether a > 0).
 */
#define PB 15
#define PMOVE 5
#define PINIT (1u << (PB - 1))
#define PMIN 31 /* a modelled bit costs at most log2(2^15 / 31) < 11 bits */
#define TOP (1u << 24)

/* A context: the probability of a 0 (out of 2^15) and how many bits it has seen (up to 15). */
struct prob {
    uint16_t p, n;
};
/* How far a context moves (a shift) after its n-th bit: about 1/(n + 1.5), then 1/32 from the 15th on. */
static const uint8_t RATE[16] = {1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, PMOVE};

static inline void adapt(struct prob *c, unsigned bit) {
    if (__builtin_expect(c->n == 15, 1)) { /* settled: a move of 1/32 keeps p inside [PMIN, 2^PB - PMIN] */
        const unsigned p = c->p;
        c->p = (uint16_t)(bit ? p - (p >> PMOVE) : p + (((1u << PB) - p) >> PMOVE));
        return;
    }
    const int sh = RATE[c->n];
    unsigned p = c->p;
    if (bit) p -= p >> sh; else p += ((1u << PB) - p) >> sh;
    c->p = (uint16_t)(p < PMIN ? PMIN : p > (1u << PB) - PMIN ? (1u << PB) - PMIN : p);
    c->n += c->n < 15;
}

/* With a change history (the elements the last HDEPTH patches changed, which the receiver knows
   too): one context per class and set of those patches that moved the element (a nonzero mask of
   HDEPTH bits) for "changed again", and signs by the direction of the last change (0: none, 1: up,
   2: down). */
#define HDEPTH 3
#define HMASKS ((1 << HDEPTH) - 1)
struct ctx {
    struct prob q[4], r[4], one[NCLASS], gamma[64], sign[2][3], present[2], count[64], dk[64], again[HMASKS * NCLASS];
};

static void ctx_init(struct ctx *c) {
    struct prob *p = (struct prob *)c;
    for (size_t i = 0; i < sizeof *c / sizeof *p; i++) p[i].p = PINIT, p[i].n = 0;
}

/* The contexts a segment starts from: fresh, or (`state` given: the bytes of a struct ctx, which
   ulp2_context made and earlier segments of the chunk moved on) where the segment before left
   them. A state from elsewhere is checked: every probability in range, every count at most 15. */
static int ctx_load(struct ctx *c, Py_buffer *state) {
    if (state->buf == NULL) {
        ctx_init(c);
        return 1;
    }
    if (state->len != (Py_ssize_t)sizeof *c) goto bad;
    memcpy(c, state->buf, sizeof *c);
    const struct prob *p = (const struct prob *)c;
    for (size_t i = 0; i < sizeof *c / sizeof *p; i++)
        if (p[i].p < PMIN || p[i].p > (1u << PB) - PMIN || p[i].n > 15) goto bad;
    return 1;
bad:
    PyErr_SetString(PyExc_ValueError, "ulp2: bad context state (make it with ulp2_context)");
    return 0;
}

static PyObject *ulp2_context(PyObject *self, PyObject *unused) {
    struct ctx c;
    ctx_init(&c);
    return PyByteArray_FromStringAndSize((const char *)&c, sizeof c);
}

/*
 * The encoder writes the same bytes as LZMA's (its first byte, always 0, left out) but resolves a
 * carry at once, into the bytes already written, rather than holding back a byte and a run of
 * 0xFF: then moving on after a coded bit takes no branch on how many bytes it writes (0, 1 or 2;
 * the range is at least 2^8 there), and the carry's own branch, a carry through a 0xFF byte, is
 * rare. `buf` has a 0 byte before it (which no carry reaches) and 2 bytes of slack after `cap`;
 * `pos` counts on past `cap`, writing nothing there, so that the caller can tell.
 */
struct rc_enc {
    uint64_t low;
    uint32_t range;
    uint8_t *buf;
    Py_ssize_t pos, cap;
};

/* A buffer for an encoder of `cap` bytes (NULL: out of memory), and its release. */
static uint8_t *enc_alloc(Py_ssize_t cap) {
    uint8_t *raw = PyMem_Malloc(cap + 3);
    if (raw == NULL) return NULL;
    raw[0] = 0;
    return raw + 1;
}

static void enc_free(uint8_t *buf) {
    if (buf != NULL) PyMem_Free(buf - 1);
}

static inline void enc_carry(struct rc_enc *e) {
    const unsigned c = (unsigned)(e->low >> 32);
    e->low &= 0xFFFFFFFFu;
    uint8_t *b = e->buf + (e->pos < e->cap ? e->pos : e->cap) - 1;
    *b = (uint8_t)(*b + c);
    if (__builtin_expect(c & (*b == 0), 0)) /* it ran through a 0xFF */
        do --b, *b = (uint8_t)(*b + 1); while (*b == 0);
}

/* Bytes out until the range is at least 2^24 again, from at least 2^8. */
static inline void enc_norm(struct rc_enc *e) {
    if (e->range >= TOP) return;
    enc_carry(e);
    const int n = 1 + (e->range < (1u << 16));
    uint8_t *w = e->buf + (e->pos < e->cap ? e->pos : e->cap);
    w[0] = (uint8_t)(e->low >> 24), w[1] = (uint8_t)(e->low >> 16);
    e->pos += n;
    e->low = (e->low << (8 * n)) & 0xFFFFFFFFu;
    e->range <<= 8 * n;
}

static inline void enc_bit(struct rc_enc *e, struct prob *p, unsigned bit) {
    const uint32_t bound = (e->range >> PB) * p->p, m = 0u - (uint32_t)bit; /* branch-free: bits are news */
    e->low += bound & m;
    e->range = (bound & ~m) | ((e->range - bound) & m);
    if (__builtin_expect(p->n == 15, 1)) { /* adapt(), settled, without a branch on the bit */
        const uint32_t q = p->p, down = q - (q >> PMOVE), up = q + (((1u << PB) - q) >> PMOVE);
        p->p = (uint16_t)((up & ~m) | (down & m));
    } else {
        adapt(p, bit);
    }
    enc_norm(e);
}

/* The end of a stream: of the values in [low, low + range) the one with the most trailing zero
   bytes (a range of at least 2^24 holds a multiple of 2^24), then the bytes up to it, less the zero
   bytes at the end (at most 4: a decoder reads zeros past the end). */
static void enc_finish(struct rc_enc *e) {
    for (int s = 32; s >= 8; s -= 8) {
        const uint64_t v = (e->low + ((1ull << s) - 1)) >> s << s;
        if (v - e->low < e->range) {
            e->low = v;
            break;
        }
    }
    enc_carry(e);
    for (int b = 0; b < 4; b++) {
        if (e->pos < e->cap) e->buf[e->pos] = (uint8_t)(e->low >> 24);
        e->pos++, e->low = (e->low << 8) & 0xFFFFFFFFu;
    }
    for (int b = 0; b < 4 && e->pos > 0 && e->pos <= e->cap && e->buf[e->pos - 1] == 0; b++) e->pos--;
}

/* Bits as they are, up to 16 at a time (the range is at least 2^24 between calls). */
static inline void enc_direct(struct rc_enc *e, uint64_t v, int nbits) {
    while (nbits > 0) {
        const int b = nbits < 16 ? nbits : 16;
        nbits -= b;
        e->range >>= b;
        e->low += ((v >> nbits) & ((1u << b) - 1)) * (uint64_t)e->range;
        enc_norm(e);
    }
}

struct rc_dec {
    const uint8_t *buf;
    Py_ssize_t pos, len;
    uint32_t range, code;
};

static inline uint8_t dec_byte(struct rc_dec *d) { return d->pos < d->len ? d->buf[d->pos++] : (d->pos++, 0); }

static inline unsigned dec_bit(struct rc_dec *d, struct prob *p) {
    const uint32_t bound = (d->range >> PB) * p->p;
    unsigned bit;
    if (d->code < bound) d->range = bound, bit = 0;
    else d->code -= bound, d->range -= bound, bit = 1;
    adapt(p, bit);
    while (d->range < TOP) d->range <<= 8, d->code = (d->code << 8) | dec_byte(d);
    return bit;
}

static inline uint64_t dec_direct(struct rc_dec *d, int nbits, int *bad) {
    uint64_t v = 0;
    while (nbits > 0) {
        const int b = nbits < 16 ? nbits : 16;
        nbits -= b;
        d->range >>= b;
        uint32_t x = d->code / d->range;
        if (x >> b) *bad = 1, x = (1u << b) - 1; /* only a corrupt stream gets here */
        d->code -= x * d->range;
        v = (v << b) | x;
        while (d->range < TOP) d->range <<= 8, d->code = (d->code << 8) | dec_byte(d);
    }
    return v;
}

static inline int bitlen64(uint64_t v) { return v ? 64 - __builtin_clzll(v) : 0; }

/* v >= 1 in Elias gamma: its bit length L less one in unary (the i-th bit in ctx[i]; the closing 0
   only if L < 64), then the L - 1 bits below its top one as they are. */
static inline void enc_gamma(struct rc_enc *e, struct prob *ctx, uint64_t v) {
    const int len = bitlen64(v);
    for (int b = 0; b < len - 1; b++) enc_bit(e, &ctx[b], 1);
    if (len < 64) enc_bit(e, &ctx[len - 1], 0);
    enc_direct(e, v, len - 1);
}

static inline uint64_t dec_gamma(struct rc_dec *d, struct prob *ctx, int *bad) {
    int len = 1;
    while (len < 64 && dec_bit(d, &ctx[len - 1])) len++;
    return (1ull << (len - 1)) | dec_direct(d, len - 1, bad);
}

static inline uint64_t zigzag64(int64_t v) { return v >= 0 ? 2 * (uint64_t)v : 2 * (uint64_t)(-v) - 1; }
static inline int64_t unzigzag64(uint64_t z) { return z & 1 ? -(int64_t)((z + 1) >> 1) : (int64_t)(z >> 1); }

static inline void store_at(void *b, int isz, Py_ssize_t i, uint64_t v) {
    switch (isz) {
    case 1: ((uint8_t *)b)[i] = (uint8_t)v; break;
    case 2: ((uint16_t *)b)[i] = (uint16_t)v; break;
    case 4: ((uint32_t *)b)[i] = (uint32_t)v; break;
    default: ((uint64_t *)b)[i] = v; break;
    }
}

/* The segment's table: per class present (ascending), its class, count and k. */
struct table {
    Py_ssize_t n;
    int64_t cls[NCLASS], count[NCLASS], k[NCLASS];
};

static int parse_table(struct table *t, Py_buffer *tb, Py_ssize_t n) {
    const int64_t *v = tb->buf;
    if (tb->len % 24 || (uintptr_t)tb->buf % 8 || tb->len / 24 > NCLASS) goto bad;
    t->n = tb->len / 24;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        t->cls[i] = v[3 * i], t->count[i] = v[3 * i + 1], t->k[i] = v[3 * i + 2];
        if (t->cls[i] < 0 || t->cls[i] >= NCLASS || (i && t->cls[i] <= t->cls[i - 1]) || t->count[i] < 1 ||
            t->k[i] < 0 || t->k[i] > 40)
            goto bad;
        total += t->count[i];
    }
    if (total != n) goto bad;
    return 1;
bad:
    PyErr_SetString(PyExc_ValueError,
                    "ulp2: bad class table (classes ascending below 16, counts at least 1 adding up, k at most 40)");
    return 0;
}

/* A change's zigzag ulp code, less one: whether it moved more than one ulp (context: its class), if
   so by how much more (gamma), then its direction (context: that bit, and the direction it last moved
   in, 0 when it did not in the history). */
static inline void enc_code(struct rc_enc *e, struct ctx *c, uint64_t z, int cl, int dir) {
    const uint64_t a = z >> 1;
    const unsigned more = a != 0;
    enc_bit(e, &c->one[cl], more);
    if (more) enc_gamma(e, c->gamma, a);
    enc_bit(e, &c->sign[more][dir], (unsigned)(z & 1));
}

/* The inverse; 0 (never a code) when it is wider than the dtype. */
static inline uint64_t dec_code(struct rc_dec *d, struct ctx *c, int cl, int dir, int isz, int *bad) {
    const unsigned more = dec_bit(d, &c->one[cl]);
    const uint64_t a = more ? dec_gamma(d, c->gamma, bad) : 0;
    const uint64_t z = (a << 1 | dec_bit(d, &c->sign[more][dir])) + 1;
    if ((isz < 8 && (z >> (8 * isz)) != 0) || z == 0 || (a >> 63)) return 0;
    return z;
}

/* The history a segment is coded with: for each element the last patches changed inside it, in
   position order, its context (class * HMASKS + mask - 1: the mask's bit a is set when the patch a
   back from the last changed it) and the direction it last moved in (1 up, 2 down). */
struct history {
    Py_ssize_t m;
    const uint8_t *ctx, *dir;
};

static int parse_history(struct history *h, Py_buffer *cb, Py_buffer *db) {
    h->m = cb->len, h->ctx = cb->buf, h->dir = db->buf;
    if (db->len != cb->len) goto bad;
    for (Py_ssize_t i = 0; i < h->m; i++)
        if (h->ctx[i] >= HMASKS * NCLASS || h->dir[i] < 1 || h->dir[i] > 2) goto bad;
    return 1;
bad:
    PyErr_SetString(PyExc_ValueError, "ulp2: bad history (contexts below 112, directions 1 or 2, one of each per element)");
    return 0;
}

/*
 * ulp2_pack(ranks, table, codes, itemsize, hctx, hdir, again, again_codes) -> bytes
 * ranks (int64): each class's ascending ranks, class after class as in table (int64 triples class,
 * count, k); codes: those changes' zigzag ulp codes in the same order. The history (hctx, hdir: see
 * struct history; empty without one), again (uint8, 1 where that element changed again) and
 * again_codes (the codes of those, in position order): the changes of history elements, which are
 * not in ranks.
 */
static PyObject *ulp2_pack(PyObject *self, PyObject *args) {
    Py_buffer rb, tb, zb, hcb, hdb, ab, azb, xb = {0};
    int isz;
    if (!PyArg_ParseTuple(args, "y*y*y*iy*y*y*y*|w*", &rb, &tb, &zb, &isz, &hcb, &hdb, &ab, &azb, &xb)) return NULL;
    PyObject *result = NULL;
    struct table t;
    struct history h;
    uint8_t *buf = NULL;
    const Py_ssize_t n = rb.len / 8;
    Py_ssize_t na = 0;
    if (!check_width(isz)) goto done;
    if (!parse_history(&h, &hcb, &hdb)) goto done;
    const uint8_t *again = ab.buf;
    for (Py_ssize_t i = 0; i < ab.len; i++) na += again[i] != 0;
    if (rb.len % 8 || (uintptr_t)rb.buf % 8 || zb.len != n * isz || (uintptr_t)zb.buf % isz || ab.len != h.m ||
        azb.len != na * isz || (uintptr_t)azb.buf % isz) {
        PyErr_SetString(PyExc_ValueError, "ulp2_pack: bad buffer sizes or alignment");
        goto done;
    }
    if (!parse_table(&t, &tb, n)) goto done;
    const int64_t *ranks = rb.buf;
    /* Room: what the bits could take at worst (a modelled bit costs at most 11: PMIN), plus the
       flush; the encoder never writes past it and says if it would. */
    int64_t worst = 11 * (int64_t)h.m;
    for (int side = 0; side < 2; side++) {
        const void *z = side ? azb.buf : zb.buf;
        const Py_ssize_t m = side ? na : n;
        for (Py_ssize_t j = 0; j < m; j++) {
            const uint64_t v = load_at(z, isz, j);
            if (v == 0) {
                PyErr_SetString(PyExc_ValueError, "ulp2_pack: a zero ulp code");
                goto done;
            }
            worst += 11 * 3 + 12 * bitlen64((v - 1) >> 1);
        }
    }
    {
        /* A class's gaps g cost at most 11 ((g >> k) + 3) + k bits each, and the sum of g >> k is at
           most (the sum of g) >> k, which is the last rank + 1 - count when the ranks ascend (the
           coding loop checks that they do, before it codes each gap). */
        Py_ssize_t j = 0;
        for (Py_ssize_t i = 0; i < t.n; i++) {
            j += t.count[i];
            const int64_t last = ranks[j - 1], sum = last + 1 - t.count[i];
            if (last < 0 || last >= ((int64_t)1 << 48)) {
                PyErr_SetString(PyExc_ValueError, "ulp2_pack: ranks must ascend within each class, below 2^48");
                goto done;
            }
            worst += 11 * ((sum > 0 ? sum >> t.k[i] : 0) + 3 * t.count[i]) + t.k[i] * t.count[i];
        }
        worst += NCLASS * 11 * (1 + 2 * 65);
    }
    const Py_ssize_t cap = (Py_ssize_t)(worst / 8 + 64);
    struct ctx c;
    if (!ctx_load(&c, &xb)) goto done;
    buf = enc_alloc(cap);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t used;
    int descending = 0;
    Py_BEGIN_ALLOW_THREADS
    struct rc_enc e = {0, 0xFFFFFFFFu, buf, 0, cap};
    for (Py_ssize_t i = 0; i < h.m; i++) enc_bit(&e, &c.again[h.ctx[i]], again[i] != 0);
    {
        unsigned had = 0;
        int64_t kprev = 0;
        for (Py_ssize_t cl = 0, i = 0; cl < NCLASS; cl++) {
            const unsigned has = i < t.n && t.cls[i] == cl;
            enc_bit(&e, &c.present[had], has);
            had = has;
            if (has) {
                enc_gamma(&e, c.count, (uint64_t)t.count[i]);
                enc_gamma(&e, c.dk, zigzag64(t.k[i] - kprev) + 1);
                kprev = t.k[i++];
            }
        }
    }
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < t.n && !descending; i++) {
        const int k = (int)t.k[i];
        int64_t prev = -1;
        for (int64_t m = 0; m < t.count[i]; m++, j++) {
            if (ranks[j] <= prev) {
                descending = 1;
                break;
            }
            const uint64_t g = (uint64_t)(ranks[j] - prev - 1);
            prev = ranks[j];
            const uint64_t q = g >> k;
            for (uint64_t b = 0; b < q; b++) enc_bit(&e, &c.q[b < 3 ? b : 3], 1);
            enc_bit(&e, &c.q[q < 3 ? q : 3], 0);
            if (k >= 1) {
                const unsigned b1 = (unsigned)(g >> (k - 1)) & 1;
                enc_bit(&e, &c.r[1], b1);
                if (k >= 2) {
                    enc_bit(&e, &c.r[2 + b1], (unsigned)(g >> (k - 2)) & 1);
                    enc_direct(&e, g, k - 2);
                }
            }
        }
    }
    for (Py_ssize_t i = 0, a = 0; i < h.m; i++)
        if (again[i]) enc_code(&e, &c, load_at(azb.buf, isz, a++) - 1, h.ctx[i] / HMASKS, h.dir[i]);
    j = 0;
    for (Py_ssize_t i = 0; i < t.n; i++)
        for (int64_t m = 0; m < t.count[i]; m++, j++) enc_code(&e, &c, load_at(zb.buf, isz, j) - 1, (int)t.cls[i], 0);
    enc_finish(&e);
    used = e.pos;
    Py_END_ALLOW_THREADS
    if (descending) {
        PyErr_SetString(PyExc_ValueError, "ulp2_pack: ranks must ascend within each class");
        goto done;
    }
    if (xb.buf != NULL) memcpy(xb.buf, &c, sizeof c);
    if (used > cap) {
        PyErr_SetString(PyExc_RuntimeError, "ulp2_pack: the coded stream outgrew its buffer");
        goto done;
    }
    result = PyBytes_FromStringAndSize((const char *)buf, used);
done:
    enc_free(buf);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&zb);
    PyBuffer_Release(&hcb);
    PyBuffer_Release(&hdb);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&azb);
    if (xb.buf != NULL) PyBuffer_Release(&xb);
    return result;
}

/*
 * exponent_mode(base, itemsize, shift, mask, starts, run) -> the commonest (bits >> shift) & mask
 * over the runs base[s:s + run) for each s in `starts` (int64), the least of equals (numpy's
 * argmax of a bincount): bits.class_lo's sample, in one call without the GIL.
 */
static PyObject *exponent_mode(PyObject *self, PyObject *args) {
    Py_buffer bb, sb;
    int isz, shift;
    unsigned long long mask;
    Py_ssize_t run;
    if (!PyArg_ParseTuple(args, "y*iiKy*n", &bb, &isz, &shift, &mask, &sb, &run)) return NULL;
    PyObject *result = NULL;
    struct classing k;
    if (!parse_classing(&k, &bb, isz, shift, mask, 0)) goto done;
    const Py_ssize_t n = bb.len / isz, m = sb.len / 8;
    const int64_t *starts = sb.buf;
    if (sb.len % 8 || (uintptr_t)sb.buf % 8 || run < 0 || mask > 0x7FF) goto bad;
    for (Py_ssize_t i = 0; i < m; i++)
        if (starts[i] < 0 || starts[i] > n - run) goto bad;
    uint32_t count[0x800] = {0};
    unsigned best = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t p = starts[i]; p < starts[i] + run; p++) count[(load_at(bb.buf, isz, p) >> shift) & mask]++;
    for (unsigned e = 1; e <= mask; e++)
        if (count[e] > count[best]) best = e;
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLong(best);
    goto done;
bad:
    PyErr_SetString(PyExc_ValueError, "exponent_mode: bad starts, run or mask");
done:
    PyBuffer_Release(&bb);
    PyBuffer_Release(&sb);
    return result;
}

/*
 * class_sort(cls, rank, codes, itemsize, offset, rank_out, codes_out, table_out) -> classes
 * What ulp2_pack takes, from a segment's changes in position order: each change's class (uint8,
 * below 16) and rank (int64, less `offset[class]`: int64[16]) and code. The changes go class by
 * class (a counting sort, stable: within a class they stay in position order, so their ranks
 * ascend) into rank_out and codes_out; table_out (int64[16][3]) gets, for each class with changes
 * in ascending order, the class, its count and its gap parameter k: of the Rice parameters around
 * log2(mean gap * ln 2) (bits.rice_k's candidates), the one that codes the class's gaps shortest.
 * Returns how many classes have changes. ValueError when a class's ranks do not ascend.
 */
static PyObject *class_sort(PyObject *self, PyObject *args) {
    Py_buffer cb, rb, zb, ob, rob, zob, tb;
    int isz;
    if (!PyArg_ParseTuple(args, "y*y*y*iy*w*w*w*", &cb, &rb, &zb, &isz, &ob, &rob, &zob, &tb)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = cb.len;
    if (!check_width(isz)) goto done;
    if (rb.len != 8 * n || (uintptr_t)rb.buf % 8 || zb.len != n * isz || (uintptr_t)zb.buf % isz ||
        ob.len != 8 * NCLASS || (uintptr_t)ob.buf % 8 || rob.len != 8 * n || (uintptr_t)rob.buf % 8 ||
        zob.len != n * isz || (uintptr_t)zob.buf % isz || tb.len != 8 * 3 * NCLASS || (uintptr_t)tb.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "class_sort: bad buffer sizes or alignment");
        goto done;
    }
    const uint8_t *cls = cb.buf;
    const int64_t *rank = rb.buf, *off = ob.buf;
    int64_t *ro = rob.buf, *table = tb.buf;
    Py_ssize_t count[NCLASS] = {0}, first[NCLASS + 1], at[NCLASS];
    for (Py_ssize_t j = 0; j < n; j++) count[cls[j] & (NCLASS - 1)] += cls[j] < NCLASS;
    first[0] = 0;
    for (int c = 0; c < NCLASS; c++) first[c + 1] = first[c] + count[c], at[c] = first[c];
    if (first[NCLASS] != n) {
        PyErr_SetString(PyExc_ValueError, "class_sort: a class above 15");
        goto done;
    }
    int bad = 0, m = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        const unsigned c = cls[j];
        const Py_ssize_t d = at[c]++;
        ro[d] = rank[j] - off[c];
        store_at(zob.buf, isz, d, load_at(zb.buf, isz, j));
    }
    for (int c = 0; c < NCLASS && !bad; c++) {
        const Py_ssize_t nc = count[c];
        if (!nc) continue;
        const int64_t *r = ro + first[c];
        /* bits.rice_k's candidates: around log2(mean gap * ln 2), the gaps (r[-1] = -1) summing to
           r[last] + 1 - nc when the ranks ascend (rice_sums checks that they do) */
        const double mean = (double)(r[nc - 1] + 1 - nc) / (double)nc;
        const int k0 = mean >= 2 ? (int)log2(mean * 0.6931) : 0;
        const int klo = k0 - 1 < 0 ? 0 : k0 - 1 > 40 ? 40 : k0 - 1, khi = k0 + 1 > 40 ? 40 : k0 + 1;
        uint64_t sums[8] = {0};
        if (!rice_sums(r, nc, 0, klo, khi, sums)) {
            bad = 1;
            break;
        }
        table[3 * m] = c, table[3 * m + 1] = nc, table[3 * m + 2] = rice_pick(nc, klo, khi, sums), m++;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "class_sort: ranks must ascend within each class");
        goto done;
    }
    result = PyLong_FromLong(m);
done:
    PyBuffer_Release(&cb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&zb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&rob);
    PyBuffer_Release(&zob);
    PyBuffer_Release(&tb);
    return result;
}

/*
 * ulp2_unpack(data, span, itemsize, hctx, hdir, ranks_out, codes_out, counts_out, again_out,
 *             again_codes_out) -> changes of history elements
 * The inverse. The outputs are sized for the segment's count of changes (ranks_out, codes_out and
 * again_codes_out) and its history (again_out); counts_out (int64[16]) gets each class's count. Of
 * the count, the history elements that changed again come first (again_out, again_codes_out, their
 * number returned); ranks_out and codes_out get the rest, class after class. `span` (the segment's
 * stop - start) bounds every rank. ValueError on a stream that is malformed, runs past its end or
 * leaves bytes over.
 */
static PyObject *ulp2_unpack(PyObject *self, PyObject *args) {
    Py_buffer db, hcb, hdb, rb, zb, cb, ab, azb, xb = {0};
    Py_ssize_t span;
    int isz;
    if (!PyArg_ParseTuple(args, "y*niy*y*w*w*w*w*w*|w*", &db, &span, &isz, &hcb, &hdb, &rb, &zb, &cb, &ab, &azb, &xb))
        return NULL;
    PyObject *result = NULL;
    struct table t = {0};
    struct history h;
    const Py_ssize_t count = rb.len / 8;
    Py_ssize_t na = 0;
    if (!check_width(isz)) goto done;
    if (!parse_history(&h, &hcb, &hdb)) goto done;
    if (rb.len % 8 || (uintptr_t)rb.buf % 8 || zb.len != count * isz || (uintptr_t)zb.buf % isz || span < 0 ||
        cb.len != NCLASS * 8 || (uintptr_t)cb.buf % 8 || ab.len != h.m || azb.len != count * isz ||
        (uintptr_t)azb.buf % isz) {
        PyErr_SetString(PyExc_ValueError, "ulp2_unpack: bad buffer sizes or alignment");
        goto done;
    }
    const char *err = NULL;
    struct ctx c;
    if (!ctx_load(&c, &xb)) goto done;
    Py_BEGIN_ALLOW_THREADS
    struct rc_dec d = {db.buf, 0, db.len, 0xFFFFFFFFu, 0};
    int bad = 0;
    for (int b = 0; b < 4; b++) d.code = (d.code << 8) | dec_byte(&d);
    uint8_t *again = ab.buf;
    for (Py_ssize_t i = 0; i < h.m && !err; i++) {
        na += again[i] = (uint8_t)dec_bit(&d, &c.again[h.ctx[i]]);
        if (na > count) err = "has more changes than the segment's count";
    }
    const Py_ssize_t n = count - na;
    {
        unsigned had = 0;
        int64_t kprev = 0, total = 0, *counts = cb.buf;
        for (int cl = 0; cl < NCLASS; cl++) counts[cl] = 0;
        for (int cl = 0; cl < NCLASS && !err; cl++) {
            had = dec_bit(&d, &c.present[had]);
            if (!had) continue;
            const uint64_t cnt = dec_gamma(&d, c.count, &bad);
            const int64_t k = kprev + unzigzag64(dec_gamma(&d, c.dk, &bad) - 1);
            if (cnt > (uint64_t)(n - total) || k < 0 || k > 40) {
                err = "has a bad class table";
                break;
            }
            t.cls[t.n] = cl, t.count[t.n] = (int64_t)cnt, t.k[t.n++] = kprev = k;
            counts[cl] = (int64_t)cnt;
            total += (int64_t)cnt;
        }
        if (!err && total != n) err = "has class counts that do not add up to the segment's";
    }
    int64_t *ranks = rb.buf;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < t.n && !err; i++) {
        const int k = (int)t.k[i];
        const uint64_t qmax = ((uint64_t)span >> k) + 1;
        int64_t prev = -1;
        for (int64_t m = 0; m < t.count[i]; m++, j++) {
            uint64_t q = 0;
            while (dec_bit(&d, &c.q[q < 3 ? q : 3]))
                if (++q > qmax) break;
            if (q > qmax || d.pos > d.len + 4) {
                err = "a gap runs past the segment";
                break;
            }
            uint64_t g = q << k;
            if (k >= 1) {
                const unsigned b1 = dec_bit(&d, &c.r[1]);
                g |= (uint64_t)b1 << (k - 1);
                if (k >= 2) {
                    g |= (uint64_t)dec_bit(&d, &c.r[2 + b1]) << (k - 2);
                    g |= dec_direct(&d, k - 2, &bad);
                }
            }
            if (g >= (uint64_t)span || prev + 1 + (int64_t)g >= span) {
                err = "a gap runs past the segment";
                break;
            }
            prev = ranks[j] = prev + 1 + (int64_t)g;
        }
    }
    for (Py_ssize_t i = 0, a = 0; i < h.m && !err; i++) {
        if (!again[i]) continue;
        const uint64_t z = dec_code(&d, &c, h.ctx[i] / HMASKS, h.dir[i], isz, &bad);
        if (z == 0) err = "an ulp code wider than its dtype";
        store_at(azb.buf, isz, a++, z);
        if (d.pos > d.len + 4) err = "runs past its end";
    }
    j = 0;
    for (Py_ssize_t i = 0; i < t.n && !err; i++) {
        for (int64_t m = 0; m < t.count[i] && !err; m++, j++) {
            const uint64_t z = dec_code(&d, &c, (int)t.cls[i], 0, isz, &bad);
            if (z == 0) err = "an ulp code wider than its dtype";
            store_at(zb.buf, isz, j, z);
            if (d.pos > d.len + 4) err = "runs past its end";
        }
    }
    if (!err && bad) err = "is malformed";
    /* The encoder leaves out up to 4 zero bytes at the end, which the decoder reads as zeros. */
    if (!err && (d.pos < d.len || d.pos > d.len + 4)) err = d.pos > d.len ? "runs past its end" : "leaves bytes over";
    Py_END_ALLOW_THREADS
    if (!err && xb.buf != NULL) memcpy(xb.buf, &c, sizeof c);
    if (err) {
        PyErr_Format(PyExc_ValueError, "ulp2 stream %s", err);
        goto done;
    }
    result = PyLong_FromSsize_t(na);
done:
    PyBuffer_Release(&db);
    PyBuffer_Release(&hcb);
    PyBuffer_Release(&hdb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&zb);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&azb);
    if (xb.buf != NULL) PyBuffer_Release(&xb);
    return result;
}

/*
 * ulp2_rows_pack(flags, ctx) -> bytes;  ulp2_rows_unpack(data, ctx, flags_out)
 * The rows stream of an ulp2 segment in row mode (docs/FORMAT.md): for each row the segment touches,
 * a modelled bit, 1 if the row has changes, in ROWS[ctx] (ctx 1 where the row holds an element of
 * the segment's history, else 0), with a range coder and contexts of its own, ended as every ulp2
 * stream is.
 */
static PyObject *ulp2_rows_pack(PyObject *self, PyObject *args) {
    Py_buffer fb, cb;
    if (!PyArg_ParseTuple(args, "y*y*", &fb, &cb)) return NULL;
    PyObject *result = NULL;
    uint8_t *buf = NULL;
    const Py_ssize_t n = fb.len;
    const uint8_t *flags = fb.buf, *ctx = cb.buf;
    if (cb.len != n) {
        PyErr_SetString(PyExc_ValueError, "ulp2_rows_pack: one context per row");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (ctx[i] > 1 || flags[i] > 1) {
            PyErr_SetString(PyExc_ValueError, "ulp2_rows_pack: flags and contexts are 0 or 1");
            goto done;
        }
    const Py_ssize_t cap = n * 11 / 8 + 64;
    buf = enc_alloc(cap);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    struct prob rows[2] = {{PINIT, 0}, {PINIT, 0}};
    struct rc_enc e = {0, 0xFFFFFFFFu, buf, 0, cap};
    for (Py_ssize_t i = 0; i < n; i++) enc_bit(&e, &rows[ctx[i]], flags[i]);
    enc_finish(&e);
    if (e.pos > cap) {
        PyErr_SetString(PyExc_RuntimeError, "ulp2_rows_pack: the stream outgrew its buffer");
        goto done;
    }
    result = PyBytes_FromStringAndSize((const char *)buf, e.pos);
done:
    enc_free(buf);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&cb);
    return result;
}

static PyObject *ulp2_rows_unpack(PyObject *self, PyObject *args) {
    Py_buffer db, cb, fb;
    if (!PyArg_ParseTuple(args, "y*y*w*", &db, &cb, &fb)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = cb.len;
    const uint8_t *ctx = cb.buf;
    uint8_t *flags = fb.buf;
    if (fb.len != n) {
        PyErr_SetString(PyExc_ValueError, "ulp2_rows_unpack: one flag per context");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (ctx[i] > 1) {
            PyErr_SetString(PyExc_ValueError, "ulp2_rows_unpack: contexts are 0 or 1");
            goto done;
        }
    struct prob rows[2] = {{PINIT, 0}, {PINIT, 0}};
    struct rc_dec d = {db.buf, 0, db.len, 0xFFFFFFFFu, 0};
    for (int b = 0; b < 4; b++) d.code = (d.code << 8) | dec_byte(&d);
    for (Py_ssize_t i = 0; i < n && d.pos <= d.len + 4; i++) flags[i] = (uint8_t)dec_bit(&d, &rows[ctx[i]]);
    if (d.pos < d.len || d.pos > d.len + 4) {
        PyErr_Format(PyExc_ValueError, "ulp2 rows stream %s", d.pos > d.len ? "runs past its end" : "leaves bytes over");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&db);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&fb);
    return result;
}

/*
 * ulp2_history(idx, cls, rank, codes, itemsize, hpos, hstate, hcls,
 *              hctx_out, hdir_out, again_out, again_codes_out, rank_out, cls_out, codes_out)
 *   -> (changed again, others)
 * An ulp2 segment's changes against its history, in one merge of the two sorted position lists (the
 * encoder's side of docs/FORMAT.md, "History"). Per history entry (hpos, hstate, hcls: positions,
 * state bytes and classes in the base): its context, class * HMASKS + mask - 1, its direction (1 up,
 * 2 down) and whether it changed again. The changes (idx, sorted; cls, rank, codes: their classes,
 * class ranks and zigzag ulp codes) split in two: the codes of those that are history entries, in
 * position order, into again_codes_out; the others into rank_out, cls_out and codes_out, each rank
 * less the history entries of its class before it (a rank that counts no history element).
 */
static PyObject *ulp2_history(PyObject *self, PyObject *args) {
    Py_buffer ib, cb, rb, zb, pb, sb, kb, xb, db, ab, azb, rob, cob, zob;
    int isz;
    if (!PyArg_ParseTuple(args, "y*y*y*y*iy*y*y*w*w*w*w*w*w*w*", &ib, &cb, &rb, &zb, &isz, &pb, &sb, &kb, &xb, &db,
                          &ab, &azb, &rob, &cob, &zob))
        return NULL;
    PyObject *result = NULL;
    if (!check_width(isz)) goto done;
    const Py_ssize_t n = ib.len / 8, m = pb.len / 8;
    if (ib.len % 8 || (uintptr_t)ib.buf % 8 || cb.len != n || rb.len != n * 8 || (uintptr_t)rb.buf % 8 ||
        zb.len != n * isz || (uintptr_t)zb.buf % isz || pb.len % 8 || (uintptr_t)pb.buf % 8 || sb.len != m ||
        kb.len != m || xb.len != m || db.len != m || ab.len != m || azb.len < (m < n ? m : n) * isz ||
        (uintptr_t)azb.buf % isz || rob.len < n * 8 || (uintptr_t)rob.buf % 8 || cob.len < n || zob.len < n * isz ||
        (uintptr_t)zob.buf % isz) {
        PyErr_SetString(PyExc_ValueError, "ulp2_history: bad buffer sizes or alignment");
        goto done;
    }
    const int64_t *idx = ib.buf, *hpos = pb.buf, *rank = rb.buf;
    const uint8_t *cls = cb.buf, *hstate = sb.buf, *hcls = kb.buf;
    int ok = 1;
    for (Py_ssize_t j = 0; j < n; j++) ok &= (idx[j] >= 0) & (j == 0 || idx[j] > idx[j - 1]) & (cls[j] < NCLASS);
    for (Py_ssize_t i = 0; i < m; i++)
        ok &= (hpos[i] >= 0) & (i == 0 || hpos[i] > hpos[i - 1]) & ((hstate[i] >> 1) >= 1) &
              ((hstate[i] >> 1) <= HMASKS) & (hcls[i] < NCLASS);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "ulp2_history: positions must be sorted, classes below 16, history masks "
                                          "1 to 7");
        goto done;
    }
    uint8_t *hctx = xb.buf, *hdir = db.buf, *again = ab.buf, *cls_out = cob.buf;
    int64_t *rank_out = rob.buf;
    Py_ssize_t na = 0, nk = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t cnt[NCLASS] = {0};
    Py_ssize_t i = 0, j = 0;
    /* Without a branch on which list is next (which is data, and would be mispredicted about one
       step in four): each step writes both sides' outputs at their current places, and moves on
       the side it took (a side that did not move writes its place again at its own step). */
    while (i < m && j < n) {
        const int64_t p = hpos[i], q = idx[j];
        const Py_ssize_t h = p <= q, changed = p == q; /* h: a history entry's step */
        const unsigned c = hcls[i], s = hstate[i], cj = cls[j];
        const uint64_t z = load_at(zb.buf, isz, j);
        hctx[i] = (uint8_t)(c * HMASKS + (s >> 1) - 1), hdir[i] = (uint8_t)(1 + (s & 1)), again[i] = (uint8_t)changed;
        store_at(azb.buf, isz, na, z);
        rank_out[nk] = rank[j] - cnt[cj], cls_out[nk] = (uint8_t)cj;
        store_at(zob.buf, isz, nk, z);
        cnt[c] += h;
        na += changed, nk += 1 - h;
        i += h, j += (1 - h) | changed;
    }
    for (; i < m; i++) { /* history entries after the last change */
        const unsigned s = hstate[i];
        hctx[i] = (uint8_t)(hcls[i] * HMASKS + (s >> 1) - 1), hdir[i] = (uint8_t)(1 + (s & 1)), again[i] = 0;
    }
    for (; j < n; j++) { /* changes after the last history entry */
        rank_out[nk] = rank[j] - cnt[cls[j]], cls_out[nk] = cls[j];
        store_at(zob.buf, isz, nk++, load_at(zb.buf, isz, j));
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nn", na, nk);
done:
    PyBuffer_Release(&ib);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&zb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&db);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&azb);
    PyBuffer_Release(&rob);
    PyBuffer_Release(&cob);
    PyBuffer_Release(&zob);
    return result;
}

/*
 * history_after(old_pos, old_state, idx, codes, itemsize, pos_out, state_out) -> n
 * One tensor's change history once a patch is applied (codec/history.py, History.after), in one
 * pass: every entry's mask of moves (state >> 1) shifts up one patch, and an entry whose mask runs
 * empty leaves; the patch's changed positions `idx` (sorted) enter, or stay, with bit 0 of the mask
 * set and bit 0 of the state set where their zigzag ulp code moved them down. Both position lists
 * are sorted; so is the result (n entries of pos_out and state_out, which have room for both lists).
 */
static PyObject *history_after(PyObject *self, PyObject *args) {
    Py_buffer ob, sb, ib, zb, pb, qb;
    int isz;
    if (!PyArg_ParseTuple(args, "y*y*y*y*iw*w*", &ob, &sb, &ib, &zb, &isz, &pb, &qb)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t no = ob.len / 8, ni = ib.len / 8;
    if (!check_width(isz)) goto done;
    if (ob.len % 8 || (uintptr_t)ob.buf % 8 || sb.len != no || ib.len % 8 || (uintptr_t)ib.buf % 8 ||
        zb.len != ni * isz || (uintptr_t)zb.buf % isz || pb.len < (no + ni) * 8 || (uintptr_t)pb.buf % 8 ||
        qb.len < no + ni) {
        PyErr_SetString(PyExc_ValueError, "history_after: bad buffer sizes or alignment");
        goto done;
    }
    const int64_t *op = ob.buf, *ip = ib.buf;
    const uint8_t *os = sb.buf;
    int64_t *pos = pb.buf;
    uint8_t *st = qb.buf;
    Py_ssize_t n = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0, j = 0;
    while (i < no || j < ni) {
        if (j < ni && (i >= no || ip[j] <= op[i])) {
            unsigned mask = 1;
            if (i < no && op[i] == ip[j]) mask |= (unsigned)os[i] & (HMASKS & ~1u), i++; /* moved again */
            pos[n] = ip[j], st[n++] = (uint8_t)(mask << 1 | (((load_at(zb.buf, isz, j) - 1) & 1) == 0));
            j++;
        } else {
            const unsigned mask = (unsigned)os[i] & (HMASKS & ~1u); /* the mask, os >> 1, shifted up a patch */
            if (mask) pos[n] = op[i], st[n++] = (uint8_t)(mask << 1 | (os[i] & 1)); /* or it leaves */
            i++;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(n);
done:
    PyBuffer_Release(&ob);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&zb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&qb);
    return result;
}

static PyMethodDef methods[] = {
    {"history_after", history_after, METH_VARARGS,
     "history_after(old_pos, old_state, idx, codes, itemsize, pos_out, state_out) -> n"},
    {"diff_into", diff_into, METH_VARARGS,
     "diff_into(old, new, itemsize, start, end, idx_out, old_out, new_out, portable=False, update=False, "
     "hash_old=None, hash_new=None, rank=None) -> (count, stop)"},
    {"hasher", hasher, METH_NOARGS, "hasher() -> a fresh XXH3-128 state for diff_into's fingerprints"},
    {"digest", digest, METH_O, "digest(hasher) -> the 16 canonical bytes of its XXH3-128"},
    {"rice_index", rice_index, METH_VARARGS, "rice_index(indices, start, kmin, kmax) -> (k, unary, rem)"},
    {"rice_positions", rice_positions, METH_VARARGS,
     "rice_positions(unary, rem, n, k, start, stop, out) -> (status, ones)"},
    {"ulp_encode", ulp_encode, METH_VARARGS, "ulp_encode(old, new, itemsize, out): zigzag ulp distances into out"},
    {"ulp_streams", ulp_streams, METH_VARARGS, "ulp_streams(codes, itemsize) -> (signs, narrow, escapes)"},
    {"ulp_codes", ulp_codes, METH_VARARGS, "ulp_codes(signs, narrow, escapes, itemsize, out): ulp_streams' inverse"},
    {"class_ranks", class_ranks, METH_VARARGS,
     "class_ranks(base, itemsize, shift, mask, lo, start, stop, indices, cls_out, rank_out, census_out, every, "
     "old=None, widest=-1, hasher=None)"},
    {"ulp2_rows_pack", ulp2_rows_pack, METH_VARARGS, "ulp2_rows_pack(flags, ctx) -> bytes"},
    {"ulp2_rows_unpack", ulp2_rows_unpack, METH_VARARGS, "ulp2_rows_unpack(data, ctx, flags_out)"},
    {"ulp2_history", ulp2_history, METH_VARARGS,
     "ulp2_history(idx, cls, rank, codes, itemsize, hpos, hstate, hcls, hctx_out, hdir_out, again_out, "
     "again_codes_out, rank_out, cls_out, codes_out) -> (changed again, others)"},
    {"ulp2_context", ulp2_context, METH_NOARGS, "ulp2_context() -> the fresh contexts a chunk's first ulp2 segment starts from"},
    {"ulp2_pack", ulp2_pack, METH_VARARGS,
     "ulp2_pack(ranks, table, codes, itemsize, hctx, hdir, again, again_codes, state=None) -> bytes"},
    {"exponent_mode", exponent_mode, METH_VARARGS, "exponent_mode(base, itemsize, shift, mask, starts, run) -> int"},
    {"class_sort", class_sort, METH_VARARGS,
     "class_sort(cls, rank, codes, itemsize, offset, rank_out, codes_out, table_out) -> classes"},
    {"ulp2_unpack", ulp2_unpack, METH_VARARGS,
     "ulp2_unpack(data, span, itemsize, hctx, hdir, ranks_out, codes_out, counts_out, again_out, again_codes_out, "
     "state=None) -> int"},
    {"class_positions", class_positions, METH_VARARGS,
     "class_positions(base, itemsize, shift, mask, lo, start, stop, counts, ranks, pos_out, perm_out, skip, "
     "portable=False) -> found"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Fused bit-pattern diff.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* SIMD: the name of the scan diff_into uses unless asked for the portable one. */
    if (PyModule_AddStringConstant(m, "SIMD", pick_simd() ? "avx2" : "portable") < 0 ||
        PyModule_AddIntConstant(m, "CLASS_SIMD", class_simd()) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE", SPARROWD_SOURCE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
