/* The suffix automaton of `tokenspeed/spec/suffix_automaton.py`, in C: the same construction, the same
 * bounded counts, the same queries, step for step (the Python class is the reference; the tests compare
 * the two state by state and proposal by proposal). Loaded through ctypes by `native_automaton.py`. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NO_STATE (-1)
#define NONE_TOK (-(INT64_C(1) << 62))
#define MANY_TOK (NONE_TOK + 1)

typedef struct {
    int64_t max_depth, num_tokens, n, cap;
    int64_t *tok, *to, *link, *len, *count, *head; /* head: first edge of a state with several */
    int64_t ne, ecap;
    int64_t *e_tok, *e_to, *e_next;
    int64_t hcap, hused;
    int64_t *h_state, *h_tok, *h_edge; /* open addressing: (state, token) -> edge; h_state -1: empty */
    int64_t last, anchor, anchor_len, next_sep;
    int failed;
} SA;

static int grow(int64_t **p, int64_t cap) {
    int64_t *q = realloc(*p, (size_t)cap * sizeof(int64_t));
    if (!q) return 0;
    *p = q;
    return 1;
}

static uint64_t slot_of(const SA *a, int64_t s, int64_t t) {
    uint64_t h = (uint64_t)s * UINT64_C(0x9E3779B97F4A7C15) ^ (uint64_t)t * UINT64_C(0xC2B2AE3D27D4EB4F);
    h ^= h >> 29;
    return h & (uint64_t)(a->hcap - 1);
}

static int64_t h_find(const SA *a, int64_t s, int64_t t) {
    uint64_t i = slot_of(a, s, t);
    while (a->h_state[i] != -1) {
        if (a->h_state[i] == s && a->h_tok[i] == t) return a->h_edge[i];
        i = (i + 1) & (uint64_t)(a->hcap - 1);
    }
    return -1;
}

static void h_put(SA *a, int64_t s, int64_t t, int64_t e) {
    uint64_t i = slot_of(a, s, t);
    while (a->h_state[i] != -1) i = (i + 1) & (uint64_t)(a->hcap - 1);
    a->h_state[i] = s; a->h_tok[i] = t; a->h_edge[i] = e;
    a->hused++;
}

static int h_rehash(SA *a) {
    int64_t old = a->hcap, *os = a->h_state, *ot = a->h_tok, *oe = a->h_edge;
    a->hcap = old * 2;
    a->h_state = malloc((size_t)a->hcap * sizeof(int64_t));
    a->h_tok = malloc((size_t)a->hcap * sizeof(int64_t));
    a->h_edge = malloc((size_t)a->hcap * sizeof(int64_t));
    if (!a->h_state || !a->h_tok || !a->h_edge) return 0;
    memset(a->h_state, -1, (size_t)a->hcap * sizeof(int64_t));
    a->hused = 0;
    for (int64_t i = 0; i < old; i++)
        if (os[i] != -1) h_put(a, os[i], ot[i], oe[i]);
    free(os); free(ot); free(oe);
    return 1;
}

static void add_edge(SA *a, int64_t s, int64_t t, int64_t target) { /* a new edge of a state with several */
    if (a->ne == a->ecap) {
        a->ecap *= 2;
        if (!grow(&a->e_tok, a->ecap) || !grow(&a->e_to, a->ecap) || !grow(&a->e_next, a->ecap)) { a->failed = 1; return; }
    }
    if (2 * (a->hused + 1) > a->hcap && !h_rehash(a)) { a->failed = 1; return; }
    int64_t e = a->ne++;
    a->e_tok[e] = t; a->e_to[e] = target; a->e_next[e] = a->head[s]; a->head[s] = e;
    h_put(a, s, t, e);
}

static int64_t step(const SA *a, int64_t s, int64_t t) {
    int64_t first = a->tok[s];
    if (first == t) return a->to[s];
    if (first == MANY_TOK) {
        int64_t e = h_find(a, s, t);
        return e < 0 ? NO_STATE : a->e_to[e];
    }
    return NO_STATE;
}

static void set_edge(SA *a, int64_t s, int64_t t, int64_t target) { /* `_set` */
    int64_t first = a->tok[s];
    if (first == NONE_TOK || first == t) { a->tok[s] = t; a->to[s] = target; return; }
    if (first == MANY_TOK) {
        int64_t e = h_find(a, s, t);
        if (e >= 0) a->e_to[e] = target; else add_edge(a, s, t, target);
        return;
    }
    int64_t old_to = a->to[s];
    a->tok[s] = MANY_TOK;
    a->head[s] = -1;
    add_edge(a, s, first, old_to);
    add_edge(a, s, t, target);
}

