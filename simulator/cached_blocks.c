/* The blocks of one KV cache that have an identity, in C: simulator/cached_blocks.py's
 * CachedBlocks, method for method (that file is the definition; tests run both side by side).
 *
 * At 512 simulated GPUs a replay keeps about 600k cached blocks. As Python objects each is about
 * 130 bytes scattered over the heap (a dict entry, the key's int, its state), far more than the
 * CPU's last-level cache, and every pin, release and eviction misses on them. Here a block is a
 * 24-byte slab slot (its key as two words, its holders, its entries in the free queue), found
 * through an open-addressing index of 8-byte slots a quarter to half full (16 to 32 bytes a
 * block), and queued as a 4-byte slot number: 44 to 60 bytes used, in three flat arrays.
 *
 * Keys are ints in the signed 128-bit range, stored in two's complement. The methods append the
 * very int objects they were given to `held`; those that hand keys back (evict, keys,
 * free_queue) make new ints of equal value.
 *
 * Where the Python class would leave its state half-changed by an exception (a key not cached,
 * a failed allocation), this one undoes what it did and leaves it as it was; `add` keeps the
 * blocks it named before the failing one, as the Python class does, which is a consistent
 * state. The type holds no Python objects, so the collector need not know it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "structmember.h"

#include <limits.h>
#include <stdint.h>
#include <string.h>

#define STALE_SLACK 64 /* as in cached_blocks.py */
#define TRIM_AFTER 64
#define NONE UINT32_MAX  /* no slot: an empty index slot, a failed lookup, the freed list's end */
#define FREED UINT32_MAX /* `entries` of a slab slot holding no block */
#define MAX_ENTRIES (UINT32_MAX - 1)
/* A tag is 32 bits and picks the home slot, so the index has at most 2**32 slots, half used. */
#define MAX_BLOCKS ((uint32_t)1 << 31)
#define MIN_INDEX 16
#define MIN_ARRAY 64

typedef struct {
    uint64_t lo, hi;  /* the key, low word first */
    uint32_t holders; /* sequences holding it; in a freed slot, the next freed slot */
    uint32_t entries; /* its entries in the free queue; FREED in a freed slot */
} Block;

typedef struct {
    uint32_t id;  /* the block's slab slot, or NONE */
    uint32_t tag; /* the high half of the key's hash: its home slot, and a check before the slab */
} Slot;

typedef struct {
    PyObject_HEAD
    Block *slab;
    uint32_t slab_used; /* slots below it hold a block or are freed */
    uint32_t slab_cap;
    uint32_t freed; /* the last slot freed, reused first */
    uint32_t count; /* blocks */
    Slot *index;    /* NULL until the first block */
    size_t mask;    /* index slots - 1 */
    uint32_t *queue; /* slab slots, oldest first from head; before head, slots already taken */
    size_t head, tail, queue_cap;
    Py_ssize_t num_free;
    Py_ssize_t stale_slack;
} Store;

static PyTypeObject StoreType;

/* ------------------------------------------------------------------------------ keys */

/* splitmix64's finalizer: block hashes are already random, but small test keys are not. */
static inline uint32_t tag_of(uint64_t lo, uint64_t hi)
{
    uint64_t z = lo ^ (hi * 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (uint32_t)((z ^ (z >> 31)) >> 32);
}

/* A key's words: 1; else 0, with TypeError or OverflowError set. Never calls __index__, so no
 * Python code runs in the middle of a method. */
static int key_words(PyObject *o, uint64_t *lo, uint64_t *hi)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "block hash must be an int, not %.200s",
                     Py_TYPE(o)->tp_name);
        return 0;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) { /* it cannot fail on an int */
        *lo = (uint64_t)v;
        *hi = v < 0 ? UINT64_MAX : 0;
        return 1;
    }
