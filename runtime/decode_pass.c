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
#include <structmember.h> /* PyMemberDef before 3.12 */
#include <stdint.h>
#include <string.h>

#define NUM_ARGS 20
#define MEMBER_OBJECT_EX 16 /* T_OBJECT_EX / Py_T_OBJECT_EX: what a __slots__ entry is */
#define MEMBER_READONLY 1

/* An attribute the loop reads: by its slot's offset when the object's type keeps it in
   __slots__ (a load, where PyObject_GetAttr costs ~25 ns: ~12 reads a row), else by name. */
struct attr {
    const char *text;
    PyObject *name;
    Py_ssize_t offset; /* -1: by name */
};

enum { OWNER, IS_FREED, MAX_POSITIONS, TABLE, KV_START, SEQ_LEN, NUM_STATE_ATTRS };
enum { PASS_MARK, BLOCKS, BLOCK_SIZE, CACHE_ID, NUM_TABLE_ATTRS };
static struct attr state_attrs[NUM_STATE_ATTRS] = {
    {"owner", NULL, -1}, {"is_freed", NULL, -1}, {"max_positions", NULL, -1},
    {"table", NULL, -1}, {"kv_start", NULL, -1}, {"seq_len", NULL, -1},
};
static struct attr table_attrs[NUM_TABLE_ATTRS] = {
    {"pass_mark", NULL, -1}, {"blocks", NULL, -1}, {"block_size", NULL, -1}, {"cache_id", NULL, -1},
};
static struct attr table_attrs_by_name[NUM_TABLE_ATTRS]; /* for a table of another type */

/* The types whose slot offsets the attrs hold (a strong reference each, so that the address
   cannot be reused by another type) and their version tags (a change to a type's attributes
   changes its tag: the offsets are looked up again). */
static PyTypeObject *offsets_for[2];
static unsigned int offsets_version[2];

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

/* The offsets of attrs in type's __slots__ (-1 where it has none); 0 on an error. */
static int find_offsets(PyTypeObject *type, struct attr *attrs, int n, int which)
{
    int k;
    if (offsets_for[which] == type && type->tp_version_tag != 0 && offsets_version[which] == type->tp_version_tag)
        return 1;
    for (k = 0; k < n; k++) {
        PyObject *descr = PyObject_GetAttr((PyObject *)type, attrs[k].name);
        attrs[k].offset = -1;
        if (descr == NULL) {
            PyErr_Clear();
            continue;
        }
        if (Py_TYPE(descr) == &PyMemberDescr_Type) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == MEMBER_OBJECT_EX && !(member->flags & MEMBER_READONLY))
                attrs[k].offset = member->offset;
        }
        Py_DECREF(descr);
    }
    Py_INCREF(type);
    Py_XSETREF(offsets_for[which], type);
    offsets_version[which] = type->tp_version_tag; /* 0 (none assigned): looked up at every call */
    return 1;
}

/* obj.attr: a new reference, or NULL (an error is cleared: the Python loop meets it again and
   raises it). */
static PyObject *get_attr(PyObject *obj, const struct attr *a)
{
    PyObject *v;
    if (a->offset >= 0) {
        v = *(PyObject **)((char *)obj + a->offset);
        Py_XINCREF(v); /* NULL: an unset slot */
        return v;
    }
    v = PyObject_GetAttr(obj, a->name);
    if (v == NULL)
        PyErr_Clear();
    return v;
}

