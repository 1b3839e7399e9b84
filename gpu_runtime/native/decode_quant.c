/* The decode step's products on quantized weights (GGUF's Q8_0, Q6_K, Q5_0, Q4_K, Q4_0,
   Q4_1), inside decode_layers.c's OpenMP region as decode_products.c's float products are.

   As llama.cpp does, the step's input rows are quantized first (quantize_acts: per 32
   values, d = max|x| / 127 and round(x / d) as int8, with the sums of each 16), and each
   product is integer dot products of those bytes with the weights' bytes, scaled per
   group afterwards: AVX512-VNNI's vpdpbusd where the build has it (-mavx512vnni), else
   vpmaddubsw + vpmaddwd (AVX-512BW or AVX2). Both multiply unsigned bytes by signed ones,
   so the weights are stored unsigned: a format's signed values plus an offset (Q8_0
   128, Q6_K 32, Q5_0 16), the offset's share taken off with the input's group sums
   (offset * sum(x) per group) -- except Q8_0 without VNNI, whose 255 * 127 pairs would
   overflow vpmaddubsw's 16 bits: there the offset is flipped off in registers and the
   input's signs moved onto the weights (|x| * sign(w, x), llama.cpp's way).

   The weights are laid out for this kernel at load (gpu_runtime/quantized.py): blocks of
   32 output rows, each one contiguous stream split between threads by blocks, as the
   float products'. A block is its weight bytes, then its scales:
     8-bit (Q8_0): [K/4][32][4] bytes, byte j of a row's 4 at k = 4g + j;
     4-bit (Q4_K, Q4_0, Q4_1): [K/8][32][4] bytes, the low nibble of byte j at k = 8g + j
       and the high one at k = 8g + 4 + j (one load: both halves of 8 values);
     Q8_0: d [K/32][32] float16;
     Q5_0: the low 4 bits as the 4-bit formats', then the fifth bits [K/8][2][2] as
       64-bit masks, one per 64 bytes of low bits in register order (the block's rows
       0-15 or 16-31, the low or high nibbles), then d [K/32][32] float16 (value
       d * (q - 16)): the file's 5.5 bits a weight;
     Q6_K: per 8 inputs the 4-bit formats' 128 bytes of low bits, then 64 bytes of high
       bit pairs (byte b: the pairs of the weights in byte b of each 64 bytes before it,
       rows 0-15's low and high nibble at bits 0-1 and 2-3, rows 16-31's at 4-5 and 6-7):
       192 bytes a step, the file's 6 bits a weight in one stream; then d [K/256][32]
       float16, then sc [K/16][32] int8 (value d * sc * (q - 32));
     Q4_K: d [K/256][32] and dmin [K/256][32] float16, then sc [K/32][32] and m [K/32][32]
       uint8 (value d * sc * q - dmin * m); Q4_0 and Q4_1 the same with 32 for 256
       (Q4_0: sc 1, m 8, dmin d; Q4_1: sc 1, m 1, dmin -min).
   Within a block the 32 rows' bytes for 4 (or 8) inputs are one 128-byte line: each
   broadcast input group multiplies 32 outputs at once, no horizontal sums.

   Included by decode_layers.c after decode_products.c (it reads COLS, store_block and
   thread_part). */

enum { Q_FLOAT = 0, Q8_0 = 1, Q5_0 = 2, Q6_K = 3, Q4_K = 4, Q4_32 = 5 };

#ifndef Q_AHEAD
#define Q_AHEAD 2048  /* bytes a block's weight stream is prefetched ahead */
#endif
/* Into L2, not L1: the weight stream then read 11-34 % faster (Q4_K 17-27 %; products over
   12 x [8192, 2048], 2 threads, huge pages, paired runs): L1 prefetches hold the few
   line-fill buffers the loads need too */
#define Q_HINT _MM_HINT_T1
#ifndef Q4_SPLIT_ROWS
#define Q4_SPLIT_ROWS 2  /* 1B-class Q4_K_M, batch 1, paired A/B: 30.7 against 28.6 tok/s */
#endif
#ifndef PRIVATE_ROWS
#define PRIVATE_ROWS 2      /* rows each thread quantizes for itself (qproject) */
#endif
#define PRIVATE_WIDTH 8192  /* ... of up to this many inputs: 16 KiB of its stack and sums */

#if SIMD16_ISA == 512
#define QROW_GROUP 4  /* rows a block's quantized products hold at once: 32 zmm */
#else
#define QROW_GROUP 2
#endif

