/* The loop of runtime/decode_pass.py's one pass, compiled (design note "compiled pass" there).

   stage_rows() does, row for row, what decode_pass._stage_rows_python does, and answers:
     - a list: the pass took the batch; the rows that need blocks (the others are staged);
     - None: a row broke the loop (the general path raises its error);
     - NotImplemented: something the loop does not read as the Python loop would (an attribute
       that is not an exact int, a sequence that is not a list or tuple, a row past the buffer):
       the caller restores the rows and runs the Python loop, which decides.
   It never decides differently from the Python loop: anything it cannot read as exact ints,
   lists, tuples and bools it leaves to it. A raised exception only comes from the writer's
   write_table (the caller resets the writer, as it does for the Python loop). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define NUM_ARGS 19

static PyObject *s_owner, *s_is_freed, *s_max_positions, *s_table, *s_kv_start, *s_seq_len;
static PyObject *s_pass_mark, *s_blocks, *s_block_size, *s_cache_id;

enum outcome { TAKEN, BROKEN, DEFERRED, FAILED };

/* An exact int that fits a long long: 1 and *out, or 0 (the caller defers or breaks). */
static int exact_ll(PyObject *o, long long *out)
{
    int overflow = 0;
    long long v;
    if (!PyLong_CheckExact(o))
        return 0;
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* obj.name as an exact int: 1, or 0 for anything else (an error is cleared: the Python loop
   meets it again and raises it). */
static int attr_ll(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    int ok;
    if (v == NULL) {
        PyErr_Clear();
        return 0;
    }
    ok = exact_ll(v, out);
    Py_DECREF(v);
    return ok;
}

static int fits_i32(long long v) { return v >= INT32_MIN && v <= INT32_MAX; }

/* Whether block is held: an index of block_states whose state is owned. -1: defer. */
static int is_held(long long block, PyObject *block_states, long long owned)
{
    long long state;
    if (block < 0 || block >= PyList_GET_SIZE(block_states))
        return 0;
    if (!exact_ll(PyList_GET_ITEM(block_states, block), &state))
        return -1;
    return state == owned;
}

/* record == (lo, blocks[lo:]) as the Python loop compares them: 1 equal, 0 not, -1 defer. */
static int record_matches(PyObject *record, long long lo, PyObject *blocks)
{
    PyObject *entries;
    Py_ssize_t n, k, num_blocks = PyList_GET_SIZE(blocks);
    long long record_lo, a, b;
    if (record == Py_None)
        return 0;
    if (!PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) != 2)
        return -1;
    if (!exact_ll(PyTuple_GET_ITEM(record, 0), &record_lo))
        return -1;
    if (record_lo != lo)
        return 0;
    entries = PyTuple_GET_ITEM(record, 1);
    if (!PyList_CheckExact(entries))
        return -1;
    n = PyList_GET_SIZE(entries);
    if (n != (lo < num_blocks ? num_blocks - lo : 0))
        return 0;
    for (k = 0; k < n; k++) {
        PyObject *x = PyList_GET_ITEM(entries, k), *y = PyList_GET_ITEM(blocks, lo + k);
        if (x == y)
            continue;
        if (!exact_ll(x, &a) || !exact_ll(y, &b))
            return -1;
        if (a != b)
            return 0;
    }
    return 1;
}

struct batch_args {
    long long num_drafts, owner, vocab, serial, row_bytes, block_size, cache_id;
    long long max_seq_len, window, max_blocks, owned;
    PyObject *serial_obj, *state_type, *written, *block_states, *write_table;
    unsigned char *mem;
    Py_ssize_t mem_len;
};

