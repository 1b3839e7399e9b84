/* Decode attention over the paged KV cache, read in place (CPU, AVX-512F).

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

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256

static inline __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p);
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the first n of 16 lanes */
static inline __mmask16 first_n(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* element i of a row of the model's dtype */
static inline char *elem(const void *p, int64_t i, int bf16) { return (char *)p + i * (bf16 ? 2 : 4); }

/* load16 of the lanes in k (the others 0) */
static inline __m512 load16m(const void *p, __mmask16 k, int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

static inline float from_bits_u16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

/* float32 bits rounded to nearest even at bfloat16 precision (in the upper half), as
   torch's float -> bfloat16 (NaN is not expected here) */
static inline __m512i rne_bits(__m512 v) {
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(rne_bits(v), _mm512_set1_epi32((int)0xffff0000u)));
}
static inline __m256i to_bf16_bits(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rne_bits(v), 16)); }
static inline uint16_t to_bf16(float v) {
    uint32_t u; memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline void store16(void *p, __m512 v, int bf16) {
    if (!bf16) _mm512_storeu_ps((float *)p, v);
    else _mm256_storeu_si256((__m256i *)p, to_bf16_bits(v));
}

/* store16 of the lanes in k */
static inline void store16m(void *p, __mmask16 k, __m512 v, int bf16) {
    if (!bf16) _mm512_mask_storeu_ps((float *)p, k, v);
    else _mm256_mask_storeu_epi16(p, k, to_bf16_bits(v));
}

/* e^x: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, |r| <= 0.35), e^r by its
   Taylor series to degree 7 (relative error < 1e-8 on that range), scalef by 2^n. x is
   clamped to [-104, 89] first: e^x is 0 below and infinite above in float32. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
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

/* lane j: the sum of v[j]'s 16 lanes (16 horizontal sums in 45 operations, not 128) */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: v[2i] in slots 0 and 2, v[2i+1] in 1 and 3 */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per lane: v[4i] .. v[4i+3], one slot each */
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* add the four lanes: pairs of lanes, then pairs of pairs, keeping v's order */
    const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s0, s1, _MM_SHUFFLE(3, 1, 3, 1)));
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

    __m512 qv[MAX_GROUP][MAX_DIM / 16];
    for (int g = 0; g < group; g++) {
        const char *qrow = (const char *)q
            + ((int64_t)b * q_row_stride + (int64_t)(h * group + g) * head_dim) * esize;
        for (int c = 0; c < chunks; c++)
            qv[g][c] = _mm512_mul_ps(load16(qrow + c * 16 * esize, bf16), _mm512_set1_ps(scale));
    }
    /* pass 1: scores by blocks of KEYS keys, and each query head's maximum */
    __m512 maxs[MAX_GROUP];
    for (int g = 0; g < group; g++) maxs[g] = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
        const int count = n - j0 < KEYS ? (int)(n - j0) : KEYS;
        float kb[KEYS][MAX_DIM] __attribute__((aligned(64)));
        for (int j = 0; j < KEYS; j++) {
            const int64_t pos = first + j0 + (j < count ? j : 0);  /* past the end: a copy */
            const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
            const char *krow = (const char *)kv + (slot * token_stride + (int64_t)h * head_dim) * esize;
            for (int c = 0; c < chunks; c++) _mm512_store_ps(kb[j] + 16 * c, load16(krow + c * 16 * esize, bf16));
        }
        const __mmask16 valid = first_n(count);
        for (int g = 0; g < group; g++) {
            __m512 dots[KEYS];
            for (int j = 0; j < KEYS; j++) {
                __m512 acc = _mm512_mul_ps(qv[g][0], _mm512_load_ps(kb[j]));
                for (int c = 1; c < chunks; c++) acc = _mm512_fmadd_ps(qv[g][c], _mm512_load_ps(kb[j] + 16 * c), acc);
                dots[j] = acc;
            }
            const __m512 s = sum16(dots);
            _mm512_mask_storeu_ps(scores + g * n + j0, valid, s);
            maxs[g] = _mm512_mask_max_ps(maxs[g], valid, maxs[g], s);
        }
    }
    /* softmax numerators in place, and their sums */
    float sums[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *row = scores + g * n;
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(maxs[g]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = first_n(n - j);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), m));
            _mm512_mask_storeu_ps(row + j, k, e);
            total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, e));
        }
        sums[g] = _mm512_reduce_add_ps(total);
    }
    /* pass 2: the weighted sum of the values */
    __m512 acc[MAX_GROUP][MAX_DIM / 16];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        const char *vrow = (const char *)kv + (v_offset + slot * token_stride + (int64_t)h * head_dim) * esize;
        for (int c = 0; c < chunks; c++) {
            const __m512 v = load16(vrow + c * 16 * esize, bf16);
            for (int g = 0; g < group; g++)
                acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + j]), v, acc[g][c]);
        }
    }
    for (int g = 0; g < group; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[g]);
        char *orow = (char *)out + (((int64_t)b * num_heads) + h * group + g) * head_dim * esize;
        for (int c = 0; c < chunks; c++)
            store16(orow + c * 16 * esize, _mm512_mul_ps(acc[g][c], inv), bf16);
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
            _mm512_storeu_ps(dst[j] + 16 * c, load16(row + c * 16 * esize, bf16));
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
    const __m512i pos_lo = _mm512_loadu_si512(row_pos), pos_hi = _mm512_loadu_si512(row_pos + 16);
    const __m512i first_lo = _mm512_loadu_si512(row_first), first_hi = _mm512_loadu_si512(row_first + 16);
    __m512 m_lo = _mm512_set1_ps(-INFINITY), m_hi = m_lo;
    __m512 l_lo = _mm512_setzero_ps(), l_hi = l_lo;
    int64_t lo = row_first[0];
    for (int r = 1; r < rows; r++) if (row_first[r] < lo) lo = row_first[r];
    const int64_t hi = num_computed + i0 + positions;  /* one past the last key */
    for (int64_t p0 = lo; p0 < hi; p0 += KEY_BLOCK) {
        const int count = hi - p0 < KEY_BLOCK ? (int)(hi - p0) : KEY_BLOCK;
        load_key_rows(kv, 0, table, block_size, p0, count, token_stride, h, head_dim, bf16, kb);
        load_key_rows(kv, v_base, table, block_size, p0, count, token_stride, h, head_dim, bf16, vb);
        __m512 s_lo[KEY_BLOCK], s_hi[KEY_BLOCK];
        for (int j = 0; j < KEY_BLOCK; j++) { s_lo[j] = _mm512_setzero_ps(); s_hi[j] = _mm512_setzero_ps(); }
        for (int d = 0; d < head_dim; d++) {
            const __m512 a = _mm512_load_ps(qt[d]), b = _mm512_load_ps(qt[d] + 16);
            for (int j = 0; j < KEY_BLOCK; j++) {
                const __m512 k = _mm512_set1_ps(kb[j][d]);
                s_lo[j] = _mm512_fmadd_ps(a, k, s_lo[j]);
                s_hi[j] = _mm512_fmadd_ps(b, k, s_hi[j]);
            }
        }
        /* mask keys past a row's position or before its window (and past the block) */
        __m512 bmax_lo = _mm512_set1_ps(-INFINITY), bmax_hi = bmax_lo;
        for (int j = 0; j < KEY_BLOCK; j++) {
            const __m512i kp = _mm512_set1_epi32((int32_t)(p0 + j));
            __mmask16 ok_lo = _mm512_cmple_epi32_mask(kp, pos_lo) & _mm512_cmpge_epi32_mask(kp, first_lo);
            __mmask16 ok_hi = _mm512_cmple_epi32_mask(kp, pos_hi) & _mm512_cmpge_epi32_mask(kp, first_hi);
            if (j >= count) ok_lo = ok_hi = 0;
            s_lo[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok_lo, s_lo[j]);
            s_hi[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok_hi, s_hi[j]);
            bmax_lo = _mm512_max_ps(bmax_lo, s_lo[j]);
            bmax_hi = _mm512_max_ps(bmax_hi, s_hi[j]);
        }
        const __m512 new_lo = _mm512_max_ps(m_lo, bmax_lo), new_hi = _mm512_max_ps(m_hi, bmax_hi);
        /* a row with no key seen yet keeps -inf: subtract 0 instead (its terms are all 0) */
        const __m512 zero = _mm512_setzero_ps(), ninf = _mm512_set1_ps(-INFINITY);
        const __m512 safe_lo = _mm512_mask_mov_ps(new_lo, _mm512_cmp_ps_mask(new_lo, ninf, _CMP_EQ_OQ), zero);
        const __m512 safe_hi = _mm512_mask_mov_ps(new_hi, _mm512_cmp_ps_mask(new_hi, ninf, _CMP_EQ_OQ), zero);
        const __m512 corr_lo = exp16(_mm512_sub_ps(m_lo, safe_lo));
        const __m512 corr_hi = exp16(_mm512_sub_ps(m_hi, safe_hi));
        m_lo = new_lo; m_hi = new_hi;
        l_lo = _mm512_mul_ps(l_lo, corr_lo); l_hi = _mm512_mul_ps(l_hi, corr_hi);
        for (int j = 0; j < KEY_BLOCK; j++) {
            s_lo[j] = exp16(_mm512_sub_ps(s_lo[j], safe_lo));
            s_hi[j] = exp16(_mm512_sub_ps(s_hi[j], safe_hi));
            l_lo = _mm512_add_ps(l_lo, s_lo[j]); l_hi = _mm512_add_ps(l_hi, s_hi[j]);
        }
        for (int d = 0; d < head_dim; d++) {
            __m512 a = _mm512_mul_ps(_mm512_load_ps(ot[d]), corr_lo);
            __m512 b = _mm512_mul_ps(_mm512_load_ps(ot[d] + 16), corr_hi);
            for (int j = 0; j < count; j++) {
                const __m512 v = _mm512_set1_ps(vb[j][d]);
                a = _mm512_fmadd_ps(s_lo[j], v, a);
                b = _mm512_fmadd_ps(s_hi[j], v, b);
            }
            _mm512_store_ps(ot[d], a); _mm512_store_ps(ot[d] + 16, b);
        }
    }
    float inv[TILE_ROWS];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l_lo));
    _mm512_storeu_ps(inv + 16, _mm512_div_ps(_mm512_set1_ps(1.0f), l_hi));
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