/* ---- 16 lanes of 4 bytes (one lane: a row's 4 bytes, or a 32-bit sum) ---- */
#if SIMD16_ISA == 512
typedef __m512i vq;
static inline vq vq_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vq vq_zero(void) { return _mm512_setzero_si512(); }
static inline vq vq_bcast(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline vq vq_sub_i32(vq a, int32_t s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }
static inline vq vq_add(vq a, vq b) { return _mm512_add_epi32(a, b); }
static inline vq vq_lo4(vq v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline vq vq_hi4(vq v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
static inline vf vq_float(vq v) { return _mm512_cvtepi32_ps(v); }
/* acc + per lane the 4-byte dot product of u (unsigned) and s (signed); without VNNI
   exact while each pair's sum fits 16 bits */
#ifdef __AVX512VNNI__
#define Q_VNNI 1
static inline vq vq_dot(vq acc, vq u, vq s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
#define Q_VNNI 0
static inline vq vq_dot(vq acc, vq u, vq s) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
#endif
/* as vq_dot with both signed (|values| <= 127): |x| times w carrying x's sign */
static inline vq vq_dot_signed(vq acc, vq w, vq x) {
    const __mmask64 negative = _mm512_movepi8_mask(x);
    return vq_dot(acc, _mm512_abs_epi8(x), _mm512_mask_sub_epi8(w, negative, _mm512_setzero_si512(), w));
}
static inline vq vq_flip(vq v) { return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); }
static inline vq vq_or(vq a, vq b) { return _mm512_or_si512(a, b); }
/* Q6_K's high bit pairs of one of a step's four nibble vectors (which: 0 rows 0-15 low
   nibbles, 1 their high nibbles, 2 and 3 rows 16-31's), moved to bits 4-5 of each byte */
static inline vq vq_high2(vq h, const int which) {
    const __m512i m = _mm512_set1_epi8(0x30);
    switch (which) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), m);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 2), m);
    case 2: return _mm512_and_si512(h, m);
    default: return _mm512_and_si512(_mm512_srli_epi16(h, 2), m);
    }
}
/* v with 16 added to each byte whose bit is set in mask (Q5_0's fifth bits) */
static inline vq vq_fifth(vq v, uint64_t mask) {
    return _mm512_or_si512(v, _mm512_maskz_mov_epi8((__mmask64)mask, _mm512_set1_epi8(0x10)));
}
/* 16 float16, int8 or uint8 as float32 */
static inline vf vf_from_f16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf_from_i8(const void *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vf_from_u8(const void *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
#else
#define Q_VNNI 0
typedef struct { __m256i lo, hi; } vq;
static inline vq vq_load(const void *p) {
    return (vq){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
static inline vq vq_zero(void) { return (vq){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline vq vq_bcast(const int8_t *p) {
    int32_t v; memcpy(&v, p, 4);
    const __m256i b = _mm256_set1_epi32(v);
    return (vq){b, b};
}
static inline vq vq_sub_i32(vq a, int32_t s) {
    const __m256i b = _mm256_set1_epi32(s);
    return (vq){_mm256_sub_epi32(a.lo, b), _mm256_sub_epi32(a.hi, b)};
}
static inline vq vq_add(vq a, vq b) { return (vq){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
static inline vq vq_lo4(vq v) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return (vq){_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
}
static inline vq vq_hi4(vq v) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return (vq){_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), m)};
}
static inline vf vq_float(vq v) { return (vf){_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
static inline __m256i dot8(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline vq vq_dot(vq acc, vq u, vq s) { return (vq){dot8(acc.lo, u.lo, s.lo), dot8(acc.hi, u.hi, s.hi)}; }
static inline vq vq_dot_signed(vq acc, vq w, vq x) {
    return (vq){dot8(acc.lo, _mm256_abs_epi8(x.lo), _mm256_sign_epi8(w.lo, x.lo)),
                dot8(acc.hi, _mm256_abs_epi8(x.hi), _mm256_sign_epi8(w.hi, x.hi))};
}
static inline vq vq_flip(vq v) {
    const __m256i m = _mm256_set1_epi8((char)0x80);
    return (vq){_mm256_xor_si256(v.lo, m), _mm256_xor_si256(v.hi, m)};
}
static inline vq vq_or(vq a, vq b) { return (vq){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
static inline __m256i high2_8(__m256i h, const int which) {
    const __m256i m = _mm256_set1_epi8(0x30);
    switch (which) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), m);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), m);
    case 2: return _mm256_and_si256(h, m);
    default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), m);
    }
}
static inline vq vq_high2(vq h, const int which) { return (vq){high2_8(h.lo, which), high2_8(h.hi, which)}; }
/* 0x10 in each byte whose bit of m is set (32 bits: a byte each, in order) */
static inline __m256i fifth8(uint32_t m) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), _mm256_setr_epi64x(
        0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                            _mm256_set1_epi8(0x10));
}
static inline vq vq_fifth(vq v, uint64_t mask) {
    return (vq){_mm256_or_si256(v.lo, fifth8((uint32_t)mask)),
                _mm256_or_si256(v.hi, fifth8((uint32_t)(mask >> 32)))};
}
static inline vf vf_from_f16(const void *p) {
    return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1))};
}
static inline vf vf_from_i8(const void *p) {
    return (vf){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const char *)p + 8))))};
}
static inline vf vf_from_u8(const void *p) {
    return (vf){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const char *)p + 8))))};
}
#endif

/* The step's input rows, quantized: q [M][K] int8, d [M][K/32] (q * d ~ x), and the sum
   of q over each 16 inputs [M][K/16]; for the many-row products also those sums times d,
   over 16 and 32 inputs (xsum16 [M][K/16], xsum32 [M][K/32]; NULL when not made). */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *sum16;
    float *xsum16, *xsum32;
} qacts;

/* Bytes of scratch quantized rows need: M rows of K inputs (sluice_quant_scratch_bytes). */
static inline int64_t qacts_bytes(int64_t M, int64_t K)
{
    return M * K + 2 * M * (K / 32) * 4 + 2 * M * (K / 16) * 4 + 320;
}

static inline qacts qacts_at(void *scratch, int64_t M, int64_t K)
{
    char *at = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    qacts a;
    a.q = (int8_t *)at;
    a.d = (float *)(at + ((M * K + 63) & ~63));
    a.sum16 = (int32_t *)((char *)a.d + ((M * (K / 32) * 4 + 63) & ~63));
    a.xsum16 = (float *)((char *)a.sum16 + ((M * (K / 16) * 4 + 63) & ~63));
    a.xsum32 = (float *)((char *)a.xsum16 + ((M * (K / 16) * 4 + 63) & ~63));
    return a;
}

/* Row m's inputs g*32 .. g*32+31 of x [M][K] quantized into a. */
static inline void quantize_group(const void *x, int64_t m, int64_t g, int64_t K, int bf16, qacts a)
{
    const int64_t groups = K / 32, at = m * K + g * 32;
    const vf v0 = load16(elem(x, at, bf16), bf16), v1 = load16(elem(x, at + 16, bf16), bf16);
    const vf amax = vf_max(vf_max(v0, vf_sub(vf_zero(), v0)), vf_max(v1, vf_sub(vf_zero(), v1)));
    const float d = vf_reduce_max(amax) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    float r[32];
    vf_storeu(r, vf_round(vf_mul(v0, vf_set1(id))));
    vf_storeu(r + 16, vf_round(vf_mul(v1, vf_set1(id))));
    int32_t s0 = 0, s1 = 0;
    for (int i = 0; i < 32; i++) {
        const int v = (int)r[i];
        a.q[at + i] = (int8_t)v;
        if (i < 16) s0 += v; else s1 += v;
    }
    a.d[m * groups + g] = d;
    a.sum16[m * (K / 16) + 2 * g] = s0;
    a.sum16[m * (K / 16) + 2 * g + 1] = s1;
    if (a.xsum16) {
        a.xsum16[m * (K / 16) + 2 * g] = d * (float)s0;
        a.xsum16[m * (K / 16) + 2 * g + 1] = d * (float)s1;
        a.xsum32[m * groups + g] = d * (float)(s0 + s1);
    }
}

/* x [M][K] (float32 or bfloat16) quantized into a, 32 values at a time (shared out
   between the region's threads; a barrier after). */
static void quantize_acts(const void *x, int M, int64_t K, int bf16, qacts a)
{
    const int64_t groups = K / 32;
    #pragma omp for schedule(static)
    for (int64_t j = 0; j < M * groups; j++) quantize_group(x, j / groups, j % groups, K, bf16, a);
}

