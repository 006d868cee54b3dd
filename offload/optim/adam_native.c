/* The fused AdamW update of one cache block, in one pass over memory.
 *
 * Loaded with ctypes by offload/optim/native.py, which checks every pointer,
 * size and dtype before a call; this file trusts its arguments. ctypes drops
 * the GIL for the call, so the worker threads of blocks.py run it at once.
 *
 * Per element: read the fp32 master and gradient and both moments (fp32, bf16
 * or 8-bit codes with one fp32 scale per QBLOCK elements, see the note in
 * codec.py), divide the gradient by `grad_scale`, apply weight decay, update
 * the moments and the master, write master and moments back (re-encoded; bf16
 * moments and the 8-bit codes of updated elements rounded stochastically, with
 * random bits from a hash of the element's model-wide index and the run's update
 * count, see to_bf16_sr and code8) and the
 * compute-dtype copy (bf16 or fp16, round to nearest even). The math is
 * the operation order of torch's fused CPU Adam (torch._fused_adamw_) in fp32,
 * fused multiply-adds where torch's vector loop has them (the lerp of exp_avg,
 * exp_avg_sq's update, Adam's L2 term), none elsewhere (-ffp-contract=off);
 * the codes are those of codec.encode / codec.decode, bit for bit.
 *
 * Work goes tile by tile (TILE elements, a multiple of QBLOCK, in L1): moments
 * of other forms are decoded into fp32 tiles on the stack, updated, and encoded
 * back (8-bit codes block by block) while the tile is in L1. Where the CPU has
 * AVX-512 (F, BW, VL; checked at run time), one vector loop does the update, the
 * copy and bf16 moments in place (adam_avx512), and the 8-bit codes are coded in
 * vectors. Compiled once for x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA, F16C)
 * and the baseline, chosen at load time (target_clones; x86-64 only: elsewhere
 * the build fails and the optional extension is left out). offload_adam_block
 * updates one block per call; offload_adam_claim lets several threads share a
 * whole chunk, one call each. With `src` (not NULL and not the master), the
 * master's current values are read from `src`, and `master` receives the new
 * ones (a partition updated into a fresh buffer, its old version kept): each
 * tile is copied from `src` as its work starts, while the tile is in L1, rather
 * than the caller copying the whole buffer in a pass of its own.
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
    uint32_t key;        /* bf16 and int8 moments: the run's part of the rounding's hash
                          * (codec.py's [Note: stochastic rounding]) */
    float m_bound;       /* int8 moments: C of codec.py's [Note: the first moment's
                          * bound]; 0: none */
} offload_run;

