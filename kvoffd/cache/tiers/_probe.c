/* The disk tier's index, probed in C: kvoffd/cache/tiers/diskindex.py's ``probe`` and ``lookup``
 * for a batch of keys in one call; and ``write_pages``, the index file's writer (indexfile.py).
 *
 * Why C: a LOOKUP of a disk hit asks the table about every key before it is answered, and the numpy
 * version of that is a dozen to two dozen array calls. Each costs microseconds hot and tens of
 * microseconds when the daemon wakes up cold (the 2-core VM: 64 keys took 140 us, 1,024 keys 190 us);
 * that was most of the LOOKUP's time above the echo floor (bench/index_scale.py, docs/benchmarks.md).
 * Here a probe of 1,024 keys of a 100M-block table is one call of ~50 us, most of it memory (the rows
 * of a chunk of keys are prefetched together). The numpy version stays, as the reference and the
 * fallback where this module is not built: tests/test_tier_table.py checks that both agree.
 *
 * The rules are diskindex.py's, bit for bit: the key's first two words mixed with the table id pick its
 * two buckets of BUCKET records (the second moved on by one if both are the same), its third word
 * mixed the same way gives the fingerprint (the top 32 bits of a product, made odd: 0 is an empty
 * record). A record is RECORD_BYTES bytes: the key (32), the table id (4), the slot, the crc.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

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
    memcpy(&w, key + 8 * i, 8); /* little-endian hosts only: checked at import (diskindex.py) */
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

/* The keys' buckets and fingerprints a chunk at a time, their rows prefetched: the rows are random
 * lines of a table of up to gigabytes, so the loads of a chunk overlap instead of each waiting for
 * memory in turn (1,024 keys of a 100M-block table: 147 us one after another on the 2-core VM). */
#define CHUNK 16

typedef struct {
    uint64_t b[CHUNK][2];
    uint32_t fp[CHUNK];
} Placed;

static inline void place_chunk(const Table *t, const unsigned char *keys, Py_ssize_t lo, Py_ssize_t m,
                               Placed *p) {
    for (Py_ssize_t j = 0; j < m; j++) {
        place(t, keys + (lo + j) * KEY_BYTES, &p->b[j][0], &p->b[j][1], &p->fp[j]);
        __builtin_prefetch(t->fp + p->b[j][0] * BUCKET);
        __builtin_prefetch(t->fp + p->b[j][1] * BUCKET);
    }
}

/* The first lane of bucket pair ``b`` whose fingerprint is ``fp`` at or after lane ``from`` (0..15),
 * or -1. */
static inline int64_t next_match(const Table *t, const uint64_t *b, uint32_t fp, int from) {
    for (int l = from; l < 2 * BUCKET; l++) {
        uint64_t bucket = b[l / BUCKET];
        if (t->fp[bucket * BUCKET + (uint64_t)(l % BUCKET)] == fp)
            return (int64_t)l;
    }
    return -1;
}

/* The record position of lane ``l`` (0..15) of bucket pair ``b``. */
static inline int64_t position(const uint64_t *b, int64_t l) {
    return (int64_t)(b[l / BUCKET] * BUCKET + (uint64_t)(l % BUCKET));
}

/* probe(fp, None, nbuckets, tid, keys, out: n bools) -> how many leading keys may be held */
static PyObject *py_probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Buffers b;
    Table t;
    uint32_t tid;
    Py_ssize_t n, lead = -1;
    Placed p;
    if (parse(args, nargs, &b, &t, &tid, &n, 1) < 0) {
        release(&b);
        return NULL;
    }
    const unsigned char *keys = b.keys.buf;
    unsigned char *out = b.out.buf;
    for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {
        Py_ssize_t m = n - lo < CHUNK ? n - lo : CHUNK;
        place_chunk(&t, keys, lo, m, &p);
        for (Py_ssize_t j = 0; j < m; j++) {
            out[lo + j] = next_match(&t, p.b[j], p.fp[j], 0) >= 0;
            if (!out[lo + j] && lead < 0)
                lead = lo + j;
        }
    }
    release(&b);
    return PyLong_FromSsize_t(lead < 0 ? n : lead);
}

/* lookup(fp, recs, nbuckets, tid, keys, out: n int64) -> how many were found */
static PyObject *py_lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Buffers b;
    Table t;
    uint32_t tid;
    Py_ssize_t n, found = 0;
    Placed p;
    if (parse(args, nargs, &b, &t, &tid, &n, 8) < 0 || !b.have_recs) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "lookup needs the records");
        release(&b);
        return NULL;
    }
    const unsigned char *keys = b.keys.buf, *recs = b.recs.buf;
    int64_t *out = b.out.buf;
    for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {
        Py_ssize_t m = n - lo < CHUNK ? n - lo : CHUNK;
        int64_t lane[CHUNK];
        place_chunk(&t, keys, lo, m, &p);
        for (Py_ssize_t j = 0; j < m; j++) {  /* the first match of each, its record prefetched */
            lane[j] = next_match(&t, p.b[j], p.fp[j], 0);
            if (lane[j] >= 0)
                __builtin_prefetch(recs + (size_t)position(p.b[j], lane[j]) * RECORD_BYTES);
        }
        for (Py_ssize_t j = 0; j < m; j++) {  /* the record decides; after a collision, the next match */
            const unsigned char *key = keys + (lo + j) * KEY_BYTES;
            out[lo + j] = -1;
            for (int64_t l = lane[j]; l >= 0; l = next_match(&t, p.b[j], p.fp[j], (int)l + 1)) {
                int64_t pos = position(p.b[j], l);
                const unsigned char *r = recs + (size_t)pos * RECORD_BYTES;
                uint32_t rt;
                memcpy(&rt, r + TID_AT, 4);
                if (rt == tid && memcmp(r, key, KEY_BYTES) == 0) {
                    out[lo + j] = pos;
                    found++;
                    break;
                }
            }
        }
    }
    release(&b);
    return PyLong_FromSsize_t(found);
}