/* The 32 outputs of one block for M (<= QROW_GROUP) rows, 8-bit weights with one
   float16 scale per 32 inputs (Q8_0: offset 128; Q5_0: offset 16). */
static inline __attribute__((always_inline)) void
qcols_8(const qacts *a, int64_t m0, int64_t K, const uint8_t *wb, int offset, const int M,
        vf out[2][ROW_GROUP])
{
    const uint16_t *scales = (const uint16_t *)(wb + 32 * K);  /* [K/32][32] */
    const int signed_path = offset == 128 && !Q_VNNI;
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) out[c][m] = vf_zero();
    for (int64_t g = 0; g < K / 32; g++) {
        vq acc[2][QROW_GROUP];
        for (int c = 0; c < 2; c++)
            for (int m = 0; m < M; m++) acc[c][m] = vq_zero();
        const uint8_t *w = wb + g * 32 * 32;
        for (int step = 0; step < 8; step++) {  /* 4 inputs a step */
            const uint8_t *ws = w + step * 128;
            _mm_prefetch((const char *)(ws + Q_AHEAD), Q_HINT);
            _mm_prefetch((const char *)(ws + Q_AHEAD + 64), Q_HINT);
            vq w0 = vq_load(ws), w1 = vq_load(ws + 64);
            if (signed_path) { w0 = vq_flip(w0); w1 = vq_flip(w1); }
            for (int m = 0; m < M; m++) {
                const vq xb = vq_bcast(a->q + (m0 + m) * K + g * 32 + step * 4);
                if (signed_path) {
                    acc[0][m] = vq_dot_signed(acc[0][m], w0, xb);
                    acc[1][m] = vq_dot_signed(acc[1][m], w1, xb);
                } else {
                    acc[0][m] = vq_dot(acc[0][m], w0, xb);
                    acc[1][m] = vq_dot(acc[1][m], w1, xb);
                }
            }
        }
        const vf d0 = vf_from_f16(scales + g * 32), d1 = vf_from_f16(scales + g * 32 + 16);
        for (int m = 0; m < M; m++) {
            const int64_t row = m0 + m;
            const int32_t shift = signed_path ? 0 : offset * (a->sum16[row * (K / 16) + 2 * g]
                                                              + a->sum16[row * (K / 16) + 2 * g + 1]);
            const vf dx = vf_set1(a->d[row * (K / 32) + g]);
            out[0][m] = vf_fmadd(vq_float(vq_sub_i32(acc[0][m], shift)), vf_mul(d0, dx), out[0][m]);
            out[1][m] = vf_fmadd(vq_float(vq_sub_i32(acc[1][m], shift)), vf_mul(d1, dx), out[1][m]);
        }
    }
}

/* One step (8 inputs) of a block's weights as values, v[0..3]: outputs 0-15's inputs 0-3,
   their inputs 4-7, then outputs 16-31's the same. The 4-bit formats' nibbles (Q5_0: with
   `fifth`, the step's four masks of fifth bits) at ws; Q6_K's nibbles and high bit pairs
   (q6_step). The products of few rows decode a step in registers for each group of rows,
   those of many rows once into a buffer (unpack_block). */
static inline __attribute__((always_inline)) void
nibble_step(const uint8_t *ws, const uint64_t *fifth, vq v[4])
{
    const vq v0 = vq_load(ws), v1 = vq_load(ws + 64);
    v[0] = vq_lo4(v0); v[1] = vq_hi4(v0); v[2] = vq_lo4(v1); v[3] = vq_hi4(v1);
    if (fifth)
        for (int i = 0; i < 4; i++) v[i] = vq_fifth(v[i], fifth[i]);
}

static inline __attribute__((always_inline)) void q6_step(const uint8_t *ws, vq v[4])
{
    const vq v0 = vq_load(ws), v1 = vq_load(ws + 64), h = vq_load(ws + 128);
    v[0] = vq_or(vq_lo4(v0), vq_high2(h, 0)); v[1] = vq_or(vq_hi4(v0), vq_high2(h, 1));
    v[2] = vq_or(vq_lo4(v1), vq_high2(h, 2)); v[3] = vq_or(vq_hi4(v1), vq_high2(h, 3));
}

/* Q5_0: 5-bit weights (0..31) as 4-bit nibbles and a plane of fifth bits, d per 32
   inputs, value d * (q - 16): the 4-bit formats' loop with the fifth bits or-ed in. */
/* One group of 32 inputs of a 4-bit block (Q5_0's too: `fifth` non-NULL adds its fifth
   bits): acc[c][m] = the integer dot products of the group's weights with row m's
   quantized inputs. Up to Q4_SPLIT_ROWS rows the low and high nibbles sum apart (two
   dependency chains a column set, not one twice as long) and are added at the end. */
static inline __attribute__((always_inline)) void
nibble_group(const qacts *a, int64_t m0, int64_t K, int64_t g, const uint8_t *wb,
             const uint64_t *fifth, const int M, vq acc[2][QROW_GROUP])
{
    const int split = M <= Q4_SPLIT_ROWS;
    vq high[2][QROW_GROUP];
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) { acc[c][m] = vq_zero(); high[c][m] = vq_zero(); }
    const uint8_t *w = wb + g * 16 * 32;
    for (int step = 0; step < 4; step++) {  /* 8 inputs a step */
        const uint8_t *ws = w + step * 128;
        _mm_prefetch((const char *)(ws + Q_AHEAD), Q_HINT);
        _mm_prefetch((const char *)(ws + Q_AHEAD + 64), Q_HINT);
        vq v[4];
        nibble_step(ws, fifth ? fifth + (g * 4 + step) * 4 : NULL, v);
        const vq lo0 = v[0], hi0 = v[1], lo1 = v[2], hi1 = v[3];
        for (int m = 0; m < M; m++) {
            const int8_t *xq = a->q + (m0 + m) * K + g * 32 + step * 8;
            const vq xl = vq_bcast(xq), xh = vq_bcast(xq + 4);
            if (split) {
                acc[0][m] = vq_dot(acc[0][m], lo0, xl);
                acc[1][m] = vq_dot(acc[1][m], lo1, xl);
                high[0][m] = vq_dot(high[0][m], hi0, xh);
                high[1][m] = vq_dot(high[1][m], hi1, xh);
            } else {
                acc[0][m] = vq_dot(vq_dot(acc[0][m], lo0, xl), hi0, xh);
                acc[1][m] = vq_dot(vq_dot(acc[1][m], lo1, xl), hi1, xh);
            }
        }
    }
    if (split)
        for (int c = 0; c < 2; c++)
            for (int m = 0; m < M; m++) acc[c][m] = vq_add(acc[c][m], high[c][m]);
}

