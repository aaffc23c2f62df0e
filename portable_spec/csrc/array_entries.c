/* The entries over plain arrays (no grammar engine): link checks, row repairs and copies,
   llguidance's written-rows pass. Arrays are held for the whole call; the kernels bound every
   index where they use it, and what is checked before the GIL is released and read again
   after (spans) is a private copy. */

static PyObject *links_valid(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *nt_obj, *ns_obj;
    if (!PyArg_ParseTuple(args, "OO", &nt_obj, &ns_obj)) return NULL;
    Array nt, ns;
    if (array_get(nt_obj, &nt, 0, 'i', 8, 2, "next_token") != 0) return NULL;
    if (array_get(ns_obj, &ns, 0, 'i', 8, 2, "next_sibling") != 0) {
        array_release(&nt);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t batch = nt.view.shape[0], n = nt.view.shape[1];
    void *scratch = NULL;
    if (ns.view.shape[0] != batch || ns.view.shape[1] != n || n < 1) {
        PyErr_SetString(PyExc_ValueError, "links must be [batch, nodes] arrays of one shape");
    } else if ((scratch = PyMem_Malloc((size_t)n * (2 * sizeof(int32_t) + 1))) == NULL) {
        PyErr_NoMemory();
    } else {
        int ok = 1;
        int32_t *indegree = (int32_t *)scratch, *queue = indegree + n;
        uint8_t *seen = (uint8_t *)(queue + n);
        const int64_t *a = (const int64_t *)nt.view.buf, *b = (const int64_t *)ns.view.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < batch && ok; r++)
            ok = ps_links_valid(a + r * n, b + r * n, n, indegree, queue, seen);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(ok);
    }
    PyMem_Free(scratch);
    array_release(&ns);
    array_release(&nt);
    return result;
}

/* tree_matches(next_token, next_sibling, draft, select, parents, tokens) -> bool: whether the
   verify trees ([batch, m] links, tokens, selection) are the selected subtrees of the drafted
   trees ([batch, n] parents, tokens): links checked, then ps_same_tree per request. */
