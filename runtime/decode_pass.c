/* The loop of runtime/decode_pass.py's one pass, compiled (design note "compiled pass" there).

   stage_rows() does, row for row, what decode_pass._stage_rows_python does, and answers:
     - a list: the pass took the batch; the rows that need blocks (the others are staged);
     - None: a row broke the loop (the general path raises its error);
     - NotImplemented: something the loop does not read as the Python loop would (an attribute
       that is not an exact int, a sequence that is not a list or tuple, a row past the buffer):
       the caller restores the rows and runs the Python loop, which decides.
   It never decides differently from the Python loop: anything it cannot read as exact ints,
   lists, tuples and bools it leaves to it. It writes a moved block table itself, as
   MetadataWriter.write_table does (bytes and record). A raised exception is a MemoryError (the
   caller resets the writer, as it does for the Python loop). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* PyMemberDef before 3.12 */
#include <stdint.h>
#include <string.h>

#define NUM_ARGS 20 /* and a 21st, optional: the rows to stage (all when None or left out) */
#define NUM_ENSURE_ARGS 11
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
enum { PASS_MARK, BLOCKS, BLOCK_SIZE, CACHE_ID, NUM_TRIMMED, NUM_TABLE_ATTRS };
static struct attr state_attrs[NUM_STATE_ATTRS] = {
    {"owner", NULL, -1}, {"is_freed", NULL, -1}, {"max_positions", NULL, -1},
    {"table", NULL, -1}, {"kv_start", NULL, -1}, {"seq_len", NULL, -1},
};
static struct attr table_attrs[NUM_TABLE_ATTRS] = {
    {"pass_mark", NULL, -1}, {"blocks", NULL, -1}, {"block_size", NULL, -1}, {"cache_id", NULL, -1},
    {"num_trimmed", NULL, -1},
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
    long long table_offset; /* BLOCK_TABLE_OFFSET: where a row's block table starts */
    PyObject *serial_obj, *state_type, *table_type, *written, *block_states;
    unsigned char *mem;
    Py_ssize_t mem_len;
};

/* Row i's block table: blocks[lo:] from entry lo on, -1 elsewhere, and its record (lo, entries),
   as MetadataWriter.write_table writes them (the old record's entries cleared first). */
static enum outcome write_table(const struct batch_args *a, Py_ssize_t i, long long lo, PyObject *blocks)
{
    PyObject *record = PyList_GET_ITEM(a->written, i), *entries, *lo_obj, *new_record;
    unsigned char *table = a->mem + i * a->row_bytes + a->table_offset;
    Py_ssize_t n, k, old_n = 0;
    long long old_lo = 0, e;
    if (record != Py_None) { /* a well-formed (lo, list) here: record_matches read it */
        exact_ll(PyTuple_GET_ITEM(record, 0), &old_lo);
        old_n = PyList_GET_SIZE(PyTuple_GET_ITEM(record, 1));
    }
    entries = PyList_GetSlice(blocks, lo, PyList_GET_SIZE(blocks));
    if (entries == NULL)
        return FAILED;
    n = PyList_GET_SIZE(entries);
    if (old_lo < 0 || a->table_offset + 4 * (old_lo + old_n) > a->row_bytes || a->table_offset + 4 * (lo + n) > a->row_bytes)
        goto deferred; /* struct.pack_into would raise: the Python loop raises it */
    for (k = 0; k < n; k++)
        if (!exact_ll(PyList_GET_ITEM(entries, k), &e) || !fits_i32(e))
            goto deferred;
    memset(table + 4 * old_lo, 0xff, 4 * old_n); /* the entries written before: -1 */
    for (k = 0; k < n; k++) {
        int32_t entry;
        exact_ll(PyList_GET_ITEM(entries, k), &e);
        entry = (int32_t)e;
        memcpy(table + 4 * (lo + k), &entry, 4);
    }
    lo_obj = PyLong_FromLongLong(lo);
    new_record = lo_obj == NULL ? NULL : PyTuple_Pack(2, lo_obj, entries);
    Py_XDECREF(lo_obj);
    Py_DECREF(entries);
    if (new_record == NULL)
        return FAILED;
    PyList_SetItem(a->written, i, new_record); /* steals it; drops the old record */
    return TAKEN;
deferred:
    Py_DECREF(entries);
    return DEFERRED;
}

