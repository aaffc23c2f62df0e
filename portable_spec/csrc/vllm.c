/* vllm_chains: the vLLM plugin's common step read straight from vLLM's objects (its request
   dict, each request's grammar wrapper and that wrapper's matcher, the scheduled draft lists),
   then packed and walked as pack_chains does with `repeat` and `plain`. The attributes read
   are the ones the plugin names when it calls (`names`, made once by its internals.py): this
   file knows the shape of vLLM's objects, not their names. Reading them runs Python code
   (attribute reads, key comparisons), which may change or free anything borrowed: every
   object is held by a reference from the moment it is read. */

/* The roles of the attribute names vllm_chains is handed: a request's structured-output
   state, the grammar wrapper field behind its property, the wrapper's xgrammar matcher. */
enum { NAME_STATE, NAME_GRAMMAR, NAME_MATCHER, CHAIN_NAMES };

/* The `n` attribute names a step reader was handed: the items of an exact tuple of exact str
   (borrowed: the caller's arguments hold the tuple, which nothing can change, for the whole
   call), or NULL with a TypeError set. */
static PyObject *const *step_names(PyObject *names, Py_ssize_t n) {
    Py_ssize_t found = -1;
    PyObject *const *items = PyTuple_CheckExact(names) ? sequence_items(names, &found) : NULL;
    for (Py_ssize_t i = 0; items != NULL && i < found; i++)
        if (!PyUnicode_CheckExact(items[i])) items = NULL;
    if (items == NULL || found != n) {
        PyErr_Format(PyExc_TypeError, "the attribute names must be a tuple of %zd str", n);
        return NULL;
    }
    return items;
}

/* What vllm_chains read of the step: per request its drafts and matcher (references, in
   lists), its matcher's facts, the stop tokens they share and the rows the step needs. */
typedef struct {
    PyObject *drafts, *matchers, *stops;
    Facts *facts;
    PyObject *const *names; /* CHAIN_NAMES attribute names (borrowed for the call) */
    Py_ssize_t n, words, rows, capacity;
} Step;

static void step_clear(Step *s) {
    Py_CLEAR(s->drafts);
    Py_CLEAR(s->matchers);
    Py_CLEAR(s->stops);
    PyMem_Free(s->facts);
    s->facts = NULL;
}

/* The matcher of vLLM request `request` and its facts from `known` (id(grammar) -> (matcher,
   handle, words, stop_ids, weak reference)): a new reference, its stop tokens a new reference
   in *stops, or NULL (an error may be set: the caller declines either way). The entry is
   read while this function holds the wrapper: dropping it may run the weak reference's
   callback, which removes the entry and frees what only the entry held. */
static PyObject *step_matcher(PyObject *request, PyObject *const *names, PyObject *known,
                              PyObject *wrappers, Py_ssize_t words, Facts *f, PyObject **stops) {
    PyObject *held = PyObject_GetAttr(request, names[NAME_STATE]);
    if (held == NULL) return NULL;
    PyObject *grammar = PyObject_GetAttr(held, names[NAME_GRAMMAR]);
    Py_DECREF(held);
    if (grammar == NULL) return NULL;
    PyObject *matcher = NULL, *key = NULL;
    if (PySet_Contains(wrappers, (PyObject *)Py_TYPE(grammar)) == 1 &&
        (matcher = PyObject_GetAttr(grammar, names[NAME_MATCHER])) != NULL &&
        (key = PyLong_FromVoidPtr(grammar)) != NULL) {
        /* made by the Python side; the lookup of an exact int key runs no Python code */
        PyObject *entry = PyDict_GetItemWithError(known, key);
        int64_t handle, width;
        if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5 ||
            PyTuple_GET_ITEM(entry, 0) != matcher ||
            exact_int(PyTuple_GET_ITEM(entry, 1), &handle) != 0 || handle == 0 ||
            exact_int(PyTuple_GET_ITEM(entry, 2), &width) != 0 || width != words) {
            Py_CLEAR(matcher);
        } else {
            f->handle = (uintptr_t)handle;
            f->words = words;
            f->vocab = 32 * (int64_t)words;
            f->stops = NULL; /* borrowed from the entry: owned through *stops instead */
            *stops = Py_NewRef(PyTuple_GET_ITEM(entry, 3));
        }
    }
    Py_XDECREF(key);
    Py_DECREF(grammar); /* may run Python code: nothing of the entry is read after this */
    return matcher;
}

/* Request b of the step read: its drafts from `spec` and its matcher. 1, or 0 to decline
   (an error may be set). */
static int step_read(Step *s, Py_ssize_t b, PyObject *id, PyObject *requests, PyObject *spec,
                     PyObject *known, PyObject *wrappers, Py_ssize_t stride) {
    PyObject *tokens = PyDict_GetItemWithError(spec, id); /* may run a key's __eq__ */
    if (tokens == NULL && PyErr_Occurred()) return 0;
    tokens = tokens == NULL || tokens == Py_None ? PyList_New(0) : Py_NewRef(tokens);
    if (tokens == NULL) return 0;
    PyList_SET_ITEM(s->drafts, b, tokens);
    PyObject *request = PyDict_GetItemWithError(requests, id);
    if (request == NULL) return 0;
    Py_INCREF(request); /* the attribute reads may run Python code */
    PyObject *stops = NULL;
    PyObject *matcher =
        step_matcher(request, s->names, known, wrappers, s->words, &s->facts[b], &stops);
    Py_DECREF(request);
    if (matcher == NULL) return 0;
    PyList_SET_ITEM(s->matchers, b, matcher);
    int same = s->stops == NULL || stops == s->stops;
    if (s->stops == NULL)
        s->stops = stops; /* the reference moves into the step */
    else
        Py_DECREF(stops);
    if (!same) return 0;
    Py_ssize_t k = PyObject_Length(tokens);
    if (k < 0) return 0;
    Py_ssize_t span = stride ? stride : k + 1;
    if (span > s->capacity - s->rows) return 0; /* (s->rows <= s->capacity: no overflow) */
    s->rows += span;
    return 1;
}