static PyObject *tree_matches(PyObject *self, PyObject *args) {
    (void)self;
    static const char *names[6] = {"next_token", "next_sibling", "draft", "select", "parents",
                                   "tokens"};
    PyObject *objs[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5]))
        return NULL;
    Array a[6] = {0};
    PyObject *result = NULL;
    void *scratch = NULL;
    for (int i = 0; i < 6; i++)
        if (array_get(objs[i], &a[i], 0, 'i', 8, 2, names[i]) != 0) goto done;
    Py_ssize_t batch = a[0].view.shape[0], m = a[0].view.shape[1], n = a[4].view.shape[1];
    for (int i = 0; i < 6; i++) {
        Py_ssize_t width = i < 4 ? m : n;
        if (a[i].view.shape[0] != batch || a[i].view.shape[1] != width) {
            PyErr_SetString(PyExc_ValueError,
                            "tree_matches: links, draft and select [batch, m], parents and "
                            "tokens [batch, n]");
            goto done;
        }
    }
    if (m < 1 || n < 1) {
        PyErr_SetString(PyExc_ValueError, "tree_matches: trees need a root");
        goto done;
    }
    size_t bytes = (size_t)m * (2 * sizeof(int32_t) + 1 + sizeof(int64_t)) +
                   (size_t)n * sizeof(int64_t) + sizeof(int64_t);
    if ((scratch = PyMem_Malloc(bytes)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *above = (int64_t *)scratch, *position = above + m;
    int32_t *indegree = (int32_t *)(position + n), *queue = indegree + m;
    uint8_t *seen = (uint8_t *)(queue + m);
    const int64_t *p[6];
    for (int i = 0; i < 6; i++) p[i] = (const int64_t *)a[i].view.buf;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < batch && ok; r++) {
        const int64_t *nt = p[0] + r * m, *ns = p[1] + r * m;
        ok = ps_links_valid(nt, ns, m, indegree, queue, seen) &&
             ps_same_tree(nt, ns, p[2] + r * m, p[3] + r * m, m, p[4] + r * n, p[5] + r * n, n,
                          above, position);
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyMem_Free(scratch);
    for (int i = 0; i < 6; i++) array_release(&a[i]);
    return result;
}

/* selection_valid(select, parents, n) -> bool: whether every request's selection ([batch, m])
   of its drafted tree ([batch, capacity] parents, nodes below n) is a verify tree's. */
static PyObject *selection_valid(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sel_obj, *par_obj;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOn", &sel_obj, &par_obj, &n)) return NULL;
    Array sel = {0}, par = {0};
    PyObject *result = NULL;
    uint8_t *count = NULL;
    if (array_get(sel_obj, &sel, 0, 'i', 8, 2, "select") != 0 ||
        array_get(par_obj, &par, 0, 'i', 8, 2, "parents") != 0)
        goto done;
    Py_ssize_t batch = sel.view.shape[0], m = sel.view.shape[1], cap = par.view.shape[1];
    if (par.view.shape[0] != batch || n < 1 || n > cap || m < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "selection_valid: select [batch, m], parents [batch, capacity], "
                        "0 < n <= capacity");
        goto done;
    }
    if ((count = PyMem_Malloc((size_t)n)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *s = (const int64_t *)sel.view.buf, *p = (const int64_t *)par.view.buf;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < batch && ok; r++)
        ok = ps_selection_valid(s + r * m, m, p + r * cap, n, count);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyMem_Free(count);
    array_release(&par);
    array_release(&sel);
    return result;
}

/* The arguments of repair_rows and keep_rows, held. */
typedef struct {
    Array rows, nt, ns, dt, stops;
    long long limit;
    int root_ok;
} RowArgs;

static void row_args_release(RowArgs *a) {
    array_release(&a->stops);
    array_release(&a->dt);
    array_release(&a->ns);
    array_release(&a->nt);
    array_release(&a->rows);
}

static int row_args_get(PyObject *const objs[5], int writable, RowArgs *a) {
    static const char *names[4] = {"next_token", "next_sibling", "draft", "stop_ids"};
    Array *arrays[4] = {&a->nt, &a->ns, &a->dt, &a->stops};
    if (array_get(objs[0], &a->rows, writable, 'i', 4, 2, "rows") != 0) return -1;
    for (int i = 0; i < 4; i++) {
        if (array_get(objs[i + 1], arrays[i], 0, 'i', 8, 1, names[i]) != 0) {
            while (i-- > 0) array_release(arrays[i]);
            array_release(&a->rows);
            return -1;
        }
    }
    Py_ssize_t n = a->rows.view.shape[0], words = a->rows.view.shape[1];
    if (a->nt.view.shape[0] != n || a->ns.view.shape[0] != n || a->dt.view.shape[0] != n ||
        n < 1 || a->limit > (long long)words * 32) {
        PyErr_SetString(PyExc_ValueError, "repair_rows: inconsistent shapes or limit");
        row_args_release(a);
        return -1;
    }
    return 0;
}

/* decide (and with `out` NULL, repair) one request's rows: the work of repair_rows and
   keep_rows, the GIL released. */
static PyObject *rows_decided(RowArgs *a, uint8_t *valid, int32_t *out) {
    Py_ssize_t n = a->rows.view.shape[0], words = a->rows.view.shape[1];
    void *scratch = PyMem_Malloc((size_t)n * (sizeof(int32_t) + 1));
    if (scratch == NULL) return PyErr_NoMemory();
    int32_t *queue = (int32_t *)scratch, *rows = (int32_t *)a->rows.view.buf;
    uint8_t *keep = (uint8_t *)(queue + n);
    const int64_t *nt = a->nt.view.buf, *ns = a->ns.view.buf, *dt = a->dt.view.buf;
    const int64_t *stops = a->stops.view.buf;
    Py_ssize_t nstops = a->stops.view.shape[0], kept, checked, rejected;
    Py_BEGIN_ALLOW_THREADS
    if (out == NULL) {
        kept = ps_repair_tree(rows, n, words, nt, ns, dt, a->limit, stops, nstops, a->root_ok,
                              queue, keep, valid, &checked, &rejected);
    } else {
        kept = ps_decide_rows(rows, n, words, nt, ns, dt, a->limit, stops, nstops, a->root_ok,
                              queue, keep, NULL, &checked, &rejected);
        Py_ssize_t k = 0;
        for (Py_ssize_t v = 0; v < n; v++)
            if (keep[v]) out[k++] = (int32_t)v;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(scratch);
    return Py_BuildValue("nnn", kept, checked, rejected);
}

static PyObject *repair_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[5], *valid_obj = Py_None;
    RowArgs a;
    if (!PyArg_ParseTuple(args, "OOOOLOi|O", &objs[0], &objs[1], &objs[2], &objs[3], &a.limit,
                          &objs[4], &a.root_ok, &valid_obj) ||
        row_args_get(objs, 1, &a) != 0)
        return NULL;
    Array valid = {0};
    PyObject *result = NULL;
    if (valid_obj == Py_None || array_flags(valid_obj, &valid, a.rows.view.shape[0]) == 0)
        result = rows_decided(&a, valid.held ? (uint8_t *)valid.view.buf : NULL, NULL);
    array_release(&valid);
    row_args_release(&a);
    return result;
}

static PyObject *keep_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[5], *kept_obj;
    RowArgs a;
    if (!PyArg_ParseTuple(args, "OOOOLOiO", &objs[0], &objs[1], &objs[2], &objs[3], &a.limit,
                          &objs[4], &a.root_ok, &kept_obj) ||
        row_args_get(objs, 0, &a) != 0)
        return NULL;
    Array out;
    PyObject *result = NULL;
    if (array_get(kept_obj, &out, 1, 'i', 4, 1, "kept") == 0) {
        if (out.view.shape[0] < a.rows.view.shape[0])
            PyErr_SetString(PyExc_ValueError, "keep_rows: kept must have room for every node");
        else
            result = rows_decided(&a, NULL, (int32_t *)out.view.buf);
        array_release(&out);
    }
    row_args_release(&a);
    return result;
}

