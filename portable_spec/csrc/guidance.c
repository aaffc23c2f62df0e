/* vllm_guidance: the vLLM plugin's step with the guidance backend, read straight from vLLM's
   objects (its request dict, each request's grammar wrapper, that wrapper's terminated flag,
   llguidance matcher and tokenizer, through the attribute names the plugin hands it; the
   scheduled draft lists) and written with one llguidance call per request: LLMatcher's
   unsafe_compute_mask_ptr_with_draft_token, which writes the root row and one row per draft
   the matcher consumes (llguidance releases the GIL while it computes them) and leaves the
   matcher where it started. ps_guidance_tail then writes the rows vLLM derives from where the
   chain ended.

   Where it ended is read off the chain's last row, cleared before the call: llguidance
   writes it only when it consumed every draft. A row still all-zero afterwards (a refused
   draft, a complete grammar, an end token, or a written row that is all-zero) makes the
   matcher say how far it goes: try_consume_tokens, then is_stopped, then rollback.

   llguidance takes a draft at or past its tokenizer's vocabulary (a padding id of the
   model's wider logits) for an error it never leaves: the chain handed to it stops before
   the first such draft, which is refused as any draft the matcher does not take.

   The matchers are llguidance's Python objects: every call into them runs with the GIL held
   (their methods release it themselves while they compute a mask), through the method
   protocol. Reading vLLM's objects runs Python code too: each object is held by a reference
   from the moment it is read, the drafts are copied before the first call, and the matchers
   are held in the held table for the whole step.

   A part of module.c (one translation unit): it uses arrays.c, walk.c (the Walk and its held
   table), vllm.c (the step readers it shares) and llguidance.c (its method calls). */

static PyObject *s_fill_chain;

/* The roles of the attribute names vllm_guidance is handed: a request's structured-output
   state, its grammar wrapper field, then the wrapper's terminated flag, llguidance tokenizer
   and matcher. */
enum { GNAME_STATE, GNAME_GRAMMAR, GNAME_TERMINATED, GNAME_TOKENIZER, GNAME_MATCHER,
       GUIDANCE_NAMES };

/* What vllm_guidance read of the step: per request its matcher (a reference in the walk;
   none for a terminated wrapper), end token, vocabulary and drafts (copied back to back). */
typedef struct {
    Walk w;          /* the matchers, held as the compiled walks hold theirs */
    PyObject *const *names; /* GUIDANCE_NAMES attribute names (borrowed for the call) */
    int64_t *tokens; /* every request's drafts back to back (owned) */
    int64_t *first;  /* [n + 1]: each request's first draft in `tokens` (owned) */
    int64_t *eos;    /* [n]: each request's end token (owned) */
    int64_t *vocab;  /* [n]: each request's tokenizer's vocabulary size (owned) */
    Py_ssize_t n, rows, capacity, ntokens, words;
} GStep;

static void gstep_clear(GStep *s) {
    walk_clear(&s->w);
    PyMem_Free(s->tokens);
    PyMem_Free(s->first);
    PyMem_Free(s->eos);
    PyMem_Free(s->vocab);
    memset(s, 0, sizeof(*s));
}

static int intern_guidance_names(void) {
#define INTERN(var, text) \
    if (var == NULL && (var = PyUnicode_InternFromString(text)) == NULL) return -1
    INTERN(s_fill_chain, "unsafe_compute_mask_ptr_with_draft_token");
#undef INTERN
    return intern_llguidance_names();
}

/* The end token and vocabulary size of `tokenizer` from `ends` (id(tokenizer) ->
   (tokenizer, end token, vocabulary size), made by the Python side): 0 with *eos and *vocab
   set, or -1 (unknown: decline; no error left set). */
static int gstep_end_token(PyObject *ends, PyObject *tokenizer, int64_t *eos, int64_t *vocab) {
    PyObject *key = PyLong_FromVoidPtr(tokenizer);
    if (key == NULL) return -1;
    PyObject *entry = PyDict_GetItemWithError(ends, key); /* an exact int key: no Python */
    Py_DECREF(key);
    if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3 ||
        PyTuple_GET_ITEM(entry, 0) != tokenizer || exact_int(PyTuple_GET_ITEM(entry, 1), eos) ||
        exact_int(PyTuple_GET_ITEM(entry, 2), vocab) || *vocab < 1) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* Request b's drafts copied into the step: exact ints, each a token below `limit` or -1
   (padding), its rows inside the buffer's. 1, or 0 to decline (an error may be set). */