/* Every request of the step read: 1, or 0 to decline (an error may be set). */
static int step_read_all(Step *s, PyObject *ids, PyObject *requests, PyObject *spec,
                         PyObject *known, PyObject *wrappers, Py_ssize_t stride) {
    s->n = PyList_GET_SIZE(ids);
    s->drafts = PyList_New(s->n);
    s->matchers = PyList_New(s->n);
    s->facts = PyMem_Calloc((size_t)s->n + 1, sizeof(Facts));
    if (s->drafts == NULL || s->matchers == NULL || s->facts == NULL) return 0;
    for (Py_ssize_t b = 0; b < s->n; b++) {
        if (b >= PyList_GET_SIZE(ids)) return 0; /* changed by an attribute read */
        PyObject *id = Py_NewRef(PyList_GET_ITEM(ids, b));
        int ok = PyUnicode_CheckExact(id) &&
                 step_read(s, b, id, requests, spec, known, wrappers, stride);
        Py_DECREF(id);
        if (!ok) return 0;
    }
    return s->n > 0;
}

/* The step packed into rows [0, s->rows) of `buffer` and walked. */
static PyObject *step_walked(Step *s, PyObject *buffer, Py_ssize_t stride, PyObject *no_ends) {
    Walk w;
    walk_init(&w, WALK_CHAINS);
    w.repeat = 1;
    w.limit = 32 * (int64_t)s->words;
    Array rows = {0}, ends = {0};
    PyObject *out = PySequence_GetSlice(buffer, 0, s->rows), *walked = NULL, *result = NULL;
    if (out == NULL || array_get(out, &rows, 1, 'i', 4, 2, "rows") != 0 ||
        array_get(no_ends, &ends, 0, 'i', 8, 1, "ends") != 0 || walk_reserve(&w, s->n) != 0)
        goto done;
    w.words = s->words;
    for (Py_ssize_t b = 0; b < s->n; b++)
        if (walk_matcher(&w, b, PyList_GET_ITEM(s->matchers, b), &s->facts[b]) != 0) goto done;
    if (walk_copy_stops(&w, s->stops) != 0) goto done;
    Pack p = {0};
    p.n = s->n;
    p.stride = stride;
    p.vocab = w.limit;
    p.active = Py_None;
    p.ends = ends.view.buf;
    p.nends = ends.view.shape[0];
    p.plain = 1;
    /* from here on no Python code runs until the lists are packed */
    int held = 0;
    if (!pack_check(&p, s->drafts) || p.rows != s->rows || (held = walk_hold(&w)) <= 0) {
        result = held < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    w.rows = (int32_t *)rows.view.buf;
    if (pack_fill(&p, &w, w.rows, s->words, NULL) != 0 || !walk_spans_fit(&w, p.rows, 1) ||
        walk_run(&w) != 0)
        goto done;
    if ((walked = walk_outcome(&w, NULL)) != NULL) result = PyTuple_Pack(3, out, walked, s->drafts);
done:
    Py_XDECREF(walked);
    Py_XDECREF(out);
    array_release(&ends);
    array_release(&rows);
    walk_clear(&w);
    return result;
}

static PyObject *vllm_chains(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *requests, *ids, *spec, *known, *wrappers, *buffer, *no_ends, *names;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "OOOO!O!OnOO", &requests, &ids, &spec, &PyDict_Type, &known,
                          &PySet_Type, &wrappers, &buffer, &stride, &no_ends, &names))
        return NULL;
    PyObject *const *read = step_names(names, CHAIN_NAMES);
    if (read == NULL) return NULL;
    if (!PyDict_CheckExact(requests) || !PyList_CheckExact(ids) || !PyDict_CheckExact(spec) ||
        stride < 0)
        Py_RETURN_NONE;
    Array view;
    if (array_get(buffer, &view, 1, 'i', 4, 2, "rows") != 0) return NULL;
    Py_ssize_t capacity = view.view.shape[0];
    Step s;
    memset(&s, 0, sizeof(s));
    s.names = read;
    s.words = view.view.shape[1];
    s.capacity = capacity;
    array_release(&view);
    PyObject *result = NULL;
    Py_INCREF(ids);
    if (step_read_all(&s, ids, requests, spec, known, wrappers, stride) && s.rows <= capacity)
        result = step_walked(&s, buffer, stride, no_ends);
    Py_DECREF(ids);
    step_clear(&s);
    if (result == NULL) { /* anything unusual, or an error reading vLLM's objects: decline */
        PyErr_Clear();
        result = Py_NewRef(Py_None);
    }
    return result;
}
