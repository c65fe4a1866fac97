// CPU kernels torch lacks, for float32 and bfloat16 (computed in float32): decode
// attention read through the block table, rotary embedding in place, RMSNorm, the K/V
// write into pool slots, SwiGLU's product, a float32 GEMM over weights packed in column
// panels, and GEMMs over weights kept in GGUF's quantized blocks. Built and loaded by
// bucketserve/runtime/cpu/kernels/__init__.py; the torch code each replaces computes the
// same thing and is what tests/runtime/test_cpu_kernels.py compares it with (the block
// GEMMs: tests/runtime/test_block_gemm.py, against the gguf package's dequantization).
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__AVX__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

// The vector width follows the ISA the library is built for: 16 floats on AVX-512, 8 on
// AVX2 (x86-64-v3), 4 on NEON and anything else. So do the register blocks of the
// microkernels: FMA_COLS vectors of a 4-row block (4 x 4 where 32 vector registers hold
// them, 4 x 2 with AVX2's 16), and GEMM_MR rows of a panel's PANEL / VL vectors.
#if defined(__AVX512F__)
#define VL 16
enum { FMA_COLS = 4, GEMM_MR = 12 };
#elif defined(__AVX__)
#define VL 8
enum { FMA_COLS = 2, GEMM_MR = 3 };
#elif defined(__aarch64__)
#define VL 4
enum { FMA_COLS = 4, GEMM_MR = 6 };
#else
#define VL 4
enum { FMA_COLS = 2, GEMM_MR = 2 };
#endif

// The vector lanes this build computes with (the loader reports it; tests assert it).
int cpu_kernels_lanes(void) { return VL; }

// Head sizes a multiple of DIM_UNIT, on every ISA (each one's VL divides it).
// MASKED: a masked key's score, finite (the library is built with -ffast-math), its exp 0.
enum { MAX_DIM = 256, MAX_GROUP = 16, MAX_BLOCK = 256, DIM_UNIT = 16, MASKED = -1000000000 };

// The first key position a query at `pos` attends: with a sliding window of `window` keys
// (transformers' semantics: keys in (pos - window, pos]), else 0. `window` <= 0: none.
static inline int window_start(int pos, int window) {
    return window > 0 && pos >= window ? pos - window + 1 : 0;
}

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

typedef float vf __attribute__((vector_size(VL * 4), aligned(4), may_alias));

// Plain dereferences of the unaligned, aliasing vector type: one vector load or store. A
// 64-byte memcpy is split into two 32-byte moves where GCC prefers 256-bit vectors (Intel
// -march targets), and the 64-byte reload of a spilled copy then misses store forwarding:
// prefill attention then stalls on every such reload.
static inline __attribute__((always_inline)) vf vload(const float *p) { return *(const vf *)p; }

static inline __attribute__((always_inline)) void vstore(float *p, vf v) { *(vf *)p = v; }

typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2), may_alias));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

// VL elements from p + i, float32 or bfloat16, as float32.
static inline __attribute__((always_inline)) vf vload_as(const void *p, int64_t i, int bf16) {
    if (!bf16) return vload((const float *)p + i);
    const vh h = *(const vh *)((const uint16_t *)p + i);
    const vu u = __builtin_convertvector(h, vu) << 16;
    return (vf)u;
}

// VL floats to p + i as float32 or bfloat16 (each rounded as `store` rounds it).
static inline __attribute__((always_inline)) void vstore_as(void *p, int64_t i, vf f, int bf16) {
    if (!bf16) {
        vstore((float *)p + i, f);
        return;
    }
    const vu u = (vu)f;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vu r = ((u + 0x7fffu + ((u >> 16) & 1u)) & ~nan) | ((u | 0x400000u) & nan);
    *(vh *)((uint16_t *)p + i) = __builtin_convertvector(r >> 16, vh);
}

static inline __attribute__((always_inline)) float hsum(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX__)
    const __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
#elif defined(__aarch64__)
    return vaddvq_f32((float32x4_t)v);
#else
    float t = 0.0f;
    for (int i = 0; i < VL; i++) t += v[i];
    return t;
#endif
}

// Decode attention: one query per row, each KV head's keys and values read in place from
// the pool (no gathered copy), online softmax per block.
// Pool layout per layer: [kv_heads, num_blocks, block_size, dim], contiguous.
// q: [rows, heads, dim], rows q_stride elements apart (the q columns of the qkv output);
// out: [rows, heads, dim], contiguous; block_tables: [rows, max_blocks]; context_lens: [rows].

// Row r, KV head kvh: the `group` query heads that share its keys, their queries and
// accumulators in vector registers. Inlined with `group` and `dim` (a multiple of VL)
// constants for the common shapes, so its loops unroll.
static inline __attribute__((always_inline)) void attend_one(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                              const int64_t *table, int ctx, int window, void *out, int r, int kvh,
                              int heads, int group, int dim, int block_size,
                              int64_t head_stride, float scale, int bf16) {
    enum { MAX_VECS = MAX_DIM / VL };
    const int nv = dim / VL;
    vf qv[MAX_GROUP][MAX_VECS], acc[MAX_GROUP][MAX_VECS];
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK];
    const int64_t q0 = (int64_t)r * q_stride + (int64_t)kvh * group * dim;
    const int64_t o0 = ((int64_t)r * heads + (int64_t)kvh * group) * dim;
    for (int g = 0; g < group; g++) {
        for (int c = 0; c < nv; c++) {
            qv[g][c] = vload_as(q, q0 + g * dim + c * VL, bf16) * scale;
            acc[g][c] = (vf){0};
        }
        m[g] = -FLT_MAX;  // finite: the library is built with -ffast-math
        l[g] = 0.0f;
    }
    // Blocks wholly before the window are never read; its first block's keys before it
    // are masked.
    const int lo = ctx > 0 ? window_start(ctx - 1, window) : 0;
    for (int j = lo / block_size; j * block_size < ctx; j++) {
        const int n = ctx - j * block_size < block_size ? ctx - j * block_size : block_size;
        const int skip = lo - j * block_size;
        const int64_t base = (int64_t)kvh * head_stride + table[j] * block_size * dim;
        // The next block sits anywhere in the pool, out of the hardware prefetcher's
        // stride: key t's loop fetches the next block's key and value t. Spread out, the
        // prefetches never stall on full miss buffers, which one burst per block did. Into
        // every cache level: non-temporal prefetches slowed decode attention down on a
        // Sapphire Rapids class VM (the line was gone again by the time the loop read it).
        const int64_t next = (j + 1) * block_size < ctx
                                 ? (int64_t)kvh * head_stride + table[j + 1] * block_size * dim
                                 : base;
        const int es = bf16 ? 2 : 4;
        for (int t = 0; t < n; t++) {
            const int64_t at = base + (int64_t)t * dim;
            for (int64_t b = 0; b < dim * es; b += 64) {
                __builtin_prefetch((const char *)k_cache + (next + t * dim) * es + b, 0, 3);
                __builtin_prefetch((const char *)v_cache + (next + t * dim) * es + b, 0, 3);
            }
            vf k[MAX_VECS];
            for (int c = 0; c < nv; c++) k[c] = vload_as(k_cache, at + c * VL, bf16);
            for (int g = 0; g < group; g++) {
                vf dot = qv[g][0] * k[0];
                for (int c = 1; c < nv; c++) dot += qv[g][c] * k[c];
                s[g][t] = hsum(dot);
            }
        }
        if (skip > 0)
            for (int g = 0; g < group; g++)
                for (int t = 0; t < skip; t++) s[g][t] = (float)MASKED;
        for (int g = 0; g < group; g++) {
            float top = m[g];
            for (int t = 0; t < n; t++) top = s[g][t] > top ? s[g][t] : top;
            const float rescale = expf(m[g] - top);
            m[g] = top;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < n; t++) {
                s[g][t] = expf(s[g][t] - top);
                sum += s[g][t];
            }
            l[g] = l[g] * rescale + sum;
            if (rescale != 1.0f)
                for (int c = 0; c < nv; c++) acc[g][c] *= rescale;
        }
        for (int t = 0; t < n; t++) {
            vf v[MAX_VECS];
            for (int c = 0; c < nv; c++) v[c] = vload_as(v_cache, base + (int64_t)t * dim + c * VL, bf16);
            for (int g = 0; g < group; g++)
                for (int c = 0; c < nv; c++) acc[g][c] += s[g][t] * v[c];
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int c = 0; c < nv; c++) {
            const vf o = acc[g][c] * inv;
            for (int i = 0; i < VL; i++) store(out, o0 + g * dim + c * VL + i, o[i], bf16);
        }
    }
}

