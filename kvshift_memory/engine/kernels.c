/* CPU kernels for quantized weights and one-token attention. kvshift_memory.engine.native builds
 * this file once per machine with the system C compiler and loads it with ctypes.
 *
 * Weights are row-major over output rows, in groups along the input dimension:
 *   int4: affine groups of 32, value = scale * q + offset with q in 0..15. A row is stored in
 *         units of 64 elements (two groups), 32 bytes each: eight 32-bit lanes, lane l holding
 *         element 8 * i + l of the unit in bits 4i..4i+3. Unpacking eight values is then a shift
 *         and a mask, with no shuffle. A row of an odd number of groups ends with a half unit.
 *   int8: value = scale * q, groups of 16 or 32.
 * Scales and offsets are float32, one per row and group. Activations stay float32: rounding them
 * to int16 for integer products was faster by a sixth but moved logits by up to 5e-3.
 *
 * Threads: OpenMP through libgomp.so.1, which resolves to the runtime PyTorch has loaded, so the
 * thread count is torch's. Compiled with -ffp-contract=off: a dequantised value is
 * scale * q + offset rounded twice, as gguf-py (and so the float32 conversion) computes it.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

int kv_abi_version(void) { return 12; }

/* one weight matrix [rows, cols] (y = x W^T); ``kind`` 4 or 8 */
typedef struct {
    int64_t kind, rows, cols, group;
    const void *data;
    const float *scale, *offset;
} kv_matrix;

/* bytes of one row of an int4 matrix of k columns */
static inline int64_t q4_row_bytes(int64_t k) { return (k + 63) / 64 * 32; }

static inline int q4_value(const uint8_t *row, int64_t e) {
    const uint32_t *lanes = (const uint32_t *)row + (e / 64) * 8;
    return (int)((lanes[e % 8] >> (4 * ((e % 64) / 8))) & 15u);
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* the sums of eight vectors, one per lane */
#define Q4_LANES(v, i) _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4 * (i)), nibble))

static inline __m256 hsum8x8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const __m256 low = _mm256_permute2f128_ps(ab, cd, 0x20), high = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(low, high);
}


/* e^x for x <= 0 (Cephes' polynomial, as in avx_mathfun): within 2 ulp over the range used */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}
#endif

static float dot(int64_t n, const float *a, const float *b) {
    float total = 0.0f;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    total = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* ---------------------------------------------------------------- one input row
 * A product reads four weight rows at a time, each load of x serving four rows, and sums the
 * products of a group as a tree rather than one chain.
 */
#define ROWS 4

/* Four rows read side by side are four interleaved streams, which the CPU's prefetcher does not
 * follow (the output head of Gemma 3 270M ran at half the memory's speed): while one block of rows
 * is summed, the next block's bytes [from, to) are fetched, a share per group. */
static inline int64_t prefetch_share(const char *next, int64_t from, int64_t to) {
#ifdef __AVX2__
    for (; from < to; from += 64) _mm_prefetch(next + from, _MM_HINT_T0);
#endif
    return from < to ? to : from;
}

/* sum_g scale_g * (q_g . x_g) + offset_g * xsum_g for ``count`` rows from ``first`` */
static void q4_rows_dot(const kv_matrix *w, int64_t first, int64_t count, const float *x, const float *xsum, float *out) {
    const int64_t k = w->cols, groups = k / 32, row_bytes = q4_row_bytes(k);
    const uint8_t *q = (const uint8_t *)w->data + first * row_bytes;
    const float *scale = w->scale + first * groups, *offset = w->offset + first * groups;
    int64_t r = 0;
#ifdef __AVX2__
    if (count == ROWS) {
        const __m256i nibble = _mm256_set1_epi32(15);
        const char *next = (const char *)(q + ROWS * row_bytes);
        int64_t fetched = 0;
        __m256 acc[ROWS];
        for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g += 2) {
            fetched = prefetch_share(next, fetched, (g + 2 < groups ? g + 2 : groups) * ROWS * row_bytes / groups);
            const uint8_t *unit = q + g * 16;
            const float *xg = x + g * 32;
            __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
            __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
            for (int i = 0; i < ROWS; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(unit + i * row_bytes));
                const __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(Q4_LANES(v, 0), x0), _mm256_mul_ps(Q4_LANES(v, 1), x1)),
                                               _mm256_add_ps(_mm256_mul_ps(Q4_LANES(v, 2), x2), _mm256_mul_ps(Q4_LANES(v, 3), x3)));
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(scale[i * groups + g]), a, acc[i]);
            }
            if (g + 1 == groups) break; /* the half unit */
            x0 = _mm256_loadu_ps(xg + 32), x1 = _mm256_loadu_ps(xg + 40);
            x2 = _mm256_loadu_ps(xg + 48), x3 = _mm256_loadu_ps(xg + 56);
            for (int i = 0; i < ROWS; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(unit + i * row_bytes));
                const __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(Q4_LANES(v, 4), x0), _mm256_mul_ps(Q4_LANES(v, 5), x1)),
                                               _mm256_add_ps(_mm256_mul_ps(Q4_LANES(v, 6), x2), _mm256_mul_ps(Q4_LANES(v, 7), x3)));
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(scale[i * groups + g + 1]), a, acc[i]);
            }
        }
        for (int i = 0; i < ROWS; i++) {
            float total = hsum8(acc[i]);
            for (int64_t g = 0; g < groups; g++) total += offset[i * groups + g] * xsum[g];
            out[i] = total;
        }
        r = ROWS;
    }