static int64_t new_state(SA *a, int64_t length, int64_t link, int64_t count, int64_t copy_of) {
    if (a->n == a->cap) {
        a->cap *= 2;
        if (!grow(&a->tok, a->cap) || !grow(&a->to, a->cap) || !grow(&a->link, a->cap) || !grow(&a->len, a->cap)
            || !grow(&a->count, a->cap) || !grow(&a->head, a->cap)) { a->failed = 1; return -1; }
    }
    int64_t s = a->n++;
    a->len[s] = length; a->link[s] = link; a->count[s] = count; a->head[s] = -1;
    if (copy_of < 0) { a->tok[s] = NONE_TOK; a->to[s] = 0; return s; }
    a->tok[s] = a->tok[copy_of]; a->to[s] = a->to[copy_of];
    if (a->tok[copy_of] == MANY_TOK) {
        /* copy the edges; a list is walked from its head, so copy in reverse to keep the order */
        int64_t n = 0;
        for (int64_t e = a->head[copy_of]; e >= 0; e = a->e_next[e]) n++;
        int64_t *order = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
        if (!order) { a->failed = 1; return s; }
        int64_t i = 0;
        for (int64_t e = a->head[copy_of]; e >= 0; e = a->e_next[e]) order[i++] = e;
        for (i = n - 1; i >= 0; i--) add_edge(a, s, a->e_tok[order[i]], a->e_to[order[i]]);
        free(order);
    }
    return s;
}

SA *sa_new(int64_t max_depth) {
    SA *a = calloc(1, sizeof(SA));
    if (!a) return NULL;
    a->max_depth = max_depth;
    a->cap = 1024; a->ecap = 1024; a->hcap = 2048;
    a->tok = malloc(1024 * sizeof(int64_t)); a->to = malloc(1024 * sizeof(int64_t));
    a->link = malloc(1024 * sizeof(int64_t)); a->len = malloc(1024 * sizeof(int64_t));
    a->count = malloc(1024 * sizeof(int64_t)); a->head = malloc(1024 * sizeof(int64_t));
    a->e_tok = malloc(1024 * sizeof(int64_t)); a->e_to = malloc(1024 * sizeof(int64_t));
    a->e_next = malloc(1024 * sizeof(int64_t));
    a->h_state = malloc(2048 * sizeof(int64_t)); a->h_tok = malloc(2048 * sizeof(int64_t));
    a->h_edge = malloc(2048 * sizeof(int64_t));
    if (!a->tok || !a->to || !a->link || !a->len || !a->count || !a->head || !a->e_tok || !a->e_to || !a->e_next
        || !a->h_state || !a->h_tok || !a->h_edge) a->failed = 1;
    else memset(a->h_state, -1, 2048 * sizeof(int64_t));
    a->n = 1;
    if (!a->failed) { a->tok[0] = NONE_TOK; a->to[0] = 0; a->link[0] = NO_STATE; a->len[0] = 0; a->count[0] = 0; a->head[0] = -1; }
    a->next_sep = -2;
    return a;
}

void sa_free(SA *a) {
    if (!a) return;
    free(a->tok); free(a->to); free(a->link); free(a->len); free(a->count); free(a->head);
    free(a->e_tok); free(a->e_to); free(a->e_next); free(a->h_state); free(a->h_tok); free(a->h_edge);
    free(a);
}

static void extend(SA *a, int64_t token) {
    int64_t cur = new_state(a, a->len[a->last] + 1, 0, 0, -1);
    if (a->failed) return;
    int64_t p = a->last, q = NO_STATE;
    while (p != NO_STATE) {
        int64_t target = step(a, p, token);
        if (target != NO_STATE) { q = target; break; }
        set_edge(a, p, token, cur);
        p = a->link[p];
    }
    if (q != NO_STATE) {
        if (a->len[p] + 1 == a->len[q]) {
            a->link[cur] = q;
        } else {
            int64_t clone = new_state(a, a->len[p] + 1, a->link[q], a->count[q], q);
            if (a->failed) return;
            while (p != NO_STATE && step(a, p, token) == q) {
                set_edge(a, p, token, clone);
                p = a->link[p];
            }
            a->link[q] = clone;
            a->link[cur] = clone;
            if (a->anchor == q && a->anchor_len <= a->len[clone]) a->anchor = clone;
        }
    }
    a->last = cur;
    a->num_tokens++;
    int64_t anchor = step(a, a->anchor, token);
    int64_t anchor_len = a->anchor_len + 1;
    if (anchor_len > a->max_depth + 1) {
        anchor_len = a->max_depth + 1;
        if (a->len[a->link[anchor]] >= anchor_len) anchor = a->link[anchor];
    }
    a->anchor = anchor; a->anchor_len = anchor_len;
    for (int64_t s = anchor; s > 0; s = a->link[s]) a->count[s]++;
}

int sa_extend_all(SA *a, const int64_t *tokens, int64_t n) {
    for (int64_t i = 0; i < n && !a->failed; i++) extend(a, tokens[i]);
    return a->failed ? -1 : 0;
}

