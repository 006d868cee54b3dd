/* The fused AdamW update of one cache block, in one pass over memory.
 *
 * Loaded with ctypes by offload/optim/native.py, which checks every pointer,
 * size and dtype before a call; this file trusts its arguments. ctypes drops
 * the GIL for the call, so the worker threads of blocks.py run it at once.
 *
 * Per element: read the fp32 master and gradient and both moments (fp32, bf16
 * or 8-bit codes with one fp32 scale per QBLOCK elements, see the note in
 * codec.py), divide the gradient by `grad_scale`, apply weight decay, update
 * the moments and the master, write master and moments back (re-encoded) and
 * the compute-dtype copy (bf16 or fp16, round to nearest even). The math is
 * the operation order of torch's fused CPU Adam (torch._fused_adamw_) in fp32,
 * fused multiply-adds where torch's vector loop has them (the lerp of exp_avg,
 * exp_avg_sq's update, Adam's L2 term), none elsewhere (-ffp-contract=off);
 * the codes are those of codec.encode / codec.decode, bit for bit.
 *
 * Work goes tile by tile (TILE elements, a multiple of QBLOCK, in L1): moments
 * of other forms are decoded into fp32 tiles on the stack, updated, and encoded
 * back (8-bit codes block by block) while the tile is in L1. Compiled once for
 * x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA, F16C) and the baseline, chosen at
 * load time (target_clones; x86-64 only: elsewhere the build fails and the
 * optional extension is left out).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>

#define QBLOCK 256
#define TILE (4 * QBLOCK) /* elements per tile: its arrays and scratch fit L1 */
#define EXPORT __attribute__((visibility("default")))
/* Every helper is inlined into each clone of the entry point, so that each is
 * compiled for that clone's instruction set (a helper left out of line would
 * be compiled once, for the baseline). */
#define INLINE static inline __attribute__((always_inline))

enum { STATE_FP32 = 0, STATE_BF16 = 1, STATE_INT8 = 2 };
enum { OUT_NONE = 0, OUT_FP32 = 1, OUT_BF16 = 2, OUT_FP16 = 3 };

/* One run: elements [lo, hi) of the call updated with one set of
 * hyper-parameters, or left alone (skip: weights and moments as they are; the
 * master is still copied to the output). Python computes the coefficients in
 * double and hands them over rounded to fp32, as torch's kernel does. */
typedef struct {
    int64_t lo, hi;
    int32_t skip;
    int32_t decoupled;   /* 1: AdamW, decay the weights; 0: Adam, decay added to the grad */
    float weight_decay;
    float decay_mult;    /* 1 - lr * weight_decay */
    float lerp_w;        /* 1 - beta1 */
    float beta2;
    float beta2_c;       /* 1 - beta2 */
    float neg_step;      /* -lr / (1 - beta1^step) */
    float bias2_sqrt;    /* sqrt(1 - beta2^step) */
    float eps;
} offload_run;

typedef struct {
    float *master;
    const float *grad;
    void *m, *v;
    float *m_scale, *v_scale;
    void *out;
    int32_t state, out_dtype;
    int32_t scaled;
    float grad_scale;
    int32_t stream;      /* the CPU has AVX2 and F16C: store_half_stream */
    int32_t avx512;      /* the CPU has AVX-512 F, BW, VL: adam_out_avx512 */
} block_args;

/* ---- conversions ------------------------------------------------------- */

INLINE uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
INLINE float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* Round to nearest even, subnormals kept, every NaN to BF16_NAN: what torch's
 * vectorised fp32 -> bf16 conversion gives (Tensor.to / copy_, AVX2 and AVX-512;
 * its scalar c10::BFloat16 gives 0x7fc0, but torch runs that on a tensor's
 * elements only where it was built without vector kernels). */
#define BF16_NAN 0xffffu
INLINE uint16_t to_bf16(float x) {
    uint32_t u = f2u(x);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return x != x ? (uint16_t)BF16_NAN : (uint16_t)r;
}