#endif
    for (; r < count; r++) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t e = g * 32; e < (g + 1) * 32; e++) s += (float)q4_value(q + r * row_bytes, e) * x[e];
            total += scale[r * groups + g] * s + offset[r * groups + g] * xsum[g];
        }
        out[r] = total;
    }
}

static void q8_rows_dot(const kv_matrix *w, int64_t first, int64_t count, const float *x, float *out) {
    const int64_t k = w->cols, group = w->group, groups = k / group;
    const int8_t *q = (const int8_t *)w->data + first * k;
    const float *scale = w->scale + first * groups;
    int64_t r = 0;
#ifdef __AVX2__
    if (count == ROWS) {
        const char *next = (const char *)(q + ROWS * k);
        int64_t fetched = 0;
        __m256 acc[ROWS];
        for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            fetched = prefetch_share(next, fetched, (g + 1) * ROWS * k / groups);
            __m256 sum[ROWS];
            for (int i = 0; i < ROWS; i++) sum[i] = _mm256_setzero_ps();
            for (int64_t at = g * group; at < (g + 1) * group; at += 8) {
                const __m256 xv = _mm256_loadu_ps(x + at);
                for (int i = 0; i < ROWS; i++) {
                    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + i * k + at));
                    sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), xv, sum[i]);
                }
            }
            for (int i = 0; i < ROWS; i++) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(scale[i * groups + g]), sum[i], acc[i]);
        }
        for (int i = 0; i < ROWS; i++) out[i] = hsum8(acc[i]);
        r = ROWS;
    }
#endif
    for (; r < count; r++) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t e = g * group; e < (g + 1) * group; e++) s += (float)q[r * k + e] * x[e];
            total += scale[r * groups + g] * s;
        }
        out[r] = total;
    }
}

/* the dequantised row: scale * q + offset, rounded as gguf-py rounds it */
static void q4_row_values(int64_t k, const uint8_t *q, const float *scale, const float *offset, float *out) {
    int64_t e = 0;
#ifdef __AVX2__
    const __m256i nibble = _mm256_set1_epi32(15);
    for (; e + 32 <= k; e += 32) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + (e / 64) * 32));
        const int first = (int)((e % 64) / 8); /* 0, or 4 for a unit's second group */
        const __m256 s = _mm256_set1_ps(scale[e / 32]), o = _mm256_set1_ps(offset[e / 32]);
        for (int i = 0; i < 4; i++) {
            const __m256i lanes = _mm256_srlv_epi32(v, _mm256_set1_epi32(4 * (first + i)));
            const __m256 w = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, nibble));
            _mm256_storeu_ps(out + e + 8 * i, _mm256_add_ps(_mm256_mul_ps(s, w), o));
        }
    }
