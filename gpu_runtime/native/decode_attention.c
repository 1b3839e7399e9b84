/* Decode attention over the paged KV cache, read in place (CPU; AVX-512F or AVX2, simd16.h).

   One query token per sequence; the keys and values of sequence b are the first
   lens[b] slots of its blocks (block_tables[b]), of which a sliding window keeps
   the last `window` (0: all). Each (sequence, KV head) is one task: its `group`
   query heads share every key and value read. Two passes over the keys: scores
   (q . k * scale) into a per-thread buffer, by blocks of 16 keys whose 16 dot
   products per query head are summed across lanes together (sum16), then softmax
   and the weighted sum of the values, accumulated in float32. K and V are each
   read once; nothing is gathered into a copy. The usual shapes (head_dim 64 or 128,
   up to 8 query heads per KV head) are compiled with both as constants, so the
   queries and the sums stay in registers: 1.5-1.9x the one general loop on
   SmolLM2's shape at 8 and 32 sequences (paired runs). Built and loaded by
   gpu_runtime/cpu_attention.py. */

#include "simd16.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256

/* 16 values of a row of the model's dtype, as float32 */
static inline vf load16(const void *p, int bf16) {
    return bf16 ? vf_from_bf16(p) : vf_loadu((const float *)p);
}

/* element i of a row of the model's dtype */
static inline char *elem(const void *p, int64_t i, int bf16) { return (char *)p + i * (bf16 ? 2 : 4); }

/* load16 of the lanes in k (the others 0) */
static inline vf load16m(const void *p, vmask k, int bf16) {
    return bf16 ? vf_maskz_from_bf16(k, p) : vf_maskz_loadu(k, (const float *)p);
}

static inline float from_bits_u16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

