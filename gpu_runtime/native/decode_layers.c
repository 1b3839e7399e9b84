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

   Values are rounded where the torch path rounds them (each product's output, the
   residual sums, RoPE's products and sum, SiLU and its product with up), so
   bfloat16 runs stay within the torch path's own rounding. The products (weights
   blocked for this kernel, shared out between threads) are decode_products.c, the
   attention decode_attention.c: one translation unit, so every phase inlines into the
   one region. Loaded by gpu_runtime/cpu_decode.py. */

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

#include "decode_products.c"  /* after ROW_GROUP and SPLIT_ROWS: it reads them */
#include "decode_quant.c"     /* after decode_products.c: it reads COLS and store_block */

/* y = x W^T + b on float or quantized weights (see project and qproject). */
static void product(const sluice_proj *p, const void *x, int M, void *y, void *residual, int bf16,
                    int y_f32, void *qscratch)
{
    if (p->qtype) qproject(p, x, M, y, residual, bf16, y_f32, qscratch);
    else project(p, x, M, y, residual, bf16, y_f32);
}

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
    sluice_proj embed_q;     /* qtype 0: `embed` holds the rows; else the quantized table */
    void *qscratch;          /* quantized input rows: sluice_quant_scratch_bytes */
} sluice_model;

/* ---- the elementwise phases, 16 values a vector (tails masked) ---- */

/* RMSNorm of row m, as layers.RMSNorm: float32 normalisation, then (bf16) the weight
   times the normalised row rounded to bf16. */