#if ULONG_MAX == UINT64_MAX
    /* Fairway's hashes are unsigned 64-bit: half of them take this path, a plain digit loop. */
    if (overflow > 0) {
        unsigned long u = PyLong_AsUnsignedLong(o);
        if (!(u == (unsigned long)-1 && PyErr_Occurred())) {
            *lo = u;
            *hi = 0;
            return 1;
        }
        PyErr_Clear();
    }
#endif
    unsigned char buf[16];
    if (_PyLong_AsByteArray((PyLongObject *)o, buf, 16, 1, 1) < 0) {
        PyErr_SetString(PyExc_OverflowError,
                        "block hash out of the 128-bit range [-2**127, 2**127)");
        return 0;
    }
    uint64_t l = 0, h = 0;
    for (int i = 7; i >= 0; i--) {
        l = l << 8 | buf[i];
        h = h << 8 | buf[8 + i];
    }
    *lo = l;
    *hi = h;
    return 1;
}

static PyObject *key_object(const Block *b)
{
    if (b->hi == (uint64_t)0 - (b->lo >> 63))
        return PyLong_FromLongLong((long long)b->lo);
    if (b->hi == 0)
        return PyLong_FromUnsignedLongLong(b->lo);
    unsigned char buf[16];
    for (int i = 0; i < 8; i++) {
        buf[i] = (unsigned char)(b->lo >> 8 * i);
        buf[8 + i] = (unsigned char)(b->hi >> 8 * i);
    }
    return _PyLong_FromByteArray(buf, 16, 1, 1);
}

static void key_error(PyObject *key)
{
    /* Wrapped, so that a tuple key is not taken for the exception's arguments. */
    PyObject *args = PyTuple_Pack(1, key);
    if (args != NULL) {
        PyErr_SetObject(PyExc_KeyError, args);
        Py_DECREF(args);
    }
}

/* ----------------------------------------------------------------------------- index */

static uint32_t find(const Store *s, uint64_t lo, uint64_t hi, uint32_t tag)
{
    if (s->index == NULL)
        return NONE;
    for (size_t i = tag & s->mask;; i = (i + 1) & s->mask) {
        Slot slot = s->index[i];
        if (slot.id == NONE)
            return NONE;
        if (slot.tag == tag) {
            const Block *b = &s->slab[slot.id];
            if (b->lo == lo && b->hi == hi)
                return slot.id;
        }
    }
}

/* A key's words and tag, read once for a lookup. */
typedef struct {
    uint64_t lo, hi;
    uint32_t tag;
    int ok; /* 0: no int in range (key_words' error, cleared) */
} Key;

static void read_key(PyObject *o, Key *k)
{
    k->ok = key_words(o, &k->lo, &k->hi);
    if (k->ok)
        k->tag = tag_of(k->lo, k->hi);
    else
        PyErr_Clear();
}

/* A key's block, or NONE: a key that is no int in range is in no store, as a dict would say. */
static uint32_t find_read(const Store *s, const Key *k)
{
    return k->ok ? find(s, k->lo, k->hi, k->tag) : NONE;
}

static uint32_t find_key(const Store *s, PyObject *key)
{
    Key k;
    read_key(key, &k);
    return find_read(s, &k);
}

/* Releases and adds take keys in runs of this many: each run's index and slab slots are
 * loaded together, and stay in the first-level cache until the run is done. */
#define WARM 16

#if defined(__GNUC__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

/* keys[from..from + n) as Keys (n <= WARM), with what finding them reads loading meanwhile.
 * At 512 simulated GPUs the engines' stores are many times the CPU's last-level cache, and
 * each lookup missed in turn: on the key's int, then its index slot, then its block. Three
 * passes, each waiting only for the loads the one before started, so the misses overlap. */
