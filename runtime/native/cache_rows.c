/* The cache's per-row loops of a propose, compiled (design note "compiled pass" in
   runtime/decode_pass.py): ensure_tables (PagedLatentCache.ensure_unheld of the rows the pass
   found unheld) and trim_tables (PagedLatentCache.trim_batch). Each checks everything before it
   changes anything, and leaves to its Python twin (NotImplemented, nothing changed) whatever
   that twin would raise for or whatever it does not read as exact ints and lists. */

#include "native_attrs.h"

#define NUM_ENSURE_ARGS 11
#define NUM_TRIM_ARGS 10

/* Whether table (of the slotted table type) passes _check_table: entries from num_trimmed on are
   exact ints, the held ones this cache's and owned. 1, or 0 (the Python trim raises, or decides). */
static int table_checks(PyObject *table, long long cache_id, PyObject *block_states, long long owned)
{
    PyObject *blocks = SLOT(table, table_attrs, BLOCKS);
    PyObject *value = SLOT(table, table_attrs, NUM_TRIMMED);
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
        value = SLOT(table, table_attrs, CACHE_ID);
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
    if (nargs != NUM_TRIM_ARGS) {
        PyErr_Format(PyExc_TypeError, "trim_tables takes %d arguments, got %zd", NUM_TRIM_ARGS, nargs);
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
    if (!table_has_slots()) /* a table type without these slots: the Python trim */
        Py_RETURN_NOTIMPLEMENTED;
    n = PyList_GET_SIZE(tables);
    todo = PyList_New(0); /* (row, stop) of the tables to trim */
    if (todo == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        PyObject *table = PyList_GET_ITEM(tables, i), *value;
        if (Py_TYPE(table) != table_type || !exact_ll(PyList_GET_ITEM(positions, i), &next_pos) || next_pos < 0)
            goto deferred;
        value = SLOT(table, table_attrs, NUM_TRIMMED);
        if (value == NULL || !exact_ll(value, &trimmed) || trimmed < 0)
            goto deferred;
        value = SLOT(table, table_attrs, CACHE_ID);
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
        blocks = SLOT(table, table_attrs, BLOCKS);
        exact_ll(SLOT(table, table_attrs, NUM_TRIMMED), &trimmed);
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
        value = SLOT(table, table_attrs, CACHE_ID);
        if (!still_held && value != NULL && exact_ll(value, &e) && e != 0) {
            PyObject *zero = PyLong_FromLong(0);
            if (zero == NULL)
                goto failed;
            Py_XSETREF(SLOT(table, table_attrs, CACHE_ID), zero);
        }
        value = PyTuple_GET_ITEM(item, 1);
        Py_INCREF(value);
        Py_XSETREF(SLOT(table, table_attrs, NUM_TRIMMED), value);
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
    Py_ssize_t n, r, j, num_free, num_states, total = 0;
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
    if (!table_has_slots()) /* a table type without these slots: the Python ensure */
        Py_RETURN_NOTIMPLEMENTED;
    n = PyList_GET_SIZE(rows), num_states = PyList_GET_SIZE(block_states);
    /* 1. Check every row's range and table and count the blocks; nothing changes here. */
    for (r = 0; r < n; r++) {
        Py_ssize_t length;
        if (!exact_ll(PyList_GET_ITEM(rows, r), &row) || row < 0 || row >= PyList_GET_SIZE(tables))
            Py_RETURN_NOTIMPLEMENTED;
        table = PyList_GET_ITEM(tables, row); /* borrowed: the list is the caller's, unchanged here */
        if (Py_TYPE(table) != table_type || !table_checks(table, cache_id, block_states, owned))
            Py_RETURN_NOTIMPLEMENTED; /* a table of another type, or one _check_table refuses */
        if (!exact_ll(PyList_GET_ITEM(positions, row), &first) || first < 0 || first + span >= max_seq_len)
            Py_RETURN_NOTIMPLEMENTED;
        last = first + span;
        blocks = SLOT(table, table_attrs, BLOCKS);
        length = PyList_GET_SIZE(blocks);
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
        blocks = SLOT(table, table_attrs, BLOCKS);
        exact_ll(PyList_GET_ITEM(positions, row), &first);
        last = first + span;
        exact_ll(SLOT(table, table_attrs, NUM_TRIMMED), &trimmed); /* checked in 1. */
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
            Py_XSETREF(SLOT(table, table_attrs, NUM_TRIMMED), value);
        }
        Py_INCREF(cache_id_obj), Py_INCREF(block_size_obj);
        Py_XSETREF(SLOT(table, table_attrs, CACHE_ID), cache_id_obj);
        Py_XSETREF(SLOT(table, table_attrs, BLOCK_SIZE), block_size_obj);
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

static PyMethodDef methods[] = {
    {"ensure_tables", (PyCFunction)(void (*)(void))ensure_tables, METH_FASTCALL,
     "PagedLatentCache.ensure_unheld of the given rows: undo records, or NotImplemented."},
    {"trim_tables", (PyCFunction)(void (*)(void))trim_tables, METH_FASTCALL,
     "PagedLatentCache.trim_batch under its lock: {row: ids given back}, or NotImplemented."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "cache_rows_native", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_cache_rows_native(void)
{
    if (!intern_attr_names())
        return NULL;
    return PyModule_Create(&module_def);
}