static inline __attribute__((always_inline)) void
qcols_5(const qacts *a, int64_t m0, int64_t K, const uint8_t *wb, const int M, vf out[2][ROW_GROUP])
{
    const uint64_t *fifth = (const uint64_t *)(wb + 16 * K);  /* [K/8][2][2] */
    const uint16_t *scales = (const uint16_t *)(wb + 20 * K);  /* [K/32][32] */
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) out[c][m] = vf_zero();
    for (int64_t g = 0; g < K / 32; g++) {
        vq acc[2][QROW_GROUP];
        nibble_group(a, m0, K, g, wb, fifth, M, acc);
        const vf d0 = vf_from_f16(scales + g * 32), d1 = vf_from_f16(scales + g * 32 + 16);
        for (int m = 0; m < M; m++) {
            const int64_t row = m0 + m;
            const int32_t shift = 16 * (a->sum16[row * (K / 16) + 2 * g] + a->sum16[row * (K / 16) + 2 * g + 1]);
            const vf dx = vf_set1(a->d[row * (K / 32) + g]);
            out[0][m] = vf_fmadd(vq_float(vq_sub_i32(acc[0][m], shift)), vf_mul(d0, dx), out[0][m]);
            out[1][m] = vf_fmadd(vq_float(vq_sub_i32(acc[1][m], shift)), vf_mul(d1, dx), out[1][m]);
        }
    }
}

/* Q6_K: 6-bit weights q + 32 (0..63) as 4-bit nibbles and a plane of high bit pairs,
   interleaved per step of 8 inputs (192 bytes: one stream); d per 256 inputs and an int8
   scale per 16. */
static inline __attribute__((always_inline)) void
qcols_6k(const qacts *a, int64_t m0, int64_t K, const uint8_t *wb, const int M, vf out[2][ROW_GROUP])
{
    const uint16_t *d = (const uint16_t *)(wb + 24 * K);                /* [K/256][32] */
    const int8_t *sc = (const int8_t *)(wb + 24 * K + (K / 256) * 64);  /* [K/16][32] */
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) out[c][m] = vf_zero();
    vf d0 = vf_zero(), d1 = vf_zero();
    for (int64_t g = 0; g < K / 16; g++) {
        if (g % 16 == 0) {  /* a new super-block */
            d0 = vf_from_f16(d + (g / 16) * 32);
            d1 = vf_from_f16(d + (g / 16) * 32 + 16);
        }
        vq acc[2][QROW_GROUP];
        for (int c = 0; c < 2; c++)
            for (int m = 0; m < M; m++) acc[c][m] = vq_zero();
        const uint8_t *w = wb + g * 2 * 192;
        for (int step = 0; step < 2; step++) {  /* 8 inputs a step */
            const uint8_t *ws = w + step * 192;
            _mm_prefetch((const char *)(ws + Q_AHEAD), Q_HINT);
            _mm_prefetch((const char *)(ws + Q_AHEAD + 64), Q_HINT);
            _mm_prefetch((const char *)(ws + Q_AHEAD + 128), Q_HINT);
            vq v[4];
            q6_step(ws, v);
            const vq lo0 = v[0], hi0 = v[1], lo1 = v[2], hi1 = v[3];
            for (int m = 0; m < M; m++) {
                const int8_t *xq = a->q + (m0 + m) * K + g * 16 + step * 8;
                const vq xl = vq_bcast(xq), xh = vq_bcast(xq + 4);
                acc[0][m] = vq_dot(vq_dot(acc[0][m], lo0, xl), hi0, xh);
                acc[1][m] = vq_dot(vq_dot(acc[1][m], lo1, xl), hi1, xh);
            }
        }
        const vf s0 = vf_mul(d0, vf_from_i8(sc + g * 32)), s1 = vf_mul(d1, vf_from_i8(sc + g * 32 + 16));
        for (int m = 0; m < M; m++) {
            const int64_t row = m0 + m;
            const int32_t shift = 32 * a->sum16[row * (K / 16) + g];
            const vf dx = vf_set1(a->d[row * (K / 32) + g / 2]);
            out[0][m] = vf_fmadd(vq_float(vq_sub_i32(acc[0][m], shift)), vf_mul(s0, dx), out[0][m]);
            out[1][m] = vf_fmadd(vq_float(vq_sub_i32(acc[1][m], shift)), vf_mul(s1, dx), out[1][m]);
        }
    }
}

/* 4-bit weights (0..15), per `super` inputs d and dmin (float16), per 32 a scale and a
   min (uint8): value d * sc * q - dmin * m (Q4_K: super 256; Q4_0, Q4_1: 32). */
static inline __attribute__((always_inline)) void
qcols_4(const qacts *a, int64_t m0, int64_t K, const uint8_t *wb, int64_t super, const int M,
        vf out[2][ROW_GROUP])
{
    const int64_t supers = K / super;
    const uint16_t *d = (const uint16_t *)(wb + 16 * K);  /* [K/super][32] */
    const uint16_t *dmin = d + supers * 32;                /* [K/super][32] */
    const uint8_t *sc = (const uint8_t *)(dmin + supers * 32);  /* [K/32][32] */
    const uint8_t *mins = sc + (K / 32) * 32;                    /* [K/32][32] */
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < M; m++) out[c][m] = vf_zero();
    vf d0 = vf_zero(), d1 = vf_zero(), e0 = vf_zero(), e1 = vf_zero();
    for (int64_t g = 0; g < K / 32; g++) {
        vq acc[2][QROW_GROUP];
        nibble_group(a, m0, K, g, wb, NULL, M, acc);
        if ((g * 32) % super == 0) {  /* a new super-block's d and dmin */
            const int64_t sb = g * 32 / super;
            d0 = vf_from_f16(d + sb * 32); d1 = vf_from_f16(d + sb * 32 + 16);
            e0 = vf_from_f16(dmin + sb * 32); e1 = vf_from_f16(dmin + sb * 32 + 16);
        }
        const vf s0 = vf_mul(d0, vf_from_u8(sc + g * 32)), s1 = vf_mul(d1, vf_from_u8(sc + g * 32 + 16));
        const vf n0 = vf_mul(e0, vf_from_u8(mins + g * 32)), n1 = vf_mul(e1, vf_from_u8(mins + g * 32 + 16));
        for (int m = 0; m < M; m++) {
            const int64_t row = m0 + m;
            const float dxs = a->d[row * (K / 32) + g];
            const vf dx = vf_set1(dxs);
            const vf xsum = vf_set1(dxs * (float)(a->sum16[row * (K / 16) + 2 * g]
                                                  + a->sum16[row * (K / 16) + 2 * g + 1]));
            out[0][m] = vf_fnmadd(n0, xsum, vf_fmadd(vq_float(acc[0][m]), vf_mul(s0, dx), out[0][m]));
            out[1][m] = vf_fnmadd(n1, xsum, vf_fmadd(vq_float(acc[1][m]), vf_mul(s1, dx), out[1][m]));
        }
    }
}