// attend_one with `group` a constant for the common GQA ratios.
static inline __attribute__((always_inline)) void attend_groups(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                              const int64_t *table, int ctx, int window, void *out, int r, int kvh,
                              int heads, int group, int dim, int block_size,
                              int64_t head_stride, float scale, int bf16) {
#define ATTEND(G) attend_one(q, q_stride, k_cache, v_cache, table, ctx, window, out, r, kvh, heads, G, dim, \
                             block_size, head_stride, scale, bf16)
    switch (group) {
    case 1: ATTEND(1); break;
    case 2: ATTEND(2); break;
    case 3: ATTEND(3); break;
    case 4: ATTEND(4); break;
    case 5: ATTEND(5); break;
    case 6: ATTEND(6); break;
    case 7: ATTEND(7); break;
    case 8: ATTEND(8); break;
    default: ATTEND(group);
    }
#undef ATTEND
}

// attend_one for token row r, with `dim` a constant for the common head sizes.
static void attend_row(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                       const int64_t *table, int ctx, int window, void *out, int r, int kvh, int heads,
                       int group, int dim, int block_size, int64_t head_stride, float scale,
                       int bf16) {
    if (dim == 64) {
        attend_groups(q, q_stride, k_cache, v_cache, table, ctx, window, out, r, kvh, heads, group, 64,
                      block_size, head_stride, scale, bf16);
    } else if (dim == 128) {
        attend_groups(q, q_stride, k_cache, v_cache, table, ctx, window, out, r, kvh, heads, group, 128,
                      block_size, head_stride, scale, bf16);
    } else {
        attend_one(q, q_stride, k_cache, v_cache, table, ctx, window, out, r, kvh, heads, group, dim, block_size,
                   head_stride, scale, bf16);
    }
}

// Rows that share a cached prefix share its first block: run them one after another, so
// the prefix's keys and values are still in cache for the next row. The order of `rows`
// rows by first block (ties and rows without context by index); NULL if out of memory.
struct row_key {
    int64_t block;
    int row;
};

static int by_first_block(const void *a, const void *b) {
    const struct row_key *x = a, *y = b;
    if (x->block != y->block) return x->block < y->block ? -1 : 1;
    return x->row - y->row;
}

static int *rows_by_first_block(const int64_t *block_tables, const int64_t *starts,
                                const int32_t *context_lens, int rows, int max_blocks) {
    struct row_key *keys = malloc(sizeof(struct row_key) * (rows + 1));
    int *order = malloc(sizeof(int) * (rows + 1));
    if (keys && order) {
        for (int r = 0; r < rows; r++) {
            const int64_t at = starts ? starts[r] : (int64_t)r * max_blocks;
            keys[r].block = context_lens[r] > 0 ? block_tables[at] : -1;
            keys[r].row = r;
        }
        qsort(keys, rows, sizeof(struct row_key), by_first_block);
        for (int r = 0; r < rows; r++) order[r] = keys[r].row;
    } else {
        free(order);
        order = NULL;
    }
    free(keys);
    return order;
}

// Row r's blocks start at block_tables + starts[r] (a flat block list, vllm-gaudi's decode
// layout) when `starts` is given, else at block_tables + r * max_blocks (one table per row).
static int paged_decode(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        const int64_t *block_tables, const int64_t *starts,
                        const int32_t *context_lens, void *out, int rows, int heads,
                        int kv_heads, int dim, int block_size, int max_blocks,
                        int64_t head_stride, float scale, int window, int threads, int bf16) {
    const int group = heads / kv_heads;
    if (dim > MAX_DIM || dim % DIM_UNIT || group > MAX_GROUP || block_size > MAX_BLOCK) return -1;
    int *order = rows_by_first_block(block_tables, starts, context_lens, rows, max_blocks);
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int i = 0; i < rows; i++) {
        for (int kvh = 0; kvh < kv_heads; kvh++) {
            const int r = order ? order[i] : i;
            const int64_t at = starts ? starts[r] : (int64_t)r * max_blocks;
            attend_row(q, q_stride, k_cache, v_cache, block_tables + at, context_lens[r], window,
                       out, r, kvh, heads, group, dim, block_size, head_stride, scale, bf16);
        }
    }
    free(order);
    return 0;
}

int paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int64_t *block_tables, const int32_t *context_lens, float *out,
                     int rows, int heads, int kv_heads, int dim, int block_size, int max_blocks,
                     int64_t head_stride, float scale, int window, int threads) {
    return paged_decode(q, q_stride, k_cache, v_cache, block_tables, NULL, context_lens, out,
                        rows, heads, kv_heads, dim, block_size, max_blocks, head_stride, scale,
                        window, threads, 0);
}

int paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int64_t *block_tables, const int32_t *context_lens, uint16_t *out,
                      int rows, int heads, int kv_heads, int dim, int block_size,
                      int max_blocks, int64_t head_stride, float scale, int window, int threads) {
    return paged_decode(q, q_stride, k_cache, v_cache, block_tables, NULL, context_lens, out,
                        rows, heads, kv_heads, dim, block_size, max_blocks, head_stride, scale,
                        window, threads, 1);
}

int paged_decode_flat_f32(const float *q, int64_t q_stride, const float *k_cache,
                          const float *v_cache, const int64_t *block_list,
                          const int64_t *block_starts, const int32_t *context_lens, float *out,
                          int rows, int heads, int kv_heads, int dim, int block_size,
                          int num_blocks, int64_t head_stride, float scale, int window, int threads) {
    return paged_decode(q, q_stride, k_cache, v_cache, block_list, block_starts, context_lens,
                        out, rows, heads, kv_heads, dim, block_size, num_blocks, head_stride,
                        scale, window, threads, 0);
}

int paged_decode_flat_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int64_t *block_list,
                           const int64_t *block_starts, const int32_t *context_lens,
                           uint16_t *out, int rows, int heads, int kv_heads, int dim,
                           int block_size, int num_blocks, int64_t head_stride, float scale,
                           int window, int threads) {
    return paged_decode(q, q_stride, k_cache, v_cache, block_list, block_starts, context_lens,
                        out, rows, heads, kv_heads, dim, block_size, num_blocks, head_stride,
                        scale, window, threads, 1);
}

// Varlen attention of a step with prompt chunks: sequence s has queries at flat tokens
// [query_start[s], query_start[s + 1]), the last at position context_lens[s] - 1, and
// attends causally to its first context_lens[s] pool tokens through its block table row.
// Rows with one query take the decode path above; prompt chunks run a tiled flash
// attention: each chunk's keys (transposed) and values are first gathered from the pool
// once per KV head into float32 buffers, then each tile of (query, head) rows computes
// S = Q K^T and O += P V in register-blocked vector code, with an online softmax.

enum { TILE_ROWS = 64, TILE_KEYS = 64 };

// Keeps a loaded vector in a register: without it GCC folds its load into each of the
// FMAs that use it, and the microkernels below become load-bound. The vector type is the
// ISA's register width, so the constraint always fits.
#if defined(__x86_64__)
#define IN_REGISTER(a) __asm__("" : "+v"(a))
#elif defined(__aarch64__)
#define IN_REGISTER(a) __asm__("" : "+w"(a))
#else
#define IN_REGISTER(a)
#endif

