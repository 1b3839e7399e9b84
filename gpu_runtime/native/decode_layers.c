/* A whole decode step's decoder layers in one call (CPU, AVX-512 or AVX2 through
   simd16.h; bf16 products on AVX512-BF16 only), for all-decode steps of up to MAX_ROWS
   rows. On AVX2 a block's products hold 3 rows at once, not 8 (16 registers of 8
   lanes: 12 accumulators; paired on a Zen 1 EPYC, 2 and 4 rows ran 9-12 % and 2-8 %
   slower at 8 and 32 rows).

   A decode step is 30-odd layers of small products and
   elementwise ops; through torch each is a dispatch, an allocation and (for the
   products) a oneDNN primitive set up again, and the second thread waits while
   the first does it (measured: 60 % of a SmolLM2 step at batch 1 outside the
   products' kernels). Here one call takes the step's token ids to the model's final
   norm and, when every row is sampled, its float32 logits and each row's argmax
   (which sampling asks for first, greedy or not): a torch op right after a
   step is cold (the weights' stream has evicted its code and data; the embedding's
   lookup took 0.09 ms, a row gather 0.12 ms), and the LM head in the same region
   spares a second one (paired, one process: 1.0-2.2 % of a bfloat16 step at 1 to 32
   rows). One OpenMP region runs every layer: RMSNorm, the fused
   q/k/v product, RoPE, the KV cache write, attention (decode_attention.c's task),
   the output product and its residual, RMSNorm, the fused gate/up product, SiLU
   and the down product and its residual; a barrier between phases. The elementwise
   phases run 16 values a vector (SiLU's exponential included: scalar, it was 7 ms
   of a 35 ms step of 32 rows); each thread, done with the phase before a product,
   starts the first 32 KiB of its share of that product's weights towards L2.

   The products read weights laid out for this kernel: blocks of 32 output rows,
   each one contiguous stream split between threads by blocks, inside a block
   [K/2][32][2] bfloat16 (the pairs AVX512-BF16's dot product takes) or [K][32]
   float32. Each input value (pair) is broadcast and multiplied into 32 output
   columns at once: no horizontal sums, and every weight read serves all rows of
   the step (in groups of 8 rows, a block read again from L2 for each group after
   the first). Every cache line of the stream is prefetched 16 pairs (bf16) or 8
   values (f32) ahead: without it the stream ran at 2/3 the speed.

   Values are rounded where the torch path rounds them (each product's output, the
   residual sums, RoPE's products and sum, SiLU and its product with up), so
   bfloat16 runs stay within the torch path's own rounding. Loaded by gpu_runtime/cpu_decode.py. */

#include "decode_attention.c"

#include <omp.h>
#include <string.h>

#define MAX_ROWS 128  /* rows of a step (cpu_decode.MAX_ROWS) */
#if SIMD16_ISA == 512
#define ROW_GROUP 8  /* rows a block's products hold in registers at once */
#define SPLIT_ROWS 4  /* up to this many rows, two accumulator sets */
#else  /* 16 ymm registers, each accumulator two of them */
#ifndef ROW_GROUP
#define ROW_GROUP 3
#endif
#ifndef SPLIT_ROWS
#define SPLIT_ROWS 1
#endif
#endif

typedef struct {
    const void *weight;  /* [ceil(N/32)][K/2][32][2] bf16 or [ceil(N/32)][K][32] f32; rows past N zero */
    const void *bias;    /* [N] in the model's dtype, or NULL */
    int64_t out_features, in_features;
} sluice_proj;

typedef struct {
    sluice_proj qkv, o, gate_up, down;
    const void *norm1, *norm2;  /* [hidden] */
    void *kv;                   /* [2, num_blocks, block_size, num_kv_heads, head_dim] */
    int64_t window;             /* 0: full attention */
} sluice_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, num_blocks, bf16;
    float eps, scale;
    const void *final_norm;  /* [hidden]: the model's last RMSNorm */
    const void *embed;       /* [vocab, hidden]: the embedding's rows */
    int64_t vocab;
    sluice_proj lm_head;     /* [vocab, hidden] blocked as the other products */
} sluice_model;

