// CPU kernels torch lacks, for float32 and bfloat16 (computed in float32): decode
// attention read through the block table, rotary embedding in place, RMSNorm. Built and
// loaded by runtime/kernels/__init__.py; the torch code each replaces computes the same
// thing and is what tests/runtime/test_cpu_kernels.py compares it with.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { MAX_DIM = 256, MAX_GROUP = 16, MAX_BLOCK = 256 };

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float f, int bf16) {
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        u |= 0x400000u;  // NaN stays NaN
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    }
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

// Decode attention: one query per row, each KV head's keys and values read in place from
// the pool (no gathered copy), online softmax per block.
// Pool layout per layer: [kv_heads, num_blocks, block_size, dim], contiguous.
// q, out: [rows, heads, dim]; block_tables: [rows, max_blocks]; context_lens: [rows].

// Row r, KV head kvh: the `group` query heads that share its keys. Inlined with `dim` a
// constant for the common head sizes, so its loops unroll.
static inline __attribute__((always_inline)) void attend_one(const void *q, const void *k_cache, const void *v_cache,
                              const int64_t *table, int ctx, void *out, int r, int kvh,
                              int heads, int group, int dim, int block_size,
                              int64_t head_stride, float scale, int bf16) {
    float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK], kf[MAX_DIM], vf[MAX_DIM];
    const int64_t q0 = ((int64_t)r * heads + (int64_t)kvh * group) * dim;
    for (int g = 0; g < group; g++) {
        for (int d = 0; d < dim; d++) {
            qf[g][d] = load(q, q0 + (int64_t)g * dim + d, bf16) * scale;
            acc[g][d] = 0.0f;
        }
        m[g] = -FLT_MAX;  // finite: the library is built with -ffast-math
        l[g] = 0.0f;
    }
    for (int j = 0; j * block_size < ctx; j++) {
        const int n = ctx - j * block_size < block_size ? ctx - j * block_size : block_size;
        const int64_t base = (int64_t)kvh * head_stride + table[j] * block_size * dim;
        for (int t = 0; t < n; t++) {
            for (int d = 0; d < dim; d++) kf[d] = load(k_cache, base + (int64_t)t * dim + d, bf16);
            for (int g = 0; g < group; g++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < dim; d++) dot += qf[g][d] * kf[d];
                s[g][t] = dot;
            }
        }
        for (int g = 0; g < group; g++) {
            float top = m[g];
            for (int t = 0; t < n; t++) top = s[g][t] > top ? s[g][t] : top;
            const float rescale = expf(m[g] - top);
            m[g] = top;
            l[g] *= rescale;
            for (int d = 0; d < dim; d++) acc[g][d] *= rescale;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < n; t++) {
                s[g][t] = expf(s[g][t] - top);
                sum += s[g][t];
            }
            l[g] += sum;
        }
        for (int t = 0; t < n; t++) {
            for (int d = 0; d < dim; d++) vf[d] = load(v_cache, base + (int64_t)t * dim + d, bf16);
            for (int g = 0; g < group; g++) {
                const float p = s[g][t];
#pragma omp simd
                for (int d = 0; d < dim; d++) acc[g][d] += p * vf[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int d = 0; d < dim; d++) store(out, q0 + (int64_t)g * dim + d, acc[g][d] * inv, bf16);
    }
}

static int paged_decode(const void *q, const void *k_cache, const void *v_cache,
                        const int64_t *block_tables, const int32_t *context_lens, void *out,
                        int rows, int heads, int kv_heads, int dim, int block_size,
                        int max_blocks, int64_t head_stride, float scale, int threads,
                        int bf16) {
    const int group = heads / kv_heads;
    if (dim > MAX_DIM || group > MAX_GROUP || block_size > MAX_BLOCK) return -1;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        for (int kvh = 0; kvh < kv_heads; kvh++) {
            const int64_t *table = block_tables + (int64_t)r * max_blocks;
            const int ctx = context_lens[r];
            if (dim == 64) {
                attend_one(q, k_cache, v_cache, table, ctx, out, r, kvh, heads, group, 64,
                           block_size, head_stride, scale, bf16);
            } else if (dim == 128) {
                attend_one(q, k_cache, v_cache, table, ctx, out, r, kvh, heads, group, 128,
                           block_size, head_stride, scale, bf16);
            } else {
                attend_one(q, k_cache, v_cache, table, ctx, out, r, kvh, heads, group, dim,
                           block_size, head_stride, scale, bf16);
            }
        }
    }
    return 0;
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int64_t *block_tables, const int32_t *context_lens, float *out,
                     int rows, int heads, int kv_heads, int dim, int block_size, int max_blocks,
                     int64_t head_stride, float scale, int threads) {
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, rows, heads,
                        kv_heads, dim, block_size, max_blocks, head_stride, scale, threads, 0);
}

int paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int64_t *block_tables, const int32_t *context_lens, uint16_t *out,
                      int rows, int heads, int kv_heads, int dim, int block_size,
                      int max_blocks, int64_t head_stride, float scale, int threads) {
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, rows, heads,
                        kv_heads, dim, block_size, max_blocks, head_stride, scale, threads, 1);
}

// Llama's (neox-style) rotary embedding in place: `x` rows of `heads` vectors of `dim`
// (row stride `row_stride` elements: the q and k columns of the qkv GEMM's output);
// `cos_sin` [T, 2 * dim] in x's dtype: cos | sin with rotate_half's sign folded in.
static void rope(void *x, const void *cos_sin, int tokens, int heads, int dim,
                 int64_t row_stride, int threads, int bf16) {
    const int half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        const int64_t cs = (int64_t)t * 2 * dim;
        float v[MAX_DIM];
        for (int h = 0; h < heads; h++) {
            const int64_t base = (int64_t)t * row_stride + (int64_t)h * dim;
            for (int d = 0; d < dim; d++) v[d] = load(x, base + d, bf16);
            for (int d = 0; d < dim; d++) {
                const float rolled = v[d < half ? d + half : d - half];
                const float c = load(cos_sin, cs + d, bf16), sn = load(cos_sin, cs + dim + d, bf16);
                store(x, base + d, v[d] * c + rolled * sn, bf16);
            }
        }
    }
}

int rope_f32(float *x, const float *cos_sin, int tokens, int heads, int dim,
             int64_t row_stride, int threads) {
    if (dim > MAX_DIM) return -1;
    rope(x, cos_sin, tokens, heads, dim, row_stride, threads, 0);
    return 0;
}

int rope_bf16(uint16_t *x, const uint16_t *cos_sin, int tokens, int heads, int dim,
              int64_t row_stride, int threads) {
    if (dim > MAX_DIM) return -1;
    rope(x, cos_sin, tokens, heads, dim, row_stride, threads, 1);
    return 0;
}

// RMSNorm of `x` [T, size] (contiguous) into `out`, accumulated in float32.
static void rms_norm(const void *x, const void *weight, void *out, int tokens, int size,
                     float eps, int threads, int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        const int64_t base = (int64_t)t * size;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < size; i++) {
            const float v = load(x, base + i, bf16);
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / size + eps);
        for (int i = 0; i < size; i++)
            store(out, base + i, load(x, base + i, bf16) * inv * load(weight, i, bf16), bf16);
    }
}

int rms_norm_f32(const float *x, const float *weight, float *out, int tokens, int size,
                 float eps, int threads) {
    rms_norm(x, weight, out, tokens, size, eps, threads, 0);
    return 0;
}

int rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int tokens,
                  int size, float eps, int threads) {
    rms_norm(x, weight, out, tokens, size, eps, threads, 1);
    return 0;
}
