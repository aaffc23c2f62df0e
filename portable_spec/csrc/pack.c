/* An engine's per-request draft lists packed into a walk: each request's chain (its root 0,
   then its drafts) into the walk's own token array, the rows no grammar walks written
   (requests without a grammar, padding rows, the free rows of a request still reasoning), and
   one walk entry per request whose grammar has a chain to walk. */

typedef struct {
    PyObject *const *requests; /* the draft lists: borrowed items of a held list or tuple */
    Py_ssize_t n, stride;      /* stride 0: chains back to back; else request b at b * stride */
    int64_t vocab;             /* reasoning: a draft outside [0, vocab) ends the chain */
    PyObject *active;          /* reasoning: a list of n bools (still reasoning), or None */
    const int64_t *ends;       /* reasoning: the tokens that end it */
    Py_ssize_t nends;
    int plain;                 /* decline negative drafts (an engine's padding) */
    Py_ssize_t ntokens, rows, walked; /* made by pack_check / pack_fill */
} Pack;

/* The first pass, nothing written: 1 when every draft list is a list or tuple of exact ints
   inside int64 (none negative with `plain`), every chain fits its stride, every flag is a
   bool and the totals fit a Py_ssize_t; then p->ntokens and p->rows are set. 0 otherwise (no
   error set). Runs no Python code. */
static int pack_check(Pack *p, PyObject *drafts) {
    Py_ssize_t n;
    p->requests = sequence_items(drafts, &n);
    if (n < 0 || n != p->n || p->stride < 0) return 0;
    if (p->active != Py_None &&
        (!PyList_CheckExact(p->active) || PyList_GET_SIZE(p->active) != n))
        return 0;
    p->ntokens = p->rows = 0;
    for (Py_ssize_t b = 0; b < n; b++) {
        Py_ssize_t k;
        PyObject *const *items = sequence_items(p->requests[b], &k);
        if (k < 0 || (p->stride && k + 1 > p->stride)) return 0;
        if (p->active != Py_None) {
            PyObject *flag = PyList_GET_ITEM(p->active, b);
            if (flag != Py_True && flag != Py_False) return 0;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            int64_t value;
            if (exact_int(items[j], &value) != 0 || (p->plain && value < 0)) return 0;
        }
        /* totals summed without overflow: a total past what a Py_ssize_t holds declines */
        Py_ssize_t span = p->stride ? p->stride : k + 1;
        if (k + 1 > PY_SSIZE_T_MAX - p->ntokens || span > PY_SSIZE_T_MAX - p->rows) return 0;
        p->ntokens += k + 1;
        p->rows += span;
    }
    return 1;
}

/* Request b still reasoning: its free rows written up to its first end token, whose row
   starts its grammar's chain; returns that token's index in the chain, or -1 when none comes
   (a draft outside the vocabulary ends the chain: later rows all-allowed, not accepted). */
static Py_ssize_t pack_reasoning(const Pack *p, const int64_t *chain, Py_ssize_t nodes,
                                 int32_t *mask, Py_ssize_t words, Py_ssize_t row,
                                 uint8_t *flags) {
    ps_fill_rows(mask, words, row, row + 1, flags, 1);
    for (Py_ssize_t j = 1; j < nodes; j++) {
        int64_t t = chain[j];
        if (t < 0 || t >= p->vocab) {
            ps_fill_rows(mask, words, row + j, row + nodes, flags, 0);
            return -1;
        }
        if (flags != NULL) flags[row + j] = 1;
        for (Py_ssize_t e = 0; e < p->nends; e++)
            if (p->ends[e] == t) return j;
        ps_fill_rows(mask, words, row + j, row + j + 1, flags, 1);
    }
    return -1;
}

/* The second pass (right after pack_check, no Python code run in between): every request's
   chain into w->tokens, the rows no grammar walks written into `mask` (int32 [p->rows, words])
   and `flags` (NULL: none), and the span of each walk entry b that has a matcher and a chain
   (entry b is request b; an entry with nothing to walk keeps 0 nodes). 0, or -1 with
   MemoryError set. */
