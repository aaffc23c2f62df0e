/* The index kernels alone (portable_spec/csrc/kernels.c), no Python: hand-made trees, chains
   and rows with their expected answers worked out by hand. Built and run by
   scripts/native-check.sh under AddressSanitizer and UndefinedBehaviorSanitizer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static int failures = 0;

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, #cond);         \
            failures++;                                                        \
        }                                                                      \
    } while (0)

static int valid(const int64_t *nt, const int64_t *ns, ptrdiff_t n) {
    int32_t indegree[16], queue[16];
    uint8_t seen[16];
    return ps_links_valid(nt, ns, n, indegree, queue, seen);
}

static void test_links(void) {
    /* root -> 1 -> 3, root -> 2 (sibling of 1) */
    int64_t nt[4] = {1, 3, -1, -1}, ns[4] = {-1, 2, -1, -1};
    CHECK(valid(nt, ns, 4));
    int64_t cycle_nt[3] = {1, 2, 1}, none3[3] = {-1, -1, -1};
    CHECK(!valid(cycle_nt, none3, 3)); /* 2 -> 1: two links into node 1 */
    int64_t far[3] = {1, 7, -1};
    CHECK(!valid(far, none3, 3)); /* a link past the nodes */
    int64_t low[3] = {1, -2, -1};
    CHECK(!valid(low, none3, 3));
    int64_t into_root[3] = {1, 0, -1};
    CHECK(!valid(into_root, none3, 3));
    int64_t root_sibling[3] = {1, -1, -1}, sib[3] = {2, -1, -1};
    CHECK(!valid(root_sibling, sib, 3));
    /* nodes 2 and 3 unreachable, linked in a cycle 2 -> 3 -> 2 */
    int64_t lone_nt[4] = {1, -1, 3, 2}, lone_ns[4] = {-1, -1, -1, -1};
    CHECK(!valid(lone_nt, lone_ns, 4));
    /* nodes 2 and 3 unreachable but acyclic (padding) */
    int64_t pad_nt[4] = {1, -1, 3, -1};
    CHECK(valid(pad_nt, lone_ns, 4));
}

/* rows of `words` words: row r allows exactly the tokens listed for it */
static void allow(int32_t *rows, ptrdiff_t words, ptrdiff_t r, int64_t token) {
    rows[r * words + (token >> 5)] |= (int32_t)(1u << (token & 31));
}

static void test_chain(void) {
    enum { W = 2 };            /* 64 token bits; the last word holds tokens 32..63 */
    int32_t rows[5 * W];
    int64_t stop[1] = {9};
    uint8_t flags[5];
    ptrdiff_t checked = 0, rejected = 0;
    /* drafts 5 (allowed), 40 (allowed by bit, its row left zero: refused by the walk) */
    int64_t chain[5] = {0, 5, 40, 6, 7};
    memset(rows, 0, sizeof(rows));
    allow(rows, W, 0, 5);
    allow(rows, W, 1, 40);
    ps_repair_chain(rows, chain, 5, W, 1, 64, stop, 1, 1, flags, &checked, &rejected);
    CHECK(checked == 2 && rejected == 1);
    CHECK(flags[0] && flags[1] && !flags[2] && !flags[3] && !flags[4]);
    for (int r = 2; r < 5; r++) /* repeat: the row before the refused draft */
        CHECK(rows[r * W] == rows[1 * W] && rows[r * W + 1] == rows[1 * W + 1]);
    /* the same chain where 40's row holds something: accepted */
    memset(rows, 0, sizeof(rows));
    allow(rows, W, 0, 5);
    allow(rows, W, 1, 40);
    allow(rows, W, 2, 9);
    checked = rejected = 0;
    int64_t ends[4] = {0, 5, 40, 9};
    ps_repair_chain(rows, ends, 4, W, 1, 64, stop, 1, 0, flags, &checked, &rejected);
    CHECK(checked == 3 && rejected == 0);
    CHECK(flags[0] && flags[1] && flags[2] && flags[3]); /* the stop token is accepted */
    CHECK(rows[3 * W] == -1 && rows[3 * W + 1] == -1);   /* and terminated: all-allowed */
    /* a token in the first word whose row is zero is not second-guessed */
    memset(rows, 0, sizeof(rows));
    allow(rows, W, 0, 5);
    checked = rejected = 0;
    int64_t early[2] = {0, 5};
    ps_repair_chain(rows, early, 2, W, 1, 64, stop, 0, 0, flags, &checked, &rejected);
    CHECK(flags[1] && rejected == 0 && rows[1 * W] == 0);
    /* past the limit, negative: refused */
    int64_t out[3] = {0, -1, 70};
    checked = rejected = 0;
    ps_repair_chain(rows, out, 2, W, 1, 64, stop, 0, 0, flags, &checked, &rejected);
    CHECK(rejected == 1 && !flags[1]);
}

