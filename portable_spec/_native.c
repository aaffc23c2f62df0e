/*
 * portable_spec._native: the index work of the mask build, without the GIL.
 *
 * Its functions (links are one request's first-child / next-sibling arrays):
 *
 *   links_valid(next_token, next_sibling) -> bool
 *       The link rules of portable_spec.topology for a C-contiguous int64 [batch, nodes]
 *       pair: every link in [-1, nodes), no link to the root, no sibling of the root, at most
 *       one link into any node, no cycle (also among nodes the root does not reach). It only
 *       answers yes or no; the Python validator explains a "no".
 *
 *   repair_rows(rows, next_token, next_sibling, draft, limit, stop_ids, root_state[, valid])
 *       -> (kept, checked, rejected)
 *       After xgrammar's traverse_draft_tree filled `rows` (int32 [nodes, words]): decide from
 *       node indices which nodes keep their row (accepted and not terminated: every node on
 *       the root path has its token in [0, limit), not a stop token, and its bit set in its
 *       parent's row) and write all-allowed (-1) into every other row. `root_state` is 1 when
 *       the matcher was live, 0 when it had terminated, -1 to read it off row 0 (xgrammar
 *       zeroes row 0 of a terminated matcher; a live matcher's row 0 allows some token).
 *       Returns the number of rows kept, of draft nodes whose token the grammar was asked
 *       about (children of kept nodes) and of those it refused (token out of range or its bit
 *       clear; an accepted stop token is not a refusal). The links must be valid
 *       (links_valid); they are still bounds-checked. `valid` (bool [nodes]), when given,
 *       receives which nodes the grammar accepts: the root, and every child of a kept node
 *       whose token is in range with its bit set (stop tokens included).
 *
 *   keep_rows(rows, next_token, next_sibling, draft, limit, stop_ids, root_state, kept)
 *       -> (kept, checked, rejected)
 *       The decision of repair_rows without its writes: `rows` is only read, and the nodes
 *       that keep their row are written in ascending order into `kept` (int32 [nodes]); the
 *       first `kept` entries are valid. For the compact layout, which copies exactly those
 *       rows out and never writes an all-allowed one.
 *
 *   repair_chains(rows, tokens, spans, limit, stop_ids, repeat) -> (checked, rejected)
 *       repair_rows for many chains in one call, after xgrammar's traverse_draft_tree filled
 *       each chain's rows: `spans` (int64 [chains, 4]) gives per chain its first row in
 *       `rows` (int32 [R, words]), its first token in `tokens` (int64 [T], root first), its
 *       length (>= 1) and whether its matcher was live (0: every row all-allowed). A chain's
 *       rows are kept up to its first draft that is out of [0, limit), whose bit is clear in
 *       the row before it, or that is a stop token; every later row is written all-allowed,
 *       or, with `repeat` and a refused (not a stop) draft, a copy of the row before the
 *       refused draft (vLLM's rule). Spans are bounds-checked before anything is written.
 *
 *   take_rows(source, index, dest[, numbers, base])
 *       dest[i, :w] = source[index[i], :w] for every i, w = min(source width, dest width);
 *       the words of dest past the source's width are set to 0; numbers[i] = index[i] + base
 *       when given (the rows' numbers in the whole mask). int32 rows; `index` int32 in
 *       [0, rows of source) (checked: ValueError, nothing written).
 *
 *   xgrammar_bind(call, move_error, decref, traverse, is_terminated, type_index)
 *       Take xgrammar's matcher methods through tvm-ffi's C ABI: the addresses of
 *       TVMFFIFunctionCall, TVMFFIErrorMoveFromRaised and TVMFFIObjectDecRef, the function
 *       handles of GrammarMatcher.traverse_draft_tree and .is_terminated, and the matcher
 *       type's index. Called once by portable_spec.engines.xgrammar after it checked the
 *       methods' signatures; until then the two functions below raise RuntimeError.
 *
 *   xgrammar_traverse(matcher, next_token, next_sibling, draft, rows) -> None
 *       One request's traverse_draft_tree with the GIL released for the whole call (no
 *       argument conversion under it): `matcher` is the handle of the matcher's tvm-ffi
 *       object, the other arguments as xgrammar takes them (int64 [nodes] links and tokens,
 *       int32 [nodes, words] rows). RuntimeError carrying xgrammar's message when it refuses.
 *
 *   walk_chains(rows, tokens, spans, limit, stop_ids, repeat[, valid[, seconds]])
 *       -> (checked, rejected, failed, message)
 *       Walk and repair many chains in one call, the GIL released: `spans` as for
 *       repair_chains, the fourth column a matcher handle (0: no matcher, every row
 *       all-allowed). A live matcher's chain is filled by traverse_draft_tree, then repaired
 *       as repair_chains does (`spans` may also be a list of 4-tuples); `valid` (bool [R])
 *       receives which nodes the grammar accepts (the root, then each draft whose bit is set
 *       in the row before it, up to the first refused one; a stop token is accepted and ends
 *       the chain; only the root of a terminated or absent matcher). Stops at the first
 *       matcher xgrammar refuses: `failed` is its chain's index (-1 when none) and `message`
 *       xgrammar's words; the chains before it are walked and repaired, the ones from it on
 *       untouched.
 *       `seconds` (float64 [chains]), when given, receives each chain's walk and repair time.
 *
 *   walk_trees(rows, next_token, next_sibling, tokens, spans, limit, stop_ids[, valid[,
 *              seconds]]) -> (checked, rejected, failed, message)
 *       walk_chains for trees: tree c's links and tokens are next_token, next_sibling and
 *       tokens (int64 [T] each, links local to the tree) from the span's second column on,
 *       for its length; a live matcher's tree is filled by traverse_draft_tree, then
 *       repaired as repair_rows does (`valid` gets the accepted nodes); a terminated or
 *       absent matcher's rows are all-allowed, only its root accepted. Links must be valid
 *       (links_valid); they are still bounds-checked.
 *
 *   pack_chains(drafts, handles, stride, vocab_size, ends, active, rows, valid[, limit,
 *               stop_ids, seconds, repeat, plain]) -> (tokens, table, owners, walked) or None
 *       An engine's per-request draft lists (a list or tuple of lists or tuples of ints) made
 *       into walk_chains' input: `tokens` (bytes of int64, each request's root 0 then its
 *       drafts), `table` (bytes of int64 [chains, 4]) and `owners` (bytes of int64 [chains]:
 *       each chain's request), `walked` the rows in the table. Request b's rows start at
 *       b * stride (stride > 0: its chain, then all-allowed padding rows no draft reaches) or
 *       right after the previous request's chain (stride 0). `handles[b]` (list of ints) is
 *       its matcher's handle, 0 for none: every row all-allowed, every node accepted. With
 *       `active` (a list of bools, or None) request b still reasoning gets all-allowed rows
 *       up to its first draft in `ends` (int64 [E]), whose row starts its chain; a draft out
 *       of [0, vocab_size) before it ends the chain (later rows all-allowed, not accepted).
 *       Writes those rows into `rows` (int32 [R, words], R the rows of every request) and
 *       their flags into `valid` (bool [R] or None). None, with nothing written, when a draft
 *       list, a draft (not an int, or outside int64), a handle or a flag is malformed, a
 *       chain does not fit its stride or R is not the rows of the requests, or (`plain`
 *       true) a draft is negative: an engine's padding, which its caller lays out itself.
 *       With `limit` (and `stop_ids`, int64 [S]) the chains are walked and repaired in the
 *       same call, the GIL released, as walk_chains does (`repeat`: its rule); it then returns
 *       (checked, rejected, failed, message) like walk_chains, `failed` the request's index,
 *       and `seconds` (float64 [requests], when given) receives each walked request's time.
 *
 *   vllm_chains(requests, ids, spec_tokens, known, wrapper_types, rows, stride, no_ends)
 *                 -> (used, (checked, rejected, failed, message), drafts) or None
 *       vLLM's structured-output step (vLLM's own objects: its request dict, the ids, the
 *       scheduled draft lists) walked as pack_chains does with `repeat` and `plain`, into
 *       `rows[:R]` (int32 [capacity, words]; `used` is that view). Request i is
 *       requests[ids[i]]; its grammar is `.structured_output_request._grammar`, an instance
 *       of a type in `wrapper_types` (a set), and its matcher that grammar's `.matcher`;
 *       `known` maps id(grammar) to (matcher, handle, words, stop_ids, weak reference).
 *       `drafts` are the lists walked (an empty one for a request with none). None, nothing
 *       written and no matcher moved, when anything differs: a missing attribute or entry,
 *       another matcher, width or stop array, a handle of 0 or listed twice, padding, too
 *       many rows.
 *
 *   chain_masks(env, grammars, drafts, rows_per_request, vocab_size, ends, active, out,
 *               want_valid, max_rows, threshold) -> (mask, valid, failed, message, extra)
 *                                                    or None
 *       build_chain_bitmask's common call with no Python in between: `env` is (facts, empty,
 *       int32, bool, ndarray, tally, held): `facts` maps id(matcher) to (weak reference, handle,
 *       words, vocab_size, stop_ids) for every xgrammar matcher probed with a handle
 *       (stop_ids one array per distinct stop set, compared by identity), `empty` numpy's
 *       allocator with its dtypes int32 and bool, `ndarray` numpy's array type, `tally` a
 *       float64 [8] of build counters this call adds to (builds, requests, rows, summed walk
 *       seconds, wall seconds, checked nodes, refused nodes, slowest walk), `held` the dict of
 *       matchers builds started with wait=False hold (not empty: None). Every grammar None
 *       or a matcher of `facts` (one width for vocab_size, one vocabulary and one stop set,
 *       none listed twice, at least one), `drafts` lists or tuples of plain ints,
 *       rows_per_request None or an int > every list's length, `out` None (allocated) or a
 *       native int32 C-contiguous writable ndarray of exactly the rows: the rows are packed,
 *       walked and repaired as pack_chains does (`ends`, `active` its reasoning arguments).
 *       `valid` is a new bool [batch, rows_per_request] or [rows] array (want_valid) or None.
 *       Returns `failed` -1 and `extra` the list of (request, seconds) walks slower than
 *       `threshold` (None when none); `failed` >= 0: that request's matcher was refused by
 *       xgrammar (`message` its words; nothing counted). With max_rows > 0, at least that
 *       many rows and two live requests, the rows are packed but not walked: `failed` -2,
 *       `extra` (pack_chains' packed tuple, limit, stop_ids). None, nothing written and no
 *       matcher called, when anything above does not hold.
 *
 *   span_masks(env, grammars, tokens, offsets, width, vocab_size, out, want_valid, threshold)
 *       -> (mask, valid, failed, message, slow) or None
 *       chain_masks for chain trees whose tokens are already a host array: `tokens` a
 *       C-contiguous writable int64 array of every request's chain back to back (its root
 *       first), `offsets` None (request b's chain is `width` tokens from b * width) or a tuple
 *       (or list) of batch + 1 ints, where each chain starts (packed). Every grammar a matcher
 *       of `facts` (no None). The rows are the chains' own (no padding); `valid` is bool
 *       [batch, width] or [rows]. A token out of [0, vocab_size) is a refused draft.
 *
 *   tree_masks(env, grammars, next_token, next_sibling, tokens, vocab_size, out, want_valid,
 *              threshold) -> (mask, valid, failed, message, slow) or None
 *       span_masks for verify trees: the three arrays C-contiguous int64 [batch, nodes] of one
 *       shape, each request's links local to it. Links that do not form a tree (as
 *       links_valid decides) return None, nothing written: the general build says which.
 *       Every grammar None (unconstrained: all-allowed rows, every node a link reaches
 *       accepted) or a matcher of `facts`, one at least. Rows [batch * nodes], `valid` bool
 *       [batch, nodes]; rows no link reaches are all-allowed and not accepted.
 *
 *   chain_live(target, rows, tokens, usable, ended, first_word, last_word, most)
 *       -> (live, checks)
 *       After llguidance's executor wrote chains into `target` (int32 [rows, width]; request
 *       k's nodes in rows[k] of int64 [count, nodes], its drafts int64 [count, nodes - 1]):
 *       per request how many leading drafts its parents' rows allow (no more than usable[k]),
 *       and in order the (request, draft, intact, sparse) of each such draft whose own row
 *       still holds both sentinel words (first and last) or allows its own token with at most
 *       `most` nonzero words: the caller decides those on a fork. None for `ended` requests.
 *
 * Numpy arrays are read through numpy's C API when the module is built with its headers
 * (aligned, native-order, C-contiguous arrays; anything else through the buffer protocol).
 *
 * Pure index work on caller-owned buffers: the GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#ifdef PS_NUMPY
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#endif

/* A numpy array read through its fields into *view: 1 when `obj` is an aligned, native-order,
   C-contiguous ndarray (writable when asked) of integers of `itemsize` bytes (kind 'i') or of
   bools (kind '?'), its view filled with nothing to release (view->obj NULL) and the format
   'i', 'q' or '?'; 0 otherwise (nothing filled, no error). A buffer export builds a format
   string and a shape for every call: microseconds with cold caches, on every engine step. The
   caller holds a reference to `obj` for as long as it reads the view. Built without numpy's
   headers, always 0 (the buffer protocol then does the job). */