// The microkernels' 4 x FMA_COLS register block: acc[i][c] += a[i * stride] * b[c * VL : +VL].
static inline __attribute__((always_inline)) void fma_block(vf acc[4][FMA_COLS], const float *a,
                                                            int64_t stride, const float *b) {
    vf bv[FMA_COLS];
#pragma GCC unroll 4
    for (int c = 0; c < FMA_COLS; c++) {
        bv[c] = vload(b + c * VL);
        IN_REGISTER(bv[c]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const float x = a[i * stride];
#pragma GCC unroll 4
        for (int c = 0; c < FMA_COLS; c++) acc[i][c] += x * bv[c];
    }
}

// S[rows, TILE_KEYS] = Q[rows, dim] . Kt[dim, keys0 : keys0 + TILE_KEYS] (Kt row stride kstride).
static void tile_scores(const float *Q, const float *Kt, int64_t kstride, float *S, int rows,
                        int dim) {
    for (int r = 0; r < rows; r += 4) {
        for (int c0 = 0; c0 < TILE_KEYS; c0 += FMA_COLS * VL) {
            vf acc[4][FMA_COLS];
            memset(acc, 0, sizeof acc);
            for (int d = 0; d < dim; d++)
                fma_block(acc, Q + r * dim + d, dim, Kt + (int64_t)d * kstride + c0);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
                for (int c = 0; c < FMA_COLS; c++)
                    vstore(S + (r + i) * TILE_KEYS + c0 + c * VL, acc[i][c]);
        }
    }
}

// O[rows, dim] = O * rescale[row] + P[rows, keys] . V[keys, dim], `dim` a multiple of VL
// (the online softmax's rescale of O rides on loading it). FMA_COLS-vector column blocks
// keep their accumulators in registers (constant loop bounds: a variable width sent them
// to the stack, copied 8 bytes at a time); what is left of `dim` goes a vector at a time.
static void tile_values(const float *P, const float *V, float *O, const float *rescale,
                        int rows, int keys, int dim) {
    for (int r = 0; r < rows; r += 4) {
        int c0 = 0;
        for (; c0 + FMA_COLS * VL <= dim; c0 += FMA_COLS * VL) {
            vf acc[4][FMA_COLS];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
                for (int c = 0; c < FMA_COLS; c++)
                    acc[i][c] = vload(O + (r + i) * dim + c0 + c * VL) * rescale[r + i];
            for (int j = 0; j < keys; j++)
                fma_block(acc, P + r * TILE_KEYS + j, TILE_KEYS, V + (int64_t)j * dim + c0);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
                for (int c = 0; c < FMA_COLS; c++) vstore(O + (r + i) * dim + c0 + c * VL, acc[i][c]);
        }
        for (; c0 < dim; c0 += VL) {
            vf acc[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) acc[i] = vload(O + (r + i) * dim + c0) * rescale[r + i];
            for (int j = 0; j < keys; j++) {
                const vf v = vload(V + (int64_t)j * dim + c0);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) acc[i] += P[(r + i) * TILE_KEYS + j] * v;
            }
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) vstore(O + (r + i) * dim + c0, acc[i]);
        }
    }
}

// A tile's rows: row r is query qa + r / group of its chunk and head kvh * group + r % group,
// at position pos[r] (-1: a padding row past `rows`), attending keys from position from[r]
// (its sliding window's start, else 0), with its online softmax state.
struct tile_rows {
    float m[TILE_ROWS], l[TILE_ROWS], rescale[TILE_ROWS];
    int pos[TILE_ROWS], from[TILE_ROWS];
};

// The rows' positions and fresh softmax state, O [padded, dim] zero.
static void tile_begin(struct tile_rows *t, float *O, int rows, int padded, int p0, int qa,
                       int group, int dim, int window) {
    memset(O, 0, sizeof(float) * padded * dim);
    for (int r = 0; r < padded; r++) {
        t->pos[r] = r < rows ? p0 + qa + r / group : -1;
        t->from[r] = r < rows ? window_start(t->pos[r], window) : 0;
        t->m[r] = MASKED;
        t->l[r] = 0.0f;
    }
}

// The first key tile (a multiple of TILE_KEYS past the gathered context's first key kbase)
// holding a key that the tile's first query attends.
static inline int tile_keys_start(int from, int kbase) {
    return kbase + (from - kbase) / TILE_KEYS * TILE_KEYS;
}

// Where row r's query vector starts in q (row stride q_stride).
static inline int64_t tile_q_at(int r, int64_t tok0, int qa, int kvh, int group, int64_t q_stride,
                                int dim) {
    return (tok0 + qa + r / group) * q_stride + ((int64_t)kvh * group + r % group) * dim;
}

// O / l of a tile's rows into out [T, heads, dim].
static void tile_store(void *out, const float *O, const float *l, int rows, int64_t tok0, int qa,
                       int kvh, int heads, int group, int dim, int bf16) {
    for (int r = 0; r < rows; r++) {
        const int64_t at =
            ((tok0 + qa + r / group) * heads + (int64_t)kvh * group + r % group) * dim;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < dim; d += VL) vstore_as(out, at + d, vload(O + r * dim + d) * inv, bf16);
    }
}

// One tile: queries [qa, qb) of a chunk whose first query sits at position p0 and flat
// token tok0, the `group` heads of KV head kvh; Kt [dim, kstride] and V [keys, dim] hold
// the chunk's context for that KV head from key position kbase on. `scratch` holds
// 2 * TILE_ROWS * dim + TILE_ROWS * TILE_KEYS floats.
static void prefill_tile(const void *q, int64_t q_stride, void *out, const float *Kt, int64_t kstride,
                         const float *V, int kbase, int64_t tok0, int p0, int qa, int qb, int kvh,
                         int heads, int group, int dim, float scale, int window, int bf16,
                         float *scratch) {
    const int rows = (qb - qa) * group, padded = (rows + 3) & ~3;
    float *Q = scratch, *O = Q + TILE_ROWS * dim, *S = O + TILE_ROWS * dim;
    struct tile_rows t;
    float *m = t.m, *l = t.l, *rescale = t.rescale;
    const int *pos = t.pos, *from = t.from;
    tile_begin(&t, O, rows, padded, p0, qa, group, dim, window);
    memset(Q + rows * dim, 0, sizeof(float) * (padded - rows) * dim);
    for (int r = 0; r < rows; r++) {
        const int64_t at = tile_q_at(r, tok0, qa, kvh, group, q_stride, dim);
        for (int d = 0; d < dim; d++) Q[r * dim + d] = load(q, at + d, bf16) * scale;
    }
    const int keys_end = p0 + qb;
    for (int k0 = tile_keys_start(from[0], kbase); k0 < keys_end; k0 += TILE_KEYS) {
        const int nk = keys_end - k0 < TILE_KEYS ? keys_end - k0 : TILE_KEYS;
        tile_scores(Q, Kt + (k0 - kbase), kstride, S, padded, dim);
        for (int r = 0; r < padded; r++) {
            float *s = S + r * TILE_KEYS;
            // keys j of the tile in [first, seen) count: one unsigned compare per key
            const int seen = pos[r] - k0 + 1 < nk ? pos[r] - k0 + 1 : nk, first = from[r] - k0;
            const unsigned span = seen > first ? (unsigned)(seen - first) : 0u;
            float top = m[r];
            for (int j = 0; j < TILE_KEYS; j++) {
                s[j] = (unsigned)(j - first) < span ? s[j] : (float)MASKED;
                top = s[j] > top ? s[j] : top;
            }
            // exp's arguments are kept >= -80: the vector expf takes a slow scalar path
            // for every lane that underflows (masked scores), and exp(-80) is ~0 anyway.
            rescale[r] = expf(fmaxf(m[r] - top, -80.0f));
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < TILE_KEYS; j++) {
                const float p = expf(fmaxf(s[j] - top, -80.0f));
                s[j] = (unsigned)(j - first) < span ? p : 0.0f;
                sum += s[j];
            }
            m[r] = top;
            l[r] = l[r] * rescale[r] + sum;
        }
        tile_values(S, V + (int64_t)(k0 - kbase) * dim, O, rescale, padded, nk, dim);
    }
    tile_store(out, O, l, rows, tok0, qa, kvh, heads, group, dim, bf16);
}

// Chunk s's context from key position kbase on, for KV head kvh, into Kt [dim, kstride]
// (transposed, zero past ctx) and V [kstride, dim].
static void gather_context(const void *k_cache, const void *v_cache, const int64_t *table,
                           int ctx, int kbase, int kvh, int dim, int block_size, int64_t head_stride,
                           int64_t kstride, float *Kt, float *V, int bf16) {
    for (int j = 0; j < kstride; j++) {
        const int key = kbase + j;
        if (key >= ctx) {
            for (int d = 0; d < dim; d++) Kt[(int64_t)d * kstride + j] = V[(int64_t)j * dim + d] = 0.0f;
            continue;
        }
        const int64_t base = (int64_t)kvh * head_stride + (table[key / block_size] * block_size + key % block_size) * dim;
        for (int d = 0; d < dim; d++) {
            Kt[(int64_t)d * kstride + j] = load(k_cache, base + d, bf16);
            V[(int64_t)j * dim + d] = load(v_cache, base + d, bf16);
        }
    }
}

// bfloat16 prompt chunks on a CPU with AMX: both products of a tile run on the tile unit
// (16 x 16 float32 blocks, bfloat16 pairs), the online softmax stays in float32 vector
// code, and P is rounded to bfloat16 for P V, as GPU flash attention does. The chunk's
// context is gathered per KV head in the layouts the tile loads read: keys as 16-key
// blocks of [dim / 2][16][2] (K^T in pairs of dims), values as [keys / 2][dim][2].
#if HAVE_AMX
// Linux (5.16+) lets a process use the tile registers only once it has asked; the answer
// holds for all its threads. BUCKETSERVE_AMX=0 keeps the float32 vector path (A/B runs).
static int amx_usable(void) {
    static int granted = 0;  // 0: not asked yet, 1: yes, -1: refused
    const char *env = getenv("BUCKETSERVE_AMX");
    if (env && env[0] == '0') return 0;
    if (granted == 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return granted == 1;
}

// Every tile register as 16 rows of 64 bytes; the configuration is per thread.
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}
#else
static int amx_usable(void) { return 0; }
static void amx_configure(void) {}
#endif

