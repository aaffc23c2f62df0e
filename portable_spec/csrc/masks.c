/* The mask builds in one call: chain_masks (an engine's draft lists), span_masks (chains
   already in a host array), tree_masks (host verify trees), and pack_chains (the vLLM
   plugin's lists with its matchers). Each checks everything first and declines (None, nothing
   written, no matcher called) on anything unusual: the general build then checks again and
   raises what it must. */

/* Whether `out` is an ndarray (exactly that type) the rows can be written into: native int32,
   C-contiguous, writable, [rows, words]. No error set either way. */
static int fits_rows(PyObject *out, Py_ssize_t rows, Py_ssize_t words) {
#ifdef PS_NUMPY
    if (Py_TYPE(out) != &PyArray_Type) return 0;
#else
    if ((PyObject *)Py_TYPE(out) != env_ndarray) return 0;
#endif
    Array a;
    if (array_get(out, &a, 1, 'i', 4, 2, "out") != 0) {
        PyErr_Clear();
        return 0;
    }
    int ok = a.view.shape[0] == rows && a.view.shape[1] == words;
    array_release(&a);
    return ok;
}

/* The int32 [rows, words] mask to write: `out` (a new reference) when it fits, a new array
   when `out` is None, NULL with no error set when `out` does not fit, NULL with an error set
   when the allocation failed. */
static PyObject *mask_for(PyObject *out, Py_ssize_t rows, Py_ssize_t words) {
    if (out == Py_None) {
#ifdef PS_NUMPY
        npy_intp dims[2] = {rows, words};
        return PyArray_SimpleNew(2, dims, NPY_INT32);
#else
        return PyObject_CallFunction(env_empty, "(nn)O", rows, words, env_int32);
#endif
    }
    return fits_rows(out, rows, words) ? Py_NewRef(out) : NULL;
}

/* A new bool array of `rows` flags shaped [batch, width] (width > 0) or [rows]. */
static PyObject *flags_for(Py_ssize_t rows, Py_ssize_t batch, Py_ssize_t width) {
#ifdef PS_NUMPY
    npy_intp dims[2] = {width ? batch : rows, width};
    return PyArray_SimpleNew(width ? 2 : 1, dims, NPY_BOOL);
#else
    return width ? PyObject_CallFunction(env_empty, "(nn)O", batch, width, env_bool)
                 : PyObject_CallFunction(env_empty, "(n)O", rows, env_bool);
#endif
}

enum { TALLY_BUILDS, TALLY_REQUESTS, TALLY_ROWS, TALLY_BUILD_SECONDS, TALLY_WALK_SECONDS,
       TALLY_CHECKED, TALLY_REJECTED, TALLY_SLOWEST, TALLY_SIZE };

/* The walks of `w` slower than `threshold` seconds as a list of (request, seconds), or None;
   NULL with an error set. Entries without a matcher are not walks. */
static PyObject *slow_walks(const Walk *w, double threshold) {
    PyObject *slow = Py_NewRef(Py_None);
    for (Py_ssize_t b = 0; threshold > 0.0 && b < w->count; b++) {
        if (w->matchers[b] == NULL || w->times[b] <= threshold) continue;
        if (slow == Py_None) {
            Py_DECREF(slow);
            if ((slow = PyList_New(0)) == NULL) return NULL;
        }
        PyObject *item = Py_BuildValue("nd", b, w->times[b]);
        if (item == NULL || PyList_Append(slow, item) != 0) {
            Py_XDECREF(item);
            Py_DECREF(slow);
            return NULL;
        }
        Py_DECREF(item);
    }
    return slow;
}

/* Add a finished walk to the tally (builds, requests, rows, summed walk seconds, wall
   seconds, checked nodes, refused nodes, slowest walk). 0, or -1 with an error set. */