static void warm(const Store *s, PyObject *keys, Py_ssize_t from, Py_ssize_t n, Key *out)
{
    Py_ssize_t i;
    for (i = 0; i < n; i++)
        PREFETCH(PyList_GET_ITEM(keys, from + i));
    for (i = 0; i < n; i++) {
        read_key(PyList_GET_ITEM(keys, from + i), &out[i]);
        if (out[i].ok && s->index != NULL)
            PREFETCH(&s->index[out[i].tag & s->mask]);
    }
    if (s->index == NULL)
        return;
    for (i = 0; i < n; i++) {
        if (!out[i].ok)
            continue;
        Slot slot = s->index[out[i].tag & s->mask];
        if (slot.id != NONE)
            PREFETCH(&s->slab[slot.id]);
    }
}

static void place(Slot *index, size_t mask, Slot slot)
{
    size_t i = slot.tag & mask;
    while (index[i].id != NONE)
        i = (i + 1) & mask;
    index[i] = slot;
}

static int grow_index(Store *s)
{
    size_t size = s->index == NULL ? MIN_INDEX : 2 * (s->mask + 1);
    if (size > (size_t)1 << 32 || size > PY_SSIZE_T_MAX / sizeof(Slot)) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *index = PyMem_Malloc(size * sizeof(Slot));
    if (index == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(index, 0xFF, size * sizeof(Slot)); /* every id NONE */
    if (s->index != NULL) {
        /* Rehashed from the tags alone: growing never reads the slab. */
        for (size_t i = 0; i <= s->mask; i++)
            if (s->index[i].id != NONE)
                place(index, size - 1, s->index[i]);
        PyMem_Free(s->index);
    }
    s->index = index;
    s->mask = size - 1;
    return 0;
}

static int grow_slab(Store *s)
{
    if (s->slab_cap >= MAX_BLOCKS) {
        PyErr_SetString(PyExc_OverflowError, "too many cached blocks");
        return -1;
    }
    uint32_t cap = s->slab_cap == 0 ? MIN_ARRAY : 2 * s->slab_cap;
    if (cap > MAX_BLOCKS)
        cap = MAX_BLOCKS;
    Block *slab = PyMem_Realloc(s->slab, (size_t)cap * sizeof(Block));
    if (slab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->slab = slab;
    s->slab_cap = cap;
    return 0;
}

/* A new block, held once, for a key known to be absent: its slot, or NONE with an error set
 * and the store unchanged. */
static uint32_t new_block(Store *s, uint64_t lo, uint64_t hi, uint32_t tag)
{
    if (s->count >= MAX_BLOCKS) {
        PyErr_SetString(PyExc_OverflowError, "too many cached blocks");
        return NONE;
    }
    if (s->index == NULL || (size_t)s->count + 1 > (s->mask + 1) / 2)
        if (grow_index(s) < 0)
            return NONE;
    uint32_t id = s->freed;
    if (id != NONE) {
        s->freed = s->slab[id].holders;
    }
    else {
        if (s->slab_used == s->slab_cap && grow_slab(s) < 0)
            return NONE;
        id = s->slab_used++;
    }
    Block *b = &s->slab[id];
    b->lo = lo;
    b->hi = hi;
    b->holders = 1;
    b->entries = 0;
    place(s->index, s->mask, (Slot){id, tag});
    s->count++;
    return id;
}

/* Forget a block. Only ever once its last queue entry has left the queue, so no entry names
 * a slot that is reused. */
static void remove_block(Store *s, uint32_t id)
{
    Block *b = &s->slab[id];
    size_t mask = s->mask, i = tag_of(b->lo, b->hi) & mask;
    while (s->index[i].id != id)
        i = (i + 1) & mask;
    /* Backward-shift deletion: pull later slots of the run back over the hole, unless that
     * would put one before its home. Homes come from the tags, so the slab is not read. */
    for (size_t j = (i + 1) & mask; s->index[j].id != NONE; j = (j + 1) & mask) {
        size_t home = s->index[j].tag & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            s->index[i] = s->index[j];
            i = j;
        }
    }
    s->index[i].id = NONE;
    b->holders = s->freed;
    b->entries = FREED;
    s->freed = id;
    s->count--;
}

/* -------------------------------------------------------------------------- free queue */

/* Room for `extra` more entries: 0, or -1 with MemoryError and nothing changed. */
static int reserve_queue(Store *s, size_t extra)
{
    if (s->queue_cap - s->tail >= extra)
        return 0;
    size_t cap = s->queue_cap < MIN_ARRAY ? MIN_ARRAY : s->queue_cap;
    while (cap - s->tail < extra) {
        if (cap > PY_SSIZE_T_MAX / 2 / sizeof(uint32_t)) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    uint32_t *queue = PyMem_Realloc(s->queue, cap * sizeof(uint32_t));
    if (queue == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->queue = queue;
    s->queue_cap = cap;
    return 0;
}

/* The queue without its stale entries, in place: each free block keeps its last entry. */
static void compact(Store *s)
{
    size_t w = 0;
    for (size_t p = s->head; p < s->tail; p++) {
        uint32_t id = s->queue[p];
        Block *b = &s->slab[id];
        if (b->holders == 0 && b->entries == 1)
            s->queue[w++] = id;
        else
            b->entries--;
    }
    s->head = 0;
    s->tail = w;
    if (s->queue_cap > 4 * (size_t)MIN_ARRAY && w < s->queue_cap / 4) {
        /* A queue that once held many stale entries gives the room back; failing is harmless. */
        size_t cap = 2 * w > MIN_ARRAY ? 2 * w : MIN_ARRAY;
        uint32_t *queue = PyMem_Realloc(s->queue, cap * sizeof(uint32_t));
        if (queue != NULL) {
            s->queue = queue;
            s->queue_cap = cap;
        }
    }
}

/* Puts back the entry counts an eviction walk took from [head, at), last first: a block marked
 * as evicted (free, no entries) gets back the one its place had. */
static void unwalk(Store *s, size_t at)
{
    while (at-- > s->head) {
        Block *b = &s->slab[s->queue[at]];
        if (b->holders == 0 && b->entries == 0)
            b->entries = 1;
        else
            b->entries++;
    }
}

/* ----------------------------------------------------------------------- arguments */

static int nargs_ok(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi)
{
    if (nargs >= lo && nargs <= hi)
        return 1;
    if (lo == hi)
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, lo,
                     nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd arguments (%zd given)", name,
                     lo, hi, nargs);
    return 0;
}

static int list_ok(PyObject *o, const char *what)
{
    if (PyList_Check(o))
        return 1;
    PyErr_Format(PyExc_TypeError, "%s must be a list, not %.200s", what, Py_TYPE(o)->tp_name);
    return 0;
}

/* An index, as range() takes one; out of Py_ssize_t's range it is clamped, which changes no
 * answer (the list is shorter either way). */
static int size_arg(PyObject *o, Py_ssize_t *out)
{
    Py_ssize_t v = PyNumber_AsSsize_t(o, NULL);
    if (v == -1 && PyErr_Occurred())
        return 0;
    *out = v;
    return 1;
}

static PyObject *index_error(void)
{
    PyErr_SetString(PyExc_IndexError, "list index out of range");
    return NULL;
}

/* Shortens a list back to `size` after a failure, keeping the error set. Eight at a time:
 * CPython removes that many from a list without allocating. */
static void shorten(PyObject *list, Py_ssize_t size)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    while (PyList_GET_SIZE(list) > size) {
        Py_ssize_t end = PyList_GET_SIZE(list);
        Py_ssize_t start = end - 8 > size ? end - 8 : size;
        if (PyList_SetSlice(list, start, end, NULL) < 0) {
            PyErr_Clear();
            break;
        }
    }
    PyErr_Restore(type, value, traceback);
}

/* ------------------------------------------------------------------------ methods */

static PyObject *Store_prefix(Store *s, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t limit;
    if (!nargs_ok("prefix", nargs, 2, 2) || !list_ok(args[0], "keys") ||
        !size_arg(args[1], &limit))
        return NULL;
    PyObject *keys = args[0];
    Py_ssize_t n = 0, stop = Py_MIN(limit, PyList_GET_SIZE(keys));
    while (n < stop && find_key(s, PyList_GET_ITEM(keys, n)) != NONE)
        n++;
    return PyLong_FromSsize_t(n);
}

static PyObject *Store_num_free_of(Store *s, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n, num = 0;
    if (!nargs_ok("num_free_of", nargs, 2, 2) || !list_ok(args[0], "keys") ||
        !size_arg(args[1], &n))
        return NULL;
    PyObject *keys = args[0];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(keys))
            return index_error();
        PyObject *key = PyList_GET_ITEM(keys, i);
        uint32_t id = find_key(s, key);
        if (id == NONE) {
            key_error(key);
            return NULL;
        }
        num += s->slab[id].holders == 0;
    }
    return PyLong_FromSsize_t(num);
}

