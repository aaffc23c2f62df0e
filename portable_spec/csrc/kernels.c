/* The index kernels (kernels.h): no Python, no allocation. */
#include "kernels.h"

#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static int is_stop(int64_t t, const int64_t *stop, ptrdiff_t nstops) {
    for (ptrdiff_t s = 0; s < nstops; s++)
        if (stop[s] == t) return 1;
    return 0;
}

static int bit_set(const int32_t *row, int64_t t) {
    return (int)(((uint32_t)row[t >> 5] >> (t & 31)) & 1u);
}

static int row_empty(const int32_t *row, ptrdiff_t words) {
    for (ptrdiff_t w = 0; w < words; w++)
        if (row[w] != 0) return 0;
    return 1;
}

/* Whether the walk accepted token t at the node whose row is `own`, its parent's row being
   `parent` (the rule of kernels.h). */
static int accepted(const int32_t *parent, const int32_t *own, int64_t t, ptrdiff_t words,
                    int64_t limit, int stop) {
    int in_range = t >= 0 && t < limit;
    if (!in_range || !bit_set(parent, t)) return 0;
    if (stop) return 1;
    int walk_refused = t >= 32 * (int64_t)(words - 1) && row_empty(own, words);
    return !walk_refused;
}

int ps_links_valid(const int64_t *nt, const int64_t *ns, ptrdiff_t n, int32_t *indegree,
                   int32_t *queue, uint8_t *seen) {
    if (n < 1 || ns[0] != -1) return 0;
    memset(indegree, 0, sizeof(int32_t) * (size_t)n);
    for (ptrdiff_t i = 0; i < n; i++) {
        int64_t a = nt[i], b = ns[i];
        if (a < -1 || a >= n || b < -1 || b >= n || a == 0 || b == 0) return 0;
        if (a >= 0 && ++indegree[a] > 1) return 0;
        if (b >= 0 && ++indegree[b] > 1) return 0;
    }
    /* With at most one link into any node and none into the root, a walk from the root
       cannot revisit a node; links are read again below, so each is bounded again. */
    memset(seen, 0, (size_t)n);
    ptrdiff_t head = 0, tail = 0, reached = 0;
    queue[tail++] = 0;
    seen[0] = 1;
    while (head < tail) {
        int64_t v = queue[head++];
        reached++;
        for (int64_t c = nt[v]; c != -1; c = ns[c]) {
            if (c < 0 || c >= n || seen[c] || tail >= n) return 0;
            seen[c] = 1;
            queue[tail++] = (int32_t)c;
        }
    }
    if (reached == n) return 1;
    /* The unreachable part is acyclic iff a walk from its orphans covers it: each node is
       queued once at most (marked when queued). */
    ptrdiff_t unreachable = n - reached, covered = 0;
    head = tail = 0;
    for (ptrdiff_t v = 0; v < n; v++) {
        if (!seen[v] && indegree[v] == 0) {
            seen[v] = 2;
            queue[tail++] = (int32_t)v;
        }
    }
    while (head < tail) {
        int32_t v = queue[head++];
        covered++;
        int64_t links[2] = {nt[v], ns[v]};
        for (int k = 0; k < 2; k++) {
            int64_t c = links[k];
            if (c < -1 || c >= n) return 0;
            if (c >= 0 && !seen[c] && tail < n) {
                seen[c] = 2;
                queue[tail++] = (int32_t)c;
            }
        }
    }
    return covered == unreachable;
}

int ps_same_tree(const int64_t *nt, const int64_t *ns, const int64_t *draft,
                 const int64_t *select, ptrdiff_t m, const int64_t *parents,
                 const int64_t *tokens, ptrdiff_t n, int64_t *above, int64_t *position) {
    for (ptrdiff_t j = 0; j < m; j++) above[j] = -1;
    for (ptrdiff_t p = 0; p < m; p++) { /* each sibling list once: at most one link into a node */
        ptrdiff_t steps = 0;
        for (int64_t c = nt[p]; c >= 0 && c < m && steps < m; c = ns[c], steps++) above[c] = p;
    }
    for (ptrdiff_t v = 0; v < n; v++) position[v] = -1;
    for (ptrdiff_t j = 0; j < m; j++) {
        int64_t s = select[j];
        if (s < -1 || s >= n) return 0;
        if (s >= 0) position[s] = j;
    }
    for (ptrdiff_t j = 0; j < m; j++) {
        int64_t s = select[j], mine = -1;
        if (s >= 0) {
            int64_t p = parents[s];
            if (p < -1 || p >= n) return 0;
            if (p >= 0) mine = position[p];
            if (j > 0 && tokens[s] != draft[j]) return 0;
        }
        if (mine != above[j]) return 0;
    }
    return 1;
}

