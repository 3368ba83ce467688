/* The per-row work of a propose over flat buffers: the C twin of runtime/native/batch_kernel.py.
 *
 * Every argument is a flat buffer (the buffer protocol: numpy arrays), a number, or the state
 * bind() made (a capsule holding the buffers of the rows' and the pool's arrays); nothing here
 * reads a Python object's layout. The functions, their arguments and their results are the
 * numpy twin's, and tests/test_batch_kernel.py holds the two equal on random batches.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { OK, STALE, TWICE, TOKEN, POSITION, BUDGET, POOL, COUNT, UNPROPOSED };
enum { FREE = 0, OWNED = 1 };
enum { POS = 0, SLOT = 8, SEQ_LEN = 16, KV_START = 20, TABLE = 256 };
#define CUT (-1)
#define ROW_MASK ((int64_t)((1 << 20) - 1))

static int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

static void release(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++)
        if (views[i].obj != NULL) PyBuffer_Release(&views[i]);
}

/* The rows' and the pool's arrays and sizes, their buffers held from bind() until the capsule goes:
 * a call then parses only its batch's arrays (ten buffers fewer a verify: 0.90 -> 0.29 us here). */
enum { B_KEY, B_SEQ_LEN, B_KV_START, B_MAX_POSITIONS, B_LAST_DRAFTED, B_VERIFY_DUE, B_TABLES, B_NUM_TRIMMED, B_BLOCK_STATE,
       B_FREE_STACK, B_FREE_TOP, B_ARRAYS };
typedef struct {
    Py_buffer v[B_ARRAYS];
    long long vocab, max_seq_len, block_size, window;
    Py_ssize_t rows, width;
} Bound;

static void bound_free(PyObject *capsule) {
    Bound *b = PyCapsule_GetPointer(capsule, "batch_kernel.bound");
    if (b == NULL) return;
    release(b->v, B_ARRAYS);
    PyMem_Free(b);
}

/* bind(seq_key, seq_len, kv_start, max_positions, last_drafted, verify_due, tables, num_trimmed, block_state,
 *      free_stack, free_top, vocab, max_seq_len, block_size, window) -> the bound state (a capsule) */
static PyObject *bind(PyObject *self, PyObject *args) {
    Bound *b = PyMem_Calloc(1, sizeof(Bound));
    if (b == NULL) return PyErr_NoMemory();
    Py_buffer *v = b->v;
    if (!PyArg_ParseTuple(args, "w*w*w*w*w*w*w*w*w*w*w*LLLL", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7],
                          &v[8], &v[9], &v[10], &b->vocab, &b->max_seq_len, &b->block_size, &b->window)) {
        release(v, B_ARRAYS);
        PyMem_Free(b);
        return NULL;
    }
    b->rows = v[B_KEY].len / 8;
    b->width = b->rows ? v[B_TABLES].len / 4 / b->rows : 0;
    PyObject *capsule = PyCapsule_New(b, "batch_kernel.bound", bound_free);
    if (capsule == NULL) {
        release(v, B_ARRAYS);
        PyMem_Free(b);
    }
    return capsule;
}

static Bound *bound_of(PyObject *capsule) { return PyCapsule_GetPointer(capsule, "batch_kernel.bound"); }

/* STALE at the first key of no live row, TWICE at the first row named again, else OK. */
static int check_keys(const int64_t *keys, Py_ssize_t n, const int64_t *seq_key, Py_ssize_t rows, Py_ssize_t *index) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = keys[i] & ROW_MASK;
        if (keys[i] == 0 || row >= rows || seq_key[row] != keys[i]) return *index = i, STALE;
    }
    for (Py_ssize_t i = 1; i < n; i++)
        for (Py_ssize_t j = 0; j < i; j++)
            if ((keys[i] & ROW_MASK) == (keys[j] & ROW_MASK)) return *index = i, TWICE;
    return OK;
}

/* place(bound, keys, tokens, pos, spans, kv_out, mapped_out) -> (status, index, m)
 * spans: int64 [1] (every row's) or [n] (each row's). */
