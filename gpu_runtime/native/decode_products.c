/* The decode step's products, y = x W^T + b for the step's rows, inside decode_layers.c's
   OpenMP region (included there: one translation unit, so they inline into it).

   The products read weights laid out for this kernel: blocks of 32 output rows,
   each one contiguous stream split between threads by blocks, inside a block
   [K/2][32][2] bfloat16 (the pairs AVX512-BF16's dot product takes) or [K][32]
   float32. Each input value (pair) is broadcast and multiplied into 32 output
   columns at once: no horizontal sums, and every weight read serves all rows of
   the step (in groups of 8 rows, a block read again from L2 for each group after
   the first). Every cache line of the stream is prefetched 16 pairs (bf16) or 8
   values (f32) ahead: without it the stream ran at 2/3 the speed.

   It reads decode_attention.c's masked loads and stores (first_n, elem, load16m,
   store16m) and decode_layers.c's ROW_GROUP and SPLIT_ROWS, both defined before it
   is included. */

typedef struct {
    const void *weight;  /* [ceil(N/32)][K/2][32][2] bf16 or [ceil(N/32)][K][32] f32; rows past N zero */
    const void *bias;    /* [N] in the model's dtype, or NULL */
    int64_t out_features, in_features;
    int64_t qtype;       /* 0: the float layout above; else decode_quant.c's */
    /* NULL, or per 32-row block its qtype and byte offset (a fused q/k/v or gate/up
       whose parts are stored in different formats) */
    const int64_t *block_qtypes, *block_offsets;
} sluice_proj;

#define COLS 32  /* output rows per block: two vectors of 16 */

static inline int64_t qblock_bytes(int64_t qtype, int64_t K);  /* decode_quant.c */
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
    const int64_t block_bytes = p->qtype ? qblock_bytes(p->qtype, p->in_features)
                                         : COLS * p->in_features * (bf16 ? 2 : 4);
    const int64_t end = count * block_bytes < AHEAD_BYTES ? count * block_bytes : AHEAD_BYTES;
    const char *w = (const char *)p->weight
                    + (p->block_offsets && count ? p->block_offsets[first] : first * block_bytes);
    for (int64_t at = 0; at < end; at += 64) _mm_prefetch(w + at, _MM_HINT_T1);
}