INLINE float from_bf16(uint16_t h) { return u2f((uint32_t)h << 16); }

INLINE void store_bf16(uint16_t *restrict d, const float *restrict s, int64_t k) {
    for (int64_t i = 0; i < k; i++) d[i] = to_bf16(s[i]);
}

INLINE void load_bf16(float *restrict d, const uint16_t *restrict s, int64_t k) {
    for (int64_t i = 0; i < k; i++) d[i] = from_bf16(s[i]);
}

/* fp32 -> fp16, round to nearest even, subnormals kept, in float and integer
 * arithmetic so that it vectorises on any target (as c10::Half converts); a NaN
 * keeps its sign and its payload's top bits, quieted, as F16C's vcvtps2ph (which
 * torch's vectorised conversion runs) does. */
INLINE uint16_t to_fp16(float x) {
    uint32_t u = f2u(x), twice = u + u, sign = u & 0x80000000u;
    /* rounds at the fp16 precision of x's exponent: adding 2^(e+13) leaves the
     * sum's low mantissa bits holding the rounded fp16 mantissa */
    uint32_t bias = twice & 0xff000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    float base = (fabsf(x) * 0x1.0p+112f) * 0x1.0p-110f;
    base = u2f((bias >> 1) + 0x07800000u) + base;
    uint32_t b = f2u(base);
    uint32_t bits = ((b >> 13) & 0x7c00u) + (b & 0x0fffu);
    uint32_t nan = 0x7e00u | ((u >> 13) & 0x03ffu);
    return (uint16_t)((sign >> 16) | (twice > 0xff000000u ? nan : bits));
}

INLINE void store_fp16(uint16_t *restrict d, const float *restrict s, int64_t k) {
    for (int64_t i = 0; i < k; i++) d[i] = to_fp16(s[i]);
}

/* 8 floats to 8 bf16 (as to_bf16) or fp16 (F16C, round to nearest even). */
__attribute__((target("avx2,f16c"))) static inline __m128i half8(__m256 x, int fp16) {
    if (fp16) return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(BF16_NAN), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* The compute-dtype copy with streaming (non-temporal) stores: the copy is not
 * read in this pass, and a plain store would first read each of its cache lines
 * (for ownership), 2 bytes per element more traffic on a pass that the memory
 * bounds. The caller fences (sfence) before returning. */
__attribute__((target("avx2,f16c"))) static void store_half_stream(uint16_t *d, const float *s,
                                                                 int64_t k, int fp16) {
    int64_t i = 0;
    for (; i < k && ((uintptr_t)(d + i) & 31); i++)
        d[i] = fp16 ? to_fp16(s[i]) : to_bf16(s[i]);
    for (; i + 16 <= k; i += 16) {
        __m128i lo = half8(_mm256_loadu_ps(s + i), fp16);
        __m128i hi = half8(_mm256_loadu_ps(s + i + 8), fp16);
        _mm256_stream_si256((__m256i *)(d + i), _mm256_set_m128i(hi, lo));
    }
    for (; i < k; i++) d[i] = fp16 ? to_fp16(s[i]) : to_bf16(s[i]);
}

/* Round to nearest even for |x| < 2^22 (codes are at most 255). */
INLINE float round_even(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (x + magic) - magic;
}

/* ---- 8-bit codes (codec.py's [Note: compressed moments]) ------------- */

INLINE void decode_m8(float *restrict d, const int8_t *restrict c, float s, int64_t k) {
    for (int64_t i = 0; i < k; i++) d[i] = (float)c[i] * s;
}

INLINE void decode_v8(float *restrict d, const uint8_t *restrict c, float s, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        float r = (float)c[i] * s;
        d[i] = r * r;
    }
}

INLINE float clamp_scale(float s) {
    const float tiny = 1.17549435e-38f; /* torch.finfo(float32).tiny */
    return s < tiny ? tiny : s;  /* a NaN stays NaN, as clamp_(min=) leaves it */
}

/* max over non-negative floats, compared as their bit patterns (vectorises
 * without -ffast-math; NaN, whose bits are above inf's, wins as in amax). */
