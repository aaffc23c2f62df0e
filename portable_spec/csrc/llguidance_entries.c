/* llguidance_walks and llguidance_masks: batches of llguidance matchers walked from C
   (llguidance.c's walk, one entry after the other, the GIL held but for the masks).

   A part of module.c (one translation unit): it uses arrays.c, env.c, walk.c (the Walk and
   its held table), masks.c (the outputs and the tally of a build) and llguidance.c. */

/* The raised exception, taken off the interpreter (a new reference, never NULL while one is
   set). */
static PyObject *take_error(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
#endif
}

/* What llguidance_walks reads: the caller's arrays, held for the call, and a private copy of
   its spans and token bounds, checked before the first entry (a matcher is Python code: it
   may rewrite the caller's spans while an entry is walked). */
typedef struct {
    Array rows, nt, ns, tokens, spans, counts, live, accepted, limits;
    int64_t *table; /* [count * 4]: per entry its first row, first token, nodes, token bound */
    Py_ssize_t count, longest;
} LlgBatch;

static void llg_batch_release(LlgBatch *b) {
    array_release(&b->rows);
    array_release(&b->nt);
    array_release(&b->ns);
    array_release(&b->tokens);
    array_release(&b->spans);
    array_release(&b->counts);
    array_release(&b->live);
    array_release(&b->accepted);
    array_release(&b->limits);
    PyMem_Free(b->table);
    b->table = NULL;
}

/* Entry c of the batch walked: its links and tokens copied out of the caller's arrays (into
   `block`, room for 40 bytes per node of the longest entry), then llg_entry. 0, or -1 with an
   error set. */
static int llg_batch_entry(LlgBatch *b, LlgWalk *w, Py_ssize_t c, int chain, int64_t *block,
                           uint8_t *filled) {
    const int64_t *span = b->table + 4 * c;
    int64_t first = span[0], at = span[1], n = span[2], limit = span[3];
    Py_ssize_t total = b->rows.view.shape[0], ntokens = b->tokens.view.shape[0];
    if (n < 1 || n > b->longest || first < 0 || first > total - n || at < 0 ||
        at > ntokens - n) { /* (checked when copied; bounded again where it is used) */
        PyErr_SetString(PyExc_ValueError, "a span lies outside the rows or the tokens");
        return -1;
    }
    int64_t *next = block, *sibling = block + n, *tokens = block + 2 * n;
    memcpy(tokens, (const int64_t *)b->tokens.view.buf + at, sizeof(int64_t) * (size_t)n);
    if (chain) {
        llg_chain_links(next, sibling, n);
    } else {
        memcpy(next, (const int64_t *)b->nt.view.buf + at, sizeof(int64_t) * (size_t)n);
        memcpy(sibling, (const int64_t *)b->ns.view.buf + at, sizeof(int64_t) * (size_t)n);
        if (!llg_tree_valid(next, sibling, n, tokens + n)) {
            PyErr_SetString(PyExc_ValueError, "the links do not form a verify tree");
            return -1;
        }
    }
    uint8_t *live = b->live.held ? (uint8_t *)b->live.view.buf + first : NULL;
    uint8_t *accepted = b->accepted.held ? (uint8_t *)b->accepted.view.buf + first : NULL;
    int32_t *rows = (int32_t *)b->rows.view.buf + first * w->words;
    return llg_entry(w, next, sibling, tokens, n, limit, rows, filled, live, accepted,
                     (int64_t *)b->counts.view.buf + 2 * c);
}

/* The private copy of the spans and token bounds, each span checked to lie inside the rows
   and the tokens, each bound cut to the rows' width; b->longest set. 0, or -1 with a
   ValueError. */