typedef struct {
    float *master;
    const float *src;    /* the master's current values: `master` itself, or read from
                          * here tile by tile into `master` before its update */
    const float *grad;
    void *m, *v;
    float *m_scale, *v_scale;
    void *out;
    int32_t state, out_dtype;
    int32_t scaled;
    float grad_scale;
    int32_t stream;      /* the CPU has AVX2 and F16C: store_half_stream */
    int32_t avx512;      /* the CPU has AVX-512 F, BW, VL: adam_avx512 and the codecs */
    int64_t first;       /* element 0's model-wide index (stochastic rounding) */
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

/* Stochastic rounding of the update's bf16 moments (codec.py's [Note: stochastic
 * rounding]): h = mix32(element index ^ run key); 16 random bits of it (the low half
 * for exp_avg, the high half for exp_avg_sq) are added to the fp32 bits before the
 * cut, so x rounds up with probability (x - down) / (up - down); bits already a bf16
 * value are kept, inf stays inf, every NaN is BF16_NAN. The index is the
 * partition's, mod 2^32 (unsigned arithmetic wraps as the mask does). */
INLINE uint32_t mix32(uint32_t x) {
    x = ((x >> 16) ^ x) * 0x45d9f3bu;
    x = ((x >> 16) ^ x) * 0x45d9f3bu;
    return (x >> 16) ^ x;
}

INLINE uint16_t to_bf16_sr(float x, uint32_t r16) {
    uint32_t r = (f2u(x) + r16) >> 16;
    return x != x ? (uint16_t)BF16_NAN : (uint16_t)r;
}

/* k elements of both moments, the first with model-wide index `index` */
INLINE void store_bf16_sr(uint16_t *restrict m, uint16_t *restrict v, const float *restrict mf,
                          const float *restrict vf, int64_t k, uint32_t index, uint32_t key) {
    for (int64_t i = 0; i < k; i++) {
        uint32_t h = mix32((index + (uint32_t)i) ^ key);
        m[i] = to_bf16_sr(mf[i], h & 0xffffu);
        v[i] = to_bf16_sr(vf[i], h >> 16);
    }
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

/* floor(x) for |x| < 2^22, inf and NaN kept (vectorises without SSE4.1's roundps) */
INLINE float floor_small(float x) {
    float t = round_even(x);
    return t > x ? t - 1.0f : t;
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

/* A block's scale max / top, within [tiny, FLT_MAX / top]: an inf in the block
 * leaves the top scale (codec.py's _SCALE_MAX, [Note: compressed moments]: a NaN or
 * an inf stays in its element); `top` is 127.0f or 255.0f. */
INLINE float clamp_scale(float s, float top) {
    const float tiny = 1.17549435e-38f; /* torch.finfo(float32).tiny */
    const float most = 3.40282347e38f / top; /* FLT_MAX / top, rounded in fp32 */
    s = s < tiny ? tiny : s;
    return s > most ? most : s;
}

/* max over |x|, compared as bit patterns (vectorises without -ffast-math); a NaN,
 * whose bits are above inf's, is left out (as codec.encode's masked amax). */
INLINE float max_abs(const float *restrict x, int64_t k) {
    uint32_t mx = 0;
    for (int64_t i = 0; i < k; i++) {
        uint32_t u = f2u(x[i]) & 0x7fffffffu;
        u = u > 0x7f800000u ? 0u : u;
        mx = u > mx ? u : mx;
    }
    return u2f(mx);
}

/* Stochastic rounding of the 8-bit codes that the update writes (codec.py's [Note:
 * stochastic rounding]): an element a run updates codes as floor(x * inv + r), with
 * r = (k + 0.5) / 256 and k 8 bits of its hash h = mix32(index ^ run key): bits 8-15
 * for exp_avg, 24-31 for exp_avg_sq (the top of each half that bf16 moments use). r
 * is in [1/512, 1 - 1/512], so a value within 1/512 of a code keeps it. The other
 * elements of a block coded again hold r = NEAREST and round to nearest even, as
 * codec.encode does. x * inv, then + r, each one fp32 rounding, then floor: the
 * torch path's order (codec.encode). */
#define NEAREST (-1.0f)

INLINE float sr_offset(uint32_t bits8) { return (float)(2u * bits8 + 1u) * (1.0f / 512.0f); }

/* the offsets of k updated elements, the first with model-wide index `index` */
INLINE void store_offsets(float *restrict rm, float *restrict rv, int64_t k, uint32_t index,
                          uint32_t key) {
    for (int64_t i = 0; i < k; i++) {
        uint32_t h = mix32((index + (uint32_t)i) ^ key);
        rm[i] = sr_offset((h >> 8) & 0xffu);
        rv[i] = sr_offset(h >> 24);
    }
}

INLINE float code8(float x, float inv, float r) {
    float q = x * inv;
    return r < 0.0f ? round_even(q) : floor_small(q + r);
}

INLINE void encode_m8(int8_t *restrict c, float *scale, const float *restrict x,
                      const float *restrict rm, int64_t k) {
    float s = clamp_scale(max_abs(x, k) / 127.0f, 127.0f);
    float inv = 1.0f / s;
    *scale = s;
    for (int64_t i = 0; i < k; i++) {
        float q = code8(x[i], inv, rm[i]);
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        c[i] = (int8_t)(int32_t)q;
    }
}

/* `r` holds sqrt(v) (the update computes it anyway). */
INLINE void encode_v8(uint8_t *restrict c, float *scale, const float *restrict r,
                      const float *restrict rv, int64_t k) {
    float s = clamp_scale(max_abs(r, k) / 255.0f, 255.0f);
    float inv = 1.0f / s;
    *scale = s;
    for (int64_t i = 0; i < k; i++) {
        float q = code8(r[i], inv, rv[i]);
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

/* ---- AVX-512: the update, bf16 moments and the copy in one loop ----------
 *
 * The update waits mostly on the divider (a square root and two divisions per
 * element); converting bf16 moments and the bf16 / fp16 copy is integer work.
 * In one loop they overlap, and the loads of the next elements go on while
 * this one's are converted, where separate passes over a tile would leave the
 * memory idle for their length. bf16 moments are read and written in place
 * (no fp32 tile). The same operations as adam_loop, to_bf16, store_bf16_sr and
 * F16C, in the same order, lane by lane: the same bits. Out of line, compiled
 * for AVX-512 (F, BW, VL) alone and called where the CPU has it (block_args.avx512). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AVX512_INLINE AVX512 static inline __attribute__((always_inline))

AVX512_INLINE __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

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

AVX512_INLINE __m512 load16(const void *x, int64_t i, __mmask16 l, int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(l, (const float *)x + i);
    __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(l, (const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

/* mix32 of 16 lanes */
AVX512_INLINE __m512i mix16(__m512i h) {
    const __m512i mul = _mm512_set1_epi32(0x45d9f3b);
    h = _mm512_mullo_epi32(_mm512_xor_si512(_mm512_srli_epi32(h, 16), h), mul);
    h = _mm512_mullo_epi32(_mm512_xor_si512(_mm512_srli_epi32(h, 16), h), mul);
    return _mm512_xor_si512(_mm512_srli_epi32(h, 16), h);
}

/* 16 floats to bf16 as to_bf16_sr, r16 the lanes' random bits (< 2^16). */
AVX512_INLINE __m256i bf16_sr16(__m512 x, __m512i r16) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r16), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(BF16_NAN));
    return _mm512_cvtepi32_epi16(r);
}

/* A moment's new values: fp32, or bf16 rounded stochastically with r16 (bf16_sr16). */
AVX512_INLINE void store16(void *x, int64_t i, __mmask16 l, int bf16, __m512 y, __m512i r16) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)x + i, l, bf16_sr16(y, r16));
    else _mm512_mask_storeu_ps((float *)x + i, l, y);
}