static int gstep_drafts(GStep *s, Py_ssize_t b, PyObject *tokens, Py_ssize_t stride,
                        int64_t limit) {
    Py_ssize_t m;
    PyObject *const *items = sequence_items(tokens, &m);
    if (m < 0 || (stride && m >= stride)) return 0; /* (an empty list has no items) */
    Py_ssize_t need = stride ? stride : m + 1;
    if (need > s->capacity - s->rows) return 0; /* (s->rows <= s->capacity: no overflow) */
    int64_t *grown = PyMem_Realloc(s->tokens, sizeof(int64_t) * (size_t)(s->ntokens + m + 1));
    if (grown == NULL) return 0;
    s->tokens = grown;
    for (Py_ssize_t i = 0; i < m; i++) { /* no Python code runs while the list is read */
        int64_t t;
        if (exact_int(items[i], &t) != 0 || t < -1 || t >= limit) return 0;
        s->tokens[s->ntokens + i] = t;
    }
    s->ntokens += m;
    s->first[b + 1] = s->ntokens;
    s->rows += need;
    return 1;
}

/* Request b's wrapper read: its matcher entered in the walk (unless `terminated`), its end
   token and vocabulary size (the mask as wide as that vocabulary's). 1, or 0 to decline (an
   error may be set). */
static int gstep_wrapper(GStep *s, Py_ssize_t b, PyObject *grammar, PyObject *ends) {
    PyObject *flag = PyObject_GetAttr(grammar, s->names[GNAME_TERMINATED]);
    if (flag == NULL) return 0;
    int terminated = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (terminated < 0) return 0;
    PyObject *tokenizer = PyObject_GetAttr(grammar, s->names[GNAME_TOKENIZER]);
    if (tokenizer == NULL) return 0;
    int known = gstep_end_token(ends, tokenizer, &s->eos[b], &s->vocab[b]) == 0 &&
                (s->vocab[b] + 31) / 32 == (int64_t)s->words; /* the mask is the tokenizer's */
    Py_DECREF(tokenizer);
    if (!known || terminated) return known;
    PyObject *matcher = PyObject_GetAttr(grammar, s->names[GNAME_MATCHER]);
    if (matcher == NULL) return 0;
    s->w.matchers[b] = matcher; /* the reference moves into the walk */
    return 1;
}

/* Request b (its id `id`) read from vLLM's objects. 1, or 0 to decline. */
static int gstep_read(GStep *s, Py_ssize_t b, PyObject *id, PyObject *requests, PyObject *spec,
                      PyObject *wrappers, PyObject *ends, Py_ssize_t stride) {
    PyObject *tokens = PyDict_GetItemWithError(spec, id); /* may run a key's __eq__ */
    if (tokens == NULL && PyErr_Occurred()) return 0;
    tokens = tokens == NULL || tokens == Py_None ? PyList_New(0) : Py_NewRef(tokens);
    if (tokens == NULL) return 0;
    int ok = gstep_drafts(s, b, tokens, stride, 32 * (int64_t)s->words);
    Py_DECREF(tokens);
    PyObject *request = ok ? PyDict_GetItemWithError(requests, id) : NULL;
    if (request == NULL) return 0;
    Py_INCREF(request); /* the attribute reads may run Python code */
    PyObject *held = PyObject_GetAttr(request, s->names[GNAME_STATE]);
    Py_DECREF(request);
    if (held == NULL) return 0;
    PyObject *grammar = PyObject_GetAttr(held, s->names[GNAME_GRAMMAR]);
    Py_DECREF(held);
    if (grammar == NULL) return 0;
    ok = PySet_Contains(wrappers, (PyObject *)Py_TYPE(grammar)) == 1 &&
         gstep_wrapper(s, b, grammar, ends);
    Py_DECREF(grammar);
    return ok;
}

