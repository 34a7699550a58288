/* Decode-step LoRA on CPU: every row through its own slot's A and B, nothing else.
 *
 *   out[n, :] += scale[n] * (x[n, :] @ at[s]) @ bt[s]      s = slots[n], for n in order[0 .. n_rows)
 *
 * x: [N, in] row-major; at: [S, in, rank] (each slot's A transposed); bt: [S, rank, out] (each slot's
 * B transposed); out: [N, out], updated in place. `order` lists the rows to update, sorted by slot so
 * that consecutive rows read the same A and B from cache. Per row: rank x (in + out) multiply-adds,
 * against (highest slot + 1) x rank x (in + out) for the stacked torch path.
 */
#include <stdint.h>

/* One row. `h` is scratch for four partial sums over `in` (4 x rank floats), so that consecutive
 * multiply-adds do not wait on each other. Inlined with a constant rank, h lives in registers. */
static inline __attribute__((always_inline)) void lora_row(float *restrict o, const float *restrict xr,
                                                           const float *restrict a, const float *restrict b,
                                                           float scale, int64_t in_f, const int64_t rank,
                                                           int64_t out_f, float *restrict h) {
    float *h0 = h, *h1 = h + rank, *h2 = h + 2 * rank, *h3 = h + 3 * rank;
    for (int64_t k = 0; k < 4 * rank; k++) h[k] = 0.0f;
    int64_t i = 0;
    for (; i + 4 <= in_f; i += 4) {
        const float x0 = xr[i], x1 = xr[i + 1], x2 = xr[i + 2], x3 = xr[i + 3];
        const float *ai = a + i * rank;
#pragma omp simd
        for (int64_t k = 0; k < rank; k++) {
            h0[k] += x0 * ai[k];
            h1[k] += x1 * ai[rank + k];
            h2[k] += x2 * ai[2 * rank + k];
            h3[k] += x3 * ai[3 * rank + k];
        }
    }
    for (; i < in_f; i++) {
        const float xi = xr[i];
        const float *ai = a + i * rank;
#pragma omp simd
        for (int64_t k = 0; k < rank; k++) h0[k] += xi * ai[k];
    }
    for (int64_t k = 0; k < rank; k++) {
        const float hk = (h0[k] + h1[k] + h2[k] + h3[k]) * scale;
        const float *bk = b + k * out_f;
#pragma omp simd
        for (int64_t j = 0; j < out_f; j++) o[j] += hk * bk[j];
    }
}

/* The common ranks get a copy compiled for that rank; any other takes the general one. */
#define ROWS_OF_RANK(R)                                                                              \
    do {                                                                                             \
        float h[4 * (R)];                                                                            \
        for (int64_t m = 0; m < n_rows; m++) {                                                       \
            const int64_t n = order[m], s = slots[n];                                                \
            lora_row(out + n * out_f, x + n * in_f, at + s * in_f * (R), bt + s * (R) * out_f,       \
                     scale[n], in_f, (R), out_f, h);                                                 \
        }                                                                                            \
    } while (0)

void lora_rowwise(float *restrict out, const float *restrict x, const float *restrict at,
                  const float *restrict bt, const int64_t *restrict slots, const float *restrict scale,
                  const int64_t *restrict order, int64_t n_rows, int64_t in_f, int64_t rank, int64_t out_f) {
    switch (rank) {
        case 8: ROWS_OF_RANK(8); break;
        case 16: ROWS_OF_RANK(16); break;
        case 32: ROWS_OF_RANK(32); break;
        case 64: ROWS_OF_RANK(64); break;
        default: ROWS_OF_RANK(rank); break;
    }
}