// Whether bfloat16 prompt chunks (head size a multiple of 64) take the tile path.
int amx_prefill(void) { return amx_usable(); }

static void gather_context_amx(const uint16_t *k_cache, const uint16_t *v_cache,
                               const int64_t *table, int ctx, int kbase, int kvh, int dim,
                               int block_size, int64_t head_stride, int64_t keys, uint16_t *Kb,
                               uint16_t *Vv) {
    for (int64_t j = 0; j < keys; j++) {
        const int64_t key = kbase + j;
        const int64_t base = key < ctx ? (int64_t)kvh * head_stride +
                                             (table[key / block_size] * block_size + key % block_size) * dim
                                       : -1;
        uint16_t *kb = Kb + j / 16 * 16 * dim + j % 16 * 2, *vv = Vv + j / 2 * 2 * dim + j % 2;
        for (int d = 0; d < dim; d++) {
            kb[d / 2 * 32 + d % 2] = base < 0 ? 0 : k_cache[base + d];
            vv[2 * d] = base < 0 ? 0 : v_cache[base + d];
        }
    }
}

#if HAVE_AMX
// exp(x) for x <= 0 (clamped at -80, where it is ~0): 2^n e^r with |r| <= ln 2 / 2, a
// degree-5 Taylor polynomial (relative error < 3e-6; P is then rounded to bfloat16's
// 4e-3), 2^n applied by scalef.
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-80.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 e = _mm512_set1_ps(1.0f / 120);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
}

// Lanes [c * 16, c * 16 + 16) below `seen`.
static inline __attribute__((always_inline)) __mmask16 lanes_below(int seen, int c) {
    const int n = seen - c * 16;
    return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

// Lanes [c * 16, c * 16 + 16) in [first, seen) (first <= 0: all below seen).
static inline __attribute__((always_inline)) __mmask16 lanes_between(int first, int seen, int c) {
    const __mmask16 below = lanes_below(seen, c);
    return first > 0 ? below & (__mmask16)~lanes_below(first, c) : below;
}

// prefill_tile on the tile unit, for bfloat16 and dim a multiple of 64. Four accumulator
// tiles are in flight at a time: one tile product's latency is about three times its
// issue interval. `scratch` holds TILE_ROWS * dim floats of O, TILE_ROWS * TILE_KEYS of S,
// then Q and P in bfloat16.
static void prefill_tile_amx(const uint16_t *q, int64_t q_stride, uint16_t *out,
                             const uint16_t *Kb, const uint16_t *Vv, int kbase, int64_t tok0,
                             int p0, int qa, int qb, int kvh, int heads, int group, int dim,
                             float scale, int window, float *scratch) {
    _Static_assert(TILE_KEYS == 64, "four 16-key accumulators and two 32-key products per tile");
    const int rows = (qb - qa) * group, padded = (rows + 15) & ~15;
    float *O = scratch, *S = O + TILE_ROWS * dim;
    uint16_t *Q = (uint16_t *)(S + TILE_ROWS * TILE_KEYS), *P = Q + TILE_ROWS * dim;
    struct tile_rows t;
    float *m = t.m, *l = t.l, *rescale = t.rescale;
    const int *pos = t.pos, *from = t.from;
    tile_begin(&t, O, rows, padded, p0, qa, group, dim, window);
    memset(Q + rows * dim, 0, sizeof(uint16_t) * (padded - rows) * dim);
    for (int r = 0; r < rows; r++)
        memcpy(Q + r * dim, q + tile_q_at(r, tok0, qa, kvh, group, q_stride, dim),
               sizeof(uint16_t) * dim);
    const __m512 vscale = _mm512_set1_ps(scale), masked = _mm512_set1_ps((float)MASKED);
    const int keys_end = p0 + qb;
    for (int k0 = tile_keys_start(from[0], kbase); k0 < keys_end; k0 += TILE_KEYS) {
        const int nk = keys_end - k0 < TILE_KEYS ? keys_end - k0 : TILE_KEYS;
        // S = Q K^T: the row block's four 16-key blocks at once (none where every row of
        // the block is before k0 or every row's window starts after these keys: the
        // softmax masks them).
        for (int rb = 0; rb < padded; rb += 16) {
            if (pos[rb + 15 < rows ? rb + 15 : rows - 1] < k0 || from[rb] >= k0 + TILE_KEYS) continue;
            const uint16_t *kb = Kb + (int64_t)(k0 - kbase) * dim;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int d0 = 0; d0 < dim; d0 += 32) {
                _tile_loadd(4, Q + rb * dim + d0, dim * 2);
                _tile_loadd(5, kb + d0 * 16, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, kb + 16 * dim + d0 * 16, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, kb + 32 * dim + d0 * 16, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, kb + 48 * dim + d0 * 16, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, S + rb * TILE_KEYS, TILE_KEYS * 4);
            _tile_stored(1, S + rb * TILE_KEYS + 16, TILE_KEYS * 4);
            _tile_stored(2, S + rb * TILE_KEYS + 32, TILE_KEYS * 4);
            _tile_stored(3, S + rb * TILE_KEYS + 48, TILE_KEYS * 4);
        }
        // Online softmax: scale and mask, each row's new maximum, the rescales of all rows
        // in vectors, then P (bfloat16) and each row's sum.
        for (int r = 0; r < padded; r++) {
            float *s = S + r * TILE_KEYS;
            const int seen = pos[r] - k0 + 1 < nk ? pos[r] - k0 + 1 : nk, first = from[r] - k0;
            __m512 top = _mm512_set1_ps(m[r]);
            for (int c = 0; c < 4; c++) {
                const __m512 x = _mm512_mask_mul_ps(masked, lanes_between(first, seen, c),
                                                    _mm512_loadu_ps(s + c * 16), vscale);
                _mm512_storeu_ps(s + c * 16, x);
                top = _mm512_max_ps(top, x);
            }
            rescale[r] = _mm512_reduce_max_ps(top);  // the new maximum, for now
        }
        for (int r = 0; r < padded; r += 16) {
            const __m512 top = _mm512_loadu_ps(rescale + r);
            _mm512_storeu_ps(rescale + r, exp512(_mm512_sub_ps(_mm512_loadu_ps(m + r), top)));
            _mm512_storeu_ps(m + r, top);
        }
        for (int r = 0; r < padded; r++) {
            const float *s = S + r * TILE_KEYS;
            const int seen = pos[r] - k0 + 1 < nk ? pos[r] - k0 + 1 : nk, first = from[r] - k0;
            const __m512 top = _mm512_set1_ps(m[r]);
            __m512 p[4];
            for (int c = 0; c < 4; c++) {
                const __mmask16 live = lanes_between(first, seen, c);
                p[c] = live ? _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + c * 16), top)))
                            : _mm512_setzero_ps();
            }
            _mm512_storeu_si512(P + r * TILE_KEYS, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
            _mm512_storeu_si512(P + r * TILE_KEYS + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
            l[r] = l[r] * rescale[r] +
                   _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
            const __m512 by = _mm512_set1_ps(rescale[r]);
            for (int d = 0; d < dim; d += 16)
                _mm512_storeu_ps(O + r * dim + d, _mm512_mul_ps(_mm512_loadu_ps(O + r * dim + d), by));
        }
        // O += P V: four 16-dim accumulator tiles of a row block, 32 keys per product;
        // key halves past the row block's last position, or before its first row's window,
        // are all zero in P.
        for (int rb = 0; rb < padded; rb += 16) {
            const int last = pos[rb + 15 < rows ? rb + 15 : rows - 1];
            float *o = O + rb * dim;
            for (int c0 = 0; c0 < dim; c0 += 64) {
                _tile_loadd(0, o + c0, dim * 4);
                _tile_loadd(1, o + c0 + 16, dim * 4);
                _tile_loadd(2, o + c0 + 32, dim * 4);
                _tile_loadd(3, o + c0 + 48, dim * 4);
                for (int kh = 0; kh < TILE_KEYS && k0 + kh <= last; kh += 32) {
                    if (k0 + kh + 32 <= from[rb]) continue;
                    const uint16_t *v = Vv + (int64_t)(k0 - kbase + kh) * dim + c0 * 2;
                    _tile_loadd(4, P + rb * TILE_KEYS + kh, TILE_KEYS * 2);
                    _tile_loadd(5, v, dim * 4);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, v + 32, dim * 4);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(7, v + 64, dim * 4);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, v + 96, dim * 4);
                    _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, o + c0, dim * 4);
                _tile_stored(1, o + c0 + 16, dim * 4);
                _tile_stored(2, o + c0 + 32, dim * 4);
                _tile_stored(3, o + c0 + 48, dim * 4);
            }
        }
    }
    tile_store(out, O, l, rows, tok0, qa, kvh, heads, group, dim, 1);
}
#endif

