/* Python's small objects on transparent huge pages: an arena allocator for pymalloc.
 *
 * pymalloc keeps every object of 512 bytes or less in 1 MiB arenas, each its own mmap. A
 * simulation of a large fleet holds hundreds of MiB of them (engines' blocks, the index, the
 * trace) and touches them in no order a cache can follow, so many of its loads also miss the
 * TLB, and 4 KiB pages make every such miss a page walk. A 1 MiB mapping can never be backed by
 * a 2 MiB page. This allocator hands pymalloc its arenas from 64 MiB reservations, aligned to
 * 2 MiB and advised MADV_HUGEPAGE, so the kernel backs them with huge pages where it allows
 * (the "madvise" setting included; under "never" they are plain pages, as before).
 *
 * A freed arena is unmapped, as pymalloc's own allocator does, so memory goes back to the
 * system, and new arenas always come from fresh address space (pages the kernel zeroes on first
 * touch). pymalloc frees few arenas in a simulation: a replay of 468k requests reserved 512 MiB
 * in all for a 1 GB peak. Unmapping 1 MiB of a 2 MiB page leaves its other half on small pages;
 * reservations are address space only (MAP_NORESERVE), so the holes cost nothing.
 *
 * Installed once per process (PyObject_SetArenaAllocator, CPython's documented hook), never
 * removed: an arena of the allocator it replaced is unmapped the same way. pymalloc calls it
 * with the GIL held, so no lock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <sys/mman.h>

#define HUGE_PAGE ((size_t)2 << 20)
#define RESERVATION ((size_t)64 << 20)

static char *cursor;        /* the next arena in the current reservation */
static size_t left;         /* bytes after it */
static size_t reservations; /* how many reservations were mapped */
static int installed;

static char *reserve(size_t size)
{
    /* Map 2 MiB more than asked and trim both ends, so that the start is 2 MiB-aligned. */
    char *raw = mmap(NULL, size + HUGE_PAGE, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    char *start = (char *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (start > raw)
        munmap(raw, (size_t)(start - raw));
    char *end = start + size; /* always short of the mapping's end, by 4 KiB to 2 MiB */
    munmap(end, (size_t)(raw + size + HUGE_PAGE - end));
#ifdef MADV_HUGEPAGE
    madvise(start, size, MADV_HUGEPAGE); /* advice: refused, the pages are plain ones */
#endif
    reservations++;
    return start;
}

static void *arena_alloc(void *ctx, size_t size)
{
    (void)ctx;
    if (left < size) {
        size_t want = size > RESERVATION ? size : RESERVATION;
        char *start = reserve(want);
        if (start == NULL)
            return NULL; /* pymalloc then raises MemoryError */
        cursor = start;
        left = want; /* the rest of the last reservation stays reserved, untouched, unbacked */
    }
    void *arena = cursor;
    cursor += size;
    left -= size;
    return arena;
}

static void arena_free(void *ctx, void *arena, size_t size)
{
    (void)ctx;
    munmap(arena, size);
}

static PyObject *install(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (!installed) {
        PyObjectArenaAllocator allocator = {NULL, arena_alloc, arena_free};
        PyObject_SetArenaAllocator(&allocator);
        installed = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *reserved(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromSize_t(reservations * RESERVATION);
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS,
     "Give pymalloc its arenas from huge-page reservations, for the rest of the process."},
    {"reserved", reserved, METH_NOARGS, "Bytes of address space reserved for arenas so far."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fairway_huge_arenas",
    "pymalloc's arenas on transparent huge pages (router/runtime/huge_arenas.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_fairway_huge_arenas(void)
{
    return PyModule_Create(&module);
}