enum { COPY_NONE = 0, COPY_BF16 = 1, COPY_FP16 = 2 };

/* The constants of a run, in vectors; the flags stay scalars (branches that
 * never change within a loop). */
typedef struct {
    __m512 w, w1, wd, decay, b2, b2c, step, bc2, eps, gs;
    __m512i iota, key;           /* lane numbers; the run's key (bf16 and int8 moments) */
    uint32_t index;              /* model-wide index of element 0, mod 2^32 */
    int small, adamw, l2;
} adam_vec;

/* Lanes `l` of elements [i, i + 16): adam_loop's body, the master read from pin
 * and written to p; m, v fp32 or bf16 (`bf16m`), sq (sqrt(v_new)) and the int8
 * codes' rounding offsets rm, rv (store_offsets) written unless sq is NULL, the copy
 * into d (streamed when `full`: all lanes, d + i 32-byte aligned;
 * without a copy, p streamed when `full` and p is not pin: p + i 64-byte aligned). */
AVX512_INLINE __m512 sr_offset16(__m512i bits8) {
    __m512i odd = _mm512_add_epi32(_mm512_slli_epi32(bits8, 1), _mm512_set1_epi32(1));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(odd), _mm512_set1_ps(1.0f / 512.0f));
}

AVX512_INLINE void adam16(int64_t i, __mmask16 l, int full, float *p, const float *pin,
                          const float *g0, void *m, void *v, float *sq, float *rm,
                          float *rv, uint16_t *d, const adam_vec *c, int copy, int bf16m,
                          int scaled) {
    __m512 g = _mm512_maskz_loadu_ps(l, g0 + i);
    __m512 x = _mm512_maskz_loadu_ps(l, pin + i);
    __m512 mo = load16(m, i, l, bf16m), vo = load16(v, i, l, bf16m);
    if (scaled) g = _mm512_div_ps(g, c->gs);
    if (c->adamw) x = _mm512_mul_ps(x, c->decay);
    if (c->l2) g = _mm512_fmadd_ps(x, c->wd, g);
    __m512 dlt = _mm512_sub_ps(g, mo);
    __m512 mi = c->small ? _mm512_fmadd_ps(c->w, dlt, mo) : _mm512_fmadd_ps(c->w1, dlt, g);
    __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(c->b2c, g), g, _mm512_mul_ps(vo, c->b2));
    __m512 root = _mm512_sqrt_ps(vi);
    __m512 den = _mm512_add_ps(_mm512_div_ps(root, c->bc2), c->eps);
    __m512 pn = _mm512_add_ps(x, _mm512_div_ps(_mm512_mul_ps(c->step, mi), den));
    __m512i hash = _mm512_setzero_si512();  /* as store_bf16_sr and store_offsets */
    if (bf16m || sq) {
        __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(c->index + (uint32_t)i)),
                                         c->iota);
        hash = mix16(_mm512_xor_si512(index, c->key));
    }
    store16(m, i, l, bf16m, mi, _mm512_and_si512(hash, _mm512_set1_epi32(0xffff)));
    store16(v, i, l, bf16m, vi, _mm512_srli_epi32(hash, 16));
    if (sq) {
        _mm512_mask_storeu_ps(sq + i, l, root);
        __m512i lo8 = _mm512_and_si512(_mm512_srli_epi32(hash, 8), _mm512_set1_epi32(0xff));
        _mm512_mask_storeu_ps(rm + i, l, sr_offset16(lo8));
        _mm512_mask_storeu_ps(rv + i, l, sr_offset16(_mm512_srli_epi32(hash, 24)));
    }
    if (full && p != pin && copy == COPY_NONE) _mm512_stream_ps(p + i, pn);
    else _mm512_mask_storeu_ps(p + i, l, pn);
    if (copy == COPY_NONE) return;
    __m256i h = half16(pn, copy == COPY_FP16);
    if (full) _mm256_stream_si256((__m256i *)(d + i), h);
    else _mm256_mask_storeu_epi16(d + i, l, h);
}

