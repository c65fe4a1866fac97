// The kernels against plain scalar references, with no Python: for ISAs this machine can
// only emulate (aarch64 under qemu-user), where torch is not at hand. Built together with
// the kernel source by tests/runtime/test_cpu_kernels_other_isa.py; prints one line per
// check and exits non-zero on any mismatch.
#include "../../bucketserve/runtime/cpu/kernels/cpu_kernels.c"

#include <stdio.h>

static uint32_t seed = 1;

static float uniform(void) {  // in [-1, 1)
    seed = seed * 1664525u + 1013904223u;
    return (float)(seed >> 8) / (float)(1u << 23) - 1.0f;
}

static float *randoms(int64_t n) {
    float *p = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) p[i] = uniform();
    return p;
}

static int failures = 0;

static void expect(const char *name, const float *got, const float *want, int64_t n, float tol) {
    float worst = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float d = fabsf(got[i] - want[i]) / (1.0f + fabsf(want[i]));
        worst = d > worst ? d : worst;
    }
    const int ok = worst <= tol;
    failures += !ok;
    printf("%s %s (worst relative error %.2g, %d lanes)\n", ok ? "ok" : "FAILED", name, worst,
           cpu_kernels_lanes());
}

static void check_gemm(int M, int N, int K, int accumulate) {
    float *x = randoms((int64_t)M * K), *w = randoms((int64_t)N * K);
    float *y = randoms((int64_t)M * N), *want = malloc(sizeof(float) * M * N);
    float *panels = malloc(sizeof(float) * N * K);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) panels[(int64_t)(n / PANEL) * PANEL * K + k * PANEL + n % PANEL] = w[(int64_t)n * K + k];
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = accumulate ? y[(int64_t)m * N + n] : 0.0;
            for (int k = 0; k < K; k++) s += (double)x[(int64_t)m * K + k] * w[(int64_t)n * K + k];
            want[(int64_t)m * N + n] = (float)s;
        }
    gemm_panels_f32(x, panels, y, M, N, K, accumulate, 2);
    char name[64];
    snprintf(name, sizeof name, "gemm_panels M=%d N=%d K=%d acc=%d", M, N, K, accumulate);
    expect(name, y, want, (int64_t)M * N, 1e-4f);
    free(x), free(w), free(y), free(want), free(panels);
}

static void check_norm_silu_rope(void) {
    enum { T = 5, SIZE = 96, HEADS = 3, DIM = 32 };
    float *x = randoms(T * SIZE), *weight = randoms(SIZE), out[T * SIZE], want[T * SIZE];
    for (int t = 0; t < T; t++) {
        double ss = 0.0;
        for (int i = 0; i < SIZE; i++) ss += (double)x[t * SIZE + i] * x[t * SIZE + i];
        const float inv = 1.0f / sqrtf((float)(ss / SIZE) + 1e-5f);
        for (int i = 0; i < SIZE; i++) want[t * SIZE + i] = x[t * SIZE + i] * inv * weight[i];
    }
    rms_norm_f32(x, weight, out, T, SIZE, 1e-5f, 2);
    expect("rms_norm", out, want, T * SIZE, 1e-5f);

    float *up = randoms(T * SIZE);
    for (int i = 0; i < T * SIZE; i++) want[i] = x[i] / (1.0f + expf(-x[i])) * up[i];
    silu_mul_f32(x, up, out, T, SIZE, SIZE, SIZE, 2);
    expect("silu_mul", out, want, T * SIZE, 1e-5f);

    float *cos_sin = randoms(T * 2 * DIM), *q = randoms(T * HEADS * DIM);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < HEADS; h++)
            for (int d = 0; d < DIM; d++) {
                const float *v = q + (t * HEADS + h) * DIM;
                const float rolled = v[d < DIM / 2 ? d + DIM / 2 : d - DIM / 2];
                want[(t * HEADS + h) * DIM + d] =
                    v[d] * cos_sin[t * 2 * DIM + d] + rolled * cos_sin[t * 2 * DIM + DIM + d];
            }
    rope_f32(q, cos_sin, T, HEADS, DIM, HEADS * DIM, 2);
    expect("rope", q, want, T * HEADS * DIM, 1e-5f);
    free(x), free(weight), free(up), free(cos_sin), free(q);
}