static PyObject *take_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src_obj, *index_obj, *dest_obj, *numbers_obj = Py_None;
    Py_ssize_t base = 0;
    if (!PyArg_ParseTuple(args, "OOO|On", &src_obj, &index_obj, &dest_obj, &numbers_obj, &base))
        return NULL;
    Array src = {0}, index = {0}, dest = {0}, numbers = {0};
    PyObject *result = NULL;
    if (array_get(src_obj, &src, 0, 'i', 4, 2, "source") != 0 ||
        array_get(index_obj, &index, 0, 'i', 4, 1, "index") != 0 ||
        array_get(dest_obj, &dest, 1, 'i', 4, 2, "dest") != 0 ||
        (numbers_obj != Py_None &&
         array_get(numbers_obj, &numbers, 1, 'i', 4, 1, "numbers") != 0))
        goto done;
    Py_ssize_t n = src.view.shape[0], k = index.view.shape[0];
    const int32_t *which = (const int32_t *)index.view.buf;
    int ok = dest.view.shape[0] == k && (!numbers.held || numbers.view.shape[0] == k);
    ok = ok && base >= 0 && base + n <= INT32_MAX;
    for (Py_ssize_t i = 0; ok && i < k; i++) ok = which[i] >= 0 && which[i] < n;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError,
                        "take_rows: dest (and numbers) need one row per index, every index a "
                        "source row");
        goto done;
    }
    int32_t *to = (int32_t *)dest.view.buf, *numbered = numbers.held ? numbers.view.buf : NULL;
    Py_ssize_t src_words = src.view.shape[1], dest_words = dest.view.shape[1];
    Py_BEGIN_ALLOW_THREADS
    ps_take_rows((const int32_t *)src.view.buf, n, src_words, which, k, to, dest_words);
    for (Py_ssize_t i = 0; numbered != NULL && i < k; i++)
        numbered[i] = (int32_t)(which[i] + base);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    array_release(&numbers);
    array_release(&dest);
    array_release(&index);
    array_release(&src);
    return result;
}

/* A span table as a private PyMem copy of chains * `columns` int64: from a C-contiguous int64
   [chains, columns] array, or from a list of tuples of `columns` exact ints (cheaper to make
   for a few chains than an array; an int subclass, whose __index__ could run Python code, is
   refused). NULL with a ValueError naming `name` on anything else. */