int ps_selection_valid(const int64_t *select, ptrdiff_t m, const int64_t *parents, ptrdiff_t n,
                       uint8_t *count) {
    if (m < 1 || select[0] != 0) return 0;
    memset(count, 0, (size_t)n);
    for (ptrdiff_t j = 0; j < m; j++) {
        int64_t s = select[j];
        if (s < -1 || s >= n) return 0;
        if (s >= 0 && count[s]++) return 0;
    }
    for (ptrdiff_t j = 1; j < m; j++) {
        int64_t s = select[j];
        if (s < 0) continue;
        int64_t p = parents[s];
        if (p >= n) return 0;
        if (p >= 0 && !count[p]) return 0;
    }
    return 1;
}

ptrdiff_t ps_decide_rows(const int32_t *rows, ptrdiff_t n, ptrdiff_t words, const int64_t *first,
                         const int64_t *next, const int64_t *token, int64_t limit,
                         const int64_t *stop, ptrdiff_t nstops, int root_ok, int32_t *queue,
                         uint8_t *keep, uint8_t *valid, ptrdiff_t *checked,
                         ptrdiff_t *rejected) {
    ptrdiff_t seen = 0, refused = 0, tail = 0;
    memset(keep, 0, (size_t)n);
    if (valid != NULL) {
        memset(valid, 0, (size_t)n);
        valid[0] = 1;
    }
    if (root_ok < 0) root_ok = !row_empty(rows, words);
    if (root_ok) {
        ptrdiff_t head = 0;
        keep[0] = 1;
        queue[tail++] = 0;
        while (head < tail) {
            int32_t p = queue[head++];
            const int32_t *parent = rows + (ptrdiff_t)p * words;
            ptrdiff_t steps = 0;
            for (int64_t c = first[p]; c >= 0 && c < n && steps < n; c = next[c], steps++) {
                int64_t t = token[c];
                int stops_here = is_stop(t, stop, nstops);
                int ok = accepted(parent, rows + c * words, t, words, limit, stops_here);
                seen++;
                refused += !ok;
                if (valid != NULL) valid[c] = (uint8_t)ok;
                if (ok && !stops_here && !keep[c] && tail < n) {
                    keep[c] = 1;
                    queue[tail++] = (int32_t)c;
                }
            }
        }
    }
    *checked = seen;
    *rejected = refused;
    return tail;
}

ptrdiff_t ps_repair_tree(int32_t *rows, ptrdiff_t n, ptrdiff_t words, const int64_t *first,
                         const int64_t *next, const int64_t *token, int64_t limit,
                         const int64_t *stop, ptrdiff_t nstops, int root_ok, int32_t *queue,
                         uint8_t *keep, uint8_t *valid, ptrdiff_t *checked,
                         ptrdiff_t *rejected) {
    ptrdiff_t kept = ps_decide_rows(rows, n, words, first, next, token, limit, stop, nstops,
                                    root_ok, queue, keep, valid, checked, rejected);
    for (ptrdiff_t v = 0; v < n; v++)
        if (!keep[v]) memset(rows + v * words, 0xff, sizeof(int32_t) * (size_t)words);
    return kept;
}

void ps_repair_chain(int32_t *rows, const int64_t *chain, ptrdiff_t n, ptrdiff_t words,
                     int live, int64_t limit, const int64_t *stop, ptrdiff_t nstops,
                     int repeat, uint8_t *flags, ptrdiff_t *checked, ptrdiff_t *rejected) {
    ptrdiff_t end = 0; /* rows [0, end) keep the grammar's */
    int refused = 0;
    if (flags != NULL) {
        memset(flags, 0, (size_t)n);
        flags[0] = 1;
    }
    if (live) {
        for (end = 1; end < n; end++) {
            int64_t t = chain[end];
            int stops_here = is_stop(t, stop, nstops);
            (*checked)++;
            if (!accepted(rows + (end - 1) * words, rows + end * words, t, words, limit,
                          stops_here)) {
                (*rejected)++;
                refused = 1;
                break;
            }
            if (flags != NULL) flags[end] = 1;
            if (stops_here) break;
        }
    }
    size_t width = sizeof(int32_t) * (size_t)words;
    for (ptrdiff_t v = end; v < n; v++) {
        if (repeat && refused)
            memcpy(rows + v * words, rows + (end - 1) * words, width);
        else
            memset(rows + v * words, 0xff, width);
    }
}