static int array_view(PyObject *obj, Py_buffer *view, int writable, char kind,
                      Py_ssize_t itemsize) {
#ifdef PS_NUMPY
    if (!PyArray_Check(obj)) return 0;
    PyArrayObject *a = (PyArrayObject *)obj;
    int type = PyArray_TYPE(a);
    const char *format;
    if (kind == '?') {
        if (type != NPY_BOOL) return 0;
        format = "?";
    } else if (type == NPY_INT || type == NPY_LONG || type == NPY_LONGLONG) {
        if (PyArray_ITEMSIZE(a) != itemsize || (itemsize != 4 && itemsize != 8)) return 0;
        format = itemsize == 8 ? "q" : "i";
    } else {
        return 0;
    }
    /* C-contiguous, aligned and in native byte order */
    if (!PyArray_ISCARRAY_RO(a) || (writable && !PyArray_ISWRITEABLE(a))) return 0;
    view->buf = PyArray_DATA(a);
    view->obj = NULL;
    view->len = PyArray_NBYTES(a);
    view->itemsize = PyArray_ITEMSIZE(a);
    view->readonly = !PyArray_ISWRITEABLE(a);
    view->ndim = PyArray_NDIM(a);
    view->format = (char *)format;
    view->shape = (Py_ssize_t *)PyArray_DIMS(a);
    view->strides = NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 1;
#else
    (void)obj, (void)view, (void)writable, (void)kind, (void)itemsize;
    return 0;
#endif
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, char kind,
                      Py_ssize_t itemsize, int ndim, const char *name) {
    if (array_view(obj, view, writable, kind, itemsize) && view->ndim == ndim) return 0;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    int kind_ok = (kind == 'i' && (*fmt == 'i' || *fmt == 'l' || *fmt == 'q'));
    if (!kind_ok || view->itemsize != itemsize || view->ndim != ndim) {
        PyErr_Format(PyExc_TypeError, "%s must be a %d-D int%d array", name, ndim,
                     (int)(itemsize * 8));
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */

static int request_links_valid(const int64_t *nt, const int64_t *ns, Py_ssize_t n,
                               int32_t *indegree, int32_t *queue, uint8_t *seen) {
    if (ns[0] != -1) return 0;
    memset(indegree, 0, sizeof(int32_t) * (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a = nt[i], b = ns[i];
        if (a < -1 || a >= n || b < -1 || b >= n || a == 0 || b == 0) return 0;
        if (a >= 0 && ++indegree[a] > 1) return 0;
        if (b >= 0 && ++indegree[b] > 1) return 0;
    }
    /* With at most one link into any node and none into the root, a walk from the root
       cannot revisit a node. */
    memset(seen, 0, (size_t)n);
    Py_ssize_t head = 0, tail = 0, reached = 0;
    queue[tail++] = 0;
    seen[0] = 1;
    while (head < tail) {
        int64_t v = queue[head++];
        reached++;
        for (int64_t c = nt[v]; c != -1; c = ns[c]) {
            if (seen[c]) return 0; /* unreachable with valid in-degrees; defensive */
            seen[c] = 1;
            queue[tail++] = (int32_t)c;
        }
    }
    if (reached == n) return 1;
    /* The unreachable part is acyclic iff a walk from its orphans covers it. */
    Py_ssize_t unreachable = n - reached, covered = 0;
    head = tail = 0;
    for (Py_ssize_t v = 0; v < n; v++)
        if (!seen[v] && indegree[v] == 0) queue[tail++] = (int32_t)v;
    while (head < tail) {
        int32_t v = queue[head++];
        if (seen[v]) continue;
        seen[v] = 1;
        covered++;
        if (nt[v] != -1 && !seen[nt[v]]) queue[tail++] = (int32_t)nt[v];
        if (ns[v] != -1 && !seen[ns[v]]) queue[tail++] = (int32_t)ns[v];
        if (tail > 2 * n) return 0; /* cannot happen with in-degree <= 1; defensive */
    }
    return covered == unreachable;
}

static PyObject *links_valid(PyObject *self, PyObject *args) {
    PyObject *nt_obj, *ns_obj;
    if (!PyArg_ParseTuple(args, "OO", &nt_obj, &ns_obj)) return NULL;
    Py_buffer nt, ns;
    if (get_buffer(nt_obj, &nt, 0, 'i', 8, 2, "next_token") != 0) return NULL;
    if (get_buffer(ns_obj, &ns, 0, 'i', 8, 2, "next_sibling") != 0) {
        PyBuffer_Release(&nt);
        return NULL;
    }
    if (nt.shape[0] != ns.shape[0] || nt.shape[1] != ns.shape[1] || nt.shape[1] < 1) {
        PyBuffer_Release(&nt);
        PyBuffer_Release(&ns);
        PyErr_SetString(PyExc_ValueError, "links must be [batch, nodes] arrays of one shape");
        return NULL;
    }
    Py_ssize_t batch = nt.shape[0], n = nt.shape[1];
    int ok = 1;
    void *scratch = malloc((size_t)n * (2 * sizeof(int32_t) + 2 * sizeof(int32_t) + 1));
    if (scratch == NULL) {
        PyBuffer_Release(&nt);
        PyBuffer_Release(&ns);
        return PyErr_NoMemory();
    }
    int32_t *indegree = (int32_t *)scratch;
    int32_t *queue = indegree + n;           /* room for 3n entries */
    uint8_t *seen = (uint8_t *)(queue + 3 * n);
    Py_BEGIN_ALLOW_THREADS
    const int64_t *a = (const int64_t *)nt.buf, *b = (const int64_t *)ns.buf;
    for (Py_ssize_t r = 0; r < batch && ok; r++)
        ok = request_links_valid(a + r * n, b + r * n, n, indegree, queue, seen);
    Py_END_ALLOW_THREADS
    free(scratch);
    PyBuffer_Release(&nt);
    PyBuffer_Release(&ns);
    return PyBool_FromLong(ok);
}

/* ---------------------------------------------------------------------------------------- */

/* Which nodes of one request keep their row: breadth first from the root, a node's test
   reads its (kept) parent's row. Fills keep[0..n) with 0/1; returns the number kept and the
   nodes checked and rejected through the pointers. No GIL needed. */
static Py_ssize_t decide_rows(const int32_t *mask, Py_ssize_t n, Py_ssize_t words,
                              const int64_t *first, const int64_t *next, const int64_t *token,
                              long long limit, const int64_t *stop, Py_ssize_t nstops,
                              int root_ok, int32_t *queue, uint8_t *keep, uint8_t *valid,
                              Py_ssize_t *checked_out, Py_ssize_t *rejected_out) {
    Py_ssize_t checked = 0, rejected = 0;
    memset(keep, 0, (size_t)n);
    if (valid != NULL) {
        memset(valid, 0, (size_t)n);
        valid[0] = 1;
    }
    if (root_ok < 0) {
        root_ok = 0;
        for (Py_ssize_t w = 0; w < words && !root_ok; w++)
            root_ok = mask[w] != 0;
    }
    Py_ssize_t tail = 0;
    if (root_ok) {
        Py_ssize_t head = 0;
        keep[0] = 1;
        queue[tail++] = 0;
        while (head < tail) {
            int32_t p = queue[head++];
            const uint32_t *parent_row = (const uint32_t *)(mask + (Py_ssize_t)p * words);
            Py_ssize_t steps = 0;
            for (int64_t c = first[p]; c >= 0 && c < n && steps < n; c = next[c], steps++) {
                int64_t t = token[c];
                int ok = t >= 0 && t < limit && ((parent_row[t >> 5] >> (t & 31)) & 1u);
                checked++;
                rejected += !ok;
                if (valid != NULL) valid[c] = (uint8_t)ok;
                for (Py_ssize_t s = 0; ok && s < nstops; s++)
                    if (stop[s] == t) ok = 0;
                if (ok && !keep[c] && tail < n) {
                    keep[c] = 1;
                    queue[tail++] = (int32_t)c;
                }
            }
        }
    }
    *checked_out = checked;
    *rejected_out = rejected;
    return tail;
}

/* A writable C-contiguous buffer of n one-byte flags (numpy bool or uint8, any shape). */
static int get_flags(PyObject *obj, Py_buffer *view, Py_ssize_t n) {
    if (array_view(obj, view, 1, '?', 1) && view->ndim >= 1 && view->len == n) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
        PyErr_SetString(PyExc_TypeError, "valid must be a C-contiguous writable buffer");
        return -1;
    }
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@' || *fmt == '|') fmt++;
    if (view->itemsize != 1 || view->ndim < 1 || view->len != n ||
        !(*fmt == '?' || *fmt == 'B' || *fmt == 'b')) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "valid must be a 1-D bool array with one entry per node");
        return -1;
    }
    return 0;
}

/* Parse the arguments shared by repair_rows and keep_rows; on success every buffer is held. */
typedef struct {
    Py_buffer rows, nt, ns, dt, stops;
    long long limit;
    int root_ok;
} RowArgs;

static void release_row_args(RowArgs *a) {
    PyBuffer_Release(&a->stops);
    PyBuffer_Release(&a->dt);
    PyBuffer_Release(&a->ns);
    PyBuffer_Release(&a->nt);
    PyBuffer_Release(&a->rows);
}

static int parse_row_args(PyObject *rows_obj, PyObject *nt_obj, PyObject *ns_obj,
                          PyObject *dt_obj, PyObject *stops_obj, int writable, RowArgs *a) {
    if (get_buffer(rows_obj, &a->rows, writable, 'i', 4, 2, "rows") != 0) return -1;
    if (get_buffer(nt_obj, &a->nt, 0, 'i', 8, 1, "next_token") != 0) goto fail_rows;
    if (get_buffer(ns_obj, &a->ns, 0, 'i', 8, 1, "next_sibling") != 0) goto fail_nt;
    if (get_buffer(dt_obj, &a->dt, 0, 'i', 8, 1, "draft") != 0) goto fail_ns;
    if (get_buffer(stops_obj, &a->stops, 0, 'i', 8, 1, "stop_ids") != 0) goto fail_dt;
    Py_ssize_t n = a->rows.shape[0], words = a->rows.shape[1];
    if (a->nt.shape[0] != n || a->ns.shape[0] != n || a->dt.shape[0] != n || n < 1 ||
        a->limit > (long long)words * 32) {
        PyErr_SetString(PyExc_ValueError, "repair_rows: inconsistent shapes or limit");
        release_row_args(a);
        return -1;
    }
    return 0;
fail_dt:
    PyBuffer_Release(&a->dt);
fail_ns:
    PyBuffer_Release(&a->ns);
fail_nt:
    PyBuffer_Release(&a->nt);
fail_rows:
    PyBuffer_Release(&a->rows);
    return -1;
}

static PyObject *repair_rows(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *nt_obj, *ns_obj, *dt_obj, *stops_obj, *valid_obj = Py_None;
    RowArgs a;
    if (!PyArg_ParseTuple(args, "OOOOLOi|O", &rows_obj, &nt_obj, &ns_obj, &dt_obj, &a.limit,
                          &stops_obj, &a.root_ok, &valid_obj))
        return NULL;
    if (parse_row_args(rows_obj, nt_obj, ns_obj, dt_obj, stops_obj, 1, &a) != 0) return NULL;
    Py_ssize_t n = a.rows.shape[0], words = a.rows.shape[1];
    Py_buffer valid_view;
    uint8_t *valid = NULL;
    if (valid_obj != Py_None) {
        if (get_flags(valid_obj, &valid_view, n) != 0) {
            release_row_args(&a);
            return NULL;
        }
        valid = (uint8_t *)valid_view.buf;
    }
    void *scratch = malloc((size_t)n * (sizeof(int32_t) + 1));
    if (scratch == NULL) {
        if (valid != NULL) PyBuffer_Release(&valid_view);
        release_row_args(&a);
        return PyErr_NoMemory();
    }
    int32_t *queue = (int32_t *)scratch;
    uint8_t *keep = (uint8_t *)(queue + n);
    Py_ssize_t kept, checked, rejected;
    Py_BEGIN_ALLOW_THREADS
    int32_t *mask = (int32_t *)a.rows.buf;
    kept = decide_rows(mask, n, words, (const int64_t *)a.nt.buf, (const int64_t *)a.ns.buf,
                       (const int64_t *)a.dt.buf, a.limit, (const int64_t *)a.stops.buf,
                       a.stops.shape[0], a.root_ok, queue, keep, valid, &checked, &rejected);
    for (Py_ssize_t v = 0; v < n; v++)
        if (!keep[v]) memset(mask + v * words, 0xff, sizeof(int32_t) * (size_t)words);
    Py_END_ALLOW_THREADS
    free(scratch);
    if (valid != NULL) PyBuffer_Release(&valid_view);
    release_row_args(&a);
    return Py_BuildValue("nnn", kept, checked, rejected);
}

static PyObject *keep_rows(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *nt_obj, *ns_obj, *dt_obj, *stops_obj, *kept_obj;
    RowArgs a;
    if (!PyArg_ParseTuple(args, "OOOOLOiO", &rows_obj, &nt_obj, &ns_obj, &dt_obj, &a.limit,
                          &stops_obj, &a.root_ok, &kept_obj))
        return NULL;
    if (parse_row_args(rows_obj, nt_obj, ns_obj, dt_obj, stops_obj, 0, &a) != 0) return NULL;
    Py_buffer out;
    if (get_buffer(kept_obj, &out, 1, 'i', 4, 1, "kept") != 0) {
        release_row_args(&a);
        return NULL;
    }
    Py_ssize_t n = a.rows.shape[0], words = a.rows.shape[1];
    if (out.shape[0] < n) {
        PyBuffer_Release(&out);
        release_row_args(&a);
        PyErr_SetString(PyExc_ValueError, "keep_rows: kept must have room for every node");
        return NULL;
    }
    void *scratch = malloc((size_t)n * (sizeof(int32_t) + 1));
    if (scratch == NULL) {
        PyBuffer_Release(&out);
        release_row_args(&a);
        return PyErr_NoMemory();
    }
    int32_t *queue = (int32_t *)scratch;
    uint8_t *keep = (uint8_t *)(queue + n);
    Py_ssize_t kept, checked, rejected;
    Py_BEGIN_ALLOW_THREADS
    kept = decide_rows((const int32_t *)a.rows.buf, n, words, (const int64_t *)a.nt.buf,
                       (const int64_t *)a.ns.buf, (const int64_t *)a.dt.buf, a.limit,
                       (const int64_t *)a.stops.buf, a.stops.shape[0], a.root_ok, queue, keep,
                       NULL, &checked, &rejected);
    int32_t *dest = (int32_t *)out.buf;
    Py_ssize_t k = 0;
    for (Py_ssize_t v = 0; v < n; v++)
        if (keep[v]) dest[k++] = (int32_t)v;
    Py_END_ALLOW_THREADS
    free(scratch);
    PyBuffer_Release(&out);
    release_row_args(&a);
    return Py_BuildValue("nnn", kept, checked, rejected);
}

/* Copy `words` int32 from `from` to `to`. Rows of the output are written once and read by
   the upload (or the caller) later, not by this thread: streaming stores skip reading the
   destination lines into the cache first, which halves the memory traffic of the copy. */
