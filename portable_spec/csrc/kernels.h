/*
 * The index kernels of the mask build: plain C over plain arrays, no Python.
 *
 * Every kernel bounds each index where it uses it and reads each caller value once, so that
 * values another thread rewrites meanwhile can give wrong rows but never a read or a write
 * outside the arrays. Sizes are ptrdiff_t; tokens and links int64; mask rows int32 words
 * (bit t % 32 of word t / 32 set: token t allowed).
 *
 * The rule of a walked row (xgrammar's traverse_draft_tree writes the rows of the nodes it
 * accepts, zeroes those of the nodes it refuses or that terminate it, leaves the others):
 * node c, child of a kept node p, is accepted when its token t is in [0, limit) with its bit
 * set in p's row, and xgrammar did not refuse it. A token in the last word of the row
 * (t >= 32 * (words - 1)) may lie past the tokenizer's vocabulary (xgrammar sets such bits in
 * some states but refuses the token): there, a row left all-zero for a token that is not a
 * stop token is xgrammar's refusal. An accepted node keeps its row unless its token is a stop
 * token (terminated: no row, no children).
 */
#ifndef PORTABLE_SPEC_KERNELS_H
#define PORTABLE_SPEC_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* 1 when one request's first-child / next-sibling links of n nodes form a verify tree
   (every link in [-1, n), none into the root, no sibling of the root, at most one link into
   any node, no cycle, also among nodes the root does not reach), else 0. Scratch: `indegree`
   and `queue` n int32 each, `seen` n bytes. */
int ps_links_valid(const int64_t *next_token, const int64_t *next_sibling, ptrdiff_t n,
                   int32_t *indegree, int32_t *queue, uint8_t *seen);

/* 1 when one request's verify tree, m nodes given by well-formed links (ps_links_valid) and
   their tokens `draft`, is the subtree `select` picks of a drafted tree of n nodes (`parents`,
   `tokens`), else 0. select[j] is the drafted node at verify node j (-1: padding). Each verify
   node's parent by the links (-1: none; siblings share their first sibling's parent) must be
   the verify node that selects its drafted node's parent (-1 for padding, for a drafted root
   or padding slot, for a parent nobody selects; the last j wins when two select one node),
   and every selected node but the root carries its drafted node's token. A select or parent
   out of range gives 0. Scratch: `above` m int64, `position` n int64. */
int ps_same_tree(const int64_t *next_token, const int64_t *next_sibling, const int64_t *draft,
                 const int64_t *select, ptrdiff_t m, const int64_t *parents,
                 const int64_t *tokens, ptrdiff_t n, int64_t *above, int64_t *position);

/* 1 when one request's selection of m drafted nodes is a verify tree's: select[0] == 0 (the
   root), every entry a node below n or -1 (padding), no node twice, the parent (`parents`,
   the drafted tree's) of every selected node selected too; else 0. Scratch: `count` n bytes. */
int ps_selection_valid(const int64_t *select, ptrdiff_t m, const int64_t *parents, ptrdiff_t n,
                       uint8_t *count);

/* Which nodes of one walked request keep their row (the rule above), breadth first from the
   root. keep[0..n) gets 0/1; valid (NULL: none) gets the accepted nodes (the root included);
   returns how many are kept; *checked counts the children of kept nodes, *rejected those
   refused. root_ok: 1 live, 0 terminated, -1 read off row 0 (any bit set: live). Scratch:
   `queue` n int32. */
ptrdiff_t ps_decide_rows(const int32_t *rows, ptrdiff_t n, ptrdiff_t words,
                         const int64_t *first, const int64_t *next, const int64_t *token,
                         int64_t limit, const int64_t *stop, ptrdiff_t nstops, int root_ok,
                         int32_t *queue, uint8_t *keep, uint8_t *valid, ptrdiff_t *checked,
                         ptrdiff_t *rejected);

/* ps_decide_rows, then every row not kept written all-allowed (-1). Returns rows kept. */
ptrdiff_t ps_repair_tree(int32_t *rows, ptrdiff_t n, ptrdiff_t words, const int64_t *first,
                         const int64_t *next, const int64_t *token, int64_t limit,
                         const int64_t *stop, ptrdiff_t nstops, int root_ok, int32_t *queue,
                         uint8_t *keep, uint8_t *valid, ptrdiff_t *checked,
                         ptrdiff_t *rejected);

/* One walked chain of n nodes (tokens chain[0..n), the root first) repaired: rows kept up to
   the first draft the rule refuses or that is a stop token; every later row all-allowed, or
   with `repeat` and a refused draft a copy of the row before it (vLLM's rule). flags (NULL:
   none) gets the accepted nodes. Counts add to *checked and *rejected. */
void ps_repair_chain(int32_t *rows, const int64_t *chain, ptrdiff_t n, ptrdiff_t words,
                     int live, int64_t limit, const int64_t *stop, ptrdiff_t nstops,
                     int repeat, uint8_t *flags, ptrdiff_t *checked, ptrdiff_t *rejected);

/* flags[v] = 1 for every node of one tree a link reaches from its root, else 0. Scratch:
   `queue` n int32. Links outside [0, n) end a sibling list. */
void ps_reach(const int64_t *next_token, const int64_t *next_sibling, ptrdiff_t n,
              int32_t *queue, uint8_t *flags);

/* rows [from, to) of a [*, words] mask all-allowed, and their flags (NULL: none) = flag. */
void ps_fill_rows(int32_t *rows, ptrdiff_t words, ptrdiff_t from, ptrdiff_t to,
                  uint8_t *flags, uint8_t flag);

/* dest[i] = source[index[i]] over `common` words, the words of dest past it zeroed, for k
   rows; an index outside [0, source_rows) gives a zero row. Streaming stores where it can. */
void ps_take_rows(const int32_t *source, ptrdiff_t source_rows, ptrdiff_t source_words,
                  const int32_t *index, ptrdiff_t k, int32_t *dest, ptrdiff_t dest_words);

/* vLLM's rows of one guidance request after its chain was walked (llguidance wrote rows 0..c,
   the masks after 0..c drafts): rows [0, m] of `rows`, drafts[0..m) its drafts (-1 padding
   from index p on), c of them consumed; `stopped`: the matcher was stopped (grammar complete)
   after them. After a consumed end token every later row is all-allowed; once the grammar is
   complete the rows repeat row c up to an offered end token, all-allowed after it; after a
   refused draft they repeat row c; after the padding they are all-allowed. */
void ps_guidance_tail(int32_t *rows, ptrdiff_t words, const int64_t *drafts, ptrdiff_t m,
                      ptrdiff_t p, ptrdiff_t c, int stopped, int64_t eos);

/* Whether `row` (width words) allows `token`, clamped into [0, 32 * width). */
int ps_row_allows(const int32_t *row, int64_t token, ptrdiff_t width);

/* Nonzero words of `row`, counted up to most + 1. */
ptrdiff_t ps_nonzero_words(const int32_t *row, ptrdiff_t width, ptrdiff_t most);

#endif