static int64_t *read_spans(PyObject *obj, Py_ssize_t columns, Py_ssize_t *chains,
                           const char *name) {
    if (PyList_CheckExact(obj)) {
        Py_ssize_t n = PyList_GET_SIZE(obj);
        int64_t *out = PyMem_Malloc(sizeof(int64_t) * (size_t)(columns * (n > 0 ? n : 1)));
        if (out == NULL) return (int64_t *)PyErr_NoMemory();
        for (Py_ssize_t c = 0; c < n; c++) {
            PyObject *item = PyList_GET_ITEM(obj, c);
            int ok = PyTuple_CheckExact(item) && PyTuple_GET_SIZE(item) == columns;
            for (Py_ssize_t k = 0; ok && k < columns; k++)
                ok = exact_int(PyTuple_GET_ITEM(item, k), &out[columns * c + k]) == 0;
            if (!ok) {
                PyMem_Free(out);
                PyErr_Format(PyExc_ValueError, "%s: spans out of bounds or malformed", name);
                return NULL;
            }
        }
        *chains = n;
        return out;
    }
    Array spans;
    if (array_get(obj, &spans, 0, 'i', 8, 2, "spans") != 0) return NULL;
    int64_t *out = NULL;
    if (spans.view.shape[1] != columns)
        PyErr_Format(PyExc_ValueError, "%s: spans out of bounds or malformed", name);
    else if ((out = copy_int64(spans.view.buf, columns * spans.view.shape[0])) != NULL)
        *chains = spans.view.shape[0];
    array_release(&spans);
    return out;
}

static PyObject *repair_chains(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows_obj, *tokens_obj, *spans_obj, *stops_obj;
    long long limit;
    int repeat;
    if (!PyArg_ParseTuple(args, "OOOLOi", &rows_obj, &tokens_obj, &spans_obj, &limit, &stops_obj,
                          &repeat))
        return NULL;
    Array rows = {0}, tokens = {0}, stops = {0};
    int64_t *sp = NULL;
    Py_ssize_t chains = 0;
    PyObject *result = NULL;
    if (array_get(rows_obj, &rows, 1, 'i', 4, 2, "rows") != 0 ||
        array_get(tokens_obj, &tokens, 0, 'i', 8, 1, "tokens") != 0 ||
        (sp = read_spans(spans_obj, 4, &chains, "repair_chains")) == NULL ||
        array_get(stops_obj, &stops, 0, 'i', 8, 1, "stop_ids") != 0)
        goto done;
    Py_ssize_t nrows = rows.view.shape[0], words = rows.view.shape[1];
    Py_ssize_t ntok = tokens.view.shape[0];
    int bad = limit > (long long)words * 32;
    for (Py_ssize_t c = 0; c < chains && !bad; c++) {
        int64_t r = sp[4 * c], t = sp[4 * c + 1], n = sp[4 * c + 2];
        bad = r < 0 || t < 0 || n < 1 || r > nrows - n || t > ntok - n;
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "repair_chains: spans out of bounds or malformed");
        goto done;
    }
    Py_ssize_t checked = 0, rejected = 0;
    int32_t *mask = (int32_t *)rows.view.buf;
    const int64_t *tok = tokens.view.buf, *stop = stops.view.buf;
    Py_ssize_t nstops = stops.view.shape[0];
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < chains; c++)
        ps_repair_chain(mask + sp[4 * c] * words, tok + sp[4 * c + 1], (Py_ssize_t)sp[4 * c + 2],
                        words, sp[4 * c + 3] != 0, limit, stop, nstops, repeat, NULL, &checked,
                        &rejected);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nn", checked, rejected);
done:
    array_release(&stops);
    PyMem_Free(sp);
    array_release(&tokens);
    array_release(&rows);
    return result;
}

/* chain_live's arguments, held. */
typedef struct {
    Array target, rows, tokens, usable, ended, ends;
} LiveArgs;

static void live_args_release(LiveArgs *a) {
    array_release(&a->ends);
    array_release(&a->ended);
    array_release(&a->usable);
    array_release(&a->tokens);
    array_release(&a->rows);
    array_release(&a->target);
}