/* Every request of the step read. 1, or 0 to decline (an error may be set). */
static int gstep_read_all(GStep *s, PyObject *ids, PyObject *requests, PyObject *spec,
                          PyObject *wrappers, PyObject *ends, Py_ssize_t stride) {
    s->n = PyList_GET_SIZE(ids);
    walk_init(&s->w, WALK_TRAVERSE);
    if (walk_reserve(&s->w, s->n) != 0) return 0;
    s->first = PyMem_Calloc((size_t)s->n + 1, sizeof(int64_t));
    s->eos = PyMem_Calloc((size_t)s->n + 1, sizeof(int64_t));
    s->vocab = PyMem_Calloc((size_t)s->n + 1, sizeof(int64_t));
    if (s->first == NULL || s->eos == NULL || s->vocab == NULL) return 0;
    for (Py_ssize_t b = 0; b < s->n; b++) {
        if (b >= PyList_GET_SIZE(ids)) return 0; /* changed by an attribute read */
        PyObject *id = Py_NewRef(PyList_GET_ITEM(ids, b));
        int ok = PyUnicode_CheckExact(id) &&
                 gstep_read(s, b, id, requests, spec, wrappers, ends, stride);
        Py_DECREF(id);
        if (!ok) return 0;
    }
    return s->n > 0;
}

/* How many of chain[0..q) the matcher consumes, and whether it is then stopped when that is
   fewer than the request's p drafts (q <= p); it ends where it started. 0, 1 (a matcher in its
   error state: decline), or -1 with an error set. */
static int chain_reach(PyObject *matcher, PyObject *chain, Py_ssize_t q, Py_ssize_t p,
                       Py_ssize_t *c, int *stopped) {
    int64_t error = 0, taken = 0, flag = 0;
    if (call_int(matcher, s_is_error, NULL, 0, &error) != 0) return -1;
    if (error) return 1;
    if (call_int(matcher, s_try_consume, &chain, 1, &taken) != 0) return -1;
    if (taken < 0 || taken > q) {
        PyErr_SetString(PyExc_RuntimeError, "llguidance consumed more drafts than it was given");
        return -1;
    }
    if (taken < p && call_int(matcher, s_is_stopped, NULL, 0, &flag) != 0) return -1;
    if (taken > 0) {
        PyObject *count = PyLong_FromLongLong(taken);
        int64_t back = 0;
        int failed = count == NULL || call_int(matcher, s_rollback, &count, 1, &back) != 0;
        Py_XDECREF(count);
        if (failed) return -1;
        if (!back) {
            PyErr_SetString(PyExc_RuntimeError, "llguidance refused to roll its drafts back");
            return -1;
        }
    }
    *c = (Py_ssize_t)taken;
    *stopped = (int)flag;
    return 0;
}

/* The matcher's row at `where` (nbytes bytes), and whether it is stopped when `ask`. 0, 1 (a
   matcher in its error state: decline), or -1 with an error set. */
static int root_row(PyObject *matcher, PyObject *where, PyObject *nbytes, int ask,
                    int *stopped) {
    int64_t error = 0, flag = 0;
    PyObject *args[2] = {where, nbytes};
    if (call_int(matcher, s_is_error, NULL, 0, &error) != 0) return -1;
    if (error) return 1;
    if (call_int(matcher, s_fill_row, args, 2, NULL) != 0) return -1;
    if (ask && call_int(matcher, s_is_stopped, NULL, 0, &flag) != 0) return -1;
    *stopped = (int)flag;
    return 0;
}

/* Request b's rows, from row `row` of `rows` (m + 1 rows: its drafts and the bonus row).
   0, 1 to decline (a matcher in its error state), or -1 with an error set. */
