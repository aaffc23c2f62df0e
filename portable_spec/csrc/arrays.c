/* The caller's arrays, read and held; the outputs, made. With the GIL. */

/* An array argument, held for as long as it is read: a buffer export, or (an aligned,
   native-order, C-contiguous ndarray read through numpy's fields) a reference to it. */
typedef struct {
    int held;
    PyObject *ref;  /* the ndarray read through its fields; NULL for a buffer export */
    Py_buffer view; /* buf, len, itemsize, ndim, shape: valid while held */
} Array;

/* A numpy array read through its fields into *view: 1 when `obj` is an aligned, native-order,
   C-contiguous ndarray (writable when asked) of integers of `itemsize` bytes (kind 'i'), of
   bools (kind '?') or of float64 (kind 'd'), its view filled with nothing to release
   (view->obj NULL); 0 otherwise (nothing filled, no error). A buffer export builds a format
   string and a shape for every call: microseconds with cold caches, on every engine step.
   Built without numpy's headers, always 0 (the buffer protocol then does the job). */
static int array_view(PyObject *obj, Py_buffer *view, int writable, char kind,
                      Py_ssize_t itemsize) {
#ifdef PS_NUMPY
    if (!PyArray_Check(obj)) return 0;
    PyArrayObject *a = (PyArrayObject *)obj;
    int type = PyArray_TYPE(a);
    const char *format;
    if (kind == '?') {
        if (type != NPY_BOOL) return 0;
        format = "?";
    } else if (kind == 'd') {
        if (type != NPY_DOUBLE) return 0;
        format = "d";
    } else if (type == NPY_INT || type == NPY_LONG || type == NPY_LONGLONG) {
        if (PyArray_ITEMSIZE(a) != itemsize || (itemsize != 4 && itemsize != 8)) return 0;
        format = itemsize == 8 ? "q" : "i";
    } else {
        return 0;
    }
    /* C-contiguous, aligned and in native byte order */
    if (!PyArray_ISCARRAY_RO(a) || (writable && !PyArray_ISWRITEABLE(a))) return 0;
    view->buf = PyArray_DATA(a);
    view->obj = NULL;
    view->len = PyArray_NBYTES(a);
    view->itemsize = PyArray_ITEMSIZE(a);
    view->readonly = !PyArray_ISWRITEABLE(a);
    view->ndim = PyArray_NDIM(a);
    view->format = (char *)format;
    view->shape = (Py_ssize_t *)PyArray_DIMS(a);
    view->strides = NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 1;
#else
    (void)obj, (void)view, (void)writable, (void)kind, (void)itemsize;
    return 0;
#endif
}

static void array_release(Array *a) {
    if (!a->held) return;
    if (a->ref != NULL)
        Py_CLEAR(a->ref);
    else
        PyBuffer_Release(&a->view);
    a->held = 0;
}

/* The format character of a buffer export, past its byte-order mark ('<' only where it is
   this machine's order). */
static char format_kind(const Py_buffer *view) {
    const uint16_t probe = 1;
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '=' || *fmt == '@' || *fmt == '|' ||
        (*fmt == '<' && *(const uint8_t *)&probe == 1))
        fmt++;
    return fmt[1] == 0 ? fmt[0] : 0;
}

/* Hold `obj` as a C-contiguous array (writable when asked) of `kind` ('i': integers of
   `itemsize` bytes; '?': one-byte flags, bool or uint8; 'd': float64) with `ndim` dimensions
   (-1: any). 0, or -1 with a TypeError naming `name`. */
static int array_get(PyObject *obj, Array *a, int writable, char kind, Py_ssize_t itemsize,
                     int ndim, const char *name) {
    a->held = 0;
    a->ref = NULL;
    if (array_view(obj, &a->view, writable, kind, itemsize) &&
        (ndim < 0 || a->view.ndim == ndim)) {
        a->ref = Py_NewRef(obj);
        a->held = 1;
        return 0;
    }
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    a->held = 1;
    char f = format_kind(&a->view);
    int ok = a->view.itemsize == itemsize && (ndim < 0 || a->view.ndim == ndim);
    if (kind == 'i') ok = ok && (f == 'i' || f == 'l' || f == 'q');
    if (kind == '?') ok = ok && (f == '?' || f == 'B' || f == 'b') && a->view.ndim >= 1;
    if (kind == 'd') ok = ok && f == 'd';
    if (!ok) {
        array_release(a);
        if (kind == 'i')
            PyErr_Format(PyExc_TypeError, "%s must be a %d-D int%d array", name, ndim,
                         (int)(itemsize * 8));
        else
            PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %s array", name,
                         kind == 'd' ? "float64" : "bool");
        return -1;
    }
    return 0;
}

/* Hold the valid flags: a writable array of exactly n one-byte flags, any shape. */
static int array_flags(PyObject *obj, Array *a, Py_ssize_t n) {
    if (array_get(obj, a, 1, '?', 1, -1, "valid") != 0) return -1;
    if (a->view.len != n) {
        array_release(a);
        PyErr_SetString(PyExc_TypeError, "valid must be a bool array with one entry per node");
        return -1;
    }
    return 0;
}

/* Hold a writable 1-D float64 array of at least n entries (per-walk times). */
static int array_seconds(PyObject *obj, Array *a, Py_ssize_t n) {
    if (array_get(obj, a, 1, 'd', 8, 1, "seconds") != 0) return -1;
    if (a->view.shape[0] < n) {
        array_release(a);
        PyErr_SetString(PyExc_TypeError, "seconds must have one entry per walk");
        return -1;
    }
    return 0;
}

/* An exact Python int that fits int64 into *v: 0; else -1 (no error left set). Runs no
   Python code (an __index__ is never called). */
static int exact_int(PyObject *obj, int64_t *v) {
    int overflow = 0;
    if (!PyLong_CheckExact(obj)) return -1;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *v = (int64_t)value;
    return 0;
}

/* The items of an exact list or tuple (borrowed: valid while no Python code runs and the
   container is held) and their count in *n; -1 in *n when `obj` is neither. */
static PyObject *const *sequence_items(PyObject *obj, Py_ssize_t *n) {
    if (PyList_CheckExact(obj)) {
        *n = PyList_GET_SIZE(obj);
        return (PyObject *const *)((PyListObject *)obj)->ob_item;
    }
    if (PyTuple_CheckExact(obj)) {
        *n = PyTuple_GET_SIZE(obj);
        return (PyObject *const *)((PyTupleObject *)obj)->ob_item;
    }
    *n = -1;
    return NULL;
}

/* A private PyMem copy of n int64 (at least one slot), or NULL with MemoryError set. */
static int64_t *copy_int64(const void *source, Py_ssize_t n) {
    int64_t *out = PyMem_Malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (out == NULL) return (int64_t *)PyErr_NoMemory();
    if (n > 0) memcpy(out, source, sizeof(int64_t) * (size_t)n);
    return out;
}