#define COLS 32  /* output rows per block: two vectors of 16 */
#ifndef PREFETCH_BF16
#define PREFETCH_BF16 16  /* pairs ahead (of 128 bytes each): 8 ran 5-10 % slower */
#endif
#ifndef PREFETCH_F32
#define PREFETCH_F32 8  /* values ahead (of 128 bytes each) */
#endif
#ifndef PREFETCH_F32_ONE_ROW
#if SIMD16_ISA == 512
#define PREFETCH_F32_ONE_ROW PREFETCH_F32
#else  /* AVX2 (Zen 1 EPYC, paired): 4 ahead 1.07-1.12x at one row, 0.96-0.98x at 8 */
#define PREFETCH_F32_ONE_ROW 4
#endif
#endif

/* The block's 32 outputs for M rows of x: out[c][m] holds outputs 16c..16c+15 of row m.
   Up to SPLIT_ROWS rows, two accumulator sets (even and odd pairs) halve the dependency
   chains. */
#if SIMD16_ISA == 512
#define BF16_PRODUCTS 1
/* acc[c][m] over the block's 32 outputs: bf16 layout [K/2][32][2] per block. */
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void
cols_bf16(const uint16_t *x, int64_t K, const uint16_t *wb, const int M, vf out[2][ROW_GROUP])
{
    vf a0[2][ROW_GROUP], a1[2][ROW_GROUP];
    const int split = M <= SPLIT_ROWS;  /* two accumulator sets: chains half as long */
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) { a0[c][m] = vf_zero(); a1[c][m] = vf_zero(); }
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const uint16_t *w = wb + k * COLS;  /* pairs k, k+1 then k+2, k+3 */
        for (int line = 0; line < 4; line++)  /* the 256 bytes 8 pairs ahead */
            _mm_prefetch((const char *)(w + 2 * PREFETCH_BF16 * COLS + line * 32), _MM_HINT_T0);
        const __m512bh w00 = (__m512bh)_mm512_loadu_si512(w), w01 = (__m512bh)_mm512_loadu_si512(w + 32);
        const __m512bh w10 = (__m512bh)_mm512_loadu_si512(w + 64), w11 = (__m512bh)_mm512_loadu_si512(w + 96);
        for (int m = 0; m < M; m++) {
            int32_t p0, p1;
            memcpy(&p0, x + m * K + k, 4); memcpy(&p1, x + m * K + k + 2, 4);
            const __m512bh b0 = (__m512bh)_mm512_set1_epi32(p0), b1 = (__m512bh)_mm512_set1_epi32(p1);
            a0[0][m] = _mm512_dpbf16_ps(a0[0][m], b0, w00);
            a0[1][m] = _mm512_dpbf16_ps(a0[1][m], b0, w01);
            if (split) {
                a1[0][m] = _mm512_dpbf16_ps(a1[0][m], b1, w10);
                a1[1][m] = _mm512_dpbf16_ps(a1[1][m], b1, w11);
            } else {
                a0[0][m] = _mm512_dpbf16_ps(a0[0][m], b1, w10);
                a0[1][m] = _mm512_dpbf16_ps(a0[1][m], b1, w11);
            }
        }
    }
    for (; k < K; k += 2) {
        const uint16_t *w = wb + k * COLS;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        for (int m = 0; m < M; m++) {
            int32_t p; memcpy(&p, x + m * K + k, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32(p);
            a0[0][m] = _mm512_dpbf16_ps(a0[0][m], b, w0);
            a0[1][m] = _mm512_dpbf16_ps(a0[1][m], b, w1);
        }
    }
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) out[c][m] = split ? vf_add(a0[c][m], a1[c][m]) : a0[c][m];
}

#else
#define BF16_PRODUCTS 0  /* AVX512-BF16's dot product: no AVX2 counterpart */
#endif

