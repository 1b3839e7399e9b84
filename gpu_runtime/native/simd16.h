/* Vectors of 16 float32 (or int32) lanes for the native kernels, on two instruction sets.

   Built with AVX-512F (cpu_attention.py passes -mavx512f and friends where the CPU
   has it): `vf` is one zmm register and every operation below is the one AVX-512
   intrinsic of the same meaning, so that build is the code it was before this header.
   Built with AVX2 and FMA only (most AMD EPYC before Zen 4, Intel before Skylake-SP):
   `vf` is a pair of ymm registers and each operation is done on both halves; masks
   stay 16 bits (bit i: lane i), turned into lane masks where an AVX2 operation needs
   one. GCC keeps such pairs in registers (a 64-byte GCC vector type without AVX-512
   went through the stack at every operation: checked in its assembly).

   bfloat16 rows are read and written here too (the KV cache and activations of a
   bfloat16 model); the bfloat16 products (AVX512-BF16) stay in decode_layers.c, in
   the AVX-512 build only. */

#ifndef SLUICE_SIMD16_H
#define SLUICE_SIMD16_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t vmask;  /* bit i: lane i */

static inline vmask first_n(int64_t n) { return n >= 16 ? (vmask)0xffff : (vmask)((1u << n) - 1); }

#ifdef __AVX512F__

#define SIMD16_ISA 512
typedef __m512 vf;
typedef __m512i vi;

