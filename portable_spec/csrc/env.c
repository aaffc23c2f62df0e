/* What the compiled builds read besides their arguments, given once by
   portable_spec.native.configure (the library's own tables, never a caller's):

     facts   dict id(matcher) -> (weak reference, handle, words, vocab_size, stop_ids) of every
             xgrammar matcher the library probed whose methods the helper can call; `handle`
             is the address of the matcher's tvm-ffi object, valid while the matcher lives;
             stop_ids one int64 array per distinct stop set (compared by identity)
     held    dict id(matcher) -> the token of the build walking it (portable_spec.pending):
             a build holds its matchers there for as long as it walks them
     tally   float64 [8], the build counters (see count_build)
     empty, int32, bool, ndarray   numpy's allocator, dtypes and array type (builds without
             numpy's headers make their outputs through them)

   And the walk hook: a callable the runner calls, with the GIL, between its checks and the
   walk without the GIL (tests use it to act as another thread would at that moment). */

static PyObject *env_facts, *env_held, *env_tally;
static PyObject *env_empty, *env_int32, *env_bool, *env_ndarray;
static PyObject *walk_hook;

static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *facts, *held, *tally, *empty, *int32, *boolean, *ndarray;
    if (!PyArg_ParseTuple(args, "O!O!OOOOO", &PyDict_Type, &facts, &PyDict_Type, &held, &tally,
                          &empty, &int32, &boolean, &ndarray))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(tally, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return NULL;
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    if (len < (Py_ssize_t)(8 * sizeof(double))) {
        PyErr_SetString(PyExc_TypeError, "configure: the tally must be float64 [8]");
        return NULL;
    }
    Py_XSETREF(env_facts, Py_NewRef(facts));
    Py_XSETREF(env_held, Py_NewRef(held));
    Py_XSETREF(env_tally, Py_NewRef(tally));
    Py_XSETREF(env_empty, Py_NewRef(empty));
    Py_XSETREF(env_int32, Py_NewRef(int32));
    Py_XSETREF(env_bool, Py_NewRef(boolean));
    Py_XSETREF(env_ndarray, Py_NewRef(ndarray));
    Py_RETURN_NONE;
}

static PyObject *set_walk_hook(PyObject *self, PyObject *hook) {
    (void)self;
    if (hook != Py_None && !PyCallable_Check(hook)) {
        PyErr_SetString(PyExc_TypeError, "the walk hook must be callable or None");
        return NULL;
    }
    Py_XSETREF(walk_hook, hook == Py_None ? NULL : Py_NewRef(hook));
    Py_RETURN_NONE;
}

/* Whether configure has run (the builds decline until it has). */
static int env_ready(void) { return env_facts != NULL; }

/* What the facts table says of matcher `g`. */
typedef struct {
    uintptr_t handle;
    Py_ssize_t words;
    int64_t vocab;
    PyObject *stops; /* borrowed from the table: take a reference before Python code runs */
} Facts;

/* 1 with *f filled when the facts table holds an entry for this very object (its weak
   reference pointing at `g`), else 0 (no error set). Runs no Python code: the key is an exact
   int, the entry's fields exact ints. */
static int matcher_facts(PyObject *g, Facts *f) {
    if (env_facts == NULL) return 0;
    PyObject *key = PyLong_FromVoidPtr(g);
    if (key == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *entry = PyDict_GetItemWithError(env_facts, key);
    Py_DECREF(key);
    if (entry == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5) return 0;
    PyObject *ref = PyTuple_GET_ITEM(entry, 0);
    if (!PyWeakref_CheckRef(ref)) return 0;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target = NULL;
    if (PyWeakref_GetRef(ref, &target) < 0) {
        PyErr_Clear();
        return 0;
    }
    Py_XDECREF(target); /* compared by identity only; `g` is held by the caller */
#else
    PyObject *target = PyWeakref_GetObject(ref);
#endif
    if (target != g) return 0;
    int64_t handle, words, vocab;
    if (exact_int(PyTuple_GET_ITEM(entry, 1), &handle) != 0 ||
        exact_int(PyTuple_GET_ITEM(entry, 2), &words) != 0 ||
        exact_int(PyTuple_GET_ITEM(entry, 3), &vocab) != 0 || handle == 0 || words < 1)
        return 0;
    f->handle = (uintptr_t)handle;
    f->words = (Py_ssize_t)words;
    f->vocab = vocab;
    f->stops = PyTuple_GET_ITEM(entry, 4);
    return 1;
}