static inline uint16_t to_bf16(float v) {
    uint32_t u; memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline void store16(void *p, vf v, int bf16) {
    if (!bf16) vf_storeu((float *)p, v);
    else vf_store_bf16(p, v);
}

/* store16 of the lanes in k */
static inline void store16m(void *p, vmask k, vf v, int bf16) {
    if (!bf16) vf_mask_storeu((float *)p, k, v);
    else vf_mask_store_bf16(p, k, v);
}

/* e^x: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, |r| <= 0.35), e^r by its
   Taylor series to degree 7 (relative error < 1e-8 on that range), scaled by 2^n. x is
   clamped to [-104, 89] first: e^x is 0 below and infinite above in float32. */
static inline vf exp16(vf x) {
    x = vf_min(vf_max(x, vf_set1(-104.0f)), vf_set1(89.0f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693145751953125f), x);
    r = vf_fnmadd(n, vf_set1(1.428606765330187045e-06f), r);
    vf p = vf_set1(1.0f / 5040);
    p = vf_fmadd(p, r, vf_set1(1.0f / 720));
    p = vf_fmadd(p, r, vf_set1(1.0f / 120));
    p = vf_fmadd(p, r, vf_set1(1.0f / 24));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_scalef(p, n);
}

static __thread float *scores_buf;
static __thread int64_t scores_cap;

static float *scores_for(int64_t n) {
    if (n > scores_cap) {
        free(scores_buf);
        scores_cap = n + 4096;
        scores_buf = aligned_alloc(64, (size_t)(((scores_cap * 4) + 63) / 64 * 64));
        if (!scores_buf) scores_cap = 0;
    }
    return scores_buf;
}

#define KEYS 16  /* keys a score pass takes at once (converted to float32 first) */

/* One (sequence b, KV head h) task: its `group` query heads over the sequence's keys.
   q: [batch, num_heads, head_dim] with rows `q_row_stride` elements apart (a view of
   the fused q/k product); out: [batch, num_heads, head_dim] contiguous; kv: [2,
   num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [batch, max_blocks];
   lens: [batch]. Returns 0, or -1 (nothing read or written) when the row has no keys,
   reaches past its table or the cache, or no buffer could be had.

   Inlined with `group` and `chunks` (head_dim / 16) as constants for the usual shapes
   (attend_task), so the queries and the output sums stay in registers: scores by
   blocks of 16 keys (each query head's 16 dot products summed across lanes at once,
   sum16), then softmax, then the values weighted into group x chunks accumulators. */
static inline __attribute__((always_inline)) int attend(
    const void *q, int64_t q_row_stride, const void *kv, void *out,
    const int64_t *block_tables, const int64_t *lens, int b, int h, int num_heads,
    int num_kv_heads, const int group, const int chunks, int block_size, int64_t num_blocks,
    int max_blocks, int window, float scale, int bf16)
{
    const int head_dim = chunks * 16, esize = bf16 ? 2 : 4;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;  /* elements */
    const int64_t v_offset = num_blocks * block_size * token_stride;
    const int64_t len = lens[b];
    const int64_t first = (window > 0 && len > window) ? len - window : 0;
    const int64_t n = len - first;
    if (n <= 0) return -1;  /* a decode row sees at least its own key */
    float *scores = scores_for(n * group);  /* [group][n] */
    if (!scores) return -1;
    const int64_t *table = block_tables + (int64_t)b * max_blocks;
    /* the blocks this row reads lie inside its table and the cache (else: no reads) */
    if ((len - 1) / block_size >= max_blocks) return -1;
    for (int64_t i = first / block_size; i <= (len - 1) / block_size; i++)
        if (table[i] < 0 || table[i] >= num_blocks) return -1;

    vf qv[MAX_GROUP][MAX_DIM / 16];
    for (int g = 0; g < group; g++) {
        const char *qrow = (const char *)q
            + ((int64_t)b * q_row_stride + (int64_t)(h * group + g) * head_dim) * esize;
        for (int c = 0; c < chunks; c++)
            qv[g][c] = vf_mul(load16(qrow + c * 16 * esize, bf16), vf_set1(scale));
    }
    /* pass 1: scores by blocks of KEYS keys, and each query head's maximum */
    vf maxs[MAX_GROUP];
    for (int g = 0; g < group; g++) maxs[g] = vf_set1(-INFINITY);
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
        const int count = n - j0 < KEYS ? (int)(n - j0) : KEYS;
        float kb[KEYS][MAX_DIM] __attribute__((aligned(64)));
        for (int j = 0; j < KEYS; j++) {
            const int64_t pos = first + j0 + (j < count ? j : 0);  /* past the end: a copy */
            const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
            const char *krow = (const char *)kv + (slot * token_stride + (int64_t)h * head_dim) * esize;
            for (int c = 0; c < chunks; c++) vf_store(kb[j] + 16 * c, load16(krow + c * 16 * esize, bf16));
        }
        const vmask valid = first_n(count);
        for (int g = 0; g < group; g++) {
            vf dots[KEYS];
            for (int j = 0; j < KEYS; j++) {
                vf acc = vf_mul(qv[g][0], vf_load(kb[j]));
                for (int c = 1; c < chunks; c++) acc = vf_fmadd(qv[g][c], vf_load(kb[j] + 16 * c), acc);
                dots[j] = acc;
            }
            const vf s = vf_sum16(dots);
            vf_mask_storeu(scores + g * n + j0, valid, s);
            maxs[g] = vf_mask_max(maxs[g], valid, maxs[g], s);
        }
    }
    /* softmax numerators in place, and their sums */
    float sums[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *row = scores + g * n;
        const vf m = vf_set1(vf_reduce_max(maxs[g]));
        vf total = vf_zero();
        for (int64_t j = 0; j < n; j += 16) {
            const vmask k = first_n(n - j);
            const vf e = exp16(vf_sub(vf_maskz_loadu(k, row + j), m));
            vf_mask_storeu(row + j, k, e);
            total = vf_add(total, vf_maskz(k, e));
        }
        sums[g] = vf_reduce_add(total);
    }
    /* pass 2: the weighted sum of the values */
    vf acc[MAX_GROUP][MAX_DIM / 16];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) acc[g][c] = vf_zero();
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const char *vrow = (const char *)kv + (v_offset + slot * token_stride + (int64_t)h * head_dim) * esize;
        for (int c = 0; c < chunks; c++) {
            const vf v = load16(vrow + c * 16 * esize, bf16);
            for (int g = 0; g < group; g++)
                acc[g][c] = vf_fmadd(vf_set1(scores[g * n + j]), v, acc[g][c]);
        }
    }
    for (int g = 0; g < group; g++) {
        const vf inv = vf_set1(1.0f / sums[g]);
        char *orow = (char *)out + (((int64_t)b * num_heads) + h * group + g) * head_dim * esize;
        for (int c = 0; c < chunks; c++)
            store16(orow + c * 16 * esize, vf_mul(acc[g][c], inv), bf16);
    }
    return 0;
}