static int pack_fill(Pack *p, Walk *w, int32_t *mask, Py_ssize_t words, uint8_t *flags) {
    PyMem_Free(w->tokens);
    if ((w->tokens = PyMem_Malloc(sizeof(int64_t) * (size_t)(p->ntokens + 1))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->ntokens = p->ntokens;
    Py_ssize_t pos = 0, row = 0;
    p->walked = 0;
    for (Py_ssize_t b = 0; b < p->n; b++) {
        Py_ssize_t k;
        PyObject *const *items = sequence_items(p->requests[b], &k);
        Py_ssize_t nodes = k + 1, span = p->stride ? p->stride : nodes;
        int64_t *chain = w->tokens + pos;
        chain[0] = 0;
        for (Py_ssize_t j = 0; j < k; j++) exact_int(items[j], &chain[j + 1]);
        if (w->matchers[b] == NULL) { /* no grammar: every row all-allowed, every node accepted */
            ps_fill_rows(mask, words, row, row + span, flags, 1);
        } else {
            ps_fill_rows(mask, words, row + nodes, row + span, flags, 0); /* padding rows */
            Py_ssize_t head = 0;
            if (p->active != Py_None && PyList_GET_ITEM(p->active, b) == Py_True)
                head = pack_reasoning(p, chain, nodes, mask, words, row, flags);
            if (head >= 0) {
                walk_span(w, b, row + head, pos + head, nodes - head);
                p->walked += nodes - head;
            }
        }
        pos += nodes;
        row += span;
    }
    return 0;
}

/* The walk entries that have a chain, as (tokens, table, owners, walked, matchers): the
   walk's tokens (bytes of int64), per walked entry its (first row, first token, nodes)
   (bytes of int64 [chains, 3]), its request (bytes of int64 [chains]), the rows walked and
   the matchers (a list, one per chain): what the caller walks in parts itself. */
static PyObject *pack_table(const Walk *w, const Pack *p) {
    int64_t *table = PyMem_Malloc(sizeof(int64_t) * 4 * (size_t)(w->count + 1));
    PyObject *matchers = PyList_New(0), *result = NULL;
    if (table == NULL || matchers == NULL) {
        if (table == NULL) PyErr_NoMemory();
        goto done;
    }
    int64_t *owners = table + 3 * (w->count + 1);
    Py_ssize_t chains = 0;
    for (Py_ssize_t b = 0; b < w->count; b++) {
        if (w->matchers[b] == NULL || w->spans[3 * b + 2] == 0) continue;
        memcpy(table + 3 * chains, w->spans + 3 * b, 3 * sizeof(int64_t));
        owners[chains++] = b;
        if (PyList_Append(matchers, w->matchers[b]) != 0) goto done;
    }
    result = Py_BuildValue("y#y#y#nO", (const char *)w->tokens,
                           (Py_ssize_t)sizeof(int64_t) * w->ntokens, (const char *)table,
                           (Py_ssize_t)sizeof(int64_t) * 3 * chains, (const char *)owners,
                           (Py_ssize_t)sizeof(int64_t) * chains, p->walked, matchers);
done:
    PyMem_Free(table);
    Py_XDECREF(matchers);
    return result;
}

/* pack_chains' arguments, held. */
typedef struct {
    Array rows, ends, valid, seconds;
} PackArgs;

static void pack_args_release(PackArgs *a) {
    array_release(&a->seconds);
    array_release(&a->valid);
    array_release(&a->ends);
    array_release(&a->rows);
}

/* Each request's matcher (None, or a matcher the facts table knows at `words` words) made
   walk entry b's: 1, 0 when one is neither (no error set), -1 with an error set. */
static int pack_matchers(Walk *w, PyObject *matchers, Py_ssize_t n, Py_ssize_t words) {
    Py_ssize_t count;
    PyObject *const *gs = sequence_items(matchers, &count);
    if (count != n || walk_reserve(w, n) != 0) return PyErr_Occurred() ? -1 : 0;
    w->words = words;
    for (Py_ssize_t b = 0; b < n; b++) {
        Facts f;
        if (gs[b] == Py_None) continue;
        int known = walk_known(w, b, gs[b], words, &f);
        if (known <= 0) return known;
    }
    return 1;
}

/* pack_chains once its arrays are held: packed (no limit) or walked. */
static PyObject *pack_walked(Walk *w, Pack *p, PyObject *drafts, PyObject *matchers,
                             PackArgs *a, PyObject *stops) {
    Py_ssize_t words = a->rows.view.shape[1];
    int known = pack_matchers(w, matchers, p->n, words);
    if (known <= 0) return known < 0 ? NULL : Py_NewRef(Py_None);
    if (w->limit >= 0 && walk_copy_stops(w, stops) != 0) return NULL;
    /* from here on no Python code runs until the lists are packed */
    int held = 1;
    if (!pack_check(p, drafts) || p->rows != a->rows.view.shape[0] ||
        (w->limit >= 0 && (held = walk_hold(w)) <= 0))
        return held < 0 ? NULL : Py_NewRef(Py_None);
    w->rows = (int32_t *)a->rows.view.buf;
    w->flags = a->valid.held ? (uint8_t *)a->valid.view.buf : NULL;
    if (pack_fill(p, w, w->rows, words, w->flags) != 0) return NULL;
    if (w->limit < 0) return pack_table(w, p);
    if (walk_timed(w) != 0 || !walk_spans_fit(w, p->rows, 1) || walk_run(w) != 0) return NULL;
    if (a->seconds.held)
        memcpy(a->seconds.view.buf, w->times, sizeof(double) * (size_t)p->n);
    return walk_outcome(w, NULL);
}

static PyObject *pack_chains(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *drafts, *matchers, *ends_obj, *active, *rows_obj, *valid_obj;
    PyObject *stops = Py_None, *seconds_obj = Py_None;
    Py_ssize_t stride;
    long long vocab, limit = -1;
    int repeat = 0, plain = 0;
    if (!PyArg_ParseTuple(args, "OOnLOOOO|LOOip", &drafts, &matchers, &stride, &vocab, &ends_obj,
                          &active, &rows_obj, &valid_obj, &limit, &stops, &seconds_obj,
                          &repeat, &plain))
        return NULL;
    if (limit >= 0 && ffi_bound() != 0) return NULL;
    Pack p = {0};
    p.stride = stride;
    p.vocab = vocab;
    p.active = active;
    p.plain = plain;
    sequence_items(drafts, &p.n);
    if (p.n < 0) Py_RETURN_NONE;
    PackArgs a;
    memset(&a, 0, sizeof(a));
    Walk w;
    walk_init(&w, WALK_CHAINS);
    w.limit = limit;
    w.repeat = repeat;
    PyObject *result = NULL;
    if (array_get(rows_obj, &a.rows, 1, 'i', 4, 2, "rows") != 0 ||
        array_get(ends_obj, &a.ends, 0, 'i', 8, 1, "ends") != 0 ||
        (valid_obj != Py_None && array_flags(valid_obj, &a.valid, a.rows.view.shape[0]) != 0) ||
        (limit >= 0 && seconds_obj != Py_None && array_seconds(seconds_obj, &a.seconds, p.n) != 0))
        goto done;
    if (limit > (long long)a.rows.view.shape[1] * 32) {
        PyErr_SetString(PyExc_ValueError, "pack_chains: limit past the rows' width");
        goto done;
    }
    p.ends = a.ends.view.buf;
    p.nends = a.ends.view.shape[0];
    result = pack_walked(&w, &p, drafts, matchers, &a, stops);
done:
    walk_clear(&w);
    pack_args_release(&a);
    return result;
}
