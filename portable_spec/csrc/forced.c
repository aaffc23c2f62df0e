/* xgrammar_forced_start, xgrammar_forced_step, xgrammar_forced_run: forced_drafts' walk of a
   batch of xgrammar matchers (portable_spec/drafting/forced.py), their methods called through
   tvm-ffi's C ABI with the GIL released, in phases that stop only where the tokenizer is
   needed and its answer is not known yet.

   Per request, the walk of forced.py's _draft_xgrammar: the longest accepted prefix of the
   proposed drafts, then rounds of the grammar's forced text (its tokens), the stability
   check's mask, and the single token of a state that allows only one. A phase runs every
   listed request until it needs a forced text's tokens or ends. Between phases, with the
   GIL, each text is looked up in the replies table (the tokenizer's answers so far, keyed by
   the text's bytes, see fx_reply_packed); the requests it answers run another phase. Only
   what the table does not answer returns to the caller:

     asks[c] is a str (or bytes that are not whole UTF-8 characters): the forced text, whose
             tokens the caller gives in the next step as (tokens, keep[, words, known]), keep
             the count of tokens stable whatever follows (known without the mask), -1 to have
             the mask filled and be asked for it, -2 when the text holds no whole character;
             with -1, `words` (mask word indices) and `known` (flat: per entry the values of
             those words, then the stable count) answer without asking where the mask's words
             match an entry;
     asks[c] is (text,): the mask after the whole text is in rows[c] (zero past the
             matcher's own width); the caller gives back (tokens, keep), keep how many of the
             text's tokens are stable; text None: the one asked last for this request;
     asks[c] is None: the request is done, its matcher rolled back, out[c, :count] its drafts.

   When nothing is asked the result carries every request's drafts as lists. The state lives
   in the caller's int64 [count, FS_FIELDS] array (private to one forced_drafts call: no other
   code sees it); a request that is not done holds its matcher moved by state[c, FS_HELD]
   tokens, which the caller rolls back if it gives up. Matchers are held by a reference for
   each call (and, by xgrammar_forced_run, in the held table until xgrammar_forced_release);
   what is read without the GIL is a private copy. */

enum { FS_DONE = 0, FS_TEXT = 1, FS_STABLE = 2 };
enum { FS_STATUS, FS_HELD, FS_COUNT, FS_LIMIT, FS_MASK, FS_FIELDS = 8 };
enum { FS_NO_TEXT = -2, FS_ASK_MASK = -1 };
/* tokens this many before a forced text's end are taken as they are (forced.py's
   _FAR_FROM_END) */
#define FS_FAR_FROM_END 8

static void *xgr_forced_text_fn, *xgr_is_completed_fn;

/* find_jump_forward_string and is_completed of the matcher type xgrammar_bind bound. */
static PyObject *xgrammar_bind_forced(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long text, completed;
    if (!PyArg_ParseTuple(args, "KK", &text, &completed)) return NULL;
    if (!ffi_moves_bound() || !text || !completed) {
        PyErr_SetString(PyExc_ValueError,
                        "xgrammar_bind_forced: a null address, or the moves not bound");
        return NULL;
    }
    xgr_forced_text_fn = (void *)(uintptr_t)text;
    xgr_is_completed_fn = (void *)(uintptr_t)completed;
    Py_RETURN_NONE;
}

static int ffi_forced_bound(void) {
    return ffi_moves_bound() && xgr_forced_text_fn != NULL && xgr_is_completed_fn != NULL;
}

static char *ffi_message(const char *text) {
    char *out = malloc(strlen(text) + 1);
    if (out != NULL) memcpy(out, text, strlen(text) + 1);
    return out;
}

/* matcher.is_completed(): 0 or 1, or -1 with *error set. */
static int ffi_is_completed(const FfiAny *matcher, char **error) {
    return ffi_bool_query(xgr_is_completed_fn, matcher, error);
}

/* matcher.find_jump_forward_string(): its bytes in *text (malloc'd, NULL when empty), their
   count in *size. 0, or -1 with *error set. */
static int ffi_forced_text(const FfiAny *matcher, char **text, size_t *size, char **error) {
    FfiAny args[1] = {*matcher}, result;
    ffi_arg(&result, FFI_NONE);
    *text = NULL;
    *size = 0;
    if (ffi_call(xgr_forced_text_fn, args, 1, &result) != 0) {
        *error = ffi_take_error();
        return -1;
    }
    const char *data = NULL;
    size_t n = 0;
    void *object = NULL;
    if (result.type_index == 11 || result.type_index == 12) { /* small str / bytes, inline */
        n = result.zero_padding; /* small_str_len */
        if (n > sizeof(result.v_int64)) n = sizeof(result.v_int64);
        data = (const char *)&result.v_int64;
    } else if (result.type_index == 65 || result.type_index == 66) { /* str / bytes objects */
        object = result.v_ptr;
        const FfiBytes *bytes = (const FfiBytes *)((const char *)object + sizeof(FfiObject));
        data = bytes->data;
        n = bytes->size;
    } else {
        if (result.type_index >= FFI_STATIC_OBJECT && result.v_ptr != NULL)
            ffi_decref(result.v_ptr);
        *error = ffi_message("find_jump_forward_string returned something other than a string");
        return -1;
    }
    int status = 0;
    if (n > 0) {
        *text = malloc(n);
        if (*text == NULL) {
            *error = ffi_message("out of memory");
            status = -1;
        } else {
            memcpy(*text, data, n);
            *size = n;
        }
    }
    if (object != NULL) ffi_decref(object);
    return status;
}