INLINE float max_abs(const float *restrict x, int64_t k) {
    uint32_t mx = 0;
    for (int64_t i = 0; i < k; i++) {
        uint32_t u = f2u(x[i]) & 0x7fffffffu;
        mx = u > mx ? u : mx;
    }
    return u2f(mx);
}

INLINE void encode_m8(int8_t *restrict c, float *scale, const float *restrict x, int64_t k) {
    float s = clamp_scale(max_abs(x, k) / 127.0f);
    float inv = 1.0f / s;
    *scale = s;
    for (int64_t i = 0; i < k; i++) {
        float q = round_even(x[i] * inv);
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        c[i] = (int8_t)(int32_t)q;
    }
}

/* `r` holds sqrt(v) (the update computes it anyway). */
INLINE void encode_v8(uint8_t *restrict c, float *scale, const float *restrict r, int64_t k) {
    float s = clamp_scale(max_abs(r, k) / 255.0f);
    float inv = 1.0f / s;
    *scale = s;
    for (int64_t i = 0; i < k; i++) {
        float q = round_even(r[i] * inv);
        q = q > 255.0f ? 255.0f : (q < 0.0f ? 0.0f : q);
        c[i] = (uint8_t)(int32_t)q;
    }
}

/* ---- the update ---------------------------------------------------- */

/* k elements in fp32: p, m, v updated in place; sq receives sqrt(v_new). */
/* The loop of adam_math, for one value of `scaled` (a constant once inlined). */
INLINE void adam_loop(int64_t k, float *restrict p, const float *restrict g0,
                      float *restrict m, float *restrict v, float *restrict sq,
                      const offload_run *r, const int scaled, float gs) {
    /* fields copied out: stores through p, m, v could otherwise alias *r */
    const float w = r->lerp_w, w1 = r->lerp_w - 1.0f, wd = r->weight_decay;
    const float decay = r->decay_mult, b2 = r->beta2, b2c = r->beta2_c;
    const float step = r->neg_step, bc2 = r->bias2_sqrt, eps = r->eps;
    const int small = fabsf(w) < 0.5f, adamw = wd != 0.0f && r->decoupled;
    const int l2 = wd != 0.0f && !r->decoupled;
    for (int64_t i = 0; i < k; i++) {
        float g = scaled ? g0[i] / gs : g0[i];
        float x = p[i];
        if (adamw) x = x * decay;
        if (l2) g = fmaf(x, wd, g);
        float d = g - m[i];
        float mi = small ? fmaf(w, d, m[i]) : fmaf(w1, d, g);
        float vi = fmaf(b2c * g, g, v[i] * b2);
        float root = sqrtf(vi);
        m[i] = mi;
        v[i] = vi;
        sq[i] = root;
        p[i] = x + step * mi / (root / bc2 + eps);
    }
}

/* k elements in fp32: p, m, v updated in place; sq receives sqrt(v_new). */
INLINE void adam_math(int64_t k, float *restrict p, const float *restrict g0,
                      float *restrict m, float *restrict v, float *restrict sq,
                      const offload_run *r, int scaled, float gs) {
    if (scaled) adam_loop(k, p, g0, m, v, sq, r, 1, gs);
    else adam_loop(k, p, g0, m, v, sq, r, 0, 1.0f);
}

/* ---- AVX-512: the update and the compute-dtype copy in one loop ---------
 *
 * The update waits mostly on the divider (a square root and two divisions per
 * element), the bf16 / fp16 conversion on integer ports: in one loop they
 * overlap, and the loads of the next elements go on while the copy is
 * converted, where a second pass over the tile would leave the memory idle
 * for its length. The same operations as adam_loop and to_bf16 / F16C, in the
 * same order, lane by lane: the same bits. Out of line, compiled for AVX-512
 * (F, BW, VL) alone and called where the CPU has it (block_args.avx512). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AVX512_INLINE AVX512 static inline __attribute__((always_inline))

/* 16 floats to 16 bf16 as to_bf16, or fp16 as F16C (round to nearest even). */
AVX512_INLINE __m256i half16(__m512 x, int fp16) {
    if (fp16) return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(BF16_NAN));
    return _mm512_cvtepi32_epi16(r);
}