static PyObject *Store_pin(Store *s, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    if (!nargs_ok("pin", nargs, 3, 3) || !list_ok(args[0], "keys") || !size_arg(args[1], &n) ||
        !list_ok(args[2], "held"))
        return NULL;
    PyObject *keys = args[0], *held = args[2];
    if (n > PyList_GET_SIZE(keys))
        return index_error();
    Py_ssize_t before = PyList_GET_SIZE(held), taken = 0, i;
    PyObject *type, *value, *traceback;
    for (i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i); /* read each time: `held` may be `keys` */
        uint32_t id = find_key(s, key);
        if (id == NONE) {
            key_error(key);
            goto undo;
        }
        Block *b = &s->slab[id];
        if (b->holders == UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "too many holders of a cached block");
            goto undo;
        }
        /* A free one leaves the LRU: its entries stay, stale, counted in `entries`. */
        taken += b->holders == 0;
        b->holders++;
        if (PyList_Append(held, key) < 0) {
            b->holders--;
            goto undo;
        }
    }
    if (taken) {
        s->num_free -= taken;
        if ((Py_ssize_t)(s->tail - s->head) - 2 * s->num_free > s->stale_slack)
            compact(s);
    }
    return PyLong_FromSsize_t(taken);
undo:
    /* A pin only raised holders (from 0 for a free block), so lowering them undoes it. The
     * error is put aside meanwhile: finding a key may raise and clear one of its own. */
    PyErr_Fetch(&type, &value, &traceback);
    while (i-- > 0)
        s->slab[find_key(s, PyList_GET_ITEM(keys, i))].holders--;
    PyErr_Restore(type, value, traceback);
    shorten(held, before);
    return NULL;
}