void ps_reach(const int64_t *nt, const int64_t *ns, ptrdiff_t n, int32_t *queue,
              uint8_t *flags) {
    memset(flags, 0, (size_t)n);
    ptrdiff_t head = 0, tail = 0;
    flags[0] = 1;
    queue[tail++] = 0;
    while (head < tail) {
        int32_t v = queue[head++];
        for (int64_t c = nt[v]; c >= 0 && c < n && !flags[c] && tail < n; c = ns[c]) {
            flags[c] = 1;
            queue[tail++] = (int32_t)c;
        }
    }
}

void ps_fill_rows(int32_t *rows, ptrdiff_t words, ptrdiff_t from, ptrdiff_t to, uint8_t *flags,
                  uint8_t flag) {
    if (to <= from) return;
    memset(rows + from * words, 0xff, sizeof(int32_t) * (size_t)(words * (to - from)));
    if (flags != NULL) memset(flags + from, flag, (size_t)(to - from));
}

/* Copy `words` int32 from `from` to `to`. Rows of the output are written once and read by
   the upload (or the caller) later, not by this thread: streaming stores skip reading the
   destination lines into the cache first, which halves the memory traffic of the copy. */
static void copy_row(int32_t *to, const int32_t *from, ptrdiff_t words) {
#if defined(__SSE2__)
    if (((uintptr_t)to & 15) == 0) {
        ptrdiff_t vectors = words / 4;
        __m128i *dst = (__m128i *)to;
        const __m128i *src = (const __m128i *)from;
        for (ptrdiff_t v = 0; v < vectors; v++) _mm_stream_si128(dst + v, _mm_loadu_si128(src + v));
        for (ptrdiff_t w = vectors * 4; w < words; w++) to[w] = from[w];
        return;
    }
#endif
    memcpy(to, from, sizeof(int32_t) * (size_t)words);
}

void ps_take_rows(const int32_t *source, ptrdiff_t source_rows, ptrdiff_t source_words,
                  const int32_t *index, ptrdiff_t k, int32_t *dest, ptrdiff_t dest_words) {
    ptrdiff_t common = source_words < dest_words ? source_words : dest_words;
    for (ptrdiff_t i = 0; i < k; i++) {
        int32_t *row = dest + i * dest_words;
        int32_t which = index[i];
        if (which < 0 || which >= source_rows) {
            memset(row, 0, sizeof(int32_t) * (size_t)dest_words);
            continue;
        }
        copy_row(row, source + (ptrdiff_t)which * source_words, common);
        if (dest_words > common)
            memset(row + common, 0, sizeof(int32_t) * (size_t)(dest_words - common));
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streaming stores are visible before anyone reads the rows */
#endif
}

int ps_row_allows(const int32_t *row, int64_t token, ptrdiff_t width) {
    int64_t limit = 32 * (int64_t)width;
    int64_t safe = token < 0 ? 0 : token >= limit ? limit - 1 : token;
    return bit_set(row, safe);
}

ptrdiff_t ps_nonzero_words(const int32_t *row, ptrdiff_t width, ptrdiff_t most) {
    ptrdiff_t count = 0;
    for (ptrdiff_t w = 0; w < width && count <= most; w++) count += row[w] != 0;
    return count;
}

void ps_guidance_tail(int32_t *rows, ptrdiff_t words, const int64_t *drafts, ptrdiff_t m,
                      ptrdiff_t p, ptrdiff_t c, int stopped, int64_t eos) {
    if (m < 0 || p < 0 || p > m || c < 0 || c > p) return;
    for (ptrdiff_t j = 0; j < c; j++) {
        if (drafts[j] == eos) { /* consumed: terminated from the next row on */
            ps_fill_rows(rows, words, j + 1, m + 1, NULL, 0);
            return;
        }
    }
    ptrdiff_t repeat_to = c; /* rows (c, repeat_to] repeat row c */
    ptrdiff_t free_from = p + 1;
    if (stopped && c < p) {
        ptrdiff_t e = c;
        while (e < p && drafts[e] != eos) e++;
        repeat_to = e;
        free_from = e + 1;
    } else if (c < p) {
        repeat_to = m;
        free_from = m + 1;
    }
    for (ptrdiff_t r = c + 1; r <= repeat_to; r++)
        copy_row(rows + r * words, rows + c * words, words);
    ps_fill_rows(rows, words, free_from, m + 1, NULL, 0);
}