/* Lanes `mask` of elements [i, i + 16): adam_loop's body, and the copy into d
 * (streamed when `full`: all 16 lanes, d + i 32-byte aligned). */
AVX512_INLINE void adam16(int64_t i, __mmask16 mask, int full, float *p, const float *g0,
                          float *m, float *v, float *sq, uint16_t *d, int fp16,
                          const float *c, int scaled, int adamw, int l2, int small) {
    const __m512 w = _mm512_set1_ps(c[0]), w1 = _mm512_set1_ps(c[1]);
    const __m512 wd = _mm512_set1_ps(c[2]), decay = _mm512_set1_ps(c[3]);
    const __m512 b2 = _mm512_set1_ps(c[4]), b2c = _mm512_set1_ps(c[5]);
    const __m512 step = _mm512_set1_ps(c[6]), bc2 = _mm512_set1_ps(c[7]);
    const __m512 eps = _mm512_set1_ps(c[8]), gs = _mm512_set1_ps(c[9]);
    __m512 g = _mm512_maskz_loadu_ps(mask, g0 + i);
    __m512 x = _mm512_maskz_loadu_ps(mask, p + i);
    __m512 mo = _mm512_maskz_loadu_ps(mask, m + i);
    __m512 vo = _mm512_maskz_loadu_ps(mask, v + i);
    if (scaled) g = _mm512_div_ps(g, gs);
    if (adamw) x = _mm512_mul_ps(x, decay);
    if (l2) g = _mm512_fmadd_ps(x, wd, g);
    __m512 dlt = _mm512_sub_ps(g, mo);
    __m512 mi = small ? _mm512_fmadd_ps(w, dlt, mo) : _mm512_fmadd_ps(w1, dlt, g);
    __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(b2c, g), g, _mm512_mul_ps(vo, b2));
    __m512 root = _mm512_sqrt_ps(vi);
    __m512 den = _mm512_add_ps(_mm512_div_ps(root, bc2), eps);
    __m512 pn = _mm512_add_ps(x, _mm512_div_ps(_mm512_mul_ps(step, mi), den));
    _mm512_mask_storeu_ps(m + i, mask, mi);
    _mm512_mask_storeu_ps(v + i, mask, vi);
    if (sq) _mm512_mask_storeu_ps(sq + i, mask, root);
    _mm512_mask_storeu_ps(p + i, mask, pn);
    __m256i h = half16(pn, fp16);
    if (full) _mm256_stream_si256((__m256i *)(d + i), h);
    else _mm256_mask_storeu_epi16(d + i, mask, h);
}

AVX512_INLINE void adam_out_loop(int64_t k, float *p, const float *g0, float *m, float *v,
                                 float *sq, uint16_t *d, int fp16, const float *c,
                                 int scaled, int adamw, int l2, int small) {
    /* lanes up to d's first 32-byte boundary, then whole aligned vectors streamed,
     * then the rest (d is 2-byte aligned: the head is < 16 elements) */
    int64_t head = (int64_t)((32 - ((uintptr_t)d & 31)) & 31) / 2;
    head = head < k ? head : k;
    if (head) adam16(0, (__mmask16)((1u << head) - 1), 0, p, g0, m, v, sq, d, fp16, c,
                     scaled, adamw, l2, small);
    int64_t i = head;
    for (; i + 16 <= k; i += 16)
        adam16(i, (__mmask16)0xffff, 1, p, g0, m, v, sq, d, fp16, c, scaled, adamw, l2, small);
    if (i < k) adam16(i, (__mmask16)((1u << (k - i)) - 1), 0, p, g0, m, v, sq, d, fp16, c,
                      scaled, adamw, l2, small);
}

