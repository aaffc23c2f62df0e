/* llguidance's matchers walked from C: llguidance_walk, the library's walk of one request's
   verify tree (or chain) over an llguidance.LLMatcher, with the rules of the Python walk
   (portable_spec/engines/walk.py and llguidance.py) and none of its interpreter work per node.

   llguidance exports C functions only for its own C matcher type, not for the Python
   LLMatcher that engines hold: the matcher's methods are called through the method protocol
   with the GIL held (llguidance releases it itself while it computes a mask). The caller
   holds the matcher (a build's matchers are in the held table); the links and tokens are
   private copies, checked to form a tree before the first call, and the rows are held for
   the whole walk. Python code runs inside every call (another thread with it): nothing read
   from the caller is read again after a call.

   A part of module.c (one translation unit): it uses arrays.c (exact_int, sequence_items,
   Array) and kernels.c (the row and link kernels). */

static PyObject *s_fill_row, *s_try_consume, *s_is_stopped, *s_is_error, *s_rollback,
    *s_stop_reason, *s_ended;

static int intern_llguidance_names(void) {
#define INTERN(var, text) \
    if (var == NULL && (var = PyUnicode_InternFromString(text)) == NULL) return -1
    INTERN(s_fill_row, "unsafe_compute_mask_ptr");
    INTERN(s_try_consume, "try_consume_tokens");
    INTERN(s_is_stopped, "is_stopped");
    INTERN(s_is_error, "is_error");
    INTERN(s_rollback, "rollback");
    INTERN(s_stop_reason, "stop_reason");
    INTERN(s_ended, "EndOfSentence");
#undef INTERN
    return 0;
}

/* A new list of the ints chain[0..n). */
static PyObject *int_list(const int64_t *chain, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++) {
        PyObject *t = PyLong_FromLongLong(chain[i]);
        if (t == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, t);
    }
    return list;
}

/* matcher.name(*args): the result as an int64 (bools 0/1) into *out (NULL: ignored). 0, or -1
   with an error set (a result that is not an int is a TypeError). */
static int call_int(PyObject *matcher, PyObject *name, PyObject *const *args, size_t nargs,
                    int64_t *out) {
    PyObject *stack[4] = {matcher, NULL, NULL, NULL};
    for (size_t i = 0; i < nargs && i < 3; i++) stack[i + 1] = args[i];
    PyObject *result = PyObject_VectorcallMethod(name, stack, 1 + nargs, NULL);
    if (result == NULL) return -1;
    int ok = 0;
    if (out != NULL) {
        if (PyBool_Check(result)) *out = result == Py_True;
        else if (exact_int(result, out) != 0) ok = -1;
    }
    Py_DECREF(result);
    if (ok != 0) PyErr_SetString(PyExc_TypeError, "llguidance returned a non-integer");
    return ok;
}

/* Whether the matcher's stop reason is the end token's: 1, 0, or -1 with an error set. */
static int llg_ended(PyObject *matcher) {
    PyObject *stack[1] = {matcher};
    PyObject *reason = PyObject_VectorcallMethod(s_stop_reason, stack, 1, NULL);
    if (reason == NULL) return -1;
    int ended = PyUnicode_Check(reason) ? PyUnicode_Compare(reason, s_ended) == 0 : -1;
    Py_DECREF(reason);
    if (ended < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "llguidance's stop_reason() is not a str");
    return ended;
}

static int llg_rollback(PyObject *matcher, Py_ssize_t count) {
    PyObject *n = PyLong_FromSsize_t(count);
    int64_t done = 0;
    int failed = n == NULL || call_int(matcher, s_rollback, &n, 1, &done) != 0;
    Py_XDECREF(n);
    if (!failed && !done) {
        PyErr_SetString(PyExc_RuntimeError, "llguidance refused to roll its tokens back");
        failed = 1;
    }
    return failed ? -1 : 0;
}

/* After an error: the matcher's `count` tokens rolled back, the error kept (the first one
   raised is the one reported; the rollback's own, if any, is dropped). */
