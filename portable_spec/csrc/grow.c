/* xgrammar_grow: the rows of the nodes a draft tree just grew, each request's xgrammar matcher
   moved along the tree through its single-step methods (accept_token, fill_next_token_bitmask,
   rollback, is_terminated), the GIL released.

   The tree so far lives in the caller's arrays (a DraftSession's): parents and tokens
   [batch, capacity] int64, rows [batch, capacity, words] int32, valid and live flags
   [batch, capacity]. Nodes below `start` are decided (their rows and live flags are read,
   never refilled); nodes start .. end - 1 are new: each is decided against its parent's row
   and, where the row allows its token, by the matcher, and gets its row (filled when live,
   all-allowed otherwise), its valid flag (the grammar accepts its root path, an end token
   included) and its live flag (accepted and not terminated: children may follow). So a node
   costs one accept and one fill; the matcher visits the parents of the new nodes in
   depth-first order, accepting each ancestor once per call on the way down and rolling back
   on the way up, and is back where it started when the call returns, also after an error.

   With start 0 the root (node 0) is new too: its row is the matcher's own (all-allowed when
   the matcher has ended: valid, not live), no token accepted for it.

   Nothing the walk reads without the GIL belongs to the caller but the rows and flags it
   holds for the call: parents, tokens and the live flags of decided nodes are private
   copies, every index read from them is bounded where it is used. */

typedef struct {
    Walk walk;           /* the matchers (held), their tvm-ffi arguments, the error */
    Py_ssize_t capacity, words, start, end;
    int64_t *requests;   /* [count]: each entry's request (row of the caller's arrays) */
    int64_t *limits;     /* [count]: tokens at or past it are refused */
    int64_t *widths;     /* [count]: each matcher's row width (at most words: zeros past it) */
    int64_t *parents;    /* [count * end]: copies of nodes 0 .. end - 1 */
    int64_t *tokens;     /* [count * end] */
    uint8_t *live;       /* [count * end]: decided nodes' live flags, then the new ones' */
    int32_t *rows;       /* the caller's [batch, capacity, words] */
    uint8_t *valid_out, *live_out; /* the caller's [batch, capacity] */
} Grow;

static void grow_clear(Grow *g) {
    walk_clear(&g->walk);
    PyMem_Free(g->requests);
    PyMem_Free(g->limits);
    PyMem_Free(g->widths);
    PyMem_Free(g->parents);
    PyMem_Free(g->tokens);
    PyMem_Free(g->live);
    memset(g, 0, sizeof(*g));
}

/* The scratch of one entry, end slots each. */
typedef struct {
    int64_t *first, *next; /* children lists (ascending ids) */
    int64_t *rank;         /* depth-first pre-order position, -1 where the root's tree lacks it */
    int64_t *order;        /* the new nodes to decide, sorted by their parent's rank */
    int64_t *path, *held;  /* a parent's root path; the nodes the matcher holds */
} GrowScratch;