static inline vf vf_set1(float s) { return _mm512_set1_ps(s); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_load(const float *p) { return _mm512_load_ps(p); }
static inline void vf_storeu(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline void vf_store(float *p, vf v) { _mm512_store_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a b + c */
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a b */
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_scalef(vf a, vf n) { return _mm512_scalef_ps(a, n); }  /* a 2^n, n integral */
static inline float vf_reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vf_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
/* lanes in k from a, the others from src */
static inline vf vf_blend(vf src, vmask k, vf a) { return _mm512_mask_mov_ps(src, k, a); }
static inline vf vf_maskz(vmask k, vf a) { return _mm512_maskz_mov_ps(k, a); }
static inline vf vf_mask_max(vf src, vmask k, vf a, vf b) { return _mm512_mask_max_ps(src, k, a, b); }
static inline vf vf_maskz_loadu(vmask k, const float *p) { return _mm512_maskz_loadu_ps(k, p); }
static inline vf vf_mask_loadu(vf src, vmask k, const float *p) { return _mm512_mask_loadu_ps(src, k, p); }
static inline void vf_mask_storeu(float *p, vmask k, vf v) { _mm512_mask_storeu_ps(p, k, v); }
static inline vmask vf_cmpgt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline vmask vf_cmpeq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline vmask vf_isnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }

static inline vi vi_set1(int32_t s) { return _mm512_set1_epi32(s); }
static inline vi vi_loadu(const int32_t *p) { return _mm512_loadu_si512(p); }
static inline vi vi_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_blend(vi src, vmask k, vi a) { return _mm512_mask_mov_epi32(src, k, a); }
static inline vmask vi_cmple(vi a, vi b) { return _mm512_cmple_epi32_mask(a, b); }
static inline vmask vi_cmpge(vi a, vi b) { return _mm512_cmpge_epi32_mask(a, b); }
static inline int32_t vi_mask_reduce_min(vmask k, vi a) { return _mm512_mask_reduce_min_epi32(k, a); }

/* 16 bfloat16 as float32 (exact) */
static inline vf vf_from_bf16(const void *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf vf_maskz_from_bf16(vmask k, const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
/* float32 bits rounded to nearest even at bfloat16 precision (in the upper half), as
   torch's float -> bfloat16 (NaN is not expected here) */
static inline __m512i rne_bits(vf v) {
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}
static inline vf vf_round_bf16(vf v) {
    return _mm512_castsi512_ps(_mm512_and_si512(rne_bits(v), _mm512_set1_epi32((int)0xffff0000u)));
}
static inline __m256i to_bf16_bits(vf v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rne_bits(v), 16)); }
static inline void vf_store_bf16(void *p, vf v) { _mm256_storeu_si256((__m256i *)p, to_bf16_bits(v)); }
static inline void vf_mask_store_bf16(void *p, vmask k, vf v) { _mm256_mask_storeu_epi16(p, k, to_bf16_bits(v)); }

/* lane j: the sum of v[j]'s 16 lanes (16 horizontal sums in 45 operations, not 128) */
static inline vf vf_sum16(const vf v[16]) {
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

#elif defined(__AVX2__) && defined(__FMA__)

#define SIMD16_ISA 256
typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256i lo, hi; } vi;

#define VF2(op, a, b) ((vf){op((a).lo, (b).lo), op((a).hi, (b).hi)})

static inline vf vf_set1(float s) { const __m256 v = _mm256_set1_ps(s); return (vf){v, v}; }
static inline vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vf_loadu(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline vf vf_load(const float *p) { return (vf){_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
static inline void vf_storeu(float *p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline void vf_store(float *p, vf v) { _mm256_store_ps(p, v.lo); _mm256_store_ps(p + 8, v.hi); }
static inline vf vf_add(vf a, vf b) { return VF2(_mm256_add_ps, a, b); }
static inline vf vf_sub(vf a, vf b) { return VF2(_mm256_sub_ps, a, b); }
static inline vf vf_mul(vf a, vf b) { return VF2(_mm256_mul_ps, a, b); }
static inline vf vf_div(vf a, vf b) { return VF2(_mm256_div_ps, a, b); }
static inline vf vf_max(vf a, vf b) { return VF2(_mm256_max_ps, a, b); }
static inline vf vf_min(vf a, vf b) { return VF2(_mm256_min_ps, a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) {
    return (vf){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf vf_fnmadd(vf a, vf b, vf c) {
    return (vf){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf vf_round(vf a) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return (vf){_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
/* a 2^n for integral n in [-150, 128] (exp16's range): two exact powers of two, each
   a normal float, as 2^n itself is not for every such n */
static inline __m256 scalef8(__m256 a, __m256 n) {
    const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}
static inline vf vf_scalef(vf a, vf n) { return (vf){scalef8(a.lo, n.lo), scalef8(a.hi, n.hi)}; }
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
/* the lane sums' order differs from AVX-512's tree: the same values up to rounding */
static inline float vf_reduce_add(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
static inline float vf_reduce_max(vf a) { return hmax8(_mm256_max_ps(a.lo, a.hi)); }

/* bits 0-7 (lo) and 8-15 (hi) of k as lane masks (all ones where set) */
static inline __m256i lanes8(unsigned bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}
static inline vmask bits8(__m256 lanes_lo, __m256 lanes_hi) {
    return (vmask)((unsigned)_mm256_movemask_ps(lanes_lo) | ((unsigned)_mm256_movemask_ps(lanes_hi) << 8));
}
static inline vf vf_blend(vf src, vmask k, vf a) {
    return (vf){_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(lanes8(k & 0xff))),
                _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(lanes8(k >> 8)))};
}
static inline vf vf_maskz(vmask k, vf a) {
    return (vf){_mm256_and_ps(a.lo, _mm256_castsi256_ps(lanes8(k & 0xff))),
                _mm256_and_ps(a.hi, _mm256_castsi256_ps(lanes8(k >> 8)))};
}
static inline vf vf_mask_max(vf src, vmask k, vf a, vf b) { return vf_blend(src, k, vf_max(a, b)); }
/* masked-off lanes are not read (vmaskmovps does not fault on them). A whole half is a
   plain move: AMD runs vmaskmovps as microcode, its stores the slowest (a Zen 3 EPYC:
   7 % of a decode step of 32 rows on quantized weights was the products' stores) */
static inline __m256 maskz_load8(unsigned bits, const float *p) {
    return bits == 0xff ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(bits));
}
static inline void mask_store8(float *p, unsigned bits, __m256 v) {
    if (bits == 0xff) _mm256_storeu_ps(p, v);
    else if (bits) _mm256_maskstore_ps(p, lanes8(bits), v);
}
static inline vf vf_maskz_loadu(vmask k, const float *p) {
    return (vf){maskz_load8(k & 0xff, p), maskz_load8((k >> 8) & 0xff, p + 8)};
}
static inline vf vf_mask_loadu(vf src, vmask k, const float *p) { return vf_blend(src, k, vf_maskz_loadu(k, p)); }
static inline void vf_mask_storeu(float *p, vmask k, vf v) {
    mask_store8(p, k & 0xff, v.lo);
    mask_store8(p + 8, (k >> 8) & 0xff, v.hi);
}
static inline vmask vf_cmpgt(vf a, vf b) {
    return bits8(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ));
}
static inline vmask vf_cmpeq(vf a, vf b) {
    return bits8(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ));
}
static inline vmask vf_isnan(vf a) {
    return bits8(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q));
}

static inline vi vi_set1(int32_t s) { const __m256i v = _mm256_set1_epi32(s); return (vi){v, v}; }
static inline vi vi_loadu(const int32_t *p) {
    return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 8))};
}
static inline vi vi_iota(void) {
    return (vi){_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
}
static inline vi vi_add(vi a, vi b) { return (vi){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
static inline vi vi_blend(vi src, vmask k, vi a) {
    return (vi){_mm256_blendv_epi8(src.lo, a.lo, lanes8(k & 0xff)), _mm256_blendv_epi8(src.hi, a.hi, lanes8(k >> 8))};
}
static inline vmask vi_cmple(vi a, vi b) {  /* a <= b: not a > b */
    return (vmask)~bits8(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a.lo, b.lo)),
                         _mm256_castsi256_ps(_mm256_cmpgt_epi32(a.hi, b.hi)));
}
static inline vmask vi_cmpge(vi a, vi b) { return vi_cmple(b, a); }
static inline int32_t vi_mask_reduce_min(vmask k, vi a) {
    int32_t lanes[16], best = INT32_MAX;
    _mm256_storeu_si256((__m256i *)lanes, a.lo);
    _mm256_storeu_si256((__m256i *)(lanes + 8), a.hi);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1 && lanes[i] < best) best = lanes[i];
    return best;
}

static inline __m256 bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vf_from_bf16(const void *p) {
    return (vf){bf16x8_to_f32(_mm_loadu_si128((const __m128i *)p)),
                bf16x8_to_f32(_mm_loadu_si128((const __m128i *)p + 1))};
}
static inline vf vf_maskz_from_bf16(vmask k, const void *p) {  /* no 16-bit masked load: by lanes */
    uint16_t h[16] = {0};
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy(h + i, (const uint16_t *)p + i, 2);
    return vf_from_bf16(h);
}
/* float32 bits rounded to nearest even at bfloat16 precision (in the upper half), as
   torch's float -> bfloat16 (NaN is not expected here) */
static inline __m256i rne_bits8(__m256 v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}
static inline __m256 round8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_and_si256(rne_bits8(v), _mm256_set1_epi32((int)0xffff0000u)));
}
static inline vf vf_round_bf16(vf v) { return (vf){round8(v.lo), round8(v.hi)}; }
static inline __m256i to_bf16_bits(vf v) {  /* 16 bfloat16, in order */
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(rne_bits8(v.lo), 16),
                                               _mm256_srli_epi32(rne_bits8(v.hi), 16));
    return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));  /* packus works per 128 bits */
}
static inline void vf_store_bf16(void *p, vf v) { _mm256_storeu_si256((__m256i *)p, to_bf16_bits(v)); }
static inline void vf_mask_store_bf16(void *p, vmask k, vf v) {
    uint16_t h[16];
    _mm256_storeu_si256((__m256i *)h, to_bf16_bits(v));
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy((uint16_t *)p + i, h + i, 2);
}

/* lanes 0-7: the sums of v[0..7]'s lanes (pairs added by hadd, halves by one permute) */
static inline __m256 sum8x8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
/* lane j: the sum of v[j]'s 16 lanes */
static inline vf vf_sum16(const vf v[16]) {
    __m256 lo[8], hi[8];
    for (int i = 0; i < 8; i++) {
        lo[i] = _mm256_add_ps(v[i].lo, v[i].hi);
        hi[i] = _mm256_add_ps(v[8 + i].lo, v[8 + i].hi);
    }
    return (vf){sum8x8(lo), sum8x8(hi)};
}

#else
#error "the native kernels need AVX-512F, or AVX2 and FMA"
#endif

#endif