/* One row, as one iteration of the Python loop. */
static enum outcome stage_row(const struct batch_args *a, Py_ssize_t i, PyObject *state, PyObject *token,
                              PyObject *position, PyObject *unheld)
{
    enum outcome result = DEFERRED;
    PyObject *table = NULL, *blocks = NULL, *is_freed, *entries, *call_args[3], *index_obj, *lo_obj, *out;
    long long value, p, kv_start, seq_len, max_positions, mark, j, last, block, lo, oldest, slot, seq;
    long long span = a->num_drafts - 1;
    int held;
    unsigned char *row;

    if (Py_TYPE(state) != (PyTypeObject *)a->state_type)
        return BROKEN;
    if (!attr_ll(state, s_owner, &value))
        return DEFERRED;
    if (value != a->owner)
        return BROKEN;
    is_freed = PyObject_GetAttr(state, s_is_freed);
    if (is_freed == NULL) {
        PyErr_Clear();
        return DEFERRED;
    }
    Py_DECREF(is_freed); /* Py_True / Py_False are immortal enough to compare after */
    if (is_freed == Py_True)
        return BROKEN;
    if (is_freed != Py_False)
        return DEFERRED;
    if (!PyLong_CheckExact(token))
        return BROKEN;
    if (!exact_ll(token, &value) || value < 0 || value >= a->vocab)
        return BROKEN;
    if (!PyLong_CheckExact(position))
        return BROKEN;
    if (!exact_ll(position, &p) || p < 0 || p >= a->max_seq_len - span)
        return BROKEN;
    if (!attr_ll(state, s_max_positions, &max_positions))
        return DEFERRED;
    if (p + a->num_drafts > max_positions)
        return BROKEN;
    table = PyObject_GetAttr(state, s_table);
    if (table == NULL) {
        PyErr_Clear();
        return DEFERRED;
    }
    if (!attr_ll(state, s_kv_start, &kv_start) || !attr_ll(table, s_pass_mark, &mark))
        goto done;
    if (mark == a->serial) { /* a table two rows share: the general path refuses it */
        result = BROKEN;
        goto done;
    }
    if (PyObject_SetAttr(table, s_pass_mark, a->serial_obj) < 0) {
        PyErr_Clear();
        goto done;
    }
    if (!attr_ll(state, s_seq_len, &seq_len))
        goto done;
    if (!(0 <= kv_start && kv_start <= p && p <= seq_len)) {
        if (kv_start <= p && p <= seq_len) { /* continuing rows from a kv_start < 0: refused */
            result = BROKEN;
            goto done;
        }
        kv_start = p; /* rows that do not continue start afresh at p */
    }
    blocks = PyObject_GetAttr(table, s_blocks);
    if (blocks == NULL) {
        PyErr_Clear();
        goto done;
    }
    if (!PyList_CheckExact(blocks) || !attr_ll(table, s_block_size, &value))
        goto done;
    if (value != a->block_size) {
        result = BROKEN;
        goto done;
    }
    /* held: as PagedLatentCache._unheld_rows (design note "held rows" in runtime.kv_cache) */
    j = p / a->block_size, last = (p + span) / a->block_size;
    held = 0;
    if (j < PyList_GET_SIZE(blocks)) {
        if (!exact_ll(PyList_GET_ITEM(blocks, j), &block))
            goto done;
        held = is_held(block, a->block_states, a->owned);
        if (held == 1) {
            if (!attr_ll(table, s_cache_id, &value))
                goto done;
            held = value == a->cache_id;
        }
        if (held == 1 && last != j) {
            long long other;
            if (last - j > 1 || last >= PyList_GET_SIZE(blocks))
                held = 0;
            else if (!exact_ll(PyList_GET_ITEM(blocks, last), &other))
                goto done;
            else
                held = is_held(other, a->block_states, a->owned);
        }
        if (held < 0)
            goto done;
    }
    if (!held) {
        index_obj = PyLong_FromSsize_t(i);
        if (index_obj == NULL || PyList_Append(unheld, index_obj) < 0) {
            Py_XDECREF(index_obj);
            result = FAILED;
            goto done;
        }
        Py_DECREF(index_obj);
        result = TAKEN;
        goto done;
    }
    /* the scalars, as SCALARS.pack_into (little-endian <qqii: pos, slot, seq_len, kv_start) */
    slot = block * a->block_size + p % a->block_size, seq = p + 1;
    if ((i + 1) * a->row_bytes > a->mem_len || a->row_bytes < 24 || !fits_i32(seq) || !fits_i32(kv_start))
        goto done;
    row = a->mem + i * a->row_bytes;
    {
        int64_t pos64 = p, slot64 = slot;
        int32_t seq32 = (int32_t)seq, kv32 = (int32_t)kv_start;
        memcpy(row, &pos64, 8), memcpy(row + 8, &slot64, 8), memcpy(row + 16, &seq32, 4), memcpy(row + 20, &kv32, 4);
    }
    oldest = p - a->window + 1;
    lo = (kv_start > oldest ? kv_start : oldest) / a->block_size; /* >= 0: kv_start >= 0 here */
    if (i >= PyList_GET_SIZE(a->written))
        goto done;
    held = record_matches(PyList_GET_ITEM(a->written, i), lo, blocks);
    if (held < 0)
        goto done;
    if (!held) { /* a table that moved (or was never staged here) */
        if (PyList_GET_SIZE(blocks) > a->max_blocks) {
            result = BROKEN;
            goto done;
        }
        entries = PyList_GetSlice(blocks, lo, PyList_GET_SIZE(blocks));
        index_obj = PyLong_FromSsize_t(i);
        lo_obj = PyLong_FromLongLong(lo);
        out = NULL;
        if (entries != NULL && index_obj != NULL && lo_obj != NULL) {
            call_args[0] = index_obj, call_args[1] = lo_obj, call_args[2] = entries;
            out = PyObject_Vectorcall(a->write_table, call_args, 3, NULL);
        }
        Py_XDECREF(entries), Py_XDECREF(index_obj), Py_XDECREF(lo_obj);
        if (out == NULL) {
            result = FAILED;
            goto done;
        }
        Py_DECREF(out);
    }
    result = TAKEN;
done:
    Py_XDECREF(blocks);
    Py_XDECREF(table);
    return result;
}