static PyObject *Store_add(Store *s, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t start, stop;
    if (!nargs_ok("add", nargs, 4, 4) || !list_ok(args[0], "keys") ||
        !size_arg(args[1], &start) || !size_arg(args[2], &stop) || !list_ok(args[3], "held"))
        return NULL;
    PyObject *keys = args[0], *held = args[3];
    Key run[WARM];
    Py_ssize_t from = 0, warmed = 0; /* run holds keys[from..from + warmed) */
    for (Py_ssize_t i = start; i < stop; i++) {
        Py_ssize_t size = PyList_GET_SIZE(keys), j = i < 0 ? i + size : i; /* as keys[i] */
        if (j < 0 || j >= size)
            return index_error();
        if (j < from || j >= from + warmed) { /* `keys` may grow (it may be `held`), never change */
            from = j;
            warmed = Py_MIN(Py_MIN(stop - i, size - j), WARM);
            warm(s, keys, from, warmed, run);
        }
        PyObject *key = PyList_GET_ITEM(keys, j);
        const Key *k = &run[j - from];
        uint64_t lo = k->lo, hi = k->hi;
        if (!k->ok) {
            key_words(key, &lo, &hi); /* its error again, now to raise */
            return NULL;
        }
        uint32_t tag = k->tag;
        if (find(s, lo, hi, tag) != NONE)
            return PyLong_FromSsize_t(i - start);
        uint32_t id = new_block(s, lo, hi, tag);
        if (id == NONE)
            return NULL;
        if (PyList_Append(held, key) < 0) {
            remove_block(s, id); /* in no queue: forgetting it leaves no trace */
            return NULL;
        }
    }
    return PyLong_FromSsize_t(stop > start ? stop - start : 0);
}