/* As cols_bf16 for float32: the block is [K][32]. */
static inline __attribute__((always_inline)) void
cols_f32(const float *x, int64_t K, const float *wb, const int M, vf out[2][ROW_GROUP])
{
    vf a0[2][ROW_GROUP], a1[2][ROW_GROUP];
    const int split = M <= SPLIT_ROWS;
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) { a0[c][m] = vf_zero(); a1[c][m] = vf_zero(); }
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        const float *w = wb + k * COLS;
        for (int line = 0; line < 4; line++)
            _mm_prefetch((const char *)(w + (M == 1 ? PREFETCH_F32_ONE_ROW : PREFETCH_F32) * COLS
                                        + line * 16), _MM_HINT_T0);
        const vf w00 = vf_loadu(w), w01 = vf_loadu(w + 16);
        const vf w10 = vf_loadu(w + 32), w11 = vf_loadu(w + 48);
        for (int m = 0; m < M; m++) {
            const vf b0 = vf_set1(x[m * K + k]), b1 = vf_set1(x[m * K + k + 1]);
            a0[0][m] = vf_fmadd(b0, w00, a0[0][m]);
            a0[1][m] = vf_fmadd(b0, w01, a0[1][m]);
            if (split) {
                a1[0][m] = vf_fmadd(b1, w10, a1[0][m]);
                a1[1][m] = vf_fmadd(b1, w11, a1[1][m]);
            } else {
                a0[0][m] = vf_fmadd(b1, w10, a0[0][m]);
                a0[1][m] = vf_fmadd(b1, w11, a0[1][m]);
            }
        }
    }
    for (; k < K; k++) {
        const float *w = wb + k * COLS;
        const vf w0 = vf_loadu(w), w1 = vf_loadu(w + 16);
        for (int m = 0; m < M; m++) {
            const vf b = vf_set1(x[m * K + k]);
            a0[0][m] = vf_fmadd(b, w0, a0[0][m]);
            a0[1][m] = vf_fmadd(b, w1, a0[1][m]);
        }
    }
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) out[c][m] = split ? vf_add(a0[c][m], a1[c][m]) : a0[c][m];
}

/* fn with M (1..ROW_GROUP) a constant */
#if ROW_GROUP == 8
#define DISPATCH(fn, x, K, w, M, out) switch (M) { \
    case 1: fn(x, K, w, 1, out); break; case 2: fn(x, K, w, 2, out); break; \
    case 3: fn(x, K, w, 3, out); break; case 4: fn(x, K, w, 4, out); break; \
    case 5: fn(x, K, w, 5, out); break; case 6: fn(x, K, w, 6, out); break; \
    case 7: fn(x, K, w, 7, out); break; default: fn(x, K, w, 8, out); break; }
#elif ROW_GROUP == 4
#define DISPATCH(fn, x, K, w, M, out) switch (M) { \
    case 1: fn(x, K, w, 1, out); break; case 2: fn(x, K, w, 2, out); break; \
    case 3: fn(x, K, w, 3, out); break; default: fn(x, K, w, 4, out); break; }
#elif ROW_GROUP == 3
#define DISPATCH(fn, x, K, w, M, out) switch (M) { \
    case 1: fn(x, K, w, 1, out); break; case 2: fn(x, K, w, 2, out); break; \
    default: fn(x, K, w, 3, out); break; }
#elif ROW_GROUP == 2
#define DISPATCH(fn, x, K, w, M, out) switch (M) { \
    case 1: fn(x, K, w, 1, out); break; default: fn(x, K, w, 2, out); break; }
#else
#error "ROW_GROUP is 2, 3, 4 or 8"
#endif

#if BF16_PRODUCTS
__attribute__((target("avx512f,avx512bf16"))) static void
block_cols_bf16(const uint16_t *x, int64_t K, const uint16_t *w, int M, vf out[2][ROW_GROUP])
{ DISPATCH(cols_bf16, x, K, w, M, out) }
#endif

static void block_cols_f32(const float *x, int64_t K, const float *w, int M, vf out[2][ROW_GROUP])
{ DISPATCH(cols_f32, x, K, w, M, out) }

