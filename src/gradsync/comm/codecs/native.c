/* gradsync's CPU codec kernels: one pass over the input where the eager code takes several.
 *
 * Loaded by gradsync/comm/codecs/native.py (compiled with -O3 -march=native -ffp-contract=off, so
 * every float operation rounds exactly as the eager torch code's does). Each kernel gives the bytes
 * of the eager code it replaces; native.py checks that on a probe before using it.
 *
 * Magnitudes are compared as the integer bits of |x| (x's bits with the sign cleared): for floats
 * that is the order of their magnitudes, -0.0 equals 0.0, and NaN sorts above infinity.
 */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t mag(const float *x, int64_t i, int64_t n) {
    uint32_t u;
    if (i >= n) return 0; /* the zero padding of the last chunk */
    memcpy(&u, x + i, 4);
    return u & 0x7FFFFFFFu;
}

/* ---- sign: packed sign bits (high bit first) and per-chunk mean |x| (float64 sum) ---------------- */

static uint8_t reverse8(uint8_t v) {
    v = (uint8_t)((v & 0xF0) >> 4 | (v & 0x0F) << 4);
    v = (uint8_t)((v & 0xCC) >> 2 | (v & 0x33) << 2);
    return (uint8_t)((v & 0xAA) >> 1 | (v & 0x55) << 1);
}

void sign_encode(const float *x, int64_t n, int64_t chunk, uint8_t *packed, float *scales) {
    for (int64_t start = 0, c = 0; start < n; start += chunk, c++) {
        int64_t end = start + chunk < n ? start + chunk : n;
        int64_t i = start;
        double s = 0.0;
#if defined(__AVX2__)
        __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), zero = _mm256_setzero_ps();
        for (; i + 16 <= end; i += 16) {
            __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
            __m256 m0 = _mm256_and_ps(v0, absmask), m1 = _mm256_and_ps(v1, absmask);
            a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(m0)));
            a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(m0, 1)));
            a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(m1)));
            a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(m1, 1)));
            /* lane j of the mask is bit j; the wire puts entry j at bit 7 - j */
            packed[i >> 3] = reverse8((uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v0, zero, _CMP_GE_OQ)));
            packed[(i >> 3) + 1] = reverse8((uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v1, zero, _CMP_GE_OQ)));
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
        s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
        for (; i < end; i++) s += fabs((double)x[i]);
        scales[c] = (float)(s / (double)(end - start));
    }
#if defined(__AVX2__)
    /* bytes the vector loop above did not write: those of each chunk's last < 16 entries */
    for (int64_t start = 0; start < n; start += chunk) {
        int64_t end = start + chunk < n ? start + chunk : n;
        for (int64_t b = (start + ((end - start) / 16) * 16) / 8; b < end / 8; b++) {
#else
    {
        for (int64_t b = 0; b < n / 8; b++) {
#endif
            const float *p = x + 8 * b;
            uint8_t v = 0;
            for (int j = 0; j < 8; j++) v |= (uint8_t)((p[j] >= 0.0f) << (7 - j));
            packed[b] = v;
        }
    }
}

void sign_decode(const uint8_t *packed, const float *scales, int64_t n, int64_t chunk, float *out) {
    static float table[256][8];
    static int ready = 0;
    if (!ready) { /* benign race: every thread writes the same values */
        for (int b = 0; b < 256; b++)
            for (int j = 0; j < 8; j++) table[b][j] = (b >> (7 - j)) & 1 ? 1.0f : -1.0f;
        ready = 1;
    }
    for (int64_t start = 0, c = 0; start < n; start += chunk, c++) {
        int64_t end = start + chunk < n ? start + chunk : n;
        float s = scales[c];
        int64_t i = start;
        if ((start & 7) == 0) {
            for (; i + 8 <= end; i += 8) {
                const float *t = table[packed[i >> 3]];
                for (int j = 0; j < 8; j++) out[i + j] = t[j] * s;
            }
        }
        for (; i < end; i++) out[i] = ((packed[i >> 3] >> (7 - (i & 7))) & 1 ? 1.0f : -1.0f) * s;
    }
}

/* ---- topk: every entry with |x| >= threshold, ascending ------------------------------------------ */

int64_t topk_candidates(const float *x, int64_t n, float threshold, int64_t *idx, float *mags, int64_t cap) {
    uint32_t t;
    float ta = fabsf(threshold);
    memcpy(&t, &ta, 4);
    int64_t count = 0;
    const uint32_t *u = (const uint32_t *)x;
    int64_t i = 0;
#if defined(__AVX2__)
    __m256i lim = _mm256_set1_epi32((int32_t)t - 1), keep = _mm256_set1_epi32(0x7FFFFFFF);
    for (; i + 16 <= n; i += 16) {
        __m256i lo8 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(u + i)), keep);
        __m256i hi8 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(u + i + 8)), keep);
        uint32_t hits = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(lo8, lim)))
                      | (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(hi8, lim))) << 8;
        while (hits) {
            int j = __builtin_ctz(hits);
            hits &= hits - 1;
            if (count < cap) {
                uint32_t m = u[i + j] & 0x7FFFFFFFu;
                idx[count] = i + j;
                memcpy(mags + count, &m, 4);
            }
            count++;
        }
    }