/* One request of a phase: its matcher, inputs (private copies) and state. */
typedef struct {
    PyObject *matcher;    /* a reference */
    FfiAny arg;
    int64_t *tokens;      /* the drafts (start) or the text's tokens (step), PyMem */
    Py_ssize_t ntokens;
    int64_t keep;         /* start: the first draft ends a reasoning; step: see above */
    int64_t *known;       /* a text's stable counts known by mask words (PyMem): the words,
                             then per entry their values and its count */
    Py_ssize_t nwords, nknown;
    const int64_t *stops; /* into the phase's copies */
    Py_ssize_t nstops;
    int64_t vocab, words, rowlen; /* rowlen: the rows' width (>= words; zero past words) */
    int64_t *state, *out; /* the caller's rows of them */
    int32_t *row;
    char *text;           /* an asked forced text (malloc'd) */
    size_t ntext;
    int run;              /* 1: start, 2: step, 0: not in this phase */
} Forced;

typedef struct {
    Py_ssize_t count, cap, words;
    Forced *entries;
    PyObject *replies; /* dict: forced text (bytes) -> its reply, or NULL (borrowed) */
    int64_t *stops; /* every distinct stop set's copy */
    Py_ssize_t failed;
    char *error;
} Phase;

static int fx_stop(const Forced *e, int64_t t) { return is_stop(t, e->stops, e->nstops); }

static void fx_push(Forced *e, Py_ssize_t cap, int64_t t) {
    if (e->state[FS_COUNT] < cap) e->out[e->state[FS_COUNT]++] = t;
}

/* Accept t: 1, 0 refused (out of the vocabulary or by the grammar), -1 with *error set. */
static int fx_accept(Forced *e, int64_t t, char **error) {
    if (t < 0 || t >= e->vocab) return 0;
    int taken = ffi_accept(&e->arg, t, error);
    if (taken > 0) e->state[FS_HELD]++, e->state[FS_MASK] = 0;
    return taken;
}

/* The request is done: its matcher rolled back. 0, or -1 with *error set. */
static int fx_done(Forced *e, char **error) {
    e->state[FS_STATUS] = FS_DONE;
    e->state[FS_MASK] = 0;
    if (e->state[FS_HELD] > 0) {
        if (ffi_rollback(&e->arg, e->state[FS_HELD], error) != 0) return -1;
        e->state[FS_HELD] = 0;
    }
    return 0;
}

static int fx_fill(Forced *e, char **error) {
    if (e->state[FS_MASK]) return 0;
    if (ffi_fill(&e->arg, e->row, e->words, error) != 0) return -1;
    if (e->rowlen > e->words) /* a row wider than the matcher's: zero past it */
        memset(e->row + e->words, 0, sizeof(int32_t) * (size_t)(e->rowlen - e->words));
    e->state[FS_MASK] = 1;
    return 0;
}

/* The token of the mask row that allows exactly one, else -1. */
static int64_t fx_single(const int32_t *row, int64_t words) {
    int64_t found = -1;
    for (int64_t w = 0; w < words; w++) {
        uint32_t word = (uint32_t)row[w];
        if (word == 0) continue;
        if (found >= 0 || (word & (word - 1)) != 0) return -1;
        int bit = 0;
        while (!((word >> bit) & 1)) bit++;
        found = 32 * w + bit;
    }
    return found;
}

/* Rounds from the current state (a forced text asked first when text_next): 0 (done, or a
   text asked), or -1 with *error set. */
static int fx_advance(Forced *e, Py_ssize_t cap, int text_next, char **error) {
    int64_t *s = e->state;
    while (s[FS_COUNT] < s[FS_LIMIT]) {
        if (text_next) {
            free(e->text);
            if (ffi_forced_text(&e->arg, &e->text, &e->ntext, error) != 0) return -1;
            if (e->ntext > 0) {
                s[FS_STATUS] = FS_TEXT;
                return 0;
            }
        }
        int completed = ffi_is_completed(&e->arg, error);
        if (completed <= 0) return completed < 0 ? -1 : fx_done(e, error);
        if (fx_fill(e, error) != 0) return -1;
        int64_t only = fx_single(e->row, e->words);
        int taken = only < 0 ? 0 : fx_accept(e, only, error);
        if (taken <= 0) return taken < 0 ? -1 : fx_done(e, error);
        fx_push(e, cap, only);
        if (fx_stop(e, only)) return fx_done(e, error);
        text_next = 1;
    }
    return fx_done(e, error);
}