static inline vf rnd16(vf v, int bf16) { return bf16 ? vf_round_bf16(v) : v; }

/* Outputs n0..n0+31 of rows m0..m0+rows-1: bias, rounding, and the residual sum.
   y_f32: y is float32 whatever the model's dtype (values rounded to it first). */
static inline void store_block(const sluice_proj *p, vf acc[2][ROW_GROUP], int m0, int rows,
                               int64_t n0_block, void *y, void *residual, int bf16, int y_f32)
{
    const int64_t N = p->out_features;
    for (int c = 0; c < 2; c++) {
        const int64_t n0 = n0_block + c * 16;
        if (n0 >= N) break;
        const vmask mask = first_n(N - n0);
        const vf bias = p->bias ? load16m(elem(p->bias, n0, bf16), mask, bf16) : vf_zero();
        for (int m = 0; m < rows; m++) {
            vf v = vf_add(acc[c][m], bias);
            const int64_t at = (int64_t)(m0 + m) * N + n0;
            if (y_f32 && !residual) {
                vf_mask_storeu((float *)y + at, mask, rnd16(v, bf16));
            } else if (residual) {
                v = vf_add(rnd16(v, bf16), load16m(elem(residual, at, bf16), mask, bf16));
                store16m(elem(residual, at, bf16), mask, v, bf16);
            } else {
                store16m(elem(y, at, bf16), mask, v, bf16);
            }
        }
    }
}

/* This thread's part of n items split between the region's threads: contiguous
   parts, the first n % threads parts one longer (as libgomp's schedule(static)).
   `project` shares its blocks out by it and `prefetch_share` warms the same part. */
static inline void thread_part(int64_t n, int64_t *first, int64_t *count)
{
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = n / threads, extra = n % threads;
    *first = t * per + (t < extra ? t : extra);
    *count = per + (t < extra);
}

/* y = x W^T + b for M rows (inside a parallel region: the blocks shared out by
   thread_part, a barrier after).
   residual == 0: y[m][n] = round(y); else residual[m][n] = round(residual + round(y)),
   as the torch path's `x + proj(h)`. y_f32: see store_block. */
static void project(const sluice_proj *p, const void *x, int M, void *y, void *residual, int bf16,
                    int y_f32)
{
    const int64_t N = p->out_features, K = p->in_features;
    int64_t first, count;
    thread_part((N + COLS - 1) / COLS, &first, &count);
    for (int64_t blk = first; blk < first + count; blk++)
        /* more than ROW_GROUP rows: the block again for each group (from L2 after the first) */
        for (int m0 = 0; m0 < M; m0 += ROW_GROUP) {
            const int rows = M - m0 < ROW_GROUP ? M - m0 : ROW_GROUP;
            vf acc[2][ROW_GROUP];
#if BF16_PRODUCTS
            if (bf16)
                block_cols_bf16((const uint16_t *)x + m0 * K, K,
                                (const uint16_t *)p->weight + blk * COLS * K, rows, acc);
            else
#endif
                block_cols_f32((const float *)x + m0 * K, K,
                               (const float *)p->weight + blk * COLS * K, rows, acc);
            store_block(p, acc, m0, rows, blk * COLS, y, residual, bf16, y_f32);
        }
    #pragma omp barrier
}

/* ---- the elementwise phases, 16 values a vector (tails masked) ---- */

#ifndef AHEAD_BYTES
#define AHEAD_BYTES (32 << 10)  /* paired A/B, SmolLM2 steps: 1-4 % faster at 1 and 8 rows; 128 KiB no better */
#endif

/* Sends the first AHEAD_BYTES of this thread's part of p's weights (the blocks
   `project` will give it, thread_part) on their way to L2, so the product starts on
   data already near instead of waiting for its stream to ramp up. Each thread calls
   it once its part of the phase before is done (at one row, one thread has all the
   norm's and RoPE's work and the other nothing). */