static int count_build(const Walk *w, Py_ssize_t rows, double seconds) {
    Py_buffer tally;
    if (PyObject_GetBuffer(env_tally, &tally, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0)
        return -1;
    double *t = (double *)tally.buf, total = 0.0, slowest = 0.0;
    Py_ssize_t requests = 0;
    for (Py_ssize_t b = 0; b < w->count; b++) {
        if (w->matchers[b] == NULL) continue;
        requests++;
        total += w->times[b];
        if (w->times[b] > slowest) slowest = w->times[b];
    }
    t[TALLY_BUILDS] += 1.0;
    t[TALLY_REQUESTS] += (double)requests;
    t[TALLY_ROWS] += (double)rows;
    t[TALLY_BUILD_SECONDS] += total;
    t[TALLY_WALK_SECONDS] += seconds;
    t[TALLY_CHECKED] += (double)w->checked;
    t[TALLY_REJECTED] += (double)w->rejected;
    if (slowest > t[TALLY_SLOWEST]) t[TALLY_SLOWEST] = slowest;
    PyBuffer_Release(&tally);
    return 0;
}

/* vocab_size as the builds take it: an exact int in (0, 2^40], else -1. */
static long long plain_vocab(PyObject *obj) {
    int64_t vocab;
    return exact_int(obj, &vocab) != 0 || vocab <= 0 || vocab > (1LL << 40) ? -1 : vocab;
}

/* Each of the n grammars made walk entry b's matcher (None: none, allowed with `none_ok`), its
   stop tokens copied and w->limit set to min(vocab, the matchers' vocabulary): 1 when each is
   a matcher of the facts table at `words` words, they share one stop set and vocabulary and
   one at least is there; 0 when not (no error set); -1 with an error set. */
static int build_matchers(Walk *w, PyObject *const *gs, Py_ssize_t n, Py_ssize_t words,
                          int none_ok, int64_t vocab) {
    PyObject *stops = NULL;
    int64_t known = 0;
    int ok = 1;
    if (walk_reserve(w, n) != 0) return -1;
    w->words = words;
    for (Py_ssize_t b = 0; b < n && ok == 1; b++) {
        Facts f;
        if (gs[b] == Py_None) {
            ok = none_ok;
            continue;
        }
        ok = walk_known(w, b, gs[b], words, &f);
        if (ok != 1) break;
        if (stops == NULL) {
            stops = Py_NewRef(f.stops);
            known = f.vocab;
        } else if (f.stops != stops || f.vocab != known) {
            ok = 0; /* matchers of other tokenizers: the general build checks them */
        }
    }
    if (ok == 1 && stops == NULL) ok = 0;
    if (ok == 1 && walk_copy_stops(w, stops) != 0) ok = -1;
    Py_XDECREF(stops);
    w->limit = vocab < known ? vocab : known;
    if (ok < 0 || PyErr_Occurred()) return PyErr_Occurred() ? -1 : ok;
    return ok;
}

/* The end of every build: the walk held unless it is (None when another build holds a matcher), run, the
   tally counted; returns (mask, valid, failed, message, slow) (`slow`: the walks over
   `threshold`, or None), NULL with an error set. The outputs are held by the caller. */
static PyObject *build_walked(Walk *w, PyObject *mask, PyObject *valid, Py_ssize_t rows,
                              double threshold) {
    int held = w->token != NULL ? 1 : walk_hold(w); /* held already by a build that packs */
    if (held <= 0) return held < 0 ? NULL : Py_NewRef(Py_None);
    struct timespec began;
    double seconds;
    clock_gettime(CLOCK_MONOTONIC, &began);
    if (walk_timed(w) != 0 || walk_run(w) != 0) return NULL;
    lap(&seconds, &began);
    if (w->failed >= 0)
        return Py_BuildValue("OOnsO", mask, valid, w->failed,
                             w->error != NULL ? w->error : "xgrammar failed", Py_None);
    PyObject *slow = slow_walks(w, threshold);
    if (slow == NULL || count_build(w, rows, seconds) != 0) {
        Py_XDECREF(slow);
        return NULL;
    }
    return Py_BuildValue("OOnON", mask, valid, (Py_ssize_t)-1, Py_None, slow);
}

/* The destination of a build: the mask and the flags, made or checked, held by `mask` and
   `valid` (new references); their buffers set in `w`. 1, 0 when `out` does not fit (nothing
   written), -1 with an error set. */
static int build_outputs(Walk *w, PyObject *out, Py_ssize_t rows, Py_ssize_t batch,
                         Py_ssize_t width, int want_valid, PyObject **mask, PyObject **valid) {
    *valid = NULL;
    if ((*mask = mask_for(out, rows, w->words)) == NULL) return PyErr_Occurred() ? -1 : 0;
    *valid = want_valid ? flags_for(rows, batch, width) : Py_NewRef(Py_None);
    if (*valid == NULL) return -1;
    Array a;
    if (array_get(*mask, &a, 1, 'i', 4, 2, "out") != 0) return -1;
    w->rows = (int32_t *)a.view.buf; /* held by *mask, which the caller holds */
    array_release(&a);
    if (want_valid) {
        if (array_flags(*valid, &a, rows) != 0) return -1;
        w->flags = (uint8_t *)a.view.buf;
        array_release(&a);
    }
    return 1;
}

/* The rows of a batch of draft lists before they are read item by item: the sum of each
   list's length + 1, or of the stride; -1 when a list is not a list or tuple or does not fit
   its stride. */
static Py_ssize_t chain_rows(PyObject *const *ds, Py_ssize_t n, Py_ssize_t stride) {
    Py_ssize_t rows = 0;
    for (Py_ssize_t b = 0; b < n; b++) {
        Py_ssize_t k;
        sequence_items(ds[b], &k);
        if (k < 0 || (stride && k >= stride)) return -1;
        rows += stride ? stride : k + 1;
    }
    return rows;
}

/* rows_per_request as chain_masks takes it: 0 for None, an exact int in [1, 2^24], or -1. */
static Py_ssize_t plain_stride(PyObject *obj) {
    int64_t stride;
    if (obj == Py_None) return 0;
    return exact_int(obj, &stride) != 0 || stride < 1 || stride > (1 << 24) ? -1
                                                                             : (Py_ssize_t)stride;
}

/* chain_masks after its arguments are read: the walk's matchers resolved, the outputs made,
   the lists packed and walked (or, from `max_rows` rows on, packed for the caller to walk in
   parts). */
static PyObject *chains_built(Walk *w, Pack *p, PyObject *const *gs, PyObject *drafts,
                              PyObject *out, int want_valid, Py_ssize_t max_rows,
                              double threshold) {
    PyObject *const *ds = p->requests;
    Py_ssize_t words = (Py_ssize_t)((p->vocab + 31) >> 5), live = 0;
    int known = build_matchers(w, gs, p->n, words, 1, p->vocab);
    if (known <= 0) return known < 0 ? NULL : Py_NewRef(Py_None);
    Py_ssize_t rows = chain_rows(ds, p->n, p->stride);
    if (rows < 0) return Py_NewRef(Py_None);
    PyObject *mask = NULL, *valid = NULL, *result = NULL;
    int made = build_outputs(w, out, rows, p->n, p->stride, want_valid, &mask, &valid);
    if (made <= 0) {
        result = made < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    /* from here on no Python code runs until the lists are packed */
    int held = 0;
    if (!pack_check(p, drafts) || p->rows != rows || (held = walk_hold(w)) <= 0) {
        result = held < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    if (pack_fill(p, w, w->rows, words, w->flags) != 0) goto done;
    for (Py_ssize_t b = 0; b < w->count; b++) live += w->matchers[b] != NULL;
    if (max_rows > 0 && rows >= max_rows && live > 1) { /* walked in parts by the caller */
        PyObject *packed = pack_table(w, p);
        if (packed != NULL)
            result = Py_BuildValue("OOnO(NLy#)", mask, valid, (Py_ssize_t)-2, Py_None, packed,
                                   (long long)w->limit, (const char *)w->stops,
                                   (Py_ssize_t)sizeof(int64_t) * w->nstops);
        goto done;
    }
    result = build_walked(w, mask, valid, rows, threshold);
done:
    Py_XDECREF(valid);
    Py_XDECREF(mask);
    return result;
}

static PyObject *chain_masks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *grammars, *drafts, *stride_obj, *vocab_obj, *ends_obj, *active, *out;
    int want_valid;
    Py_ssize_t max_rows, n;
    double threshold;
    if (!PyArg_ParseTuple(args, "OOOOOOOpnd", &grammars, &drafts, &stride_obj, &vocab_obj,
                          &ends_obj, &active, &out, &want_valid, &max_rows, &threshold))
        return NULL;
    PyObject *const *gs = sequence_items(grammars, &n);
    Pack p = {0};
    p.requests = sequence_items(drafts, &p.n);
    p.stride = plain_stride(stride_obj);
    p.vocab = plain_vocab(vocab_obj);
    p.active = active;
    if (!env_ready() || n <= 0 || p.n != n || p.stride < 0 || p.vocab < 0) Py_RETURN_NONE;
    Array ends;
    if (array_get(ends_obj, &ends, 0, 'i', 8, 1, "ends") != 0) return NULL;
    p.ends = ends.view.buf;
    p.nends = ends.view.shape[0];
    Walk w;
    walk_init(&w, WALK_CHAINS);
    PyObject *result = chains_built(&w, &p, gs, drafts, out, want_valid, max_rows, threshold);
    walk_clear(&w);
    array_release(&ends);
    return result;
}

/* span_masks' spans from `offsets` (None: request b is `width` tokens from b * width; else a
   list or tuple of batch + 1 exact ints, 0 first, each chain at least one token) into the
   walk; the rows they cover, or -1 when malformed. */
static Py_ssize_t offset_spans(Walk *w, PyObject *offsets, Py_ssize_t n, Py_ssize_t width) {
    Py_ssize_t n_off = 0, rows = 0;
    PyObject *const *offs = NULL;
    int64_t end = 0; /* offsets[b + 1] as read */
    if (offsets != Py_None &&
        ((offs = sequence_items(offsets, &n_off)) == NULL || n_off != n + 1 ||
         exact_int(offs[0], &end) != 0 || end != 0))
        return -1;
    if (offsets == Py_None && width < 1) return -1;
    for (Py_ssize_t b = 0; b < n; b++) {
        int64_t first = offs != NULL ? end : (int64_t)b * width;
        if (offs != NULL && exact_int(offs[b + 1], &end) != 0) return -1;
        int64_t len = offs != NULL ? end - first : width;
        if (len < 1 || first != rows) return -1;
        walk_span(w, b, first, first, len);
        rows += len;
    }
    return rows;
}

static PyObject *span_masks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *grammars, *tokens_obj, *offsets, *vocab_obj, *out;
    Py_ssize_t width, n;
    int want_valid;
    double threshold;
    if (!PyArg_ParseTuple(args, "OOOnOOpd", &grammars, &tokens_obj, &offsets, &width, &vocab_obj,
                          &out, &want_valid, &threshold))
        return NULL;
    PyObject *const *gs = sequence_items(grammars, &n);
    long long vocab = plain_vocab(vocab_obj);
    if (!env_ready() || n <= 0 || vocab < 0) Py_RETURN_NONE;
    Array tokens;
    if (array_get(tokens_obj, &tokens, 0, 'i', 8, -1, "tokens") != 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Walk w;
    walk_init(&w, WALK_CHAINS);
    PyObject *mask = NULL, *valid = NULL, *result = NULL;
    Py_ssize_t words = (Py_ssize_t)((vocab + 31) >> 5);
    int known = build_matchers(&w, gs, n, words, 0, vocab);
    if (known <= 0) {
        result = known < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t rows = offset_spans(&w, offsets, n, width);
    if (rows < 0 || rows != tokens.view.len / 8) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (walk_copy_tokens(&w, tokens.view.buf, rows) != 0) goto done;
    int made = build_outputs(&w, out, rows, n, offsets == Py_None ? width : 0, want_valid, &mask,
                             &valid);
    if (made > 0 && walk_spans_fit(&w, rows, 0))
        result = build_walked(&w, mask, valid, rows, threshold);
    else if (made == 0)
        result = Py_NewRef(Py_None);
done:
    Py_XDECREF(valid);
    Py_XDECREF(mask);
    walk_clear(&w);
    array_release(&tokens);
    return result;
}

static PyObject *tree_masks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *grammars, *objs[3], *vocab_obj, *out;
    Py_ssize_t n;
    int want_valid;
    double threshold;
    if (!PyArg_ParseTuple(args, "OOOOOOpd", &grammars, &objs[0], &objs[1], &objs[2], &vocab_obj,
                          &out, &want_valid, &threshold))
        return NULL;
    PyObject *const *gs = sequence_items(grammars, &n);
    long long vocab = plain_vocab(vocab_obj);
    if (!env_ready() || n <= 0 || vocab < 0) Py_RETURN_NONE;
    Array a[3] = {0};
    Walk w;
    walk_init(&w, WALK_TREES);
    w.reach_free = 1;
    PyObject *mask = NULL, *valid = NULL, *result = NULL;
    for (int i = 0; i < 3; i++) {
        if (array_get(objs[i], &a[i], 0, 'i', 8, 2, "tree") != 0 ||
            a[i].view.shape[0] != n || a[i].view.shape[1] != a[0].view.shape[1] ||
            a[i].view.shape[1] < 1) {
            PyErr_Clear();
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    Py_ssize_t nodes = a[0].view.shape[1], rows = n * nodes;
    int known = build_matchers(&w, gs, n, (Py_ssize_t)((vocab + 31) >> 5), 1, vocab);
    if (known <= 0) {
        result = known < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t b = 0; b < n; b++) walk_span(&w, b, b * nodes, b * nodes, nodes);
    if (walk_copy_tokens(&w, a[2].view.buf, rows) != 0 ||
        walk_copy_links(&w, a[0].view.buf, a[1].view.buf, rows) != 0)
        goto done;
    int links = walk_links_valid(&w); /* on the copies xgrammar reads */
    int made = links > 0 ? build_outputs(&w, out, rows, n, nodes, want_valid, &mask, &valid) : 0;
    if (links < 0 || made < 0) goto done;
    if (made > 0)
        result = build_walked(&w, mask, valid, rows, threshold);
    else
        result = Py_NewRef(Py_None); /* the general build says which link is wrong */
done:
    Py_XDECREF(valid);
    Py_XDECREF(mask);
    walk_clear(&w);
    for (int i = 0; i < 3; i++) array_release(&a[i]);
    return result;
}