static int paged_prefill(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const int64_t *block_tables, const int32_t *query_start,
                         const int32_t *context_lens, void *out, int seqs, int heads,
                         int kv_heads, int dim, int block_size, int max_blocks,
                         int64_t head_stride, float scale, int window, int threads, int bf16) {
    const int group = heads / kv_heads;
    if (dim > MAX_DIM || dim % DIM_UNIT || group > MAX_GROUP || block_size > MAX_BLOCK) return -1;
    const int per_tile = TILE_ROWS / group, amx = bf16 && dim % 64 == 0 && amx_usable();
    // Work items: (seq, kvh) of one-query rows, (seq, kvh, tile) of chunks, each chunk's
    // last tiles (the most keys) first. A chunk's context is gathered from the first key
    // its first query attends (kbase: all of it without a sliding window).
    int64_t chunk_keys = 0, items = 0;
    int64_t *offset = malloc(sizeof(int64_t) * (seqs + 1));
    if (!offset) return -2;
    for (int s = 0; s < seqs; s++) {
        const int n = query_start[s + 1] - query_start[s];
        const int kbase = window_start(context_lens[s] - n, window);
        offset[s] = chunk_keys;
        if (n > 1 && context_lens[s] > 0)
            chunk_keys += (context_lens[s] - kbase + TILE_KEYS - 1) / TILE_KEYS * TILE_KEYS;
        items += n > 1 ? (n + per_tile - 1) / per_tile : context_lens[s] > 0;
    }
    offset[seqs] = chunk_keys;
    float *Kt = malloc(sizeof(float) * (chunk_keys * dim * kv_heads + 1));
    float *V = malloc(sizeof(float) * (chunk_keys * dim * kv_heads + 1));
    int32_t *item_seq = malloc(sizeof(int32_t) * (items + 1));
    int32_t *item_tile = malloc(sizeof(int32_t) * (items + 1));
    int *order = rows_by_first_block(block_tables, NULL, context_lens, seqs, max_blocks);
    int ok = Kt && V && item_seq && item_tile && order;
    if (ok) {
        int64_t i = 0;
        for (int k = 0; k < seqs; k++) {
            const int s = order[k];
            const int n = query_start[s + 1] - query_start[s];
            const int tiles = n > 1 ? (n + per_tile - 1) / per_tile : context_lens[s] > 0;
            for (int t = tiles - 1; t >= 0; t--, i++) {
                item_seq[i] = s;
                item_tile[i] = t;
            }
        }
#pragma omp parallel num_threads(threads)
        {
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int s = 0; s < seqs; s++) {
                for (int kvh = 0; kvh < kv_heads; kvh++) {
                    const int64_t keys = offset[s + 1] - offset[s];
                    if (keys == 0) continue;
                    const int64_t at = (offset[s] * kv_heads + keys * kvh) * dim;
                    const int64_t *table = block_tables + (int64_t)s * max_blocks;
                    const int ctx = context_lens[s];
                    const int kbase = window_start(ctx - (query_start[s + 1] - query_start[s]), window);
                    if (amx)
                        gather_context_amx(k_cache, v_cache, table, ctx, kbase, kvh, dim,
                                           block_size, head_stride, keys, (uint16_t *)Kt + at,
                                           (uint16_t *)V + at);
                    else
                        gather_context(k_cache, v_cache, table, ctx, kbase, kvh, dim, block_size,
                                       head_stride, keys, Kt + at, V + at, bf16);
                }
            }
            float *scratch = malloc(sizeof(float) * 2 * (TILE_ROWS * dim + TILE_ROWS * TILE_KEYS));
            if (amx) amx_configure();
            if (!scratch) {
#pragma omp atomic write
                ok = 0;
            }
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                for (int kvh = 0; kvh < kv_heads; kvh++) {
                    const int s = item_seq[it], t = item_tile[it];
                    const int n = query_start[s + 1] - query_start[s], ctx = context_lens[s];
                    const int64_t *table = block_tables + (int64_t)s * max_blocks;
                    if (n == 1) {
                        attend_row(q, q_stride, k_cache, v_cache, table, ctx, window, out, query_start[s],
                                   kvh, heads, group, dim, block_size, head_stride, scale, bf16);
                        continue;
                    }
                    const int kbase = window_start(ctx - n, window);
                    const int64_t keys = offset[s + 1] - offset[s];
                    const int64_t at = (offset[s] * kv_heads + keys * kvh) * dim;
                    const int qa = t * per_tile, qb = qa + per_tile < n ? qa + per_tile : n;
                    if (!scratch) continue;
#if HAVE_AMX
                    if (amx) {
                        prefill_tile_amx(q, q_stride, out, (const uint16_t *)Kt + at,
                                         (const uint16_t *)V + at, kbase, query_start[s], ctx - n,
                                         qa, qb, kvh, heads, group, dim, scale, window, scratch);
                        continue;
                    }
#endif
                    prefill_tile(q, q_stride, out, Kt + at, keys, V + at, kbase, query_start[s],
                                 ctx - n, qa, qb, kvh, heads, group, dim, scale, window, bf16,
                                 scratch);
                }
            }
#if HAVE_AMX
            if (amx) _tile_release();
#endif
            free(scratch);
        }
    }
    free(offset);
    free(Kt);
    free(V);
    free(item_seq);
    free(item_tile);
    free(order);
    return ok ? 0 : -2;
}

int paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                      const int64_t *block_tables, const int32_t *query_start,
                      const int32_t *context_lens, float *out, int seqs, int heads,
                      int kv_heads, int dim, int block_size, int max_blocks,
                      int64_t head_stride, float scale, int window, int threads) {
    return paged_prefill(q, q_stride, k_cache, v_cache, block_tables, query_start, context_lens, out,
                         seqs, heads, kv_heads, dim, block_size, max_blocks, head_stride, scale,
                         window, threads, 0);
}

int paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int64_t *block_tables, const int32_t *query_start,
                       const int32_t *context_lens, uint16_t *out, int seqs, int heads,
                       int kv_heads, int dim, int block_size, int max_blocks,
                       int64_t head_stride, float scale, int window, int threads) {
    return paged_prefill(q, q_stride, k_cache, v_cache, block_tables, query_start, context_lens, out,
                         seqs, heads, kv_heads, dim, block_size, max_blocks, head_stride, scale,
                         window, threads, 1);
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
        if (size % VL == 0) {  // every hidden size in practice: whole vectors, no tail
            vf acc = {0};
            for (int i = 0; i < size; i += VL) {
                const vf v = vload_as(x, base + i, bf16);
                acc += v * v;
            }
            const float inv = 1.0f / sqrtf(hsum(acc) / size + eps);
            for (int i = 0; i < size; i += VL)
                vstore_as(out, base + i,
                          vload_as(x, base + i, bf16) * inv * vload_as(weight, i, bf16), bf16);
            continue;
        }
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

// SwiGLU's `silu(gate) * up` of one row of `size` into `out`.
static inline __attribute__((always_inline)) void silu_mul_row(const void *gate, const void *up,
                                                               void *out, int64_t g0, int64_t u0,
                                                               int64_t o0, int size, int bf16) {
    // exp's argument is kept in [-80, 80], off the vector expf's slow scalar lanes
#pragma omp simd
    for (int i = 0; i < size; i++) {
        const float g = load(gate, g0 + i, bf16);
        const float e = expf(fminf(fmaxf(-g, -80.0f), 80.0f));
        store(out, o0 + i, g / (1.0f + e) * load(up, u0 + i, bf16), bf16);
    }
}

// SwiGLU's `silu(gate) * up` over `rows` rows of `size` (each operand's rows `*_stride`
// elements apart) into contiguous `out`, which may be `gate` itself: one pass where torch
// takes two (silu_, then mul_). The dtype is a constant in each row loop: the parallel
// region is outlined before `bf16` is propagated, and a loop that tests it per element
// does not vectorise without AVX-512's masked stores.
static void silu_mul(const void *gate, const void *up, void *out, int rows, int size,
                     int64_t gate_stride, int64_t up_stride, int threads, int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        const int64_t g0 = (int64_t)r * gate_stride, u0 = (int64_t)r * up_stride;
        if (bf16)
            silu_mul_row(gate, up, out, g0, u0, (int64_t)r * size, size, 1);
        else
            silu_mul_row(gate, up, out, g0, u0, (int64_t)r * size, size, 0);
    }
}