#endif
    for (; i < n; i++) {
        uint32_t m = u[i] & 0x7FFFFFFFu;
        if (m >= t) {
            if (count < cap) { idx[count] = i; memcpy(mags + count, &m, 4); }
            count++;
        }
    }
    return count; /* more than cap: the caller searches again with room for all */
}

/* out = 0 except out[idx[e]] = vals[e]; idx strictly ascending and below n (else returns -1 having
 * written nothing): written block by block, each zeroed and filled while in cache. */
int topk_decode(const int32_t *idx, const float *vals, int64_t k, int64_t n, float *out) {
    for (int64_t e = 0; e < k; e++)
        if (idx[e] < 0 || idx[e] >= n || (e && idx[e] <= idx[e - 1])) return -1;
    const int64_t block = 4096;
    int64_t e = 0;
    for (int64_t start = 0; start < n; start += block) {
        int64_t end = start + block < n ? start + block : n;
        memset(out + start, 0, (size_t)(end - start) * sizeof(float));
        for (; e < k && idx[e] < end; e++) out[idx[e]] = vals[e];
    }
    return 0;
}

/* ---- sparseloco ------------------------------------------------------------------------------ */

/* A t with at least k of v[0..m) >= t (m >= k): found by bisection on the bits between their minimum
 * and maximum, stopping as soon as at most k + slack reach it; otherwise the largest such t, the
 * k-th largest value. */
