/*
 * portable_spec._native: the index work of the mask build and xgrammar's walks, without the
 * GIL. Built as one translation unit from the files below, each one concern:
 *
 *   kernels.c        the index kernels over plain arrays (no Python; kernels.h)
 *   arrays.c         the caller's arrays read and held
 *   xgrammar_abi.c   xgrammar's matcher methods through tvm-ffi's C ABI
 *   env.c            the library's tables the builds read (configure), the walk hook
 *   walk.c           the walk runner: the one place that calls xgrammar without the GIL
 *   array_entries.c  links_valid, tree_matches, selection_valid, repair_rows, keep_rows,
 *                    take_rows, repair_chains, chain_live
 *   walk_entries.c   xgrammar_traverse, walk_chains, walk_trees
 *   grow.c           xgrammar_grow: a draft tree's new nodes, the matcher moved step by step;
 *                    xgrammar_level: a draft level checked, written, grown and copied out
 *   pack.c           draft lists packed into a walk; pack_chains
 *   masks.c          chain_masks, span_masks, tree_masks
 *   vllm.c           vllm_chains, read from vLLM's objects (the attribute names handed in)
 *   llguidance.c     llguidance_walk: an llguidance matcher's walk, its methods called from C
 *   llguidance_entries.c  llguidance_walks, llguidance_masks: batches of them
 *   guidance.c       vllm_guidance: vLLM's guidance step, one llguidance call per request
 *   forced.c         xgrammar_forced_start/_step/_run: forced_drafts' walk of xgrammar matchers
 *   module.c         the module table
 *
 * The rule every entry keeps: every Python object and buffer the C reads without the GIL is
 * owned for the whole time it is read, by a reference or as a private copy; what is checked
 * before the GIL is released is the copy that is read after; an index read from a caller's
 * array is bounded where it is used. Python code can run whenever the C calls into Python
 * (an attribute read, a key comparison, an allocation that collects garbage): anything
 * borrowed is held by a reference before such a call. portable_spec/native.py is the only way
 * into this module and says what each entry does; ABI_VERSION changes whenever an entry's
 * arguments or results do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef PS_NUMPY
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#endif

#include "kernels.h"

#include "kernels.c"
#include "arrays.c"
#include "xgrammar_abi.c"
#include "env.c"
#include "walk.c"
#include "array_entries.c"
#include "walk_entries.c"
#include "grow.c"
#include "pack.c"
#include "masks.c"
#include "vllm.c"
#include "llguidance.c"
#include "llguidance_entries.c"
#include "guidance.c"
#include "forced.c"

#define ABI_VERSION 11

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(facts, held, tally, empty, int32, bool, ndarray): the library's tables."},
    {"set_walk_hook", set_walk_hook, METH_O,
     "set_walk_hook(hook or None): called with the GIL right before each walk drops it."},
    {"links_valid", links_valid, METH_VARARGS,
     "links_valid(next_token, next_sibling) -> bool (GIL released)."},
    {"selection_valid", selection_valid, METH_VARARGS,
     "selection_valid(select, parents, n) -> bool (GIL released)."},
    {"tree_matches", tree_matches, METH_VARARGS,
     "tree_matches(next_token, next_sibling, draft, select, parents, tokens) -> bool "
     "(GIL released)."},
    {"repair_rows", repair_rows, METH_VARARGS,
     "repair_rows(rows, next_token, next_sibling, draft, limit, stop_ids, root_state[, valid])"
     " -> (kept, checked, rejected) (GIL released)."},
    {"keep_rows", keep_rows, METH_VARARGS,
     "keep_rows(rows, next_token, next_sibling, draft, limit, stop_ids, root_state, kept) -> "
     "(kept, checked, rejected) (GIL released)."},
    {"take_rows", take_rows, METH_VARARGS,
     "take_rows(source, index, dest[, numbers, base]) (GIL released)."},
    {"repair_chains", repair_chains, METH_VARARGS,
     "repair_chains(rows, tokens, spans, limit, stop_ids, repeat) -> (checked, rejected) (GIL "
     "released)."},
    {"chain_live", chain_live, METH_VARARGS,
     "chain_live(target, rows, tokens, usable, ended, ends, first_word, last_word) -> (live, "
     "checks)."},
    {"xgrammar_bind", xgrammar_bind, METH_VARARGS,
     "xgrammar_bind(call, move_error, decref, traverse, is_terminated, type_index)."},
    {"xgrammar_bind_moves", xgrammar_bind_moves, METH_VARARGS,
     "xgrammar_bind_moves(accept_token, fill_next_token_bitmask, rollback)."},
    {"xgrammar_bind_forced", xgrammar_bind_forced, METH_VARARGS,
     "xgrammar_bind_forced(find_jump_forward_string, is_completed)."},
    {"xgrammar_forced_start", xgrammar_forced_start, METH_VARARGS,
     "xgrammar_forced_start(matchers, drafts, content_ends, state, out, rows, replies) -> "
     "(asks, failed, message, drafts) or None (GIL released)."},
    {"xgrammar_forced_step", xgrammar_forced_step, METH_VARARGS,
     "xgrammar_forced_step(matchers, answers, state, out, rows, replies) -> (asks, failed, "
     "message, drafts) or None (GIL released)."},
    {"xgrammar_forced_run", xgrammar_forced_run, METH_VARARGS,
     "xgrammar_forced_run(matchers, drafts, limits, token, block, cap, words, replies) -> "
     "(asks, failed, message, drafts) or None; the matchers held under token (GIL released)."},
    {"xgrammar_forced_release", xgrammar_forced_release, METH_VARARGS,
     "xgrammar_forced_release(token, matchers): what xgrammar_forced_run held."},
    {"xgrammar_grow", xgrammar_grow, METH_VARARGS,
     "xgrammar_grow(matchers, requests, limits, rows, parents, tokens, valid, live, start, end) "
     "-> (checked, rejected, failed, message) or None (GIL released)."},
    {"xgrammar_level", xgrammar_level, METH_VARARGS,
     "xgrammar_level(matchers, requests, limits, rows, parents, tokens, valid, live, first, "
     "level_parents, level_tokens, out) -> (status, padded, checked, rejected, failed, "
     "message) (GIL released to walk)."},
    {"xgrammar_traverse", xgrammar_traverse, METH_VARARGS,
     "xgrammar_traverse(matcher, next_token, next_sibling, draft, rows) -> bool or None (GIL "
     "released)."},
    {"walk_chains", walk_chains, METH_VARARGS,
     "walk_chains(rows, tokens, spans, matchers, limit, stop_ids, repeat[, valid, seconds, "
     "hold]) -> (checked, rejected, failed, message) or None (GIL released)."},
    {"walk_trees", walk_trees, METH_VARARGS,
     "walk_trees(rows, next_token, next_sibling, tokens, spans, matchers, limit, stop_ids[, "
     "valid, seconds, hold]) -> (checked, rejected, failed, message) or None (GIL released)."},
    {"pack_chains", pack_chains, METH_VARARGS,
     "pack_chains(drafts, matchers, stride, vocab_size, ends, active, rows, valid[, limit, "
     "stop_ids, seconds, repeat, plain]) -> packed, walked or None (GIL released to walk)."},
    {"vllm_chains", vllm_chains, METH_VARARGS,
     "vllm_chains(requests, ids, spec_tokens, known, wrapper_types, rows, stride, no_ends, "
     "names) -> (rows used, walked, drafts) or None (GIL released to walk)."},
    {"llguidance_walk", llguidance_walk, METH_VARARGS,
     "llguidance_walk(matcher, next_token, next_sibling, draft, rows, limit, chain) -> (filled, "
     "checked, rejected)."},
    {"llguidance_walks", llguidance_walks, METH_VARARGS,
     "llguidance_walks(rows, next_token, next_sibling, tokens, spans, matchers, limits, chain, "
     "counts, live, accepted) -> (failed, error)."},
    {"llguidance_masks", llguidance_masks, METH_VARARGS,
     "llguidance_masks(grammars, next_token, next_sibling, tokens, vocab_size, out, want_valid, "
     "matcher_type, widths, threshold) -> (mask, valid, failed, error, slow) or None."},
    {"vllm_guidance", vllm_guidance, METH_VARARGS,
     "vllm_guidance(requests, ids, spec_tokens, wrapper_types, end_tokens, rows, stride, names) "
     "-> (rows used, unwritten rows) or None."},
    {"chain_masks", chain_masks, METH_VARARGS,
     "chain_masks(grammars, drafts, rows_per_request, vocab_size, ends, active, out, "
     "want_valid, max_rows, threshold) -> (mask, valid, failed, message, extra) or None."},
    {"span_masks", span_masks, METH_VARARGS,
     "span_masks(grammars, tokens, offsets, width, vocab_size, out, want_valid, threshold) -> "
     "(mask, valid, failed, message, slow) or None."},
    {"tree_masks", tree_masks, METH_VARARGS,
     "tree_masks(grammars, next_token, next_sibling, tokens, vocab_size, out, want_valid, "
     "threshold) -> (mask, valid, failed, message, slow) or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "portable_spec._native",
    "The index work of the mask build and xgrammar's walks, without the GIL "
    "(portable_spec.native is the way in).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef PS_NUMPY
    import_array();
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