int silu_mul_f32(const float *gate, const float *up, float *out, int rows, int size,
                 int64_t gate_stride, int64_t up_stride, int threads) {
    silu_mul(gate, up, out, rows, size, gate_stride, up_stride, threads, 0);
    return 0;
}

int silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int rows, int size,
                  int64_t gate_stride, int64_t up_stride, int threads) {
    silu_mul(gate, up, out, rows, size, gate_stride, up_stride, threads, 1);
    return 0;
}

// The step's K and V into their pool slots: token t's KV head h goes to slot slots[t] of
// head h's plane ([kv_heads, head_stride] caches). k and v rows are `k_stride` and
// `v_stride` elements apart (columns of the qkv GEMM's output), each row's heads contiguous.
static void write_kv(const void *k, const void *v, int64_t k_stride, int64_t v_stride,
                     void *k_cache, void *v_cache, const int64_t *slots, int tokens,
                     int kv_heads, int dim, int64_t head_stride, int threads, int es) {
    const size_t bytes = (size_t)dim * es;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 256)
    for (int t = 0; t < tokens; t++) {
        for (int h = 0; h < kv_heads; h++) {
            const int64_t to = ((int64_t)h * head_stride + slots[t] * dim) * es;
            memcpy((char *)k_cache + to, (const char *)k + (t * k_stride + h * dim) * es, bytes);
            memcpy((char *)v_cache + to, (const char *)v + (t * v_stride + h * dim) * es, bytes);
        }
    }
}

int write_kv_f32(const float *k, const float *v, int64_t k_stride, int64_t v_stride,
                 float *k_cache, float *v_cache, const int64_t *slots, int tokens, int kv_heads,
                 int dim, int64_t head_stride, int threads) {
    write_kv(k, v, k_stride, v_stride, k_cache, v_cache, slots, tokens, kv_heads, dim,
             head_stride, threads, 4);
    return 0;
}

int write_kv_bf16(const uint16_t *k, const uint16_t *v, int64_t k_stride, int64_t v_stride,
                  uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int tokens,
                  int kv_heads, int dim, int64_t head_stride, int threads) {
    write_kv(k, v, k_stride, v_stride, k_cache, v_cache, slots, tokens, kv_heads, dim,
             head_stride, threads, 2);
    return 0;
}

// float32 GEMM y[M, N] (+)= x[M, K] . W^T over W packed in column panels: panel p holds
// output columns [32p, 32p + 32) as [K, 32], k-major, so a panel streams from memory
// in one contiguous run. At decode batches the GEMM is as much a stream of the weights as
// it is arithmetic; MKL's and oneDNN's packed GEMMs left the two apart (a row block's
// first pass waited on memory, the next ones left it idle). Here a panel's row blocks
// also prefetch the thread's next panel into L2 as they go, spread over all of them. Each
// thread owns a contiguous run of panels. At prefill sizes rows go in blocks of GEMM_ROWS
// (x's block stays in L2) and k in chunks of GEMM_KC (a row block's x and the panel's
// chunk stay in L1), as MKL blocks them.
enum { PANEL = 32, PANEL_VECS = PANEL / VL, GEMM_ROWS = 96, GEMM_KC = 256 };

// rows [0, MR) of x (row stride ldx) times a panel's k-range [0, K) into y (row stride
// ldy), adding to y when `acc`; prefetches `lines` cache lines of `pf` per k-step (a
// prefetch never faults: past the next panel it reads ahead into the one after).
// Inlined with MR and `lines` constants: the k loop is the FMAs, their loads, and the
// prefetch where there is one.
static inline __attribute__((always_inline)) void gemm_block(
    const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int K, int MR, int acc,
    const char *pf, int lines) {
    vf sum[GEMM_MR][PANEL_VECS];
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int c = 0; c < PANEL_VECS; c++) sum[i][c] = acc ? vload(y + i * ldy + c * VL) : (vf){0};
    for (int k = 0; k < K; k++) {
        const float *wk = w + (int64_t)k * PANEL;
        for (int l = 0; l < lines; l++) __builtin_prefetch(pf + ((int64_t)k * lines + l) * 64, 0, 2);
        vf wv[PANEL_VECS];
#pragma GCC unroll 8
        for (int c = 0; c < PANEL_VECS; c++) wv[c] = vload(wk + c * VL);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            const float a = x[i * ldx + k];
#pragma GCC unroll 8
            for (int c = 0; c < PANEL_VECS; c++) sum[i][c] += a * wv[c];
        }
    }
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int c = 0; c < PANEL_VECS; c++) vstore(y + i * ldy + c * VL, sum[i][c]);
}

// `rows` rows of x (row stride K) through one panel, k in chunks of `kc`. One chunk (decode
// sizes): row block b prefetches lines [b * K, (b + 1) * K) of the next panel; several:
// each chunk's first row block prefetches the next panel's same chunk.
static void gemm_panel(const float *x, const float *w, float *y, int64_t ldy, int rows, int K,
                       int kc, int acc, const char *next) {
    for (int k0 = 0; k0 < K; k0 += kc) {
        const int kn = K - k0 < kc ? K - k0 : kc;
        for (int m0 = 0; m0 < rows; m0 += GEMM_MR) {
            const char *pf = 0;
            int lines = 0;  // this block prefetches nothing
            if (next && kn == K) {
                pf = next + (int64_t)(m0 / GEMM_MR) * K * 64;
                lines = 1;
            } else if (next && m0 == 0) {
                pf = next + (int64_t)k0 * PANEL * 4;
                lines = 2;
            }
#define GEMM_CALL(R, L) gemm_block(x + (int64_t)m0 * K + k0, K, w + (int64_t)k0 * PANEL, \
                                   y + (int64_t)m0 * ldy, ldy, kn, R, acc || k0 > 0, pf, L)
#define GEMM_BLOCK(R) (lines == 0 ? GEMM_CALL(R, 0) : lines == 1 ? GEMM_CALL(R, 1) \
                                                                  : GEMM_CALL(R, 2))
            // MR a constant in each call; a full block is GEMM_MR rows, a last one fewer.
#define GEMM_CASE(R) case R: if (R < GEMM_MR) GEMM_BLOCK(R); break
            const int mr = rows - m0 < GEMM_MR ? rows - m0 : GEMM_MR;
            if (mr == GEMM_MR) {
                GEMM_BLOCK(GEMM_MR);
            } else {
                switch (mr) {
                GEMM_CASE(1); GEMM_CASE(2); GEMM_CASE(3); GEMM_CASE(4); GEMM_CASE(5);
                GEMM_CASE(6); GEMM_CASE(7); GEMM_CASE(8); GEMM_CASE(9); GEMM_CASE(10);
                GEMM_CASE(11);
                }
            }
#undef GEMM_CASE
#undef GEMM_BLOCK
#undef GEMM_CALL
        }
    }
}

// y [M, N] (contiguous) = x [M, K] (contiguous) . W^T, plus y itself when `accumulate`;
// `panels` is W packed as [N / 32, K, 32]. N a multiple of 32.
int gemm_panels_f32(const float *x, const float *panels, float *y, int M, int N, int K,
                    int accumulate, int threads) {
    if (N % PANEL) return -1;
    const int count = N / PANEL;
    const int kc = M > GEMM_ROWS ? GEMM_KC : K;
#pragma omp parallel num_threads(threads) if (M > 0)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int first = count * t / nt, last = count * (t + 1) / nt;
        for (int r0 = 0; r0 < M; r0 += GEMM_ROWS) {
            const int rows = M - r0 < GEMM_ROWS ? M - r0 : GEMM_ROWS;
            for (int p = first; p < last; p++) {
                const float *w = panels + (int64_t)p * PANEL * K;
                const char *next = p + 1 < last ? (const char *)(w + (int64_t)PANEL * K) : 0;
                gemm_panel(x + (int64_t)r0 * K, w, y + (int64_t)r0 * N + p * PANEL, N, rows, K,
                           kc, accumulate, next);
            }
        }
    }
    return 0;
}