static uint32_t threshold(const uint32_t *v, int64_t m, int64_t k, int64_t slack) {
    uint32_t lo = 0xFFFFFFFFu, hi = 0;
    for (int64_t i = 0; i < m; i++) {
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    while (lo < hi) { /* invariant: count(>= lo) >= k; count(>= hi + 1) < k */
        uint32_t mid = lo + (hi - lo + 1) / 2;
        int64_t count = 0;
        for (int64_t i = 0; i < m; i++) count += v[i] >= mid;
        if (count >= k) {
            lo = mid;
            if (count <= k + slack) break;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

typedef struct {
    uint8_t *out;
    int64_t pos;
    uint64_t acc;
    int bits;
} writer;

static inline void put(writer *w, uint64_t code, int width) {
    w->acc = (w->acc << width) | code;
    w->bits += width;
    while (w->bits >= 8) {
        w->bits -= 8;
        w->out[w->pos++] = (uint8_t)(w->acc >> w->bits);
    }
}

/* The packed message of sparse.encode: per chunk the k entries of largest magnitude (ties to the
 * lower index), in ascending index order, as (low << bits | q) codes of low_bits + bits bits (an
 * index's low bits), then the chunk's upper bitmap (Elias-Fano: the i-th entry sets bit
 * (index >> low_bits) + i of k + chunk >> low_bits), chunk after chunk; then the float32 scales.
 * Scratch: ``groups``, ``cand_idx``, ``cand_mag`` of ``chunk`` entries each, ``chosen_idx``,
 * ``chosen_val``, ``chosen_q`` of ``k``. */
void sparse_encode(const float *x, int64_t n, int64_t chunk, int64_t k, int bits, int low_bits,
                   uint8_t *msg, uint32_t *groups, int32_t *cand_idx, uint32_t *cand_mag, int32_t *chosen_idx,
                   float *chosen_val, int32_t *chosen_q) {
    int64_t chunks = n > chunk ? (n + chunk - 1) / chunk : 1;
    /* groups of g entries, at least k of them: the k-th largest group maximum is a lower bound
     * of the chunk's k-th largest magnitude (k distinct entries reach it) */
    int64_t g = 16;
    while (g > 1 && chunk / g < k) g /= 2;
    int64_t ngroups = chunk / g;
    int top = (1 << bits) - 1;
    float half = (float)top / 2.0f;
    writer w = {msg, 0, 0, 0};
    float *scales = (float *)0;
    int64_t upper = k + (chunk >> low_bits);
    int64_t code_bytes = (chunks * (k * (low_bits + bits) + upper) + 7) / 8;
    uint64_t low_mask = ((uint64_t)1 << low_bits) - 1;
    for (int64_t c = 0; c < chunks; c++) {
        int64_t base = c * chunk;
        if (base + chunk <= n) {
            const uint32_t *u = (const uint32_t *)(x + base);
            for (int64_t q = 0; q < ngroups; q++) {
                uint32_t best = 0;
                for (int64_t j = 0; j < g; j++) {
                    uint32_t m = u[q * g + j] & 0x7FFFFFFFu;
                    best = m > best ? m : best;
                }
                groups[q] = best;
            }
        } else {
            for (int64_t q = 0; q < ngroups; q++) {
                uint32_t best = 0;
                for (int64_t j = 0; j < g; j++) {
                    uint32_t m = mag(x, base + q * g + j, n);
                    best = m > best ? m : best;
                }
                groups[q] = best;
            }
        }
        uint32_t bound = threshold(groups, ngroups, k, k / 4);
        int64_t cands = 0;
        for (int64_t q = 0; q < ngroups; q++) {
            if (groups[q] < bound) continue;
            int64_t first = q * g;
            if (g == 16 && base + first + 16 <= n) {
                const uint32_t *u = (const uint32_t *)(x + base + first);
                uint32_t hits = 0;
#if defined(__AVX2__)
                __m256i lim = _mm256_set1_epi32((int32_t)bound - 1), keep = _mm256_set1_epi32(0x7FFFFFFF);
                __m256i lo8 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)u), keep);
                __m256i hi8 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(u + 8)), keep);
                hits = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(lo8, lim)))
                     | (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(hi8, lim))) << 8;
#else
                for (int j = 0; j < 16; j++) hits |= (uint32_t)((u[j] & 0x7FFFFFFFu) >= bound) << j;
#endif
                while (hits) {
                    int j = __builtin_ctz(hits);
                    hits &= hits - 1;
                    cand_idx[cands] = (int32_t)(first + j);
                    cand_mag[cands++] = u[j] & 0x7FFFFFFFu;
                }
                continue;
            }
            for (int64_t j = 0; j < g; j++) {
                int64_t i = first + j;
                uint32_t m = mag(x, base + i, n);
                cand_idx[cands] = (int32_t)i;
                cand_mag[cands] = m;
                cands += m >= bound;
            }
        }
        uint32_t tau = threshold(cand_mag, cands, k, 0); /* exactly k reach it, or the k-th largest */
        int64_t above = 0;
        uint32_t smax = 0;
        for (int64_t i = 0; i < cands; i++) {
            above += cand_mag[i] > tau;
            smax = cand_mag[i] > smax ? cand_mag[i] : smax; /* the largest chosen magnitude: the scale */
        }
        int64_t ties = k - above; /* entries equal to tau taken, lowest index first */
        float s;
        memcpy(&s, &smax, 4);
        float denom = s > 0x1p-126f ? s : 0x1p-126f;
        int64_t kept = 0;
        for (int64_t i = 0; i < cands; i++) {
            uint32_t m = cand_mag[i];
            if (m < tau || (m == tau && ties-- <= 0)) continue;
            int64_t at = base + cand_idx[i];
            chosen_idx[kept] = cand_idx[i];
            chosen_val[kept++] = at < n ? x[at] : 0.0f;
        }
        for (int64_t i = 0; i < k; i++) { /* vectorized: the divisions round as torch's do */
            float t = chosen_val[i] / denom;
            t = t + 1.0f;
            t = t * half;
            t = nearbyintf(t);
            t = t < 0.0f ? 0.0f : t;
            t = t > (float)top ? (float)top : t;
            chosen_q[i] = (int32_t)t;
        }
        for (int64_t i = 0; i < k; i++)
            put(&w, (((uint64_t)chosen_idx[i] & low_mask) << bits) | (uint64_t)chosen_q[i], low_bits + bits);
        /* the upper bitmap, built in ``groups`` (free now; it holds chunk >= (upper + 31) / 32 words) */
        uint32_t *words = groups;
        int64_t nwords = (upper + 31) / 32;
        memset(words, 0, (size_t)nwords * sizeof(uint32_t));
        for (int64_t i = 0; i < k; i++) {
            int64_t at = ((int64_t)chosen_idx[i] >> low_bits) + i;
            words[at >> 5] |= 0x80000000u >> (at & 31);
        }
        for (int64_t j = 0; j + 1 < nwords; j++) put(&w, words[j], 32);
        int last = (int)(upper - 32 * (nwords - 1));
        put(&w, words[nwords - 1] >> (32 - last), last);
        scales = (float *)(msg + code_bytes);
        memcpy(scales + c, &s, 4);
    }
    if (w.bits > 0) msg[w.pos++] = (uint8_t)(w.acc << (8 - w.bits));
}