/* The accepted prefix of the drafts, then the rounds. */
static int fx_start(Forced *e, Py_ssize_t cap, char **error) {
    int ended = ffi_is_terminated(&e->arg, error);
    if (ended != 0) return ended < 0 ? -1 : fx_done(e, error);
    for (Py_ssize_t i = 0; i < e->ntokens; i++) {
        if (e->state[FS_COUNT] >= e->state[FS_LIMIT]) return fx_done(e, error);
        int64_t t = e->tokens[i];
        int taken = fx_accept(e, t, error);
        if (taken < 0) return -1;
        if (taken == 0) {
            if (i == 0 && e->keep) return fx_done(e, error);
            break;
        }
        fx_push(e, cap, t);
        if (fx_stop(e, t)) return fx_done(e, error);
    }
    return fx_advance(e, cap, 1, error);
}

/* `keep` of the text's tokens stay the tokenizer's whatever follows: drafted, then the rounds
   go on without a text (a whole forced text is followed by no other). */
static int fx_stable(Forced *e, Py_ssize_t cap, int64_t keep, char **error) {
    int64_t room = e->state[FS_LIMIT] - e->state[FS_COUNT];
    int64_t n = keep < 0 ? 0 : keep;
    if (n > e->ntokens) n = e->ntokens;
    if (n > room) n = room;
    for (int64_t j = 0; j < n; j++) fx_push(e, cap, e->tokens[j]);
    if (n < e->ntokens || n == room) return fx_done(e, error);
    return fx_advance(e, cap, 0, error);
}

/* The stable count the caller already knows for the mask now in the row (the values of the
   mask words it depends on), else -1. */
static int64_t fx_known(const Forced *e) {
    const int64_t *words = e->known, *entry = e->known + e->nwords;
    for (Py_ssize_t w = 0; w < e->nwords; w++)
        if (words[w] < 0 || words[w] >= e->words) return -1;
    for (Py_ssize_t k = 0; k < e->nknown; k++, entry += e->nwords + 1) {
        Py_ssize_t w = 0;
        while (w < e->nwords && (int64_t)e->row[words[w]] == entry[w]) w++;
        if (w == e->nwords) return entry[e->nwords];
    }
    return -1;
}

/* The forced text's tokens, given back by the caller. */
static int fx_text(Forced *e, Py_ssize_t cap, char **error) {
    if (e->keep == FS_NO_TEXT) return fx_advance(e, cap, 0, error);
    Py_ssize_t n = e->ntokens;
    if (n == 0) return fx_done(e, error);
    int64_t room = e->state[FS_LIMIT] - e->state[FS_COUNT];
    int far = room + FS_FAR_FROM_END <= n;
    Py_ssize_t upto = far ? (Py_ssize_t)room : n, taken = 0;
    for (Py_ssize_t j = 0; j < upto; j++) {
        int64_t t = e->tokens[j];
        int ok = fx_accept(e, t, error);
        if (ok < 0) return -1;
        if (ok == 0) break;
        taken++;
        if (fx_stop(e, t)) break;
    }
    if (far || taken < n || fx_stop(e, e->tokens[n - 1])) {
        int64_t m = taken < room ? taken : room;
        for (int64_t j = 0; j < m; j++) fx_push(e, cap, e->tokens[j]);
        return fx_done(e, error);
    }
    if (e->keep == FS_ASK_MASK) {
        if (fx_fill(e, error) != 0) return -1;
        int64_t known = fx_known(e);
        if (known >= 0) return fx_stable(e, cap, known, error);
        e->state[FS_STATUS] = FS_STABLE;
        return 0;
    }
    return fx_stable(e, cap, e->keep, error);
}

/* Every listed request, the GIL released; the first that fails stops the phase. */
static void fx_run(Phase *p) {
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < p->count; c++) {
        Forced *e = &p->entries[c];
        if (!e->run) continue;
        int64_t status = e->state[FS_STATUS];
        e->state[FS_STATUS] = FS_DONE;
        int done;
        if (e->run == 1) done = fx_start(e, p->cap, &p->error);
        else if (status == FS_TEXT) done = fx_text(e, p->cap, &p->error);
        else done = fx_stable(e, p->cap, e->keep, &p->error);
        if (done != 0) {
            char *ignored = NULL;
            if (e->state[FS_HELD] > 0 && ffi_rollback(&e->arg, e->state[FS_HELD], &ignored) == 0)
                e->state[FS_HELD] = 0;
            free(ignored);
            e->state[FS_STATUS] = FS_DONE;
            p->failed = c;
            break;
        }
    }
    Py_END_ALLOW_THREADS
}

static void phase_clear(Phase *p) {
    if (p->entries != NULL) {
        for (Py_ssize_t c = 0; c < p->count; c++) {
            Py_XDECREF(p->entries[c].matcher);
            PyMem_Free(p->entries[c].tokens);
            PyMem_Free(p->entries[c].known);
            free(p->entries[c].text);
        }
    }
    PyMem_Free(p->entries);
    PyMem_Free(p->stops);
    free(p->error);
    memset(p, 0, sizeof(*p));
}