#if QROW_GROUP == 4
#define QDISPATCH(call) switch (M) { \
    case 1: { const int M_ = 1; call; } break; case 2: { const int M_ = 2; call; } break; \
    case 3: { const int M_ = 3; call; } break; default: { const int M_ = 4; call; } break; }
#else
#define QDISPATCH(call) switch (M) { \
    case 1: { const int M_ = 1; call; } break; default: { const int M_ = 2; call; } break; }
#endif

static void block_qcols(int64_t qtype, const qacts *a, int64_t m0, int64_t K, const uint8_t *wb,
                        int M, vf out[2][ROW_GROUP])
{
    switch (qtype) {
    case Q8_0: QDISPATCH(qcols_8(a, m0, K, wb, 128, M_, out)) break;
    case Q5_0: QDISPATCH(qcols_5(a, m0, K, wb, M_, out)) break;
    case Q6_K: QDISPATCH(qcols_6k(a, m0, K, wb, M_, out)) break;
    case Q4_K: QDISPATCH(qcols_4(a, m0, K, wb, 256, M_, out)) break;
    default: QDISPATCH(qcols_4(a, m0, K, wb, 32, M_, out)) break;
    }
}

/* ---- Many rows a call (prefill chunks, decode steps of 3 rows or more): each block
   unpacked once into plain bytes and float scales in a buffer of the thread's own, then
   every row's products read it from the cache. Inline, the 4-bit formats' nibble and
   fifth/high-bit unpacking was done again for each group of QROW_GROUP rows: Q5_0 spent
   more instructions on it than on the dot products at 2 rows. ---- */

#ifndef QWIDE_ROWS
#define QWIDE_ROWS 5  /* from this many rows a call (Q5_0: 3) */
#endif
#ifndef QWIDE_GROUP
#if SIMD16_ISA == 512
#define QWIDE_GROUP 4  /* rows the unpacked products hold at once */
#else
#define QWIDE_GROUP 3  /* 16 ymm (4 within noise of 3 here; 5 and 6 spill: 0.4-0.6x) */
#endif
#endif
_Static_assert(QWIDE_GROUP <= ROW_GROUP, "store_block takes ROW_GROUP rows");

/* A block unpacked, per half (its outputs 0-15, then 16-31) one contiguous stream:
   u [2][K/4][16][4] bytes (the format's unsigned values), s and b [2][K/sub][16] float32:
   value = s * u - b, sub 16 for Q6_K, else 32. Q8_0 keeps its own path: its bytes need
   no unpacking. */
typedef struct {
    uint8_t *u;
    float *s, *b;
    int64_t sub;
    int chunk;  /* wide_chunk */
} qwide;

static __thread uint8_t *wide_buffer;
static __thread int64_t wide_capacity;

/* This thread's buffer for a block of K inputs, or a NULL u when it cannot be had. */
static qwide wide_at(int64_t K)
{
    const int64_t u_bytes = 32 * K, scale_bytes = 2 * (K / 16) * 16 * 4, need = u_bytes + 2 * scale_bytes;
    if (wide_capacity < need) {
        free(wide_buffer);
        wide_buffer = NULL;
        wide_capacity = 0;
        void *p = NULL;
        if (posix_memalign(&p, 64, (size_t)need) == 0) { wide_buffer = p; wide_capacity = need; }
    }
    qwide w = {wide_buffer, NULL, NULL, 32, 1};
    if (wide_buffer) {
        w.s = (float *)(wide_buffer + u_bytes);
        w.b = (float *)(wide_buffer + u_bytes + scale_bytes);
    }
    return w;
}

static inline void vq_storeu(uint8_t *p, vq v)
{
#if SIMD16_ISA == 512
    _mm512_storeu_si512(p, v);
#else
    _mm256_storeu_si256((__m256i *)p, v.lo);
    _mm256_storeu_si256((__m256i *)p + 1, v.hi);
#endif
}

/* Without VNNI: a row's vpmaddubsw pair sums added in 16 bits over `chunk` steps and
   widened once (vpmaddwd), not each step: half the multiplies. Exact while the chunk's
   sum fits: |x| <= 127, so 2 * 127 * max(u) * chunk <= 32767 -- 8 steps for 4-bit
   values, 4 for Q5_0's 5 bits, 2 for Q6_K's 6. */