typedef struct {
    const uint8_t *p;
    uint64_t acc;
    int have;
} reader;

/* A reader at bit ``bit`` of ``msg``. */
static inline reader reader_at(const uint8_t *msg, int64_t bit) {
    reader r = {msg + (bit >> 3) + 1, msg[bit >> 3], 8 - (int)(bit & 7)};
    r.acc &= (1u << r.have) - 1;
    return r;
}

/* The next ``width`` (<= 56) bits, most significant first. */
static inline uint64_t get(reader *r, int width) {
    while (r->have < width) { r->acc = (r->acc << 8) | *r->p++; r->have += 8; }
    r->have -= width;
    uint64_t code = (r->acc >> r->have) & (((uint64_t)1 << width) - 1);
    r->acc &= ((uint64_t)1 << r->have) - 1;
    return code;
}

/* The sum of ``world`` messages (``msgs``: world x msg_bytes) into ``total`` (C x chunk entries),
 * chunk by chunk: the chunk's row is zeroed, then every message's values are added in rank order
 * (positions are unique within a message), so the row is written while it is in cache. Scratch:
 * ``codes`` of k. */
void sparse_decode_sum(const uint8_t *msgs, int64_t world, int64_t msg_bytes, int64_t n, int64_t chunk, int64_t k,
                       int bits, int low_bits, uint32_t *codes, float *total) {
    int64_t chunks = n > chunk ? (n + chunk - 1) / chunk : 1;
    int64_t code_bytes = msg_bytes - 4 * chunks;
    int width = low_bits + bits;
    int64_t upper = k + (chunk >> low_bits);
    int64_t chunk_bits = k * width + upper;
    int top = (1 << bits) - 1;
    float levels[256];
    for (int q = 0; q <= top; q++) levels[q] = ((float)q * 2.0f - (float)top) / (float)top;
    for (int64_t c = 0; c < chunks; c++) {
        float *row = total + c * chunk;
        memset(row, 0, (size_t)chunk * sizeof(float));
        for (int64_t r = 0; r < world; r++) {
            const uint8_t *msg = msgs + r * msg_bytes;
            float s;
            memcpy(&s, msg + code_bytes + 4 * c, 4);
            reader in = reader_at(msg, c * chunk_bits);
            for (int64_t e = 0; e < k; e++) codes[e] = (uint32_t)get(&in, width);
            /* the i-th set bit of the upper bitmap is at (index >> low_bits) + i */
            int64_t e = 0;
            for (int64_t at = 0; at < upper && e < k; at += 32) {
                int take = upper - at < 32 ? (int)(upper - at) : 32;
                uint32_t word = (uint32_t)get(&in, take);
                while (word && e < k) {
                    int lead = 31 - __builtin_clz(word); /* the highest set bit comes first */
                    word &= ~((uint32_t)1 << lead);
                    int64_t high = at + (take - 1 - lead) - e;
                    uint32_t code = codes[e++];
                    row[(high << low_bits) | (code >> bits)] += levels[code & (uint32_t)top] * s;
                }
            }
        }
    }
}

/* ---- int8 / int4 ------------------------------------------------------------------------------ */