/* An int sequence (list or tuple of ints) as a private int64 copy; ids that do not fit are
   -1 (refused). 0, or -1 with an error set. */
static int fx_tokens(PyObject *obj, Forced *e, const char *name) {
    Py_ssize_t n;
    PyObject *const *items = sequence_items(obj, &n);
    if (n < 0) { /* (an empty list has no items array) */
        PyErr_Format(PyExc_TypeError, "%s: a list or tuple of int token ids", name);
        return -1;
    }
    e->tokens = PyMem_Malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (e->tokens == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "%s: a token id is not an int", name);
            return -1;
        }
        int overflow = 0;
        long long t = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (t == -1 && PyErr_Occurred()) return -1;
        e->tokens[i] = overflow ? -1 : (int64_t)t;
    }
    e->ntokens = n;
    return 0;
}

/* The phase's common arguments: the matchers (each known to the facts table), the state,
   output and mask arrays held in a[0..2]. 1 ready, 0 declined (a matcher the helper cannot
   call: nothing moved, no error set), -1 with an error set. */
static int phase_entries(Phase *p, PyObject *const *items, Py_ssize_t n, int64_t *state,
                         int64_t *out, int32_t *rows, PyObject *limits);

static int phase_init(Phase *p, PyObject *matchers, PyObject *objs[3], Array a[3]) {
    memset(p, 0, sizeof(*p));
    p->failed = -1;
    if (!ffi_forced_bound()) return 0;
    if (array_get(objs[0], &a[0], 1, 'i', 8, 2, "state") != 0 ||
        array_get(objs[1], &a[1], 1, 'i', 8, 2, "out") != 0 ||
        array_get(objs[2], &a[2], 1, 'i', 4, 2, "rows") != 0)
        return -1;
    Py_ssize_t n;
    PyObject *const *items = sequence_items(matchers, &n);
    if (n < 0 || a[0].view.shape[0] != n || a[0].view.shape[1] != FS_FIELDS ||
        a[1].view.shape[0] != n || a[2].view.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_forced: one matcher, state, out and rows "
                                          "row per request");
        return -1;
    }
    p->count = n, p->cap = a[1].view.shape[1], p->words = a[2].view.shape[1];
    return phase_entries(p, items, n, a[0].view.buf, a[1].view.buf, a[2].view.buf, NULL);
}

/* xgrammar_forced_run's arrays: one writable 1-D int64 block holding, in order, the state
   [n, FS_FIELDS], out [n, cap] and the rows (int32 [n, words], padded to whole int64), and
   the limits (an exact int, or a list or tuple of them, one per request) written into a
   zeroed state. 1 ready, 0 declined (no error set), -1 with an error set. */
static int phase_block(Phase *p, PyObject *matchers, PyObject *block, Py_ssize_t cap,
                       Py_ssize_t words, PyObject *limits, Array *a) {
    memset(p, 0, sizeof(*p));
    p->failed = -1;
    if (!ffi_forced_bound()) return 0;
    Py_ssize_t n;
    PyObject *const *items = sequence_items(matchers, &n);
    if (n < 0 || cap < 1 || words < 1) return 0;
    if (array_get(block, a, 1, 'i', 8, 1, "block") != 0) return -1;
    Py_ssize_t need = n * (FS_FIELDS + cap) + (n * words + 1) / 2;
    if (a->view.shape[0] < need) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_forced_run: the block is too small");
        return -1;
    }
    p->count = n, p->cap = cap, p->words = words;
    int64_t *state = a->view.buf, *out = state + n * FS_FIELDS;
    int32_t *rows = (int32_t *)(out + n * cap);
    memset(state, 0, sizeof(int64_t) * (size_t)(n * FS_FIELDS));
    return phase_entries(p, items, n, state, out, rows, limits);
}

/* Request c's limit from `limits` (an exact int for all, or one per request) into *v: 1, or
   0 when it is not an exact int from 0 to cap. */
static int fx_limit(PyObject *limits, Py_ssize_t c, Py_ssize_t n, Py_ssize_t cap, int64_t *v) {
    PyObject *item = limits;
    if (!PyLong_CheckExact(limits)) {
        Py_ssize_t k;
        PyObject *const *each = sequence_items(limits, &k);
        if (k != n) return 0;
        item = each[c];
    }
    return exact_int(item, v) == 0 && *v >= 0 && *v <= cap;
}

/* Every request's entry: its matcher (known to the facts table), its rows of the arrays, its
   stop tokens; with `limits`, its limit written into its (zeroed) state row first. */
