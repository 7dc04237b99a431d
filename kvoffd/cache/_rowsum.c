/* The pool checksum's one pass over a block, in C: kvoffd/cache/checksum.py's ``block_sum`` calls
 * ``row_sums`` for the block's whole 64-bit words and mixes the two sums it returns itself.
 *
 * Why C: numpy sums a 2 MiB block at 5-8 GB/s a thread in a dozen calls, each taking the GIL back
 * between reductions; the cluster tier verifies every fetched value, and that pass (on check threads,
 * handed each value) cost its GET a third of the store's speed (bench/remote_get_ladder.py,
 * docs/benchmarks.md). Here the pass is one call that releases the GIL for the whole block, on bytes
 * the reading thread just received (in its cache). numpy stays as the reference and the fallback where
 * this module is not built: tests/test_checksum_kernel.py checks that both agree.
 *
 * The sums, mod 2^64, over ``n`` words in rows of ROW words (4 KiB): ``plain`` is every word added;
 * ``weighted`` is each full row's sum times its position (1, 2, ...) plus the words after the last
 * full row times (rows + 1). The caller adds nothing else.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROW 512

static PyObject *py_row_sums(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    if (b.len % 8) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "row_sums: the buffer must be whole 64-bit words");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)b.buf;
    size_t n = (size_t)b.len / 8, rows = n / ROW;
    uint64_t plain = 0, weighted = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t r = 0; r < rows; r++) {
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, w[4];
        const unsigned char *q = p + r * ROW * 8;
        for (size_t i = 0; i < ROW; i += 4) {
            memcpy(w, q + i * 8, 32); /* unaligned-safe; compiled to vector loads */
            s0 += w[0];
            s1 += w[1];
            s2 += w[2];
            s3 += w[3];
        }
        uint64_t s = s0 + s1 + s2 + s3;
        plain += s;
        weighted += s * (uint64_t)(r + 1);
    }
    uint64_t rest = 0;
    for (size_t i = rows * ROW; i < n; i++) {
        uint64_t w;
        memcpy(&w, p + i * 8, 8);
        rest += w;
    }
    plain += rest;
    weighted += rest * (uint64_t)(rows + 1);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return Py_BuildValue("(KK)", (unsigned long long)plain, (unsigned long long)weighted);
}

static PyMethodDef methods[] = {
    {"row_sums", py_row_sums, METH_O, "row_sums(buffer) -> (plain, weighted): the checksum's two sums mod 2^64"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowsum", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rowsum(void) { return PyModule_Create(&module); }