/* max |x| of every chunk of every row of x (rows x length, contiguous): (rows x chunks) floats. */
void absmax_chunks(const float *x, int64_t rows, int64_t length, int64_t chunk, float *out) {
    int64_t chunks = (length + chunk - 1) / chunk;
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *u = (const uint32_t *)(x + r * length);
        for (int64_t c = 0; c < chunks; c++) {
            int64_t start = c * chunk, end = start + chunk < length ? start + chunk : length;
            uint32_t best = 0;
            for (int64_t i = start; i < end; i++) {
                uint32_t m = u[i] & 0x7FFFFFFFu;
                best = m > best ? m : best;
            }
            memcpy(out + r * chunks + c, &best, 4);
        }
    }
}

/* out = q * step of its chunk, q the int8 codes (rows x length, rows ``stride`` bytes apart), step (rows x chunks). */
void int8_decode(const int8_t *q, int64_t rows, int64_t length, int64_t stride, int64_t chunk, const float *step,
                 float *out) {
    int64_t chunks = (length + chunk - 1) / chunk;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t start = c * chunk, end = start + chunk < length ? start + chunk : length;
            float s = step[r * chunks + c];
            const int8_t *qr = q + r * stride;
            float *o = out + r * length;
            for (int64_t i = start; i < end; i++) o[i] = (float)qr[i] * s;
        }
}

/* int4 payload rows (rows x half bytes, ``stride`` apart: entry i in the high nibble, entry i + half
 * in the low one, each q + 8) to q * step of its chunk (rows x 2 half). */
void int4_decode(const uint8_t *payload, int64_t rows, int64_t half, int64_t stride, int64_t chunk, const float *step,
                 float *out) {
    int64_t length = 2 * half, chunks = (length + chunk - 1) / chunk;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *p = payload + r * stride;
        float *o = out + r * length;
        const float *st = step + r * chunks;
        for (int64_t c = 0; c < chunks; c++) {
            int64_t start = c * chunk, end = start + chunk < length ? start + chunk : length;
            float s = st[c];
            int64_t i = start, mid = end < half ? end : half;
            for (; i < mid; i++) o[i] = (float)((int)(p[i] >> 4) - 8) * s;
            for (i = i > half ? i : half; i < end; i++) o[i] = (float)((int)(p[i - half] & 0x0F) - 8) * s;
        }
    }
}

/* Stochastic rounding of int8/int4 (see int8.py): codes[r, i] = floor(x inv[r, c] + w) as a byte, w the
 * float32 with bits a[r, c] ^ b[j] (in [2^e, 2^e + 1)), i = c chunk + j; x rows ``xstride`` floats
 * apart, codes rows ``cstride`` bytes apart. ``nibbles``: int4's payload instead (length / 2 bytes a
 * row: entry i in the high nibble of byte i, entry i + length / 2 in its low nibble). x inv + w is one fused multiply-add, rounded once, as
 * torch's addcmul on a CPU with FMA (the caller's probe checks that this machine's eager code agrees). */
void quant_round(const float *x, int64_t rows, int64_t length, int64_t xstride, int64_t chunk, const float *inv,
                 const int32_t *a, const int32_t *b, uint8_t *codes, int64_t cstride, int nibbles) {
    int64_t chunks = (length + chunk - 1) / chunk;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xstride;
        uint8_t *cr = codes + r * cstride;
        for (int64_t c = 0; c < chunks; c++) {
            int64_t start = c * chunk, end = start + chunk < length ? start + chunk : length;
            float f = inv[r * chunks + c];
            int32_t ac = a[r * chunks + c];
            if (!nibbles) {
                for (int64_t i = start; i < end; i++) {
                    int32_t bits = ac ^ b[i - start];
                    float w;
                    memcpy(&w, &bits, 4);
                    cr[i] = (uint8_t)(int32_t)fmaf(xr[i], f, w);
                }
                continue;
            }
            /* int4: entry i in the high nibble of byte i, entry i + half in the low nibble */
            int64_t half = length / 2;
            for (int64_t i = start; i < end; i++) {
                int32_t bits = ac ^ b[i - start];
                float w;
                memcpy(&w, &bits, 4);
                uint8_t code = (uint8_t)(int32_t)fmaf(xr[i], f, w);
                if (i < half) cr[i] = (uint8_t)(code << 4);
                else cr[i - half] |= code;
            }
        }
    }
}
