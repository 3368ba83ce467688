/* What runtime/decode_pass.c and runtime/cache_rows.c share: exact ints, and the fields of
   MtpProposerState and BlockTable read at their __slots__ offsets (design note "compiled pass"
   in runtime/decode_pass.py). Header-only: each module has its own copy and its own offsets. */

#ifndef DRAFTGRAPH_NATIVE_ATTRS_H
#define DRAFTGRAPH_NATIVE_ATTRS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* PyMemberDef before 3.12 */
#include <stdint.h>
#include <string.h>

#define MEMBER_OBJECT_EX 16 /* T_OBJECT_EX / Py_T_OBJECT_EX: what a __slots__ entry is */
#define MEMBER_READONLY 1

/* An attribute the loop reads: by its slot's offset when the object's type keeps it in
   __slots__ (a load, where PyObject_GetAttr costs ~25 ns: ~12 reads a row), else by name. */
struct attr {
    const char *text;
    PyObject *name;
    Py_ssize_t offset; /* -1: by name */
};

enum { OWNER, IS_FREED, MAX_POSITIONS, TABLE, KV_START, SEQ_LEN, LAST_NUM_DRAFTED, NUM_STATE_ATTRS };
enum { PASS_MARK, BLOCKS, BLOCK_SIZE, CACHE_ID, NUM_TRIMMED, NUM_TABLE_ATTRS };
static struct attr state_attrs[NUM_STATE_ATTRS] = {
    {"owner", NULL, -1}, {"is_freed", NULL, -1}, {"max_positions", NULL, -1},
    {"table", NULL, -1}, {"kv_start", NULL, -1}, {"seq_len", NULL, -1}, {"last_num_drafted", NULL, -1},
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

/* An exact int that fits a long long: 1 and *out, or 0 (the caller defers or breaks). */
static inline int exact_ll(PyObject *o, long long *out)
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
static inline int find_offsets(PyTypeObject *type, struct attr *attrs, int n, int which)
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
static inline PyObject *get_attr(PyObject *obj, const struct attr *a)
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
static inline int set_attr(PyObject *obj, const struct attr *a, PyObject *value)
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
static inline int attr_ll(PyObject *obj, const struct attr *a, long long *out)
{
    PyObject *v = get_attr(obj, a);
    int ok;
    if (v == NULL)
        return 0;
    ok = exact_ll(v, out);
    Py_DECREF(v);
    return ok;
}

static inline int fits_i32(long long v) { return v >= INT32_MIN && v <= INT32_MAX; }


/* A slot's value by its offset (borrowed; NULL when unset). Only for an object of the type the
   offsets were found for, with every offset >= 0. */
#define SLOT(obj, attrs, k) (*(PyObject **)((char *)(obj) + (attrs)[k].offset))

/* Intern the attribute names: call from the module's init. 1, or 0 with an exception set. */
static inline int intern_attr_names(void)
{
    int k;
    for (k = 0; k < NUM_STATE_ATTRS; k++)
        if (!(state_attrs[k].name = PyUnicode_InternFromString(state_attrs[k].text)))
            return 0;
    for (k = 0; k < NUM_TABLE_ATTRS; k++) {
        if (!(table_attrs[k].name = PyUnicode_InternFromString(table_attrs[k].text)))
            return 0;
        table_attrs_by_name[k] = table_attrs[k];
    }
    return 1;
}

/* Whether every table attr has a slot offset (the table type is the slotted BlockTable). */
static inline int table_has_slots(void)
{
    int k;
    for (k = 0; k < NUM_TABLE_ATTRS; k++)
        if (table_attrs[k].offset < 0)
            return 0;
    return 1;
}

#endif