#define ATTEND(G, C) attend(q, q_row_stride, kv, out, block_tables, lens, b, h, num_heads, \
    num_kv_heads, G, C, block_size, num_blocks, max_blocks, window, scale, bf16)

/* attend() for one task: the usual (group, head_dim) pairs with both as constants. */
static int attend_task(
    const void *q, int64_t q_row_stride, const void *kv, void *out,
    const int64_t *block_tables, const int64_t *lens, int b, int h, int num_heads, int num_kv_heads,
    int head_dim, int block_size, int64_t num_blocks, int max_blocks, int window, float scale, int bf16)
{
    const int group = num_heads / num_kv_heads, chunks = head_dim / 16;
    if (chunks == 4) switch (group) {
        case 1: return ATTEND(1, 4); case 2: return ATTEND(2, 4); case 3: return ATTEND(3, 4);
        case 4: return ATTEND(4, 4); case 5: return ATTEND(5, 4); case 6: return ATTEND(6, 4);
        case 7: return ATTEND(7, 4); case 8: return ATTEND(8, 4); default: break;
    }
    if (chunks == 8) switch (group) {
        case 1: return ATTEND(1, 8); case 2: return ATTEND(2, 8); case 3: return ATTEND(3, 8);
        case 4: return ATTEND(4, 8); case 6: return ATTEND(6, 8); case 8: return ATTEND(8, 8);
        default: break;
    }
    return ATTEND(group, chunks);
}

/* Every (sequence, KV head) of a decode batch (arguments as `attend_task`'s). Returns
   0, or -1 when some row could not be read (see `attend_task`). */
int sluice_decode_attention(
    const void *q, int64_t q_row_stride, const void *kv, void *out,
    const int64_t *block_tables, const int64_t *lens, int batch, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int64_t num_blocks, int max_blocks, int window, float scale,
    int bf16, int num_threads)
{
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(|: failed)
    for (int task = 0; task < batch * num_kv_heads; task++)
        failed |= attend_task(q, q_row_stride, kv, out, block_tables, lens, task / num_kv_heads,
                              task % num_kv_heads, num_heads, num_kv_heads, head_dim, block_size,
                              num_blocks, max_blocks, window, scale, bf16) != 0;
    return failed ? -1 : 0;
}

/* ---- prefill attention: one sequence's chunk of query rows --------------------------

   Rows i = 0..n-1 of a chunk sit at positions num_computed + i and see the keys at
   positions up to their own (and, with a window, the last `window` of them), read
   in place from the paged cache (the chunk's keys are written before). A task is one
   KV head and a tile of consecutive query positions whose `group` query heads make at
   most 32 rows: the tile's queries are held transposed ([dim][32 rows], two vectors
   per dim), so a key's scores for all rows are two vectors of multiply-adds with the
   key's values broadcast: no horizontal sums. Keys go by blocks of 8 (copied to
   float32), with the softmax online per row (running maximum and sum, as flash
   attention) and the output accumulated transposed the same way. Measured against
   torch's CPU flash attention (SDPA, is_causal) on SmolLM2's prefill of 512: see
   cpu_attention.py. */

#define TILE_ROWS 32
#define KEY_BLOCK 8

static inline void load_key_rows(const void *kv, int64_t base, const int64_t *table, int block_size,
                                 int64_t p0, int count, int64_t token_stride, int h, int head_dim,
                                 int bf16, float (*dst)[MAX_DIM])
{
    const int esize = bf16 ? 2 : 4;
    for (int j = 0; j < count; j++) {
        const int64_t pos = p0 + j;
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const char *row = (const char *)kv + (base + slot * token_stride + (int64_t)h * head_dim) * esize;
        for (int c = 0; c < head_dim / 16; c++)
            vf_storeu(dst[j] + 16 * c, load16(row + c * 16 * esize, bf16));
    }
}

