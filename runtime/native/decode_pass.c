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

#include "native_attrs.h"

#define NUM_ARGS 20 /* and a 21st, optional: the rows to stage (all when None or left out) */

enum outcome { TAKEN, BROKEN, DEFERRED, FAILED };

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
    entries = PyTuple_GET_ITEM(record, 1); /* a list, as write_table clears it after */
    if (!exact_ll(PyTuple_GET_ITEM(record, 0), &record_lo) || !PyList_CheckExact(entries))
        return -1;
    if (record_lo != lo)
        return 0;
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
    long long old_lo = 0, e = 0;
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

/* The 20 arguments stage_rows and stage_batch share, read into *a and the three sequences:
   1, or 0 (NotImplemented: a value the loop does not read as the Python loop would). Borrowed:
   the caller holds args. mem is not read here: each caller takes its buffer. */
static int read_batch_args(PyObject *const *args, struct batch_args *a, PyObject ***states, Py_ssize_t *num_states,
                           PyObject ***tokens, Py_ssize_t *num_tokens, PyObject ***positions, Py_ssize_t *num_positions)
{
    a->serial_obj = args[6], a->state_type = args[7], a->written = args[10], a->block_states = args[11];
    a->table_type = args[19];
    return exact_ll(args[3], &a->num_drafts) && exact_ll(args[4], &a->owner) && exact_ll(args[5], &a->vocab)
        && exact_ll(args[6], &a->serial) && exact_ll(args[9], &a->row_bytes) && exact_ll(args[12], &a->block_size)
        && exact_ll(args[13], &a->cache_id) && exact_ll(args[14], &a->max_seq_len)
        && exact_ll(args[15], &a->window) && exact_ll(args[16], &a->max_blocks) && exact_ll(args[18], &a->owned)
        && exact_ll(args[17], &a->table_offset) && a->table_offset >= 0
        && a->block_size > 0 && a->row_bytes > 0 && PyType_Check(a->state_type) && PyType_Check(a->table_type)
        && PyList_CheckExact(a->written) && PyList_CheckExact(a->block_states)
        && sequence_items(args[0], states, num_states) && sequence_items(args[1], tokens, num_tokens)
        && sequence_items(args[2], positions, num_positions);
}

/* The rows (all n when rows is None), staged one by one; TAKEN, or what stopped the loop. */
static enum outcome stage_each(const struct batch_args *a, PyObject *rows, Py_ssize_t n, PyObject **states,
                               PyObject **tokens, PyObject **positions, PyObject *unheld)
{
    Py_ssize_t r, num_rows = rows == Py_None ? n : PyList_GET_SIZE(rows);
    enum outcome outcome = TAKEN;
    /* The items are borrowed from lists the caller holds, which nothing here calls out to change. */
    for (r = 0; r < num_rows && outcome == TAKEN; r++) {
        long long row = r;
        if (rows != Py_None && (!exact_ll(PyList_GET_ITEM(rows, r), &row) || row < 0 || row >= n))
            return DEFERRED;
        outcome = stage_row(a, (Py_ssize_t)row, states[row], tokens[row], positions[row], unheld);
    }
    return outcome;
}

/* The list, None or NotImplemented that an outcome answers (unheld's reference is taken). */
static PyObject *answer(enum outcome outcome, PyObject *unheld)
{
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

/* stage_rows(states, tokens, positions, num_drafts, owner, vocab, serial, state_type, mem,
              row_bytes, written, block_states, block_size, cache_id, max_seq_len, window,
              max_blocks, table_offset, owned, table_type[, rows]) -> list | None | NotImplemented */
static PyObject *stage_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    struct batch_args a;
    Py_buffer view;
    PyObject **states, **tokens, **positions, *unheld, *rows = Py_None;
    Py_ssize_t num_states, num_tokens, num_positions, n;
    enum outcome outcome;
    (void)module;
    if (nargs != NUM_ARGS && nargs != NUM_ARGS + 1) {
        PyErr_Format(PyExc_TypeError, "stage_rows takes %d or %d arguments, got %zd", NUM_ARGS, NUM_ARGS + 1, nargs);
        return NULL;
    }
    if (nargs > NUM_ARGS)
        rows = args[NUM_ARGS];
    if (rows != Py_None && !PyList_CheckExact(rows))
        Py_RETURN_NOTIMPLEMENTED;
    if (!read_batch_args(args, &a, &states, &num_states, &tokens, &num_tokens, &positions, &num_positions))
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
    outcome = stage_each(&a, rows, n, states, tokens, positions, unheld);
    PyBuffer_Release(&view);
    if (outcome == TAKEN && num_states != num_tokens)
        outcome = BROKEN;
    return answer(outcome, unheld);
}