static PyObject *Store_release(Store *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok("release", nargs, 1, 1) || !list_ok(args[0], "held"))
        return NULL;
    PyObject *held = args[0], *unheld = NULL, *type, *value, *traceback;
    Py_ssize_t size = PyList_GET_SIZE(held), freed = 0, i;
    if (reserve_queue(s, (size_t)size) < 0) /* so that nothing below can fail to allocate */
        return NULL;
    Key run[WARM];
    Py_ssize_t from = size; /* run holds held[from..i] */
    for (i = size - 1; i >= 0; i--) { /* last first */
        if (i < from) {
            from = Py_MAX(i + 1 - WARM, 0);
            warm(s, held, from, i + 1 - from, run);
        }
        PyObject *key = PyList_GET_ITEM(held, i);
        uint32_t id = find_read(s, &run[i - from]);
        if (id == NONE) {
            key_error(key);
            goto undo;
        }
        Block *b = &s->slab[id];
        if (b->holders == 0) {
            unheld = key; /* the Python class would count an entry the queue never gets */
            goto undo;
        }
        if (b->holders == 1) {
            if (b->entries == MAX_ENTRIES) {
                PyErr_SetString(PyExc_OverflowError, "too many free queue entries of a block");
                goto undo;
            }
            b->entries++;
            s->queue[s->tail++] = id;
            freed++;
        }
        b->holders--;
    }
    s->num_free += freed;
    /* A whole list's slice deleted is a clear, which cannot fail. */
    if (PyList_SetSlice(held, 0, PY_SSIZE_T_MAX, NULL) < 0)
        return NULL;
    return PyLong_FromSsize_t(freed);
undo:
    /* In the reverse order: a block left with no holder was freed by that very step, and its
     * entry is then the queue's newest. */
    PyErr_Fetch(&type, &value, &traceback);
    for (i++; i < size; i++) {
        Block *b = &s->slab[find_key(s, PyList_GET_ITEM(held, i))];
        if (b->holders == 0) {
            b->entries--;
            s->tail--;
        }
        b->holders++;
    }
    PyErr_Restore(type, value, traceback);
    if (unheld != NULL) /* its repr may run Python code, so only once the store is whole */
        PyErr_Format(PyExc_ValueError, "releasing cached block %R, which nobody holds", unheld);
    return NULL;
}