static void llg_rollback_after_error(PyObject *matcher, Py_ssize_t count) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *raised = PyErr_GetRaisedException();
    if (llg_rollback(matcher, count) != 0) PyErr_Clear();
    PyErr_SetRaisedException(raised);
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (llg_rollback(matcher, count) != 0) PyErr_Clear();
    PyErr_Restore(type, value, traceback);
#endif
}

/* One request's walk: the matcher, its rows and what the walk keeps per node. */
typedef struct {
    PyObject *matcher, *one, *nbytes; /* a one-item list for the token; the row's bytes */
    int32_t *rows;
    Py_ssize_t words;
    uint8_t *stopped; /* per node: the grammar was complete there (only the end token next) */
    Py_ssize_t held;  /* tokens the matcher holds past its start */
    uint8_t *accepted; /* NULL, or per node: a child of a live node its parent's row allows */
} LlgWalk;

static int llg_fill(LlgWalk *w, Py_ssize_t node) {
    PyObject *where = PyLong_FromVoidPtr(w->rows + node * w->words);
    if (where == NULL) return -1;
    PyObject *args[2] = {where, w->nbytes};
    int status = call_int(w->matcher, s_fill_row, args, 2, NULL);
    Py_DECREF(where);
    return status;
}

enum { LLG_REFUSED, LLG_LIVE, LLG_ENDED_HELD, LLG_ENDED_FREE };

/* `token` (its parent's row allows it) taken at `node`: an outcome above, or -1 with an
   error set (the token rolled back if it was consumed). The Python walk's take_token. */
static int llg_take(LlgWalk *w, int64_t token, Py_ssize_t parent, Py_ssize_t node) {
    if (w->stopped[parent]) return LLG_ENDED_FREE; /* the end token of a complete grammar */
    PyObject *t = PyLong_FromLongLong(token);
    if (t == NULL || PyList_SetItem(w->one, 0, t) != 0) return -1; /* (steals t) */
    int64_t taken = 0, stopped = 0;
    if (call_int(w->matcher, s_try_consume, &w->one, 1, &taken) != 0) return -1;
    if (taken != 1) return LLG_REFUSED;
    int ended = 0;
    if (call_int(w->matcher, s_is_stopped, NULL, 0, &stopped) != 0 ||
        (stopped && (ended = llg_ended(w->matcher)) < 0)) {
        llg_rollback_after_error(w->matcher, 1);
        return -1;
    }
    if (ended) return LLG_ENDED_HELD;
    w->stopped[node] = (uint8_t)stopped;
    return LLG_LIVE;
}

/* Node v's children pushed (the first on top) as (node, parent, depth), the stack holding at
   most n entries (links checked to form a tree never reach that); their count. */
static Py_ssize_t llg_push(int64_t *stack, Py_ssize_t *top, Py_ssize_t n, const int64_t *nt,
                           const int64_t *ns, Py_ssize_t v, int64_t depth) {
    Py_ssize_t first = *top, count = 0;
    for (int64_t c = nt[v]; c >= 0 && c < n && *top < n; c = ns[c], count++) {
        stack[3 * *top] = c;
        stack[3 * *top + 1] = v;
        stack[3 * *top + 2] = depth;
        (*top)++;
    }
    for (Py_ssize_t i = 0; i < count / 2; i++) { /* reversed: the first child on top */
        for (int k = 0; k < 3; k++) {
            int64_t tmp = stack[3 * (first + i) + k];
            stack[3 * (first + i) + k] = stack[3 * (*top - 1 - i) + k];
            stack[3 * (*top - 1 - i) + k] = tmp;
        }
    }
    return count;
}

/* The depth-first walk of one request from a live root (row 0 filled): the Python walk's
   walk_tree. `stack` has room for 3 * n. 0, or -1 with an error set; the matcher holds
   w->held tokens past its start either way (the caller rolls them back). */