#if SIMD16_ISA == 512
static inline vq vq_pairs16(vq u, vq s) { return _mm512_maddubs_epi16(u, s); }
static inline vq vq_add16(vq a, vq b) { return _mm512_add_epi16(a, b); }
static inline vq vq_widen(vq acc, vq v) { return _mm512_add_epi32(acc, _mm512_madd_epi16(v, _mm512_set1_epi16(1))); }
#else
static inline vq vq_pairs16(vq u, vq s) { return (vq){_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi)}; }
static inline vq vq_add16(vq a, vq b) { return (vq){_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
static inline vq vq_widen(vq acc, vq v) {
    const __m256i one = _mm256_set1_epi16(1);
    return (vq){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(v.lo, one)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(v.hi, one))};
}
#endif

/* v held in registers here: without it GCC computed a chunk's products first and summed
   them in a tree, spilling most of them (Q4_K products of 32 and 512 rows, 2 threads,
   AVX2: 1.3-1.4x with it) */
#if SIMD16_ISA == 512
#define VQ_KEEP(v) __asm__("" : "+v"(v))
#else
#define VQ_KEEP(v) __asm__("" : "+x"((v).lo), "+x"((v).hi))
#endif

/* Steps a wide product sums in 16 bits before widening (1: none) */
static inline int wide_chunk(int64_t qtype)
{
    if (Q_VNNI) return 1;
    return qtype == Q6_K ? 2 : qtype == Q5_0 ? 4 : 8;
}

/* Step t (inputs 4t..4t+3) of u: its 16 outputs of half h. */
static inline uint8_t *wide_step(const qwide *w, int64_t K, int h, int64_t t)
{
    return w->u + h * 16 * K + t * 64;
}

/* A decoded step of 8 inputs (nibble_step's order) into u: steps 2*t8 and 2*t8 + 1. */
static inline void store_step(const qwide *w, int64_t K, int64_t t8, const vq v[4])
{
    vq_storeu(wide_step(w, K, 0, 2 * t8), v[0]);
    vq_storeu(wide_step(w, K, 0, 2 * t8 + 1), v[1]);
    vq_storeu(wide_step(w, K, 1, 2 * t8), v[2]);
    vq_storeu(wide_step(w, K, 1, 2 * t8 + 1), v[3]);
}

/* Block wb of qtype (K inputs, not Q8_0) into w. */
static void unpack_block(int64_t qtype, const uint8_t *wb, int64_t K, qwide *w)
{
    w->sub = qtype == Q6_K ? 16 : 32;
    w->chunk = wide_chunk(qtype);
    const int64_t groups = K / w->sub;
    float *s0 = w->s, *s1 = w->s + groups * 16, *b0 = w->b, *b1 = w->b + groups * 16;
    if (qtype == Q6_K) {
        const uint16_t *d = (const uint16_t *)(wb + 24 * K);
        const int8_t *sc = (const int8_t *)(wb + 24 * K + (K / 256) * 64);
        for (int64_t t8 = 0; t8 < K / 8; t8++) {
            vq v[4];
            q6_step(wb + t8 * 192, v);
            store_step(w, K, t8, v);
        }
        for (int64_t g = 0; g < groups; g++) {
            const vf dd0 = vf_from_f16(d + (g / 16) * 32), dd1 = vf_from_f16(d + (g / 16) * 32 + 16);
            const vf a0 = vf_mul(dd0, vf_from_i8(sc + g * 32)), a1 = vf_mul(dd1, vf_from_i8(sc + g * 32 + 16));
            vf_storeu(s0 + g * 16, a0);
            vf_storeu(s1 + g * 16, a1);
            vf_storeu(b0 + g * 16, vf_mul(a0, vf_set1(32.0f)));
            vf_storeu(b1 + g * 16, vf_mul(a1, vf_set1(32.0f)));
        }
        return;
    }
    /* the 4-bit formats and Q5_0: nibbles (and Q5_0's fifth bits) */
    const uint64_t *fifth = qtype == Q5_0 ? (const uint64_t *)(wb + 16 * K) : NULL;
    for (int64_t t8 = 0; t8 < K / 8; t8++) {
        vq v[4];
        nibble_step(wb + t8 * 128, fifth ? fifth + t8 * 4 : NULL, v);
        store_step(w, K, t8, v);
    }
    if (qtype == Q5_0) {
        const uint16_t *d = (const uint16_t *)(wb + 20 * K);
        for (int64_t g = 0; g < groups; g++) {
            const vf a0 = vf_from_f16(d + g * 32), a1 = vf_from_f16(d + g * 32 + 16);
            vf_storeu(s0 + g * 16, a0);
            vf_storeu(s1 + g * 16, a1);
            vf_storeu(b0 + g * 16, vf_mul(a0, vf_set1(16.0f)));
            vf_storeu(b1 + g * 16, vf_mul(a1, vf_set1(16.0f)));
        }
        return;
    }
    const int64_t super = qtype == Q4_K ? 256 : 32, supers = K / super;
    const uint16_t *d = (const uint16_t *)(wb + 16 * K), *dmin = d + supers * 32;
    const uint8_t *sc = (const uint8_t *)(dmin + supers * 32), *mins = sc + (K / 32) * 32;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t sb = g * 32 / super;
        vf_storeu(s0 + g * 16, vf_mul(vf_from_f16(d + sb * 32), vf_from_u8(sc + g * 32)));
        vf_storeu(s1 + g * 16, vf_mul(vf_from_f16(d + sb * 32 + 16), vf_from_u8(sc + g * 32 + 16)));
        vf_storeu(b0 + g * 16, vf_mul(vf_from_f16(dmin + sb * 32), vf_from_u8(mins + g * 32)));
        vf_storeu(b1 + g * 16, vf_mul(vf_from_f16(dmin + sb * 32 + 16), vf_from_u8(mins + g * 32 + 16)));
    }
}

/* Half h of an unpacked block for M (<= QWIDE_GROUP) rows from row m0: out[m]. */
static inline __attribute__((always_inline)) void
wide_cols(const qacts *a, int64_t m0, int64_t K, const qwide *w, int h, const int sub,
          const int chunk, const int M, vf out[QWIDE_GROUP])
{
    const int64_t groups = K / sub;
    const float *s = w->s + h * groups * 16, *b = w->b + h * groups * 16;
    for (int m = 0; m < M; m++) out[m] = vf_zero();
    for (int64_t g = 0; g < groups; g++) {
        vq acc[QWIDE_GROUP];
        for (int m = 0; m < M; m++) acc[m] = vq_zero();
        const uint8_t *u = wide_step(w, K, h, g * sub / 4);
        if (chunk == 1) {
            for (int step = 0; step < sub / 4; step++) {
                const vq wv = vq_load(u + step * 64);
                for (int m = 0; m < M; m++) {
                    const vq xb = vq_bcast(a->q + (m0 + m) * K + g * sub + step * 4);
                    acc[m] = vq_dot(acc[m], wv, xb);
                }
            }
        } else {
            for (int c0 = 0; c0 < sub / 4; c0 += chunk) {
                vq part[QWIDE_GROUP];
                for (int step = c0; step < c0 + chunk; step++) {
                    const vq wv = vq_load(u + step * 64);
                    for (int m = 0; m < M; m++) {
                        const vq p = vq_pairs16(wv, vq_bcast(a->q + (m0 + m) * K + g * sub + step * 4));
                        part[m] = step == c0 ? p : vq_add16(part[m], p);
                        VQ_KEEP(part[m]);
                    }
                }
                for (int m = 0; m < M; m++) acc[m] = vq_widen(acc[m], part[m]);
            }
        }
        const vf sg = vf_loadu(s + g * 16);
        for (int m = 0; m < M; m++) {
            const int64_t row = m0 + m;
            const float dx = a->d[row * (K / 32) + g * sub / 32];
            out[m] = vf_fmadd(vq_float(acc[m]), vf_mul(sg, vf_set1(dx)), out[m]);
            const float xs = sub == 16 ? a->xsum16[row * (K / 16) + g] : a->xsum32[row * (K / 32) + g];
            out[m] = vf_fnmadd(vf_loadu(b + g * 16), vf_set1(xs), out[m]);
        }
    }
}