static void copy_row(int32_t *to, const int32_t *from, Py_ssize_t words) {
#if defined(__SSE2__)
    if (((uintptr_t)to & 15) == 0) {
        Py_ssize_t vectors = words / 4;
        __m128i *dst = (__m128i *)to;
        const __m128i *src = (const __m128i *)from;
        for (Py_ssize_t v = 0; v < vectors; v++) _mm_stream_si128(dst + v, _mm_loadu_si128(src + v));
        for (Py_ssize_t w = vectors * 4; w < words; w++) to[w] = from[w];
        return;
    }
#endif
    memcpy(to, from, sizeof(int32_t) * (size_t)words);
}

static PyObject *take_rows(PyObject *self, PyObject *args) {
    PyObject *src_obj, *index_obj, *dest_obj, *numbers_obj = NULL;
    Py_ssize_t base = 0;
    if (!PyArg_ParseTuple(args, "OOO|On", &src_obj, &index_obj, &dest_obj, &numbers_obj, &base))
        return NULL;
    Py_buffer src, index, dest, numbers;
    numbers.buf = NULL;
    if (get_buffer(src_obj, &src, 0, 'i', 4, 2, "source") != 0) return NULL;
    if (get_buffer(index_obj, &index, 0, 'i', 4, 1, "index") != 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (get_buffer(dest_obj, &dest, 1, 'i', 4, 2, "dest") != 0) {
        PyBuffer_Release(&index);
        PyBuffer_Release(&src);
        return NULL;
    }
    if (numbers_obj != NULL && numbers_obj != Py_None &&
        get_buffer(numbers_obj, &numbers, 1, 'i', 4, 1, "numbers") != 0) {
        PyBuffer_Release(&dest);
        PyBuffer_Release(&index);
        PyBuffer_Release(&src);
        return NULL;
    }
    int has_numbers = numbers_obj != NULL && numbers_obj != Py_None;
    Py_ssize_t n = src.shape[0], src_words = src.shape[1], k = index.shape[0];
    Py_ssize_t dest_words = dest.shape[1];
    const int32_t *which = (const int32_t *)index.buf;
    int ok = dest.shape[0] == k && (!has_numbers || numbers.shape[0] == k);
    ok = ok && base >= 0 && base + n <= INT32_MAX;
    for (Py_ssize_t i = 0; ok && i < k; i++) ok = which[i] >= 0 && which[i] < n;
    if (!ok) {
        if (has_numbers) PyBuffer_Release(&numbers);
        PyBuffer_Release(&dest);
        PyBuffer_Release(&index);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError,
                        "take_rows: dest (and numbers) need one row per index, every index a "
                        "source row");
        return NULL;
    }
    Py_ssize_t common = src_words < dest_words ? src_words : dest_words;
    Py_BEGIN_ALLOW_THREADS
    const int32_t *from = (const int32_t *)src.buf;
    int32_t *to = (int32_t *)dest.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        int32_t *row = to + i * dest_words;
        copy_row(row, from + (Py_ssize_t)which[i] * src_words, common);
        if (dest_words > common)
            memset(row + common, 0, sizeof(int32_t) * (size_t)(dest_words - common));
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streaming stores are visible before anyone reads the rows */
#endif
    if (has_numbers) {
        int32_t *out = (int32_t *)numbers.buf;
        for (Py_ssize_t i = 0; i < k; i++) out[i] = (int32_t)(which[i] + base);
    }
    Py_END_ALLOW_THREADS
    if (has_numbers) PyBuffer_Release(&numbers);
    PyBuffer_Release(&dest);
    PyBuffer_Release(&index);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* Repair one chain after its walk (the rule of repair_chains): rows kept up to the first
   draft out of [0, limit), refused by the row before it, or a stop token; every later row
   all-allowed, or with `repeat` and a refused draft a copy of the row before it. `flags`
   (NULL: none) receives which nodes the grammar accepts. Counts go to *checked and
   *rejected. No GIL needed. */
static void repair_chain(int32_t *base, const int64_t *chain, Py_ssize_t n, Py_ssize_t words,
                         int live, long long limit, const int64_t *stop, Py_ssize_t nstops,
                         int repeat, uint8_t *flags, Py_ssize_t *checked, Py_ssize_t *rejected) {
    Py_ssize_t first = 0, refused = 0;
    if (flags != NULL) {
        memset(flags, 0, (size_t)n);
        flags[0] = 1;
    }
    if (live) {
        for (first = 1; first < n; first++) {
            int64_t t = chain[first];
            const uint32_t *parent = (const uint32_t *)(base + (first - 1) * words);
            (*checked)++;
            if (!(t >= 0 && t < limit && ((parent[t >> 5] >> (t & 31)) & 1u))) {
                (*rejected)++;
                refused = 1;
                break;
            }
            if (flags != NULL) flags[first] = 1;
            int is_stop = 0;
            for (Py_ssize_t s = 0; s < nstops && !is_stop; s++) is_stop = stop[s] == t;
            if (is_stop) break;
        }
    }
    size_t width = sizeof(int32_t) * (size_t)words;
    for (Py_ssize_t v = first; v < n; v++) {
        if (repeat && refused)
            memcpy(base + v * words, base + (first - 1) * words, width);
        else
            memset(base + v * words, 0xff, width);
    }
}

static PyObject *repair_chains(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *tokens_obj, *spans_obj, *stops_obj;
    long long limit;
    int repeat;
    if (!PyArg_ParseTuple(args, "OOOLOi", &rows_obj, &tokens_obj, &spans_obj, &limit, &stops_obj,
                          &repeat))
        return NULL;
    Py_buffer rows, tokens, spans, stops;
    if (get_buffer(rows_obj, &rows, 1, 'i', 4, 2, "rows") != 0) return NULL;
    if (get_buffer(tokens_obj, &tokens, 0, 'i', 8, 1, "tokens") != 0) goto fail_rows;
    if (get_buffer(spans_obj, &spans, 0, 'i', 8, 2, "spans") != 0) goto fail_tokens;
    if (get_buffer(stops_obj, &stops, 0, 'i', 8, 1, "stop_ids") != 0) goto fail_spans;
    Py_ssize_t nrows = rows.shape[0], words = rows.shape[1], ntok = tokens.shape[0];
    Py_ssize_t chains = spans.shape[0];
    const int64_t *sp = (const int64_t *)spans.buf;
    int bad = spans.shape[1] != 4 || limit > (long long)words * 32;
    for (Py_ssize_t c = 0; c < chains && !bad; c++) {
        int64_t r = sp[4 * c], t = sp[4 * c + 1], n = sp[4 * c + 2];
        bad = r < 0 || t < 0 || n < 1 || r > nrows - n || t > ntok - n;
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "repair_chains: spans out of bounds or malformed");
        goto fail_stops;
    }
    Py_ssize_t checked = 0, rejected = 0;
    Py_BEGIN_ALLOW_THREADS
    int32_t *mask = (int32_t *)rows.buf;
    const int64_t *tok = (const int64_t *)tokens.buf, *stop = (const int64_t *)stops.buf;
    Py_ssize_t nstops = stops.shape[0];
    for (Py_ssize_t c = 0; c < chains; c++)
        repair_chain(mask + sp[4 * c] * words, tok + sp[4 * c + 1], (Py_ssize_t)sp[4 * c + 2],
                     words, sp[4 * c + 3] != 0, limit, stop, nstops, repeat, NULL, &checked,
                     &rejected);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&stops);
    PyBuffer_Release(&spans);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&rows);
    return Py_BuildValue("nn", checked, rejected);
fail_stops:
    PyBuffer_Release(&stops);
fail_spans:
    PyBuffer_Release(&spans);
fail_tokens:
    PyBuffer_Release(&tokens);
fail_rows:
    PyBuffer_Release(&rows);
    return NULL;
}


/* ---------------------------------------------------------------------------------------- */
/* xgrammar's matcher methods through tvm-ffi's C ABI (the layouts of tvm/ffi/c_api.h and
   dlpack.h, both stable ABIs). Bound at run time from Python, never linked. */

typedef struct {
    int32_t type_index;
    uint32_t zero_padding;
    union {
        int64_t v_int64;
        double v_float64;
        void *v_ptr;
    };
} FfiAny;

typedef struct {
    uint64_t ref_count;
    int32_t type_index;
    uint32_t padding;
    void *deleter;
} FfiObject;

typedef struct {
    const char *data;
    size_t size;
} FfiBytes;

typedef struct {
    FfiBytes kind, message;
} FfiErrorCell; /* follows the object header; only its first fields are read */

typedef struct {
    int32_t device_type, device_id;
} DlDevice;

typedef struct {
    uint8_t code, bits;
    uint16_t lanes;
} DlDataType;

typedef struct {
    void *data;
    DlDevice device;
    int32_t ndim;
    DlDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DlTensor;

enum { FFI_NONE = 0, FFI_BOOL = 2, FFI_FLOAT = 3, FFI_DLTENSOR_PTR = 7, FFI_STATIC_OBJECT = 64 };

typedef int (*ffi_call_fn)(void *func, FfiAny *args, int32_t num_args, FfiAny *result);
typedef void (*ffi_move_error_fn)(void **error);
typedef int (*ffi_decref_fn)(void *object);

static ffi_call_fn ffi_call;
static ffi_move_error_fn ffi_move_error;
static ffi_decref_fn ffi_decref;
static void *xgr_traverse_fn, *xgr_is_terminated_fn;
static int32_t xgr_matcher_type = -1;

static PyObject *xgrammar_bind(PyObject *self, PyObject *args) {
    unsigned long long call, move_error, decref, traverse, is_terminated;
    int type_index;
    if (!PyArg_ParseTuple(args, "KKKKKi", &call, &move_error, &decref, &traverse, &is_terminated,
                          &type_index))
        return NULL;
    if (!call || !move_error || !decref || !traverse || !is_terminated ||
        type_index < FFI_STATIC_OBJECT) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_bind: a null address or a bad type index");
        return NULL;
    }
    ffi_call = (ffi_call_fn)(uintptr_t)call;
    ffi_move_error = (ffi_move_error_fn)(uintptr_t)move_error;
    ffi_decref = (ffi_decref_fn)(uintptr_t)decref;
    xgr_traverse_fn = (void *)(uintptr_t)traverse;
    xgr_is_terminated_fn = (void *)(uintptr_t)is_terminated;
    xgr_matcher_type = type_index;
    Py_RETURN_NONE;
}

/* The matcher handle as a tvm-ffi object argument, or -1 (Python error set) when it is not a
   bound matcher object. */
static int matcher_arg(unsigned long long handle, FfiAny *arg) {
    if (ffi_call == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xgrammar's methods are not bound (xgrammar_bind)");
        return -1;
    }
    FfiObject *object = (FfiObject *)(uintptr_t)handle;
    if (object == NULL || object->type_index != xgr_matcher_type) {
        PyErr_SetString(PyExc_TypeError, "not the handle of an xgrammar GrammarMatcher");
        return -1;
    }
    arg->type_index = object->type_index;
    arg->zero_padding = 0;
    arg->v_ptr = object;
    return 0;
}

/* Take the error tvm-ffi raised into a malloc'd "Kind: message" string (NULL if out of
   memory). No GIL needed. */
static char *take_ffi_error(void) {
    void *error = NULL;
    ffi_move_error(&error);
    const char *kind = "Error", *text = "xgrammar failed";
    size_t nkind = strlen(kind), ntext = strlen(text);
    if (error != NULL) {
        const FfiErrorCell *cell = (const FfiErrorCell *)((const char *)error + sizeof(FfiObject));
        if (cell->kind.data != NULL) kind = cell->kind.data, nkind = cell->kind.size;
        if (cell->message.data != NULL) text = cell->message.data, ntext = cell->message.size;
    }
    char *out = malloc(nkind + ntext + 3);
    if (out != NULL) {
        memcpy(out, kind, nkind);
        memcpy(out + nkind, ": ", 2);
        memcpy(out + nkind + 2, text, ntext);
        out[nkind + 2 + ntext] = 0;
    }
    if (error != NULL) ffi_decref(error);
    return out;
}

static void set_tensor(DlTensor *t, void *data, int ndim, int64_t *shape, uint8_t bits) {
    t->data = data;
    t->device.device_type = 1; /* kDLCPU */
    t->device.device_id = 0;
    t->ndim = ndim;
    t->dtype.code = 0; /* kDLInt */
    t->dtype.bits = bits;
    t->dtype.lanes = 1;
    t->shape = shape;
    t->strides = NULL;
    t->byte_offset = 0;
}

/* traverse_draft_tree on one request: 0 on success, else -1 with *error set (malloc'd or
   NULL). *terminated (if not NULL) asks is_terminated first and skips a terminated matcher.
   No GIL needed. */
static int call_traverse(const FfiAny *matcher, int64_t *nt, int64_t *ns, int64_t *dt,
                         int32_t *rows, int64_t n, int64_t words, int *terminated,
                         char **error) {
    FfiAny args[7], result;
    args[0] = *matcher;
    if (terminated != NULL) {
        result.type_index = FFI_NONE;
        result.zero_padding = 0;
        result.v_int64 = 0;
        if (ffi_call(xgr_is_terminated_fn, args, 1, &result) != 0) {
            *error = take_ffi_error();
            return -1;
        }
        *terminated = result.v_int64 != 0;
        if (*terminated) return 0;
    }
    int64_t shape1[1] = {n}, shape2[2] = {n, words};
    DlTensor t_nt, t_ns, t_dt, t_rows;
    set_tensor(&t_nt, nt, 1, shape1, 64);
    set_tensor(&t_ns, ns, 1, shape1, 64);
    set_tensor(&t_dt, dt, 1, shape1, 64);
    set_tensor(&t_rows, rows, 2, shape2, 32);
    DlTensor *tensors[4] = {&t_nt, &t_ns, &t_dt, &t_rows};
    for (int i = 0; i < 4; i++) {
        args[1 + i].type_index = FFI_DLTENSOR_PTR;
        args[1 + i].zero_padding = 0;
        args[1 + i].v_ptr = tensors[i];
    }
    args[5].type_index = FFI_FLOAT;
    args[5].zero_padding = 0;
    args[5].v_float64 = -1.0; /* no time limit */
    args[6].type_index = FFI_NONE;
    args[6].zero_padding = 0;
    args[6].v_int64 = 0; /* no temperatures */
    result.type_index = FFI_NONE;
    result.zero_padding = 0;
    result.v_int64 = 0;
    if (ffi_call(xgr_traverse_fn, args, 7, &result) != 0) {
        *error = take_ffi_error();
        return -1;
    }
    return 0;
}