/* k elements as adam_math, the new master's copy to d (bf16, or fp16 if `fp16`);
 * sq may be NULL (not needed). One specialised loop per combination of flags. */
AVX512 static void adam_out_avx512(int64_t k, float *restrict p, const float *restrict g0,
                                   float *restrict m, float *restrict v, float *restrict sq,
                                   uint16_t *restrict d, int fp16, const offload_run *r,
                                   int scaled, float gs) {
    const float c[10] = {r->lerp_w, r->lerp_w - 1.0f, r->weight_decay, r->decay_mult,
                         r->beta2, r->beta2_c, r->neg_step, r->bias2_sqrt, r->eps, gs};
    const int small = fabsf(r->lerp_w) < 0.5f, wd = r->weight_decay != 0.0f;
    const int adamw = wd && r->decoupled, l2 = wd && !r->decoupled;
    /* the flags as constants: each combination its own loop, branch-free inside */
#define ADAM_OUT(S, W, L, M) adam_out_loop(k, p, g0, m, v, sq, d, fp16, c, S, W, L, M)
#define ADAM_OUT_SM(S, W, L) (small ? ADAM_OUT(S, W, L, 1) : ADAM_OUT(S, W, L, 0))
#define ADAM_OUT_WL(S) (adamw ? ADAM_OUT_SM(S, 1, 0) : l2 ? ADAM_OUT_SM(S, 0, 1) \
                                                         : ADAM_OUT_SM(S, 0, 0))
    if (fp16) {
        if (scaled) ADAM_OUT_WL(1); else ADAM_OUT_WL(0);
    } else {
        if (scaled) ADAM_OUT_WL(1); else ADAM_OUT_WL(0);
    }
#undef ADAM_OUT_WL
#undef ADAM_OUT_SM
#undef ADAM_OUT
}

INLINE void write_out(const block_args *a, int64_t lo, int64_t k) {
    const float *src = a->master + lo;
    switch (a->out_dtype) {
    case OUT_FP32:
        if ((float *)a->out + lo != src) memcpy((float *)a->out + lo, src, 4 * (size_t)k);
        break;
    case OUT_BF16:
        if (a->stream) store_half_stream((uint16_t *)a->out + lo, src, k, 0);
        else store_bf16((uint16_t *)a->out + lo, src, k);
        break;
    case OUT_FP16:
        if (a->stream) store_half_stream((uint16_t *)a->out + lo, src, k, 1);
        else store_fp16((uint16_t *)a->out + lo, src, k);
        break;
    default: break;
    }
}

/* Elements [lo, lo + k) of one tile under run r; mt, vt: the tile's fp32 moments
 * (the arrays themselves for fp32 state) offset to element lo. */
INLINE void run_span(const block_args *a, const offload_run *r, int64_t lo, int64_t k,
                            float *mt, float *vt, float *sq) {
    int half = a->out_dtype == OUT_BF16 || a->out_dtype == OUT_FP16;
    if (!r->skip && half && a->avx512) {
        adam_out_avx512(k, a->master + lo, a->grad + lo, mt, vt,
                        a->state == STATE_INT8 ? sq : NULL, (uint16_t *)a->out + lo,
                        a->out_dtype == OUT_FP16, r, a->scaled, a->grad_scale);
        return;
    }
    if (!r->skip)
        adam_math(k, a->master + lo, a->grad + lo, mt, vt, sq, r, a->scaled, a->grad_scale);
    write_out(a, lo, k);
}

/* Elements of [t0, t1) that runs from `ri` on update. */
INLINE int64_t covered(const offload_run *runs, int64_t nruns, int64_t ri, int64_t t0,
                              int64_t t1) {
    int64_t c = 0;
    for (int64_t j = ri; j < nruns && runs[j].lo < t1; j++)
        if (!runs[j].skip)
            c += (runs[j].hi < t1 ? runs[j].hi : t1) - (runs[j].lo > t0 ? runs[j].lo : t0);
    return c;
}