/* obj.attr = value: 1, or 0 (error cleared). */
static int set_attr(PyObject *obj, const struct attr *a, PyObject *value)
{
    if (a->offset >= 0) {
        PyObject **slot = (PyObject **)((char *)obj + a->offset);
        Py_INCREF(value);
        Py_XSETREF(*slot, value);
        return 1;
    }
    if (PyObject_SetAttr(obj, a->name, value) < 0) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* obj.attr as an exact int: 1, or 0 for anything else. */
static int attr_ll(PyObject *obj, const struct attr *a, long long *out)
{
    PyObject *v = get_attr(obj, a);
    int ok;
    if (v == NULL)
        return 0;
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
    PyObject *serial_obj, *state_type, *table_type, *written, *block_states, *write_table;
    unsigned char *mem;
    Py_ssize_t mem_len;
};

/* One row, as one iteration of the Python loop. */
static enum outcome stage_row(const struct batch_args *a, Py_ssize_t i, PyObject *state, PyObject *token,
                              PyObject *position, PyObject *unheld)
{
    enum outcome result = DEFERRED;
    const struct attr *tattrs;
    PyObject *table = NULL, *blocks = NULL, *is_freed, *entries, *call_args[3], *index_obj, *lo_obj, *out;
    long long value, p, kv_start, seq_len, max_positions, mark, j, last, block, lo, oldest, slot, seq;
    long long span = a->num_drafts - 1;
    int held;
    unsigned char *row;

    if (Py_TYPE(state) != (PyTypeObject *)a->state_type)
        return BROKEN;
    if (!attr_ll(state, &state_attrs[OWNER], &value))
        return DEFERRED;
    if (value != a->owner)
        return BROKEN;
    is_freed = get_attr(state, &state_attrs[IS_FREED]);
    if (is_freed == NULL)
        return DEFERRED;
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
    if (!attr_ll(state, &state_attrs[MAX_POSITIONS], &max_positions))
        return DEFERRED;
    if (p + a->num_drafts > max_positions)
        return BROKEN;
    table = get_attr(state, &state_attrs[TABLE]);
    if (table == NULL)
        return DEFERRED;
    tattrs = Py_TYPE(table) == (PyTypeObject *)a->table_type ? table_attrs : table_attrs_by_name;
    if (!attr_ll(state, &state_attrs[KV_START], &kv_start) || !attr_ll(table, &tattrs[PASS_MARK], &mark))
        goto done;
    if (mark == a->serial) { /* a table two rows share: the general path refuses it */
        result = BROKEN;
        goto done;
    }
    if (!set_attr(table, &tattrs[PASS_MARK], a->serial_obj))
        goto done;
    if (!attr_ll(state, &state_attrs[SEQ_LEN], &seq_len))
        goto done;
    if (!(0 <= kv_start && kv_start <= p && p <= seq_len)) {
        if (kv_start <= p && p <= seq_len) { /* continuing rows from a kv_start < 0: refused */
            result = BROKEN;
            goto done;
        }
        kv_start = p; /* rows that do not continue start afresh at p */
    }
    blocks = get_attr(table, &tattrs[BLOCKS]);
    if (blocks == NULL)
        goto done;
    if (!PyList_CheckExact(blocks) || !attr_ll(table, &tattrs[BLOCK_SIZE], &value))
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
            if (!attr_ll(table, &tattrs[CACHE_ID], &value))
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
              max_blocks, write_table, owned, table_type) -> list | None | NotImplemented */
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
    a.write_table = args[17], a.table_type = args[19];
    if (!exact_ll(args[3], &a.num_drafts) || !exact_ll(args[4], &a.owner) || !exact_ll(args[5], &a.vocab)
        || !exact_ll(args[6], &a.serial) || !exact_ll(args[9], &a.row_bytes) || !exact_ll(args[12], &a.block_size)
        || !exact_ll(args[13], &a.cache_id) || !exact_ll(args[14], &a.max_seq_len)
        || !exact_ll(args[15], &a.window) || !exact_ll(args[16], &a.max_blocks) || !exact_ll(args[18], &a.owned)
        || a.block_size <= 0 || a.row_bytes <= 0 || !PyType_Check(a.state_type) || !PyType_Check(a.table_type)
        || !PyList_CheckExact(a.written) || !PyList_CheckExact(a.block_states)
        || !sequence_items(args[0], &states, &num_states) || !sequence_items(args[1], &tokens, &num_tokens)
        || !sequence_items(args[2], &positions, &num_positions))
        Py_RETURN_NOTIMPLEMENTED;
    if (!find_offsets((PyTypeObject *)a.state_type, state_attrs, NUM_STATE_ATTRS, 0)
        || !find_offsets((PyTypeObject *)a.table_type, table_attrs, NUM_TABLE_ATTRS, 1))
        return NULL;
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
    int k;
#if !PY_LITTLE_ENDIAN
    PyErr_SetString(PyExc_ImportError, "decode_pass_native writes little-endian rows");
    return NULL;
#endif
    for (k = 0; k < NUM_STATE_ATTRS; k++)
        if (!(state_attrs[k].name = PyUnicode_InternFromString(state_attrs[k].text)))
            return NULL;
    for (k = 0; k < NUM_TABLE_ATTRS; k++) {
        if (!(table_attrs[k].name = PyUnicode_InternFromString(table_attrs[k].text)))
            return NULL;
        table_attrs_by_name[k] = table_attrs[k];
    }
    return PyModule_Create(&module_def);
}