// ---- GEMMs over weights kept in llama.cpp's quantized blocks --------------------------------
// A weight row is blocks of one type, as the GGUF file stores them: 32 weights a block with
// a float16 scale d (and a float16 minimum m for the _1 types), 4, 5 or 8 bits a weight; or
// 256-weight super-blocks (the K types) of eight 32-weight sub-blocks, each with its own
// 6-bit scale and minimum (Q4_K) or two 8-bit scales of 16 weights (Q6_K). x is quantized
// per row and 32 values to 8 bits first (scale dx, and s = dx * sum(qx) for the minima),
// so a sub-block's contribution is an integer dot product scaled once:
// dx * (sc * sum(qw * qx)) + m * s, sc per 16 weights. Weight values are unpacked into a
// register of 32 int8 and multiplied by x's as llama.cpp does on each ISA: AVX2's
// vpmaddubsw (unsigned x signed bytes, the sign moved onto x for the signed types), plain
// integer loops the compiler vectorizes elsewhere (NEON's sdot with +dotprod).
enum { QBLOCK = 32, BLOCK_Q8_0 = 0, BLOCK_Q4_0, BLOCK_Q4_1, BLOCK_Q5_0, BLOCK_Q5_1, BLOCK_Q4_K,
       BLOCK_Q6_K, BLOCK_TYPE_COUNT };
enum { QGEMM_ROWS = 4, QGEMM_TILE = 64 };

static const int block_bytes[] = {34, 18, 20, 22, 24, 144, 210};
static const int block_subs[] = {1, 1, 1, 1, 1, 8, 8};  // 32-weight sub-blocks a block

// x's blocks: scale, scale * sum of the quants, the quants.
struct xblock {
    float d, s;
    int8_t q[QBLOCK];
};

static inline __attribute__((always_inline)) float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: its mantissa times 2^-24
        float f = (float)man * (1.0f / 16777216.0f);
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// Whether the type's quants are unsigned with a minimum added (else signed, no minimum).
static inline __attribute__((always_inline)) int has_min(int type) {
    return type == BLOCK_Q4_1 || type == BLOCK_Q5_1 || type == BLOCK_Q4_K;
}

// Sub-block s of block b: the scales of its two halves of 16 weights and its minimum.
static inline __attribute__((always_inline)) void sub_scales(int type, const uint8_t *b, int s,
                                                             float *sc0, float *sc1, float *mn) {
    if (type == BLOCK_Q4_K) {  // scales[12]: 6-bit scale and minimum per sub-block
        const uint8_t *k = b + 4;
        int sc, m;
        if (s < 4) {
            sc = k[s] & 63;
            m = k[s + 4] & 63;
        } else {
            sc = (k[s + 4] & 15) | ((k[s - 4] >> 6) << 4);
            m = (k[s + 4] >> 4) | ((k[s] >> 6) << 4);
        }
        *sc0 = *sc1 = half_to_float(b) * (float)sc;
        *mn = -half_to_float(b + 2) * (float)m;
    } else if (type == BLOCK_Q6_K) {  // ql[128] qh[64] scales[16] (int8) d
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_to_float(b + 208);
        const int first = 8 * (s / 4) + 2 * (s % 4);
        *sc0 = d * (float)scales[first];
        *sc1 = d * (float)scales[first + 1];
        *mn = 0.0f;
    } else {
        *sc0 = *sc1 = half_to_float(b);
        *mn = has_min(type) ? half_to_float(b + 2) : 0.0f;
    }
}

// Sub-block s's 32 quants as int8 (the minimum types' unsigned, the others' signed).
static inline __attribute__((always_inline)) void unpack_sub(int type, const uint8_t *b, int s,
                                                             int8_t q[QBLOCK]) {
    if (type == BLOCK_Q8_0) {
        memcpy(q, b + 2, QBLOCK);
    } else if (type == BLOCK_Q4_K) {  // qs[128]: 64-weight chunks, low nibbles then high
        const uint8_t *qs = b + 16 + 32 * (s / 2);
        for (int j = 0; j < QBLOCK; j++) q[j] = (int8_t)(s % 2 ? qs[j] >> 4 : qs[j] & 15);
    } else if (type == BLOCK_Q6_K) {  // 128-weight halves: 4 bits from ql, 2 from qh
        const int t = s % 4;
        const uint8_t *ql = b + 64 * (s / 4) + 32 * (t % 2), *qh = b + 128 + 32 * (s / 4);
        for (int j = 0; j < QBLOCK; j++) {
            const int low = t < 2 ? ql[j] & 15 : ql[j] >> 4;
            q[j] = (int8_t)((low | (((qh[j] >> (2 * t)) & 3) << 4)) - 32);
        }
    } else {
        uint32_t qh = 0;
        const uint8_t *qs = b + (has_min(type) ? 4 : 2);
        if (type == BLOCK_Q5_0 || type == BLOCK_Q5_1) {
            memcpy(&qh, qs, 4);
            qs += 4;
        }
        const int offset = type == BLOCK_Q4_0 ? 8 : type == BLOCK_Q5_0 ? 16 : 0;
        for (int j = 0; j < QBLOCK / 2; j++) {
            q[j] = (int8_t)((qs[j] & 15) + (((qh >> j) & 1u) << 4) - offset);
            q[j + QBLOCK / 2] = (int8_t)((qs[j] >> 4) + (((qh >> (j + 16)) & 1u) << 4) - offset);
        }
    }
}

static void quantize_row_q8(const float *x, struct xblock *out, int nb) {
    for (int b = 0; b < nb; b++) {
        const float *v = x + (int64_t)b * QBLOCK;
        float amax = 0.0f;
        for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QBLOCK; j++) {
            const int q = (int)lrintf(v[j] * id);
            out[b].q[j] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

#if defined(__AVX2__)
// unpack_sub in one register.
static inline __attribute__((always_inline)) __m256i unpack_avx2(int type, const uint8_t *b, int s) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (type == BLOCK_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    if (type == BLOCK_Q4_K) {
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s / 2)));
        return _mm256_and_si256(s % 2 ? _mm256_srli_epi16(qs, 4) : qs, low4);
    }
    if (type == BLOCK_Q6_K) {
        const int t = s % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * (s / 4) + 32 * (t % 2)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * (s / 4)));
        const __m256i low = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        // bits 2t, 2t + 1 of qh to bits 4, 5 (shifts move whole 16-bit lanes: mask after)
        const __m128i by = _mm_cvtsi32_si128(2 * t);
        const __m256i high = _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, by), 4),
                                              _mm256_set1_epi8(0x30));
        return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
    }
    const uint8_t *qs = b + (has_min(type) ? 4 : 2);
    uint32_t qh = 0;
    if (type == BLOCK_Q5_0 || type == BLOCK_Q5_1) {
        memcpy(&qh, qs, 4);
        qs += 4;
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low4);
    if (type == BLOCK_Q5_0 || type == BLOCK_Q5_1) {
        // byte j takes bit j of qh: byte j / 8 of qh spread over each 8 bytes, one bit kept
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32((int)qh),
            _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    const int offset = type == BLOCK_Q4_0 ? 8 : type == BLOCK_Q5_0 ? 16 : 0;
    return offset ? _mm256_sub_epi8(q, _mm256_set1_epi8((char)offset)) : q;
}

// Eight int32 partial sums of w . x (lanes 0-3 the first 16 weights): w unsigned (the
// minimum types) or signed.
static inline __attribute__((always_inline)) __m256i dot_avx2(int type, __m256i w, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (has_min(type)) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                             ones);
}
#endif

#if defined(__AVX2__)
typedef __m256 qacc;
#else
typedef float qacc;
#endif

// Sub-block i of the row at w times x's rows (R of them, `xstride` x-blocks apart), added
// into acc[r] (and the minimum's share into mins[r]).
static inline __attribute__((always_inline)) void dot_sub(int type, const uint8_t *w,
                                                          const struct xblock *x, int64_t xstride,
                                                          int i, int R, qacc *acc, float *mins) {
    const int subs = block_subs[type], s = i % subs;
    const uint8_t *blk = w + (int64_t)(i / subs) * block_bytes[type];
    float sc0, sc1, mn;
    sub_scales(type, blk, s, &sc0, &sc1, &mn);
#if defined(__AVX2__)
    const __m256i q = unpack_avx2(type, blk, s);
#else
    int8_t q[QBLOCK];
    unpack_sub(type, blk, s, q);
#endif
    for (int r = 0; r < R; r++) {
        const struct xblock *xb = x + r * xstride + i;
#if defined(__AVX2__)
        const __m256i p = dot_avx2(type, q, _mm256_loadu_si256((const __m256i *)xb->q));
        // one scale for the 32 weights but for Q6_K's two halves
        const __m256 scale = type == BLOCK_Q6_K
            ? _mm256_set_m128(_mm_set1_ps(sc1 * xb->d), _mm_set1_ps(sc0 * xb->d))
            : _mm256_set1_ps(sc0 * xb->d);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
#else
        int sum0 = 0, sum1 = 0;
        for (int j = 0; j < QBLOCK / 2; j++) sum0 += (int)q[j] * (int)xb->q[j];
        for (int j = QBLOCK / 2; j < QBLOCK; j++) sum1 += (int)q[j] * (int)xb->q[j];
        acc[r] += xb->d * (sc0 * (float)sum0 + sc1 * (float)sum1);
#endif
        mins[r] += mn * xb->s;
    }
}