#endif
    for (; e < k; e++) out[e] = scale[e / 32] * (float)q4_value(q, e) + offset[e / 32];
}

static void row_values(const kv_matrix *w, int64_t row, float *out) {
    const int64_t k = w->cols, groups = k / w->group;
    if (w->kind == 4) {
        q4_row_values(k, (const uint8_t *)w->data + row * q4_row_bytes(k), w->scale + row * groups,
                      w->offset + row * groups, out);
    } else {
        const int8_t *q = (const int8_t *)w->data + row * k;
        const float *scale = w->scale + row * groups;
        for (int64_t g = 0; g < groups; g++)
            for (int64_t i = g * w->group; i < (g + 1) * w->group; i++) out[i] = scale[g] * (float)q[i];
    }
}

/* ---------------------------------------------------------------- matrix products
 * y[r, n] = x[r, :] . W[n, :]. One row of x: four weight rows at a time, as above. Several: four
 * weight rows are dequantised into a scratch buffer, then each row of x is dotted with the four
 * at once.
 */
static void dot_block(int64_t m, int64_t n, int64_t k, const float *x, const float *values, int64_t rows, int64_t first,
                      float *y) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        if (rows < ROWS) {
            for (int64_t i = 0; i < rows; i++) y[r * n + first + i] = dot(k, values + i * k, xr);
            continue;
        }
#ifdef __AVX2__
        __m256 acc[ROWS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        int64_t e = 0;
        for (; e + 8 <= k; e += 8) {
            const __m256 xv = _mm256_loadu_ps(xr + e);
            for (int i = 0; i < ROWS; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(values + i * k + e), xv, acc[i]);
        }
        for (int i = 0; i < ROWS; i++) {
            float total = hsum8(acc[i]);
            for (int64_t t = e; t < k; t++) total += values[i * k + t] * xr[t];
            y[r * n + first + i] = total;
        }
#else
        for (int64_t i = 0; i < rows; i++) y[r * n + first + i] = dot(k, values + i * k, xr);
#endif
    }
}

/* the sums of x's groups of 32, which an int4 product's offsets multiply (nothing for int8) */
static void group_sums(const kv_matrix *w, const float *x, float *xsum) {
    if (w->kind != 4) return;
    for (int64_t g = 0; g < w->cols / 32; g++) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += x[g * 32 + i];
        xsum[g] = s;
    }
}

/* y = W x, the rows shared among the threads of the enclosing parallel region (an orphaned
 * worksharing loop, ending at a barrier); outside a region, the caller computes them all */
static void matvec_shared(const kv_matrix *w, const float *x, const float *xsum, float *y) {
    const int64_t n = w->rows, blocks = (n + ROWS - 1) / ROWS;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t first = block * ROWS, count = n - first < ROWS ? n - first : ROWS;
        if (w->kind == 4)
            q4_rows_dot(w, first, count, x, xsum, y + first);
        else
            q8_rows_dot(w, first, count, x, y + first);
    }
}

/* y = W x, the share of thread ``t`` of ``threads`` (the model step's team) */
static void matvec_part(const kv_matrix *w, const float *x, const float *xsum, float *y, int t, int threads) {
    const int64_t n = w->rows, blocks = (n + ROWS - 1) / ROWS;
    for (int64_t block = blocks * t / threads; block < blocks * (t + 1) / threads; block++) {
        const int64_t first = block * ROWS, count = n - first < ROWS ? n - first : ROWS;
        if (w->kind == 4)
            q4_rows_dot(w, first, count, x, xsum, y + first);
        else
            q8_rows_dot(w, first, count, x, y + first);
    }
}