#if QWIDE_GROUP == 4
#define QWDISPATCH(call) switch (M) { \
    case 1: { const int M_ = 1; call; } break; case 2: { const int M_ = 2; call; } break; \
    case 3: { const int M_ = 3; call; } break; default: { const int M_ = 4; call; } break; }
#elif QWIDE_GROUP == 3
#define QWDISPATCH(call) switch (M) { \
    case 1: { const int M_ = 1; call; } break; case 2: { const int M_ = 2; call; } break; \
    default: { const int M_ = 3; call; } break; }
#else
#define QWDISPATCH(call) switch (M) { \
    case 1: { const int M_ = 1; call; } break; default: { const int M_ = 2; call; } break; }
#endif

/* An unpacked block's 32 outputs for M (<= QWIDE_GROUP) rows from row m0. */
static void wide_block(const qacts *a, int64_t m0, int64_t K, const qwide *w, int M,
                       vf out[2][ROW_GROUP])
{
    for (int h = 0; h < 2; h++) {
        vf half[QWIDE_GROUP];
        switch (w->chunk) {  /* the formats' kernels */
        case 2: QWDISPATCH(wide_cols(a, m0, K, w, h, 16, 2, M_, half)) break;
        case 4: QWDISPATCH(wide_cols(a, m0, K, w, h, 32, 4, M_, half)) break;
        case 8: QWDISPATCH(wide_cols(a, m0, K, w, h, 32, 8, M_, half)) break;
        default:  /* VNNI */
            if (w->sub == 16) { QWDISPATCH(wide_cols(a, m0, K, w, h, 16, 1, M_, half)) }
            else { QWDISPATCH(wide_cols(a, m0, K, w, h, 32, 1, M_, half)) }
        }
        for (int m = 0; m < M; m++) out[h][m] = half[m];
    }
}

/* Bytes of one 32-row block of a K-input projection stored as qtype. */
static inline int64_t qblock_bytes(int64_t qtype, int64_t K)
{
    switch (qtype) {
    case Q8_0: return 32 * K + (K / 32) * 64;
    case Q5_0: return 16 * K + 4 * K + (K / 32) * 64;
    case Q6_K: return 24 * K + (K / 256) * 64 + (K / 16) * 32;
    case Q4_K: return 16 * K + (K / 256) * 128 + (K / 32) * 64;
    case Q4_32: return 16 * K + (K / 32) * 128 + (K / 32) * 64;
    default: return 0;
    }
}

/* Whether a K-input projection can be stored as qtype. */
static inline int qtype_fits(int64_t qtype, int64_t K)
{
    if (qtype == Q6_K || qtype == Q4_K) return K > 0 && K % 256 == 0;
    return K > 0 && K % 32 == 0;
}

/* As `project` for quantized weights: x's rows quantized into scratch, then the blocks. */
static void qproject(const sluice_proj *p, const void *x, int M, void *y, void *residual,
                     int bf16, int y_f32, void *scratch)
{
    const int64_t K = p->in_features, N = p->out_features, bytes = qblock_bytes(p->qtype, K);
    /* Up to PRIVATE_ROWS rows each thread quantizes all of x itself, on its stack: a few
       hundred values a row, where sharing them out would cost a barrier per product
       (five a layer) */
    int8_t own_q[PRIVATE_ROWS * PRIVATE_WIDTH] __attribute__((aligned(64)));
    float own_d[PRIVATE_ROWS * PRIVATE_WIDTH / 32];
    int32_t own_sums[PRIVATE_ROWS * PRIVATE_WIDTH / 16];
    qacts a;
    if (M <= PRIVATE_ROWS && K <= PRIVATE_WIDTH) {
        a.q = own_q; a.d = own_d; a.sum16 = own_sums; a.xsum16 = a.xsum32 = NULL;
        for (int m = 0; m < M; m++)
            for (int64_t g = 0; g < K / 32; g++) quantize_group(x, m, g, K, bf16, a);
    } else {
        a = qacts_at(scratch, M, K);
        quantize_acts(x, M, K, bf16, a);  /* a barrier after */
    }
    int64_t first, count;
    thread_part((N + COLS - 1) / COLS, &first, &count);
    qwide wide = {NULL, NULL, NULL, 32, 1};
    if (a.xsum16 && (M >= QWIDE_ROWS || (M >= 3 && p->qtype == Q5_0))) wide = wide_at(K);
    for (int64_t blk = first; blk < first + count; blk++) {
        const int64_t qtype = p->block_qtypes ? p->block_qtypes[blk] : p->qtype;
        const int64_t at = p->block_offsets ? p->block_offsets[blk] : blk * bytes;
        if (wide.u && qtype != Q8_0) {  /* Q8_0: nothing to unpack */
            unpack_block(qtype, (const uint8_t *)p->weight + at, K, &wide);
            for (int m0 = 0; m0 < M; m0 += QWIDE_GROUP) {
                const int rows = M - m0 < QWIDE_GROUP ? M - m0 : QWIDE_GROUP;
                vf acc[2][ROW_GROUP];
                wide_block(&a, m0, K, &wide, rows, acc);
                store_block(p, acc, m0, rows, blk * COLS, y, residual, bf16, y_f32);
            }
            continue;
        }
        for (int m0 = 0; m0 < M; m0 += QROW_GROUP) {
            const int rows = M - m0 < QROW_GROUP ? M - m0 : QROW_GROUP;
            vf acc[2][ROW_GROUP];
            block_qcols(qtype, &a, m0, K, (const uint8_t *)p->weight + at, rows, acc);
            store_block(p, acc, m0, rows, blk * COLS, y, residual, bf16, y_f32);
        }
    }
    #pragma omp barrier
}

static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