/* write_pages(fd, image, pages, scratch) -> (bytes written, failed writes, first errno)
 *
 * The index file's writer (kvoffd/cache/tiers/tablefile.py): pages ``pages`` (sorted, unique int64 page
 * numbers of 4 KiB) of ``image`` (the file's bytes, in memory) written at their offsets. A chunk of pages
 * is copied into ``scratch`` with the GIL held (so the copy sees the loop's numpy statements done, or one
 * of them in progress: what makes a copied record whole or invisible, tablefile.py says why), then
 * written with the GIL released, a run of consecutive pages in one pwrite. Why here and not in Python:
 * the GIL is taken once per chunk instead of once per page (thousands per spill), and a loop waiting
 * for it waits for a memcpy, not for the writer's next turn of the interpreter. */
#define PAGE_BYTES 4096
#define CHUNK_PAGES 1024 /* 4 MiB copied per GIL hold: ~0.5 ms */

static PyObject *py_write_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_buffer img, pg, scr;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "expected (fd, image, pages, scratch)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[1], &img, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &pg, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&img);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &scr, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&img);
        PyBuffer_Release(&pg);
        return NULL;
    }
    long long written = 0, failed = 0;
    int first_errno = 0;
    Py_ssize_t per = scr.len / PAGE_BYTES, npages = pg.len / 8;
    if (per > CHUNK_PAGES)
        per = CHUNK_PAGES;
    if (per < 1 || pg.len % 8) {
        PyErr_SetString(PyExc_ValueError, "scratch must hold a page; pages must be int64");
        goto done;
    }
    const int64_t *pages = pg.buf;
    const unsigned char *image = img.buf;
    unsigned char *scratch = scr.buf;
    Py_ssize_t size = img.len;
    for (Py_ssize_t lo = 0; lo < npages; lo += per) {
        Py_ssize_t m = npages - lo < per ? npages - lo : per;
        Py_ssize_t lens[CHUNK_PAGES];
        for (Py_ssize_t j = 0; j < m; j++) { /* the copy, with the GIL held */
            int64_t p = pages[lo + j];
            Py_ssize_t at = (Py_ssize_t)p * PAGE_BYTES;
            lens[j] = (p < 0 || at >= size) ? 0 : (size - at < PAGE_BYTES ? size - at : PAGE_BYTES);
            if (lens[j])
                memcpy(scratch + j * PAGE_BYTES, image + at, (size_t)lens[j]);
        }
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t j = 0;
        while (j < m) {
            Py_ssize_t k = j + 1; /* a run of consecutive, whole pages: one pwrite */
            while (k < m && pages[lo + k] == pages[lo + k - 1] + 1 && lens[k - 1] == PAGE_BYTES && lens[k])
                k++;
            size_t len = (size_t)((k - j - 1) * PAGE_BYTES + lens[k - 1]);
            if (lens[j]) {
                ssize_t n = pwrite((int)fd, scratch + j * PAGE_BYTES, len, (off_t)pages[lo + j] * PAGE_BYTES);
                if (n == (ssize_t)len) {
                    written += n;
                } else {
                    failed++;
                    if (!first_errno)
                        first_errno = n < 0 ? errno : EIO;
                }
            }
            j = k;
        }
        Py_END_ALLOW_THREADS
    }
done:
    PyBuffer_Release(&img);
    PyBuffer_Release(&pg);
    PyBuffer_Release(&scr);
    if (PyErr_Occurred())
        return NULL;
    return Py_BuildValue("(LLi)", written, failed, first_errno);
}

static PyMethodDef methods[] = {
    {"probe", (PyCFunction)(void (*)(void))py_probe, METH_FASTCALL,
     "probe(fp, None, nbuckets, tid, keys, out) -> leading maybe-held keys; out[i]: key i may be held"},
    {"lookup", (PyCFunction)(void (*)(void))py_lookup, METH_FASTCALL,
     "lookup(fp, recs, nbuckets, tid, keys, out) -> keys found; out[i]: record position or -1"},
    {"write_pages", (PyCFunction)(void (*)(void))py_write_pages, METH_FASTCALL,
     "write_pages(fd, image, pages, scratch) -> (bytes written, failed writes, first errno)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