// Causal attention through block tables: sequence s's n queries end at position ctx - 1;
// with a sliding `window` (> 0) the query at pos sees keys (pos - window, pos].
static void reference_attention(const float *q, const float *kc, const float *vc,
                                const int64_t *table, int ctx, int n, float *out, int heads,
                                int kv_heads, int dim, int bs, int64_t head_stride,
                                float scale, int window) {
    float *p = malloc(sizeof(float) * ctx);
    for (int i = 0; i < n; i++) {
        const int pos = ctx - n + i, lo = window > 0 && pos >= window ? pos - window + 1 : 0;
        for (int h = 0; h < heads; h++) {
            const int64_t plane = (int64_t)(h / (heads / kv_heads)) * head_stride;
            const float *qv = q + ((int64_t)i * heads + h) * dim;
            float top = -FLT_MAX, sum = 0.0f;
            for (int t = lo; t <= pos; t++) {
                const float *k = kc + plane + (table[t / bs] * bs + t % bs) * dim;
                float s = 0.0f;
                for (int d = 0; d < dim; d++) s += qv[d] * k[d];
                p[t] = s * scale;
                top = p[t] > top ? p[t] : top;
            }
            for (int t = lo; t <= pos; t++) sum += p[t] = expf(p[t] - top);
            for (int d = 0; d < dim; d++) {
                float o = 0.0f;
                for (int t = lo; t <= pos; t++) o += p[t] * vc[plane + (table[t / bs] * bs + t % bs) * dim + d];
                out[((int64_t)i * heads + h) * dim + d] = o / sum;
            }
        }
    }
    free(p);
}

static void check_attention(int heads, int kv_heads, int dim, int bs, int window) {
    enum { SEQS = 4, MAX_BLOCKS = 24 };
    const int lens[SEQS] = {1, 37, 130, 1}, ctxs[SEQS] = {40, 37, 200, 1};
    const int blocks = SEQS * MAX_BLOCKS + 1;
    const int64_t head_stride = (int64_t)blocks * bs * dim;
    float *kc = randoms(kv_heads * head_stride), *vc = randoms(kv_heads * head_stride);
    int64_t tables[SEQS * MAX_BLOCKS];
    for (int i = 0; i < SEQS * MAX_BLOCKS; i++) tables[i] = (i * 37) % (SEQS * MAX_BLOCKS) + 1;
    int32_t starts[SEQS + 1] = {0}, context[SEQS];
    for (int s = 0; s < SEQS; s++) starts[s + 1] = starts[s] + lens[s], context[s] = ctxs[s];
    const int64_t tokens = starts[SEQS], width = (int64_t)heads * dim;
    float *q = randoms(tokens * width), *out = malloc(sizeof(float) * tokens * width);
    float *want = malloc(sizeof(float) * tokens * width);
    for (int s = 0; s < SEQS; s++)
        reference_attention(q + starts[s] * width, kc, vc, tables + s * MAX_BLOCKS, ctxs[s],
                            lens[s], want + starts[s] * width, heads, kv_heads, dim, bs,
                            head_stride, 1.0f / sqrtf(dim), window);
    char name[112];
    const int status = paged_prefill_f32(q, width, kc, vc, tables, starts, context, out, SEQS,
                                         heads, kv_heads, dim, bs, MAX_BLOCKS, head_stride,
                                         1.0f / sqrtf(dim), window, 2);
    snprintf(name, sizeof name, "paged_prefill heads=%d/%d dim=%d block=%d window=%d status=%d",
             heads, kv_heads, dim, bs, window, status);
    expect(name, out, want, tokens * width, status ? -1.0f : 1e-4f);
    // decode rows: each sequence's last query over its whole context
    float *qd = malloc(sizeof(float) * SEQS * width), *wd = malloc(sizeof(float) * SEQS * width);
    for (int s = 0; s < SEQS; s++) {
        memcpy(qd + s * width, q + (starts[s + 1] - 1) * width, sizeof(float) * width);
        memcpy(wd + s * width, want + (starts[s + 1] - 1) * width, sizeof(float) * width);
    }
    const int decoded = paged_decode_f32(qd, width, kc, vc, tables, context, out, SEQS, heads,
                                         kv_heads, dim, bs, MAX_BLOCKS, head_stride,
                                         1.0f / sqrtf(dim), window, 2);
    snprintf(name, sizeof name, "paged_decode heads=%d/%d dim=%d block=%d window=%d status=%d",
             heads, kv_heads, dim, bs, window, decoded);
    expect(name, out, wd, SEQS * width, decoded ? -1.0f : 1e-4f);
    free(kc), free(vc), free(q), free(out), free(want), free(qd), free(wd);
}

int main(void) {
    check_gemm(1, 64, 40, 0);
    check_gemm(13, 96, 300, 1);
    check_gemm(130, 160, 600, 0);
    check_norm_silu_rope();
    check_attention(9, 3, 64, 16, 0);
    check_attention(4, 2, 80, 8, 0);
    check_attention(8, 1, 128, 32, 0);
    check_attention(9, 3, 64, 16, 50);  // sliding windows not aligned to blocks or tiles
    check_attention(4, 2, 80, 8, 7);
    check_attention(8, 1, 128, 32, 100);
    printf("%d failed\n", failures);
    return failures != 0;
}