static PyObject *raise_ffi_error(char *error) {
    PyErr_SetString(PyExc_RuntimeError, error != NULL ? error : "xgrammar failed");
    free(error);
    return NULL;
}

static PyObject *xgrammar_traverse(PyObject *self, PyObject *args) {
    unsigned long long handle;
    PyObject *nt_obj, *ns_obj, *dt_obj, *rows_obj;
    if (!PyArg_ParseTuple(args, "KOOOO", &handle, &nt_obj, &ns_obj, &dt_obj, &rows_obj))
        return NULL;
    FfiAny matcher;
    if (matcher_arg(handle, &matcher) != 0) return NULL;
    Py_buffer nt, ns, dt, rows;
    if (get_buffer(nt_obj, &nt, 0, 'i', 8, 1, "next_token") != 0) return NULL;
    if (get_buffer(ns_obj, &ns, 0, 'i', 8, 1, "next_sibling") != 0) goto fail_nt;
    if (get_buffer(dt_obj, &dt, 0, 'i', 8, 1, "draft") != 0) goto fail_ns;
    if (get_buffer(rows_obj, &rows, 1, 'i', 4, 2, "rows") != 0) goto fail_dt;
    Py_ssize_t n = nt.shape[0];
    if (ns.shape[0] != n || dt.shape[0] != n || rows.shape[0] != n || n < 1) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_traverse: links, tokens and rows differ in length");
        goto fail_rows;
    }
    int rc;
    char *error = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = call_traverse(&matcher, (int64_t *)nt.buf, (int64_t *)ns.buf, (int64_t *)dt.buf,
                       (int32_t *)rows.buf, n, rows.shape[1], NULL, &error);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows);
    PyBuffer_Release(&dt);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&nt);
    if (rc != 0) return raise_ffi_error(error);
    Py_RETURN_NONE;
fail_rows:
    PyBuffer_Release(&rows);
fail_dt:
    PyBuffer_Release(&dt);
fail_ns:
    PyBuffer_Release(&ns);
fail_nt:
    PyBuffer_Release(&nt);
    return NULL;
}

/* The span table of walk_chains as a PyMem copy of chains * 4 int64: from a C-contiguous
   int64 [chains, 4] buffer, or from a list of 4-tuples of ints (cheaper to make for a few
   chains than an array). NULL with a Python error on anything else. */
static int64_t *read_spans(PyObject *obj, Py_ssize_t *chains) {
    int64_t *out = NULL;
    if (PyList_Check(obj)) {
        Py_ssize_t n = PyList_GET_SIZE(obj);
        out = PyMem_Malloc(sizeof(int64_t) * 4 * (size_t)(n > 0 ? n : 1));
        if (out == NULL) return (int64_t *)PyErr_NoMemory();
        for (Py_ssize_t c = 0; c < n; c++) {
            PyObject *item = PyList_GET_ITEM(obj, c);
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
                PyMem_Free(out);
                PyErr_SetString(PyExc_ValueError, "walk_chains: spans out of bounds or malformed");
                return NULL;
            }
            for (int k = 0; k < 4; k++) {
                long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(item, k));
                if (v == -1 && PyErr_Occurred()) {
                    PyMem_Free(out);
                    return NULL;
                }
                out[4 * c + k] = (int64_t)v;
            }
        }
        *chains = n;
        return out;
    }
    Py_buffer spans;
    if (get_buffer(obj, &spans, 0, 'i', 8, 2, "spans") != 0) return NULL;
    if (spans.shape[1] != 4) {
        PyBuffer_Release(&spans);
        PyErr_SetString(PyExc_ValueError, "walk_chains: spans out of bounds or malformed");
        return NULL;
    }
    *chains = spans.shape[0];
    out = PyMem_Malloc(sizeof(int64_t) * 4 * (size_t)(*chains > 0 ? *chains : 1));
    if (out == NULL) {
        PyBuffer_Release(&spans);
        return (int64_t *)PyErr_NoMemory();
    }
    memcpy(out, spans.buf, sizeof(int64_t) * 4 * (size_t)*chains);
    PyBuffer_Release(&spans);
    return out;
}

/* The longest span of a span table whose every span lies inside `nrows` rows and `ntok`
   tokens, or -1 when one does not (or is empty). */
static Py_ssize_t longest_span(const int64_t *sp, Py_ssize_t chains, Py_ssize_t nrows,
                               Py_ssize_t ntok) {
    Py_ssize_t longest = 1;
    for (Py_ssize_t c = 0; c < chains; c++) {
        int64_t r = sp[4 * c], t = sp[4 * c + 1], n = sp[4 * c + 2];
        if (r < 0 || t < 0 || n < 1 || r > nrows - n || t > ntok - n) return -1;
        if (n > longest) longest = n;
    }
    return longest;
}

/* Seconds since *began into *out; *began becomes now. */
static void lap(double *out, struct timespec *began) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    *out = (double)(now.tv_sec - began->tv_sec) + 1e-9 * (double)(now.tv_nsec - began->tv_nsec);
    *began = now;
}

/* (checked, rejected, failed, message) of a walk; frees `error` (malloc'd, or NULL). */
static PyObject *walk_result(Py_ssize_t checked, Py_ssize_t rejected, Py_ssize_t failed,
                             char *error) {
    PyObject *result;
    if (failed < 0)
        result = Py_BuildValue("nnnO", checked, rejected, (Py_ssize_t)-1, Py_None);
    else
        result = Py_BuildValue("nnns", checked, rejected, failed,
                               error != NULL ? error : "xgrammar failed");
    free(error);
    return result;
}

/* A writable C-contiguous 1-D float64 buffer of at least n entries (per-walk times). */
static int get_seconds(PyObject *obj, Py_buffer *view, Py_ssize_t n) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0)
        return -1;
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (*fmt != 'd' || view->itemsize != 8 || view->ndim != 1 || view->shape[0] < n) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "seconds must be a 1-D float64 array, one entry per walk");
        return -1;
    }
    return 0;
}

/* The tvm-ffi argument of each span's matcher (handles in the fourth column; 0: none), in a
   PyMem block the caller frees; NULL with the error set. */
static FfiAny *matcher_args(const int64_t *sp, Py_ssize_t chains) {
    FfiAny *matchers = PyMem_Calloc((size_t)(chains > 0 ? chains : 1), sizeof(FfiAny));
    if (matchers == NULL) return (FfiAny *)PyErr_NoMemory();
    for (Py_ssize_t c = 0; c < chains; c++) {
        if (sp[4 * c + 3] != 0 && matcher_arg((unsigned long long)sp[4 * c + 3], &matchers[c]) != 0) {
            PyMem_Free(matchers);
            return NULL;
        }
    }
    return matchers;
}

/* Walk and repair the chains of a span table (see walk_chains): `links` has room for two
   [longest] arrays, `matchers` one argument per chain (unused where its handle is 0).
   Returns the index of the chain xgrammar refused (its message in *error, malloc'd), or -1.
   No GIL needed. */
static Py_ssize_t walk_table(int32_t *mask, Py_ssize_t words, int64_t *tok, const int64_t *sp,
                             Py_ssize_t chains, const FfiAny *matchers, int64_t *links,
                             Py_ssize_t longest, long long limit, const int64_t *stop,
                             Py_ssize_t nstops, int repeat, uint8_t *flags, double *times,
                             Py_ssize_t *checked, Py_ssize_t *rejected, char **error) {
    int64_t *next_token = links, *next_sibling = links + longest;
    for (Py_ssize_t i = 0; i < longest; i++) {
        next_token[i] = i + 1;
        next_sibling[i] = -1;
    }
    struct timespec began;
    if (times != NULL) clock_gettime(CLOCK_MONOTONIC, &began);
    for (Py_ssize_t c = 0; c < chains; c++) {
        int32_t *base = mask + sp[4 * c] * words;
        int64_t *chain = tok + sp[4 * c + 1];
        Py_ssize_t n = (Py_ssize_t)sp[4 * c + 2];
        int live = 0;
        if (sp[4 * c + 3] != 0) {
            int terminated = 0;
            next_token[n - 1] = -1;
            int rc = call_traverse(&matchers[c], next_token, next_sibling, chain, base, n, words,
                                   &terminated, error);
            next_token[n - 1] = n;
            if (rc != 0) return c;
            live = !terminated;
        }
        repair_chain(base, chain, n, words, live, limit, stop, nstops, repeat,
                     flags != NULL ? flags + sp[4 * c] : NULL, checked, rejected);
        if (times != NULL) lap(&times[c], &began);
    }
    return -1;
}

static PyObject *walk_chains(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *tokens_obj, *spans_obj, *stops_obj, *valid_obj = Py_None;
    PyObject *seconds_obj = Py_None;
    long long limit;
    int repeat;
    if (!PyArg_ParseTuple(args, "OOOLOi|OO", &rows_obj, &tokens_obj, &spans_obj, &limit,
                          &stops_obj, &repeat, &valid_obj, &seconds_obj))
        return NULL;
    if (ffi_call == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xgrammar's methods are not bound (xgrammar_bind)");
        return NULL;
    }
    Py_buffer rows, tokens, stops, valid, seconds;
    Py_ssize_t chains = 0;
    int64_t *sp = NULL;
    int has_valid = valid_obj != Py_None, has_seconds = seconds_obj != Py_None;
    if (get_buffer(rows_obj, &rows, 1, 'i', 4, 2, "rows") != 0) return NULL;
    if (get_buffer(tokens_obj, &tokens, 0, 'i', 8, 1, "tokens") != 0) goto fail_rows;
    if ((sp = read_spans(spans_obj, &chains)) == NULL) goto fail_tokens;
    if (get_buffer(stops_obj, &stops, 0, 'i', 8, 1, "stop_ids") != 0) goto fail_spans;
    Py_ssize_t nrows = rows.shape[0], words = rows.shape[1], ntok = tokens.shape[0];
    if (has_valid && get_flags(valid_obj, &valid, nrows) != 0) goto fail_stops;
    Py_ssize_t longest = longest_span(sp, chains, nrows, ntok);
    if (longest < 0 || limit > (long long)words * 32) {
        PyErr_SetString(PyExc_ValueError, "walk_chains: spans out of bounds or malformed");
        goto fail_valid;
    }
    if (has_seconds && get_seconds(seconds_obj, &seconds, chains) != 0) goto fail_valid;
    FfiAny *matchers = matcher_args(sp, chains);
    int64_t *links = matchers == NULL ? NULL : PyMem_Malloc(sizeof(int64_t) * 2 * (size_t)longest);
    if (links == NULL) {
        if (matchers != NULL) PyErr_NoMemory();
        PyMem_Free(matchers);
        goto fail_seconds;
    }
    Py_ssize_t checked = 0, rejected = 0, failed = -1;
    char *error = NULL;
    Py_BEGIN_ALLOW_THREADS
    failed = walk_table((int32_t *)rows.buf, words, (int64_t *)tokens.buf, sp, chains, matchers,
                        links, longest, limit, (const int64_t *)stops.buf, stops.shape[0],
                        repeat, has_valid ? (uint8_t *)valid.buf : NULL,
                        has_seconds ? (double *)seconds.buf : NULL, &checked, &rejected, &error);
    Py_END_ALLOW_THREADS
    PyMem_Free(matchers);
    PyMem_Free(links);
    if (has_seconds) PyBuffer_Release(&seconds);
    if (has_valid) PyBuffer_Release(&valid);
    PyBuffer_Release(&stops);
    PyMem_Free(sp);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&rows);
    return walk_result(checked, rejected, failed, error);
fail_seconds:
    if (has_seconds) PyBuffer_Release(&seconds);
fail_valid:
    if (has_valid) PyBuffer_Release(&valid);
fail_stops:
    PyBuffer_Release(&stops);
fail_spans:
    PyMem_Free(sp);
fail_tokens:
    PyBuffer_Release(&tokens);
fail_rows:
    PyBuffer_Release(&rows);
    return NULL;
}

/* Walk and repair the trees of a span table (see walk_trees): each tree's links and tokens
   start at its span's second column in `nt`, `ns`, `tok`; `scratch` has room for a queue and
   flags of the longest tree. Returns the index of the tree xgrammar refused (its message in
   *error, malloc'd), or -1. No GIL needed. */
static Py_ssize_t walk_tree_table(int32_t *mask, Py_ssize_t words, int64_t *nt, int64_t *ns,
                                  int64_t *tok, const int64_t *sp, Py_ssize_t trees,
                                  const FfiAny *matchers, int32_t *queue, uint8_t *keep,
                                  long long limit, const int64_t *stop, Py_ssize_t nstops,
                                  uint8_t *flags, double *times, Py_ssize_t *checked,
                                  Py_ssize_t *rejected, char **error) {
    struct timespec began;
    if (times != NULL) clock_gettime(CLOCK_MONOTONIC, &began);
    for (Py_ssize_t c = 0; c < trees; c++) {
        int32_t *base = mask + sp[4 * c] * words;
        Py_ssize_t at = (Py_ssize_t)sp[4 * c + 1], n = (Py_ssize_t)sp[4 * c + 2];
        int live = 0;
        if (sp[4 * c + 3] != 0) {
            int terminated = 0;
            if (call_traverse(&matchers[c], nt + at, ns + at, tok + at, base, n, words,
                              &terminated, error) != 0)
                return c;
            live = !terminated;
        }
        Py_ssize_t c_checked = 0, c_rejected = 0;
        decide_rows(base, n, words, nt + at, ns + at, tok + at, limit, stop, nstops, live,
                    queue, keep, flags != NULL ? flags + sp[4 * c] : NULL, &c_checked,
                    &c_rejected);
        for (Py_ssize_t v = 0; v < n; v++)
            if (!keep[v]) memset(base + v * words, 0xff, sizeof(int32_t) * (size_t)words);
        *checked += c_checked;
        *rejected += c_rejected;
        if (times != NULL) lap(&times[c], &began);
    }
    return -1;
}

