/* The walk runner: the one place that releases the GIL to call xgrammar.

   An entry point fills a Walk with the GIL held: one entry per chain or tree (its first row,
   first token and node count), the matcher of each (a reference taken, so that no other
   thread can free it), private copies of the tokens, links and stop tokens it reads, and the
   destination rows (the entry point holds them until the walk returns). walk_hold then enters
   every matcher in the held table (a matcher another build is walking declines the walk
   before anything is written), walk_run walks and repairs every entry without the GIL, and
   walk_clear lets everything go. Nothing the walk reads without the GIL belongs to the
   caller. */

enum { WALK_CHAINS, WALK_TREES, WALK_TRAVERSE };

typedef struct {
    int kind;       /* WALK_CHAINS: repaired chains; WALK_TREES: repaired trees; WALK_TRAVERSE:
                       xgrammar's rows only, `live` set */
    int repeat;     /* chains: rows after a refused draft repeat the row before it */
    int reach_free; /* trees: an entry without a matcher accepts every node a link reaches */
    int64_t limit;  /* tokens at or past it are refused */
    Py_ssize_t count, words, longest;
    int64_t *spans;       /* [count * 3]: first row, first token, nodes (owned) */
    PyObject **matchers;  /* [count]: references, NULL where an entry has no matcher */
    FfiAny *args;         /* [count]: the matchers as tvm-ffi arguments */
    int64_t *tokens;      /* every entry's tokens (owned) */
    int64_t *next_token, *next_sibling; /* trees: every entry's links (owned) */
    int64_t *stops;       /* stop tokens (owned) */
    Py_ssize_t ntokens, nstops;
    PyObject *token;      /* this walk's mark in the held table */
    PyObject **keys;      /* [count]: the held table's keys this walk entered */
    int32_t *rows;        /* destination [rows, words], held by the entry point */
    uint8_t *flags;       /* destination accepted flags per row, or NULL */
    double *times;        /* destination seconds per entry, or NULL */
    double *owned_times;  /* walk_timed's, freed with the walk */
    uint8_t *live;        /* WALK_TRAVERSE: per entry, whether its matcher was live */
    Py_ssize_t checked, rejected, failed; /* outcome; failed: the entry xgrammar refused */
    char *error;          /* xgrammar's words when it refused (malloc'd) */
} Walk;

static void walk_init(Walk *w, int kind) {
    memset(w, 0, sizeof(*w));
    w->kind = kind;
    w->failed = -1;
}