static PyObject *place(PyObject *self, PyObject *args) {
    Py_buffer v[6] = {{0}};
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "Oy*y*y*y*w*w*", &capsule, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5])) return NULL;
    Bound *b = bound_of(capsule);
    if (b == NULL) {
        release(v, 6);
        return NULL;
    }
    const int64_t *keys = v[0].buf, *tokens = v[1].buf, *pos = v[2].buf, *spans = v[3].buf;
    int64_t *kv_out = v[4].buf, *mapped_out = v[5].buf;
    const int64_t *seq_key = b->v[B_KEY].buf, *seq_len = b->v[B_SEQ_LEN].buf, *kv_start = b->v[B_KV_START].buf;
    const int64_t *max_positions = b->v[B_MAX_POSITIONS].buf;
    int32_t *tables = b->v[B_TABLES].buf, *free_stack = b->v[B_FREE_STACK].buf;
    int64_t *num_trimmed = b->v[B_NUM_TRIMMED].buf, *free_top = b->v[B_FREE_TOP].buf;
    int8_t *block_state = b->v[B_BLOCK_STATE].buf;
    long long vocab = b->vocab, max_seq_len = b->max_seq_len, block_size = b->block_size;
    Py_ssize_t n = v[2].len / 8, rows = b->rows, num_spans = v[3].len / 8, room = v[5].len / 16, width = b->width;
    Py_ssize_t index = 0, m = 0;
    if (num_spans != 1 && num_spans != n) {
        release(v, 6);
        return PyErr_Format(PyExc_ValueError, "spans: 1 or %zd entries, got %zd", n, num_spans);
    }
#define SPAN(i) spans[num_spans == 1 ? 0 : (i)]
    int status = check_keys(keys, n, seq_key, rows, &index);
    for (Py_ssize_t i = 0; i < n && status == OK; i++)
        if (tokens[i] < 0 || tokens[i] >= vocab) status = TOKEN, index = i;
    for (Py_ssize_t i = 0; i < n && status == OK; i++)
        if (pos[i] < 0 || pos[i] >= max_seq_len) status = POSITION, index = i;
    for (Py_ssize_t i = 0; i < n && status == OK; i++)
        if (pos[i] + SPAN(i) > max_positions[keys[i] & ROW_MASK]) status = BUDGET, index = i;
    if (status == OK) {  /* the blocks missing, all or nothing */
        Py_ssize_t needed = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const int32_t *table = tables + (keys[i] & ROW_MASK) * width;
            for (int64_t j = pos[i] / block_size; j <= (pos[i] + SPAN(i) - 1) / block_size; j++)
                needed += table[j] < 0;
        }
        if (needed > free_top[0]) status = POOL, index = needed;
        else if (needed > room) {
            release(v, 6);
            return PyErr_Format(PyExc_ValueError, "mapped_out: room for %zd (row, entry) pairs, %zd mapped", room,
                                needed);
        }
    }
    if (status == OK) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t row = keys[i] & ROW_MASK, p = pos[i], first = kv_start[row];
            int32_t *table = tables + row * width;
            for (int64_t j = p / block_size; j <= (p + SPAN(i) - 1) / block_size; j++) {
                if (table[j] >= 0) continue;
                int32_t block = free_stack[--free_top[0]];
                table[j] = block;
                block_state[block] = OWNED;
                if (j < num_trimmed[row]) num_trimmed[row] = j;
                mapped_out[2 * m] = row, mapped_out[2 * m + 1] = j, m++;
            }
            kv_out[i] = (first <= p && p <= seq_len[row]) ? first : p;
        }
    }
#undef SPAN
    release(v, 6);
    return Py_BuildValue("(inn)", status, index, m);
}

/* write(meta, row_bytes, max_blocks, columns, window, block_size, tables, rows, pos, kv, token_buf, tokens,
 *       num_live) -> n */