void kv_matmul(const kv_matrix *w, int64_t m, const float *x, float *y) {
    if (m == 1) {
        float *xsum = malloc(sizeof(float) * (size_t)(w->cols / 32 + 1));
        group_sums(w, x, xsum);
#pragma omp parallel
        matvec_shared(w, x, xsum, y);
        free(xsum);
        return;
    }
    const int64_t n = w->rows, k = w->cols;
#pragma omp parallel
    {
        float *values = malloc(sizeof(float) * (size_t)(ROWS * k));
#pragma omp for schedule(static)
        for (int64_t block = 0; block < (n + ROWS - 1) / ROWS; block++) {
            const int64_t first = block * ROWS, rows = n - first < ROWS ? n - first : ROWS;
            for (int64_t i = 0; i < rows; i++) row_values(w, first + i, values + i * k);
            dot_block(m, n, k, x, values, rows, first, y);
        }
        free(values);
    }
}

/* rows of a matrix as float32 (``rows`` NULL: the first ``count``): an embedding lookup, or a
 * block of a matrix for a long prefill's GEMM */
void kv_dequantize(const kv_matrix *w, int64_t count, const int64_t *rows, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) row_values(w, rows ? rows[i] : i, out + i * w->cols);
}

/* ---------------------------------------------------------------- one-token attention
 * One query token's heads (q: [q_heads, dim]) over keys and values [kv_heads][capacity][dim]
 * (head stride ``head_stride`` floats), keys [lo, hi) visible; q head h reads kv head
 * h / (q_heads / kv_heads), as transformers' repeat_kv pairs them. The keys are split between
 * threads; each keeps a running softmax (max, sum, weighted values) per head over tiles of keys,
 * and the parts are merged at the end.
 */
#define TILE 64

static void tile_scores(int64_t dim, const float *qh, const float *keys, int64_t count, float scaling, float *scores) {
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + 8 <= count; j += 8) {
        __m256 acc[8];
        for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + d);
            for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + (j + t) * dim + d), acc[t]);
        }
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scaling)));
    }
#endif
    for (; j < count; j++) scores[j] = dot(dim, qh, keys + j * dim) * scaling;
}

static float exp_tile(float *scores, int64_t count, float top) {
    float total = 0.0f;
    int64_t j = 0;
#ifdef __AVX2__
    __m256 sum = _mm256_setzero_ps();
    for (; j + 8 <= count; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(scores + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    total = hsum8(sum);
#endif
    for (; j < count; j++) {
        scores[j] = expf(scores[j] - top);
        total += scores[j];
    }
    return total;
}

/* acc += sum_j p_j v_j over a tile, eight lanes of acc at a time held in registers */
static void accumulate_values(int64_t dim, const float *p, const float *v, int64_t count, float *acc) {
    int64_t d = 0;
#ifdef __AVX2__
    for (; d + 64 <= dim; d += 64) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(acc + d + 8 * i);
        for (int64_t j = 0; j < count; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *vj = v + j * dim + d;
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + d + 8 * i, a[i]);
    }
#endif
    for (; d < dim; d++)
        for (int64_t j = 0; j < count; j++) acc[d] += p[j] * v[j * dim + d];
}

static void attend_part(int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t head_stride, const float *q,
                        const float *keys, const float *values, int64_t lo, int64_t hi, float scaling, float *max_out,
                        float *sum_out, float *acc_out) {
    /* each tile of a kv head's keys and values is read from memory once, for every q head it serves */
    const int64_t group = q_heads / kv_heads;
    float scores[TILE];
    for (int64_t h = 0; h < q_heads; h++) {
        max_out[h] = -INFINITY;
        sum_out[h] = 0.0f;
        memset(acc_out + h * dim, 0, sizeof(float) * (size_t)dim);
    }
    for (int64_t kv = 0; kv < kv_heads; kv++) {
        const float *kh = keys + kv * head_stride, *vh = values + kv * head_stride;
        for (int64_t start = lo; start < hi; start += TILE) {
            const int64_t count = hi - start < TILE ? hi - start : TILE;
            for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
                float *acc = acc_out + h * dim;
                tile_scores(dim, q + h * dim, kh + start * dim, count, scaling, scores);
                float tile_max = -INFINITY;
                for (int64_t j = 0; j < count; j++) tile_max = scores[j] > tile_max ? scores[j] : tile_max;
                const float new_max = tile_max > max_out[h] ? tile_max : max_out[h];
                const float rescale = expf(max_out[h] - new_max);
                sum_out[h] = sum_out[h] * rescale + exp_tile(scores, count, new_max);
                for (int64_t d = 0; d < dim; d++) acc[d] *= rescale;
                accumulate_values(dim, scores, vh + start * dim, count, acc);
                max_out[h] = new_max;
            }
        }
    }
}