static int sequence_items(PyObject *seq, PyObject ***items, Py_ssize_t *n)
{
    if (PyList_CheckExact(seq)) {
        *items = ((PyListObject *)seq)->ob_item, *n = PyList_GET_SIZE(seq);
        return 1;
    }
    if (PyTuple_CheckExact(seq)) {
        *items = ((PyTupleObject *)seq)->ob_item, *n = PyTuple_GET_SIZE(seq);
        return 1;
    }
    return 0;
}

/* stage_rows(states, tokens, positions, num_drafts, owner, vocab, serial, state_type, mem,
              row_bytes, written, block_states, block_size, cache_id, max_seq_len, window,
              max_blocks, write_table, owned) -> list | None | NotImplemented */
static PyObject *stage_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    struct batch_args a;
    Py_buffer view;
    PyObject **states, **tokens, **positions, *unheld;
    Py_ssize_t num_states, num_tokens, num_positions, n, i;
    enum outcome outcome = TAKEN;
    (void)module;
    if (nargs != NUM_ARGS) {
        PyErr_Format(PyExc_TypeError, "stage_rows takes %d arguments, got %zd", NUM_ARGS, nargs);
        return NULL;
    }
    a.serial_obj = args[6], a.state_type = args[7], a.written = args[10], a.block_states = args[11];
    a.write_table = args[17];
    if (!exact_ll(args[3], &a.num_drafts) || !exact_ll(args[4], &a.owner) || !exact_ll(args[5], &a.vocab)
        || !exact_ll(args[6], &a.serial) || !exact_ll(args[9], &a.row_bytes) || !exact_ll(args[12], &a.block_size)
        || !exact_ll(args[13], &a.cache_id) || !exact_ll(args[14], &a.max_seq_len)
        || !exact_ll(args[15], &a.window) || !exact_ll(args[16], &a.max_blocks) || !exact_ll(args[18], &a.owned)
        || a.block_size <= 0 || a.row_bytes <= 0 || !PyType_Check(a.state_type)
        || !PyList_CheckExact(a.written) || !PyList_CheckExact(a.block_states)
        || !sequence_items(args[0], &states, &num_states) || !sequence_items(args[1], &tokens, &num_tokens)
        || !sequence_items(args[2], &positions, &num_positions))
        Py_RETURN_NOTIMPLEMENTED;
    if (PyObject_GetBuffer(args[8], &view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    a.mem = view.buf, a.mem_len = view.len;
    unheld = PyList_New(0);
    if (unheld == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    n = num_states < num_tokens ? num_states : num_tokens;
    n = n < num_positions ? n : num_positions;
    /* The items are borrowed from lists the caller holds; write_table (Python) could change
       them only through the caller's own objects, which it does not. */
    for (i = 0; i < n && outcome == TAKEN; i++)
        outcome = stage_row(&a, i, states[i], tokens[i], positions[i], unheld);
    PyBuffer_Release(&view);
    if (outcome == TAKEN && num_states != num_tokens)
        outcome = BROKEN;
    switch (outcome) {
    case TAKEN:
        return unheld;
    case BROKEN:
        Py_DECREF(unheld);
        Py_RETURN_NONE;
    case DEFERRED:
        Py_DECREF(unheld);
        Py_RETURN_NOTIMPLEMENTED;
    default:
        Py_DECREF(unheld);
        return NULL;
    }
}

static PyMethodDef methods[] = {
    {"stage_rows", (PyCFunction)(void (*)(void))stage_rows, METH_FASTCALL,
     "The one pass's loop (runtime.decode_pass): a list of unheld rows, None, or NotImplemented."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "decode_pass_native", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_decode_pass_native(void)
{
#if !PY_LITTLE_ENDIAN
    PyErr_SetString(PyExc_ImportError, "decode_pass_native writes little-endian rows");
    return NULL;
#endif
    if (!(s_owner = PyUnicode_InternFromString("owner")) || !(s_is_freed = PyUnicode_InternFromString("is_freed"))
        || !(s_max_positions = PyUnicode_InternFromString("max_positions"))
        || !(s_table = PyUnicode_InternFromString("table")) || !(s_kv_start = PyUnicode_InternFromString("kv_start"))
        || !(s_seq_len = PyUnicode_InternFromString("seq_len"))
        || !(s_pass_mark = PyUnicode_InternFromString("pass_mark"))
        || !(s_blocks = PyUnicode_InternFromString("blocks"))
        || !(s_block_size = PyUnicode_InternFromString("block_size"))
        || !(s_cache_id = PyUnicode_InternFromString("cache_id")))
        return NULL;
    return PyModule_Create(&module_def);
}