static void test_tree(void) {
    enum { W = 1, N = 5 };
    /* root -> 1, 2; 1 -> 3; 2 -> 4 */
    int64_t nt[N] = {1, 3, 4, -1, -1}, ns[N] = {-1, 2, -1, -1, -1};
    int64_t token[N] = {0, 3, 4, 30, 31};
    int32_t rows[N * W] = {0};
    int32_t queue[N];
    uint8_t keep[N], flags[N];
    ptrdiff_t checked, rejected;
    allow(rows, W, 0, 3); /* 4 not allowed at the root */
    allow(rows, W, 1, 30);
    /* node 3's row stays zero and 30 is in the last (only) word: refused by the walk */
    ptrdiff_t kept = ps_repair_tree(rows, N, W, nt, ns, token, 32, NULL, 0, 1, queue, keep,
                                    flags, &checked, &rejected);
    CHECK(kept == 2 && checked == 3 && rejected == 2);
    CHECK(flags[0] && flags[1] && !flags[2] && !flags[3] && !flags[4]);
    CHECK(rows[2] == -1 && rows[3] == -1 && rows[4] == -1);
    /* a link pointing anywhere is bounded where it is followed */
    int64_t wild[N] = {1, 1000000, -7, 3, 2};
    memset(rows, 0xff, sizeof(rows));
    ps_decide_rows(rows, N, W, wild, ns, token, 32, NULL, 0, 1, queue, keep, flags, &checked,
                   &rejected);
    ps_reach(wild, ns, N, queue, flags);
    CHECK(flags[0] && flags[1] && flags[2] && !flags[3] && !flags[4]);
}

static void test_take(void) {
    int32_t source[3 * 2] = {1, 2, 3, 4, 5, 6};
    int32_t index[3] = {2, 99, 0}, dest[3 * 3];
    memset(dest, 0x55, sizeof(dest));
    ps_take_rows(source, 3, 2, index, 3, dest, 3);
    int32_t want[9] = {5, 6, 0, 0, 0, 0, 1, 2, 0}; /* an index outside: a zero row */
    CHECK(memcmp(dest, want, sizeof(want)) == 0);
}

/* ps_guidance_tail on rows of one word: row r of the chain's walked prefix holds 10 + r, the
   rows past it 99 (unwritten); -1 is all-allowed. */
static void guidance_case(const int64_t *drafts, ptrdiff_t m, ptrdiff_t p, ptrdiff_t c,
                          int stopped, const int32_t *want) {
    int32_t rows[8];
    for (ptrdiff_t r = 0; r <= m; r++) rows[r] = r <= c ? (int32_t)(10 + r) : 99;
    ps_guidance_tail(rows, 1, drafts, m, p, c, stopped, 2);
    CHECK(memcmp(rows, want, sizeof(int32_t) * (size_t)(m + 1)) == 0);
}

static void test_guidance_tail(void) {
    int64_t all[3] = {5, 6, 7};
    int32_t every[4] = {10, 11, 12, 13}; /* every draft consumed */
    guidance_case(all, 3, 3, 3, 0, every);
    int32_t refused[4] = {10, 11, 11, 11}; /* the second refused: row 1 repeated */
    guidance_case(all, 3, 3, 1, 0, refused);
    int64_t ended[3] = {5, 2, 7}; /* the end token consumed: all-allowed after it */
    int32_t after_end[4] = {10, 11, -1, -1};
    guidance_case(ended, 3, 3, 2, 0, after_end);
    int64_t done[3] = {5, 6, 2}; /* complete at row 0: repeats up to the end token */
    int32_t complete[4] = {10, 10, 10, -1};
    guidance_case(done, 3, 3, 0, 1, complete);
    int64_t padded[3] = {5, -1, -1}; /* padding: all-allowed after the chain */
    int32_t pad_rows[4] = {10, 11, -1, -1};
    guidance_case(padded, 3, 1, 1, 0, pad_rows);
    int32_t pad_refused[4] = {10, 10, 10, 10}; /* refused before the padding: repeated */
    guidance_case(padded, 3, 1, 0, 0, pad_refused);
    int32_t pad_complete[4] = {10, 10, -1, -1}; /* complete, then padding */
    guidance_case(padded, 3, 1, 0, 1, pad_complete);
}

int main(void) {
    test_links();
    test_chain();
    test_tree();
    test_take();
    test_guidance_tail();
    if (failures) {
        fprintf(stderr, "%d kernel check(s) failed\n", failures);
        return 1;
    }
    printf("kernels: every check passed\n");
    return 0;
}