/* scratch for attend_shared: a running max, sum and weighted values per head for each part */
typedef struct {
    float *maxes, *sums, *accs;
} attention_parts;

static attention_parts parts_for(int64_t q_heads, int64_t dim, int threads) {
    attention_parts parts = {malloc(sizeof(float) * (size_t)(threads * q_heads)),
                             malloc(sizeof(float) * (size_t)(threads * q_heads)),
                             malloc(sizeof(float) * (size_t)(threads * q_heads * dim))};
    return parts;
}

static void free_parts(attention_parts parts) {
    free(parts.maxes);
    free(parts.sums);
    free(parts.accs);
}

/* how many parts the keys [lo, hi) are split into among ``threads``: at least a tile each (a
 * part's merge costs a pass over one head's values) */
static int attention_parts_for(int64_t length, int threads) {
    const int64_t tiles = length / TILE;
    return tiles < threads ? (tiles > 1 ? (int)tiles : 1) : threads;
}

static void merge_parts(int64_t q_heads, int64_t dim, int parts, attention_parts scratch, float *out) {
    for (int64_t h = 0; h < q_heads; h++) {
        float top = -INFINITY, total = 0.0f;
        for (int p = 0; p < parts; p++) top = scratch.maxes[p * q_heads + h] > top ? scratch.maxes[p * q_heads + h] : top;
        float *o = out + h * dim;
        memset(o, 0, sizeof(float) * (size_t)dim);
        for (int p = 0; p < parts; p++) {
            const float weight = expf(scratch.maxes[p * q_heads + h] - top);
            total += scratch.sums[p * q_heads + h] * weight;
            const float *acc = scratch.accs + ((int64_t)p * q_heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) o[d] += acc[d] * weight;
        }
        for (int64_t d = 0; d < dim; d++) o[d] /= total;
    }
}

/* the keys [lo, hi) shared among the threads of the enclosing region, one part each; one merges */
static void attend_shared(int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t head_stride, const float *q,
                          const float *keys, const float *values, int64_t lo, int64_t hi, float scaling,
                          attention_parts scratch, float *out) {
    const int64_t length = hi - lo;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_num_threads();
#endif
    const int parts = attention_parts_for(length, threads);
#pragma omp for schedule(static)
    for (int p = 0; p < parts; p++) {
        const int64_t a = lo + length * p / parts, b = lo + length * (p + 1) / parts;
        attend_part(q_heads, kv_heads, dim, head_stride, q, keys, values, a, b, scaling, scratch.maxes + p * q_heads,
                    scratch.sums + p * q_heads, scratch.accs + (int64_t)p * q_heads * dim);
    }
#pragma omp single
    merge_parts(q_heads, dim, parts, scratch, out);
}