static void prefetch_share(const sluice_proj *p, int bf16)
{
    int64_t first, count;
    thread_part((p->out_features + COLS - 1) / COLS, &first, &count);
    const int64_t block_bytes = COLS * p->in_features * (bf16 ? 2 : 4);
    const int64_t end = count * block_bytes < AHEAD_BYTES ? count * block_bytes : AHEAD_BYTES;
    const char *w = (const char *)p->weight + first * block_bytes;
    for (int64_t at = 0; at < end; at += 64) _mm_prefetch(w + at, _MM_HINT_T1);
}

/* RMSNorm of each row, as layers.RMSNorm: float32 normalisation, then (bf16) the
   weight times the normalised row rounded to bf16. */
static void rms_norm(const void *x, const void *weight, void *out, int M, int64_t dim, float eps,
                     int bf16)
{
    #pragma omp for schedule(static) nowait
    for (int m = 0; m < M; m++) {
        const char *row = elem(x, m * dim, bf16);
        vf squares = vf_zero();
        for (int64_t i = 0; i < dim; i += 16) {
            const vf v = load16m(elem(row, i, bf16), first_n(dim - i), bf16);
            squares = vf_fmadd(v, v, squares);
        }
        const vf inv = vf_set1(1.0f / sqrtf(vf_reduce_add(squares) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 16) {
            const vmask k = first_n(dim - i);
            const vf v = rnd16(vf_mul(load16m(elem(row, i, bf16), k, bf16), inv), bf16);
            store16m(elem(out, m * dim + i, bf16), k,
                     vf_mul(load16m(elem(weight, i, bf16), k, bf16), v), bf16);
        }
    }
}

/* RoPE on each row's q and k heads in place (layers.apply_rope: x * cos +
   roll(x, D/2) * signed_sin, each product and the sum rounded like the torch path's
   ops), then k and v into the row's cache slot. D is a multiple of 16. */
static void rope_and_write(const sluice_model *md, const sluice_layer *ly, void *qkv, int M,
                           const int64_t *positions, const int64_t *slots, const float *rope)
{
    const int bf16 = (int)md->bf16, esize = bf16 ? 2 : 4;
    const int64_t D = md->head_dim, half = D / 2, H = md->num_heads, nkv = md->num_kv_heads;
    const int64_t row = (H + 2 * nkv) * D, token = nkv * D;
    const int64_t v_offset = md->num_blocks * md->block_size * token;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        const float *cs = rope + positions[m] * 2 * D;  /* [2, D]: cos, signed sin */
        for (int64_t h = 0; h < H + nkv; h++) {
            char *head = elem(qkv, m * row + h * D, bf16);
            float twice[2 * MAX_DIM];  /* the head twice: roll(x, D/2) is one slice of it */
            for (int64_t d = 0; d < D; d += 16) {
                const vf v = load16(elem(head, d, bf16), bf16);
                vf_storeu(twice + d, v);
                vf_storeu(twice + D + d, v);
            }
            for (int64_t d = 0; d < D; d += 16) {
                const vf c = rnd16(vf_loadu(cs + d), bf16);
                const vf s = rnd16(vf_loadu(cs + D + d), bf16);
                const vf a = rnd16(vf_mul(vf_loadu(twice + d), c), bf16);
                const vf b = rnd16(vf_mul(vf_loadu(twice + d + half), s), bf16);
                store16(elem(head, d, bf16), vf_add(a, b), bf16);
            }
        }
        const int64_t k_base = m * row + H * D, slot = slots[m];
        memcpy(elem(ly->kv, slot * token, bf16), elem(qkv, k_base, bf16), (size_t)(token * esize));
        memcpy(elem(ly->kv, v_offset + slot * token, bf16), elem(qkv, k_base + token, bf16),
               (size_t)(token * esize));
    }
}

/* act[m][i] = round(round(silu(gate)) * up), gate_up's rows [gate | up]; silu(g) is
   g / (1 + e^-g), as torch computes it. */