int sa_end_document(SA *a) {
    extend(a, a->next_sep);
    a->next_sep--;
    return a->failed ? -1 : 0;
}

int64_t sa_num_tokens(const SA *a) { return a->num_tokens; }
int64_t sa_num_states(const SA *a) { return a->n; }

/* state fields, for the tests' state-by-state comparison: 0 len, 1 link, 2 count */
int64_t sa_field(const SA *a, int64_t which, int64_t s) {
    return which == 0 ? a->len[s] : which == 1 ? a->link[s] : a->count[s];
}

int64_t sa_step(const SA *a, int64_t s, int64_t t) { return step(a, s, t); }

void sa_tail(const SA *a, int64_t *state, int64_t *length) {
    int64_t s = a->anchor, l = a->anchor_len < a->max_depth ? a->anchor_len : a->max_depth;
    if (s != 0 && a->len[a->link[s]] >= l) s = a->link[s];
    *state = s; *length = l;
}

void sa_advance(const SA *a, int64_t *state, int64_t *length, const int64_t *tokens, int64_t n) {
    int64_t s = *state, matched = *length;
    for (int64_t i = 0; i < n; i++) {
        int64_t token = tokens[i];
        int64_t target = step(a, s, token);
        while (target == NO_STATE && s != 0) {
            s = a->link[s];
            matched = a->len[s];
            target = step(a, s, token);
        }
        if (target == NO_STATE) { s = 0; matched = 0; continue; }
        matched++;
        if (matched > a->max_depth) {
            matched = a->max_depth;
            if (a->len[a->link[target]] >= matched) target = a->link[target];
        }
        s = target;
    }
    *state = s; *length = matched;
}

static int has_follower(const SA *a, int64_t s) {
    int64_t first = a->tok[s];
    if (first == MANY_TOK) {
        for (int64_t e = a->head[s]; e >= 0; e = a->e_next[e]) if (a->e_tok[e] >= 0) return 1;
        return 0;
    }
    return first >= 0;
}

int64_t sa_speculate(const SA *a, int64_t state, int64_t matched, int64_t max_tokens, double max_spec_factor,
                     double min_token_prob, int64_t *out, double *score_out) {
    while (state != 0 && !has_follower(a, state)) {
        state = a->link[state];
        matched = a->len[state];
    }
    int64_t limit = (int64_t)((double)matched * max_spec_factor);
    if (max_tokens < limit) limit = max_tokens;
    int64_t n = 0;
    double prob = 1.0, score = 0.0;
    while (n < limit) {
        int64_t first = a->tok[state], token;
        if (first >= 0) {
            token = first; state = a->to[state];
        } else if (first == MANY_TOK) {
            int64_t best = 0, total = 0, target = -1;
            token = -1;
            for (int64_t e = a->head[state]; e >= 0; e = a->e_next[e]) {
                int64_t candidate = a->e_tok[e];
                if (candidate < 0) continue;
                int64_t seen = a->count[a->e_to[e]];
                total += seen;
                if (seen > best || (seen == best && candidate < token)) { token = candidate; best = seen; target = a->e_to[e]; }
            }
            if (token < 0) break;
            prob *= (double)best / (double)total;
            if (prob < min_token_prob) break;
            state = target;
        } else {
            break;
        }
        out[n++] = token;
        score += prob;
        matched++;
        if (matched > a->max_depth) {
            matched = a->max_depth;
            if (a->len[a->link[state]] >= matched) state = a->link[state];
        }
    }
    *score_out = score;
    return n;
}

/* `speculate(tail())` in one call: a request's proposal from its own text. */
int64_t sa_speculate_tail(const SA *a, int64_t max_tokens, double max_spec_factor, double min_token_prob,
                          int64_t *out, double *score_out) {
    int64_t state, length;
    sa_tail(a, &state, &length);
    return sa_speculate(a, state, length, max_tokens, max_spec_factor, min_token_prob, out, score_out);
}

/* `extend_all(tokens)` then `speculate(tail())`: a request's catch-up and own proposal in one call. */
int64_t sa_extend_speculate_tail(SA *a, const int64_t *tokens, int64_t n, int64_t max_tokens, double max_spec_factor,
                                 double min_token_prob, int64_t *out, double *score_out) {
    if (sa_extend_all(a, tokens, n) != 0) return -1;
    return sa_speculate_tail(a, max_tokens, max_spec_factor, min_token_prob, out, score_out);
}

/* `advance(match, tokens)` then `speculate(match)`: a corpus proposal in one call (pair: state, length). */
int64_t sa_advance_speculate(const SA *a, int64_t *pair, const int64_t *tokens, int64_t n, int64_t max_tokens,
                             double max_spec_factor, double min_token_prob, int64_t *out, double *score_out) {
    sa_advance(a, &pair[0], &pair[1], tokens, n);
    return sa_speculate(a, pair[0], pair[1], max_tokens, max_spec_factor, min_token_prob, out, score_out);
}