AVX512_INLINE void adam_vec_loop(int64_t k, float *p, const float *pin, const float *g0,
                                 void *m, void *v, float *sq, float *rm, float *rv,
                                 uint16_t *d, const adam_vec *c, int copy, int bf16m,
                                 int scaled) {
    /* with a copy: lanes up to d's first 32-byte boundary, then whole aligned
     * vectors streamed, then the rest (d is 2-byte aligned: the head is < 16);
     * without one and p not pin, the same up to p's first 64-byte boundary */
    int64_t head = copy ? (int64_t)((32 - ((uintptr_t)d & 31)) & 31) / 2
                        : p != pin ? (int64_t)((64 - ((uintptr_t)p & 63)) & 63) / 4 : 0;
    head = head < k ? head : k;
    if (head)
        adam16(0, lanes(head), 0, p, pin, g0, m, v, sq, rm, rv, d, c, copy, bf16m, scaled);
    int64_t i = head;
    for (; i + 16 <= k; i += 16)
        adam16(i, (__mmask16)0xffff, 1, p, pin, g0, m, v, sq, rm, rv, d, c, copy, bf16m,
               scaled);
    if (i < k)
        adam16(i, lanes(k - i), 0, p, pin, g0, m, v, sq, rm, rv, d, c, copy, bf16m, scaled);
}

/* k elements as adam_math, with m, v fp32 or bf16 (`bf16m`; in place either way,
 * bf16 rounded as to_bf16_sr, `index` element 0's model-wide index), sq as there or
 * NULL (not needed; with it, the int8 codes' offsets rm, rv as store_offsets), and
 * the new master's copy to d (`copy`). The master's current
 * values are read from `pin`: `p` itself, or where they are when `p` only receives
 * the new ones ([Note: the master read in the loop]); so neither is `restrict`.
 * One loop per combination of the three (constants once inlined). */
AVX512 static void adam_avx512(int64_t k, float *p, const float *pin, const float *restrict g0,
                               void *restrict m, void *restrict v, float *restrict sq,
                               float *restrict rm, float *restrict rv,
                               uint16_t *restrict d, int copy, int bf16m,
                               const offload_run *r, int scaled, float gs, uint32_t index) {
    adam_vec c;
    c.w = _mm512_set1_ps(r->lerp_w);
    c.w1 = _mm512_set1_ps(r->lerp_w - 1.0f);
    c.wd = _mm512_set1_ps(r->weight_decay);
    c.decay = _mm512_set1_ps(r->decay_mult);
    c.b2 = _mm512_set1_ps(r->beta2);
    c.b2c = _mm512_set1_ps(r->beta2_c);
    c.step = _mm512_set1_ps(r->neg_step);
    c.bc2 = _mm512_set1_ps(r->bias2_sqrt);
    c.eps = _mm512_set1_ps(r->eps);
    c.gs = _mm512_set1_ps(gs);
    c.iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    c.key = _mm512_set1_epi32((int32_t)r->key);
    c.index = index;
    c.small = fabsf(r->lerp_w) < 0.5f;
    c.adamw = r->weight_decay != 0.0f && r->decoupled;
    c.l2 = r->weight_decay != 0.0f && !r->decoupled;
#define ADAM_VEC(C, B) (scaled ? adam_vec_loop(k, p, pin, g0, m, v, sq, rm, rv, d, &c, C, B, 1) \
                               : adam_vec_loop(k, p, pin, g0, m, v, sq, rm, rv, d, &c, C, B, 0))
#define ADAM_VEC_C(B) (copy == COPY_BF16 ? ADAM_VEC(COPY_BF16, B) \
                       : copy == COPY_FP16 ? ADAM_VEC(COPY_FP16, B) : ADAM_VEC(COPY_NONE, B))
    if (bf16m) ADAM_VEC_C(1);
    else ADAM_VEC_C(0);
#undef ADAM_VEC_C
#undef ADAM_VEC
}

/* The moments' codes in and out of a tile's fp32 arrays (k elements from the first
 * of a QBLOCK): decode_m8 / decode_v8 / encode_m8 / encode_v8 on AVX-512 (bf16
 * moments stay in adam_avx512's loop), the same operations lane by lane (the clamps as vminps
 * / vmaxps with the bound first, which keep a NaN as the C comparisons do; a
 * NaN's code is cvttps2dq's 0x80000000 cut to 8 bits, as the C casts give). */