static PyObject *Store_evict(Store *s, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    if (!nargs_ok("evict", nargs, 1, 2) || !size_arg(args[0], &n))
        return NULL;
    PyObject *evicted = nargs > 1 ? args[1] : Py_None;
    if (evicted != Py_None && !list_ok(evicted, "evicted"))
        return NULL;
    if (n > s->num_free || n < 0) {
        /* A negative n, which the Python class takes and then miscounts, is refused too. */
        PyErr_Format(PyExc_ValueError, "evicting %S of %zd free cached blocks", args[0],
                     s->num_free);
        return NULL;
    }
    size_t at = s->head;
    if (evicted == Py_None) {
        /* Nothing here can fail, so blocks go as their places surface. */
        for (Py_ssize_t k = 0; k < n; k++)
            for (;;) {
                uint32_t id = s->queue[at++];
                Block *b = &s->slab[id];
                if (b->holders == 0 && b->entries == 1) {
                    remove_block(s, id);
                    break;
                }
                b->entries--; /* a stale entry */
            }
    }
    else if (n > 0) {
        /* Making the keys' ints can fail: the walk first only counts entries down and marks
         * each block evicted (free, no entries), so that it can be undone; blocks are
         * forgotten once the keys are in `evicted`. */
        PyObject *out = PyList_New(n);
        if (out == NULL)
            return NULL;
        for (Py_ssize_t k = 0; k < n; k++)
            for (;;) {
                Block *b = &s->slab[s->queue[at++]];
                if (b->holders == 0 && b->entries == 1) {
                    PyObject *key = key_object(b);
                    if (key == NULL) {
                        unwalk(s, at - 1);
                        Py_DECREF(out);
                        return NULL;
                    }
                    PyList_SET_ITEM(out, k, key);
                    b->entries = 0;
                    break;
                }
                b->entries--;
            }
        Py_ssize_t size = PyList_GET_SIZE(evicted);
        if (PyList_SetSlice(evicted, size, size, out) < 0) {
            unwalk(s, at);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(out);
        for (size_t p = s->head; p < at; p++) {
            uint32_t id = s->queue[p];
            Block *b = &s->slab[id];
            if (b->holders == 0 && b->entries == 0) /* a freed slot's entries are FREED */
                remove_block(s, id);
        }
    }
    if (at > TRIM_AFTER && 2 * at > s->tail) {
        memmove(s->queue, s->queue + at, (s->tail - at) * sizeof(uint32_t));
        s->tail -= at;
        at = 0;
    }
    s->head = at;
    s->num_free -= n;
    Py_RETURN_NONE;
}

static void release_memory(Store *s)
{
    PyMem_Free(s->slab);
    PyMem_Free(s->index);
    PyMem_Free(s->queue);
    s->slab = NULL;
    s->index = NULL;
    s->queue = NULL;
    s->slab_used = s->slab_cap = s->count = 0;
    s->freed = NONE;
    s->mask = 0;
    s->head = s->tail = s->queue_cap = 0;
    s->num_free = 0;
}

static PyObject *Store_clear(Store *s, PyObject *unused)
{
    (void)unused;
    release_memory(s);
    Py_RETURN_NONE;
}

static PyObject *Store_keys(Store *s, PyObject *unused)
{
    (void)unused;
    PyObject *list = PyList_New(s->count);
    if (list == NULL)
        return NULL;
    Py_ssize_t k = 0;
    for (uint32_t id = 0; id < s->slab_used; id++) {
        if (s->slab[id].entries == FREED)
            continue;
        PyObject *key = key_object(&s->slab[id]);
        if (key == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k++, key);
    }
    return list;
}

static PyObject *Store_free_queue(Store *s, PyObject *unused)
{
    (void)unused;
    PyObject *list = PyList_New((Py_ssize_t)(s->tail - s->head));
    if (list == NULL)
        return NULL;
    for (size_t p = s->head; p < s->tail; p++) {
        PyObject *key = key_object(&s->slab[s->queue[p]]);
        if (key == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)(p - s->head), key);
    }
    return list;
}

static PyObject *Store_holders(Store *s, PyObject *key)
{
    uint32_t id = find_key(s, key);
    if (id == NONE) {
        key_error(key);
        return NULL;
    }
    return Py_BuildValue("(kk)", (unsigned long)s->slab[id].holders,
                         (unsigned long)s->slab[id].entries);
}

static Py_ssize_t Store_len(Store *s)
{
    return s->count;
}

static int Store_contains(Store *s, PyObject *key)
{
    return find_key(s, key) != NONE;
}

static PyObject *Store_get_num_free(Store *s, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(s->num_free);
}

/* Room for `capacity` blocks before any array grows: 0, or -1 with MemoryError (the arrays
 * taken so far stay, as a store that grew would hold them). A cache fills to its size: grown
 * from empty to 833 blocks, its index was rehashed seven times and its slab copied four, each
 * time out of the CPU's caches at 512 workers. */