static void silu_mul(const void *gate_up, void *act, int M, int64_t inter, int bf16)
{
    const int64_t chunks = (inter + 15) / 16;
    #pragma omp for schedule(static) nowait
    for (int64_t j = 0; j < M * chunks; j++) {
        const int64_t m = j / chunks, i = j % chunks * 16;
        const vmask k = first_n(inter - i);
        const vf g = load16m(elem(gate_up, m * 2 * inter + i, bf16), k, bf16);
        const vf u = load16m(elem(gate_up, m * 2 * inter + inter + i, bf16), k, bf16);
        const vf e = exp16(vf_sub(vf_zero(), g));
        const vf silu = rnd16(vf_div(g, vf_add(vf_set1(1.0f), e)), bf16);
        store16m(elem(act, m * inter + i, bf16), k, vf_mul(silu, u), bf16);
    }
}

/* The first index of row's largest value, as torch.argmax (a row holding NaN: its first
   NaN, which torch ranks above every number); row: [cols] float32. */
static int64_t argmax_row(const float *row, int64_t cols)
{
    vf best = vf_set1(-INFINITY);
    vi at = vi_set1(0), index = vi_iota();
    vmask nan = 0;
    for (int64_t i = 0; i < cols; i += 16) {
        const vmask k = first_n(cols - i);
        const vf v = vf_mask_loadu(vf_set1(-INFINITY), k, row + i);
        const vmask above = vf_cmpgt(v, best);  /* each lane's first */
        best = vf_blend(best, above, v);
        at = vi_blend(at, above, index);
        nan |= vf_isnan(v);
        index = vi_add(index, vi_set1(16));
    }
    if (nan) {
        int64_t i = 0;
        while (!isnan(row[i])) i++;
        return i;
    }
    /* the lanes holding the maximum: the smallest of their first indices */
    const vmask top = vf_cmpeq(best, vf_set1(vf_reduce_max(best)));
    return vi_mask_reduce_min(top, at);
}

/* Runs every layer over the embedding's rows of token_ids [rows], held in x [rows,
   hidden] (scratch of the model's dtype: the residual stream). positions, slots, lens:
   [rows]; block_tables: [rows, max_blocks]; rope: [rope_len, 2, head_dim] float32
   (layers.rope_cache); work: scratch of `rows * (hidden + q/k/v + heads*head_dim + 3 *
   intermediate)` elements of the model's dtype; out: [rows, hidden], the last layer's
   output through the model's final RMSNorm. logits: NULL, or [rows, lm_head's
   out_features] float32 for the LM head of every row, and greedy [rows] for each
   row's argmax (argmax_row). Returns 0; -1 (nothing written) when an argument is out
   of range; -2 when attention could not read a row (see attend_task). */