AVX512 static void decode8_avx512(float *restrict mb, float *restrict vb,
                                  const int8_t *restrict mc, const uint8_t *restrict vc,
                                  const float *ms, const float *vs, int64_t k) {
    for (int64_t b = 0; b < k; b += QBLOCK) {
        int64_t end = k - b < QBLOCK ? k : b + QBLOCK;
        const __m512 sm = _mm512_set1_ps(ms[b / QBLOCK]), sv = _mm512_set1_ps(vs[b / QBLOCK]);
        for (int64_t i = b; i < end; i += 16) {
            __mmask16 l = lanes(end - i);
            __m512i cm = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(l, mc + i));
            __m512i cv = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(l, vc + i));
            __m512 r = _mm512_mul_ps(_mm512_cvtepi32_ps(cv), sv);
            _mm512_mask_storeu_ps(mb + i, l, _mm512_mul_ps(_mm512_cvtepi32_ps(cm), sm));
            _mm512_mask_storeu_ps(vb + i, l, _mm512_mul_ps(r, r));
        }
    }
}

/* bound_m8 on AVX-512: vminps / vmaxps with the bound first are its two selects, and
 * -lim a flip of the sign bit, as C's unary minus (0 - lim would be +0.0 for 0) */
AVX512 static void bound8_avx512(float *restrict mb, const uint8_t *restrict vc,
                                 const float *vs, int64_t t0, int64_t lo, int64_t hi, float c) {
    const __m512 cc = _mm512_set1_ps(c);
    for (int64_t b = lo, end; b < hi; b = end) {
        end = (b / QBLOCK + 1) * QBLOCK < hi ? (b / QBLOCK + 1) * QBLOCK : hi;
        const __m512 s = _mm512_set1_ps(vs[b / QBLOCK]);
        for (int64_t i = b; i < end; i += 16) {
            __mmask16 l = lanes(end - i);
            __m512i cv = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(l, vc + i));
            __m512 lim = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(cv), s), cc);
            __m512 x = _mm512_min_ps(lim, _mm512_maskz_loadu_ps(l, mb + (i - t0)));
            __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(  /* -lim: -0.0 for a lim of 0 */
                _mm512_castps_si512(lim), _mm512_set1_epi32((int)0x80000000u)));
            x = _mm512_max_ps(neg, x);
            _mm512_mask_storeu_ps(mb + (i - t0), l, x);
        }
    }
}

/* max_abs over [i0, end) (bit patterns of |x|, NaN left out, as max_abs) */
AVX512_INLINE float max_abs16(const float *x, int64_t i0, int64_t end) {
    __m512i mx = _mm512_setzero_si512();
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (int64_t i = i0; i < end; i += 16) {
        __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(lanes(end - i), x + i));
        u = _mm512_and_si512(u, abs);
        mx = _mm512_mask_max_epu32(mx, _mm512_cmple_epu32_mask(u, inf), mx, u);
    }
    return u2f(_mm512_reduce_max_epu32(mx));
}

/* x * inv rounded to an integer code in [lo, hi] (code8: floor(x * inv + r), or
 * round_even where r is NEAREST; then the clamps) */
AVX512_INLINE __m512i code16(__m512 x, __m512 inv, __m512 r, __m512 lo, __m512 hi) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    __m512 q = _mm512_mul_ps(x, inv);
    __m512 near = _mm512_sub_ps(_mm512_add_ps(q, magic), magic);
    __m512 down = _mm512_roundscale_ps(_mm512_add_ps(q, r),
                                       _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    q = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_LT_OQ), down,
                             near);
    q = _mm512_max_ps(lo, _mm512_min_ps(hi, q));
    return _mm512_cvttps_epi32(q);
}