/* Row i as padding, as MetadataWriter._write_dead: pos 0, slot -1, seq_len 0, kv_start 1, its
   staged table entries -1 and its record None. Only for a well-formed record (or None). */
static int write_dead(const struct batch_args *a, Py_ssize_t i)
{
    PyObject *record = PyList_GET_ITEM(a->written, i);
    unsigned char *row = a->mem + i * a->row_bytes;
    int64_t pos64 = 0, slot64 = -1;
    int32_t seq32 = 0, kv32 = 1;
    long long lo;
    Py_ssize_t num;
    if (record == Py_None)
        return 1; /* padding already */
    if (!PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) != 2 || !exact_ll(PyTuple_GET_ITEM(record, 0), &lo)
        || !PyList_CheckExact(PyTuple_GET_ITEM(record, 1)))
        return 0;
    num = PyList_GET_SIZE(PyTuple_GET_ITEM(record, 1));
    if (lo < 0 || a->table_offset + 4 * (lo + num) > a->row_bytes)
        return 0;
    memcpy(row, &pos64, 8), memcpy(row + 8, &slot64, 8), memcpy(row + 16, &seq32, 4), memcpy(row + 20, &kv32, 4);
    memset(row + a->table_offset + 4 * lo, 0xff, 4 * num);
    Py_INCREF(Py_None);
    PyList_SetItem(a->written, i, Py_None); /* steals; drops the old record */
    return 1;
}

/* ensure(tables, positions, span, unheld, ...) of the unheld rows (cache_rows_native.ensure_tables):
   its records, NotImplemented, or NULL. tables holds the unheld rows' tables, None elsewhere. */
static PyObject *ensure_unheld(const struct batch_args *a, PyObject *ensure, PyObject *free_list, PyObject **states, Py_ssize_t n, PyObject *positions, PyObject *unheld)
{
    PyObject *tables, *call_args[11], *records;
    Py_ssize_t r, k;
    if (!PyList_CheckExact(positions))
        Py_RETURN_NOTIMPLEMENTED;
    tables = PyList_New(n);
    if (tables == NULL)
        return NULL;
    for (k = 0; k < n; k++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(tables, k, Py_None);
    }
    for (r = 0; r < PyList_GET_SIZE(unheld); r++) {
        Py_ssize_t row = PyLong_AsSsize_t(PyList_GET_ITEM(unheld, r)); /* the pass's own ints, < n */
        PyObject *table = get_attr(states[row], &state_attrs[TABLE]);
        if (table == NULL) {
            Py_DECREF(tables);
            Py_RETURN_NOTIMPLEMENTED;
        }
        PyList_SetItem(tables, row, table); /* steals it */
    }
    call_args[0] = tables, call_args[1] = positions, call_args[3] = unheld, call_args[4] = a->table_type;
    call_args[5] = free_list, call_args[6] = a->block_states;
    call_args[2] = PyLong_FromLongLong(a->num_drafts - 1);
    call_args[7] = PyLong_FromLongLong(a->cache_id);
    call_args[8] = PyLong_FromLongLong(a->block_size);
    call_args[9] = PyLong_FromLongLong(a->owned);
    call_args[10] = PyLong_FromLongLong(a->max_seq_len);
    records = NULL;
    if (call_args[2] && call_args[7] && call_args[8] && call_args[9] && call_args[10])
        records = PyObject_Vectorcall(ensure, call_args, 11, NULL);
    Py_XDECREF(call_args[2]), Py_XDECREF(call_args[7]), Py_XDECREF(call_args[8]);
    Py_XDECREF(call_args[9]), Py_XDECREF(call_args[10]);
    Py_DECREF(tables);
    return records;
}

/* The context of stage_batch: what is the same at every propose of one staging buffer and cache. */
enum { CTX_STATE_TYPE, CTX_MEM, CTX_ROW_BYTES, CTX_WRITTEN, CTX_BLOCK_STATES, CTX_BLOCK_SIZE, CTX_CACHE_ID,
       CTX_MAX_SEQ_LEN, CTX_WINDOW, CTX_MAX_BLOCKS, CTX_TABLE_OFFSET, CTX_OWNED, CTX_TABLE_TYPE, CTX_ENSURE,
       CTX_FREE, CTX_SAVED, CTX_SAVED_WRITTEN, CTX_TOKEN_MEM, CTX_TOKEN_AT, NUM_CTX };