/* One (KV head h, tile of `positions` query positions from row i0) task. */
static void prefill_tile(
    const void *q, int64_t q_row_stride, const void *kv, void *out, const int64_t *table,
    int64_t num_computed, int64_t i0, int positions, int h, int num_heads, int num_kv_heads,
    int head_dim, int block_size, int64_t num_blocks, int window, float scale, int bf16)
{
    const int group = num_heads / num_kv_heads, rows = positions * group;
    const int esize = bf16 ? 2 : 4;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t v_base = num_blocks * block_size * token_stride;
    float qt[MAX_DIM][TILE_ROWS] __attribute__((aligned(64)));
    float ot[MAX_DIM][TILE_ROWS] __attribute__((aligned(64)));
    float kb[KEY_BLOCK][MAX_DIM] __attribute__((aligned(64)));
    float vb[KEY_BLOCK][MAX_DIM] __attribute__((aligned(64)));
    int32_t row_pos[TILE_ROWS], row_first[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        const int64_t pos = num_computed + i0 + (r < rows ? r / group : positions - 1);
        row_pos[r] = (int32_t)pos;
        row_first[r] = (int32_t)(window > 0 && pos + 1 > window ? pos + 1 - window : 0);
        if (r >= rows) row_first[r] = row_pos[r] + 1;  /* padding rows see nothing */
    }
    for (int d = 0; d < head_dim; d++)
        for (int r = 0; r < TILE_ROWS; r++) {
            float v = 0.0f;
            if (r < rows) {
                const char *qrow = (const char *)q + ((i0 + r / group) * q_row_stride
                    + (int64_t)(h * group + r % group) * head_dim) * esize;
                v = (bf16 ? from_bits_u16(((const uint16_t *)qrow)[d])
                          : ((const float *)qrow)[d]) * scale;
            }
            qt[d][r] = v;
            ot[d][r] = 0.0f;
        }
    const vi pos_lo = vi_loadu(row_pos), pos_hi = vi_loadu(row_pos + 16);
    const vi first_lo = vi_loadu(row_first), first_hi = vi_loadu(row_first + 16);
    vf m_lo = vf_set1(-INFINITY), m_hi = m_lo;
    vf l_lo = vf_zero(), l_hi = l_lo;
    int64_t lo = row_first[0];
    for (int r = 1; r < rows; r++) if (row_first[r] < lo) lo = row_first[r];
    const int64_t hi = num_computed + i0 + positions;  /* one past the last key */
    for (int64_t p0 = lo; p0 < hi; p0 += KEY_BLOCK) {
        const int count = hi - p0 < KEY_BLOCK ? (int)(hi - p0) : KEY_BLOCK;
        load_key_rows(kv, 0, table, block_size, p0, count, token_stride, h, head_dim, bf16, kb);
        load_key_rows(kv, v_base, table, block_size, p0, count, token_stride, h, head_dim, bf16, vb);
        vf s_lo[KEY_BLOCK], s_hi[KEY_BLOCK];
        for (int j = 0; j < KEY_BLOCK; j++) { s_lo[j] = vf_zero(); s_hi[j] = vf_zero(); }
        for (int d = 0; d < head_dim; d++) {
            const vf a = vf_load(qt[d]), b = vf_load(qt[d] + 16);
            for (int j = 0; j < KEY_BLOCK; j++) {
                const vf k = vf_set1(kb[j][d]);
                s_lo[j] = vf_fmadd(a, k, s_lo[j]);
                s_hi[j] = vf_fmadd(b, k, s_hi[j]);
            }
        }
        /* mask keys past a row's position or before its window (and past the block) */
        vf bmax_lo = vf_set1(-INFINITY), bmax_hi = bmax_lo;
        for (int j = 0; j < KEY_BLOCK; j++) {
            const vi kp = vi_set1((int32_t)(p0 + j));
            vmask ok_lo = vi_cmple(kp, pos_lo) & vi_cmpge(kp, first_lo);
            vmask ok_hi = vi_cmple(kp, pos_hi) & vi_cmpge(kp, first_hi);
            if (j >= count) ok_lo = ok_hi = 0;
            s_lo[j] = vf_blend(vf_set1(-INFINITY), ok_lo, s_lo[j]);
            s_hi[j] = vf_blend(vf_set1(-INFINITY), ok_hi, s_hi[j]);
            bmax_lo = vf_max(bmax_lo, s_lo[j]);
            bmax_hi = vf_max(bmax_hi, s_hi[j]);
        }
        const vf new_lo = vf_max(m_lo, bmax_lo), new_hi = vf_max(m_hi, bmax_hi);
        /* a row with no key seen yet keeps -inf: subtract 0 instead (its terms are all 0) */
        const vf zero = vf_zero(), ninf = vf_set1(-INFINITY);
        const vf safe_lo = vf_blend(new_lo, vf_cmpeq(new_lo, ninf), zero);
        const vf safe_hi = vf_blend(new_hi, vf_cmpeq(new_hi, ninf), zero);
        const vf corr_lo = exp16(vf_sub(m_lo, safe_lo));
        const vf corr_hi = exp16(vf_sub(m_hi, safe_hi));
        m_lo = new_lo; m_hi = new_hi;
        l_lo = vf_mul(l_lo, corr_lo); l_hi = vf_mul(l_hi, corr_hi);
        for (int j = 0; j < KEY_BLOCK; j++) {
            s_lo[j] = exp16(vf_sub(s_lo[j], safe_lo));
            s_hi[j] = exp16(vf_sub(s_hi[j], safe_hi));
            l_lo = vf_add(l_lo, s_lo[j]); l_hi = vf_add(l_hi, s_hi[j]);
        }
        for (int d = 0; d < head_dim; d++) {
            vf a = vf_mul(vf_load(ot[d]), corr_lo);
            vf b = vf_mul(vf_load(ot[d] + 16), corr_hi);
            for (int j = 0; j < count; j++) {
                const vf v = vf_set1(vb[j][d]);
                a = vf_fmadd(s_lo[j], v, a);
                b = vf_fmadd(s_hi[j], v, b);
            }
            vf_store(ot[d], a); vf_store(ot[d] + 16, b);
        }
    }
    float inv[TILE_ROWS];
    vf_storeu(inv, vf_div(vf_set1(1.0f), l_lo));
    vf_storeu(inv + 16, vf_div(vf_set1(1.0f), l_hi));
    for (int r = 0; r < rows; r++) {
        char *orow = (char *)out + ((i0 + r / group) * num_heads + h * group + r % group) * head_dim * esize;
        for (int d = 0; d < head_dim; d++) {
            const float v = ot[d][r] * inv[r];
            if (bf16) ((uint16_t *)orow)[d] = to_bf16(v);
            else ((float *)orow)[d] = v;
        }
    }
}