static int gstep_request(GStep *s, Py_ssize_t b, int32_t *rows, Py_ssize_t row) {
    Py_ssize_t words = s->words, m = (Py_ssize_t)(s->first[b + 1] - s->first[b]);
    const int64_t *drafts = s->tokens + s->first[b];
    int32_t *own = rows + row * words;
    PyObject *matcher = s->w.matchers[b];
    if (matcher == NULL) { /* vLLM's wrapper says terminated: every row all-allowed */
        ps_fill_rows(own, words, 0, m + 1, NULL, 0);
        return 0;
    }
    Py_ssize_t p = 0, q = 0, c = 0;
    while (p < m && drafts[p] >= 0) p++;
    while (q < p && drafts[q] < s->vocab[b]) q++; /* llguidance is handed drafts [0, q) */
    int stopped = 0, status = 0;
    PyObject *where = PyLong_FromVoidPtr(own), *nbytes = PyLong_FromSsize_t(4 * words);
    PyObject *chain = q > 0 ? int_list(drafts, q) : NULL;
    if (where == NULL || nbytes == NULL || (q > 0 && chain == NULL)) {
        status = -1;
    } else if (q == 0) {
        status = root_row(matcher, where, nbytes, p > 0, &stopped);
    } else {
        int32_t *last = own + q * words;
        memset(last, 0, sizeof(int32_t) * (size_t)words);
        PyObject *args[3] = {where, nbytes, chain};
        status = call_int(matcher, s_fill_chain, args, 3, NULL);
        if (status == 0 && q == p && ps_nonzero_words(last, words, 0) > 0)
            c = p;
        else if (status == 0)
            status = chain_reach(matcher, chain, q, p, &c, &stopped);
    }
    Py_XDECREF(where);
    Py_XDECREF(nbytes);
    Py_XDECREF(chain);
    if (status == 0) ps_guidance_tail(own, words, drafts, m, p, c, stopped, s->eos[b]);
    return status;
}

/* Every request's rows written into `rows` (`capacity` rows); the strided layout's rows past
   a request's chain all-allowed and listed in `unwritten`. 1 done, 0 to decline, -1 with an
   error set. */
static int gstep_write(GStep *s, int32_t *rows, Py_ssize_t capacity, Py_ssize_t stride,
                       PyObject *unwritten) {
    if (s->rows > capacity) return 0;
    int held = walk_hold(&s->w);
    if (held <= 0) return held;
    Py_ssize_t row = 0;
    for (Py_ssize_t b = 0; b < s->n; b++) {
        Py_ssize_t m = (Py_ssize_t)(s->first[b + 1] - s->first[b]);
        int status = gstep_request(s, b, rows, row);
        if (status != 0) return status > 0 ? 0 : -1;
        Py_ssize_t next = stride ? row + stride : row + m + 1;
        ps_fill_rows(rows, s->words, row + m + 1, next, NULL, 0);
        for (Py_ssize_t r = row + m + 1; r < next; r++) {
            PyObject *index = PyLong_FromSsize_t(r);
            int failed = index == NULL || PyList_Append(unwritten, index) != 0;
            Py_XDECREF(index);
            if (failed) return -1;
        }
        row = next;
    }
    return 1;
}

static PyObject *vllm_guidance(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *requests, *ids, *spec, *wrappers, *ends, *buffer, *names;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "OOOO!O!OnO", &requests, &ids, &spec, &PySet_Type, &wrappers,
                          &PyDict_Type, &ends, &buffer, &stride, &names))
        return NULL;
    PyObject *const *read = step_names(names, GUIDANCE_NAMES);
    if (read == NULL || intern_guidance_names() != 0) return NULL;
    if (!PyDict_CheckExact(requests) || !PyList_CheckExact(ids) || !PyDict_CheckExact(spec) ||
        stride < 0)
        Py_RETURN_NONE;
    Array view;
    if (array_get(buffer, &view, 1, 'i', 4, 2, "rows") != 0) return NULL;
    GStep s;
    memset(&s, 0, sizeof(s));
    s.names = read;
    s.words = view.view.shape[1];
    s.capacity = view.view.shape[0];
    PyObject *result = NULL, *unwritten = PyList_New(0);
    Py_INCREF(ids);
    int done = 0;
    if (unwritten != NULL && gstep_read_all(&s, ids, requests, spec, wrappers, ends, stride))
        done = gstep_write(&s, (int32_t *)view.view.buf, view.view.shape[0], stride, unwritten);
    if (done > 0) {
        PyObject *out = PySequence_GetSlice(buffer, 0, s.rows);
        if (out != NULL) result = PyTuple_Pack(2, out, unwritten);
        Py_XDECREF(out);
    }
    Py_DECREF(ids);
    gstep_clear(&s);
    array_release(&view);
    Py_XDECREF(unwritten);
    if (done < 0) return NULL; /* llguidance raised after a matcher moved: the caller says so */
    if (result == NULL) { /* anything unusual, or an error reading vLLM's objects: decline */
        PyErr_Clear();
        result = Py_NewRef(Py_None);
    }
    return result;
}