static void rms_norm_row(const void *x, const void *weight, void *out, int m, int64_t dim,
                         float eps, int bf16)
{
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

/* Every row's RMSNorm, the rows shared out between the region's threads (no barrier). */
static void rms_norm(const void *x, const void *weight, void *out, int M, int64_t dim, float eps,
                     int bf16)
{
    #pragma omp for schedule(static) nowait
    for (int m = 0; m < M; m++) rms_norm_row(x, weight, out, m, dim, eps, bf16);
}

/* Steps of up to OWN_NORM_ROWS rows (of up to OWN_NORM_WIDTH values): each thread
   normalises every row itself into its own buffer, which the product after reads:
   no barrier between the two (two of a layer's nine; ~2.2 us each on a 2-vCPU VM,
   where one thread did the row while the other waited anyway). */
#ifndef OWN_NORM_ROWS
#define OWN_NORM_ROWS 2
#endif
#define OWN_NORM_WIDTH 8192

/* The RMSNorm before product p into out, ready for it: each thread's own rows
   (own_norm: out is the thread's buffer), or the rows shared out and a barrier. */
static void norm_for(const sluice_proj *p, const void *x, const void *weight, void *out, int M,
                     int64_t dim, float eps, int bf16, int own_norm)
{
    if (own_norm) {
        for (int m = 0; m < M; m++) rms_norm_row(x, weight, out, m, dim, eps, bf16);
        prefetch_share(p, bf16);
        return;
    }
    rms_norm(x, weight, out, M, dim, eps, bf16);
    prefetch_share(p, bf16);
    #pragma omp barrier
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
    for (int m = 0; m < rows; m++) {  /* the embedding: the residual stream starts as its rows */
        if (md->embed_q.qtype) {
            float row[hidden];
            dequantize_row(&md->embed_q, token_ids[m], row);
            for (int64_t i = 0; i < hidden; i += 16)
                store16m(elem(x, m * hidden + i, bf16), first_n(hidden - i),
                         vf_maskz_loadu(first_n(hidden - i), row + i), bf16);
        } else {
            memcpy((char *)x + m * hidden * esize, (const char *)md->embed + token_ids[m] * hidden * esize,
                   hidden * esize);
        }
    }
    char *h = (char *)work;  /* [rows, hidden] */
    char *qkv = h + rows * hidden * esize;  /* [rows, (H + 2 nkv) D] */
    char *attn = qkv + rows * qkv_size * esize;  /* [rows, H D] */
    char *gate_up = attn + rows * H * D * esize;  /* [rows, 2 inter] */
    char *act = gate_up + rows * 2 * inter * esize;  /* [rows, inter] */
    int failed = 0;

    const int own_norm = rows <= OWN_NORM_ROWS && hidden <= OWN_NORM_WIDTH;
    #pragma omp parallel num_threads(num_threads)
    {
    float own_rows[OWN_NORM_ROWS * OWN_NORM_WIDTH] __attribute__((aligned(64)));
    void *hn = own_norm ? (void *)own_rows : (void *)h;  /* the normalised rows' home */
    for (int64_t l = 0; l < md->num_layers; l++) {
        const sluice_layer *ly = layers + l;
        norm_for(&ly->qkv, x, ly->norm1, hn, rows, hidden, md->eps, bf16, own_norm);
        product(&ly->qkv, hn, rows, qkv, NULL, bf16, 0, md->qscratch);
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
        product(&ly->o, attn, rows, NULL, x, bf16, 0, md->qscratch);
        norm_for(&ly->gate_up, x, ly->norm2, hn, rows, hidden, md->eps, bf16, own_norm);
        product(&ly->gate_up, hn, rows, gate_up, NULL, bf16, 0, md->qscratch);
        silu_mul(gate_up, act, rows, inter, bf16);
        prefetch_share(&ly->down, bf16);
        #pragma omp barrier
        product(&ly->down, act, rows, NULL, x, bf16, 0, md->qscratch);
    }
    rms_norm(x, md->final_norm, out, rows, hidden, md->eps, bf16);
    if (logits != NULL) {  /* every row sampled (a decode step's): the LM head in this region */
        prefetch_share(&md->lm_head, bf16);
        #pragma omp barrier
        product(&md->lm_head, out, rows, logits, NULL, bf16, 1, md->qscratch);  /* a barrier after */
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
                   int num_threads, void *qscratch)
{
    if (rows < 1 || rows > MAX_ROWS || (bf16 && !BF16_PRODUCTS)) return -1;
    #pragma omp parallel num_threads(num_threads)
    product(p, x, rows, y, NULL, bf16, 1, qscratch);
    return 0;
}

/* y [rows, N] = x [rows, K] W^T (+ b) in the model's dtype (bf16: bfloat16, else float32)
   on quantized weights: a quantized Linear's forward outside the decode kernel (prefill
   chunks, larger steps), up to QLINEAR_ROWS rows a call (each block's weights serve all
   of them from the cache). Returns 0, or -1 for rows out of range or weights not
   quantized. */
#define QLINEAR_ROWS 4096
int sluice_qlinear(const sluice_proj *p, const void *x, int rows, void *y, int bf16,
                   int num_threads, void *qscratch)
{
    if (rows < 1 || rows > QLINEAR_ROWS || !p->qtype || !qtype_fits(p->qtype, p->in_features))
        return -1;
    #pragma omp parallel num_threads(num_threads)
    qproject(p, x, rows, y, NULL, bf16, 0, qscratch);
    return 0;
}

/* Bytes of scratch the quantized products need for `rows` rows of up to `max_in` inputs. */
int64_t sluice_quant_scratch_bytes(int64_t rows, int64_t max_in) { return qacts_bytes(rows, max_in); }

/* Bytes of one 32-row block of a K-input projection stored as qtype (0: not storable). */
int64_t sluice_qblock_bytes(int64_t qtype, int64_t K) { return qtype_fits(qtype, K) ? qblock_bytes(qtype, K) : 0; }

/* Rows ids[0..n) of a quantized table as float32 into out [n, K] (the embedding's lookup). */
void sluice_dequantize_rows(const sluice_proj *p, const int64_t *ids, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++) dequantize_row(p, ids[i], out + i * p->in_features);
}

/* The kernel's layout of an N x K weight of qtype from its values q [N][K] (uint8, as
   quantized.Unpacked holds them) and scales: d [N][K/super] and dmin (4-bit formats)
   [N][K/super] float16, sc [N][K/16] int8 (Q6_K) or [N][K/32] uint8, mins [N][K/32]
   uint8; into out [ceil(N/32)][sluice_qblock_bytes] (blocks shared out between
   threads). Returns 0, or -1 for a qtype or width the kernel does not take. */
int sluice_pack(int64_t qtype, int64_t N, int64_t K, const uint8_t *q, const uint8_t *d,
                const uint8_t *dmin, const uint8_t *sc, const uint8_t *mins, uint8_t *out,
                int num_threads)
{
    if (qtype < Q8_0 || qtype > Q4_32 || !qtype_fits(qtype, K) || N < 1) return -1;
    const int64_t blocks = (N + COLS - 1) / COLS, bytes = qblock_bytes(qtype, K);
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++)
        pack_block(qtype, N, K, q, d, dmin, sc, mins, blk, out + blk * bytes);
    return 0;
}

/* Whether the quantized products use AVX512-VNNI (1) or vpmaddubsw (0). */
int sluice_quant_vnni(void) { return Q_VNNI; }

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