static int reserve(Store *s, Py_ssize_t capacity)
{
    if (capacity <= 0)
        return 0;
    if (capacity > MAX_BLOCKS)
        capacity = MAX_BLOCKS;
    while ((size_t)capacity > (s->index == NULL ? 0 : (s->mask + 1) / 2))
        if (grow_index(s) < 0)
            return -1;
    while ((Py_ssize_t)s->slab_cap < capacity)
        if (grow_slab(s) < 0)
            return -1;
    return reserve_queue(s, (size_t)capacity);
}

static PyObject *Store_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:CachedBlocks", kwlist, &capacity))
        return NULL;
    if (capacity < 0) {
        PyErr_Format(PyExc_ValueError, "capacity: blocks to make room for, not %zd", capacity);
        return NULL;
    }
    Store *s = (Store *)type->tp_alloc(type, 0); /* zeroed */
    if (s == NULL)
        return NULL;
    s->freed = NONE;
    s->stale_slack = STALE_SLACK;
    if (reserve(s, capacity) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static void Store_dealloc(Store *s)
{
    release_memory(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef Store_methods[] = {
    {"prefix", FASTCALL(Store_prefix), METH_FASTCALL,
     "prefix(keys, limit): how many leading blocks of keys (at most limit) are cached."},
    {"num_free_of", FASTCALL(Store_num_free_of), METH_FASTCALL,
     "num_free_of(keys, n): of the first n blocks of keys (all cached), how many nobody holds."},
    {"pin", FASTCALL(Store_pin), METH_FASTCALL,
     "pin(keys, n, held): one holder more for each of the first n blocks of keys, appended to "
     "held; how many were free."},
    {"add", FASTCALL(Store_add), METH_FASTCALL,
     "add(keys, start, stop, held): name blocks keys[start:stop], each held once and appended "
     "to held, up to the first one cached already; how many."},
    {"release", FASTCALL(Store_release), METH_FASTCALL,
     "release(held): one holder fewer for each of held, last first; held is emptied. How many "
     "joined the LRU."},
    {"evict", FASTCALL(Store_evict), METH_FASTCALL,
     "evict(n, evicted=None): forget the n oldest free blocks, their keys appended to evicted."},
    {"clear", (PyCFunction)Store_clear, METH_NOARGS, "Forget every block."},
    {"keys", (PyCFunction)Store_keys, METH_NOARGS, "Every cached block's key, in no order."},
    {"free_queue", (PyCFunction)Store_free_queue, METH_NOARGS,
     "The free queue's entries, oldest first, stale ones included (a copy)."},
    {"holders", (PyCFunction)Store_holders, METH_O,
     "holders(key): a cached block's holders and its entries in the free queue."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Store_members[] = {
    {"stale_slack", T_PYSSIZET, offsetof(Store, stale_slack), 0,
     "Stale entries the free queue may hold beyond its live ones before it is rebuilt."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Store_getset[] = {
    {"num_free", (getter)Store_get_num_free, NULL, "Cached blocks nobody holds.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Store_as_sequence = {
    .sq_length = (lenfunc)Store_len,
    .sq_contains = (objobjproc)Store_contains,
};

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fairway_cached_blocks.CachedBlocks",
    .tp_basicsize = sizeof(Store),
    .tp_dealloc = (destructor)Store_dealloc,
    .tp_as_sequence = &Store_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Blocks with an identity, by key: their holders and the free LRU "
              "(simulator/cached_blocks.py).",
    .tp_methods = Store_methods,
    .tp_members = Store_members,
    .tp_getset = Store_getset,
    .tp_new = Store_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fairway_cached_blocks",
    .m_doc = "The KV cache's blocks with an identity, in C (simulator/cached_blocks.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit_fairway_cached_blocks(void)
{
    if (PyType_Ready(&StoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&StoreType);
    if (PyModule_AddObject(m, "CachedBlocks", (PyObject *)&StoreType) < 0) {
        Py_DECREF(&StoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