static int phase_entries(Phase *p, PyObject *const *items, Py_ssize_t n, int64_t *state,
                         int64_t *out, int32_t *rows, PyObject *limits) {
    size_t slots = (size_t)(n > 0 ? n : 1);
    p->entries = PyMem_Calloc(slots, sizeof(Forced));
    if (p->entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *last_stops = NULL;
    Py_ssize_t stop_at = 0, stop_count = 0, stop_room = 0;
    for (Py_ssize_t c = 0; c < n; c++) {
        Forced *e = &p->entries[c];
        Facts f;
        if (!matcher_facts(items[c], &f) || f.words > p->words) return 0;
        if (ffi_matcher(f.handle, &e->arg) != 0) return -1;
        e->matcher = Py_NewRef(items[c]);
        e->vocab = f.vocab, e->words = f.words, e->rowlen = p->words;
        e->state = state + c * FS_FIELDS, e->out = out + c * p->cap, e->row = rows + c * p->words;
        if (limits != NULL && !fx_limit(limits, c, n, p->cap, &e->state[FS_LIMIT])) return 0;
        if (e->state[FS_LIMIT] < 0 || e->state[FS_LIMIT] > p->cap || e->state[FS_COUNT] < 0 ||
            e->state[FS_COUNT] > e->state[FS_LIMIT] || e->state[FS_HELD] < 0) {
            PyErr_SetString(PyExc_ValueError, "xgrammar_forced: a state row out of range");
            return -1;
        }
        if (f.stops != last_stops) { /* a new stop set: copied after the others */
            Array s;
            Py_INCREF(f.stops);
            int got = array_get(f.stops, &s, 0, 'i', 8, 1, "stop_ids");
            Py_DECREF(f.stops);
            if (got != 0) return -1;
            Py_ssize_t k = s.view.shape[0];
            if (stop_count + k > stop_room) {
                Py_ssize_t room = 2 * (stop_count + k) + 4;
                int64_t *grown = PyMem_Realloc(p->stops, sizeof(int64_t) * (size_t)room);
                if (grown == NULL) {
                    array_release(&s);
                    PyErr_NoMemory();
                    return -1;
                }
                p->stops = grown, stop_room = room;
            }
            if (k > 0) memcpy(p->stops + stop_count, s.view.buf, sizeof(int64_t) * (size_t)k);
            array_release(&s);
            stop_at = stop_count, stop_count += k, last_stops = f.stops;
        }
        /* offsets for now: pointers once every set is copied (the block may move) */
        e->stops = (const int64_t *)(intptr_t)stop_at;
        e->nstops = stop_count - stop_at;
    }
    for (Py_ssize_t c = 0; c < n; c++)
        p->entries[c].stops = p->stops + (intptr_t)p->entries[c].stops;
    return 1;
}

/* A text reply's known stable counts: `words` (mask word indices) and `known` (per entry the
   values of those words, then its count), ints, copied. 0, or -1 with an error set. */
static int fx_known_copy(Forced *e, PyObject *words, PyObject *known) {
    Py_ssize_t nw, nk;
    PyObject *const *w = sequence_items(words, &nw);
    PyObject *const *k = sequence_items(known, &nk);
    if (nw < 0 || nk < 0 || nk % (nw + 1) != 0) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_forced_step: known stable counts malformed");
        return -1;
    }
    e->known = PyMem_Malloc(sizeof(int64_t) * (size_t)(nw + nk + 1));
    if (e->known == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nw + nk; i++) {
        if (exact_int(i < nw ? w[i] : k[i - nw], &e->known[i]) != 0) {
            PyErr_SetString(PyExc_ValueError, "xgrammar_forced_step: a known value is not an int");
            return -1;
        }
    }
    e->nwords = nw, e->nknown = nk / (nw + 1);
    return 0;
}

/* Request c's reply to its ask (status FS_TEXT or FS_STABLE): (tokens, keep[, words, known]),
   copied; the request runs in the next phase. 0, or -1 with an error set. */
static int fx_reply(Forced *e, int64_t status, PyObject *item, const char *name) {
    int64_t keep;
    Py_ssize_t size = PyTuple_CheckExact(item) ? PyTuple_GET_SIZE(item) : 0;
    if (status == FS_DONE || (size != 2 && size != 4) ||
        exact_int(PyTuple_GET_ITEM(item, 1), &keep) != 0 ||
        keep < (status == FS_TEXT ? FS_NO_TEXT : 0)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: a reply is (tokens, keep[, words, known]) to an ask", name);
        return -1;
    }
    PyMem_Free(e->tokens);
    PyMem_Free(e->known);
    e->tokens = NULL, e->known = NULL, e->ntokens = 0, e->nwords = 0, e->nknown = 0;
    if (fx_tokens(PyTuple_GET_ITEM(item, 0), e, name) != 0) return -1;
    if (size == 4 &&
        fx_known_copy(e, PyTuple_GET_ITEM(item, 2), PyTuple_GET_ITEM(item, 3)) != 0)
        return -1;
    e->keep = keep;
    e->run = 2;
    return 0;
}