/* stage_batch(states, tokens, positions, num_drafts, owner, vocab, serial, restage_serial, context)
       -> (unheld, records, done) | None | NotImplemented

   context: (state_type, mem, row_bytes, written, block_states, block_size, cache_id, max_seq_len,
   window, max_blocks, table_offset, owned, table_type, ensure, free, saved, saved_written,
   token_mem, token_at), made once per staging buffer and cache (runtime/decode_pass.py).

   A propose's front in one call (design note "compiled front" in runtime/decode_pass.py):
   1. saves every row's scalars (24 bytes a row into saved) and records (into saved_written),
      so that MetadataWriter.restore puts the rows back whatever comes after;
   2. the pass (stage_rows): None or NotImplemented as it answers them, the rows restorable;
   3. when rows need blocks and ensure is not None: ensure(...) of those rows (the caller holds
      the cache's lock), then their rows staged again with restage_serial; records is what
      ensure answered (a list of (row, length before, new ids)), None where it was not called
      or answered NotImplemented (the caller ensures);
   4. done: every row is staged, the rows past the batch are padding and the tokens are in
      token_mem at token_at (int64, 0 past the batch). Not done: the caller does the rest of
      3 and 4, as it would without this call. */
static PyObject *stage_batch(PyObject *module, PyObject *const *call_args, Py_ssize_t nargs)
{
    struct batch_args a;
    Py_buffer view, saved_view, token_view;
    PyObject *args[NUM_ARGS], *const *ctx;
    PyObject **states, **tokens, **positions, *unheld, *restage_serial, *ensure, *free_list, *saved_written;
    PyObject *records = Py_None, *restaged = NULL, *result = NULL;
    Py_ssize_t num_states, num_tokens, num_positions, n, i, bucket;
    long long token_at, token;
    enum outcome outcome;
    int done = 0;
    (void)module;
    if (nargs != 9 || !PyTuple_CheckExact(call_args[8]) || PyTuple_GET_SIZE(call_args[8]) != NUM_CTX) {
        PyErr_Format(PyExc_TypeError, "stage_batch takes 9 arguments, the last a tuple of %d", NUM_CTX);
        return NULL;
    }
    ctx = ((PyTupleObject *)call_args[8])->ob_item;
    /* stage_rows' arguments, in its order */
    for (i = 0; i < 7; i++)
        args[i] = call_args[i];
    args[7] = ctx[CTX_STATE_TYPE], args[8] = ctx[CTX_MEM], args[9] = ctx[CTX_ROW_BYTES], args[10] = ctx[CTX_WRITTEN];
    args[11] = ctx[CTX_BLOCK_STATES], args[12] = ctx[CTX_BLOCK_SIZE], args[13] = ctx[CTX_CACHE_ID];
    args[14] = ctx[CTX_MAX_SEQ_LEN], args[15] = ctx[CTX_WINDOW], args[16] = ctx[CTX_MAX_BLOCKS];
    args[17] = ctx[CTX_TABLE_OFFSET], args[18] = ctx[CTX_OWNED], args[19] = ctx[CTX_TABLE_TYPE];
    restage_serial = call_args[7], ensure = ctx[CTX_ENSURE], free_list = ctx[CTX_FREE];
    saved_written = ctx[CTX_SAVED_WRITTEN];
    /* What the save needs is the writer's own: a wrong one is a caller's bug, not a batch to defer. */
    if (!PyList_CheckExact(args[10]) || !PyList_CheckExact(saved_written) || !exact_ll(args[9], &a.row_bytes)
        || a.row_bytes < 24 || !exact_ll(ctx[CTX_TOKEN_AT], &token_at) || token_at < 0) {
        PyErr_SetString(PyExc_TypeError, "stage_batch: written and saved_written must be lists, row_bytes >= 24");
        return NULL;
    }
    if (PyObject_GetBuffer(args[8], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(ctx[CTX_SAVED], &saved_view, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (PyObject_GetBuffer(ctx[CTX_TOKEN_MEM], &token_view, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&view), PyBuffer_Release(&saved_view);
        return NULL;
    }
    bucket = PyList_GET_SIZE(args[10]);
    if (bucket * a.row_bytes > view.len || saved_view.len < 24 * bucket || token_at + 8 * bucket > token_view.len) {
        PyErr_SetString(PyExc_ValueError, "stage_batch: a buffer is smaller than the writer's rows");
        goto release;
    }
    /* 1. The save. */
    for (i = 0; i < bucket; i++)
        memcpy((unsigned char *)saved_view.buf + 24 * i, (unsigned char *)view.buf + i * a.row_bytes, 24);
    if (PyList_SetSlice(saved_written, 0, PY_SSIZE_T_MAX, args[10]) < 0)
        goto release;
    /* 2. The pass. */
    if (!read_batch_args(args, &a, &states, &num_states, &tokens, &num_tokens, &positions, &num_positions)
        || !(ensure == Py_None || PyCallable_Check(ensure)) || !PyList_CheckExact(free_list)) {
        result = Py_NewRef(Py_NotImplemented);
        goto release;
    }
    if (!find_offsets((PyTypeObject *)a.state_type, state_attrs, NUM_STATE_ATTRS, 0)
        || !find_offsets((PyTypeObject *)a.table_type, table_attrs, NUM_TABLE_ATTRS, 1))
        goto release;
    a.mem = view.buf, a.mem_len = view.len;
    unheld = PyList_New(0);
    if (unheld == NULL)
        goto release;
    n = num_states < num_tokens ? num_states : num_tokens;
    n = n < num_positions ? n : num_positions;
    outcome = stage_each(&a, Py_None, n, states, tokens, positions, unheld);
    if (outcome == TAKEN && num_states != num_tokens)
        outcome = BROKEN;
    if (outcome != TAKEN) {
        result = answer(outcome, unheld);
        goto release;
    }
    /* 3. The ensure and the restage of the rows that needed blocks. */
    if (PyList_GET_SIZE(unheld) > 0) {
        if (ensure == Py_None)
            goto partial;
        records = ensure_unheld(&a, ensure, free_list, states, n, args[2], unheld);
        if (records == NULL) {
            Py_DECREF(unheld);
            goto release;
        }
        if (records == Py_NotImplemented) {
            Py_DECREF(records);
            records = Py_None;
            goto partial;
        }
        restaged = PyList_New(0);
        if (restaged == NULL)
            goto failed;
        a.serial_obj = restage_serial;
        if (!exact_ll(restage_serial, &a.serial))
            goto partial;
        outcome = stage_each(&a, unheld, n, states, tokens, positions, restaged);
        if (outcome == FAILED)
            goto failed;
        if (outcome != TAKEN || PyList_GET_SIZE(restaged) != 0)
            goto partial; /* the caller stages them its general way, which decides */
    }
    /* 4. Padding past the batch, and the tokens (checked exact ints in 0..vocab by the pass). */
    for (i = n; i < bucket; i++)
        if (!write_dead(&a, i))
            goto partial;
    for (i = 0; i < bucket; i++) {
        int64_t t = 0;
        if (i < n) {
            exact_ll(tokens[i], &token);
            t = token;
        }
        memcpy((unsigned char *)token_view.buf + token_at + 8 * i, &t, 8);
    }
    done = 1;
partial:
    result = Py_BuildValue("(NOO)", unheld, records, done ? Py_True : Py_False);
    if (records != Py_None)
        Py_DECREF(records);
    Py_XDECREF(restaged);
    goto release;
failed: /* memory ran out after the ensure: its records go back all the same, so that the caller,
           staging these rows its general way (which raises the same error), can undo the ensure */
    PyErr_Clear();
    goto partial;
release:
    PyBuffer_Release(&view), PyBuffer_Release(&saved_view), PyBuffer_Release(&token_view);
    return result;
}

/* commit_rows(states, positions, drafted, num_drafts, state_type) -> (short_rows, tables) | NotImplemented

   What a propose writes back into its states once the drafts are read (runtime/proposer.py,
   design note "compiled front" in runtime/decode_pass.py), as its Python loop does, row by row:
   kv_start kept when p continues the rows (kv_start <= p <= seq_len) else p, seq_len = p + the
   row's drafts, last_num_drafted = them. Answers the rows that drafted fewer than num_drafts
   (the caller gives their spare blocks back) and the states' tables (for the trim). Every row
   is read first: anything that is not a state of state_type with slotted exact-int fields and a
   list of drafts is NotImplemented, with no state changed. */
static PyObject *commit_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject **states, **positions, **drafted, *state_type, *short_rows = NULL, *tables = NULL, *values[3];
    Py_ssize_t n, num_positions, num_drafted, i, k;
    long long num_drafts, p, kv_start, seq_len;
    (void)module;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "commit_rows takes 5 arguments, got %zd", nargs);
        return NULL;
    }
    state_type = args[4];
    if (!sequence_items(args[0], &states, &n) || !sequence_items(args[1], &positions, &num_positions)
        || !sequence_items(args[2], &drafted, &num_drafted) || num_positions != n || num_drafted != n
        || !exact_ll(args[3], &num_drafts) || !PyType_Check(state_type))
        Py_RETURN_NOTIMPLEMENTED;
    if (!find_offsets((PyTypeObject *)state_type, state_attrs, NUM_STATE_ATTRS, 0))
        return NULL;
    for (k = 0; k < NUM_STATE_ATTRS; k++)
        if (state_attrs[k].offset < 0)
            Py_RETURN_NOTIMPLEMENTED;
    for (i = 0; i < n; i++) { /* 1. read every row; nothing changes */
        PyObject *state = states[i], *table;
        if (Py_TYPE(state) != (PyTypeObject *)state_type || !PyList_CheckExact(drafted[i])
            || !exact_ll(positions[i], &p) || SLOT(state, state_attrs, KV_START) == NULL
            || SLOT(state, state_attrs, SEQ_LEN) == NULL || !exact_ll(SLOT(state, state_attrs, KV_START), &kv_start)
            || !exact_ll(SLOT(state, state_attrs, SEQ_LEN), &seq_len))
            Py_RETURN_NOTIMPLEMENTED;
        table = SLOT(state, state_attrs, TABLE);
        if (table == NULL || p + PyList_GET_SIZE(drafted[i]) < p)
            Py_RETURN_NOTIMPLEMENTED;
    }
    short_rows = PyList_New(0);
    tables = PyList_New(n);
    if (short_rows == NULL || tables == NULL)
        goto failed;
    for (i = 0; i < n; i++) { /* 2. write; only memory can fail here */
        PyObject *state = states[i], *table = SLOT(state, state_attrs, TABLE);
        Py_ssize_t count = PyList_GET_SIZE(drafted[i]);
        exact_ll(positions[i], &p);
        exact_ll(SLOT(state, state_attrs, KV_START), &kv_start);
        exact_ll(SLOT(state, state_attrs, SEQ_LEN), &seq_len);
        Py_INCREF(table);
        PyList_SET_ITEM(tables, i, table);
        values[0] = kv_start <= p && p <= seq_len ? NULL : PyLong_FromLongLong(p);
        values[1] = PyLong_FromLongLong(p + count);
        values[2] = PyLong_FromSsize_t(count);
        if ((values[0] == NULL && !(kv_start <= p && p <= seq_len)) || values[1] == NULL || values[2] == NULL) {
            Py_XDECREF(values[0]), Py_XDECREF(values[1]), Py_XDECREF(values[2]);
            goto failed; /* rows before i are committed, as the Python loop leaves them on an error */
        }
        if (values[0] != NULL)
            Py_XSETREF(SLOT(state, state_attrs, KV_START), values[0]);
        Py_XSETREF(SLOT(state, state_attrs, SEQ_LEN), values[1]);
        Py_XSETREF(SLOT(state, state_attrs, LAST_NUM_DRAFTED), values[2]);
        if (count < num_drafts) {
            PyObject *row = PyLong_FromSsize_t(i);
            if (row == NULL || PyList_Append(short_rows, row) < 0) {
                Py_XDECREF(row);
                goto failed;
            }
            Py_DECREF(row);
        }
    }
    return Py_BuildValue("(NN)", short_rows, tables);
failed:
    Py_XDECREF(short_rows);
    Py_XDECREF(tables);
    return NULL;
}

static PyMethodDef methods[] = {
    {"stage_rows", (PyCFunction)(void (*)(void))stage_rows, METH_FASTCALL,
     "The one pass's loop (runtime.decode_pass): a list of unheld rows, None, or NotImplemented."},
    {"stage_batch", (PyCFunction)(void (*)(void))stage_batch, METH_FASTCALL,
     "A propose's front (runtime.decode_pass): save, pass, ensure, restage, padding and tokens."},
    {"commit_rows", (PyCFunction)(void (*)(void))commit_rows, METH_FASTCALL,
     "What a propose writes back into its states: the rows that drafted fewer, and the tables."},
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
    if (!intern_attr_names())
        return NULL;
    return PyModule_Create(&module_def);
}