/* One tile [t0, t1) (TILE elements, in L1; t0 the first of a QBLOCK): decode,
 * the runs over it, encode. `ri`: the first run that may reach this tile (runs
 * are sorted and disjoint); returns it for the next tile. */
INLINE int64_t tile(const block_args *a, const offload_run *runs, int64_t nruns,
                    int64_t ri, int64_t t0, int64_t t1) {
    float mb[TILE], vb[TILE], sq[TILE];
    int64_t k = t1 - t0;
    int busy = 0;
    while (ri < nruns && runs[ri].hi <= t0) ri++;
    for (int64_t j = ri; j < nruns && runs[j].lo < t1; j++) busy |= !runs[j].skip;
    float *m = mb, *v = vb;
    if (a->state == STATE_FP32) {
        m = (float *)a->m + t0;
        v = (float *)a->v + t0;
    } else if (busy && a->state == STATE_BF16) {
        load_bf16(mb, (const uint16_t *)a->m + t0, k);
        load_bf16(vb, (const uint16_t *)a->v + t0, k);
    } else if (busy) {
        for (int64_t b = 0; b < k; b += QBLOCK) {
            int64_t kb = k - b < QBLOCK ? k - b : QBLOCK, q = (t0 + b) / QBLOCK;
            decode_m8(mb + b, (const int8_t *)a->m + t0 + b, a->m_scale[q], kb);
            decode_v8(vb + b, (const uint8_t *)a->v + t0 + b, a->v_scale[q], kb);
        }
        if (covered(runs, nruns, ri, t0, t1) < k) {
            /* every element of a block is coded again, as codec.encode does over a
             * decoded block: sqrt(v) of the elements no run updates is taken here */
            for (int64_t i = 0; i < k; i++) sq[i] = sqrtf(vb[i]);
        }
    }
    for (int64_t j = ri; j < nruns && runs[j].lo < t1; j++) {
        int64_t lo = runs[j].lo > t0 ? runs[j].lo : t0;
        int64_t hi = runs[j].hi < t1 ? runs[j].hi : t1;
        run_span(a, &runs[j], lo, hi - lo, m + (lo - t0), v + (lo - t0), sq + (lo - t0));
    }
    if (!busy || a->state == STATE_FP32) return ri;
    if (a->state == STATE_BF16) {
        store_bf16((uint16_t *)a->m + t0, mb, k);
        store_bf16((uint16_t *)a->v + t0, vb, k);
        return ri;
    }
    for (int64_t b = 0; b < k; b += QBLOCK) {
        int64_t kb = k - b < QBLOCK ? k - b : QBLOCK, q = (t0 + b) / QBLOCK;
        encode_m8((int8_t *)a->m + t0 + b, &a->m_scale[q], mb + b, kb);
        encode_v8((uint8_t *)a->v + t0 + b, &a->v_scale[q], sq + b, kb);
    }
    return ri;
}

/* The update of elements [0, n) of one block. For int8 state, element 0 is the
 * first of a QBLOCK and m_scale / v_scale point at its scale. Returns 0. */
EXPORT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
int offload_adam_block(int64_t n, float *master, const float *grad, void *m, void *v,
                       float *m_scale, float *v_scale, int32_t state, void *out,
                       int32_t out_dtype, float grad_scale, const offload_run *runs,
                       int64_t nruns) {
    block_args a = {master, grad, m, v, m_scale, v_scale, out, state, out_dtype,
                    grad_scale != 1.0f, grad_scale,
                    __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"),
                    __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                        && __builtin_cpu_supports("avx512vl")};
    int64_t ri = 0;
    for (int64_t t0 = 0; t0 < n; t0 += TILE)
        ri = tile(&a, runs, nruns, ri, t0, t0 + TILE < n ? t0 + TILE : n);
    if ((a.stream || a.avx512) && (out_dtype == OUT_BF16 || out_dtype == OUT_FP16))
        _mm_sfence(); /* the streaming stores are visible before the caller goes on */
    return 0;
}

/* 1 when this build can be called at all (the loader's handshake). */
EXPORT int offload_adam_abi(void) { return 1; }
