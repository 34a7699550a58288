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
#include <string.h>

void lora_rowwise(float *restrict out, const float *restrict x, const float *restrict at,
                  const float *restrict bt, const int64_t *restrict slots, const float *restrict scale,
                  const int64_t *restrict order, int64_t n_rows, int64_t in_f, int64_t rank, int64_t out_f) {
    /* Four partial sums over `in` so that consecutive multiply-adds do not wait on each other. */
    float h[4][rank];
    for (int64_t m = 0; m < n_rows; m++) {
        const int64_t n = order[m];
        const float *xr = x + n * in_f;
        const float *a = at + slots[n] * in_f * rank;
        memset(h, 0, sizeof(h));
        int64_t i = 0;
        for (; i + 4 <= in_f; i += 4) {
            const float x0 = xr[i], x1 = xr[i + 1], x2 = xr[i + 2], x3 = xr[i + 3];
            const float *ai = a + i * rank;
#pragma omp simd
            for (int64_t k = 0; k < rank; k++) {
                h[0][k] += x0 * ai[k];
                h[1][k] += x1 * ai[rank + k];
                h[2][k] += x2 * ai[2 * rank + k];
                h[3][k] += x3 * ai[3 * rank + k];
            }
        }
        for (; i < in_f; i++) {
            const float xi = xr[i];
            const float *ai = a + i * rank;
#pragma omp simd
            for (int64_t k = 0; k < rank; k++) h[0][k] += xi * ai[k];
        }
        const float *b = bt + slots[n] * rank * out_f;
        float *o = out + n * out_f;
        for (int64_t k = 0; k < rank; k++) {
            const float hk = (h[0][k] + h[1][k] + h[2][k] + h[3][k]) * scale[n];
            const float *bk = b + k * out_f;
#pragma omp simd
            for (int64_t j = 0; j < out_f; j++) o[j] += hk * bk[j];
        }
    }
}