static int by_key(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Depth-first pre-order ranks of the tree of entry c (nodes 0 .. end - 1; a node whose parent
   is not an earlier node is outside it). */
static void grow_ranks(const int64_t *parents, Py_ssize_t end, GrowScratch *s) {
    for (Py_ssize_t v = 0; v < end; v++) s->first[v] = s->next[v] = -1, s->rank[v] = -1;
    for (Py_ssize_t v = end - 1; v >= 1; v--) {
        int64_t p = parents[v];
        if (p < 0 || p >= v) continue;
        s->next[v] = s->first[p];
        s->first[p] = v;
    }
    /* s->path is the stack here: each node pushed once */
    Py_ssize_t top = 0, seen = 0;
    s->path[top++] = 0;
    while (top > 0) {
        int64_t v = s->path[--top];
        s->rank[v] = seen++;
        /* push the children last to first, so that the first is ranked next */
        Py_ssize_t mark = top;
        for (int64_t c = s->first[v]; c >= 0; c = s->next[c]) s->path[top++] = c;
        for (Py_ssize_t i = mark, j = top - 1; i < j; i++, j--) {
            int64_t t = s->path[i];
            s->path[i] = s->path[j];
            s->path[j] = t;
        }
    }
}

/* Move the matcher of entry c from the nodes it holds (s->held, *depth of them) to node p
   (its root path held instead). 0, or -1 with w->error set. */
static int grow_move(Grow *g, Py_ssize_t c, int64_t p, GrowScratch *s, Py_ssize_t *depth) {
    const int64_t *parents = g->parents + c * g->end, *tokens = g->tokens + c * g->end;
    Walk *w = &g->walk;
    Py_ssize_t n = 0;
    for (int64_t v = p; v > 0 && n < g->end; v = parents[v]) s->path[n++] = v;
    /* s->path holds p's ancestors bottom-up: reverse into root-down order */
    for (Py_ssize_t i = 0, j = n - 1; i < j; i++, j--) {
        int64_t t = s->path[i];
        s->path[i] = s->path[j];
        s->path[j] = t;
    }
    Py_ssize_t common = 0;
    while (common < *depth && common < n && s->held[common] == s->path[common]) common++;
    if (*depth > common) {
        if (ffi_rollback(&w->args[c], *depth - common, &w->error) != 0) return -1;
        *depth = common;
    }
    for (Py_ssize_t i = common; i < n; i++) {
        int taken = ffi_accept(&w->args[c], tokens[s->path[i]], &w->error);
        if (taken < 0) return -1;
        if (taken == 0) {
            const char *text = "the matcher refused a token of a path it accepted before";
            w->error = malloc(strlen(text) + 1);
            if (w->error != NULL) memcpy(w->error, text, strlen(text) + 1);
            return -1;
        }
        s->held[(*depth)++] = s->path[i];
    }
    return 0;
}

/* Decide entry c's new nodes. 0, or -1 with w->error set (the matcher rolled back to where it
   started as far as xgrammar lets it). No GIL. */
static int grow_entry(Grow *g, Py_ssize_t c, GrowScratch *s) {
    Walk *w = &g->walk;
    Py_ssize_t end = g->end, words = g->words;
    const int64_t *parents = g->parents + c * end, *tokens = g->tokens + c * end;
    uint8_t *live = g->live + c * end;
    int64_t b = g->requests[c], limit = g->limits[c], width = g->widths[c];
    int32_t *rows = g->rows + b * g->capacity * words;
    uint8_t *valid_out = g->valid_out + b * g->capacity, *live_out = g->live_out + b * g->capacity;
    Py_ssize_t count = 0, first = g->start;
    int failed = 0;
    if (first == 0) { /* the root: the matcher's own state, valid; live unless it ended */
        int32_t *row = rows;
        live[0] = live_out[0] = 0;
        valid_out[0] = 1;
        int ended = ffi_is_terminated(&w->args[c], &w->error);
        if (ended < 0) {
            failed = 1;
        } else if (ended) {
            ps_fill_rows(rows, words, 0, 1, NULL, 0);
        } else if (ffi_fill(&w->args[c], row, width, &w->error) != 0) {
            failed = 1;
        } else {
            if (width < words) memset(row + width, 0, (size_t)(words - width) * sizeof(int32_t));
            live[0] = live_out[0] = 1;
        }
        first = 1;
    }
    grow_ranks(parents, end, s);
    for (Py_ssize_t v = first; v < end && !failed; v++) {
        int64_t p = parents[v];
        live[v] = 0;
        valid_out[v] = live_out[v] = 0;
        if (p >= 0 && p < v && s->rank[p] >= 0) s->order[count++] = (s->rank[p] << 32) | v;
        else ps_fill_rows(rows, words, v, v + 1, NULL, 0);
    }
    qsort(s->order, (size_t)count, sizeof(int64_t), by_key);
    Py_ssize_t depth = 0;
    for (Py_ssize_t i = 0; i < count && !failed; i++) {
        int64_t v = s->order[i] & 0xFFFFFFFF, p = parents[v], t = tokens[v];
        int32_t *row = rows + v * words;
        const int32_t *above = rows + p * words;
        if (!live[p]) {
            ps_fill_rows(rows, words, v, v + 1, NULL, 0);
            continue;
        }
        w->checked++;
        if (t < 0 || t >= limit || !((above[t >> 5] >> (t & 31)) & 1)) {
            w->rejected++;
            ps_fill_rows(rows, words, v, v + 1, NULL, 0);
            continue;
        }
        if (grow_move(g, c, p, s, &depth) != 0) {
            failed = 1;
            break;
        }
        int taken = ffi_accept(&w->args[c], t, &w->error);
        if (taken <= 0) {
            failed = taken < 0;
            w->rejected++;
            ps_fill_rows(rows, words, v, v + 1, NULL, 0);
            continue;
        }
        s->held[depth++] = v;
        valid_out[v] = 1;
        int ended = ffi_is_terminated(&w->args[c], &w->error);
        if (ended != 0) { /* an end token: valid, nothing follows, the row all-allowed */
            failed = ended < 0;
            ps_fill_rows(rows, words, v, v + 1, NULL, 0);
            if (!failed && ffi_rollback(&w->args[c], 1, &w->error) != 0) failed = 1;
            if (!failed) depth--;
            continue;
        }
        if (ffi_fill(&w->args[c], row, width, &w->error) != 0) {
            failed = 1;
            break;
        }
        if (width < words) memset(row + width, 0, (size_t)(words - width) * sizeof(int32_t));
        live[v] = live_out[v] = 1;
    }
    if (depth > 0) {
        char *error = NULL;
        if (ffi_rollback(&w->args[c], depth, &error) != 0 && !failed) {
            w->error = error;
            failed = 1;
        } else {
            free(error);
        }
    }
    if (failed) { /* the entry's new nodes refused, none half-written */
        for (Py_ssize_t v = g->start; v < end; v++) {
            valid_out[v] = live_out[v] = 0;
            ps_fill_rows(rows, words, v, v + 1, NULL, 0);
        }
    }
    return failed ? -1 : 0;
}

/* Every entry decided, the GIL released. 0 with the outcome in w->failed (-1, or the entry
   xgrammar failed on: the entries after it untouched), -1 with an error set (memory, the walk
   hook raised). */
static int grow_run(Grow *g) {
    size_t n = (size_t)g->end + 1;
    int64_t *block = PyMem_Malloc(n * 6 * sizeof(int64_t));
    if (block == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    GrowScratch s = {block, block + n, block + 2 * n, block + 3 * n, block + 4 * n, block + 5 * n};
    if (walk_hook != NULL) {
        PyObject *done = PyObject_CallNoArgs(walk_hook);
        if (done == NULL) {
            PyMem_Free(block);
            return -1;
        }
        Py_DECREF(done);
    }
    Walk *w = &g->walk;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < w->count; c++) {
        if (grow_entry(g, c, &s) != 0) {
            w->failed = c;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(block);
    return 0;
}

/* Hold `obj` as a writable C-contiguous array of one-byte flags [batch, capacity]. */
static int grow_flags(PyObject *obj, Array *a, Py_ssize_t batch, Py_ssize_t capacity,
                      const char *name) {
    if (array_get(obj, a, 1, '?', 1, 2, name) != 0) return -1;
    if (a->view.shape[0] != batch || a->view.shape[1] != capacity) {
        array_release(a);
        PyErr_Format(PyExc_ValueError, "xgrammar_grow: %s must be [batch, capacity]", name);
        return -1;
    }
    return 0;
}

/* Hold a grow's arrays (objs[0 .. 6]: requests, limits, rows, parents, tokens, valid, live,
   into a[0 .. 6]; parents and tokens writable when `tree_writable`) and check their shapes,
   the requests and the limits. 0, or -1 with an error set naming `who`. */
static int grow_arrays(PyObject *const *objs, Array *a, int tree_writable, const char *who) {
    if (array_get(objs[0], &a[0], 0, 'i', 8, 1, "requests") != 0 ||
        array_get(objs[1], &a[1], 0, 'i', 8, 1, "limits") != 0 ||
        array_get(objs[2], &a[2], 1, 'i', 4, 3, "rows") != 0 ||
        array_get(objs[3], &a[3], tree_writable, 'i', 8, 2, "parents") != 0 ||
        array_get(objs[4], &a[4], tree_writable, 'i', 8, 2, "tokens") != 0)
        return -1;
    Py_ssize_t count = a[0].view.shape[0], batch = a[2].view.shape[0];
    Py_ssize_t capacity = a[2].view.shape[1], words = a[2].view.shape[2];
    if (grow_flags(objs[5], &a[5], batch, capacity, "valid") != 0 ||
        grow_flags(objs[6], &a[6], batch, capacity, "live") != 0)
        return -1;
    if (a[1].view.shape[0] != count || a[3].view.shape[0] != batch ||
        a[3].view.shape[1] != capacity || a[4].view.shape[0] != batch ||
        a[4].view.shape[1] != capacity) {
        PyErr_Format(PyExc_ValueError, "%s: arrays malformed", who);
        return -1;
    }
    const int64_t *requests = a[0].view.buf, *limits = a[1].view.buf;
    for (Py_ssize_t c = 0; c < count; c++) {
        if (requests[c] < 0 || requests[c] >= batch || limits[c] < 0 || limits[c] > 32 * words) {
            PyErr_Format(PyExc_ValueError, "%s: a request or limit out of range", who);
            return -1;
        }
    }
    return 0;
}

/* Nodes start .. end - 1 decided over arrays held by grow_arrays (end <= capacity): the
   outcome tuple (checked, rejected, failed, message), None when the walk declines (nothing
   written), or NULL with an error set. */
static PyObject *grow_held(PyObject *matchers, Array *a, Py_ssize_t start, Py_ssize_t end) {
    if (!ffi_moves_bound()) Py_RETURN_NONE;
    Py_ssize_t count = a[0].view.shape[0];
    Py_ssize_t capacity = a[2].view.shape[1], words = a[2].view.shape[2];
    const int64_t *requests = a[0].view.buf, *limits = a[1].view.buf;
    Grow g;
    memset(&g, 0, sizeof(g));
    walk_init(&g.walk, WALK_TRAVERSE);
    PyObject *result = NULL;
    if (walk_reserve(&g.walk, count) != 0) goto done;
    g.walk.words = words;
    Py_ssize_t n;
    PyObject *const *items = sequence_items(matchers, &n);
    if (n != count) {
        PyErr_SetString(PyExc_TypeError, "xgrammar_grow: one matcher per request");
        goto done;
    }
    if ((g.widths = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t c = 0; c < count; c++) {
        Facts f;
        if (!matcher_facts(items[c], &f) || f.words > words) { /* the caller's path */
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (walk_matcher(&g.walk, c, items[c], &f) != 0) goto done;
        g.widths[c] = f.words;
    }
    size_t slots = (size_t)(count > 0 ? count : 1) * (size_t)(end > 0 ? end : 1);
    g.capacity = capacity, g.words = words, g.start = start, g.end = end;
    g.requests = copy_int64(requests, count);
    g.limits = copy_int64(limits, count);
    g.parents = PyMem_Malloc(slots * sizeof(int64_t));
    g.tokens = PyMem_Malloc(slots * sizeof(int64_t));
    g.live = PyMem_Malloc(slots);
    if (g.requests == NULL || g.limits == NULL || g.parents == NULL || g.tokens == NULL ||
        g.live == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *parents = a[3].view.buf, *tokens = a[4].view.buf;
    const uint8_t *live = a[6].view.buf;
    for (Py_ssize_t c = 0; c < count; c++) {
        int64_t b = g.requests[c];
        memcpy(g.parents + c * end, parents + b * capacity, (size_t)end * sizeof(int64_t));
        memcpy(g.tokens + c * end, tokens + b * capacity, (size_t)end * sizeof(int64_t));
        for (Py_ssize_t v = 0; v < end; v++) g.live[c * end + v] = live[b * capacity + v] != 0;
        for (Py_ssize_t d = 0; d < c; d++) {
            if (g.requests[d] == b) {
                PyErr_SetString(PyExc_ValueError, "xgrammar_grow: a request listed twice");
                goto done;
            }
        }
    }
    int held = walk_hold(&g.walk);
    if (held <= 0) {
        result = held < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    g.rows = (int32_t *)a[2].view.buf;
    g.valid_out = (uint8_t *)a[5].view.buf;
    g.live_out = (uint8_t *)a[6].view.buf;
    if (grow_run(&g) == 0) result = walk_outcome(&g.walk, NULL);
done:
    grow_clear(&g);
    return result;
}

static PyObject *xgrammar_grow(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *matchers, *objs[7];
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnn", &matchers, &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5], &objs[6], &start, &end))
        return NULL;
    if (!ffi_moves_bound()) Py_RETURN_NONE;
    Array a[7] = {0};
    PyObject *result = NULL;
    if (grow_arrays(objs, a, 0, "xgrammar_grow") != 0) goto done;
    if (start < 0 || end < start || end > a[2].view.shape[1] || end > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_grow: node range malformed");
        goto done;
    }
    result = grow_held(matchers, a, start, end);
done:
    for (int i = 0; i < 7; i++) array_release(&a[i]);
    return result;
}

/* xgrammar_level: a DraftSession level in one call. The level's parents and tokens ([batch, k]
   int64, copied first) are checked against the tree so far (each parent an earlier node, or -1
   for a padding slot; never a padding slot itself), written into the tree's columns first ..
   first + k - 1 (a padding slot's token as 0), and decided: the listed requests' by
   xgrammar_grow's walk, every other request's as an unconstrained one's (valid and live unless
   padding, rows all-allowed). With `out` ([batch * k, words] int32, or None) the level's rows
   are then copied there, node j of request b in row b * k + j.

   Returns (status, padded, checked, rejected, failed, message): status 0 done (failed, message:
   xgrammar_grow's); 1 a parent is malformed: nothing written (the caller names it); 2 the walk
   declined: the columns and the unconstrained requests' rows written, the listed requests'
   rows not, nothing copied. padded: whether the level has a padding slot. */
static PyObject *xgrammar_level(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *matchers, *objs[7], *level_objs[2], *out_obj;
    Py_ssize_t first;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnOOO", &matchers, &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5], &objs[6], &first, &level_objs[0],
                          &level_objs[1], &out_obj))
        return NULL;
    Array a[10] = {0};
    int64_t *copies = NULL;
    uint8_t *listed = NULL;
    PyObject *result = NULL, *grown = NULL;
    if (grow_arrays(objs, a, 1, "xgrammar_level") != 0 ||
        array_get(level_objs[0], &a[7], 0, 'i', 8, 2, "level parents") != 0 ||
        array_get(level_objs[1], &a[8], 0, 'i', 8, 2, "level tokens") != 0)
        goto done;
    Py_ssize_t count = a[0].view.shape[0], batch = a[2].view.shape[0];
    Py_ssize_t capacity = a[2].view.shape[1], words = a[2].view.shape[2];
    Py_ssize_t k = a[7].view.shape[1];
    if (a[7].view.shape[0] != batch || a[8].view.shape[0] != batch || a[8].view.shape[1] != k ||
        k < 1 || first < 1 || first > capacity - k || first + k > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_level: arrays or node range malformed");
        goto done;
    }
    if (out_obj != Py_None) {
        if (array_get(out_obj, &a[9], 1, 'i', 4, 2, "out") != 0) goto done;
        if (a[9].view.shape[0] != batch * k || a[9].view.shape[1] != words) {
            PyErr_SetString(PyExc_ValueError, "xgrammar_level: out must be [batch * k, words]");
            goto done;
        }
    }
    listed = PyMem_Calloc((size_t)batch, 1);
    copies = PyMem_Malloc((size_t)(batch * k) * 2 * sizeof(int64_t));
    if (listed == NULL || copies == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(copies, a[7].view.buf, (size_t)(batch * k) * sizeof(int64_t));
    memcpy(copies + batch * k, a[8].view.buf, (size_t)(batch * k) * sizeof(int64_t));
    const int64_t *requests = a[0].view.buf, *level_parents = copies;
    const int64_t *level_tokens = copies + batch * k;
    for (Py_ssize_t c = 0; c < count; c++) listed[requests[c]] = 1; /* in range: grow_arrays */
    int64_t *parents = a[3].view.buf, *tokens = a[4].view.buf;
    int padded = 0;
    for (Py_ssize_t i = 0; i < batch * k; i++) { /* checked before anything is written */
        int64_t p = level_parents[i];
        if (p < -1 || p >= first || (p > 0 && parents[(i / k) * capacity + p] < 0)) {
            result = Py_BuildValue("(iiiiiO)", 1, 0, 0, 0, -1, Py_None);
            goto done;
        }
        padded |= p < 0;
    }
    int32_t *rows = a[2].view.buf;
    uint8_t *valid = a[5].view.buf, *live = a[6].view.buf;
    for (Py_ssize_t b = 0; b < batch; b++) {
        for (Py_ssize_t j = 0; j < k; j++) {
            int64_t p = level_parents[b * k + j];
            parents[b * capacity + first + j] = p;
            tokens[b * capacity + first + j] = p < 0 ? 0 : level_tokens[b * k + j];
            if (!listed[b]) valid[b * capacity + first + j] = live[b * capacity + first + j] = p >= 0;
        }
        if (!listed[b]) ps_fill_rows(rows + b * capacity * words, words, first, first + k, NULL, 0);
    }
    grown = grow_held(matchers, a, first, first + k);
    if (grown == NULL) goto done;
    if (grown == Py_None) {
        result = Py_BuildValue("(iiiiiO)", 2, padded, 0, 0, -1, Py_None);
        goto done;
    }
    /* (checked, rejected, failed, message) */
    Py_ssize_t failed = PyLong_AsSsize_t(PyTuple_GET_ITEM(grown, 2));
    if (failed == -1 && PyErr_Occurred()) goto done;
    if (failed < 0 && a[9].held) {
        int32_t *out = a[9].view.buf;
        size_t span = (size_t)(k * words) * sizeof(int32_t);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t b = 0; b < batch; b++)
            memcpy(out + b * k * words, rows + (b * capacity + first) * words, span);
        Py_END_ALLOW_THREADS
    }
    result = Py_BuildValue("(iiOOnO)", 0, padded, PyTuple_GET_ITEM(grown, 0),
                           PyTuple_GET_ITEM(grown, 1), failed, PyTuple_GET_ITEM(grown, 3));
done:
    Py_XDECREF(grown);
    PyMem_Free(listed);
    PyMem_Free(copies);
    for (int i = 0; i < 10; i++) array_release(&a[i]);
    return result;
}