/* A text's answer from the replies table: int64 words [keep, ntokens, nwords, nentries,
   tokens..., words..., entries...] (each entry the values of the words, then its count),
   copied. 0, or -1 with an error set. */
static int fx_reply_packed(Forced *e, PyObject *packed) {
    Py_ssize_t size = PyBytes_GET_SIZE(packed) / (Py_ssize_t)sizeof(int64_t);
    int64_t head[4];
    int ok = PyBytes_GET_SIZE(packed) % (Py_ssize_t)sizeof(int64_t) == 0 && size >= 4;
    if (ok) memcpy(head, PyBytes_AS_STRING(packed), sizeof(head));
    ok = ok && head[0] >= FS_NO_TEXT && head[1] >= 0 && head[2] >= 0 && head[3] >= 0 &&
         head[1] <= size && head[2] <= size && head[3] <= size &&
         4 + head[1] + head[2] + head[3] * (head[2] + 1) == size;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "forced text replies: a malformed entry");
        return -1;
    }
    PyMem_Free(e->tokens);
    PyMem_Free(e->known);
    e->known = NULL, e->nwords = 0, e->nknown = 0, e->ntokens = 0;
    const int64_t *v = (const int64_t *)PyBytes_AS_STRING(packed) + 4;
    if ((e->tokens = copy_int64(v, (Py_ssize_t)head[1])) == NULL) return -1;
    e->ntokens = (Py_ssize_t)head[1];
    Py_ssize_t rest = size - 4 - e->ntokens;
    if (rest > 0) {
        if ((e->known = copy_int64(v + e->ntokens, rest)) == NULL) return -1;
        e->nwords = (Py_ssize_t)head[2], e->nknown = (Py_ssize_t)head[3];
    }
    e->keep = head[0];
    e->run = 2;
    return 0;
}

/* After a phase, with the GIL: every request that asked for a forced text the replies table
   answers gets that answer and runs again; the others stop (asked, or done). The count that
   run again, or -1 with an error set. */
static Py_ssize_t fx_resolve(Phase *p) {
    Py_ssize_t again = 0;
    for (Py_ssize_t c = 0; c < p->count; c++) {
        Forced *e = &p->entries[c];
        e->run = 0;
        if (p->replies == NULL || e->state[FS_STATUS] != FS_TEXT) continue;
        PyObject *key = PyBytes_FromStringAndSize(e->text, (Py_ssize_t)e->ntext);
        if (key == NULL) return -1;
        PyObject *reply = PyDict_GetItemWithError(p->replies, key);
        Py_DECREF(key);
        if (reply == NULL) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        if (!PyBytes_CheckExact(reply)) {
            PyErr_SetString(PyExc_ValueError, "forced text replies: an entry is not bytes");
            return -1;
        }
        Py_INCREF(reply);
        int bad = fx_reply_packed(e, reply);
        Py_DECREF(reply);
        if (bad) return -1;
        again++; /* the text stays: a stability ask names it */
    }
    return again;
}

/* Phases until every request is done or asks what the replies table does not answer (or one
   fails). 0, or -1 with an error set (matchers may be held: see the state). */
static int fx_loop(Phase *p) {
    for (;;) {
        fx_run(p);
        if (p->failed >= 0) return 0;
        Py_ssize_t again = fx_resolve(p);
        if (again < 0) return -1;
        if (again == 0) return 0;
    }
}

/* The forced text a request asked last: a str, or bytes when not whole UTF-8 characters
   (xgrammar 0.2.8: the caller cuts). NULL with an error set. */
static PyObject *fx_text_object(const Forced *e) {
    PyObject *text = PyUnicode_DecodeUTF8(e->text, (Py_ssize_t)e->ntext, "strict");
    if (text == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        text = PyBytes_FromStringAndSize(e->text, (Py_ssize_t)e->ntext);
    }
    return text;
}

/* (asks, failed, message, drafts) after the phases: asks one per request (see the top), None
   when none asks; drafts, when every request is done, a list per request of its drafts
   (out[c, :count]), else None. */