static int llg_descend(LlgWalk *w, const int64_t *nt, const int64_t *ns, const int64_t *draft,
                       Py_ssize_t n, int64_t limit, int64_t *stack, uint8_t *filled,
                       Py_ssize_t *checked, Py_ssize_t *rejected) {
    Py_ssize_t top = 0;
    *checked += llg_push(stack, &top, n, nt, ns, 0, 1);
    while (top > 0) {
        top--;
        Py_ssize_t node = (Py_ssize_t)stack[3 * top], parent = (Py_ssize_t)stack[3 * top + 1];
        Py_ssize_t depth = (Py_ssize_t)stack[3 * top + 2];
        int64_t token = draft[node];
        if (token < 0 || token >= limit || !ps_row_allows(w->rows + parent * w->words, token,
                                                           w->words)) {
            (*rejected)++;
            continue;
        }
        if (w->accepted != NULL) w->accepted[node] = 1;
        if (w->held >= depth) { /* leave the previous sibling's subtree */
            if (llg_rollback(w->matcher, w->held - depth + 1) != 0) return -1;
            w->held = depth - 1;
        }
        int outcome = llg_take(w, token, parent, node);
        if (outcome < 0) return -1;
        if (outcome == LLG_REFUSED) { /* the matcher disagrees with its own mask */
            (*rejected)++;
            continue;
        }
        if (outcome != LLG_ENDED_FREE) w->held = depth;
        if (outcome != LLG_LIVE) continue; /* terminated: nothing below is walked */
        if (llg_fill(w, node) != 0) return -1;
        filled[node] = 1;
        *checked += llg_push(stack, &top, n, nt, ns, node, depth + 1);
    }
    return 0;
}

/* The walk of one request over private copies of its links and tokens: 0 with filled[],
   *checked and *rejected set, or -1 with an error set. The matcher ends where it started. */
static int llg_walk(LlgWalk *w, const int64_t *nt, const int64_t *ns, const int64_t *draft,
                    Py_ssize_t n, int64_t limit, uint8_t *filled, Py_ssize_t *checked,
                    Py_ssize_t *rejected) {
    int ended = llg_ended(w->matcher);
    if (ended != 0) return ended < 0 ? -1 : 0; /* terminated: nothing is written */
    int64_t stopped = 0;
    if (call_int(w->matcher, s_is_stopped, NULL, 0, &stopped) != 0 || llg_fill(w, 0) != 0)
        return -1;
    w->stopped[0] = (uint8_t)stopped;
    filled[0] = 1;
    int64_t *stack = PyMem_Malloc(sizeof(int64_t) * 3 * (size_t)n);
    if (stack == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int status = llg_descend(w, nt, ns, draft, n, limit, stack, filled, checked, rejected);
    PyMem_Free(stack);
    if (w->held > 0 && status != 0)
        llg_rollback_after_error(w->matcher, w->held);
    else if (w->held > 0 && llg_rollback(w->matcher, w->held) != 0)
        status = -1;
    return status;
}

/* Chain links of n nodes: node i's child i + 1, no siblings. */
static void llg_chain_links(int64_t *next, int64_t *sibling, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        next[i] = i + 1 < n ? i + 1 : -1;
        sibling[i] = -1;
    }
}

/* Whether n nodes' links form a verify tree; `scratch` has room for 9 bytes per node. */
static int llg_tree_valid(const int64_t *next, const int64_t *sibling, int64_t n, void *scratch) {
    int32_t *indegree = scratch, *queue = indegree + n;
    return ps_links_valid(next, sibling, n, indegree, queue, (uint8_t *)(queue + n));
}

/* A caller's list or tuple of n exact ints copied into out[0..n): 0, or -1 with a TypeError. */
static int copy_ints(PyObject *obj, int64_t *out, Py_ssize_t n, const char *name) {
    Py_ssize_t k;
    PyObject *const *items = sequence_items(obj, &k);
    for (Py_ssize_t i = 0; k == n && i < n; i++) /* no Python code runs while it is read */
        if (exact_int(items[i], &out[i]) != 0) k = -1;
    if (k != n) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of %zd ints", name, n);
        return -1;
    }
    return 0;
}

/* Private copies of one request's links and tokens (a chain's links made here), checked to
   form a tree: 0, or -1 with an error set. `block` gets 3 * n int64 (links, then tokens). */