static int live_args_get(PyObject *const objs[6], LiveArgs *a) {
    memset(a, 0, sizeof(*a));
    if (array_get(objs[0], &a->target, 0, 'i', 4, 2, "target") != 0 ||
        array_get(objs[1], &a->rows, 0, 'i', 8, 2, "rows") != 0 ||
        array_get(objs[2], &a->tokens, 0, 'i', 8, 2, "tokens") != 0 ||
        array_get(objs[3], &a->usable, 0, 'i', 8, 1, "usable") != 0 ||
        array_flags(objs[4], &a->ended, a->rows.view.shape[0]) != 0 ||
        array_get(objs[5], &a->ends, 0, '?', 1, 2, "ends") != 0) {
        live_args_release(a);
        return -1;
    }
    Py_ssize_t count = a->rows.view.shape[0], nodes = a->rows.view.shape[1];
    if (a->tokens.view.shape[0] != count || a->tokens.view.shape[1] != nodes - 1 ||
        a->ends.view.shape[0] != count || a->ends.view.shape[1] != nodes - 1 ||
        a->usable.view.shape[0] != count || a->target.view.shape[1] < 1) {
        PyErr_SetString(PyExc_ValueError, "chain_live: rows [count, nodes], tokens and ends "
                                          "[count, nodes - 1], usable and ended [count]");
        live_args_release(a);
        return -1;
    }
    const int64_t *row = a->rows.view.buf;
    for (Py_ssize_t j = 0; j < count * nodes; j++) {
        if (row[j] < 0 || row[j] >= a->target.view.shape[0]) {
            PyErr_SetString(PyExc_ValueError, "chain_live: a row index is outside target");
            live_args_release(a);
            return -1;
        }
    }
    return 0;
}

/* Row `index` of target, or NULL when it is outside (read once: the objects chain_live makes
   may run Python code, and another thread with it). */
static const int32_t *target_row(const LiveArgs *a, int64_t index) {
    if (index < 0 || index >= a->target.view.shape[0]) return NULL;
    return (const int32_t *)a->target.view.buf + index * a->target.view.shape[1];
}

/* Request k's live drafts (before the first its parent's row refuses, at most usable[k]). */
static Py_ssize_t live_drafts(const LiveArgs *a, Py_ssize_t k) {
    Py_ssize_t nodes = a->rows.view.shape[1], drafts = nodes - 1;
    const int64_t *r = (const int64_t *)a->rows.view.buf + k * nodes;
    const int64_t *d = (const int64_t *)a->tokens.view.buf + k * drafts;
    int64_t usable = ((const int64_t *)a->usable.view.buf)[k];
    Py_ssize_t width = a->target.view.shape[1];
    for (Py_ssize_t i = 0; i < drafts; i++) {
        const int32_t *parent = target_row(a, r[i]);
        if (i >= usable || parent == NULL || !ps_row_allows(parent, d[i], width)) return i;
    }
    return drafts;
}

static PyObject *chain_live(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[6];
    int first_word, last_word;
    LiveArgs a;
    if (!PyArg_ParseTuple(args, "OOOOOOii", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &first_word, &last_word) ||
        live_args_get(objs, &a) != 0)
        return NULL;
    Py_ssize_t count = a.rows.view.shape[0], nodes = a.rows.view.shape[1];
    Py_ssize_t width = a.target.view.shape[1];
    PyObject *live = PyList_New(count), *checks = PyList_New(0), *result = NULL;
    if (live == NULL || checks == NULL) goto done;
    const uint8_t *stopped = (const uint8_t *)a.ended.view.buf;
    const uint8_t *ends = (const uint8_t *)a.ends.view.buf;
    for (Py_ssize_t k = 0; k < count; k++) {
        Py_ssize_t n = live_drafts(&a, k);
        PyObject *value = PyLong_FromSsize_t(n);
        if (value == NULL) goto done;
        PyList_SET_ITEM(live, k, value);
        if (stopped[k]) continue;
        const int64_t *r = (const int64_t *)a.rows.view.buf + k * nodes;
        const uint8_t *end_of = ends + k * (nodes - 1);
        for (Py_ssize_t i = 0; i < n; i++) { /* drafts to decide on a fork */
            const int32_t *own = target_row(&a, r[i + 1]);
            if (own == NULL) continue;
            int intact = own[0] == first_word && own[width - 1] == last_word;
            int end = end_of[i] != 0;
            if (!intact && !end) continue;
            PyObject *item = Py_BuildValue("nnOO", k, i, intact ? Py_True : Py_False,
                                           end ? Py_True : Py_False);
            if (item == NULL || PyList_Append(checks, item) != 0) {
                Py_XDECREF(item);
                goto done;
            }
            Py_DECREF(item);
        }
    }
    result = PyTuple_Pack(2, live, checks);
done:
    Py_XDECREF(live);
    Py_XDECREF(checks);
    live_args_release(&a);
    return result;
}