static PyObject *walk_trees(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *nt_obj, *ns_obj, *tokens_obj, *spans_obj, *stops_obj;
    PyObject *valid_obj = Py_None, *seconds_obj = Py_None;
    long long limit;
    if (!PyArg_ParseTuple(args, "OOOOOLO|OO", &rows_obj, &nt_obj, &ns_obj, &tokens_obj,
                          &spans_obj, &limit, &stops_obj, &valid_obj, &seconds_obj))
        return NULL;
    if (ffi_call == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xgrammar's methods are not bound (xgrammar_bind)");
        return NULL;
    }
    Py_buffer rows, nt, ns, tokens, stops, valid, seconds;
    Py_ssize_t trees = 0;
    int64_t *sp = NULL;
    int has_valid = valid_obj != Py_None, has_seconds = seconds_obj != Py_None;
    PyObject *result = NULL;
    if (get_buffer(rows_obj, &rows, 1, 'i', 4, 2, "rows") != 0) return NULL;
    if (get_buffer(nt_obj, &nt, 0, 'i', 8, 1, "next_token") != 0) goto fail_rows;
    if (get_buffer(ns_obj, &ns, 0, 'i', 8, 1, "next_sibling") != 0) goto fail_nt;
    if (get_buffer(tokens_obj, &tokens, 0, 'i', 8, 1, "tokens") != 0) goto fail_ns;
    if ((sp = read_spans(spans_obj, &trees)) == NULL) goto fail_tokens;
    if (get_buffer(stops_obj, &stops, 0, 'i', 8, 1, "stop_ids") != 0) goto fail_spans;
    Py_ssize_t nrows = rows.shape[0], words = rows.shape[1], nlinks = tokens.shape[0];
    if (has_valid && get_flags(valid_obj, &valid, nrows) != 0) goto fail_stops;
    Py_ssize_t longest = longest_span(sp, trees, nrows, nlinks);
    if (longest < 0 || limit > (long long)words * 32 || nt.shape[0] != nlinks ||
        ns.shape[0] != nlinks) {
        PyErr_SetString(PyExc_ValueError, "walk_trees: spans out of bounds or malformed");
        goto fail_valid;
    }
    if (has_seconds && get_seconds(seconds_obj, &seconds, trees) != 0) goto fail_valid;
    FfiAny *matchers = matcher_args(sp, trees);
    void *scratch = matchers == NULL ? NULL : PyMem_Malloc((size_t)longest * (sizeof(int32_t) + 1));
    if (scratch == NULL) {
        if (matchers != NULL) PyErr_NoMemory();
        PyMem_Free(matchers);
        goto fail_seconds;
    }
    Py_ssize_t checked = 0, rejected = 0, failed = -1;
    char *error = NULL;
    Py_BEGIN_ALLOW_THREADS
    failed = walk_tree_table((int32_t *)rows.buf, words, (int64_t *)nt.buf, (int64_t *)ns.buf,
                             (int64_t *)tokens.buf, sp, trees, matchers, (int32_t *)scratch,
                             (uint8_t *)scratch + sizeof(int32_t) * (size_t)longest, limit,
                             (const int64_t *)stops.buf, stops.shape[0],
                             has_valid ? (uint8_t *)valid.buf : NULL,
                             has_seconds ? (double *)seconds.buf : NULL, &checked, &rejected,
                             &error);
    Py_END_ALLOW_THREADS
    PyMem_Free(matchers);
    PyMem_Free(scratch);
    result = walk_result(checked, rejected, failed, error);
fail_seconds:
    if (has_seconds) PyBuffer_Release(&seconds);
fail_valid:
    if (has_valid) PyBuffer_Release(&valid);
fail_stops:
    PyBuffer_Release(&stops);
fail_spans:
    PyMem_Free(sp);
fail_tokens:
    PyBuffer_Release(&tokens);
fail_ns:
    PyBuffer_Release(&ns);
fail_nt:
    PyBuffer_Release(&nt);
fail_rows:
    PyBuffer_Release(&rows);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* pack_chains: an engine's per-request draft lists turned into walk_chains' table, and every
   row no grammar walks written. See the module comment. */

/* The items of a list or tuple (borrowed; an empty list may have none) and their count in
   *n; -1 in *n when `obj` is neither. */
static PyObject *const *draft_items(PyObject *obj, Py_ssize_t *n) {
    if (PyList_CheckExact(obj)) {
        *n = PyList_GET_SIZE(obj);
        return (PyObject *const *)((PyListObject *)obj)->ob_item;
    }
    if (PyTuple_CheckExact(obj)) {
        *n = PyTuple_GET_SIZE(obj);
        return (PyObject *const *)((PyTupleObject *)obj)->ob_item;
    }
    *n = -1;
    return NULL;
}

static void fill_rows(int32_t *mask, Py_ssize_t words, Py_ssize_t from, Py_ssize_t to,
                      uint8_t *flags, uint8_t flag) {
    if (to <= from) return;
    memset(mask + from * words, 0xff, sizeof(int32_t) * (size_t)(words * (to - from)));
    if (flags != NULL) memset(flags + from, flag, (size_t)(to - from));
}

/* pack_chains' work (its arguments parsed); `times_out` (per request, or NULL), when the
   chains are walked, receives each walked request's seconds like its `seconds` buffer. */
static PyObject *pack_walk(PyObject *drafts, PyObject *handles, Py_ssize_t stride, long long vocab,
                           PyObject *ends_obj, PyObject *active, PyObject *rows_obj,
                           PyObject *valid_obj, long long limit, PyObject *stops_obj,
                           PyObject *seconds_obj, double *times_out, int repeat, int plain) {
    int walk = limit >= 0;
    if (walk && ffi_call == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xgrammar's methods are not bound (xgrammar_bind)");
        return NULL;
    }
    Py_ssize_t n;
    PyObject *const *requests = draft_items(drafts, &n);
    if (n < 0 || !PyList_CheckExact(handles) || PyList_GET_SIZE(handles) != n || stride < 0)
        Py_RETURN_NONE;
    if (active != Py_None && (!PyList_CheckExact(active) || PyList_GET_SIZE(active) != n))
        Py_RETURN_NONE;
    Py_buffer rows, ends, valid, stops, seconds;
    int has_valid = valid_obj != Py_None, has_seconds = walk && seconds_obj != Py_None;
    int has_times = walk && (has_seconds || times_out != NULL);
    PyObject *result = NULL;
    int64_t *tok = NULL, *table = NULL, *owners = NULL, *links = NULL;
    FfiAny *matchers = NULL;
    double *times = NULL;
    if (get_buffer(rows_obj, &rows, 1, 'i', 4, 2, "rows") != 0) return NULL;
    if (get_buffer(ends_obj, &ends, 0, 'i', 8, 1, "ends") != 0) goto fail_rows;
    if (has_valid && get_flags(valid_obj, &valid, rows.shape[0]) != 0) goto fail_ends;
    if (walk && get_buffer(stops_obj, &stops, 0, 'i', 8, 1, "stop_ids") != 0) goto fail_valid;
    if (has_seconds && get_seconds(seconds_obj, &seconds, n) != 0) goto fail_stops;
    Py_ssize_t nrows = rows.shape[0], words = rows.shape[1];
    if (walk && limit > (long long)words * 32) {
        PyErr_SetString(PyExc_ValueError, "pack_chains: limit past the rows' width");
        goto fail_seconds;
    }
    /* first pass, nothing written: every draft a plain int, every chain fits its rows */
    Py_ssize_t total = 0, ntokens = 0, longest = 1;
    for (Py_ssize_t b = 0; b < n; b++) {
        Py_ssize_t k = 0;
        PyObject *const *items = draft_items(requests[b], &k);
        PyObject *handle = PyList_GET_ITEM(handles, b);
        if (k < 0 || !PyLong_CheckExact(handle) || (stride && k + 1 > stride)) goto decline;
        if (active != Py_None) {
            PyObject *flag = PyList_GET_ITEM(active, b);
            if (flag != Py_True && flag != Py_False) goto decline;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            if (!PyLong_CheckExact(items[j])) goto decline;
            int overflow = 0;
            long long value = PyLong_AsLongLongAndOverflow(items[j], &overflow);
            if (overflow || (plain && value < 0)) goto decline;
        }
        ntokens += k + 1;
        total += stride ? stride : k + 1;
        if (k + 1 > longest) longest = k + 1;
    }
    if (total != nrows) goto decline;
    tok = PyMem_Malloc(sizeof(int64_t) * (size_t)(ntokens > 0 ? ntokens : 1));
    table = PyMem_Malloc(sizeof(int64_t) * 4 * (size_t)(n > 0 ? n : 1));
    owners = PyMem_Malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (tok == NULL || table == NULL || owners == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t *mask = (int32_t *)rows.buf;
    uint8_t *flags = has_valid ? (uint8_t *)valid.buf : NULL;
    const int64_t *end = (const int64_t *)ends.buf;
    Py_ssize_t nends = ends.shape[0], chains = 0, walked = 0, pos = 0, row = 0;
    for (Py_ssize_t b = 0; b < n; b++) {
        Py_ssize_t k = 0;
        PyObject *const *items = draft_items(requests[b], &k);
        Py_ssize_t nodes = k + 1, span = stride ? stride : nodes;
        long long handle = PyLong_AsLongLong(PyList_GET_ITEM(handles, b));
        tok[pos] = 0;
        for (Py_ssize_t j = 0; j < k; j++) tok[pos + 1 + j] = (int64_t)PyLong_AsLongLong(items[j]);
        if (handle == 0) { /* no grammar: every row all-allowed, every node accepted */
            fill_rows(mask, words, row, row + span, flags, 1);
        } else {
            fill_rows(mask, words, row + nodes, row + span, flags, 0); /* padding rows */
            Py_ssize_t head = 0;
            if (active != Py_None && PyList_GET_ITEM(active, b) == Py_True) {
                /* still reasoning: free rows up to the first end token, whose row is the
                   grammar's first; a token out of the vocabulary ends the chain */
                head = -1;
                fill_rows(mask, words, row, row + 1, flags, 1);
                for (Py_ssize_t j = 1; j < nodes && head < 0; j++) {
                    int64_t t = tok[pos + j];
                    if (t < 0 || t >= vocab) {
                        fill_rows(mask, words, row + j, row + nodes, flags, 0);
                        break;
                    }
                    if (flags != NULL) flags[row + j] = 1;
                    for (Py_ssize_t e = 0; e < nends && head < 0; e++)
                        if (end[e] == t) head = j;
                    if (head < 0) fill_rows(mask, words, row + j, row + j + 1, flags, 1);
                }
            }
            if (head >= 0) {
                table[4 * chains] = row + head;
                table[4 * chains + 1] = pos + head;
                table[4 * chains + 2] = nodes - head;
                table[4 * chains + 3] = handle;
                owners[chains++] = b;
                walked += nodes - head;
            }
        }
        pos += nodes;
        row += span;
    }
    if (!walk) {
        result = Py_BuildValue("y#y#y#n", (const char *)tok, (Py_ssize_t)sizeof(int64_t) * ntokens,
                               (const char *)table, (Py_ssize_t)sizeof(int64_t) * 4 * chains,
                               (const char *)owners, (Py_ssize_t)sizeof(int64_t) * chains, walked);
        goto done;
    }
    /* walk now, the GIL released, as walk_chains does */
    if ((matchers = matcher_args(table, chains)) == NULL) goto done;
    links = PyMem_Malloc(sizeof(int64_t) * 2 * (size_t)longest);
    times = has_times ? PyMem_Calloc((size_t)(chains > 0 ? chains : 1), sizeof(double)) : NULL;
    if (links == NULL || (has_times && times == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t checked = 0, rejected = 0, failed = -1;
    char *error = NULL;
    Py_BEGIN_ALLOW_THREADS
    failed = walk_table(mask, words, tok, table, chains, matchers, links, longest, limit,
                        (const int64_t *)stops.buf, stops.shape[0], repeat, flags, times, &checked,
                        &rejected, &error);
    Py_END_ALLOW_THREADS
    if (has_seconds) {
        double *out = (double *)seconds.buf;
        for (Py_ssize_t c = 0; c < chains; c++) out[owners[c]] = times[c];
    }
    if (times_out != NULL)
        for (Py_ssize_t c = 0; c < chains; c++) times_out[owners[c]] = times[c];
    result = walk_result(checked, rejected, failed < 0 ? -1 : (Py_ssize_t)owners[failed], error);
done:
    PyMem_Free(times);
    PyMem_Free(links);
    PyMem_Free(matchers);
    PyMem_Free(owners);
    PyMem_Free(table);
    PyMem_Free(tok);
fail_seconds:
    if (has_seconds) PyBuffer_Release(&seconds);
fail_stops:
    if (walk) PyBuffer_Release(&stops);
fail_valid:
    if (has_valid) PyBuffer_Release(&valid);
fail_ends:
    PyBuffer_Release(&ends);
fail_rows:
    PyBuffer_Release(&rows);
    return result;
decline:
    if (has_seconds) PyBuffer_Release(&seconds);
    if (walk) PyBuffer_Release(&stops);
    if (has_valid) PyBuffer_Release(&valid);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&rows);
    Py_RETURN_NONE;
}

static PyObject *pack_chains(PyObject *self, PyObject *args) {
    PyObject *drafts, *handles, *ends_obj, *active, *rows_obj, *valid_obj;
    PyObject *stops_obj = Py_None, *seconds_obj = Py_None;
    Py_ssize_t stride;
    long long vocab, limit = -1;
    int repeat = 0, plain = 0;
    if (!PyArg_ParseTuple(args, "OOnLOOOO|LOOip", &drafts, &handles, &stride, &vocab, &ends_obj,
                          &active, &rows_obj, &valid_obj, &limit, &stops_obj, &seconds_obj,
                          &repeat, &plain))
        return NULL;
    return pack_walk(drafts, handles, stride, vocab, ends_obj, active, rows_obj, valid_obj, limit,
                     stops_obj, seconds_obj, NULL, repeat, plain);
}

/* The facts entry of matcher `g` (a borrowed 5-tuple: weak reference, handle, words,
   vocab_size, stop_ids) when `facts` (id -> entry) holds one for this very object, else
   NULL with no error set. */
static PyObject *matcher_facts(PyObject *facts, PyObject *g) {
    PyObject *key = PyLong_FromVoidPtr(g);
    if (key == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(facts, key);
    Py_DECREF(key);
    if (entry == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5) return NULL;
    PyObject *ref = PyTuple_GET_ITEM(entry, 0);
    if (!PyWeakref_CheckRef(ref)) return NULL;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target = NULL;
    if (PyWeakref_GetRef(ref, &target) < 0) {
        PyErr_Clear();
        return NULL;
    }
    Py_XDECREF(target); /* compared by identity only; `g` is held by the caller's list */
#else
    PyObject *target = PyWeakref_GetObject(ref);
#endif
    if (target != g) return NULL;
    for (int i = 1; i < 4; i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(entry, i))) return NULL;
    return entry;
}

static int compare_addresses(const void *a, const void *b) {
    uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
    return (x > y) - (x < y);
}

/* ---------------------------------------------------------------------------------------- */
/* vllm_chains: the vLLM plugin's common step read straight from vLLM's objects. See the
   module comment. */

static PyObject *attr_name(PyObject **cache, const char *name) {
    if (*cache == NULL) *cache = PyUnicode_InternFromString(name);
    return *cache;
}

static PyObject *vllm_chains(PyObject *self, PyObject *args) {
    PyObject *requests, *ids, *spec, *known, *wrappers, *buffer, *no_ends;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "OOOO!O!OnO", &requests, &ids, &spec, &PyDict_Type, &known,
                          &PySet_Type, &wrappers, &buffer, &stride, &no_ends))
        return NULL;
    static PyObject *s_request = NULL, *s_grammar = NULL, *s_matcher = NULL;
    if (attr_name(&s_request, "structured_output_request") == NULL ||
        attr_name(&s_grammar, "_grammar") == NULL || attr_name(&s_matcher, "matcher") == NULL)
        return NULL;
    if (!PyDict_CheckExact(requests) || !PyList_CheckExact(ids) || !PyDict_CheckExact(spec))
        Py_RETURN_NONE;
    Py_buffer view;
    if (get_buffer(buffer, &view, 1, 'i', 4, 2, "rows") != 0) return NULL;
    Py_ssize_t capacity = view.shape[0], words = view.shape[1];
    PyBuffer_Release(&view);
    Py_ssize_t n = PyList_GET_SIZE(ids), total = 0;
    PyObject *drafts = PyList_New(n), *handles = PyList_New(n), *matchers = PyList_New(n);
    PyObject *common = NULL, *result = NULL, *out = NULL, *walked = NULL;
    uintptr_t *seen = PyMem_Malloc(sizeof(uintptr_t) * (size_t)(n > 0 ? n : 1));
    if (drafts == NULL || handles == NULL || matchers == NULL || seen == NULL) {
        if (seen == NULL) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t b = 0; b < n; b++) {
        if (b >= PyList_GET_SIZE(ids)) goto decline; /* changed by an attribute read */
        PyObject *id = PyList_GET_ITEM(ids, b);
        if (!PyUnicode_CheckExact(id)) goto decline; /* so that no lookup runs Python code */
        PyObject *tokens = PyDict_GetItemWithError(spec, id);
        if (tokens == NULL && PyErr_Occurred()) goto decline;
        if (tokens == NULL || tokens == Py_None) { /* no drafts: the root row only */
            tokens = PyList_New(0);
            if (tokens == NULL) goto done;
        } else {
            Py_INCREF(tokens);
        }
        PyList_SET_ITEM(drafts, b, tokens);
        PyObject *request = PyDict_GetItemWithError(requests, id);
        if (request == NULL) goto decline;
        Py_INCREF(request); /* the attribute reads may run Python code */
        PyObject *held = PyObject_GetAttr(request, s_request);
        Py_DECREF(request);
        if (held == NULL) goto decline;
        PyObject *grammar = PyObject_GetAttr(held, s_grammar);
        Py_DECREF(held);
        if (grammar == NULL) goto decline;
        if (PySet_Contains(wrappers, (PyObject *)Py_TYPE(grammar)) != 1) {
            Py_DECREF(grammar);
            goto decline;
        }
        PyObject *matcher = PyObject_GetAttr(grammar, s_matcher);
        PyObject *key = PyLong_FromVoidPtr(grammar);
        Py_DECREF(grammar);
        if (matcher == NULL || key == NULL) {
            Py_XDECREF(matcher);
            Py_XDECREF(key);
            goto decline;
        }
        PyList_SET_ITEM(matchers, b, matcher); /* held until the walk is over */
        PyObject *entry = PyDict_GetItemWithError(known, key);
        Py_DECREF(key);
        /* (matcher, handle, words, stop_ids, weak reference), made by the Python side */
        if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5 ||
            PyTuple_GET_ITEM(entry, 0) != matcher)
            goto decline;
        PyObject *handle = PyTuple_GET_ITEM(entry, 1), *stop = PyTuple_GET_ITEM(entry, 3);
        if (!PyLong_CheckExact(handle) || PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 2)) != words)
            goto decline;
        seen[b] = (uintptr_t)PyLong_AsVoidPtr(handle);
        if (seen[b] == 0 || (common != NULL && stop != common)) goto decline;
        if (common == NULL) common = Py_NewRef(stop);
        Py_INCREF(handle);
        PyList_SET_ITEM(handles, b, handle);
        Py_ssize_t k = PyObject_Length(tokens);
        if (k < 0) goto decline;
        total += stride ? stride : k + 1;
    }
    if (PyErr_Occurred()) goto decline;
    qsort(seen, (size_t)n, sizeof(uintptr_t), compare_addresses);
    for (Py_ssize_t b = 1; b < n; b++)
        if (seen[b] == seen[b - 1]) goto decline; /* a matcher listed twice */
    if (n == 0 || total > capacity) goto decline;
    PyObject *stop_at = PyLong_FromSsize_t(total);
    PyObject *slice = stop_at == NULL ? NULL : PySlice_New(NULL, stop_at, NULL);
    Py_XDECREF(stop_at);
    if (slice == NULL) goto done;
    out = PyObject_GetItem(buffer, slice);
    Py_DECREF(slice);
    if (out == NULL) goto done;
    long long limit = (long long)words * 32;
    walked = pack_walk(drafts, handles, stride, limit, no_ends, Py_None, out, Py_None, limit,
                       common, Py_None, NULL, 1, 1);
    if (walked == NULL || walked == Py_None) {
        result = walked;
        walked = NULL;
        goto done;
    }
    result = PyTuple_Pack(3, out, walked, drafts);
    goto done;
