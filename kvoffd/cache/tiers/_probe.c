/* The disk tier's block table, probed in C: kvoffd/cache/tiers/table.py's ``probe`` and ``lookup``
 * for a batch of keys in one call.
 *
 * Why C: a LOOKUP of a disk hit asks the table about every key before it is answered, and the numpy
 * version of that is a dozen to two dozen array calls. Each costs microseconds hot and tens of
 * microseconds when the daemon wakes up cold (the 2-core VM: 64 keys took 140 us, 1,024 keys 190 us,
 * against ~4 us and ~15 us here); that was most of the LOOKUP's time above the echo floor
 * (bench/index_scale.py, docs/benchmarks.md). The numpy version stays, as the reference and the
 * fallback where this module is not built: tests/test_tier_table.py checks that both agree.
 *
 * The rules are table.py's, bit for bit: the key's first two words mixed with the table id pick its
 * two buckets of BUCKET records (the second moved on by one if both are the same), its third word
 * mixed the same way gives the fingerprint (the top 32 bits of a product, made odd: 0 is an empty
 * record). A record is RECORD_BYTES bytes: the key (32), the table id (4), the slot, the crc.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BUCKET 8
#define KEY_BYTES 32
#define RECORD_BYTES 44
#define TID_AT 32

static const uint64_t MIX = 0x9E3779B97F4A7C15ULL;
static const uint64_t FP_MIX = 0xD6E8FEB86659FD93ULL;

typedef struct {
    const uint32_t *fp;
    uint64_t nbuckets;
    uint64_t mix;
} Table;

static inline uint64_t word(const unsigned char *key, int i) {
    uint64_t w;
    memcpy(&w, key + 8 * i, 8); /* little-endian hosts only: checked at import (table.py) */
    return w;
}

/* The key's two buckets and its fingerprint. */
static inline void place(const Table *t, const unsigned char *key, uint64_t *b0, uint64_t *b1, uint32_t *fp) {
    *b0 = (word(key, 0) ^ t->mix) % t->nbuckets;
    *b1 = (word(key, 1) ^ t->mix) % t->nbuckets;
    if (*b1 == *b0)
        *b1 = (*b0 + 1) % t->nbuckets;
    *fp = (uint32_t)(((word(key, 2) ^ t->mix) * FP_MIX) >> 32) | 1u;
}

/* Position of the record holding ``key`` of table ``tid``, or -1 (``recs`` NULL: the first lane whose
 * fingerprint matches, a "maybe"). */
static inline int64_t find(const Table *t, const unsigned char *recs, uint32_t tid, const unsigned char *key) {
    uint64_t b[2];
    uint32_t fp;
    place(t, key, &b[0], &b[1], &fp);
    for (int h = 0; h < 2; h++) {
        const uint32_t *row = t->fp + b[h] * BUCKET;
        for (int j = 0; j < BUCKET; j++) {
            if (row[j] != fp)
                continue;
            int64_t pos = (int64_t)(b[h] * BUCKET + (uint64_t)j);
            if (recs == NULL)
                return pos;
            const unsigned char *r = recs + (size_t)pos * RECORD_BYTES;
            uint32_t rt;
            memcpy(&rt, r + TID_AT, 4);
            if (rt == tid && memcmp(r, key, KEY_BYTES) == 0)
                return pos;
        }
    }
    return -1;
}

typedef struct {
    Py_buffer fp, recs, keys, out;
    int have_fp, have_recs, have_keys, have_out;
} Buffers;

static void release(Buffers *b) {
    if (b->have_fp) PyBuffer_Release(&b->fp);
    if (b->have_recs) PyBuffer_Release(&b->recs);
    if (b->have_keys) PyBuffer_Release(&b->keys);
    if (b->have_out) PyBuffer_Release(&b->out);
}

/* Shared argument handling: (fp, recs or None, nbuckets, tid, keys, out), sizes checked so that no
 * index can leave a buffer. */
static int parse(PyObject *const *args, Py_ssize_t nargs, Buffers *b, Table *t, uint32_t *tid,
                 Py_ssize_t *n, Py_ssize_t out_item) {
    memset(b, 0, sizeof(*b));
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "expected (fp, recs, nbuckets, tid, keys, out)");
        return -1;
    }
    unsigned long long nb = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long id = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return -1;
    if (nb == 0 || id > 0xFFFFFFFFULL) {
        PyErr_SetString(PyExc_ValueError, "nbuckets must be > 0 and tid fit 32 bits");
        return -1;
    }
    if (PyObject_GetBuffer(args[0], &b->fp, PyBUF_C_CONTIGUOUS) < 0) return -1;
    b->have_fp = 1;
    if (args[1] != Py_None) {
        if (PyObject_GetBuffer(args[1], &b->recs, PyBUF_C_CONTIGUOUS) < 0) return -1;
        b->have_recs = 1;
    }
    if (PyObject_GetBuffer(args[4], &b->keys, PyBUF_C_CONTIGUOUS) < 0) return -1;
    b->have_keys = 1;
    if (PyObject_GetBuffer(args[5], &b->out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    b->have_out = 1;
    Py_ssize_t cap = (Py_ssize_t)(nb * BUCKET);
    *n = b->keys.len / KEY_BYTES;
    if (b->keys.len % KEY_BYTES || b->fp.len < cap * 4 || b->out.len < *n * out_item
        || (b->have_recs && b->recs.len < cap * RECORD_BYTES)) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not fit the table");
        return -1;
    }
    t->fp = (const uint32_t *)b->fp.buf;
    t->nbuckets = nb;
    t->mix = (uint64_t)id * MIX;
    *tid = (uint32_t)id;
    return 0;
}

/* probe(fp, None, nbuckets, tid, keys, out: n bools) -> how many leading keys may be held */
static PyObject *py_probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buffers b;
    Table t;
    uint32_t tid;
    Py_ssize_t n, lead = -1;
    if (parse(args, nargs, &b, &t, &tid, &n, 1) < 0) {
        release(&b);
        return NULL;
    }
    const unsigned char *keys = b.keys.buf;
    unsigned char *out = b.out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = find(&t, NULL, tid, keys + i * KEY_BYTES) >= 0;
        if (!out[i] && lead < 0)
            lead = i;
    }
    release(&b);
    return PyLong_FromSsize_t(lead < 0 ? n : lead);
}

/* lookup(fp, recs, nbuckets, tid, keys, out: n int64) -> how many were found */
static PyObject *py_lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buffers b;
    Table t;
    uint32_t tid;
    Py_ssize_t n, found = 0;
    if (parse(args, nargs, &b, &t, &tid, &n, 8) < 0 || !b.have_recs) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "lookup needs the records");
        release(&b);
        return NULL;
    }
    const unsigned char *keys = b.keys.buf, *recs = b.recs.buf;
    int64_t *out = b.out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = find(&t, recs, tid, keys + i * KEY_BYTES);
        found += out[i] >= 0;
    }
    release(&b);
    return PyLong_FromSsize_t(found);
}

static PyMethodDef methods[] = {
    {"probe", (PyCFunction)(void (*)(void))py_probe, METH_FASTCALL,
     "probe(fp, None, nbuckets, tid, keys, out) -> leading maybe-held keys; out[i]: key i may be held"},
    {"lookup", (PyCFunction)(void (*)(void))py_lookup, METH_FASTCALL,
     "lookup(fp, recs, nbuckets, tid, keys, out) -> keys found; out[i]: record position or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe", NULL, -1, methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