void kv_attend_one(int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t head_stride, const float *q,
                   const float *keys, const float *values, int64_t lo, int64_t hi, float scaling, float *out) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const attention_parts scratch = parts_for(q_heads, dim, threads);
#pragma omp parallel
    attend_shared(q_heads, kv_heads, dim, head_stride, q, keys, values, lo, hi, scaling, scratch, out);
    free_parts(scratch);
}

/* ---------------------------------------------------------------- one token through the model
 * What kvshift_memory.engine.stepping does in PyTorch, here in one call and one parallel region:
 * the embedding row, then per layer its norms (RMS: ``w * (x * rsqrt(mean(x^2) + eps))``, Gemma's
 * ``1 + w`` given as ``w``), one product for q, k and v, the optional norms of q and k per head, the
 * rotation (``x * cos + roll(x) * signed_sin``, as transformers' rotate_half), the cache write at
 * ``slot``, attention over the slots the layer sees, the output projection, the MLP with gate and
 * up in one product; then the final norm and the output head. Layouts: ``sandwich`` 0 (Llama:
 * norm, attention, add; norm, MLP, add) or 1 (Gemma 3: norms on the attention output and around
 * the MLP).
 *
 * One region for the whole token, not one per product: its threads meet at barriers, while a new
 * region wakes its threads again, and once another thread of the process has run OpenMP work
 * (a background writer's PyTorch call) libgomp stops spinning between regions and puts its
 * threads to sleep (a step of SmolLM2-135M went from 12 to 22 ms with one region per product).
 */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, intermediate, window, activation, sandwich;
    float eps, scaling;
    const float *input_norm, *attention_norm, *mlp_norm, *mlp_out_norm, *q_norm, *k_norm;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* each NULL when the layer has none */
    kv_matrix qkv, o, gate_up, down;
} kv_layer;

typedef struct {
    int64_t layers, hidden, vocab;
    float eps, embed_scale;
    const kv_layer *layer;
    kv_matrix embed, head;
    const float *final_norm;
} kv_model;

static void add_bias(int64_t n, float *y, const float *bias) {
    if (bias)
        for (int64_t i = 0; i < n; i++) y[i] += bias[i];
}

static void rms_norm(int64_t n, const float *x, const float *weight, float eps, float *out) {
    float squares = 0.0f;
    for (int64_t i = 0; i < n; i++) squares += x[i] * x[i];
    const float scale = 1.0f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * scale);
}

static void rotate(int64_t heads, int64_t dim, float *x, const float *cos, const float *signed_sin) {
    const int64_t half = dim / 2;
    float rolled[dim];
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * dim;
        for (int64_t d = 0; d < dim; d++) rolled[d] = xh[(d + half) % dim];
        for (int64_t d = 0; d < dim; d++) xh[d] = xh[d] * cos[d] + rolled[d] * signed_sin[d];
    }
}

static float activate(float x, int64_t kind) {
    if (kind == 0) return x / (1.0f + expf(-x)); /* silu */
    const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x); /* gelu, tanh approximation */
    return 0.5f * x * (1.0f + tanhf(inner));
}

/* ---------------------------------------------------------------- the model step's threads
 * One OpenMP region for the whole token, and inside it barriers of our own that spin: once a
 * second thread of the process has run OpenMP work (a background writer's PyTorch call, a
 * framework's worker thread), libgomp stops spinning at its own barriers and puts threads to
 * sleep there, and a step with a few hundred barriers took twice as long (12 to 22 ms for
 * SmolLM2-135M). A pool of separate threads avoided that but then competed for the cores with
 * libgomp's threads, which spin for a while after PyTorch's own work (a `cos` before the step
 * made it 60 % slower); running on libgomp's threads, the step uses the very threads that spin.
 */
typedef void (*team_job)(void *arg, int thread, int threads);

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void run_team(team_job job, void *arg, int threads) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    job(arg, omp_get_thread_num(), omp_get_num_threads());
#else
    (void)threads;
    job(arg, 0, 1);