static int llg_batch_table(LlgBatch *b) {
    Py_ssize_t total = b->rows.view.shape[0], ntokens = b->tokens.view.shape[0];
    int64_t width = 32 * (int64_t)b->rows.view.shape[1];
    b->table = PyMem_Malloc(sizeof(int64_t) * 4 * (size_t)(b->count + 1));
    if (b->table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->longest = 1;
    for (Py_ssize_t c = 0; c < b->count; c++) {
        const int64_t *span = (const int64_t *)b->spans.view.buf + 3 * c;
        int64_t first = span[0], at = span[1], n = span[2];
        int64_t limit = ((const int64_t *)b->limits.view.buf)[c];
        if (n < 1 || first < 0 || first > total - n || at < 0 || at > ntokens - n) {
            PyErr_SetString(PyExc_ValueError, "a span lies outside the rows or the tokens");
            return -1;
        }
        int64_t *row = b->table + 4 * c;
        row[0] = first;
        row[1] = at;
        row[2] = n;
        row[3] = limit < 0 ? 0 : limit > width ? width : limit;
        if (n > b->longest) b->longest = (Py_ssize_t)n;
    }
    return 0;
}

/* Hold the caller's arrays: 0, or -1 with a TypeError naming the one that is wrong (a
   ValueError for a span outside them). */
static int llg_batch_get(LlgBatch *b, PyObject *rows, PyObject *nt, PyObject *ns,
                         PyObject *tokens, PyObject *spans, PyObject *limits, PyObject *counts,
                         PyObject *live, PyObject *accepted, int chain) {
    if (array_get(rows, &b->rows, 1, 'i', 4, 2, "rows") != 0 ||
        array_get(tokens, &b->tokens, 0, 'i', 8, 1, "tokens") != 0 ||
        array_get(spans, &b->spans, 0, 'i', 8, 2, "spans") != 0 ||
        array_get(limits, &b->limits, 0, 'i', 8, 1, "limits") != 0 ||
        array_get(counts, &b->counts, 1, 'i', 8, 2, "counts") != 0)
        return -1;
    if (!chain && (array_get(nt, &b->nt, 0, 'i', 8, 1, "next_token") != 0 ||
                   array_get(ns, &b->ns, 0, 'i', 8, 1, "next_sibling") != 0))
        return -1;
    Py_ssize_t total = b->rows.view.shape[0];
    if ((live != Py_None && array_flags(live, &b->live, total) != 0) ||
        (accepted != Py_None && array_flags(accepted, &b->accepted, total) != 0))
        return -1;
    b->count = b->spans.view.shape[0];
    if (b->spans.view.shape[1] != 3 || b->counts.view.shape[0] != b->count ||
        b->counts.view.shape[1] != 2 || b->limits.view.shape[0] != b->count) {
        PyErr_SetString(PyExc_TypeError,
                        "spans must be int64 [count, 3], limits [count], counts [count, 2]");
        return -1;
    }
    if (!chain && (b->nt.view.shape[0] != b->tokens.view.shape[0] ||
                   b->ns.view.shape[0] != b->tokens.view.shape[0])) {
        PyErr_SetString(PyExc_ValueError, "the links and the tokens differ in length");
        return -1;
    }
    return llg_batch_table(b);
}

static PyObject *llguidance_walks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows, *nt, *ns, *tokens, *spans, *matchers, *limits, *counts, *live, *accepted;
    int chain;
    if (!PyArg_ParseTuple(args, "OOOOOO!OpOOO", &rows, &nt, &ns, &tokens, &spans, &PyList_Type,
                          &matchers, &limits, &chain, &counts, &live, &accepted))
        return NULL;
    if (intern_llguidance_names() != 0) return NULL;
    LlgBatch b;
    memset(&b, 0, sizeof(b));
    PyObject *result = NULL, *list = Py_NewRef(matchers);
    if (llg_batch_get(&b, rows, nt, ns, tokens, spans, limits, counts, live, accepted, chain) !=
        0)
        goto done;
    if (PyList_GET_SIZE(list) != b.count) {
        PyErr_SetString(PyExc_TypeError, "one matcher per span");
        goto done;
    }
    Py_ssize_t longest = b.longest, words = b.rows.view.shape[1];
    LlgWalk w = {NULL, PyList_New(1), PyLong_FromSsize_t(4 * words), NULL, words,
                 PyMem_Calloc((size_t)longest + 1, 2), 0, NULL};
    int64_t *block = PyMem_Malloc((size_t)longest * 40);
    Py_ssize_t failed = -1;
    PyObject *error = NULL;
    if (w.one == NULL || w.nbytes == NULL || w.stopped == NULL || block == NULL ||
        PyList_SetItem(w.one, 0, PyLong_FromLong(0)) != 0) {
        PyErr_NoMemory();
    } else {
        for (Py_ssize_t c = 0; c < b.count && failed < 0; c++) {
            if (c >= PyList_GET_SIZE(list)) { /* the caller's list changed by a call */
                PyErr_SetString(PyExc_RuntimeError, "the matchers list changed during the walk");
                failed = c;
            } else {
                w.matcher = Py_NewRef(PyList_GET_ITEM(list, c));
                if (llg_batch_entry(&b, &w, c, chain, block, w.stopped + longest + 1) != 0)
                    failed = c;
                Py_CLEAR(w.matcher);
            }
            if (failed >= 0) error = take_error();
        }
        result = Py_BuildValue("nO", failed, error != NULL ? error : Py_None);
    }
    Py_XDECREF(error);
    PyMem_Free(block);
    PyMem_Free(w.stopped);
    Py_XDECREF(w.one);
    Py_XDECREF(w.nbytes);
done:
    Py_DECREF(list);
    llg_batch_release(&b);
    return result;
}

static PyObject *s_words, *s_vocab_size;