// out[r] = row w . x row r (r < R, rows `xstride` x-blocks apart) over nb blocks of w.
// Two sums a row, even and odd sub-blocks, so that neighbouring sub-blocks' FMAs overlap.
static inline __attribute__((always_inline)) void dot_rows(int type, const uint8_t *w,
                                                           const struct xblock *x, int64_t xstride,
                                                           int nb, int R, float *out) {
    float mins[QGEMM_ROWS] = {0};
    qacc even[QGEMM_ROWS], odd[QGEMM_ROWS];
    for (int r = 0; r < R; r++) {
#if defined(__AVX2__)
        even[r] = odd[r] = _mm256_setzero_ps();
#else
        even[r] = odd[r] = 0.0f;
#endif
    }
    const int total = nb * block_subs[type];
    int i = 0;
    for (; i + 1 < total; i += 2) {
        dot_sub(type, w, x, xstride, i, R, even, mins);
        dot_sub(type, w, x, xstride, i + 1, R, odd, mins);
    }
    if (i < total) dot_sub(type, w, x, xstride, i, R, even, mins);
    for (int r = 0; r < R; r++) {
#if defined(__AVX2__)
        const __m256 sum = _mm256_add_ps(even[r], odd[r]);
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
        out[r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1))) + mins[r];
#else
        out[r] = even[r] + odd[r] + mins[r];
#endif
    }
}

// Rows [m0, m1) of y (row stride ldy) against weight rows [n0, n1), QGEMM_ROWS rows of x
// per pass over a weight row (it stays in L1 while they go by).
static inline __attribute__((always_inline)) void block_gemm_tile(
    int type, const uint8_t *w, const struct xblock *xq, float *y, int64_t ldy, int m0, int m1,
    int n0, int n1, int nb, int xstride, int acc) {
    const int64_t row_bytes = (int64_t)nb * block_bytes[type];
    for (int n = n0; n < n1; n++) {
        const uint8_t *wn = w + n * row_bytes;
        for (int m = m0; m < m1; m += QGEMM_ROWS) {
            float out[QGEMM_ROWS];
            const int R = m1 - m < QGEMM_ROWS ? m1 - m : QGEMM_ROWS;
            const struct xblock *xm = xq + (int64_t)m * xstride;
            if (R == QGEMM_ROWS) dot_rows(type, wn, xm, xstride, nb, QGEMM_ROWS, out);
            else if (R == 3) dot_rows(type, wn, xm, xstride, nb, 3, out);
            else if (R == 2) dot_rows(type, wn, xm, xstride, nb, 2, out);
            else dot_rows(type, wn, xm, xstride, nb, 1, out);
            for (int r = 0; r < R; r++) {
                float *yp = y + (int64_t)(m + r) * ldy + n;
                *yp = acc ? *yp + out[r] : out[r];
            }
        }
    }
}

// Weights per block of a type (32, or 256 for the K types); -1 for an unknown type.
int block_type_weights(int type) {
    return type >= 0 && type < BLOCK_TYPE_COUNT ? QBLOCK * block_subs[type] : -1;
}

// y [M, N] (row stride ldy) (+)= x [M, K] . W^T, W [N, K] in blocks of `type`, K a multiple
// of the type's block. Threads split W's rows; x's rows go QGEMM_TILE at a time (their
// 8-bit blocks stay in L2).
int block_gemm_f32(const float *x, const uint8_t *w, float *y, int64_t ldy, int M, int N, int K,
                   int type, int accumulate, int threads) {
    if (block_type_weights(type) < 0 || K % block_type_weights(type)) return -1;
    const int nb = K / block_type_weights(type), xstride = K / QBLOCK;
    struct xblock *xq = malloc(sizeof(struct xblock) * (size_t)M * xstride);
    if (!xq) return -2;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) quantize_row_q8(x + (int64_t)m * K, xq + (int64_t)m * xstride, xstride);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int n0 = (int)((int64_t)N * t / nt), n1 = (int)((int64_t)N * (t + 1) / nt);
        for (int m0 = 0; m0 < M; m0 += QGEMM_TILE) {
            const int m1 = M - m0 < QGEMM_TILE ? M : m0 + QGEMM_TILE;
#define TILE(T) block_gemm_tile(T, w, xq, y, ldy, m0, m1, n0, n1, nb, xstride, accumulate)
            switch (type) {  // the type a constant in each: its unpacking inlined
            case BLOCK_Q8_0: TILE(BLOCK_Q8_0); break;
            case BLOCK_Q4_0: TILE(BLOCK_Q4_0); break;
            case BLOCK_Q4_1: TILE(BLOCK_Q4_1); break;
            case BLOCK_Q5_0: TILE(BLOCK_Q5_0); break;
            case BLOCK_Q5_1: TILE(BLOCK_Q5_1); break;
            case BLOCK_Q4_K: TILE(BLOCK_Q4_K); break;
            default: TILE(BLOCK_Q6_K); break;
            }
#undef TILE
        }
    }
    free(xq);
    return 0;
}

// out [R, K] = rows ids[0..R) of W [*, K] in blocks of `type`, as float32 (an embedding's
// lookups, and the reference the tests compare the GEMM with).
// One row of nb blocks as K float32 values.
static inline __attribute__((always_inline)) void expand_row(int type, const uint8_t *row, int nb,
                                                             float *o) {
    const int bytes = block_bytes[type], subs = block_subs[type];
    for (int b = 0; b < nb; b++) {
        for (int s = 0; s < subs; s++, o += QBLOCK) {
            const uint8_t *blk = row + (int64_t)b * bytes;
            float sc0, sc1, mn;
            sub_scales(type, blk, s, &sc0, &sc1, &mn);
#if defined(__AVX2__)
            // every type's quants fit a signed byte (the unsigned ones are < 32)
            const __m256i q = unpack_avx2(type, blk, s);
            const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            const __m256 m = _mm256_set1_ps(mn), a = _mm256_set1_ps(sc0), c = _mm256_set1_ps(sc1);
#define EXPAND8(at, bytes16, scale) _mm256_storeu_ps(o + (at), _mm256_fmadd_ps( \
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes16)), scale, m))
            EXPAND8(0, lo, a);
            EXPAND8(8, _mm_srli_si128(lo, 8), a);
            EXPAND8(16, hi, c);
            EXPAND8(24, _mm_srli_si128(hi, 8), c);
#undef EXPAND8
#else
            int8_t q[QBLOCK];
            unpack_sub(type, blk, s, q);
            for (int j = 0; j < QBLOCK; j++) o[j] = (j < QBLOCK / 2 ? sc0 : sc1) * (float)q[j] + mn;
#endif
        }
    }
}

int block_rows_f32(const uint8_t *w, const int64_t *ids, float *out, int R, int K, int type,
                   int threads) {
    if (block_type_weights(type) < 0 || K % block_type_weights(type)) return -1;
    const int nb = K / block_type_weights(type);
    const int64_t row_bytes = (int64_t)nb * block_bytes[type];
#pragma omp parallel for num_threads(threads) schedule(static) if (R > 1)
    for (int r = 0; r < R; r++) {
        const uint8_t *row = w + ids[r] * row_bytes;
        float *o = out + (int64_t)r * K;
        switch (type) {  // the type a constant in each: its unpacking inlined
        case BLOCK_Q8_0: expand_row(BLOCK_Q8_0, row, nb, o); break;
        case BLOCK_Q4_0: expand_row(BLOCK_Q4_0, row, nb, o); break;
        case BLOCK_Q4_1: expand_row(BLOCK_Q4_1, row, nb, o); break;
        case BLOCK_Q5_0: expand_row(BLOCK_Q5_0, row, nb, o); break;
        case BLOCK_Q5_1: expand_row(BLOCK_Q5_1, row, nb, o); break;
        case BLOCK_Q4_K: expand_row(BLOCK_Q4_K, row, nb, o); break;
        default: expand_row(BLOCK_Q6_K, row, nb, o); break;
        }
    }
    return 0;
}