/* One row, as one iteration of the Python loop. */
static enum outcome stage_row(const struct batch_args *a, Py_ssize_t i, PyObject *state, PyObject *token,
                              PyObject *position, PyObject *unheld)
{
    enum outcome result = DEFERRED;
    const struct attr *tattrs;
    PyObject *table = NULL, *blocks = NULL, *is_freed, *index_obj;
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
        result = write_table(a, i, lo, blocks);
        if (result != TAKEN)
            goto done;
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
              max_blocks, table_offset, owned, table_type[, rows]) -> list | None | NotImplemented */
static PyObject *stage_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    struct batch_args a;
    Py_buffer view;
    PyObject **states, **tokens, **positions, *unheld, *rows = Py_None;
    Py_ssize_t num_states, num_tokens, num_positions, n, i, r, num_rows;
    enum outcome outcome = TAKEN;
    (void)module;
    if (nargs != NUM_ARGS && nargs != NUM_ARGS + 1) {
        PyErr_Format(PyExc_TypeError, "stage_rows takes %d or %d arguments, got %zd", NUM_ARGS, NUM_ARGS + 1, nargs);
        return NULL;
    }
    if (nargs > NUM_ARGS)
        rows = args[NUM_ARGS];
    if (rows != Py_None && !PyList_CheckExact(rows))
        Py_RETURN_NOTIMPLEMENTED;
    a.serial_obj = args[6], a.state_type = args[7], a.written = args[10], a.block_states = args[11];
    a.table_type = args[19];
    if (!exact_ll(args[3], &a.num_drafts) || !exact_ll(args[4], &a.owner) || !exact_ll(args[5], &a.vocab)
        || !exact_ll(args[6], &a.serial) || !exact_ll(args[9], &a.row_bytes) || !exact_ll(args[12], &a.block_size)
        || !exact_ll(args[13], &a.cache_id) || !exact_ll(args[14], &a.max_seq_len)
        || !exact_ll(args[15], &a.window) || !exact_ll(args[16], &a.max_blocks) || !exact_ll(args[18], &a.owned)
        || !exact_ll(args[17], &a.table_offset) || a.table_offset < 0
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
    /* The items are borrowed from lists the caller holds, which nothing here calls out to change. */
    num_rows = rows == Py_None ? n : PyList_GET_SIZE(rows);
    for (r = 0; r < num_rows && outcome == TAKEN; r++) {
        long long row = r;
        if (rows != Py_None && (!exact_ll(PyList_GET_ITEM(rows, r), &row) || row < 0 || row >= n)) {
            outcome = DEFERRED;
            break;
        }
        i = (Py_ssize_t)row;
        outcome = stage_row(&a, i, states[i], tokens[i], positions[i], unheld);
    }
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


/* ensure_tables(tables, first_positions, span, rows, table_type, free, block_states, cache_id,
                 block_size, owned, max_seq_len) -> [(row, length before, [new ids]), ...] | NotImplemented

   PagedLatentCache.ensure_unheld of the given rows, compiled (design note "compiled pass" in
   runtime/decode_pass.py): positions p .. p + span of tables[row] (p = first_positions[row])
   get blocks, all or nothing. Every table is checked first as _check_table checks it (its held
   blocks, from num_trimmed on, are this cache's and owned) and the blocks counted; only then
   are blocks popped from the end of ``free`` and mapped, in the order _allocate maps them.
   Anything the Python ensure would raise for (a range out of bounds, a table checked bad, a
   pool too small) or that this loop does not read (a table of another type, a value that is
   not an exact int) is NotImplemented, with nothing changed: the caller's Python ensure then
   raises or does it. A record for each row that got blocks. */
static PyObject *ensure_tables(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *tables, *positions, *rows, *free_list, *block_states, *cache_id_obj, *block_size_obj, *owned_obj;
    PyObject *records = NULL, *table = NULL, *blocks = NULL, *value;
    PyTypeObject *table_type;
    Py_ssize_t n, r, k, j, num_free, num_states, total = 0;
    long long cache_id, bs, owned, first, last, e, trimmed, span, max_seq_len, row;
    (void)module;
    if (nargs != NUM_ENSURE_ARGS) {
        PyErr_Format(PyExc_TypeError, "ensure_tables takes %d arguments, got %zd", NUM_ENSURE_ARGS, nargs);
        return NULL;
    }
    tables = args[0], positions = args[1], rows = args[3], table_type = (PyTypeObject *)args[4];
    free_list = args[5], block_states = args[6], cache_id_obj = args[7], block_size_obj = args[8];
    owned_obj = args[9];
    if (!PyList_CheckExact(tables) || !PyList_CheckExact(positions) || !PyList_CheckExact(rows)
        || !exact_ll(args[2], &span) || !PyType_Check(args[4]) || !PyList_CheckExact(free_list)
        || !PyList_CheckExact(block_states) || !exact_ll(cache_id_obj, &cache_id) || !exact_ll(block_size_obj, &bs)
        || !exact_ll(owned_obj, &owned) || !exact_ll(args[10], &max_seq_len) || bs <= 0 || span < 0
        || PyList_GET_SIZE(positions) < PyList_GET_SIZE(tables))
        Py_RETURN_NOTIMPLEMENTED;
    if (!find_offsets(table_type, table_attrs, NUM_TABLE_ATTRS, 1))
        return NULL;
    for (k = 0; k < NUM_TABLE_ATTRS; k++)
        if (table_attrs[k].offset < 0) /* a table type without these slots: the Python ensure */
            Py_RETURN_NOTIMPLEMENTED;
    n = PyList_GET_SIZE(rows), num_states = PyList_GET_SIZE(block_states);
    /* 1. Check every row's range and table and count the blocks; nothing changes here. */
    for (r = 0; r < n; r++) {
        Py_ssize_t length;
        int has_held = 0;
        if (!exact_ll(PyList_GET_ITEM(rows, r), &row) || row < 0 || row >= PyList_GET_SIZE(tables))
            Py_RETURN_NOTIMPLEMENTED;
        table = PyList_GET_ITEM(tables, row); /* borrowed: the list is the caller's, unchanged here */
        if (Py_TYPE(table) != table_type)
            Py_RETURN_NOTIMPLEMENTED;
        blocks = *(PyObject **)((char *)table + table_attrs[BLOCKS].offset);
        value = *(PyObject **)((char *)table + table_attrs[NUM_TRIMMED].offset);
        if (blocks == NULL || !PyList_CheckExact(blocks) || value == NULL || !exact_ll(value, &trimmed))
            Py_RETURN_NOTIMPLEMENTED;
        if (!exact_ll(PyList_GET_ITEM(positions, row), &first) || first < 0 || first + span >= max_seq_len)
            Py_RETURN_NOTIMPLEMENTED;
        last = first + span;
        length = PyList_GET_SIZE(blocks);
        for (j = trimmed > 0 ? (Py_ssize_t)(trimmed < length ? trimmed : length) : 0; j < length; j++) {
            if (!exact_ll(PyList_GET_ITEM(blocks, j), &e))
                Py_RETURN_NOTIMPLEMENTED;
            if (e >= 0) { /* held: one of this cache's blocks, owned (else _check_table raises) */
                long long state;
                if (e >= num_states || !exact_ll(PyList_GET_ITEM(block_states, e), &state) || state != owned)
                    Py_RETURN_NOTIMPLEMENTED;
                has_held = 1;
            }
        }
        if (has_held) {
            value = *(PyObject **)((char *)table + table_attrs[CACHE_ID].offset);
            if (value == NULL || !exact_ll(value, &e) || e != cache_id)
                Py_RETURN_NOTIMPLEMENTED;
        }
        for (j = (Py_ssize_t)(first / bs); j <= (Py_ssize_t)(last / bs); j++) {
            if (j >= length)
                total++;
            else if (!exact_ll(PyList_GET_ITEM(blocks, j), &e))
                Py_RETURN_NOTIMPLEMENTED;
            else if (e < 0)
                total++;
        }
    }
    num_free = PyList_GET_SIZE(free_list);
    if (total > num_free) /* the pool is too small: the Python ensure raises its CacheError */
        Py_RETURN_NOTIMPLEMENTED;
    for (j = num_free - total; j < num_free; j++)
        if (!exact_ll(PyList_GET_ITEM(free_list, j), &e) || e < 0 || e >= num_states)
            Py_RETURN_NOTIMPLEMENTED;
    records = PyList_New(0);
    if (records == NULL)
        return NULL;
    /* 2. Map the blocks, as _allocate does: popped from the end of the free list, lowest entry first. */
    for (r = 0; r < n; r++) {
        Py_ssize_t length, first_missing = -1, count = 0, filled = 0;
        PyObject *new_ids, *record, *minus_one;
        exact_ll(PyList_GET_ITEM(rows, r), &row); /* checked in 1. */
        table = PyList_GET_ITEM(tables, row);
        blocks = *(PyObject **)((char *)table + table_attrs[BLOCKS].offset);
        exact_ll(PyList_GET_ITEM(positions, row), &first);
        last = first + span;
        exact_ll(*(PyObject **)((char *)table + table_attrs[NUM_TRIMMED].offset), &trimmed); /* checked in 1. */
        length = PyList_GET_SIZE(blocks);
        for (j = (Py_ssize_t)(first / bs); j <= (Py_ssize_t)(last / bs); j++) {
            if (j >= length || (exact_ll(PyList_GET_ITEM(blocks, j), &e), e < 0)) {
                count++;
                if (first_missing < 0)
                    first_missing = j;
            }
        }
        if (count == 0)
            continue;
        new_ids = PyList_New(count);
        if (new_ids == NULL)
            goto failed;
        minus_one = PyLong_FromLong(-1);
        if (minus_one == NULL) {
            Py_DECREF(new_ids);
            goto failed;
        }
        while (PyList_GET_SIZE(blocks) <= (Py_ssize_t)(last / bs)) { /* as _allocate's extend with -1 */
            if (PyList_Append(blocks, minus_one) < 0) {
                Py_DECREF(minus_one), Py_DECREF(new_ids);
                goto failed;
            }
        }
        Py_DECREF(minus_one);
        for (j = first_missing; j <= (Py_ssize_t)(last / bs); j++) {
            PyObject *block;
            exact_ll(PyList_GET_ITEM(blocks, j), &e);
            if (e >= 0)
                continue;
            num_free = PyList_GET_SIZE(free_list);
            block = PyList_GET_ITEM(free_list, num_free - 1);
            Py_INCREF(block);
            if (PyList_SetSlice(free_list, num_free - 1, num_free, NULL) < 0) {
                Py_DECREF(block), Py_DECREF(new_ids);
                goto failed;
            }
            exact_ll(block, &e);
            Py_INCREF(block);
            PyList_SET_ITEM(new_ids, filled++, block);
            Py_INCREF(owned_obj);
            PyList_SetItem(block_states, (Py_ssize_t)e, owned_obj); /* steals; drops the old state */
            PyList_SetItem(blocks, j, block);                        /* steals the reference taken above */
        }
        if (first_missing < trimmed) { /* design note "trimmed front": lowered to the lowest entry filled */
            value = PyLong_FromSsize_t(first_missing);
            if (value == NULL) {
                Py_DECREF(new_ids);
                goto failed;
            }
            Py_XSETREF(*(PyObject **)((char *)table + table_attrs[NUM_TRIMMED].offset), value);
        }
        Py_INCREF(cache_id_obj), Py_INCREF(block_size_obj);
        Py_XSETREF(*(PyObject **)((char *)table + table_attrs[CACHE_ID].offset), cache_id_obj);
        Py_XSETREF(*(PyObject **)((char *)table + table_attrs[BLOCK_SIZE].offset), block_size_obj);
        record = Py_BuildValue("(LnN)", row, length, new_ids);
        if (record == NULL || PyList_Append(records, record) < 0) {
            Py_XDECREF(record);
            goto failed;
        }
        Py_DECREF(record);
    }
    return records;
failed: /* memory ran out while mapping: the tables may be part done, as a MemoryError in _allocate leaves them */
    Py_DECREF(records);
    return NULL;
}

/* Whether table (of the slotted table type) passes _check_table: entries from num_trimmed on are
   exact ints, the held ones this cache's and owned. 1, or 0 (the Python trim raises, or decides). */
static int table_checks(PyObject *table, long long cache_id, PyObject *block_states, long long owned)
{
    PyObject *blocks = *(PyObject **)((char *)table + table_attrs[BLOCKS].offset);
    PyObject *value = *(PyObject **)((char *)table + table_attrs[NUM_TRIMMED].offset);
    Py_ssize_t j, length, num_states = PyList_GET_SIZE(block_states);
    long long trimmed, e, state;
    int has_held = 0;
    if (blocks == NULL || !PyList_CheckExact(blocks) || value == NULL || !exact_ll(value, &trimmed))
        return 0;
    length = PyList_GET_SIZE(blocks);
    for (j = trimmed > 0 ? (Py_ssize_t)(trimmed < length ? trimmed : length) : 0; j < length; j++) {
        if (!exact_ll(PyList_GET_ITEM(blocks, j), &e))
            return 0;
        if (e >= 0) {
            if (e >= num_states || !exact_ll(PyList_GET_ITEM(block_states, e), &state) || state != owned)
                return 0;
            has_held = 1;
        }
    }
    if (has_held) {
        value = *(PyObject **)((char *)table + table_attrs[CACHE_ID].offset);
        if (value == NULL || !exact_ll(value, &e) || e != cache_id)
            return 0;
    }
    return 1;
}

/* trim_tables(tables, next_positions, table_type, free, block_states, cache_id, window, block_size,
               free_state) -> {row: [ids given back]} | NotImplemented

   PagedLatentCache.trim_batch under its lock, compiled (design note "trimmed front" there): a
   table whose window moved past entries it has not trimmed is checked (all such tables first),
   then those entries go back to the free list and num_trimmed moves up; a table left holding
   nothing has cache_id 0. Anything its Python twin would raise for, or that this loop does not
   read, is NotImplemented with nothing changed. */
static PyObject *trim_tables(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *tables, *positions, *free_list, *block_states, *free_obj, *released, *todo;
    PyTypeObject *table_type;
    Py_ssize_t n, i, t, j, length;
    long long cache_id, window, bs, free_state, owned, next_pos, stop, trimmed, e;
    (void)module;
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "trim_tables takes 10 arguments, got %zd", nargs);
        return NULL;
    }
    tables = args[0], positions = args[1], table_type = (PyTypeObject *)args[2], free_list = args[3];
    block_states = args[4], free_obj = args[8];
    if (!PyList_CheckExact(tables) || !PyList_CheckExact(positions) || !PyType_Check(args[2])
        || !PyList_CheckExact(free_list) || !PyList_CheckExact(block_states) || !exact_ll(args[5], &cache_id)
        || !exact_ll(args[6], &window) || !exact_ll(args[7], &bs) || !exact_ll(free_obj, &free_state)
        || !exact_ll(args[9], &owned) || bs <= 0 || PyList_GET_SIZE(positions) < PyList_GET_SIZE(tables))
        Py_RETURN_NOTIMPLEMENTED;
    if (!find_offsets(table_type, table_attrs, NUM_TABLE_ATTRS, 1))
        return NULL;
    for (i = 0; i < NUM_TABLE_ATTRS; i++)
        if (table_attrs[i].offset < 0)
            Py_RETURN_NOTIMPLEMENTED;
    n = PyList_GET_SIZE(tables);
    todo = PyList_New(0); /* (row, stop) of the tables to trim */
    if (todo == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        PyObject *table = PyList_GET_ITEM(tables, i), *value;
        if (Py_TYPE(table) != table_type || !exact_ll(PyList_GET_ITEM(positions, i), &next_pos) || next_pos < 0)
            goto deferred;
        value = *(PyObject **)((char *)table + table_attrs[NUM_TRIMMED].offset);
        if (value == NULL || !exact_ll(value, &trimmed) || trimmed < 0)
            goto deferred;
        value = *(PyObject **)((char *)table + table_attrs[CACHE_ID].offset);
        if (value == NULL || !exact_ll(value, &e)) /* read as a truth value when the table empties */
            goto deferred;
        if (next_pos - (window - 1) < 0)
            continue; /* the window reaches back to position 0: nothing behind it */
        stop = (next_pos - (window - 1)) / bs;
        if (stop > trimmed) {
            PyObject *item = Py_BuildValue("(nL)", i, stop);
            if (item == NULL || PyList_Append(todo, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(todo);
                return NULL;
            }
            Py_DECREF(item);
            if (!table_checks(table, cache_id, block_states, owned)) /* every table checked before any change */
                goto deferred;
        }
    }
    released = PyDict_New();
    if (released == NULL) {
        Py_DECREF(todo);
        return NULL;
    }
    for (t = 0; t < PyList_GET_SIZE(todo); t++) {
        PyObject *item = PyList_GET_ITEM(todo, t), *table, *blocks, *freed = NULL, *value;
        int still_held = 0;
        i = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
        exact_ll(PyTuple_GET_ITEM(item, 1), &stop);
        table = PyList_GET_ITEM(tables, i);
        blocks = *(PyObject **)((char *)table + table_attrs[BLOCKS].offset);
        exact_ll(*(PyObject **)((char *)table + table_attrs[NUM_TRIMMED].offset), &trimmed);
        length = PyList_GET_SIZE(blocks);
        for (j = trimmed > 0 ? (Py_ssize_t)trimmed : 0; j < length && j < stop; j++) {
            PyObject *block = PyList_GET_ITEM(blocks, j), *minus_one;
            exact_ll(block, &e);
            if (e < 0)
                continue;
            if (freed == NULL && (freed = PyList_New(0)) == NULL)
                goto failed;
            minus_one = PyLong_FromLong(-1);
            if (minus_one == NULL || PyList_Append(freed, block) < 0 || PyList_Append(free_list, block) < 0) {
                Py_XDECREF(minus_one);
                goto failed;
            }
            Py_INCREF(free_obj);
            PyList_SetItem(block_states, (Py_ssize_t)e, free_obj);
            PyList_SetItem(blocks, j, minus_one); /* drops the list's reference to block (freed holds one) */
        }
        for (j = stop < length ? (Py_ssize_t)stop : length; j < length && !still_held; j++)
            still_held = exact_ll(PyList_GET_ITEM(blocks, j), &e) && e >= 0;
        value = *(PyObject **)((char *)table + table_attrs[CACHE_ID].offset);
        if (!still_held && value != NULL && exact_ll(value, &e) && e != 0) {
            PyObject *zero = PyLong_FromLong(0);
            if (zero == NULL)
                goto failed;
            Py_XSETREF(*(PyObject **)((char *)table + table_attrs[CACHE_ID].offset), zero);
        }
        value = PyTuple_GET_ITEM(item, 1);
        Py_INCREF(value);
        Py_XSETREF(*(PyObject **)((char *)table + table_attrs[NUM_TRIMMED].offset), value);
        if (freed != NULL) {
            PyObject *key = PyTuple_GET_ITEM(item, 0);
            int failed = PyDict_SetItem(released, key, freed) < 0;
            Py_DECREF(freed);
            if (failed)
                goto failed_dict;
        }
        continue;
    failed:
        Py_XDECREF(freed);
    failed_dict: /* memory ran out mid-trim: the tables may be part done, as in the Python loop */
        Py_DECREF(released);
        Py_DECREF(todo);
        return NULL;
    }
    Py_DECREF(todo);
    return released;
deferred:
    Py_DECREF(todo);
    Py_RETURN_NOTIMPLEMENTED;
}

static PyMethodDef methods[] = {
    {"stage_rows", (PyCFunction)(void (*)(void))stage_rows, METH_FASTCALL,
     "The one pass's loop (runtime.decode_pass): a list of unheld rows, None, or NotImplemented."},
    {"ensure_tables", (PyCFunction)(void (*)(void))ensure_tables, METH_FASTCALL,
     "PagedLatentCache.ensure_unheld of the given rows: undo records, or NotImplemented."},
    {"trim_tables", (PyCFunction)(void (*)(void))trim_tables, METH_FASTCALL,
     "PagedLatentCache.trim_batch under its lock: {row: ids given back}, or NotImplemented."},
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