decline:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(seen);
    Py_XDECREF(common);
    Py_XDECREF(walked);
    Py_XDECREF(out);
    Py_XDECREF(matchers);
    Py_XDECREF(handles);
    Py_XDECREF(drafts);
    return result;
}

/* Whether `out` is an `ndarray` (exactly that type) the rows can be written into: native
   int32, C-contiguous, writable, [rows, words]. No error set either way. */
static int fits_rows(PyObject *out, PyObject *ndarray, Py_ssize_t rows, Py_ssize_t words) {
    if ((PyObject *)Py_TYPE(out) != ndarray) return 0;
    Py_buffer view;
    if (array_view(out, &view, 1, 'i', 4))
        return view.ndim == 2 && view.shape[0] == rows && view.shape[1] == words;
    if (PyObject_GetBuffer(out, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
        PyErr_Clear();
        return 0;
    }
    const uint16_t probe = 1;
    const char *fmt = view.format ? view.format : "B";
    if (*fmt == '=' || *fmt == '@' || (*fmt == '<' && *(const uint8_t *)&probe == 1)) fmt++;
    int ok = (fmt[0] == 'i' || fmt[0] == 'l') && fmt[1] == 0 && view.itemsize == 4 &&
             view.ndim == 2 && view.shape[0] == rows && view.shape[1] == words;
    PyBuffer_Release(&view);
    return ok;
}

enum { TALLY_BUILDS, TALLY_REQUESTS, TALLY_ROWS, TALLY_BUILD_SECONDS, TALLY_WALK_SECONDS,
       TALLY_CHECKED, TALLY_REJECTED, TALLY_SLOWEST, TALLY_SIZE };

/* The compiled builds' environment (see chain_masks): borrowed references. */
typedef struct {
    PyObject *facts, *empty, *int32, *boolean, *ndarray, *tally, *held;
} MaskEnv;

/* The env tuple into *e: 0, or -1 with a TypeError set. `held` is the dict of the matchers
   that builds started with wait=False are walking (portable_spec.pending): while it is not
   empty, every compiled build declines and the checked path decides what to refuse. */
static int read_env(PyObject *env, MaskEnv *e) {
    if (!PyTuple_CheckExact(env) || PyTuple_GET_SIZE(env) != 7 ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(env, 0)) ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(env, 6))) {
        PyErr_SetString(PyExc_TypeError,
                        "env must be (facts, empty, int32, bool, ndarray, tally, held)");
        return -1;
    }
    e->facts = PyTuple_GET_ITEM(env, 0);
    e->empty = PyTuple_GET_ITEM(env, 1);
    e->int32 = PyTuple_GET_ITEM(env, 2);
    e->boolean = PyTuple_GET_ITEM(env, 3);
    e->ndarray = PyTuple_GET_ITEM(env, 4);
    e->tally = PyTuple_GET_ITEM(env, 5);
    e->held = PyTuple_GET_ITEM(env, 6);
    return 0;
}

/* An exact Python int that fits int64 into *v: 0; else -1 (no error left set). */
static int exact_int(PyObject *obj, int64_t *v) {
    int overflow = 0;
    if (!PyLong_CheckExact(obj)) return -1;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *v = (int64_t)value;
    return 0;
}

/* vocab_size as the compiled builds take it: an exact int in (0, 2^40], else -1. */
static long long plain_vocab(PyObject *obj) {
    int64_t vocab;
    return exact_int(obj, &vocab) != 0 || vocab <= 0 || vocab > (1LL << 40) ? -1 : vocab;
}

/* Each grammar's handle from the facts table into handles[n] (0 for None, allowed only with
   `none_ok`); *stops and *known_vocab the matchers' shared stop array and vocabulary, *live
   how many there are. 1 when every grammar is known at width `words`, all share one stop
   set and vocabulary, none is listed twice and one at least is live; 0 when not (no error
   set); -1 with an error set. */
static int resolve_matchers(PyObject *facts, PyObject *const *gs, Py_ssize_t n,
                            Py_ssize_t words, int none_ok, long long *handles, PyObject **stops,
                            long long *known_vocab, Py_ssize_t *live) {
    uintptr_t *seen = PyMem_Malloc(sizeof(uintptr_t) * (size_t)(n > 0 ? n : 1));
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int ok = 0;
    *stops = NULL;
    *live = 0;
    for (Py_ssize_t b = 0; b < n; b++) {
        PyObject *g = gs[b];
        handles[b] = 0;
        if (g == Py_None) {
            if (!none_ok) goto done;
            continue;
        }
        PyObject *entry = matcher_facts(facts, g);
        if (entry == NULL) goto done;
        Py_ssize_t w = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 2));
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 3));
        long long handle = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            goto done;
        }
        if (w != words || handle == 0) goto done;
        if (*stops == NULL) {
            *stops = PyTuple_GET_ITEM(entry, 4);
            *known_vocab = v;
        } else if (PyTuple_GET_ITEM(entry, 4) != *stops || v != *known_vocab) {
            goto done; /* matchers of other tokenizers: the general build checks them */
        }
        handles[b] = handle;
        seen[(*live)++] = (uintptr_t)g;
    }
    if (*live == 0) goto done;
    if (*live > 1) { /* a matcher listed twice would be walked twice: the general build refuses */
        qsort(seen, (size_t)*live, sizeof(uintptr_t), compare_addresses);
        for (Py_ssize_t i = 1; i < *live; i++)
            if (seen[i] == seen[i - 1]) goto done;
    }
    ok = 1;
done:
    PyMem_Free(seen);
    return ok;
}

/* The int32 [rows, words] mask to write: `out` (a new reference) when it fits, a new array
   when `out` is None, NULL with no error set when `out` does not fit, NULL with an error set
   when the allocation failed. */
static PyObject *mask_for(const MaskEnv *e, PyObject *out, Py_ssize_t rows, Py_ssize_t words) {
    if (out == Py_None) {
#ifdef PS_NUMPY
        npy_intp dims[2] = {rows, words};
        return PyArray_SimpleNew(2, dims, NPY_INT32);
#else
        return PyObject_CallFunction(e->empty, "(nn)O", rows, words, e->int32);
#endif
    }
    return fits_rows(out, e->ndarray, rows, words) ? Py_NewRef(out) : NULL;
}

/* A new bool array of `rows` flags shaped [batch, width] (width > 0) or [rows]. */
static PyObject *flags_for(const MaskEnv *e, Py_ssize_t rows, Py_ssize_t batch, Py_ssize_t width) {
#ifdef PS_NUMPY
    (void)e;
    npy_intp dims[2] = {width ? batch : rows, width};
    return PyArray_SimpleNew(width ? 2 : 1, dims, NPY_BOOL);
#else
    return width ? PyObject_CallFunction(e->empty, "(nn)O", batch, width, e->boolean)
                 : PyObject_CallFunction(e->empty, "(n)O", rows, e->boolean);
#endif
}

/* Add one build to the tally (times: per request, counted where handles[b] != 0) and return
   the list of (request, seconds) walks over `threshold`, or None; NULL with an error set. */