int sluice_decode_layers(const sluice_model *md, const sluice_layer *layers, void *x, int rows,
                         const int64_t *token_ids, const int64_t *positions, const int64_t *slots,
                         const int64_t *block_tables, int max_blocks, const int64_t *lens,
                         const float *rope, int64_t rope_len, void *work, int num_threads,
                         void *out, float *logits, int64_t *greedy)
{
    const int bf16 = (int)md->bf16, esize = bf16 ? 2 : 4;
    const int64_t hidden = md->hidden, D = md->head_dim, H = md->num_heads, nkv = md->num_kv_heads;
    const int64_t qkv_size = (H + 2 * nkv) * D, inter = md->intermediate;
    const int64_t num_slots = md->num_blocks * md->block_size;
    if (rows < 1 || rows > MAX_ROWS || D > MAX_DIM || D % 16 || H % nkv || H / nkv > MAX_GROUP
        || (bf16 && !BF16_PRODUCTS))
        return -1;
    for (int m = 0; m < rows; m++)
        if (positions[m] < 0 || positions[m] >= rope_len || slots[m] < 0 || slots[m] >= num_slots
            || token_ids[m] < 0 || token_ids[m] >= md->vocab)
            return -1;
    for (int m = 0; m < rows; m++)  /* the embedding: the residual stream starts as its rows */
        memcpy((char *)x + m * hidden * esize, (const char *)md->embed + token_ids[m] * hidden * esize,
               hidden * esize);
    char *h = (char *)work;  /* [rows, hidden] */
    char *qkv = h + rows * hidden * esize;  /* [rows, (H + 2 nkv) D] */
    char *attn = qkv + rows * qkv_size * esize;  /* [rows, H D] */
    char *gate_up = attn + rows * H * D * esize;  /* [rows, 2 inter] */
    char *act = gate_up + rows * 2 * inter * esize;  /* [rows, inter] */
    int failed = 0;

    #pragma omp parallel num_threads(num_threads)
    {
    for (int64_t l = 0; l < md->num_layers; l++) {
        const sluice_layer *ly = layers + l;
        rms_norm(x, ly->norm1, h, rows, hidden, md->eps, bf16);
        prefetch_share(&ly->qkv, bf16);
        #pragma omp barrier
        project(&ly->qkv, h, rows, qkv, NULL, bf16, 0);
        rope_and_write(md, ly, qkv, rows, positions, slots, rope);
        #pragma omp for schedule(dynamic, 1) nowait
        for (int task = 0; task < rows * nkv; task++)
            if (attend_task(qkv, qkv_size, ly->kv, attn, block_tables, lens, task / (int)nkv,
                            task % (int)nkv, (int)H, (int)nkv, (int)D, (int)md->block_size,
                            md->num_blocks, max_blocks, (int)ly->window, md->scale, bf16) != 0) {
                #pragma omp atomic write
                failed = 1;
            }
        prefetch_share(&ly->o, bf16);
        #pragma omp barrier
        project(&ly->o, attn, rows, NULL, x, bf16, 0);
        rms_norm(x, ly->norm2, h, rows, hidden, md->eps, bf16);
        prefetch_share(&ly->gate_up, bf16);
        #pragma omp barrier
        project(&ly->gate_up, h, rows, gate_up, NULL, bf16, 0);
        silu_mul(gate_up, act, rows, inter, bf16);
        prefetch_share(&ly->down, bf16);
        #pragma omp barrier
        project(&ly->down, act, rows, NULL, x, bf16, 0);
    }
    rms_norm(x, md->final_norm, out, rows, hidden, md->eps, bf16);
    if (logits != NULL) {  /* every row sampled (a decode step's): the LM head in this region */
        prefetch_share(&md->lm_head, bf16);
        #pragma omp barrier
        project(&md->lm_head, out, rows, logits, NULL, bf16, 1);  /* a barrier after */
        /* and each row's argmax, which every sampling call asks for first (the logits
           are in the cores' caches still; outside, that op ran cold) */
        #pragma omp for schedule(static) nowait
        for (int r = 0; r < rows; r++)
            greedy[r] = argmax_row(logits + r * md->lm_head.out_features, md->lm_head.out_features);
    }
    }
    return failed ? -2 : 0;
}

/* y [rows, N] float32 = x [rows, K] W^T (+ b), rounded to the model's dtype first (as the
   torch path's product in that dtype, then .float()): the LM head of the rows a step
   samples. Returns 0, or -1 for a row count the kernel does not take. */
int sluice_project(const sluice_proj *p, const void *x, int rows, float *y, int bf16,
                   int num_threads)
{
    if (rows < 1 || rows > MAX_ROWS || (bf16 && !BF16_PRODUCTS)) return -1;
    #pragma omp parallel num_threads(num_threads)
    project(p, x, rows, y, NULL, bf16, 1);
    return 0;
}

/* out[r] = argmax_row of row r of x [rows, cols] float32. Rows are shared out between
   threads; torch's argmax over a 49k-wide vocabulary ran at ~1 G values/s here, this at
   memory speed. Returns 0, or -1 for cols out of range. */
int sluice_argmax(const float *x, int rows, int64_t cols, int64_t *out, int num_threads)
{
    if (cols < 1 || cols > INT32_MAX - 16) return -1;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = 0; r < rows; r++)
        out[r] = argmax_row(x + (int64_t)r * cols, cols);
    return 0;
}

/* The vector width this library was built for: 512 (AVX-512) or 256 (AVX2 and FMA;
   no bfloat16 products). */
int sluice_simd_bits(void) { return SIMD16_ISA; }