#endif
}

typedef struct {
    atomic_int arrived, phase;
} barrier;

/* every thread of the team waits here for the others, spinning (``threads``: the team's size) */
static void barrier_wait(barrier *b, int *phase, int threads) {
    if (threads == 1) return;
    *phase = !*phase;
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, *phase, memory_order_release);
    } else {
        while (atomic_load_explicit(&b->phase, memory_order_acquire) != *phase) relax();
    }
}

typedef struct {
    const kv_model *M;
    int64_t token, slot, capacity;
    float *const *keys, *const *values;
    const float *const *cos, *const *signed_sin;
    float *logits, *hidden, *normed, *qkv, *attended, *out, *gate_up, *xsum;
    attention_parts scratch;
    barrier sync;
} step_args;

/* one of the step's products, W x: the threads meet before it (its input is ready) and after it
 * (its output is) */
static void product(step_args *a, int *phase, const kv_matrix *w, const float *x, float *y, int t, int threads) {
    barrier_wait(&a->sync, phase, threads);
    matvec_part(w, x, a->xsum, y, t, threads);
    barrier_wait(&a->sync, phase, threads);
}

static void step_job(void *pointer, int t, int threads) {
    step_args *a = pointer;
    const kv_model *M = a->M;
    const int64_t n = M->hidden;
    int phase = 0;
#define SYNC() barrier_wait(&a->sync, &phase, threads)
    if (t == 0) {
        row_values(&M->embed, a->token, a->hidden);
        if (M->embed_scale != 1.0f)
            for (int64_t i = 0; i < n; i++) a->hidden[i] *= M->embed_scale;
    }
    for (int64_t index = 0; index < M->layers; index++) {
        const kv_layer *L = M->layer + index;
        const int64_t d = L->head_dim, q_size = L->q_heads * d, kv_size = L->kv_heads * d;
        float *k_cache = a->keys[index], *v_cache = a->values[index];
        if (t == 0) {
            rms_norm(n, a->hidden, L->input_norm, L->eps, a->normed);
            group_sums(&L->qkv, a->normed, a->xsum);
        }
        product(a, &phase, &L->qkv, a->normed, a->qkv, t, threads);
        if (t == 0) {
            float *q = a->qkv, *k = a->qkv + q_size, *v = a->qkv + q_size + kv_size;
            add_bias(q_size + 2 * kv_size, a->qkv, L->qkv_bias);
            if (L->q_norm) {
                for (int64_t h = 0; h < L->q_heads; h++) rms_norm(d, q + h * d, L->q_norm, L->eps, q + h * d);
                for (int64_t h = 0; h < L->kv_heads; h++) rms_norm(d, k + h * d, L->k_norm, L->eps, k + h * d);
            }
            rotate(L->q_heads, d, q, a->cos[index], a->signed_sin[index]);
            rotate(L->kv_heads, d, k, a->cos[index], a->signed_sin[index]);
            for (int64_t h = 0; h < L->kv_heads; h++) {
                memcpy(k_cache + (h * a->capacity + a->slot) * d, k + h * d, sizeof(float) * (size_t)d);
                memcpy(v_cache + (h * a->capacity + a->slot) * d, v + h * d, sizeof(float) * (size_t)d);
            }
        }
        SYNC();
        const int64_t lo = L->window > 0 && a->slot + 1 > L->window ? a->slot + 1 - L->window : 0, hi = a->slot + 1;
        const int parts = attention_parts_for(hi - lo, threads);
        if (t < parts) {
            const int64_t from = lo + (hi - lo) * t / parts, to = lo + (hi - lo) * (t + 1) / parts;
            attend_part(L->q_heads, L->kv_heads, d, a->capacity * d, a->qkv, k_cache, v_cache, from, to, L->scaling,
                        a->scratch.maxes + t * L->q_heads, a->scratch.sums + t * L->q_heads,
                        a->scratch.accs + (int64_t)t * L->q_heads * d);
        }
        SYNC();
        if (t == 0) {
            merge_parts(L->q_heads, d, parts, a->scratch, a->attended);
            group_sums(&L->o, a->attended, a->xsum);
        }
        product(a, &phase, &L->o, a->attended, a->out, t, threads);
        if (t == 0) {
            add_bias(n, a->out, L->o_bias);
            if (L->sandwich) rms_norm(n, a->out, L->attention_norm, L->eps, a->out);
            for (int64_t i = 0; i < n; i++) a->hidden[i] += a->out[i];
            rms_norm(n, a->hidden, L->mlp_norm, L->eps, a->normed);
            group_sums(&L->gate_up, a->normed, a->xsum);
        }
        product(a, &phase, &L->gate_up, a->normed, a->gate_up, t, threads);
        {
            /* the activation's share of each thread (tanh and exp are most of the step's scalar work) */
            const int64_t from = L->intermediate * t / threads, to = L->intermediate * (t + 1) / threads;
            const float *gate_bias = L->gate_up_bias, *up_bias = gate_bias ? gate_bias + L->intermediate : NULL;
            for (int64_t i = from; i < to; i++) {
                const float gate = a->gate_up[i] + (gate_bias ? gate_bias[i] : 0.0f);
                const float up = a->gate_up[L->intermediate + i] + (up_bias ? up_bias[i] : 0.0f);
                a->gate_up[i] = activate(gate, L->activation) * up;
            }
        }
        SYNC();
        if (t == 0) group_sums(&L->down, a->gate_up, a->xsum);
        product(a, &phase, &L->down, a->gate_up, a->out, t, threads);
        if (t == 0) {
            add_bias(n, a->out, L->down_bias);
            if (L->sandwich) rms_norm(n, a->out, L->mlp_out_norm, L->eps, a->out);
            for (int64_t i = 0; i < n; i++) a->hidden[i] += a->out[i];
        }
    }
    if (t == 0) {
        rms_norm(n, a->hidden, M->final_norm, M->eps, a->normed);
        group_sums(&M->head, a->normed, a->xsum);
    }
    barrier_wait(&a->sync, &phase, threads);
    matvec_part(&M->head, a->normed, a->xsum, a->logits, t, threads);
#undef SYNC
}