static PyObject *phase_result(Phase *p) {
    PyObject *asks = PyList_New(p->count);
    if (asks == NULL) return NULL;
    int asked = 0;
    for (Py_ssize_t c = 0; c < p->count; c++) {
        Forced *e = &p->entries[c];
        PyObject *ask = Py_None;
        int64_t status = e->state[FS_STATUS];
        if (status == FS_TEXT || status == FS_STABLE) {
            /* a stability ask names its text, or None when the caller gave its tokens (the
               text then being the one it was asked last for this request) */
            ask = e->text == NULL ? Py_NewRef(Py_None) : fx_text_object(e);
            if (ask != NULL && status == FS_STABLE) Py_SETREF(ask, PyTuple_Pack(1, ask));
            if (ask == NULL) {
                Py_DECREF(asks);
                return NULL;
            }
            asked = 1;
        } else {
            Py_INCREF(ask);
        }
        PyList_SET_ITEM(asks, c, ask);
    }
    PyObject *message = NULL, *drafts = NULL;
    if (p->failed >= 0) {
        const char *text = p->error ? p->error : "xgrammar failed";
        message = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
        if (message == NULL) goto fail;
    } else if (!asked) {
        drafts = PyList_New(p->count);
        if (drafts == NULL) goto fail;
        for (Py_ssize_t c = 0; c < p->count; c++) {
            Forced *e = &p->entries[c];
            Py_ssize_t n = (Py_ssize_t)e->state[FS_COUNT];
            PyObject *row = PyList_New(n);
            if (row == NULL) goto fail;
            PyList_SET_ITEM(drafts, c, row);
            for (Py_ssize_t j = 0; j < n; j++) {
                PyObject *t = PyLong_FromLongLong(e->out[j]);
                if (t == NULL) goto fail;
                PyList_SET_ITEM(row, j, t);
            }
        }
    }
    if (!asked) Py_SETREF(asks, Py_NewRef(Py_None));
    return Py_BuildValue("(NnNN)", asks, p->failed, message ? message : Py_NewRef(Py_None),
                         drafts ? drafts : Py_NewRef(Py_None));
fail:
    Py_DECREF(asks);
    Py_XDECREF(drafts);
    Py_XDECREF(message);
    return NULL;
}

/* The replies table argument: a dict, or None (every text asked). */
static int fx_replies(Phase *p, PyObject *replies) {
    if (replies == Py_None) return 0;
    if (!PyDict_CheckExact(replies)) {
        PyErr_SetString(PyExc_TypeError, "xgrammar_forced: the replies table must be a dict");
        return -1;
    }
    p->replies = replies;
    return 0;
}

static PyObject *xgrammar_forced_start(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *matchers, *drafts, *content_ends, *replies, *objs[3];
    if (!PyArg_ParseTuple(args, "OOOOOOO", &matchers, &drafts, &content_ends, &objs[0], &objs[1],
                          &objs[2], &replies))
        return NULL;
    Phase p;
    Array a[3] = {0};
    PyObject *result = NULL;
    int ready = phase_init(&p, matchers, objs, a);
    if (ready <= 0) {
        if (ready == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    if (fx_replies(&p, replies) != 0) goto done;
    Py_ssize_t nd, ne;
    PyObject *const *rows = sequence_items(drafts, &nd);
    PyObject *const *ends = sequence_items(content_ends, &ne);
    if (nd < 0 || ne < 0 || nd != p.count || ne != p.count) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_forced_start: one draft list and one flag "
                                          "per request");
        goto done;
    }
    for (Py_ssize_t c = 0; c < p.count; c++) {
        Forced *e = &p.entries[c];
        if (fx_tokens(rows[c], e, "xgrammar_forced_start") != 0) goto done;
        int flag = PyObject_IsTrue(ends[c]);
        if (flag < 0) goto done;
        e->keep = flag;
        e->run = 1;
        e->state[FS_STATUS] = FS_DONE, e->state[FS_HELD] = 0, e->state[FS_MASK] = 0;
    }
    if (fx_loop(&p) == 0) result = phase_result(&p);
done:
    phase_clear(&p);
    for (int i = 0; i < 3; i++) array_release(&a[i]);
    return result;
}

static PyObject *xgrammar_forced_step(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *matchers, *replies, *table, *objs[3];
    if (!PyArg_ParseTuple(args, "OOOOOO", &matchers, &replies, &objs[0], &objs[1], &objs[2],
                          &table))
        return NULL;
    Phase p;
    Array a[3] = {0};
    PyObject *result = NULL;
    int ready = phase_init(&p, matchers, objs, a);
    if (ready <= 0) {
        if (ready == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    if (fx_replies(&p, table) != 0) goto done;
    Py_ssize_t nr;
    PyObject *const *items = sequence_items(replies, &nr);
    if (nr != p.count) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_forced_step: one reply per request");
        goto done;
    }
    for (Py_ssize_t c = 0; c < p.count; c++) {
        Forced *e = &p.entries[c];
        int64_t status = e->state[FS_STATUS];
        if (items[c] == Py_None) {
            if (status != FS_DONE) {
                PyErr_SetString(PyExc_ValueError, "xgrammar_forced_step: an ask not answered");
                goto done;
            }
            continue;
        }
        if (fx_reply(e, status, items[c], "xgrammar_forced_step") != 0) goto done;
    }
    if (fx_loop(&p) == 0) result = phase_result(&p);
done:
    phase_clear(&p);
    for (int i = 0; i < 3; i++) array_release(&a[i]);
    return result;
}

/* Row c of the drafts for xgrammar_forced_run: an exact list or tuple of exact ints, copied
   (ids that do not fit int64 are -1: refused). 1, 0 when it is anything else (no error set),
   -1 with an error set. */
static int fx_tokens_exact(PyObject *obj, Forced *e) {
    Py_ssize_t n;
    PyObject *const *items = sequence_items(obj, &n);
    if (n < 0) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyLong_CheckExact(items[i])) return 0;
    return fx_tokens(obj, e, "xgrammar_forced_run") == 0 ? 1 : -1;
}

