/* The entries that walk xgrammar matchers over the caller's arrays: one request's traversal
   (the general build's), and tables of chains or trees (the builds that hand their own rows
   and tokens). Each fills a Walk (walk.c) and runs it. */

/* Every matcher of `matchers` (a list or tuple of `count` entries, each None or an xgrammar
   matcher the facts table knows at `words` words) made the walk's. 0, or -1 with an error
   naming the first that is not. */
static int walk_matchers(Walk *w, PyObject *matchers, Py_ssize_t words, const char *name) {
    Py_ssize_t n;
    PyObject *const *items = sequence_items(matchers, &n);
    if (n != w->count) {
        PyErr_Format(PyExc_TypeError, "%s: matchers must be a list with one entry per span",
                     name);
        return -1;
    }
    for (Py_ssize_t c = 0; c < n; c++) {
        Facts f;
        PyObject *g = items[c];
        if (g == Py_None) continue;
        int known = walk_known(w, c, g, words, &f);
        if (known < 0) return -1;
        if (known == 0) {
            PyErr_Format(PyExc_TypeError,
                         "%s: matchers[%zd] is not an xgrammar matcher the library has probed "
                         "at %zd words",
                         name, c, words);
            return -1;
        }
    }
    return 0;
}

static PyObject *xgrammar_traverse(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *matcher, *objs[4];
    if (!PyArg_ParseTuple(args, "OOOOO", &matcher, &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    if (ffi_bound() != 0) return NULL;
    static const char *names[3] = {"next_token", "next_sibling", "draft"};
    Array a[4] = {0};
    Walk w;
    walk_init(&w, WALK_TRAVERSE);
    PyObject *result = NULL;
    for (int i = 0; i < 3; i++)
        if (array_get(objs[i], &a[i], 0, 'i', 8, 1, names[i]) != 0) goto done;
    if (array_get(objs[3], &a[3], 1, 'i', 4, 2, "rows") != 0) goto done;
    Py_ssize_t n = a[0].view.shape[0], words = a[3].view.shape[1];
    if (a[1].view.shape[0] != n || a[2].view.shape[0] != n || a[3].view.shape[0] != n || n < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "xgrammar_traverse: links, tokens and rows differ in length");
        goto done;
    }
    Facts f;
    if (walk_reserve(&w, 1) != 0) goto done;
    int known = walk_known(&w, 0, matcher, words, &f);
    if (known <= 0) {
        result = known < 0 ? NULL : Py_NewRef(Py_None); /* None: xgrammar's binding does it */
        goto done;
    }
    walk_span(&w, 0, 0, 0, n);
    w.words = words;
    w.rows = (int32_t *)a[3].view.buf;
    if (walk_copy_tokens(&w, a[2].view.buf, n) != 0 ||
        walk_copy_links(&w, a[0].view.buf, a[1].view.buf, n) != 0)
        goto done;
    int valid = walk_links_valid(&w);
    if (valid == 0)
        PyErr_SetString(PyExc_ValueError, "xgrammar_traverse: the links do not form a tree");
    if (valid <= 0 || walk_run(&w) != 0) goto done;
    if (w.failed >= 0)
        PyErr_SetString(PyExc_RuntimeError, w.error != NULL ? w.error : "xgrammar failed");
    else
        result = PyBool_FromLong(w.live[0]);
done:
    walk_clear(&w);
    for (int i = 0; i < 4; i++) array_release(&a[i]);
    return result;
}

/* The arguments walk_chains and walk_trees share, held. */
typedef struct {
    Array rows, valid, seconds;
} TableOut;

static void table_out_release(TableOut *o) {
    array_release(&o->seconds);
    array_release(&o->valid);
    array_release(&o->rows);
}

/* walk_chains' and walk_trees' common part, their tokens (and links) already copied into `w`:
   spans, matchers, stops and outputs read, the walk held when `hold`, run. */
static PyObject *walk_table(Walk *w, PyObject *rows_obj, PyObject *spans_obj,
                            PyObject *matchers, PyObject *stops, PyObject *valid_obj,
                            PyObject *seconds_obj, int hold, const char *name) {
    TableOut o;
    memset(&o, 0, sizeof(o));
    PyObject *result = NULL;
    Py_ssize_t chains = 0;
    int64_t *sp = NULL;
    if (ffi_bound() != 0) return NULL;
    if (array_get(rows_obj, &o.rows, 1, 'i', 4, 2, "rows") != 0 ||
        (sp = read_spans(spans_obj, 3, &chains, name)) == NULL || walk_reserve(w, chains) != 0)
        goto done;
    Py_ssize_t nrows = o.rows.view.shape[0];
    w->words = o.rows.view.shape[1];
    for (Py_ssize_t c = 0; c < chains; c++) walk_span(w, c, sp[3 * c], sp[3 * c + 1], sp[3 * c + 2]);
    if (!walk_spans_fit(w, nrows, 0) || w->limit > (long long)w->words * 32) {
        PyErr_Format(PyExc_ValueError, "%s: spans out of bounds or malformed", name);
        goto done;
    }
    int links = w->kind == WALK_CHAINS ? 1 : walk_links_valid(w);
    if (links <= 0) {
        if (links == 0) PyErr_Format(PyExc_ValueError, "%s: links that do not form trees", name);
        goto done;
    }
    if (walk_matchers(w, matchers, w->words, name) != 0 || walk_copy_stops(w, stops) != 0 ||
        (valid_obj != Py_None && array_flags(valid_obj, &o.valid, nrows) != 0) ||
        (seconds_obj != Py_None && array_seconds(seconds_obj, &o.seconds, chains) != 0))
        goto done;
    int held = hold ? walk_hold(w) : 1;
    if (held <= 0) {
        result = held < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    w->rows = (int32_t *)o.rows.view.buf;
    w->flags = o.valid.held ? (uint8_t *)o.valid.view.buf : NULL;
    w->times = o.seconds.held ? (double *)o.seconds.view.buf : NULL;
    if (walk_run(w) == 0) result = walk_outcome(w, NULL);
done:
    PyMem_Free(sp);
    table_out_release(&o);
    return result;
}

static PyObject *walk_chains(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows, *tokens_obj, *spans, *matchers, *stops, *valid = Py_None, *seconds = Py_None;
    long long limit;
    int repeat, hold = 1;
    if (!PyArg_ParseTuple(args, "OOOOLOi|OOp", &rows, &tokens_obj, &spans, &matchers, &limit,
                          &stops, &repeat, &valid, &seconds, &hold))
        return NULL;
    Walk w;
    walk_init(&w, WALK_CHAINS);
    w.limit = limit;
    w.repeat = repeat;
    Array tokens;
    if (array_get(tokens_obj, &tokens, 0, 'i', 8, 1, "tokens") != 0) return NULL;
    PyObject *result = NULL;
    if (walk_copy_tokens(&w, tokens.view.buf, tokens.view.shape[0]) == 0)
        result = walk_table(&w, rows, spans, matchers, stops, valid, seconds, hold, "walk_chains");
    walk_clear(&w);
    array_release(&tokens);
    return result;
}

static PyObject *walk_trees(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows, *objs[3], *spans, *matchers, *stops, *valid = Py_None, *seconds = Py_None;
    long long limit;
    int hold = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOLO|OOp", &rows, &objs[0], &objs[1], &objs[2], &spans,
                          &matchers, &limit, &stops, &valid, &seconds, &hold))
        return NULL;
    static const char *names[3] = {"next_token", "next_sibling", "tokens"};
    Array a[3] = {0};
    Walk w;
    walk_init(&w, WALK_TREES);
    w.limit = limit;
    PyObject *result = NULL;
    for (int i = 0; i < 3; i++)
        if (array_get(objs[i], &a[i], 0, 'i', 8, 1, names[i]) != 0) goto done;
    Py_ssize_t n = a[2].view.shape[0];
    if (a[0].view.shape[0] != n || a[1].view.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "walk_trees: spans out of bounds or malformed");
        goto done;
    }
    if (walk_copy_tokens(&w, a[2].view.buf, n) == 0 &&
        walk_copy_links(&w, a[0].view.buf, a[1].view.buf, n) == 0)
        result = walk_table(&w, rows, spans, matchers, stops, valid, seconds, hold, "walk_trees");
done:
    walk_clear(&w);
    for (int i = 0; i < 3; i++) array_release(&a[i]);
    return result;
}