void kv_model_step(const kv_model *M, int64_t token, int64_t slot, float *const *keys, float *const *values,
                   int64_t capacity, const float *const *cos, const float *const *signed_sin, float *logits,
                   int64_t threads) {
    const kv_layer *first = M->layer;
    const int64_t n = M->hidden, d = first->head_dim, q_size = first->q_heads * d, kv_size = first->kv_heads * d;
    int64_t widest = n > first->intermediate ? n : first->intermediate;
    widest = widest > q_size ? widest : q_size;
    if (threads < 1) threads = 1;
    step_args a = {M, token, slot, capacity, keys, values, cos, signed_sin, logits};
    a.hidden = malloc(sizeof(float) * (size_t)n);
    a.normed = malloc(sizeof(float) * (size_t)n);
    a.qkv = malloc(sizeof(float) * (size_t)(q_size + 2 * kv_size));
    a.attended = malloc(sizeof(float) * (size_t)q_size);
    a.out = malloc(sizeof(float) * (size_t)n);
    a.gate_up = malloc(sizeof(float) * (size_t)(2 * first->intermediate));
    a.xsum = malloc(sizeof(float) * (size_t)(widest / 16 + 1));
    a.scratch = parts_for(first->q_heads, d, (int)threads);
    atomic_init(&a.sync.arrived, 0);
    atomic_init(&a.sync.phase, 0);
    run_team(step_job, &a, (int)threads);
    free(a.hidden);
    free(a.normed);
    free(a.qkv);
    free(a.attended);
    free(a.out);
    free(a.gate_up);
    free(a.xsum);
    free_parts(a.scratch);
}
