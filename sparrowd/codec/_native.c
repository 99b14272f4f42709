/*
 * sparrowd.codec._native: the one loop numpy cannot fuse.
 *
 * diff_into(old, new, itemsize, start, end, idx_out, old_out, new_out) -> (count, stop)
 *
 * Compares the raw bit patterns of two equally long byte buffers holding
 * elements of `itemsize` bytes (1, 2, 4 or 8), elements [start, end), and
 * writes each differing element's flat index (int64) and its old and new bit
 * patterns into the three output buffers, in one pass over memory: numpy
 * needs a compare pass, a mask, a nonzero pass and two gathers. It stops
 * when the outputs have no room for the next block and returns how many it
 * wrote and the element it stopped at, so the caller can go on with larger
 * buffers; `stop` equals
 * `end` when the scan is complete.
 *
 * The scan reads 32 bytes of each side per step and only looks inside a step
 * whose XOR is non-zero, so at RL densities (about 1% of elements) it runs at
 * memory speed. The GIL is released during the scan.
 *
 * No numpy headers: everything goes through the buffer protocol.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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
 * Before a block is written out the output must have room for all of it,
 * which keeps every restart point on a block boundary.
 */
/* Elements [e, limit) one at a time (the ragged ends); stops when the output is full. */
#define ONE_BY_ONE(limit)                                                                                    \
    for (; e < (limit); e++) {                                                                               \
        if (o[e] != n[e]) {                                                                                  \
            if (c == cap) goto out;                                                                          \
            idx[c] = e, ov[c] = o[e], nv[c] = n[e], c++;                                                     \
        }                                                                                                    \
    }

#define DEFINE_SCAN(T, NAME, LOW, SHIFT)                                                                     \
    static Py_ssize_t NAME(const T *o, const T *n, Py_ssize_t total, Py_ssize_t e, int64_t *idx, T *ov,     \
                           T *nv, Py_ssize_t cap, Py_ssize_t *count) {                                       \
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
            if (cap - c < groups * per_group) goto out;                                                      \
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
        }                                                                                                    \
        ONE_BY_ONE(total);                                                                                   \
    out:                                                                                                     \
        *count = c;                                                                                          \
        return e;                                                                                            \
    }

DEFINE_SCAN(uint8_t, scan8, 0x7F7F7F7F7F7F7F7FULL, 3)
DEFINE_SCAN(uint16_t, scan16, 0x7FFF7FFF7FFF7FFFULL, 4)
DEFINE_SCAN(uint32_t, scan32, 0x7FFFFFFF7FFFFFFFULL, 5)
DEFINE_SCAN(uint64_t, scan64, 0x7FFFFFFFFFFFFFFFULL, 6)

static PyObject *diff_into(PyObject *self, PyObject *args) {
    Py_buffer ob, nb, ib, vb, wb;
    int isz;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*y*innw*w*w*", &ob, &nb, &isz, &start, &end, &ib, &vb, &wb)) return NULL;
    PyObject *result = NULL;
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
    Py_ssize_t count = 0, stop = start;
    int64_t *idx = (int64_t *)ib.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (isz) {
    case 1: stop = scan8(ob.buf, nb.buf, end, start, idx, vb.buf, wb.buf, cap, &count); break;
    case 2: stop = scan16(ob.buf, nb.buf, end, start, idx, vb.buf, wb.buf, cap, &count); break;
    case 4: stop = scan32(ob.buf, nb.buf, end, start, idx, vb.buf, wb.buf, cap, &count); break;
    default: stop = scan64(ob.buf, nb.buf, end, start, idx, vb.buf, wb.buf, cap, &count); break;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nn", count, stop);
done:
    PyBuffer_Release(&ob);
    PyBuffer_Release(&nb);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&wb);
    return result;
}

static PyMethodDef methods[] = {
    {"diff_into", diff_into, METH_VARARGS,
     "diff_into(old, new, itemsize, start, end, idx_out, old_out, new_out) -> (count, stop)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Fused bit-pattern diff.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