/* mb: exp_avg's fp32 tile, sq: sqrt of exp_avg_sq's, rm / rv: their offsets (code8) */
AVX512 static void encode8_avx512(int8_t *restrict mc, uint8_t *restrict vc, float *ms,
                                  float *vs, const float *restrict mb,
                                  const float *restrict sq, const float *restrict rm,
                                  const float *restrict rv, int64_t k) {
    for (int64_t b = 0; b < k; b += QBLOCK) {
        int64_t end = k - b < QBLOCK ? k : b + QBLOCK;
        float s = clamp_scale(max_abs16(mb, b, end) / 127.0f, 127.0f);
        float t = clamp_scale(max_abs16(sq, b, end) / 255.0f, 255.0f);
        ms[b / QBLOCK] = s;
        vs[b / QBLOCK] = t;
        const __m512 inv_m = _mm512_set1_ps(1.0f / s), inv_v = _mm512_set1_ps(1.0f / t);
        const __m512 m_lo = _mm512_set1_ps(-127.0f), m_hi = _mm512_set1_ps(127.0f);
        const __m512 v_lo = _mm512_setzero_ps(), v_hi = _mm512_set1_ps(255.0f);
        for (int64_t i = b; i < end; i += 16) {
            __mmask16 l = lanes(end - i);
            __m512i cm = code16(_mm512_maskz_loadu_ps(l, mb + i), inv_m,
                                _mm512_maskz_loadu_ps(l, rm + i), m_lo, m_hi);
            __m512i cv = code16(_mm512_maskz_loadu_ps(l, sq + i), inv_v,
                                _mm512_maskz_loadu_ps(l, rv + i), v_lo, v_hi);
            _mm_mask_storeu_epi8(mc + i, l, _mm512_cvtepi32_epi8(cm));
            _mm_mask_storeu_epi8(vc + i, l, _mm512_cvtepi32_epi8(cv));
        }
    }
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
 * (the arrays themselves for fp32 state) offset to element lo; int8 state: rm, rv
 * receive the codes' offsets (store_offsets). */
INLINE void run_span(const block_args *a, const offload_run *r, int64_t lo, int64_t k,
                     float *mt, float *vt, float *sq, float *rm, float *rv) {
    if (!r->skip) {
        adam_math(k, a->master + lo, a->grad + lo, mt, vt, sq, r, a->scaled, a->grad_scale);
        if (a->state == STATE_INT8)
            store_offsets(rm, rv, k, (uint32_t)(a->first + lo), r->key);
    }
    write_out(a, lo, k);
}

/* run_span on AVX-512: m, v the moments at element lo, fp32 (the arrays or the
 * tile's decoded int8 codes) or the bf16 arrays themselves (`bf16m`). */
INLINE void run_span_avx512(const block_args *a, const offload_run *r, int64_t lo, int64_t k,
                            void *m, void *v, int bf16m, float *sq, float *rm, float *rv) {
    if (r->skip) {
        if (a->src != a->master) memcpy(a->master + lo, a->src + lo, 4 * (size_t)k);
        write_out(a, lo, k);
        return;
    }
    int copy = a->out_dtype == OUT_BF16 ? COPY_BF16
               : a->out_dtype == OUT_FP16 ? COPY_FP16 : COPY_NONE;
    int int8 = a->state == STATE_INT8;
    adam_avx512(k, a->master + lo, a->src + lo, a->grad + lo, m, v, int8 ? sq : NULL,
                int8 ? rm : NULL, int8 ? rv : NULL, (uint16_t *)a->out + lo, copy, bf16m, r,
                a->scaled, a->grad_scale, (uint32_t)(a->first + lo));
    if (a->out_dtype == OUT_FP32) write_out(a, lo, k);
}

/* [Note: the master read in the loop]
 * With `src`, the master's current values are elsewhere and `master` receives
 * the new ones. Copying a tile from `src` into `master` before its update
 * stalled on memory for the copy's length (the tile's reads no longer overlap
 * the update's arithmetic) and made the pass a third slower than an update in
 * place (`offload bench adam`, int8 moments, 2 threads). The AVX-512 loop reads
 * the master from `src` as it goes instead; only the elements no run updates
 * (skipped runs, gaps between runs) are copied, so `master` ends the same.
 * Where no compute-dtype copy rides on the loop, it also writes the new master
 * with non-temporal stores from its first 64-byte boundary on: `master` holds
 * nothing the pass reads, and a store through the cache would first read each
 * line in (4 more bytes per element on a pass of 16 with int8 moments); `fence`
 * orders them before the call returns. Both together took the pass from
 * 0.91-0.92 to 1.19-1.26 Gelem/s with a partition-sized `master` (an update in
 * place: 1.20-1.27), the same bits. */
INLINE void copy_gaps(const block_args *a, const offload_run *runs, int64_t nruns,
                      int64_t ri, int64_t t0, int64_t t1) {
    int64_t at = t0;
    for (int64_t j = ri; j < nruns && runs[j].lo < t1 && at < t1; j++) {
        int64_t lo = runs[j].lo > at ? runs[j].lo : at;
        if (lo > at) memcpy(a->master + at, a->src + at, 4 * (size_t)(lo - at));
        at = runs[j].hi > at ? runs[j].hi : at;
    }
    if (at < t1) memcpy(a->master + at, a->src + at, 4 * (size_t)(t1 - at));
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

/* The 8-bit codes of tile [t0, t0 + k): exp_avg from mb, sqrt(exp_avg_sq) from sq,
 * each element rounded with its offset in rm / rv (code8). */
INLINE void encode_tile8(const block_args *a, int64_t t0, int64_t k, const float *mb,
                         const float *sq, const float *rm, const float *rv) {
    if (a->avx512) {
        encode8_avx512((int8_t *)a->m + t0, (uint8_t *)a->v + t0, a->m_scale + t0 / QBLOCK,
                       a->v_scale + t0 / QBLOCK, mb, sq, rm, rv, k);
        return;
    }
    for (int64_t b = 0; b < k; b += QBLOCK) {
        int64_t kb = k - b < QBLOCK ? k - b : QBLOCK, q = (t0 + b) / QBLOCK;
        encode_m8((int8_t *)a->m + t0 + b, &a->m_scale[q], mb + b, rm + b, kb);
        encode_v8((uint8_t *)a->v + t0 + b, &a->v_scale[q], sq + b, rv + b, kb);
    }
}

/* codec.py's [Note: the first moment's bound]: decoded exp_avg mb (tile from t0) of
 * elements [lo, hi) clamped to +-(code * s) * c, the element's decoded sqrt(v), as
 * codec.bound_first_moment (fp32, the same order of operations). */
INLINE void bound_m8(float *restrict mb, const uint8_t *restrict vc, const float *vs,
                     int64_t t0, int64_t lo, int64_t hi, float c) {
    for (int64_t b = lo, end; b < hi; b = end) {
        end = (b / QBLOCK + 1) * QBLOCK < hi ? (b / QBLOCK + 1) * QBLOCK : hi;
        const float s = vs[b / QBLOCK];
        for (int64_t e = b; e < end; e++) {
            float lim = ((float)vc[e] * s) * c, x = mb[e - t0];
            x = lim < x ? lim : x;
            mb[e - t0] = -lim > x ? -lim : x;
        }
    }
}

/* One tile [t0, t1) (TILE elements, in L1; t0 the first of a QBLOCK): decode,
 * the runs over it, encode. `ri`: the first run that may reach this tile (runs
 * are sorted and disjoint); returns it for the next tile. */
INLINE int64_t tile(const block_args *a, const offload_run *runs, int64_t nruns,
                    int64_t ri, int64_t t0, int64_t t1) {
    float mb[TILE], vb[TILE], sq[TILE], rm[TILE], rv[TILE];
    int64_t k = t1 - t0;
    int busy = 0;
    if (a->src != a->master && !a->avx512)  /* elements no run updates keep src's values */
        memcpy(a->master + t0, a->src + t0, 4 * (size_t)k);
    while (ri < nruns && runs[ri].hi <= t0) ri++;
    if (a->src != a->master && a->avx512)  /* [Note: the master read in the loop] */
        copy_gaps(a, runs, nruns, ri, t0, t1);
    for (int64_t j = ri; j < nruns && runs[j].lo < t1; j++) busy |= !runs[j].skip;
    float *m = mb, *v = vb;
    if (a->state == STATE_FP32) {
        m = (float *)a->m + t0;
        v = (float *)a->v + t0;
    } else if (a->avx512 && a->state == STATE_BF16) {
        /* read and written in adam_avx512's loop */
    } else if (busy && a->state == STATE_BF16) {
        load_bf16(mb, (const uint16_t *)a->m + t0, k);
        load_bf16(vb, (const uint16_t *)a->v + t0, k);
    } else if (busy && a->avx512) {
        decode8_avx512(mb, vb, (const int8_t *)a->m + t0, (const uint8_t *)a->v + t0,
                       a->m_scale + t0 / QBLOCK, a->v_scale + t0 / QBLOCK, k);
    } else if (busy) {
        for (int64_t b = 0; b < k; b += QBLOCK) {
            int64_t kb = k - b < QBLOCK ? k - b : QBLOCK, q = (t0 + b) / QBLOCK;
            decode_m8(mb + b, (const int8_t *)a->m + t0 + b, a->m_scale[q], kb);
            decode_v8(vb + b, (const uint8_t *)a->v + t0 + b, a->v_scale[q], kb);
        }
    }
    if (busy && a->state == STATE_INT8 && covered(runs, nruns, ri, t0, t1) < k) {
        /* every element of a block is coded again, as codec.encode does over a
         * decoded block: sqrt(v) of the elements no run updates is taken here, and
         * they round to nearest (the runs overwrite their own elements' offsets) */
        for (int64_t i = 0; i < k; i++) {
            sq[i] = sqrtf(vb[i]);
            rm[i] = rv[i] = NEAREST;
        }
    }
    int bf16m = a->avx512 && a->state == STATE_BF16;
    for (int64_t j = ri; j < nruns && runs[j].lo < t1; j++) {
        int64_t lo = runs[j].lo > t0 ? runs[j].lo : t0;
        int64_t hi = runs[j].hi < t1 ? runs[j].hi : t1;
        if (a->state == STATE_INT8 && !runs[j].skip && runs[j].m_bound > 0.0f) {
            if (a->avx512)
                bound8_avx512(mb, (const uint8_t *)a->v, a->v_scale, t0, lo, hi,
                              runs[j].m_bound);
            else
                bound_m8(mb, (const uint8_t *)a->v, a->v_scale, t0, lo, hi, runs[j].m_bound);
        }
        if (bf16m)
            run_span_avx512(a, &runs[j], lo, hi - lo, (uint16_t *)a->m + lo,
                            (uint16_t *)a->v + lo, 1, NULL, NULL, NULL);
        else if (a->avx512)
            run_span_avx512(a, &runs[j], lo, hi - lo, m + (lo - t0), v + (lo - t0), 0,
                            sq + (lo - t0), rm + (lo - t0), rv + (lo - t0));
        else
            run_span(a, &runs[j], lo, hi - lo, m + (lo - t0), v + (lo - t0), sq + (lo - t0),
                     rm + (lo - t0), rv + (lo - t0));
    }
    if (!busy || a->state == STATE_FP32 || bf16m) return ri;
    if (a->state == STATE_BF16) {
        /* the updated elements, run by run (each with its key); the others keep the
         * bits they were stored with */
        for (int64_t j = ri; j < nruns && runs[j].lo < t1; j++) {
            if (runs[j].skip) continue;
            int64_t lo = runs[j].lo > t0 ? runs[j].lo : t0;
            int64_t hi = runs[j].hi < t1 ? runs[j].hi : t1;
            store_bf16_sr((uint16_t *)a->m + lo, (uint16_t *)a->v + lo, mb + (lo - t0),
                          vb + (lo - t0), hi - lo, (uint32_t)(a->first + lo), runs[j].key);
        }
        return ri;
    }
    encode_tile8(a, t0, k, mb, sq, rm, rv);
    return ri;
}

/* `isa` caps the code paths: 0 none of the optional ones, 1 the AVX2 stream, 2 also
 * the AVX-512 loop and codecs (each where the CPU has it). The clone that runs is
 * still the CPU's; the paths give the same bits, and tests compare them. */
INLINE block_args make_args(float *master, const float *src, const float *grad, void *m,
                            void *v, float *m_scale, float *v_scale, int32_t state, void *out,
                            int32_t out_dtype, float grad_scale, int64_t first, int32_t isa) {
    block_args a = {master, src ? src : master, grad, m, v, m_scale, v_scale, out, state,
                    out_dtype,
                    grad_scale != 1.0f, grad_scale,
                    isa >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"),
                    isa >= 2 && __builtin_cpu_supports("avx512f")
                        && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"),
                    first};
    return a;
}

/* Tiles of [lo, hi) (lo a multiple of TILE); `ri` as for tile. */
INLINE int64_t span(const block_args *a, const offload_run *runs, int64_t nruns, int64_t ri,
                    int64_t lo, int64_t hi) {
    for (int64_t t0 = lo; t0 < hi; t0 += TILE)
        ri = tile(a, runs, nruns, ri, t0, t0 + TILE < hi ? t0 + TILE : hi);
    return ri;
}

INLINE void fence(const block_args *a) {
    if ((a->stream || a->avx512) && (a->out_dtype == OUT_BF16 || a->out_dtype == OUT_FP16
                                     || a->src != a->master))
        _mm_sfence(); /* the streaming stores are visible before the caller goes on */
}

/* The update of elements [0, n) of one block. For int8 state, element 0 is the
 * first of a QBLOCK and m_scale / v_scale point at its scale. `first`: element 0's
 * model-wide index; `isa`: as make_args; `src`: where the master's current
 * values are (NULL: in `master`). Returns 0. */
EXPORT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
int offload_adam_block(int64_t n, float *master, const float *grad, void *m, void *v,
                       float *m_scale, float *v_scale, int32_t state, void *out,
                       int32_t out_dtype, float grad_scale, const offload_run *runs,
                       int64_t nruns, int64_t first, int32_t isa, const float *src) {
    block_args a = make_args(master, src, grad, m, v, m_scale, v_scale, state, out, out_dtype,
                             grad_scale, first, isa);
    span(&a, runs, nruns, 0, 0, n);
    fence(&a);
    return 0;
}

/* The same update, shared between threads: each caller claims units of `unit`
 * elements (a multiple of TILE) from the counter `*next` (unit index, starting
 * at 0) until none is left, so one call per thread covers its share of a whole
 * chunk, and a thread that loses its core claims fewer units. Returns the
 * number of units this caller updated. */
EXPORT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
int64_t offload_adam_claim(int64_t n, float *master, const float *grad, void *m, void *v,
                           float *m_scale, float *v_scale, int32_t state, void *out,
                           int32_t out_dtype, float grad_scale, const offload_run *runs,
                           int64_t nruns, int64_t first, int32_t isa, const float *src,
                           int64_t unit, int64_t *next) {
    block_args a = make_args(master, src, grad, m, v, m_scale, v_scale, state, out, out_dtype,
                             grad_scale, first, isa);
    int64_t ri = 0, done = 0;
    for (;;) {
        /* a thread's claims increase, so `ri` only moves forward */
        int64_t lo = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * unit;
        if (lo >= n) break;
        ri = span(&a, runs, nruns, ri, lo, lo + unit < n ? lo + unit : n);
        done++;
    }
    fence(&a);
    return done;
}

/* 1 when this build can be called at all (the loader's handshake). */
EXPORT int offload_adam_abi(void) { return 5; } /* 2: offload_adam_claim; 3: first, isa, key;
                                                  4: src; 5: int8 codes rounded
                                                  stochastically */