static PyObject *count_build(PyObject *tally_obj, const long long *handles, const double *times,
                             Py_ssize_t n, Py_ssize_t rows, double seconds, Py_ssize_t checked,
                             Py_ssize_t rejected, double threshold) {
    Py_buffer tally;
    if (PyObject_GetBuffer(tally_obj, &tally, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0)
        return NULL;
    if (tally.len < (Py_ssize_t)(sizeof(double) * TALLY_SIZE)) {
        PyBuffer_Release(&tally);
        PyErr_SetString(PyExc_TypeError, "the tally must be float64 [8]");
        return NULL;
    }
    PyObject *slow = Py_NewRef(Py_None);
    double *t = (double *)tally.buf, total = 0.0, slowest = 0.0;
    Py_ssize_t requests = 0;
    for (Py_ssize_t b = 0; b < n; b++) {
        if (handles[b] == 0) continue;
        requests++;
        total += times[b];
        if (times[b] > slowest) slowest = times[b];
        if (threshold > 0.0 && times[b] > threshold) {
            if (slow == Py_None) {
                Py_DECREF(slow);
                if ((slow = PyList_New(0)) == NULL) break;
            }
            PyObject *item = Py_BuildValue("nd", b, times[b]);
            if (item == NULL || PyList_Append(slow, item) != 0) {
                Py_XDECREF(item);
                Py_CLEAR(slow);
                break;
            }
            Py_DECREF(item);
        }
    }
    if (slow != NULL) {
        t[TALLY_BUILDS] += 1.0;
        t[TALLY_REQUESTS] += (double)requests;
        t[TALLY_ROWS] += (double)rows;
        t[TALLY_BUILD_SECONDS] += total;
        t[TALLY_WALK_SECONDS] += seconds;
        t[TALLY_CHECKED] += (double)checked;
        t[TALLY_REJECTED] += (double)rejected;
        if (slowest > t[TALLY_SLOWEST]) t[TALLY_SLOWEST] = slowest;
    }
    PyBuffer_Release(&tally);
    return slow;
}

static PyObject *chain_masks(PyObject *self, PyObject *args) {
    PyObject *env, *grammars, *drafts, *stride_obj, *vocab_obj, *ends_obj, *active, *out;
    int want_valid;
    Py_ssize_t max_rows;
    double threshold;
    MaskEnv e;
    if (!PyArg_ParseTuple(args, "OOOOOOOOpnd", &env, &grammars, &drafts, &stride_obj, &vocab_obj,
                          &ends_obj, &active, &out, &want_valid, &max_rows, &threshold) ||
        read_env(env, &e) != 0)
        return NULL;
    if (PyDict_GET_SIZE(e.held) != 0) Py_RETURN_NONE; /* pending builds hold matchers */
    Py_ssize_t n, nd, stride = 0;
    PyObject *const *gs = draft_items(grammars, &n);
    PyObject *const *ds = draft_items(drafts, &nd);
    if (n <= 0 || nd != n) Py_RETURN_NONE;
    if (stride_obj != Py_None) {
        if (!PyLong_CheckExact(stride_obj)) Py_RETURN_NONE;
        stride = PyLong_AsSsize_t(stride_obj);
        if (stride == -1 && PyErr_Occurred()) PyErr_Clear();
        if (stride < 1 || stride > (1 << 24)) Py_RETURN_NONE;
    }
    long long vocab = plain_vocab(vocab_obj);
    if (vocab < 0) Py_RETURN_NONE;
    Py_ssize_t words = (Py_ssize_t)((vocab + 31) >> 5);
    PyObject *handles = NULL, *mask = NULL, *valid = NULL, *result = NULL;
    long long *ids = PyMem_Malloc(sizeof(long long) * (size_t)n);
    double *times = PyMem_Calloc((size_t)n, sizeof(double));
    if (ids == NULL || times == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *stops;
    long long known_vocab = 0;
    Py_ssize_t live;
    int known = resolve_matchers(e.facts, gs, n, words, 1, ids, &stops, &known_vocab, &live);
    if (known <= 0) {
        result = known < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t rows = 0;
    for (Py_ssize_t b = 0; b < n; b++) {
        Py_ssize_t k;
        draft_items(ds[b], &k);
        if (k < 0 || (stride && k >= stride)) goto decline;
        rows += stride ? stride : k + 1;
    }
    if ((handles = PyList_New(n)) == NULL) goto done;
    for (Py_ssize_t b = 0; b < n; b++) {
        PyObject *handle = PyLong_FromLongLong(ids[b]);
        if (handle == NULL) goto done;
        PyList_SET_ITEM(handles, b, handle);
    }
    if ((mask = mask_for(&e, out, rows, words)) == NULL) {
        if (PyErr_Occurred()) goto done;
        goto decline;
    }
    valid = want_valid ? flags_for(&e, rows, n, stride) : Py_NewRef(Py_None);
    if (valid == NULL) goto done;
    long long limit = vocab < known_vocab ? vocab : known_vocab;
    if (max_rows > 0 && rows >= max_rows && live > 1) { /* walked in parts by the caller */
        PyObject *packed = pack_walk(drafts, handles, stride, vocab, ends_obj, active, mask, valid,
                                     -1, Py_None, Py_None, NULL, 0, 0);
        if (packed == NULL || packed == Py_None) {
            result = packed;
            goto done;
        }
        result = Py_BuildValue("OOnON", mask, valid, (Py_ssize_t)-2, Py_None,
                               Py_BuildValue("NLO", packed, limit, stops));
        goto done;
    }
    struct timespec began;
    clock_gettime(CLOCK_MONOTONIC, &began);
    PyObject *walked = pack_walk(drafts, handles, stride, vocab, ends_obj, active, mask, valid,
                                 limit, stops, Py_None, times, 0, 0);
    if (walked == NULL || walked == Py_None) {
        result = walked;
        goto done;
    }
    double seconds;
    lap(&seconds, &began);
    Py_ssize_t checked = PyLong_AsSsize_t(PyTuple_GET_ITEM(walked, 0));
    Py_ssize_t rejected = PyLong_AsSsize_t(PyTuple_GET_ITEM(walked, 1));
    Py_ssize_t failed = PyLong_AsSsize_t(PyTuple_GET_ITEM(walked, 2));
    PyObject *slow = failed < 0 ? count_build(e.tally, ids, times, n, rows, seconds, checked,
                                              rejected, threshold)
                                : Py_NewRef(Py_None);
    if (slow != NULL)
        result = Py_BuildValue("OOnON", mask, valid, failed, PyTuple_GET_ITEM(walked, 3), slow);
    Py_DECREF(walked);
    goto done;
decline:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(valid);
    Py_XDECREF(mask);
    Py_XDECREF(handles);
    PyMem_Free(times);
    PyMem_Free(ids);
    return result;
}

/* flags[v] = 1 for every node of one (valid) tree a link reaches from its root, else 0;
   `queue` has room for n. No GIL needed. */
static void reach(const int64_t *nt, const int64_t *ns, Py_ssize_t n, int32_t *queue,
                  uint8_t *flags) {
    memset(flags, 0, (size_t)n);
    Py_ssize_t head = 0, tail = 0;
    flags[0] = 1;
    queue[tail++] = 0;
    while (head < tail) {
        int32_t v = queue[head++];
        for (int64_t c = nt[v]; c != -1; c = ns[c]) {
            flags[c] = 1;
            queue[tail++] = (int32_t)c;
        }
    }
}

/* The part of the small builds (span_masks, tree_masks) after their own checks: the matchers'
   facts (grammar None allowed with `none_ok`; their handles go to `ids` and the table's
   fourth column), the mask and flags to write, the walk with the GIL released and the tally.
   `table` holds every request's rows and tokens; `scratch` is the walk's: chains (tree 0) two [longest] int64 link arrays, trees (tree 1) an int32 queue and a
   flag byte per node (`longest` nodes per tree). Returns the result tuple, None when a
   matcher is not known or `out` does not fit (nothing written), or NULL with an error set. */
typedef struct {
    int tree;
    int64_t *tok, *nt, *ns;
    Py_ssize_t longest;
    void *scratch;
} SmallWalk;

static PyObject *small_masks(const MaskEnv *e, PyObject *const *gs, int none_ok, PyObject *out,
                             Py_ssize_t rows, Py_ssize_t words, Py_ssize_t n, Py_ssize_t width,
                             int want_valid, int64_t *table, long long *ids, double *times,
                             long long vocab, double threshold, const SmallWalk *w) {
    PyObject *stops;
    long long known_vocab = 0;
    Py_ssize_t live;
    int known = resolve_matchers(e->facts, gs, n, words, none_ok, ids, &stops, &known_vocab, &live);
    if (known <= 0) return known < 0 ? NULL : Py_NewRef(Py_None);
    for (Py_ssize_t b = 0; b < n; b++) table[4 * b + 3] = ids[b];
    long long limit = vocab < known_vocab ? vocab : known_vocab;
    PyObject *mask = mask_for(e, out, rows, words), *valid = NULL, *result = NULL;
    if (mask == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    valid = want_valid ? flags_for(e, rows, n, width) : Py_NewRef(Py_None);
    if (valid == NULL) goto done;
    Py_buffer flags, rows_view, stop_view;
    if (want_valid && get_flags(valid, &flags, rows) != 0) goto done;
    if (get_buffer(mask, &rows_view, 1, 'i', 4, 2, "rows") != 0) goto release_flags;
    if (get_buffer(stops, &stop_view, 0, 'i', 8, 1, "stop_ids") != 0) goto release_rows;
    FfiAny *matchers = matcher_args(table, n);
    if (matchers != NULL) {
        Py_ssize_t checked = 0, rejected = 0, failed = -1;
        char *error = NULL;
        uint8_t *accepted = want_valid ? (uint8_t *)flags.buf : NULL;
        int32_t *mask_rows = (int32_t *)rows_view.buf;
        const int64_t *stop = (const int64_t *)stop_view.buf;
        struct timespec began;
        double seconds;
        clock_gettime(CLOCK_MONOTONIC, &began);
        Py_BEGIN_ALLOW_THREADS
        if (w->tree) {
            int32_t *queue = (int32_t *)w->scratch;
            uint8_t *keep = (uint8_t *)(queue + w->longest);
            Py_ssize_t nodes = w->longest;
            failed = walk_tree_table(mask_rows, words, w->nt, w->ns, w->tok, table, n, matchers,
                                     queue, keep, limit, stop, stop_view.shape[0], accepted,
                                     times, &checked, &rejected, &error);
            if (failed < 0 && accepted != NULL && live < n) /* unconstrained: what links reach */
                for (Py_ssize_t b = 0; b < n; b++)
                    if (ids[b] == 0)
                        reach(w->nt + b * nodes, w->ns + b * nodes, nodes, queue,
                              accepted + b * nodes);
        } else {
            failed = walk_table(mask_rows, words, w->tok, table, n, matchers,
                                (int64_t *)w->scratch, w->longest, limit, stop,
                                stop_view.shape[0], 0, accepted, times, &checked, &rejected,
                                &error);
        }
        Py_END_ALLOW_THREADS
        lap(&seconds, &began);
        PyObject *slow = failed < 0 ? count_build(e->tally, ids, times, n, rows, seconds, checked,
                                                  rejected, threshold)
                                    : Py_NewRef(Py_None);
        if (slow != NULL) {
            if (failed < 0)
                result = Py_BuildValue("OOnON", mask, valid, (Py_ssize_t)-1, Py_None, slow);
            else
                result = Py_BuildValue("OOnsN", mask, valid, failed,
                                       error != NULL ? error : "xgrammar failed", slow);
        }
        free(error);
        PyMem_Free(matchers);
    }
    PyBuffer_Release(&stop_view);
release_rows:
    PyBuffer_Release(&rows_view);
release_flags:
    if (want_valid) PyBuffer_Release(&flags);
done:
    Py_XDECREF(valid);
    Py_DECREF(mask);
    return result;
}

/* tree_masks' three [batch, nodes] int64 arrays, held: 0 when they all are such arrays of one
   shape, else -1 with none held and no error set. */
static int get_tree_arrays(PyObject *const *objs, Py_buffer *views) {
    static const char *names[3] = {"next_token", "next_sibling", "tokens"};
    for (int i = 0; i < 3; i++) {
        if (get_buffer(objs[i], &views[i], 0, 'i', 8, 2, names[i]) != 0 ||
            views[i].shape[0] != views[0].shape[0] || views[i].shape[1] != views[0].shape[1] ||
            views[i].shape[1] < 1) {
            if (PyErr_Occurred())
                PyErr_Clear();
            else
                PyBuffer_Release(&views[i]);
            while (i-- > 0) PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static PyObject *tree_masks(PyObject *self, PyObject *args) {
    PyObject *env, *grammars, *arrays[3], *vocab_obj, *out;
    int want_valid;
    double threshold;
    MaskEnv e;
    if (!PyArg_ParseTuple(args, "OOOOOOOpd", &env, &grammars, &arrays[0], &arrays[1], &arrays[2],
                          &vocab_obj, &out, &want_valid, &threshold) ||
        read_env(env, &e) != 0)
        return NULL;
    if (PyDict_GET_SIZE(e.held) != 0) Py_RETURN_NONE; /* pending builds hold matchers */
    Py_ssize_t n;
    PyObject *const *gs = draft_items(grammars, &n);
    long long vocab = plain_vocab(vocab_obj);
    if (n <= 0 || vocab < 0) Py_RETURN_NONE;
    Py_buffer views[3];
    if (get_tree_arrays(arrays, views) != 0) Py_RETURN_NONE;
    Py_ssize_t words = (Py_ssize_t)((vocab + 31) >> 5), nodes = views[0].shape[1];
    Py_ssize_t rows = n * nodes;
    int64_t *nt = (int64_t *)views[0].buf, *ns = (int64_t *)views[1].buf;
    int64_t *tok = (int64_t *)views[2].buf;
    PyObject *result = NULL;
    long long *ids = PyMem_Malloc(sizeof(long long) * (size_t)n);
    double *times = PyMem_Calloc((size_t)n, sizeof(double));
    int64_t *table = PyMem_Malloc(sizeof(int64_t) * 4 * (size_t)n);
    /* scratch of one tree: in-degrees and queue (int32), then flags (one byte each) */
    void *scratch = PyMem_Malloc((size_t)nodes * (2 * sizeof(int32_t) + 1));
    if (ids == NULL || times == NULL || table == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (views[0].shape[0] != n) goto decline;
    int32_t *indegree = (int32_t *)scratch, *queue = indegree + nodes;
    uint8_t *seen = (uint8_t *)(queue + nodes);
    for (Py_ssize_t b = 0; b < n; b++) {
        if (!request_links_valid(nt + b * nodes, ns + b * nodes, nodes, indegree, queue, seen))
            goto decline; /* the general build explains which link is wrong */
        table[4 * b] = table[4 * b + 1] = b * nodes;
        table[4 * b + 2] = nodes;
    }
    SmallWalk walk = {1, tok, nt, ns, nodes, scratch};
    result = small_masks(&e, gs, 1, out, rows, words, n, nodes, want_valid, table, ids, times,
                         vocab, threshold, &walk);
    goto done;
decline:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(scratch);
    PyMem_Free(table);
    PyMem_Free(times);
    PyMem_Free(ids);
    for (int i = 0; i < 3; i++) PyBuffer_Release(&views[i]);
    return result;
}

static PyObject *span_masks(PyObject *self, PyObject *args) {
    PyObject *env, *grammars, *tokens_obj, *offsets_obj, *vocab_obj, *out;
    Py_ssize_t width;
    int want_valid;
    double threshold;
    MaskEnv e;
    if (!PyArg_ParseTuple(args, "OOOOnOOpd", &env, &grammars, &tokens_obj, &offsets_obj, &width,
                          &vocab_obj, &out, &want_valid, &threshold) ||
        read_env(env, &e) != 0)
        return NULL;
    if (PyDict_GET_SIZE(e.held) != 0) Py_RETURN_NONE; /* pending builds hold matchers */
    Py_ssize_t n;
    PyObject *const *gs = draft_items(grammars, &n);
    long long vocab = plain_vocab(vocab_obj);
    if (n <= 0 || vocab < 0 || (offsets_obj == Py_None && width < 1)) Py_RETURN_NONE;
    Py_ssize_t words = (Py_ssize_t)((vocab + 31) >> 5);
    /* the offsets: a tuple or list of Python ints (a packed layout's, made once per layout:
       reading them costs nothing like a numpy buffer export with cold caches) */
    Py_ssize_t n_off = 0;
    PyObject *const *offs = NULL;
    int has_offsets = offsets_obj != Py_None;
    if (has_offsets && ((offs = draft_items(offsets_obj, &n_off)) == NULL || n_off != n + 1))
        Py_RETURN_NONE;
    Py_buffer tokens;
    if (!array_view(tokens_obj, &tokens, 1, 'i', 8) &&
        PyObject_GetBuffer(tokens_obj, &tokens, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                                                    PyBUF_WRITABLE) != 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = NULL;
    long long *ids = PyMem_Malloc(sizeof(long long) * (size_t)n);
    double *times = PyMem_Calloc((size_t)n, sizeof(double));
    int64_t *table = PyMem_Malloc(sizeof(int64_t) * 4 * (size_t)n);
    int64_t *links = NULL;
    if (ids == NULL || times == NULL || table == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *fmt = tokens.format ? tokens.format : "B";
    if (*fmt == '=' || *fmt == '@' || *fmt == '<') fmt++;
    if ((fmt[0] != 'q' && fmt[0] != 'l') || fmt[1] != 0 || tokens.itemsize != 8) goto decline;
    Py_ssize_t total = tokens.len / 8, rows = 0, longest = 1;
    int64_t end = 0; /* offsets[b + 1] as read (offsets[0] must be 0) */
    if (has_offsets && (exact_int(offs[0], &end) != 0 || end != 0)) goto decline;
    for (Py_ssize_t b = 0; b < n; b++) { /* request b: rows (and tokens) first .. first + len */
        int64_t first = has_offsets ? end : (int64_t)b * width;
        if (has_offsets && exact_int(offs[b + 1], &end) != 0) goto decline;
        int64_t len = has_offsets ? end - first : width;
        if (len < 1 || first != rows) goto decline;
        table[4 * b] = table[4 * b + 1] = first;
        table[4 * b + 2] = len;
        rows += len;
        if (len > longest) longest = len;
    }
    if (rows != total) goto decline;
    if ((links = PyMem_Malloc(sizeof(int64_t) * 2 * (size_t)longest)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    SmallWalk walk = {0, (int64_t *)tokens.buf, NULL, NULL, longest, links};
    result = small_masks(&e, gs, 0, out, rows, words, n, has_offsets ? 0 : width, want_valid,
                         table, ids, times, vocab, threshold, &walk);
    goto done;
decline:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(links);
    PyMem_Free(table);
    PyMem_Free(times);
    PyMem_Free(ids);
    PyBuffer_Release(&tokens);
    return result;
}

/* Nonzero words of one row, counting up to `most + 1` (enough to tell "at most `most`"). */
static Py_ssize_t nonzero_words(const int32_t *row, Py_ssize_t width, Py_ssize_t most) {
    Py_ssize_t count = 0;
    for (Py_ssize_t w = 0; w < width && count <= most; w++) count += row[w] != 0;
    return count;
}

/* Whether int32 `row` allows `token`, clamped into [0, limit) (the caller has cut the chain
   at its first token outside that range where it matters). */
static int row_allows(const int32_t *row, int64_t token, int64_t limit) {
    int64_t safe = token < 0 ? 0 : token >= limit ? limit - 1 : token;
    return ((uint32_t)row[safe >> 5] >> (safe & 31)) & 1;
}

static PyObject *chain_live(PyObject *self, PyObject *args) {
    PyObject *target_obj, *rows_obj, *tokens_obj, *usable_obj, *ended_obj;
    int first_word, last_word;
    Py_ssize_t most;
    if (!PyArg_ParseTuple(args, "OOOOOiin", &target_obj, &rows_obj, &tokens_obj, &usable_obj,
                          &ended_obj, &first_word, &last_word, &most))
        return NULL;
    Py_buffer target, rows, tokens, usable, ended;
    PyObject *result = NULL;
    if (get_buffer(target_obj, &target, 0, 'i', 4, 2, "target") != 0) return NULL;
    if (get_buffer(rows_obj, &rows, 0, 'i', 8, 2, "rows") != 0) goto fail_target;
    if (get_buffer(tokens_obj, &tokens, 0, 'i', 8, 2, "tokens") != 0) goto fail_rows;
    if (get_buffer(usable_obj, &usable, 0, 'i', 8, 1, "usable") != 0) goto fail_tokens;
    Py_ssize_t count = rows.shape[0], nodes = rows.shape[1];
    if (get_flags(ended_obj, &ended, count) != 0) goto fail_usable;
    Py_ssize_t drafts = tokens.shape[1], height = target.shape[0], width = target.shape[1];
    const int64_t *row = (const int64_t *)rows.buf, *tok = (const int64_t *)tokens.buf;
    const int64_t *use = (const int64_t *)usable.buf;
    if (tokens.shape[0] != count || drafts != nodes - 1 || usable.shape[0] != count ||
        width < 1) {
        PyErr_SetString(PyExc_ValueError, "chain_live: rows [count, nodes], tokens "
                                          "[count, nodes - 1], usable and ended [count]");
        goto fail_ended;
    }
    for (Py_ssize_t j = 0; j < count * nodes; j++)
        if (row[j] < 0 || row[j] >= height) {
            PyErr_SetString(PyExc_ValueError, "chain_live: a row index is outside target");
            goto fail_ended;
        }
    PyObject *live = PyList_New(count), *checks = PyList_New(0);
    if (live == NULL || checks == NULL) goto fail_lists;
    const int32_t *t = (const int32_t *)target.buf;
    const uint8_t *stopped = (const uint8_t *)ended.buf;
    const int64_t limit = 32 * (int64_t)width;
    for (Py_ssize_t k = 0; k < count; k++) {
        const int64_t *r = row + k * nodes, *d = tok + k * drafts;
        Py_ssize_t n = drafts; /* drafts before the first its parent's row refuses */
        for (Py_ssize_t i = 0; i < drafts; i++) {
            if (i >= use[k] || !row_allows(t + r[i] * width, d[i], limit)) {
                n = i;
                break;
            }
        }
        PyObject *value = PyLong_FromSsize_t(n);
        if (value == NULL) goto fail_lists;
        PyList_SET_ITEM(live, k, value);
        if (stopped[k]) continue;
        for (Py_ssize_t i = 0; i < n; i++) { /* rows to decide on a fork */
            const int32_t *own = t + r[i + 1] * width;
            int intact = own[0] == first_word && own[width - 1] == last_word;
            int sparse = row_allows(own, d[i], limit) && nonzero_words(own, width, most) <= most;
            if (!intact && !sparse) continue;
            PyObject *item = Py_BuildValue("nnOO", k, i, intact ? Py_True : Py_False,
                                           sparse ? Py_True : Py_False);
            if (item == NULL || PyList_Append(checks, item) != 0) {
                Py_XDECREF(item);
                goto fail_lists;
            }
            Py_DECREF(item);
        }
    }
    result = Py_BuildValue("NN", live, checks);
    live = checks = NULL;
fail_lists:
    Py_XDECREF(live);
    Py_XDECREF(checks);
fail_ended:
    PyBuffer_Release(&ended);
fail_usable:
    PyBuffer_Release(&usable);
fail_tokens:
    PyBuffer_Release(&tokens);
fail_rows:
    PyBuffer_Release(&rows);
fail_target:
    PyBuffer_Release(&target);
    return result;
}

static PyMethodDef methods[] = {
    {"links_valid", links_valid, METH_VARARGS,
     "links_valid(next_token, next_sibling) -> bool: whether int64 [batch, nodes] links form "
     "valid verify trees (GIL released)."},
    {"repair_rows", repair_rows, METH_VARARGS,
     "repair_rows(rows, next_token, next_sibling, draft, limit, stop_ids, root_ok) -> "
     "(kept, checked, rejected): write -1 into every row of one request that is not an "
     "accepted, non-terminated node's; count rows kept, draft nodes checked against the "
     "grammar and those refused (GIL released)."},
    {"repair_chains", repair_chains, METH_VARARGS,
     "repair_chains(rows, tokens, spans, limit, stop_ids, repeat) -> (checked, rejected): "
     "repair_rows over many chains in one call; with `repeat`, rows after a refused draft "
     "copy the row before it (GIL released)."},
    {"keep_rows", keep_rows, METH_VARARGS,
     "keep_rows(rows, next_token, next_sibling, draft, limit, stop_ids, root_ok, kept) -> "
     "(kept, checked, refused): the decision of repair_rows without writing any row; the "
     "kept nodes go to `kept` (int32 [nodes]) in ascending order (GIL released)."},
    {"take_rows", take_rows, METH_VARARGS,
     "take_rows(source, index, dest[, numbers, base]): dest[i] = source[index[i]] for int32 "
     "rows, words past the source's width set to 0; numbers[i] = index[i] + base (GIL "
     "released)."},
    {"xgrammar_bind", xgrammar_bind, METH_VARARGS,
     "xgrammar_bind(call, move_error, decref, traverse, is_terminated, type_index): take "
     "xgrammar's matcher methods through tvm-ffi's C ABI."},
    {"xgrammar_traverse", xgrammar_traverse, METH_VARARGS,
     "xgrammar_traverse(matcher, next_token, next_sibling, draft, rows): one request's "
     "traverse_draft_tree, GIL released; RuntimeError with xgrammar's message."},
    {"walk_chains", walk_chains, METH_VARARGS,
     "walk_chains(rows, tokens, spans, limit, stop_ids, repeat[, valid[, seconds]]) -> (checked, "
     "rejected, failed, message): traverse and repair many chains in one call, GIL released."},
    {"walk_trees", walk_trees, METH_VARARGS,
     "walk_trees(rows, next_token, next_sibling, tokens, spans, limit, stop_ids[, valid[, "
     "seconds]]) -> (checked, rejected, failed, message): traverse and repair many trees in "
     "one call, GIL released."},
    {"pack_chains", pack_chains, METH_VARARGS,
     "pack_chains(drafts, handles, stride, vocab_size, ends, active, rows, valid[, limit, "
     "stop_ids, seconds, repeat, plain]) -> (tokens, table, owners, walked), (checked, rejected, "
     "failed, "
     "message) with `limit`, or None: per-request draft lists as walk_chains' table, the rows "
     "no grammar walks written; with `limit`, walked and repaired in the same call (GIL "
     "released)."},
    {"vllm_chains", vllm_chains, METH_VARARGS,
     "vllm_chains(requests, ids, spec_tokens, known, wrapper_types, rows, stride, no_ends) -> "
     "(rows used, (checked, rejected, failed, message), drafts) or None: the vLLM plugin's "
     "common step read from vLLM's objects, walked and repaired (GIL released)."},
    {"chain_live", chain_live, METH_VARARGS,
     "chain_live(target, rows, tokens, usable, ended, first_word, last_word, most) -> (live, "
     "checks): after llguidance's executor filled chains: per request how many leading drafts "
     "its parents' rows allow (up to usable[k]), and the (request, draft, intact, sparse) rows "
     "of those drafts still holding both sentinel words, or allowing their own token with at "
     "most `most` nonzero words (ended requests: none)."},
    {"span_masks", span_masks, METH_VARARGS,
     "span_masks(env, grammars, tokens, offsets, width, vocab_size, out, want_valid, threshold) "
     "-> (mask, valid, failed, message, slow) or None: a small build of chain trees (host int64 "
     "tokens; offsets None, or a tuple of ints) in one call, GIL released for the walk."},
    {"tree_masks", tree_masks, METH_VARARGS,
     "tree_masks(env, grammars, next_token, next_sibling, tokens, vocab_size, out, want_valid, "
     "threshold) -> (mask, valid, failed, message, slow) or None: a small build of trees (host "
     "int64 [batch, nodes] arrays) in one call, GIL released for the walk."},
    {"chain_masks", chain_masks, METH_VARARGS,
     "chain_masks(env, grammars, drafts, rows_per_request, vocab_size, ends, active, out, "
     "want_valid, max_rows, threshold) -> (mask, valid, failed, message, extra) or None: "
     "build_chain_bitmask's common call (matchers' facts from env's table) in one call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "portable_spec._native",
    "GIL-free index work of the mask build (link validation, row repair, row copies).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef PS_NUMPY
    import_array();
#endif
    PyObject *m = PyModule_Create(&module);
    /* repair_rows takes the optional `valid` output (older builds of this module do not) */
    if (m != NULL && PyModule_AddIntConstant(m, "REPAIR_VALID", 1) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