static PyObject *write_rows(PyObject *self, PyObject *args) {
    Py_buffer v[7] = {{0}};
    Py_ssize_t row_bytes, max_blocks, columns, window, block_size, num_live;
    if (!PyArg_ParseTuple(args, "w*nnnnny*y*y*y*w*y*n", &v[0], &row_bytes, &max_blocks, &columns, &window,
                          &block_size, &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &num_live))
        return NULL;
    char *meta = v[0].buf;
    const int32_t *tables = v[1].buf;
    const int64_t *rows = v[2].buf, *pos = v[3].buf, *kv = v[4].buf, *tokens = v[6].buf;
    int64_t *token_buf = v[5].buf;
    Py_ssize_t n = v[3].len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        char *row = meta + i * row_bytes;
        const int32_t *table = tables + (rows[i] & ROW_MASK) * max_blocks;
        int64_t p = pos[i], block = table[p / block_size];
        int64_t slot = block >= 0 ? block * block_size + p % block_size : -1;
        int32_t seq_len = (int32_t)(p + 1), kv_start = (int32_t)kv[i];
        memcpy(row + POS, &p, 8);
        memcpy(row + SLOT, &slot, 8);
        memcpy(row + SEQ_LEN, &seq_len, 4);
        memcpy(row + KV_START, &kv_start, 4);
        int64_t lo = floor_div(p - (window - 1), block_size);
        if (lo > max_blocks - columns) lo = max_blocks - columns;
        if (lo < 0) lo = 0;
        memcpy(row + TABLE + 4 * lo, table + lo, 4 * columns);
        token_buf[i] = tokens[i];
    }
    for (Py_ssize_t i = n; i < num_live; i++) {
        char *row = meta + i * row_bytes;
        int64_t zero = 0, dead = -1;
        int32_t none = 0, one = 1;
        memcpy(row + POS, &zero, 8);
        memcpy(row + SLOT, &dead, 8);
        memcpy(row + SEQ_LEN, &none, 4);
        memcpy(row + KV_START, &one, 4);
        memset(row + TABLE, 0xff, 4 * columns);
        token_buf[i] = 0;
    }
    release(v, 7);
    return PyLong_FromSsize_t(n);
}

/* commit(bound, keys, pos, kv, drafts, k, gated, kept_out) -> blocks given back */
static PyObject *commit(PyObject *self, PyObject *args) {
    Py_buffer v[5] = {{0}};
    PyObject *capsule;
    Py_ssize_t k;
    int gated;
    if (!PyArg_ParseTuple(args, "Oy*y*y*y*npw*", &capsule, &v[0], &v[1], &v[2], &v[3], &k, &gated, &v[4])) return NULL;
    Bound *b = bound_of(capsule);
    if (b == NULL) {
        release(v, 5);
        return NULL;
    }
    const int64_t *keys = v[0].buf, *pos = v[1].buf, *kv = v[2].buf, *drafts = v[3].buf;
    int64_t *kept_out = v[4].buf;
    int64_t *seq_len = b->v[B_SEQ_LEN].buf, *kv_start = b->v[B_KV_START].buf, *last_drafted = b->v[B_LAST_DRAFTED].buf;
    int64_t *num_trimmed = b->v[B_NUM_TRIMMED].buf, *free_top = b->v[B_FREE_TOP].buf;
    uint8_t *verify_due = b->v[B_VERIFY_DUE].buf;
    int32_t *tables = b->v[B_TABLES].buf, *free_stack = b->v[B_FREE_STACK].buf;
    int8_t *block_state = b->v[B_BLOCK_STATE].buf;
    long long window = b->window, block_size = b->block_size;
    Py_ssize_t n = v[1].len / 8, width = b->width, freed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t kept = k, row = keys[i] & ROW_MASK;
        if (gated) {
            kept = 0;
            for (Py_ssize_t j = 0; j < k; j++) kept += drafts[i * k + j] != CUT;
        }
        kept_out[i] = kept;
        seq_len[row] = pos[i] + kept;
        kv_start[row] = kv[i];
        last_drafted[row] = kept;
        verify_due[row] = 1;
        int64_t stop = floor_div(pos[i] - (window - 1), block_size);
        if (stop > num_trimmed[row]) {
            int32_t *table = tables + row * width;
            for (int64_t j = num_trimmed[row]; j < stop && j < width; j++) {
                if (table[j] < 0) continue;
                free_stack[free_top[0]++] = table[j];
                block_state[table[j]] = FREE;
                table[j] = -1;
                freed++;
            }
            num_trimmed[row] = stop;
        }
    }
    release(v, 5);
    return PyLong_FromSsize_t(freed);
}