/* Each grammar made walk entry b's matcher (a reference): 1 when each is an object of exactly
   `type`, known to `widths` (id(matcher) -> (matcher, facts with `words` and `vocab_size`))
   at `words` words and not in its error state, its tokenizer's vocabulary in bounds[b]; 0
   when not (no error set); -1 with an error set. Asking the matchers runs Python code: each
   is held by the walk before the first call. */
static int llg_matchers(Walk *w, PyObject *const *gs, Py_ssize_t n, PyObject *type,
                        PyObject *widths, Py_ssize_t words, int64_t *bounds) {
    if (walk_reserve(w, n) != 0) return -1;
    w->words = words;
    for (Py_ssize_t b = 0; b < n; b++) {
        if ((PyObject *)Py_TYPE(gs[b]) != type) return 0;
        PyObject *key = PyLong_FromVoidPtr(gs[b]);
        if (key == NULL) return -1;
        PyObject *entry = PyDict_GetItemWithError(widths, key); /* an exact int key */
        Py_DECREF(key);
        if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
            PyTuple_GET_ITEM(entry, 0) != gs[b])
            return PyErr_Occurred() ? -1 : 0;
        w->matchers[b] = Py_NewRef(gs[b]);
    }
    for (Py_ssize_t b = 0; b < n; b++) { /* from here on Python code may run */
        PyObject *key = PyLong_FromVoidPtr(w->matchers[b]), *entry = NULL, *found = NULL;
        PyObject *vocab = NULL;
        int64_t width = 0, error = 0;
        if (key != NULL && (entry = PyDict_GetItemWithError(widths, key)) != NULL)
            entry = Py_NewRef(entry);
        Py_XDECREF(key);
        if (entry == NULL) return PyErr_Occurred() ? -1 : 0;
        if (PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2 &&
            (found = PyObject_GetAttr(PyTuple_GET_ITEM(entry, 1), s_words)) != NULL)
            vocab = PyObject_GetAttr(PyTuple_GET_ITEM(entry, 1), s_vocab_size);
        Py_DECREF(entry);
        int ok = found != NULL && exact_int(found, &width) == 0 && width == words &&
                 vocab != NULL && exact_int(vocab, &bounds[b]) == 0 && bounds[b] > 0;
        Py_XDECREF(found);
        Py_XDECREF(vocab);
        if (!ok || call_int(w->matchers[b], s_is_error, NULL, 0, &error) != 0 || error)
            return PyErr_Occurred() ? -1 : 0;
    }
    return 1;
}

/* Every entry of a held walk walked (llg_entry), entry b's tokens bounded by w->limit and
   bounds[b], timed, counted in w->checked and w->rejected: -1 when done, the failing entry
   otherwise (its exception in *error). */
static Py_ssize_t llg_walk_all(Walk *w, Py_ssize_t nodes, const int64_t *bounds,
                               PyObject **error) {
    LlgWalk lw = {NULL, PyList_New(1), PyLong_FromSsize_t(4 * w->words), NULL, w->words,
                  PyMem_Calloc((size_t)nodes + 1, 2), 0, NULL};
    Py_ssize_t failed = -1;
    if (lw.one == NULL || lw.nbytes == NULL || lw.stopped == NULL ||
        PyList_SetItem(lw.one, 0, PyLong_FromLong(0)) != 0) {
        PyErr_NoMemory();
        failed = 0;
    }
    struct timespec began;
    clock_gettime(CLOCK_MONOTONIC, &began);
    for (Py_ssize_t b = 0; b < w->count && failed < 0; b++) {
        const int64_t *s = w->spans + 3 * b;
        int64_t counts[2] = {0, 0};
        uint8_t *accepted = w->flags != NULL ? w->flags + s[0] : NULL;
        int64_t limit = bounds[b] < w->limit ? bounds[b] : w->limit;
        lw.matcher = w->matchers[b];
        if (llg_entry(&lw, w->next_token + s[1], w->next_sibling + s[1], w->tokens + s[1],
                      (Py_ssize_t)s[2], limit, w->rows + s[0] * w->words,
                      lw.stopped + nodes + 1, NULL, accepted, counts) != 0)
            failed = b;
        w->checked += (Py_ssize_t)counts[0];
        w->rejected += (Py_ssize_t)counts[1];
        lap(&w->times[b], &began);
    }
    if (failed >= 0) *error = take_error();
    PyMem_Free(lw.stopped);
    Py_XDECREF(lw.one);
    Py_XDECREF(lw.nbytes);
    return failed;
}

/* The walk's private copies of the tokens and links ([n, nodes] each: `chain` links made
   here), checked to form trees: 1, 0 when they do not (no error set), -1 with an error set. */