/* Room for `count` entries: 0, or -1 with MemoryError set. */
static int walk_reserve(Walk *w, Py_ssize_t count) {
    size_t slots = (size_t)(count > 0 ? count : 1);
    w->count = count;
    w->longest = 1;
    w->spans = PyMem_Calloc(slots * 3, sizeof(int64_t));
    w->matchers = PyMem_Calloc(slots, sizeof(PyObject *));
    w->args = PyMem_Calloc(slots, sizeof(FfiAny));
    w->keys = PyMem_Calloc(slots, sizeof(PyObject *));
    if (w->spans == NULL || w->matchers == NULL || w->args == NULL || w->keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Entry i: rows from `row`, tokens from `token`, `nodes` of them. */
static void walk_span(Walk *w, Py_ssize_t i, int64_t row, int64_t token, int64_t nodes) {
    w->spans[3 * i] = row;
    w->spans[3 * i + 1] = token;
    w->spans[3 * i + 2] = nodes;
    if (nodes > w->longest) w->longest = (Py_ssize_t)nodes;
}

/* Entry i walked by matcher `g`, whose facts `f` the caller looked up: a reference to `g` is
   taken. 0, or -1 with an error set. */
static int walk_matcher(Walk *w, Py_ssize_t i, PyObject *g, const Facts *f) {
    if (ffi_matcher(f->handle, &w->args[i]) != 0) return -1;
    Py_XSETREF(w->matchers[i], Py_NewRef(g));
    return 0;
}

/* Look `g` up and make it entry i's matcher: 1 done; 0 when the facts table does not know it
   at `words` words (no error set); -1 with an error set. */
static int walk_known(Walk *w, Py_ssize_t i, PyObject *g, Py_ssize_t words, Facts *f) {
    if (!matcher_facts(g, f) || f->words != words) return 0;
    return walk_matcher(w, i, g, f) == 0 ? 1 : -1;
}

/* Private copies of what the walk reads: 0, or -1 with MemoryError set. */
static int walk_copy_tokens(Walk *w, const int64_t *tokens, Py_ssize_t n) {
    PyMem_Free(w->tokens);
    w->ntokens = n;
    return (w->tokens = copy_int64(tokens, n)) == NULL ? -1 : 0;
}

static int walk_copy_links(Walk *w, const int64_t *nt, const int64_t *ns, Py_ssize_t n) {
    if ((w->next_token = copy_int64(nt, n)) == NULL) return -1;
    return (w->next_sibling = copy_int64(ns, n)) == NULL ? -1 : 0;
}

/* The stop tokens, a 1-D int64 array: copied. 0, or -1 with an error set. */
static int walk_copy_stops(Walk *w, PyObject *stops) {
    Array a;
    if (array_get(stops, &a, 0, 'i', 8, 1, "stop_ids") != 0) return -1;
    w->nstops = a.view.shape[0];
    w->stops = copy_int64(a.view.buf, w->nstops);
    array_release(&a);
    return w->stops == NULL ? -1 : 0;
}

/* Room for each entry's walk seconds, owned by the walk (the tally reads them): 0, or -1
   with MemoryError set. */
static int walk_timed(Walk *w) {
    if ((w->owned_times = PyMem_Calloc((size_t)w->count + 1, sizeof(double))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->times = w->owned_times;
    return 0;
}

/* Whether every entry's rows lie inside `nrows` rows and its tokens inside the walk's; with
   `empty_ok`, an entry of 0 nodes (nothing to walk: a request still reasoning) passes. */
static int walk_spans_fit(const Walk *w, Py_ssize_t nrows, int empty_ok) {
    for (Py_ssize_t c = 0; c < w->count; c++) {
        const int64_t *s = w->spans + 3 * c;
        if (empty_ok && s[2] == 0) continue;
        if (s[0] < 0 || s[1] < 0 || s[2] < 1 || s[0] > nrows - s[2] || s[1] > w->ntokens - s[2])
            return 0;
    }
    return 1;
}

/* Whether the links of every tree entry (the walk's own copies) form a tree: 1, 0, or -1 with
   MemoryError set. xgrammar follows them without the GIL, so they are checked where it reads
   them, after the copy. */
static int walk_links_valid(const Walk *w) {
    size_t n = (size_t)w->longest;
    void *scratch = PyMem_Malloc(n * (2 * sizeof(int32_t) + 1));
    if (scratch == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int32_t *indegree = (int32_t *)scratch, *queue = indegree + n;
    uint8_t *seen = (uint8_t *)(queue + n);
    int ok = 1;
    for (Py_ssize_t c = 0; c < w->count && ok; c++) {
        const int64_t *s = w->spans + 3 * c;
        ok = ps_links_valid(w->next_token + s[1], w->next_sibling + s[1], (ptrdiff_t)s[2],
                            indegree, queue, seen);
    }
    PyMem_Free(scratch);
    return ok;
}

/* Enter every matcher in the held table under this walk's token: 1, or 0 when another
   build holds one of them or one is listed twice (what was entered stays until walk_clear),
   or -1 with an error set. Runs no Python code between a test and its entry (the table's
   keys are exact ints), so no other thread can enter the same matcher in between. */
static int walk_hold(Walk *w) {
    if (env_held == NULL) return 0;
    w->token = PyLong_FromVoidPtr(w);
    if (w->token == NULL) return -1;
    for (Py_ssize_t c = 0; c < w->count; c++) {
        if (w->matchers[c] == NULL) continue;
        PyObject *key = PyLong_FromVoidPtr(w->matchers[c]);
        if (key == NULL) return -1;
        PyObject *holder = PyDict_GetItemWithError(env_held, key);
        if (holder != NULL || PyErr_Occurred()) {
            Py_DECREF(key);
            return PyErr_Occurred() ? -1 : 0;
        }
        if (PyDict_SetItem(env_held, key, w->token) != 0) {
            Py_DECREF(key);
            return -1;
        }
        w->keys[c] = key;
    }
    return 1;
}

static void walk_unhold(Walk *w) {
    if (w->keys == NULL) return;
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *raised = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
#endif
    for (Py_ssize_t c = 0; c < w->count; c++) {
        PyObject *key = w->keys[c];
        if (key == NULL) continue;
        PyObject *holder = PyDict_GetItemWithError(env_held, key);
        if (holder == w->token && PyDict_DelItem(env_held, key) != 0) PyErr_Clear();
        Py_CLEAR(w->keys[c]);
    }
    PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(raised);
#else
    PyErr_Restore(type, value, traceback);
#endif
}

static void walk_clear(Walk *w) {
    walk_unhold(w);
    for (Py_ssize_t c = 0; w->matchers != NULL && c < w->count; c++) Py_CLEAR(w->matchers[c]);
    Py_CLEAR(w->token);
    PyMem_Free(w->spans);
    PyMem_Free(w->matchers);
    PyMem_Free(w->args);
    PyMem_Free(w->keys);
    PyMem_Free(w->tokens);
    PyMem_Free(w->next_token);
    PyMem_Free(w->next_sibling);
    PyMem_Free(w->stops);
    PyMem_Free(w->owned_times);
    free(w->error);
    memset(w, 0, sizeof(*w));
}

/* Seconds since *began into *out; *began becomes now. */
static void lap(double *out, struct timespec *began) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    *out = (double)(now.tv_sec - began->tv_sec) + 1e-9 * (double)(now.tv_nsec - began->tv_nsec);
    *began = now;
}

/* The scratch of one entry: chain links (next_token i + 1, next_sibling -1) for chains, a
   queue and flags for trees. */
typedef struct {
    int64_t *chain_next, *chain_none;
    int32_t *queue;
    uint8_t *keep;
} Scratch;

/* xgrammar's walk of entry c: 1 live and walked, 0 no matcher or terminated, -1 refused
   (w->error set). No GIL. */
static int walk_xgrammar(Walk *w, Py_ssize_t c, int64_t *nt, int64_t *ns, int64_t *tokens,
                         int32_t *rows, Py_ssize_t n) {
    if (w->matchers[c] == NULL) return 0;
    int terminated = ffi_is_terminated(&w->args[c], &w->error);
    if (terminated != 0) return terminated < 0 ? -1 : 0;
    return ffi_traverse(&w->args[c], nt, ns, tokens, rows, n, w->words, &w->error) == 0 ? 1 : -1;
}

/* Walk and repair entry c. 0, or -1 when xgrammar refused it. No GIL. */
static int walk_entry(Walk *w, Py_ssize_t c, Scratch *s) {
    const int64_t *span = w->spans + 3 * c;
    Py_ssize_t n = (Py_ssize_t)span[2], words = w->words;
    int32_t *rows = w->rows + span[0] * words;
    int64_t *tokens = w->tokens + span[1];
    uint8_t *flags = w->flags != NULL ? w->flags + span[0] : NULL;
    Py_ssize_t checked = 0, rejected = 0;
    if (n == 0) return 0; /* an entry with nothing to walk (a request still reasoning) */
    if (w->kind == WALK_CHAINS) {
        s->chain_next[n - 1] = -1;
        int live = walk_xgrammar(w, c, s->chain_next, s->chain_none, tokens, rows, n);
        s->chain_next[n - 1] = n;
        if (live < 0) return -1;
        ps_repair_chain(rows, tokens, n, words, live, w->limit, w->stops, w->nstops, w->repeat,
                        flags, &checked, &rejected);
    } else {
        int64_t *nt = w->next_token + span[1], *ns = w->next_sibling + span[1];
        int live = walk_xgrammar(w, c, nt, ns, tokens, rows, n);
        if (live < 0) return -1;
        if (w->kind == WALK_TRAVERSE) {
            w->live[c] = (uint8_t)live;
        } else if (w->matchers[c] == NULL && w->reach_free) {
            ps_fill_rows(rows, words, 0, n, NULL, 0);
            if (flags != NULL) ps_reach(nt, ns, n, s->queue, flags);
        } else {
            ps_repair_tree(rows, n, words, nt, ns, tokens, w->limit, w->stops, w->nstops, live,
                           s->queue, s->keep, flags, &checked, &rejected);
        }
    }
    w->checked += checked;
    w->rejected += rejected;
    return 0;
}

/* Every entry walked and repaired, the GIL released for all of them. The walk must be held
   (walk_hold) and its spans checked (walk_spans_fit). 0 with the outcome in w->failed (-1, or
   the entry xgrammar refused: the entries before it are done, the rest untouched) and
   w->error; -1 with an error set (memory, or the walk hook raised). */
static int walk_run(Walk *w) {
    if (w->kind == WALK_TRAVERSE && (w->live = PyMem_Calloc((size_t)w->count + 1, 1)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t n = (size_t)w->longest;
    void *block = PyMem_Malloc(n * (2 * sizeof(int64_t) + sizeof(int32_t) + 1));
    if (block == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Scratch s = {(int64_t *)block, (int64_t *)block + n, (int32_t *)((int64_t *)block + 2 * n),
                 NULL};
    s.keep = (uint8_t *)(s.queue + n);
    for (size_t i = 0; i < n; i++) {
        s.chain_next[i] = (int64_t)i + 1;
        s.chain_none[i] = -1;
    }
    if (walk_hook != NULL) {
        PyObject *done = PyObject_CallNoArgs(walk_hook);
        if (done == NULL) {
            PyMem_Free(block);
            return -1;
        }
        Py_DECREF(done);
    }
    Py_BEGIN_ALLOW_THREADS
    struct timespec began;
    clock_gettime(CLOCK_MONOTONIC, &began);
    for (Py_ssize_t c = 0; c < w->count; c++) {
        if (walk_entry(w, c, &s) != 0) {
            w->failed = c;
            break;
        }
        if (w->times != NULL) lap(&w->times[c], &began);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(block);
    return 0;
}

/* (checked, rejected, failed, message) of a finished walk; `failed` mapped through `owners`
   when given (the request of each entry). */
static PyObject *walk_outcome(const Walk *w, const int64_t *owners) {
    if (w->failed < 0)
        return Py_BuildValue("nnnO", w->checked, w->rejected, (Py_ssize_t)-1, Py_None);
    Py_ssize_t failed = owners != NULL ? (Py_ssize_t)owners[w->failed] : w->failed;
    return Py_BuildValue("nnns", w->checked, w->rejected, failed,
                         w->error != NULL ? w->error : "xgrammar failed");
}