/* verify(bound, keys, accepted) -> (status, index, blocks given back) */
static PyObject *verify(PyObject *self, PyObject *args) {
    Py_buffer v[2] = {{0}};
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "Oy*y*", &capsule, &v[0], &v[1])) return NULL;
    Bound *b = bound_of(capsule);
    if (b == NULL) {
        release(v, 2);
        return NULL;
    }
    const int64_t *keys = v[0].buf, *accepted = v[1].buf, *seq_key = b->v[B_KEY].buf, *kv_start = b->v[B_KV_START].buf;
    const int64_t *last_drafted = b->v[B_LAST_DRAFTED].buf;
    int64_t *seq_len = b->v[B_SEQ_LEN].buf, *free_top = b->v[B_FREE_TOP].buf;
    uint8_t *verify_due = b->v[B_VERIFY_DUE].buf;
    int32_t *tables = b->v[B_TABLES].buf, *free_stack = b->v[B_FREE_STACK].buf;
    int8_t *block_state = b->v[B_BLOCK_STATE].buf;
    long long block_size = b->block_size;
    Py_ssize_t n = v[0].len / 8, rows = b->rows, width = b->width, index = 0, freed = 0;
    int status = check_keys(keys, n, seq_key, rows, &index);
    for (Py_ssize_t i = 0; i < n && status == OK; i++) {
        int64_t drafted = last_drafted[keys[i] & ROW_MASK];
        if (drafted < 1) drafted = 1;
        if (accepted[i] < 0 || accepted[i] > drafted) status = COUNT, index = i;
    }
    for (Py_ssize_t i = 0; i < n && status == OK; i++)
        if (!verify_due[keys[i] & ROW_MASK]) status = UNPROPOSED, index = i;
    for (Py_ssize_t i = 0; i < n && status == OK; i++) {
        int64_t row = keys[i] & ROW_MASK, drafted = last_drafted[row];
        if (drafted < 1) drafted = 1;
        int64_t trim = drafted - accepted[i];
        verify_due[row] = 0;
        if (trim <= 0) continue;
        int64_t last = seq_len[row], length = last - trim;
        if (length < kv_start[row]) length = kv_start[row];
        seq_len[row] = length;
        int32_t *table = tables + row * width;
        int64_t first = (length + block_size - 1) / block_size, held = 0;
        for (int64_t j = first; j <= floor_div(last - 1, block_size) && j < width; j++) held |= table[j] >= 0;
        if (!held) continue;
        for (int64_t j = first; j < width; j++) {
            if (table[j] < 0) continue;
            free_stack[free_top[0]++] = table[j];
            block_state[table[j]] = FREE;
            table[j] = -1;
            freed++;
        }
    }
    release(v, 2);
    return Py_BuildValue("(inn)", status, index, freed);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "Hold the rows' and the pool's arrays for the calls below (see batch_kernel.py)."},
    {"place", place, METH_VARARGS, "Check a batch and place its rows (see batch_kernel.py)."},
    {"write", write_rows, METH_VARARGS, "Write a batch's metadata rows and tokens (see batch_kernel.py)."},
    {"commit", commit, METH_VARARGS, "Write a propose's rows back (see batch_kernel.py)."},
    {"verify", verify, METH_VARARGS, "after_verify of a batch (see batch_kernel.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "batch_kernel_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_batch_kernel_native(void) { return PyModule_Create(&module_def); }