static int llg_copy(PyObject *nt, PyObject *ns, PyObject *draft, int chain, Py_ssize_t n,
                    int64_t *block) {
    int64_t *next = block, *sibling = block + n, *tokens = block + 2 * n;
    if (copy_ints(draft, tokens, n, "draft") != 0) return -1;
    if (chain) {
        llg_chain_links(next, sibling, n);
        return 0;
    }
    if (copy_ints(nt, next, n, "next_token") != 0 || copy_ints(ns, sibling, n, "next_sibling"))
        return -1;
    void *scratch = PyMem_Malloc((size_t)n * (2 * sizeof(int32_t) + 1));
    if (scratch == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int ok = llg_tree_valid(next, sibling, n, scratch);
    PyMem_Free(scratch);
    if (!ok) PyErr_SetString(PyExc_ValueError, "the links do not form a verify tree");
    return ok ? 0 : -1;
}

/* A list of n bools from flags[0..n), or NULL with an error set. */
static PyObject *bool_list(const uint8_t *flags, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++)
        PyList_SET_ITEM(list, i, Py_NewRef(flags[i] ? Py_True : Py_False));
    return list;
}

static PyObject *llguidance_walk(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *matcher, *nt, *ns, *draft, *rows;
    long long limit;
    int chain;
    if (!PyArg_ParseTuple(args, "OOOOOLp", &matcher, &nt, &ns, &draft, &rows, &limit, &chain))
        return NULL;
    if (intern_llguidance_names() != 0) return NULL;
    Array view;
    if (array_get(rows, &view, 1, 'i', 4, 2, "rows") != 0) return NULL;
    Py_ssize_t n = view.view.shape[0], words = view.view.shape[1], checked = 0, rejected = 0;
    LlgWalk w = {matcher, PyList_New(1), PyLong_FromSsize_t(4 * words),
                 (int32_t *)view.view.buf, words, PyMem_Calloc((size_t)n + 1, 2), 0, NULL};
    int64_t *block = PyMem_Malloc(sizeof(int64_t) * 3 * (size_t)(n > 0 ? n : 1));
    PyObject *result = NULL;
    if (w.one == NULL || w.nbytes == NULL || w.stopped == NULL || block == NULL) {
        PyErr_NoMemory();
    } else if (n > 0 && PyList_SetItem(w.one, 0, PyLong_FromLong(0)) == 0 &&
               llg_copy(nt, ns, draft, chain, n, block) == 0) {
        uint8_t *filled = w.stopped + n + 1;
        Py_INCREF(matcher);
        if (llg_walk(&w, block, block + n, block + 2 * n, n, (int64_t)limit, filled, &checked,
                     &rejected) == 0) {
            PyObject *flags = bool_list(filled, n);
            if (flags != NULL) result = Py_BuildValue("Nnn", flags, checked, rejected);
        }
        Py_DECREF(matcher);
    } else if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "a walk needs at least the root row");
    }
    PyMem_Free(block);
    PyMem_Free(w.stopped);
    Py_XDECREF(w.one);
    Py_XDECREF(w.nbytes);
    array_release(&view);
    return result;
}

/* One entry of a batch walked from private copies of its links and tokens (n nodes) into
   `rows` (n rows): the rows it does not fill written all-allowed, `live` (NULL: none) the
   filled ones, `accepted` (NULL: none) the root and each child its live parent's row allows;
   counts into counts[0..2). 0, or -1 with an error set (the matcher back in its state). */
static int llg_entry(LlgWalk *w, const int64_t *next, const int64_t *sibling,
                     const int64_t *tokens, Py_ssize_t n, int64_t limit, int32_t *rows,
                     uint8_t *filled, uint8_t *live, uint8_t *accepted, int64_t *counts) {
    w->rows = rows;
    w->held = 0;
    w->accepted = accepted;
    memset(w->stopped, 0, (size_t)n);
    memset(filled, 0, (size_t)n);
    if (accepted != NULL) {
        memset(accepted, 0, (size_t)n);
        accepted[0] = 1; /* the root */
    }
    Py_ssize_t checked = 0, rejected = 0;
    if (llg_walk(w, next, sibling, tokens, n, limit, filled, &checked, &rejected) != 0) return -1;
    counts[0] = checked;
    counts[1] = rejected;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!filled[i]) ps_fill_rows(rows, w->words, i, i + 1, NULL, 0);
        if (live != NULL) live[i] = filled[i];
    }
    return 0;
}