/* One chunk of n query rows at positions num_computed.. (q: [n, num_heads, head_dim],
   rows q_row_stride apart; out: [n, num_heads, head_dim] contiguous; table: the
   sequence's blocks, covering num_computed + n tokens, all inside the cache — the
   caller checks). Returns 0. */
int sluice_prefill_attention(
    const void *q, int64_t q_row_stride, const void *kv, void *out, const int64_t *table,
    int64_t num_computed, int64_t n, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int64_t num_blocks, int window, float scale, int bf16, int num_threads)
{
    const int group = num_heads / num_kv_heads;
    const int positions = group >= TILE_ROWS ? 1 : TILE_ROWS / group;
    const int64_t tiles = (n + positions - 1) / positions;
    if (group > TILE_ROWS || head_dim > MAX_DIM || head_dim % 16) return -1;
    /* the last tiles see the most keys: hand them out first */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < tiles * num_kv_heads; task++) {
        const int64_t tile = tiles - 1 - task / num_kv_heads;
        const int64_t i0 = tile * positions;
        const int count = n - i0 < positions ? (int)(n - i0) : positions;
        prefill_tile(q, q_row_stride, kv, out, table, num_computed, i0, count,
                     (int)(task % num_kv_heads), num_heads, num_kv_heads, head_dim, block_size,
                     num_blocks, window, scale, bf16);
    }
    return 0;
}