/* Enter every request's matcher in the held table under `token`: 1, or 0 when another build
   holds one or one is listed twice (what this call entered is taken out again), or -1 with an
   error set. No Python code runs between a test and its entry (the keys are exact ints). */
static int fx_hold(Phase *p, PyObject *token) {
    if (env_held == NULL) return 0;
    Py_ssize_t c = 0;
    int outcome = 1;
    for (; c < p->count; c++) {
        PyObject *key = PyLong_FromVoidPtr(p->entries[c].matcher);
        if (key == NULL) {
            outcome = -1;
            break;
        }
        PyObject *holder = PyDict_GetItemWithError(env_held, key);
        if (holder != NULL || PyErr_Occurred()) {
            Py_DECREF(key);
            outcome = PyErr_Occurred() ? -1 : 0;
            break;
        }
        int bad = PyDict_SetItem(env_held, key, token);
        Py_DECREF(key);
        if (bad) {
            outcome = -1;
            break;
        }
    }
    if (outcome == 1) return 1;
    for (Py_ssize_t k = 0; k < c; k++) { /* what this call entered */
        PyObject *key = PyLong_FromVoidPtr(p->entries[k].matcher);
        if (key == NULL) break;
        if (PyDict_GetItemWithError(env_held, key) == token) PyDict_DelItem(env_held, key);
        Py_DECREF(key);
    }
    if (outcome == 0) PyErr_Clear();
    return outcome;
}

/* forced_drafts' common case in one call: xgrammar matchers the library probed, drafts as
   exact lists of exact ints, one limit for all (in the state rows). Declines (None, nothing
   held or moved) for anything else, or when another build holds a matcher or one is listed
   twice: the caller's checked path serves (and names what is wrong). Otherwise the matchers
   stay held under `token` until xgrammar_forced_release. */
static void fx_roll_back_all(Phase *p);

static PyObject *xgrammar_forced_run(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *matchers, *drafts, *limits, *token, *block, *replies;
    Py_ssize_t cap, words;
    if (!PyArg_ParseTuple(args, "OOOOOnnO", &matchers, &drafts, &limits, &token, &block, &cap,
                          &words, &replies))
        return NULL;
    Phase p;
    Array a = {0};
    PyObject *result = NULL;
    int ready = phase_block(&p, matchers, block, cap, words, limits, &a);
    if (ready > 0 && fx_replies(&p, replies) != 0) ready = -1;
    Py_ssize_t nd = -1;
    PyObject *const *rows = ready > 0 ? sequence_items(drafts, &nd) : NULL;
    if (ready > 0 && nd != p.count) ready = 0;
    for (Py_ssize_t c = 0; ready > 0 && c < p.count; c++) {
        Forced *e = &p.entries[c];
        ready = fx_tokens_exact(rows[c], e);
        e->keep = 0;
        e->run = 1;
    }
    if (ready > 0) ready = fx_hold(&p, token);
    if (ready <= 0) {
        if (ready == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    if (fx_loop(&p) == 0) result = phase_result(&p);
    if (result == NULL) fx_roll_back_all(&p); /* raising: nothing left moved */
done:
    phase_clear(&p);
    array_release(&a);
    return result;
}

/* Every request's matcher back where it was (an error is being raised: xgrammar's own
   errors here are dropped). */
static void fx_roll_back_all(Phase *p) {
    for (Py_ssize_t c = 0; c < p->count; c++) {
        Forced *e = &p->entries[c];
        char *ignored = NULL;
        if (e->state != NULL && e->state[FS_HELD] > 0 &&
            ffi_rollback(&e->arg, e->state[FS_HELD], &ignored) == 0)
            e->state[FS_HELD] = 0;
        free(ignored);
    }
}

/* Take out of the held table what xgrammar_forced_run entered under `token`. Never raises
   for a matcher that is not held (any more). */
static PyObject *xgrammar_forced_release(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *token, *matchers;
    if (!PyArg_ParseTuple(args, "OO", &token, &matchers)) return NULL;
    Py_ssize_t n;
    PyObject *const *items = sequence_items(matchers, &n);
    if (n < 0) {
        PyErr_SetString(PyExc_TypeError, "xgrammar_forced_release: a list or tuple of matchers");
        return NULL;
    }
    if (env_held == NULL) Py_RETURN_NONE;
    Py_INCREF(matchers);
    for (Py_ssize_t c = 0; c < n; c++) {
        PyObject *key = PyLong_FromVoidPtr(items[c]);
        if (key == NULL) {
            Py_DECREF(matchers);
            return NULL;
        }
        PyObject *holder = PyDict_GetItemWithError(env_held, key);
        if (holder == token && PyDict_DelItem(env_held, key) != 0) PyErr_Clear();
        PyErr_Clear();
        Py_DECREF(key);
    }
    Py_DECREF(matchers);
    Py_RETURN_NONE;
}