static int llg_copies(Walk *w, Array *a, int chain, Py_ssize_t n, Py_ssize_t nodes) {
    Py_ssize_t rows = n * nodes;
    for (Py_ssize_t b = 0; b < n; b++) walk_span(w, b, b * nodes, b * nodes, nodes);
    if (walk_copy_tokens(w, a[2].view.buf, rows) != 0) return -1;
    if (!chain) {
        if (walk_copy_links(w, a[0].view.buf, a[1].view.buf, rows) != 0) return -1;
        return walk_links_valid(w);
    }
    w->next_token = PyMem_Malloc(sizeof(int64_t) * (size_t)rows);
    w->next_sibling = PyMem_Malloc(sizeof(int64_t) * (size_t)rows);
    if (w->next_token == NULL || w->next_sibling == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t b = 0; b < n; b++)
        llg_chain_links(w->next_token + b * nodes, w->next_sibling + b * nodes, nodes);
    return 1;
}

/* llguidance_masks once the arrays are held: the matchers checked, the copies made, the
   outputs made, the matchers held, every request walked, the build counted. */
static PyObject *llg_masks_built(Walk *w, PyObject *const *gs, Array *a, int chain,
                                 Py_ssize_t n, int64_t vocab, PyObject *out, int want_valid,
                                 PyObject *type, PyObject *widths, double threshold) {
    Py_ssize_t nodes = a[2].view.shape[1], rows = n * nodes, words = (Py_ssize_t)((vocab + 31) >> 5);
    PyObject *mask = NULL, *valid = NULL, *result = NULL, *error = NULL;
    int64_t *bounds = PyMem_Calloc((size_t)n, sizeof(int64_t));
    if (bounds == NULL) return PyErr_NoMemory();
    int ok = llg_matchers(w, gs, n, type, widths, words, bounds);
    if (ok > 0) ok = llg_copies(w, a, chain, n, nodes);
    if (ok > 0) ok = build_outputs(w, out, rows, n, nodes, want_valid, &mask, &valid);
    if (ok > 0) ok = walk_hold(w);
    if (ok > 0 && walk_timed(w) != 0) ok = -1;
    if (ok <= 0) {
        result = ok < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    w->limit = vocab;
    struct timespec began;
    double seconds;
    clock_gettime(CLOCK_MONOTONIC, &began);
    Py_ssize_t failed = llg_walk_all(w, nodes, bounds, &error);
    lap(&seconds, &began);
    if (failed >= 0) {
        result = Py_BuildValue("OOnOO", mask, valid, failed, error ? error : Py_None, Py_None);
        goto done;
    }
    PyObject *slow = slow_walks(w, threshold);
    if (slow != NULL && count_build(w, rows, seconds) == 0)
        result = Py_BuildValue("OOnON", mask, valid, (Py_ssize_t)-1, Py_None, slow);
    else
        Py_XDECREF(slow);
done:
    PyMem_Free(bounds);
    Py_XDECREF(error);
    Py_XDECREF(valid);
    Py_XDECREF(mask);
    return result;
}

static PyObject *llguidance_masks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *grammars, *objs[3], *vocab_obj, *out, *type, *widths;
    int want_valid;
    double threshold;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOOOOOpOO!d", &grammars, &objs[0], &objs[1], &objs[2],
                          &vocab_obj, &out, &want_valid, &type, &PyDict_Type, &widths,
                          &threshold))
        return NULL;
    if (intern_llguidance_names() != 0 ||
        (s_words == NULL && (s_words = PyUnicode_InternFromString("words")) == NULL) ||
        (s_vocab_size == NULL &&
         (s_vocab_size = PyUnicode_InternFromString("vocab_size")) == NULL))
        return NULL;
    PyObject *const *gs = sequence_items(grammars, &n);
    long long vocab = plain_vocab(vocab_obj);
    int chain = objs[0] == Py_None && objs[1] == Py_None;
    if (!env_ready() || n <= 0 || vocab < 0) Py_RETURN_NONE;
    Array a[3] = {0};
    for (int i = chain ? 2 : 0; i < 3; i++) {
        if (array_get(objs[i], &a[i], 0, 'i', 8, 2, "tree") != 0 ||
            a[i].view.shape[0] != n || a[i].view.shape[1] != a[chain ? 2 : 0].view.shape[1] ||
            a[i].view.shape[1] < 1) {
            PyErr_Clear();
            for (int j = 0; j <= i; j++) array_release(&a[j]);
            Py_RETURN_NONE;
        }
    }
    Walk w;
    walk_init(&w, WALK_TREES);
    Py_INCREF(grammars); /* its items are read until every matcher is held */
    PyObject *result = llg_masks_built(&w, gs, a, chain, n, vocab, out, want_valid, type, widths,
                                       threshold);
    Py_DECREF(grammars);
    walk_clear(&w);
    for (int i = 0; i < 3; i++) array_release(&a[i]);
    return result;
}