/* Row r of a quantized projection's weight as float32 [K] (the embedding's lookup). */
static void dequantize_row(const sluice_proj *p, int64_t r, float *out)
{
    const int64_t K = p->in_features, blk = r / COLS, j = r % COLS;
    const uint8_t *wb = (const uint8_t *)p->weight + blk * qblock_bytes(p->qtype, K);
    if (p->qtype == Q5_0) {
        const uint64_t *fifth = (const uint64_t *)(wb + 16 * K);
        const uint16_t *d = (const uint16_t *)(wb + 20 * K);
        for (int64_t k = 0; k < K; k++) {
            const uint8_t byte = wb[(k / 8) * 128 + j * 4 + k % 4];
            const int nibble_high = k % 8 >= 4;
            const uint64_t mask = fifth[(k / 8) * 4 + (j / 16) * 2 + nibble_high];
            const int q = (nibble_high ? byte >> 4 : byte & 15) | (int)((mask >> ((j % 16) * 4 + k % 4)) & 1) << 4;
            out[k] = f16_to_f32(d[(k / 32) * 32 + j]) * (float)(q - 16);
        }
        return;
    }
    if (p->qtype == Q8_0) {
        const uint16_t *d = (const uint16_t *)(wb + 32 * K);
        for (int64_t k = 0; k < K; k++)
            out[k] = f16_to_f32(d[(k / 32) * 32 + j]) * (float)((int)wb[(k / 4) * 128 + j * 4 + k % 4] - 128);
        return;
    }
    if (p->qtype == Q6_K) {
        const uint16_t *d = (const uint16_t *)(wb + 24 * K);
        const int8_t *sc = (const int8_t *)(wb + 24 * K + (K / 256) * 64);
        for (int64_t k = 0; k < K; k++) {
            const uint8_t *step = wb + (k / 8) * 192;
            const int nibble_high = k % 8 >= 4;
            const uint8_t byte = step[j * 4 + k % 4];
            const int pair = (step[128 + (j % 16) * 4 + k % 4] >> (2 * nibble_high + 4 * (j / 16))) & 3;
            const int q = (nibble_high ? byte >> 4 : byte & 15) | pair << 4;
            out[k] = f16_to_f32(d[(k / 256) * 32 + j]) * (float)sc[(k / 16) * 32 + j] * (float)(q - 32);
        }
        return;
    }
    const int64_t super = p->qtype == Q4_K ? 256 : 32, supers = K / super;
    const uint16_t *d = (const uint16_t *)(wb + 16 * K), *dmin = d + supers * 32;
    const uint8_t *sc = (const uint8_t *)(dmin + supers * 32), *mins = sc + (K / 32) * 32;
    for (int64_t k = 0; k < K; k++) {
        const uint8_t byte = wb[(k / 8) * 128 + j * 4 + k % 4];
        const int q = k % 8 < 4 ? byte & 15 : byte >> 4;
        const int64_t sb = k / super, g = k / 32;
        out[k] = f16_to_f32(d[sb * 32 + j]) * (float)sc[g * 32 + j] * (float)q
                 - f16_to_f32(dmin[sb * 32 + j]) * (float)mins[g * 32 + j];
    }
}

/* ---- the layout, made at load (quantized.pack is the same in numpy, the tests'
   reference): from a weight's values q [N][K] (the format's values as Unpacked holds
   them) and its scales, rows past N zero ---- */

static inline uint8_t q_at(const uint8_t *q, int64_t N, int64_t K, int64_t n, int64_t k)
{
    return n < N ? q[n * K + k] : 0;
}

/* per-row values [N][G] (elem bytes each) -> [G][32] of block blk */
static void pack_scales(uint8_t *o, const uint8_t *src, int64_t elem, int64_t G, int64_t N, int64_t blk)
{
    for (int64_t g = 0; g < G; g++)
        for (int64_t r = 0; r < COLS; r++) {
            const int64_t n = blk * COLS + r;
            for (int64_t b = 0; b < elem; b++)
                o[(g * COLS + r) * elem + b] = n < N ? src[(n * G + g) * elem + b] : 0;
        }
}

static void pack_block(int64_t qtype, int64_t N, int64_t K, const uint8_t *q, const uint8_t *d,
                       const uint8_t *dmin, const uint8_t *sc, const uint8_t *mins, int64_t blk,
                       uint8_t *o)
{
    if (qtype == Q8_0) {
        for (int64_t r = 0; r < COLS; r++)
            for (int64_t k = 0; k < K; k++) o[(k / 4) * 128 + r * 4 + k % 4] = q_at(q, N, K, blk * COLS + r, k);
        pack_scales(o + 32 * K, d, 2, K / 32, N, blk);
        return;
    }
    const int64_t stride = qtype == Q6_K ? 192 : 128;  /* bytes a step of 8 inputs */
    for (int64_t r = 0; r < COLS; r++) {
        const int64_t n = blk * COLS + r;
        for (int64_t s = 0; s < K / 8; s++)
            for (int64_t j = 0; j < 4; j++)
                o[s * stride + r * 4 + j] = (uint8_t)((q_at(q, N, K, n, 8 * s + j) & 15)
                                                      | (q_at(q, N, K, n, 8 * s + 4 + j) & 15) << 4);
    }
    if (qtype == Q5_0) {
        uint64_t *fifth = (uint64_t *)(o + 16 * K);  /* [K/8][2 row halves][2 nibbles] */
        for (int64_t s = 0; s < K / 8; s++)
            for (int64_t h = 0; h < 2; h++)
                for (int64_t half = 0; half < 2; half++) {
                    uint64_t mask = 0;
                    for (int64_t i = 0; i < 64; i++) {
                        const int64_t n = blk * COLS + h * 16 + i / 4;
                        mask |= (uint64_t)((q_at(q, N, K, n, 8 * s + 4 * half + i % 4) >> 4) & 1) << i;
                    }
                    fifth[s * 4 + h * 2 + half] = mask;
                }
        pack_scales(o + 20 * K, d, 2, K / 32, N, blk);
        return;
    }
    if (qtype == Q6_K) {
        for (int64_t s = 0; s < K / 8; s++)
            for (int64_t b = 0; b < 64; b++) {
                const int64_t n = blk * COLS + b / 4, k = 8 * s + b % 4;
                o[s * 192 + 128 + b] = (uint8_t)(((q_at(q, N, K, n, k) >> 4) & 3)
                                                 | ((q_at(q, N, K, n, k + 4) >> 4) & 3) << 2
                                                 | ((q_at(q, N, K, n + 16, k) >> 4) & 3) << 4
                                                 | ((q_at(q, N, K, n + 16, k + 4) >> 4) & 3) << 6);
            }
        pack_scales(o + 24 * K, d, 2, K / 256, N, blk);
        pack_scales(o + 24 * K + (K / 256) * 64, sc, 1, K / 16, N, blk);
        return;
    }
    const int64_t supers = K / (qtype == Q4_K ? 256 : 32);
    pack_scales(o + 16 * K, d, 2, supers, N, blk);
    pack_scales(o + 16 * K + supers * 64, dmin, 2, supers, N, blk);
    pack_scales(o + 16 * K + supers * 128, sc, 1, K / 32, N, blk);
    pack_scales(o + 16 * K + supers * 128 + (K / 32) * 32, mins, 1, K / 32, N, blk);
}
