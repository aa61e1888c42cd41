// Batch-invariant int8 / int4 linear kernels for x86 CPUs with AVX2 (specserve.kernels).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with
//   * weights in k-quant layouts (superblocks of 256 along k, the last one may be shorter):
//       int4: w = d[n,s] * sc[n,j] * q - dmin[n,s] * mn[n,j], q in 0..15, j = k / 32
//             (llama.cpp's Q4_K, with 8-bit instead of 6-bit sub-block scales and mins)
//       int8: w = d[n,s] * sc[n,j] * q, q in -127..127, sc int8, j = k / 16   (Q6_K generalised)
//   * activations quantized per row and per superblock to int8 (d_x = amax / 127, llama.cpp's Q8_K).
//
// Kernel order. Within each superblock of L = 32 * B values (B sub-blocks of 32; B = 8 but in a
// short last superblock) the int8 activations and the weights are stored transposed in groups of
// four: position t * 4B + 4b + i holds value 32b + 4t + i (t < 8, b < B, i < 4). Byte group b of
// every 32-byte vector then belongs to 32-value block b, so one u8 x s8 four-way dot product per
// vector leaves int32 lane b with the sum of block b alone. With AVX-512 VNNI that is one vpdpbusd
// per 32 products and the sub-block scales multiply whole lanes once per superblock; on AVX2 it is
// vpmaddubsw, then vpmaddwd by the lane's scale (int4: once per superblock, see q4_super). int4 packs
// two such vectors (t = 2u low nibbles, t = 2u + 1 high nibbles) in 4B bytes.
// (specserve.models.quantization.kernel_order is the same map in Python.)
//
// Integer products are summed exactly within a superblock (int32 lanes; AVX2 int4: int16, see
// q4_dot), then each superblock adds
// one float term per lane in a fixed order. Every output element is computed by one thread with
// the same float operations in the same order whatever the number of rows M, the row's place in
// the batch or the thread count (weight rows are paired for their integer sums only, see
// kWeightRows; calls of many rows may take their integer sums from AMX tiles, see
// q4_matmul_amx), so a row's result is bitwise independent of what it is multiplied with
// (speculative verify of k+1 rows == k+1 single-row decodes); the VNNI and AVX2 dot products give
// the same integers, so the same bits. Compiled with -ffp-contract=off so the compiler cannot
// fuse the scalar float operations differently in different loops.
// torch/python.h (pybind11 and the tensor casters) and the few ATen headers used, not
// torch/extension.h: the whole of torch's C++ API takes ~10 s more to compile per build.
#include <torch/python.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

// 512-bit paths (q4_super512, q4_rows_zmm, q8_super512_pairs, q8_rows_zmm): built where the CPU runs 512-bit
// instructions at full width (build_quant_ops defines SPECSERVE_ZMM where
// specserve.kernels.cpu_runs_512bit_at_full_width).
#if defined(SPECSERVE_ZMM) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KERNEL_ZMM 1
#else
#define KERNEL_ZMM 0
#endif
// AMX int8 tiles (q4_matmul_amx, q8_matmul_amx) for calls of many rows: where build_quant_ops defines SPECSERVE_AMX
// (specserve.kernels.cpu_has_amx) on top of the 512-bit build.
#if KERNEL_ZMM && defined(SPECSERVE_AMX) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define KERNEL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>
#else
#define KERNEL_AMX 0
#endif

namespace {

constexpr int64_t kSuper = 256;   // superblock length along k
constexpr int64_t kRowBlock = 64; // rows processed per pass over a thread's weight rows

// Decode and verify read every weight byte once, from memory: the hardware prefetcher alone kept a
// one-row call at ~11-14 GB/s where this machine streams ~22 (measured on a Xeon with AMX). Each
// superblock therefore asks for the weight lines kPrefetchBytes ahead in its thread's stream (a
// thread's weight rows are contiguous); 2-4 KB measured alike, 6 KB slowed one int8 shape. A
// prefetch never faults, so it may run past the tensor's end. It changes no value.
constexpr int64_t kPrefetchBytes = 3072;

__attribute__((always_inline)) inline void prefetch_ahead(const void* p, int lines) {
  const char* q = static_cast<const char*>(p) + kPrefetchBytes;
  for (int l = 0; l < lines; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T0);
}

// The four-way dot product: acc + per int32 lane b, sum_i u[4b+i] * s[4b+i] * scale[b]. With
// VNNI the scale is applied after the superblock (vpdpbusd, then one multiply per lane:
// finish_scale); without, vpmaddubsw's int16 pairs are multiplied by the scale in vpmaddwd (whose
// pair scales are the lane's scale twice: scale16). Either way the same integers: operands never
// saturate vpmaddubsw (int4: 2 * 15 * 127; int8: 2 * 127 * 127) and the sums stay far below 2^31.
inline __m256i scale16(__m256i scale32) {   // int32 lanes (|v| < 2^15) -> both int16 halves = v
  return _mm256_or_si256(_mm256_and_si256(scale32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(scale32, 16));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i dot4(__m256i acc, __m256i u, __m256i s, __m256i /*scale16v*/) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
inline __m256i finish_scale(__m256i acc, __m256i scale32) { return _mm256_mullo_epi32(acc, scale32); }
#else
inline __m256i dot4(__m256i acc, __m256i u, __m256i s, __m256i scale16v) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale16v));
}
inline __m256i finish_scale(__m256i acc, __m256i /*scale32*/) { return acc; }
#endif

// The int4 superblock's dot product, unscaled, and its scaling once per superblock. With VNNI as
// dot4. On AVX2 vpmaddubsw's int16 pair sums are added as int16 over the whole superblock, then
// scaled by one vpmaddwd: exact, since a pair sum is at most 2 * 15 * 127 = 3,810 in magnitude and
// a lane adds 8 of them (30,480 < 2^15), so the same integers as one vpmaddwd per vector with a
// third of the multiplies (decode and verify rows cost less).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i q4_dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
inline __m256i q4_finish(__m256i acc, __m256i scale32, __m256i /*scale16v*/) { return _mm256_mullo_epi32(acc, scale32); }
#else
inline __m256i q4_dot(__m256i acc, __m256i u, __m256i s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
inline __m256i q4_finish(__m256i acc, __m256i /*scale32*/, __m256i scale16v) { return _mm256_madd_epi16(acc, scale16v); }
#endif

inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);                     // 4 lanes
  __m128 sh = _mm_movehl_ps(lo, lo);
  lo = _mm_add_ps(lo, sh);                     // 2 lanes
  sh = _mm_shuffle_ps(lo, lo, 0x1);
  lo = _mm_add_ss(lo, sh);
  return _mm_cvtss_f32(lo);
}

// 32 bytes from p, or the first n of them and zeros (a short superblock's narrower vectors).
__attribute__((always_inline)) inline __m256i load32(const void* p, int64_t n) {
  if (n == 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (n == 16) return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(32) uint8_t tmp[32] = {0};
  std::memcpy(tmp, p, static_cast<size_t>(n));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
}

// Up to 8 unsigned bytes as int32 lanes (zeros past n).
__attribute__((always_inline)) inline __m256i lanes_u8(const uint8_t* p, int64_t n) {
  if (n == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint8_t tmp[16] = {0};
  std::memcpy(tmp, p, static_cast<size_t>(n));
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tmp)));
}

// Weight rows per pass: with VNNI (32 vector registers) two weight rows share each activation
// load once a call has kPairMinRows rows (prefill: compute-bound, 1.1-1.3x faster); fewer rows
// (decode, verify) are bound by streaming the weights from memory, which two interleaved rows
// slowed up to 2.4x (the 151,936-row lm_head). AVX2's 16 registers hold one row. Only the integer
// sums are computed together: every output element still gets its own float operations in the
// same order, so the bits depend neither on the pairing nor on which row is left alone.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kWeightRows = 2;
#else
constexpr int kWeightRows = 1;
#endif
constexpr int64_t kPairMinRows = 16;
// Activation rows per group of one weight row (a speculative verify of k + 1 rows unpacks each
// weight once when they fit one group). AVX-512 builds have 32 vector registers: 512-bit ones hold
// the sums of 6 rows, 256-bit ones (VNNI on Zen 4) of 8; 5-8 rows in one group there cost
// 0.61-0.99x the time of two groups (BENCHMARKS.md, "Verify rows on Zen 4"). AVX2's 16 registers
// hold 4. Two weight rows take groups of 4.
#if KERNEL_ZMM
constexpr int kRowGroup = 6;
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kRowGroup = 8;
#else
constexpr int kRowGroup = 4;
#endif

__attribute__((always_inline)) inline __m256 lanes_f32(const float* p, int64_t n) {
  if (n == 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, static_cast<size_t>(n) * 4);
  return _mm256_load_ps(tmp);
}

// One int4 superblock of activation rows r0..r0+R-1 against weight rows n..n+NB-1:
// isum[b * R + r] lane j = block j's integer dot product times its scale. W = 4 * (sub-blocks in
// this superblock) bytes per vector; called with the literal 32 for full superblocks so that the
// loads are plain vector loads.
template <int R, int NB>
__attribute__((always_inline)) inline void q4_super(__m256i* isum, int64_t W, const uint8_t* const* wq,
                                                    const int8_t* xs, int64_t K, const __m256i* scv) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256i sc16[NB];
  for (int b = 0; b < NB; ++b) sc16[b] = scale16(scv[b]);
  for (int i = 0; i < NB * R; ++i) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 2   // fully unrolled, the reassociated sums spill the vector registers
  for (int64_t u = 0; u < 4; ++u) {
    __m256i lo[NB], hi[NB];
    for (int b = 0; b < NB; ++b) {
      const __m256i v = load32(wq[b] + u * W, W);
      lo[b] = _mm256_and_si256(v, m4);
      hi[b] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xs + r * K + 2 * u * W;
      const __m256i xa = load32(xr, W), xb = load32(xr + W, W);
      for (int b = 0; b < NB; ++b) {
        isum[b * R + r] = q4_dot(isum[b * R + r], lo[b], xa);
        isum[b * R + r] = q4_dot(isum[b * R + r], hi[b], xb);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) isum[b * R + r] = q4_finish(isum[b * R + r], scv[b], sc16[b]);
}

#if KERNEL_ZMM
// [lo | hi] as one 512-bit vector, and its halves back.
inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline __m256 upper(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// The two 256-bit halves of v added lane by lane (exact int32 sums): one row's sums.
inline __m256i add_halves(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

// [u.lo + u.hi | v.lo + v.hi]: the 256-bit halves of two vectors added lane by lane (exact int32
// sums), two rows' results in one vector for three instructions.
inline __m512i pair_halves(__m512i u, __m512i v) {
  return _mm512_add_epi32(_mm512_shuffle_i64x2(u, v, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_i64x2(u, v, _MM_SHUFFLE(3, 2, 3, 2)));
}

// q4_super's dot products for a full superblock on 64-byte vectors: half the loads and
// dot-product instructions. 64 weight bytes hold kernel-order vectors t = 4p, 4p + 2 (low
// nibbles) and 4p + 1, 4p + 3 (high); two 128-bit lane shuffles regroup them as [4p | 4p + 1] and
// [4p + 2 | 4p + 3], the order of 64 contiguous activation bytes. Lane j of acc[b * R + r] holds
// block j mod 8 of one half; q4_super512 adds the halves. Integer sums are exact in any order, so
// the result is q4_super's, bit for bit, and so is everything computed from it. Built where
// 512-bit instructions run at full width (KERNEL_ZMM), with q4_rows_zmm.
template <int R, int NB>
__attribute__((always_inline)) inline void q4_dots512(__m512i* acc, const uint8_t* const* wq, const int8_t* xs,
                                                      int64_t K) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < NB * R; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t p = 0; p < 2; ++p) {
    __m512i a[NB], b2[NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i v = _mm512_loadu_si512(wq[b] + 64 * p);
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      a[b] = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
      b2[b] = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xs + r * K + 128 * p;
      const __m512i xa = _mm512_loadu_si512(xr), xb = _mm512_loadu_si512(xr + 64);
      for (int b = 0; b < NB; ++b) {
        acc[b * R + r] = _mm512_dpbusd_epi32(acc[b * R + r], a[b], xa);
        acc[b * R + r] = _mm512_dpbusd_epi32(acc[b * R + r], b2[b], xb);
      }
    }
  }
}

// The row of activation-row pair p that fills the upper half of a pair's vector: 2p + 1, or 2p
// again for an odd last row.
template <int R>
constexpr int pair_row(int p) { return 2 * p + 1 < R ? 2 * p + 1 : 2 * p; }

// The scaled sums of q4_super (as floats, exact) two activation rows to a vector, as q4_rows_zmm
// consumes them: fpair[b * P + p] = [row 2p | row pair_row(p)] of weight row b, P = (R + 1) / 2.
// pair_halves gives both rows' sums at once (an extract and an add per row before), and one
// convert and one multiply by the scales serve both rows.
// The scale multiplies as a float: the sum, the scale and their product are integers below 2^24
// (see q4_rows), so exact, and one vmulps costs less than Intel's two-uop vpmulld.
template <int R, int NB>
__attribute__((always_inline)) inline void q4_super512(__m512* fpair, const uint8_t* const* wq, const int8_t* xs,
                                                       int64_t K, const __m256i* scv) {
  constexpr int P = (R + 1) / 2;
  __m512i acc[NB * R];
  q4_dots512<R, NB>(acc, wq, xs, K);
  for (int b = 0; b < NB; ++b) {
    const __m256 scf8 = _mm256_cvtepi32_ps(scv[b]);
    if constexpr (R == 1) {   // one row (decode): an extract and an add, the row in both halves
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(add_halves(acc[b])), scf8);
      fpair[b] = join(f, f);
      continue;
    }
    const __m512 scf = join(scf8, scf8);
    for (int p = 0; p < P; ++p) {
      const __m512i sums = pair_halves(acc[b * R + 2 * p], acc[b * R + pair_row<R>(p)]);
      fpair[b * P + p] = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), scf);
    }
  }
}
#endif

// Superblock k0's packed weights and sub-block scales (as int32 lanes) of weight rows n..n+NB-1.
template <int NB>
__attribute__((always_inline)) inline void q4_weight_rows(const uint8_t** wq, __m256i* scv, int64_t n, int64_t K,
                                                          int64_t k0, int64_t nsub, const uint8_t* qs, const uint8_t* sc) {
  for (int b = 0; b < NB; ++b) {
    wq[b] = qs + (n + b) * (K / 2) + k0 / 2;
    prefetch_ahead(wq[b], 2);   // a superblock's 128 bytes
    scv[b] = lanes_u8(sc + (n + b) * (K / 32) + k0 / 32, nsub);
  }
}

// One int4 output block: activation rows r0..r0+R-1 against weight rows n..n+NB-1.
template <int R, int NB>
inline void q4_rows(int64_t n, int64_t r0, int64_t K, int64_t S, const int8_t* xq, const float* dx,
                    const float* bsum, const uint8_t* qs, const uint8_t* sc, const uint8_t* mn,
                    const float* d, const float* dmin, const float* bias, float* out, int64_t ldo) {
  __m256 acc[NB * R], macc[NB * R];
  for (int i = 0; i < NB * R; ++i) { acc[i] = _mm256_setzero_ps(); macc[i] = _mm256_setzero_ps(); }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper, j0 = k0 / 32;
    const int64_t nsub = std::min(kSuper, K - k0) / 32;
    const int8_t* xs = xq + r0 * K + k0;
    const uint8_t* wq[NB];
    __m256i scv[NB];
    q4_weight_rows<NB>(wq, scv, n, K, k0, nsub, qs, sc);
    __m256i isum[NB * R];
    if (nsub == 8) q4_super<R, NB>(isum, 32, wq, xs, K, scv);
    else q4_super<R, NB>(isum, 4 * nsub, wq, xs, K, scv);
    // lane j: block j's scaled integer sum (|.| < 32 * 15 * 127 * 255 < 2^24: exact as a float);
    // the mins times the rows' block sums likewise (|.| < 255 * 32 * 127 < 2^24), so their float
    // product is that integer exactly and the rows' block sums are converted once per call
    __m256 bv[R];
    for (int r = 0; r < R; ++r) bv[r] = lanes_f32(bsum + (r0 + r) * (K / 32) + j0, nsub);
    for (int b = 0; b < NB; ++b) {
      const __m256 mv = _mm256_cvtepi32_ps(lanes_u8(mn + (n + b) * (K / 32) + j0, nsub));
      const float dw = d[(n + b) * S + s], dm = dmin[(n + b) * S + s];
      for (int r = 0; r < R; ++r) {
        const float ds = dx[(r0 + r) * S + s];
        __m256& a = acc[b * R + r];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[b * R + r]), _mm256_set1_ps(dw * ds), a);
        __m256& ma = macc[b * R + r];
        ma = _mm256_fmadd_ps(_mm256_mul_ps(mv, bv[r]), _mm256_set1_ps(dm * ds), ma);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const float bb = bias ? bias[n + b] : 0.0f;
    for (int r = 0; r < R; ++r)
      out[(r0 + r) * ldo + n + b] = (hsum8(acc[b * R + r]) - hsum8(macc[b * R + r])) + bb;
  }
}

#if KERNEL_ZMM
// q4_rows on 512-bit vectors: q4_super512 for whole superblocks, and the float work of two
// activation rows per vector (rows 2p and 2p + 1 in the low and high halves; an odd last row
// fills both). Every lane does q4_rows' operations on q4_rows' values, in the same order: the
// products dw * ds and dm * ds are the same single roundings as vectors, mv * bv is exact, so
// each output has q4_rows' bits.
template <int R, int NB>
inline void q4_rows_zmm(int64_t n, int64_t r0, int64_t K, int64_t S, const int8_t* xq, const float* dx,
                        const float* bsum, const uint8_t* qs, const uint8_t* sc, const uint8_t* mn,
                        const float* d, const float* dmin, const float* bias, float* out, int64_t ldo) {
  constexpr int P = (R + 1) / 2;
  __m512 acc[NB * P], macc[NB * P];
  for (int i = 0; i < NB * P; ++i) { acc[i] = _mm512_setzero_ps(); macc[i] = _mm512_setzero_ps(); }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper, j0 = k0 / 32;
    const int64_t nsub = std::min(kSuper, K - k0) / 32;
    const int8_t* xs = xq + r0 * K + k0;
    const uint8_t* wq[NB];
    __m256i scv[NB];
    q4_weight_rows<NB>(wq, scv, n, K, k0, nsub, qs, sc);
    __m512 fpair[NB * P];   // q4_rows' converted isum of rows 2p | pair_row(p) (exact, see q4_super512)
    if (nsub == 8) {
      q4_super512<R, NB>(fpair, wq, xs, K, scv);
    } else {
      __m256i isum[NB * R];
      q4_super<R, NB>(isum, 4 * nsub, wq, xs, K, scv);
      for (int b = 0; b < NB; ++b)
        for (int p = 0; p < P; ++p)
          fpair[b * P + p] = join(_mm256_cvtepi32_ps(isum[b * R + 2 * p]), _mm256_cvtepi32_ps(isum[b * R + pair_row<R>(p)]));
    }
    __m512 bv[P], ds[P];
    for (int p = 0; p < P; ++p) {
      const int ra = 2 * p, rb = pair_row<R>(p);
      bv[p] = join(lanes_f32(bsum + (r0 + ra) * (K / 32) + j0, nsub), lanes_f32(bsum + (r0 + rb) * (K / 32) + j0, nsub));
      ds[p] = join(_mm256_set1_ps(dx[(r0 + ra) * S + s]), _mm256_set1_ps(dx[(r0 + rb) * S + s]));
    }
    for (int b = 0; b < NB; ++b) {
      const __m256 mv8 = _mm256_cvtepi32_ps(lanes_u8(mn + (n + b) * (K / 32) + j0, nsub));
      const __m512 mv = join(mv8, mv8);
      const __m512 dw = _mm512_set1_ps(d[(n + b) * S + s]), dm = _mm512_set1_ps(dmin[(n + b) * S + s]);
      for (int p = 0; p < P; ++p) {
        acc[b * P + p] = _mm512_fmadd_ps(fpair[b * P + p], _mm512_mul_ps(dw, ds[p]), acc[b * P + p]);
        macc[b * P + p] = _mm512_fmadd_ps(_mm512_mul_ps(mv, bv[p]), _mm512_mul_ps(dm, ds[p]), macc[b * P + p]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const float bb = bias ? bias[n + b] : 0.0f;
    for (int p = 0; p < P; ++p) {
      const __m512 a = acc[b * P + p], m = macc[b * P + p];
      out[(r0 + 2 * p) * ldo + n + b] = (hsum8(_mm512_castps512_ps256(a)) - hsum8(_mm512_castps512_ps256(m))) + bb;
      if (2 * p + 1 < R) out[(r0 + 2 * p + 1) * ldo + n + b] = (hsum8(upper(a)) - hsum8(upper(m))) + bb;
    }
  }
}
#endif

// One int8 superblock: vector t < 4 holds, in lane j, values of 16-value sub-block 2j, vector
// t >= 4 of sub-block 2j + 1, so the even scales (se) weigh the first four, the odd (so) the rest.
// One weight row: |w| times x with w's sign (the dot product needs one unsigned operand).
template <int R>
__attribute__((always_inline)) inline void q8_super_signed(__m256i* isum, int64_t W, const int8_t* wq,
                                                           const int8_t* xs, int64_t K, __m256i se, __m256i so) {
  __m256i ea[R], oa[R];
  for (int r = 0; r < R; ++r) { ea[r] = _mm256_setzero_si256(); oa[r] = _mm256_setzero_si256(); }
  const __m256i se16 = scale16(se), so16 = scale16(so);
#pragma GCC unroll 2   // as in q4_super
  for (int64_t t = 0; t < 8; ++t) {
    const __m256i w = load32(wq + t * W, W);
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_sign_epi8(load32(xs + r * K + t * W, W), w);
      if (t < 4) ea[r] = dot4(ea[r], aw, x, se16);
      else oa[r] = dot4(oa[r], aw, x, so16);
    }
  }
  for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(finish_scale(ea[r], se), finish_scale(oa[r], so));
}

#if KERNEL_ZMM
// q8_super_signed's dot products for a full superblock on 64-byte vectors (vectors t = 2q, 2q + 1;
// both even sub-blocks for q < 2, both odd after): ea[r] and oa[r] hold each half's lanes.
// AVX-512 has no vpsignb: |w| by vpabsb, and x negated where w < 0 by a masked subtraction from
// zero (where w = 0, |w| = 0 makes the product 0 as vpsignb's would). The same integer products,
// summed exactly.
template <int R>
__attribute__((always_inline)) inline void q8_dots512(__m512i* ea, __m512i* oa, const int8_t* wq, const int8_t* xs,
                                                      int64_t K) {
  for (int r = 0; r < R; ++r) { ea[r] = _mm512_setzero_si512(); oa[r] = _mm512_setzero_si512(); }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t q = 0; q < 4; ++q) {
    const __m512i w = _mm512_loadu_si512(wq + 64 * q);
    const __m512i aw = _mm512_abs_epi8(w);
    const __mmask64 neg = _mm512_movepi8_mask(w);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(xs + r * K + 64 * q);
      __m512i& acc = q < 2 ? ea[r] : oa[r];
      acc = _mm512_dpbusd_epi32(acc, aw, _mm512_mask_sub_epi8(x, neg, zero, x));
    }
  }
}

// q8_super_signed's isum of one activation row from q8_dots512 (one-row calls: decode).
__attribute__((always_inline)) inline __m256i q8_super_signed512(const int8_t* wq, const int8_t* xs, int64_t K,
                                                                 __m256i se, __m256i so) {
  __m512i ea[1], oa[1];
  q8_dots512<1>(ea, oa, wq, xs, K);
  return _mm256_add_epi32(_mm256_mullo_epi32(add_halves(ea[0]), se), _mm256_mullo_epi32(add_halves(oa[0]), so));
}

#endif

// Several weight rows (VNNI only): the sign trick would cost a sign per row and activation, so
// the activations go in offset by 128 (x ^ 0x80 = x + 128 as an unsigned byte), and 128 times
// each lane's weight sum (one vpdpbusd by ones per weight vector, shared by all rows) comes off
// again: the same integers as the sign trick's.
template <int R, int NB>
__attribute__((always_inline)) inline void q8_super(__m256i* isum, int64_t W, const int8_t* const* wq,
                                                    const int8_t* xs, int64_t K, const __m256i* se,
                                                    const __m256i* so) {
  if constexpr (NB == 1) {
#if KERNEL_ZMM
    if constexpr (R == 1) {
      if (W == 32) {
        isum[0] = q8_super_signed512(wq[0], xs, K, se[0], so[0]);
        return;
      }
    }
#endif
    q8_super_signed<R>(isum, W, wq[0], xs, K, se[0], so[0]);
  } else {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi8(1);
    for (int half = 0; half < 2; ++half) {
      __m256i a[NB * R], wsum[NB];
      for (int i = 0; i < NB * R; ++i) a[i] = _mm256_setzero_si256();
      for (int b = 0; b < NB; ++b) wsum[b] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int64_t t = 4 * half; t < 4 * half + 4; ++t) {
        __m256i w[NB];
        for (int b = 0; b < NB; ++b) {
          w[b] = load32(wq[b] + t * W, W);
          wsum[b] = _mm256_dpbusd_epi32(wsum[b], ones, w[b]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_xor_si256(load32(xs + r * K + t * W, W), flip);
          for (int b = 0; b < NB; ++b) a[b * R + r] = _mm256_dpbusd_epi32(a[b * R + r], x, w[b]);
        }
      }
      for (int b = 0; b < NB; ++b) {
        const __m256i corr = _mm256_slli_epi32(wsum[b], 7);
        const __m256i scale = half ? so[b] : se[b];
        for (int r = 0; r < R; ++r) {
          const __m256i v = _mm256_mullo_epi32(_mm256_sub_epi32(a[b * R + r], corr), scale);
          isum[b * R + r] = half ? _mm256_add_epi32(isum[b * R + r], v) : v;
        }
      }
    }
#else
    static_assert(NB == 1, "AVX2 computes one weight row per pass");
#endif
  }
}

// Superblock k0's int8 sub-block scales of weight row n as int32 lanes: even sub-blocks (se), odd (so).
__attribute__((always_inline)) inline void q8_scales(__m256i& se, __m256i& so, const int8_t* sc, int64_t n, int64_t K,
                                                     int64_t k0, int64_t nsub) {
  const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m128i odd = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m128i sv = _mm256_castsi256_si128(load32(sc + n * (K / 16) + k0 / 16, 2 * nsub));
  se = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sv, even));
  so = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sv, odd));
}

// One int8 output block: activation rows r0..r0+R-1 against weight rows n..n+NB-1.
template <int R, int NB>
inline void q8_rows(int64_t n, int64_t r0, int64_t K, int64_t S, const int8_t* xq, const float* dx,
                    const int8_t* qs, const int8_t* sc, const float* d, const float* bias, float* out,
                    int64_t ldo) {
  __m256 acc[NB * R];
  for (int i = 0; i < NB * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper;
    const int64_t nsub = std::min(kSuper, K - k0) / 32;
    const int8_t* wq[NB];
    __m256i se[NB], so[NB];
    for (int b = 0; b < NB; ++b) {
      q8_scales(se[b], so[b], sc, n + b, K, k0, nsub);
      wq[b] = qs + (n + b) * K + k0;
      prefetch_ahead(wq[b], 4);   // a superblock's 256 bytes
    }
    const int8_t* xs = xq + r0 * K + k0;
    __m256i isum[NB * R];
    if (nsub == 8) q8_super<R, NB>(isum, 32, wq, xs, K, se, so);
    else q8_super<R, NB>(isum, 4 * nsub, wq, xs, K, se, so);
    for (int b = 0; b < NB; ++b) {
      const float dw = d[(n + b) * S + s];
      for (int r = 0; r < R; ++r) {
        const float ds = dx[(r0 + r) * S + s];
        acc[b * R + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[b * R + r]), _mm256_set1_ps(dw * ds), acc[b * R + r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const float bb = bias ? bias[n + b] : 0.0f;
    for (int r = 0; r < R; ++r) out[(r0 + r) * ldo + n + b] = hsum8(acc[b * R + r]) + bb;
  }
}

#if KERNEL_ZMM
// q8_super_signed's isum two activation rows to a vector, as q8_rows_zmm consumes them:
// ipair[p] = [isum of row 2p | isum of row pair_row(p)]. pair_halves gives both rows' sums at once
// and one 512-bit vpmulld scales both: the same exact integers with fewer instructions.
template <int R>
__attribute__((always_inline)) inline void q8_super512_pairs(__m512i* ipair, const int8_t* wq, const int8_t* xs,
                                                             int64_t K, __m512i se, __m512i so) {
  constexpr int P = (R + 1) / 2;
  __m512i ea[R], oa[R];
  q8_dots512<R>(ea, oa, wq, xs, K);
  for (int p = 0; p < P; ++p) {
    const int u = 2 * p, v = pair_row<R>(p);
    ipair[p] = _mm512_add_epi32(_mm512_mullo_epi32(pair_halves(ea[u], ea[v]), se),
                                _mm512_mullo_epi32(pair_halves(oa[u], oa[v]), so));
  }
}

// q8_rows for one weight row on 512-bit vectors: q8_super512_pairs for whole superblocks, and the
// float work of two activation rows per vector (as q4_rows_zmm). Every lane does q8_rows'
// operations on q8_rows' values in the same order (dw * ds is the same single rounding as a
// vector), so each output has q8_rows' bits.
template <int R>
inline void q8_rows_zmm(int64_t n, int64_t r0, int64_t K, int64_t S, const int8_t* xq, const float* dx,
                        const int8_t* qs, const int8_t* sc, const float* d, const float* bias, float* out,
                        int64_t ldo) {
  constexpr int P = (R + 1) / 2;
  auto join_i = [](__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); };
  __m512 acc[P];
  for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper;
    const int64_t nsub = std::min(kSuper, K - k0) / 32;
    __m256i se, so;
    q8_scales(se, so, sc, n, K, k0, nsub);
    const int8_t* wq = qs + n * K + k0;
    prefetch_ahead(wq, 4);   // a superblock's 256 bytes
    const int8_t* xs = xq + r0 * K + k0;
    __m512i ipair[P];
    if (nsub == 8) {
      q8_super512_pairs<R>(ipair, wq, xs, K, join_i(se, se), join_i(so, so));
    } else {
      __m256i isum[R];
      q8_super_signed<R>(isum, 4 * nsub, wq, xs, K, se, so);
      for (int p = 0; p < P; ++p) ipair[p] = join_i(isum[2 * p], isum[pair_row<R>(p)]);
    }
    const __m512 dw = _mm512_set1_ps(d[n * S + s]);
    for (int p = 0; p < P; ++p) {
      const __m512 ds = join(_mm256_set1_ps(dx[(r0 + 2 * p) * S + s]), _mm256_set1_ps(dx[(r0 + pair_row<R>(p)) * S + s]));
      acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ipair[p]), _mm512_mul_ps(dw, ds), acc[p]);
    }
  }
  const float bb = bias ? bias[n] : 0.0f;
  for (int p = 0; p < P; ++p) {
    out[(r0 + 2 * p) * ldo + n] = hsum8(_mm512_castps512_ps256(acc[p])) + bb;
    if (2 * p + 1 < R) out[(r0 + 2 * p + 1) * ldo + n] = hsum8(upper(acc[p])) + bb;
  }
}
#endif

// Rows m0..m1-1 in groups of at most G, as even as possible (G = 6: 5 rows in one group, 7 as
// 4 + 3, 13 as 5 + 4 + 4; G = 8: 13 as 7 + 6): every group pays the weights' unpacking once, so
// a lone last row costs nearly as much as a full group. Every row gets the same arithmetic whatever its group (R).
template <int G, typename F>
__attribute__((always_inline)) inline void row_group(int64_t R, int64_t r, F&& f) {
  static_assert(G >= 1 && G <= 8, "row groups are instantiated for R = 1..8");
  switch (R) {
    case 8: if constexpr (G >= 8) f(std::integral_constant<int, 8>{}, r); break;
    case 7: if constexpr (G >= 7) f(std::integral_constant<int, 7>{}, r); break;
    case 6: if constexpr (G >= 6) f(std::integral_constant<int, 6>{}, r); break;
    case 5: if constexpr (G >= 5) f(std::integral_constant<int, 5>{}, r); break;
    case 4: if constexpr (G >= 4) f(std::integral_constant<int, 4>{}, r); break;
    case 3: if constexpr (G >= 3) f(std::integral_constant<int, 3>{}, r); break;
    case 2: if constexpr (G >= 2) f(std::integral_constant<int, 2>{}, r); break;
    default: f(std::integral_constant<int, 1>{}, r); break;
  }
}

template <int G, typename F>
inline void for_row_groups(int64_t m0, int64_t m1, F&& f) {
  const int64_t rows = m1 - m0;
  if (rows <= G) {   // decode and verify: one group, no divisions per weight row
    row_group<G>(rows, m0, f);
    return;
  }
  const int64_t groups = (rows + G - 1) / G;
  int64_t r = m0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t R = rows / groups + (g < rows % groups ? 1 : 0);
    row_group<G>(R, r, f);
    r += R;
  }
}

// f(R, NB, n, r) for every group of NB weight rows from n (weight rows n0..N-1) (split over threads; NB = kWeightRows
// when M >= kPairMinRows, else 1, and 1 for a thread's last odd row) and group of R activation
// rows from r; activation rows in passes of kRowBlock so a thread's weight rows are re-read from
// cache, not memory.
template <typename F>
void for_each_output(int64_t M, int64_t N, F&& f, int64_t n0 = 0) {
  if (M == 0 || N <= n0) return;
  const bool pair = kWeightRows > 1 && M >= kPairMinRows;
  at::parallel_for(n0, N, 16, [&](int64_t nb, int64_t ne) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      int64_t n = nb;
      for (; pair && n + kWeightRows <= ne; n += kWeightRows)
        for_row_groups<4>(m0, m1, [&](auto R, int64_t r) { f(R, std::integral_constant<int, kWeightRows>{}, n, r); });
      for (; n < ne; ++n)
        for_row_groups<kRowGroup>(m0, m1, [&](auto R, int64_t r) { f(R, std::integral_constant<int, 1>{}, n, r); });
    }
  });
}

#if KERNEL_AMX
// int4 calls of many rows on AMX tiles (Intel Sapphire Rapids and later). One tdpbusd multiplies
// a 16 x 32 tile of one sub-block's weights (16 weight rows, unsigned nibbles) by the same
// sub-block of 16 activation rows (int8), leaving 256 of the exact int32 block sums that q4_super
// leaves in its lanes, 8,192 products per instruction. The float work then runs q4_rows' lane
// operations on those integers, in q4_rows' order, with the 16 lanes of a vector holding 16
// activation rows (one weight row, one sub-block) instead of 8 sub-blocks: every lane's operands
// and operations are q4_rows', so every output has its bits. That work, not the dot products, is
// most of the cost here: a convert, three multiplies and two fmas per 16 block sums.
constexpr int64_t kAmxMinRows = 32;   // fewer rows leave most of the 32-row block empty (slower than q4_rows_zmm)
constexpr int64_t kAmxWeightRows = 32;   // weight rows per group: two tiles of 16
// One sub-block's 4 x 256 sums, then 64 bytes of padding: the float work reads one line of every
// sub-block in turn, lines that at a stride of 4 KB would all fall in one L1 cache set.
constexpr int64_t kAmxSumStride = 1024 + 16;
constexpr int64_t kAmxSuperblocks = 8;   // superblocks per pass of the float work (bounds the sums' buffer)

// Linux grants the tiles' register state only on request, once per process.
bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Palette 1: tiles 0-3 the int32 sums of 2 x 2 blocks of 16 weight rows x 16 activation rows,
// 4 and 5 two weight tiles (16 rows x 32 bytes), 6 and 7 two activation tiles (8 rows of 16
// activation rows x 4 bytes): four independent products per sub-block, each operand loaded once.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8, 8};
};

// q8_matmul_amx's: tiles 0-3 as above (16 activation rows x 16 weight rows), 4 and 5 two
// activation tiles (16 rows x 16 bytes: one 16-value sub-block), 6 and 7 two weight tiles (4 rows
// of 16 weight rows x 4 bytes).
struct alignas(64) Amx8TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 16, 16, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 4, 4};
};

// The four products of a 2 x 2 block into c (int32 [4, 16, 16]): c[256 (2a + b) + 16i + j] = row i
// of first operand tile a (a0 or a1, unsigned bytes, rows lda bytes apart) times column j of
// second operand tile b (b0 or b1, signed, four bytes per column, rows ldb bytes apart), with the
// tile shapes of the configuration loaded (TileConfig or Amx8TileConfig).
__attribute__((always_inline)) inline void amx_2x2(int32_t* c, const void* a0, const void* a1, int64_t lda,
                                                   const void* b0, const void* b1, int64_t ldb) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a0, lda);
  _tile_loadd(5, a1, lda);
  _tile_loadd(6, b0, ldb);
  _tile_loadd(7, b1, ldb);
  _tile_dpbusd(0, 4, 6);
  _tile_dpbusd(1, 4, 7);
  _tile_dpbusd(2, 5, 6);
  _tile_dpbusd(3, 5, 7);
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

// The tile configuration loaded for this thread's scope, released at its end (also when an
// allocation throws): a thread holding tile state costs every context switch its save.
struct TileScope {
  explicit TileScope(const void* config) { _tile_loadconfig(config); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// An 8 x 8 transpose of int32s: r[t] lane b -> r[b] lane t.
inline void transpose8x8(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// The activations as tdpbusd's second operand: xb[((rb * S + s) * 8 + j) * 512 + t * 64 + 4r + i]
// = row 16 rb + r's value 32j + 4t + i of superblock s (zero past M and past a short superblock's
// blocks); dsT [Mp / 16, S, 16] and bvT [Mp / 16, 8S, 16] the rows' scales and block sums, 16 rows
// to a vector, a row block's contiguous so the float work reads them in one run (zero likewise).
void amx_activations(int64_t M, int64_t Mp, int64_t K, int64_t S, const int8_t* xq, const float* dx,
                     const float* bsum, uint8_t* xb, float* dsT, float* bvT) {
  at::parallel_for(0, Mp / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t rb = b0; rb < b1; ++rb) {
      for (int64_t r = 0; r < 16 && rb * 16 + r < M; ++r) {
        const int64_t m = rb * 16 + r;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t k0 = s * kSuper, nsub = std::min(kSuper, K - k0) / 32;
          const int8_t* src = xq + m * K + k0;
          uint8_t* dst = xb + (rb * S + s) * 8 * 512 + 4 * r;
          for (int64_t t = 0; t < 8; ++t)
            for (int64_t j = 0; j < nsub; ++j) std::memcpy(dst + j * 512 + t * 64, src + (t * nsub + j) * 4, 4);
          dsT[(rb * S + s) * 16 + r] = dx[m * S + s];
          for (int64_t j = 0; j < nsub; ++j) bvT[((rb * S + s) * 8 + j) * 16 + r] = bsum[m * (K / 32) + s * 8 + j];
        }
      }
    }
  });
}

// Weight rows n..n+31 as tdpbusd's first operand: wa[((s * 8 + b) * 32 + w) * 32 + 4t + i] = row
// n + w's value 32b + 4t + i of superblock s (nibbles widened to bytes); scf and mnf [32, 8S]
// their sub-block scales and mins as floats (zero past a short superblock's blocks).
void amx_weights(int64_t n, int64_t K, int64_t S, const uint8_t* qs, const uint8_t* sc, const uint8_t* mn,
                 uint8_t* wa, float* scf, float* mnf) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t w = 0; w < kAmxWeightRows; ++w) {
    const uint8_t* q = qs + (n + w) * (K / 2);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t k0 = s * kSuper, nsub = std::min(kSuper, K - k0) / 32, W = 4 * nsub;
      __m256i r[8];   // kernel-order vectors t: lane b holds block b's values 4t..4t+3
      for (int64_t u = 0; u < 4; ++u) {
        const __m256i v = load32(q + k0 / 2 + u * W, W);
        r[2 * u] = _mm256_and_si256(v, m4);
        r[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      }
      transpose8x8(r);
      for (int64_t b = 0; b < 8; ++b)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wa + ((s * 8 + b) * kAmxWeightRows + w) * 32), r[b]);
      for (int64_t j = 0; j < 8; ++j) {
        scf[w * 8 * S + s * 8 + j] = j < nsub ? sc[(n + w) * (K / 32) + s * 8 + j] : 0.0f;
        mnf[w * 8 * S + s * 8 + j] = j < nsub ? mn[(n + w) * (K / 32) + s * 8 + j] : 0.0f;
      }
    }
  }
}

// q4_rows' float work over superblocks s0..s1-1 for weight rows n..n+15 (their scales and mins
// at rows w0.. of scf / mnf) and activation rows 16 rb..16 rb + 15, from block sums
// c[((s - s0) * 8 + j) * kAmxSumStride + w * 16 + r]. The 16 partial sums per weight row carry over in acc
// between passes; the last pass writes the rows below M.
void amx_outputs(int64_t n, int64_t w0, int64_t rb, int64_t s0, int64_t s1, int64_t M, int64_t S,
                 const int32_t* c, const float* scf, const float* mnf, const float* dsT, const float* bvT,
                 const float* d, const float* dmin, const float* bias, float* accs, float* out, int64_t ldo) {
  alignas(64) float res[16][16];
  const bool first = s0 == 0, last = s1 == S;
  for (int64_t w = 0; w < 16; ++w) {
    __m512 acc[8], macc[8];
    float* keep = accs + w * 256;
    for (int j = 0; j < 8; ++j) {
      acc[j] = first ? _mm512_setzero_ps() : _mm512_load_ps(keep + 16 * j);
      macc[j] = first ? _mm512_setzero_ps() : _mm512_load_ps(keep + 128 + 16 * j);
    }
    const float* scw = scf + (w0 + w) * 8 * S;
    const float* mnw = mnf + (w0 + w) * 8 * S;
    for (int64_t s = s0; s < s1; ++s) {
      const __m512 ds = _mm512_loadu_ps(dsT + (rb * S + s) * 16);
      const __m512 dwds = _mm512_mul_ps(_mm512_set1_ps(d[(n + w) * S + s]), ds);
      const __m512 dmds = _mm512_mul_ps(_mm512_set1_ps(dmin[(n + w) * S + s]), ds);
#pragma GCC unroll 8   // acc and macc stay in registers
      for (int j = 0; j < 8; ++j) {
        const __m512i isum = _mm512_loadu_si512(c + ((s - s0) * 8 + j) * kAmxSumStride + w * 16);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(scw[s * 8 + j]));
        acc[j] = _mm512_fmadd_ps(f, dwds, acc[j]);
        const __m512 mb = _mm512_mul_ps(_mm512_set1_ps(mnw[s * 8 + j]), _mm512_loadu_ps(bvT + ((rb * S + s) * 8 + j) * 16));
        macc[j] = _mm512_fmadd_ps(mb, dmds, macc[j]);
      }
    }
    if (!last) {
      for (int j = 0; j < 8; ++j) { _mm512_store_ps(keep + 16 * j, acc[j]); _mm512_store_ps(keep + 128 + 16 * j, macc[j]); }
      continue;
    }
    // hsum8's order over the 8 blocks: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
    auto h = [](const __m512* a) {
      return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                           _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
    };
    const float bb = bias ? bias[n + w] : 0.0f;
    _mm512_store_ps(res[w], _mm512_add_ps(_mm512_sub_ps(h(acc), h(macc)), _mm512_set1_ps(bb)));
  }
  if (!last) return;
  for (int64_t r = 0; r < 16 && rb * 16 + r < M; ++r)
    for (int64_t w = 0; w < 16; ++w) out[(rb * 16 + r) * ldo + n + w] = res[w][r];
}

// Activation rows per pass over a thread's weight groups: ~768 KB of activations (kept in its
// cache), but at least 256 rows, since every pass widens the weights again (with fewer rows that
// costs more than streaming the activations from L3).
inline int64_t amx_row_chunk(int64_t Mp, int64_t K) {
  return std::min(Mp, std::max<int64_t>(256, (int64_t{768} * 1024 / K) / 32 * 32));
}

// A float buffer with a 64-byte aligned start, for the aligned vector loads and stores of the
// partial sums that carry over between passes.
class AlignedFloats {
 public:
  explicit AlignedFloats(size_t n) : buf_(n + 16) {}
  float* data() { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf_.data()) + 63) & ~uintptr_t{63}); }

 private:
  std::vector<float> buf_;
};

// The loops both AMX paths share. Threads split weight rows 0..N-1 (a multiple of 32) in groups
// of 32; each widens a group's weights once per pass over amx_row_chunk activation rows, and
// runs 32 x 32 blocks over kPassSuperblocks superblocks at a time: per sub-block one 2 x 2 tile
// product, then the float work on the four 16 x 16 blocks of sums. A superblock has kSubBlocks
// sub-blocks of 32 / (kSubBlocks / 8) values; a short one's missing blocks get zero sums. The
// layout's per-thread struct (Int4 or Int8, made by make_group) names its tile Config and those
// constants, and does the layout's parts:
//   widen(n): weight rows n..n+31 into the tiles' layout;
//   products(c, rb, s, b): sub-block b of superblock s for activation rows 16 rb..16 rb + 31
//     into c (int32 [4, 16, 16], amx_2x2's order);
//   outputs(blk, n, rb, s0, s1, c, acc): the float work of block blk (0-3) of those sums, with
//     16 * kAccFloats floats of partial sums in acc.
template <typename MakeGroup>
void amx_matmul(int64_t Mp, int64_t N, int64_t K, int64_t S, MakeGroup&& make_group) {
  using Group = decltype(make_group());
  using Config = typename Group::Config;
  constexpr int64_t SubBlocks = Group::kSubBlocks, PassSuperblocks = Group::kPassSuperblocks;
  constexpr int64_t AccFloats = Group::kAccFloats;
  const int64_t chunk = amx_row_chunk(Mp, K);
  at::parallel_for(0, N / kAmxWeightRows, 1, [&](int64_t g0, int64_t g1) {
    const Config cfg;
    const TileScope tiles(&cfg);
    auto group = make_group();
    std::vector<int32_t> c(static_cast<size_t>(PassSuperblocks * SubBlocks * kAmxSumStride));
    AlignedFloats accs(4 * 16 * AccFloats);
    for (int64_t m0 = 0; m0 < Mp; m0 += chunk) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n = g * kAmxWeightRows;
        group.widen(n);
        for (int64_t rb = m0 / 16; rb < std::min(Mp, m0 + chunk) / 16; rb += 2) {
          for (int64_t s0 = 0; s0 < S; s0 += PassSuperblocks) {
            const int64_t s1 = std::min(S, s0 + PassSuperblocks);
            for (int64_t s = s0; s < s1; ++s) {
              const int64_t nsub = std::min(kSuper, K - s * kSuper) / 32;
              for (int64_t b = 0; b < SubBlocks; ++b) {
                int32_t* cs = c.data() + ((s - s0) * SubBlocks + b) * kAmxSumStride;
                if (b / (SubBlocks / 8) >= nsub) std::memset(cs, 0, 1024 * sizeof(int32_t));
                else group.products(cs, rb, s, b);
              }
            }
            for (int64_t blk = 0; blk < 4; ++blk)
              group.outputs(blk, n, rb, s0, s1, c.data() + blk * 256, accs.data() + blk * 16 * AccFloats);
          }
        }
      }
    }
  });
}

// The int4 matmul of weight rows 0..N-1 (a multiple of 32) on AMX tiles (amx_matmul's loops):
// per sub-block two weight and two activation tiles, four products.
void q4_matmul_amx(int64_t M, int64_t N, int64_t K, int64_t S, const int8_t* xq, const float* dx,
                   const float* bsum, const uint8_t* qs, const uint8_t* sc, const uint8_t* mn, const float* d,
                   const float* dmin, const float* bias, float* out, int64_t ldo) {
  const int64_t Mp = (M + 31) / 32 * 32;
  std::vector<uint8_t> xb(static_cast<size_t>(Mp / 16 * S * 8 * 512), 0);
  std::vector<float> dsT(static_cast<size_t>(S * Mp), 0.0f), bvT(static_cast<size_t>(8 * S * Mp), 0.0f);
  amx_activations(M, Mp, K, S, xq, dx, bsum, xb.data(), dsT.data(), bvT.data());
  amx_matmul(Mp, N, K, S, [&] {
    struct Int4 {
      using Config = TileConfig;
      // 32-value sub-blocks; amx_outputs keeps 16 x 256 partial sums per block (acc and macc)
      enum : int64_t { kSubBlocks = 8, kPassSuperblocks = kAmxSuperblocks, kAccFloats = 256 };
      std::vector<uint8_t> wa;
      std::vector<float> scf, mnf;
      int64_t M, K, S;
      const uint8_t *xb, *qs, *sc, *mn;
      const float *dsT, *bvT, *d, *dmin, *bias;
      float* out;
      int64_t ldo;
      void widen(int64_t n) { amx_weights(n, K, S, qs, sc, mn, wa.data(), scf.data(), mnf.data()); }
      void products(int32_t* c, int64_t rb, int64_t s, int64_t b) {
        const uint8_t* ws = wa.data() + (s * 8 + b) * kAmxWeightRows * 32;
        const uint8_t* xs = xb + (rb * S + s) * 8 * 512 + b * 512;
        amx_2x2(c, ws, ws + 16 * 32, 32, xs, xs + S * 8 * 512, 64);   // activation rows 16 (rb + 1).. second
      }
      void outputs(int64_t blk, int64_t n, int64_t rb, int64_t s0, int64_t s1, const int32_t* c, float* acc) {
        const int64_t wt = blk / 2, rt = blk % 2;   // (weight tile, activation tile)
        amx_outputs(n + 16 * wt, 16 * wt, rb + rt, s0, s1, M, S, c, scf.data(), mnf.data(), dsT, bvT, d, dmin,
                    bias, acc, out, ldo);
      }
    };
    const size_t wrows = static_cast<size_t>(kAmxWeightRows * 8 * S);
    return Int4{std::vector<uint8_t>(wrows * 32), std::vector<float>(wrows), std::vector<float>(wrows),
                M, K, S, xb.data(), qs, sc, mn, dsT.data(), bvT.data(), d, dmin, bias, out, ldo};
  });
}

// int8 calls of many rows on AMX tiles, as q4_matmul_amx. The weights are signed, so they are
// tdpbusd's second operand and the activations its first, offset by 128 (x ^ 0x80 = x + 128 as
// an unsigned byte); 128 times each 16-value sub-block's weight sum comes off again (the offset
// trick of q8_super): the exact sub-block sums of q8_super. Then q8_rows' lane operations in
// q8_rows' order (each lane's two sub-blocks times their int8 scales, summed as int32, converted,
// one fma per superblock; hsum8's order at the end), with the 16 lanes of a vector holding 16
// weight rows: q8_rows' bits.
constexpr int64_t kAmx8Superblocks = 4;   // superblocks per pass of the float work (~64 KB of sums each)
constexpr int64_t kAmx8MinRows = 128;   // twice the sums and float work of int4: no faster than q8_rows below

// Activations as tdpbusd's first operand: xa[((rb * S + s) * 16 + 2j + h) * 256 + 16r + 4t + i] =
// row 16 rb + r's value 32j + 16h + 4t + i of superblock s, plus 128 (zero past M).
void amx8_activations(int64_t M, int64_t Mp, int64_t K, int64_t S, const int8_t* xq, uint8_t* xa) {
  at::parallel_for(0, Mp / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t rb = b0; rb < b1; ++rb) {
      for (int64_t r = 0; r < 16 && rb * 16 + r < M; ++r) {
        const int64_t m = rb * 16 + r;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t k0 = s * kSuper, nsub = std::min(kSuper, K - k0) / 32, W = 4 * nsub;
          const int8_t* src = xq + m * K + k0;
          uint8_t* dst = xa + (rb * S + s) * 16 * 256 + 16 * r;
          for (int64_t t = 0; t < 8; ++t) {   // t < 4: the first half of each block (h = 0)
            alignas(32) int32_t v[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(v), _mm256_xor_si256(load32(src + t * W, W), _mm256_set1_epi8(static_cast<char>(0x80))));
            for (int64_t j = 0; j < nsub; ++j) std::memcpy(dst + (2 * j + t / 4) * 256 + 4 * (t % 4), v + j, 4);
          }
        }
      }
    }
  });
}

// Weight rows n..n+31 as tdpbusd's second operand: wb[((s * 16 + 2j + h) * 2 + g) * 256 + 64t + 4w + i]
// = row n + 16g + w's value 32j + 16h + 4t + i; wsum[(s * 16 + 2j + h) * 32 + w] 128 times that
// sub-block's weight sum; se / so[(s * 8 + j) * 32 + w] the scales of sub-blocks 2j and 2j + 1;
// dw[s * 32 + w] the superblock scales (zero past a short superblock's blocks).
void amx8_weights(int64_t n, int64_t K, int64_t S, const int8_t* qs, const int8_t* sc, const float* d, int8_t* wb,
                  int32_t* wsum, int32_t* se, int32_t* so, float* dw) {
  for (int64_t w = 0; w < kAmxWeightRows; ++w) {
    const int8_t* q = qs + (n + w) * K;
    const int64_t g = w / 16, wl = w % 16;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t k0 = s * kSuper, nsub = std::min(kSuper, K - k0) / 32, W = 4 * nsub;
      dw[s * kAmxWeightRows + w] = d[(n + w) * S + s];
      __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};   // lane j: block j's half h
      for (int64_t t = 0; t < 8; ++t) {   // kernel-order vector t: lane j holds block j's values 4t..4t+3
        const __m256i v = load32(q + k0 + t * W, W);
        sums[t / 4] = _mm256_dpbusd_epi32(sums[t / 4], _mm256_set1_epi8(1), v);
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
        for (int64_t j = 0; j < 8; ++j)
          std::memcpy(wb + ((s * 16 + 2 * j + t / 4) * 2 + g) * 256 + 64 * (t % 4) + 4 * wl, lanes + j, 4);
      }
      for (int64_t h = 0; h < 2; ++h) {
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_slli_epi32(sums[h], 7));
        for (int64_t j = 0; j < 8; ++j) wsum[(s * 16 + 2 * j + h) * kAmxWeightRows + w] = lanes[j];
      }
      for (int64_t j = 0; j < 8; ++j) {
        const bool in = j < nsub;
        se[(s * 8 + j) * kAmxWeightRows + w] = in ? sc[(n + w) * (K / 16) + k0 / 16 + 2 * j] : 0;
        so[(s * 8 + j) * kAmxWeightRows + w] = in ? sc[(n + w) * (K / 16) + k0 / 16 + 2 * j + 1] : 0;
      }
    }
  }
}

// q8_rows' float work over superblocks s0..s1-1 for activation rows 16 rb..16 rb + 15 and weight
// rows n..n+15 (column g0.. of the group's wsum / se / so / dw), from sub-block sums
// c[((s - s0) * 16 + 2j + h) * kAmxSumStride + 16r + w]; partial sums carry over in acc between passes,
// the last pass writes the rows below M.
void amx8_outputs(int64_t n, int64_t g0, int64_t rb, int64_t s0, int64_t s1, int64_t M, int64_t S,
                  const int32_t* c, const int32_t* wsum, const int32_t* se, const int32_t* so, const float* dw,
                  const float* dx, const float* bias, float* accs, float* out, int64_t ldo) {
  const bool first = s0 == 0, last = s1 == S;
  const __m512 bb = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  for (int64_t r = 0; r < 16 && rb * 16 + r < M; ++r) {
    const int64_t m = rb * 16 + r;
    __m512 acc[8];
    float* keep = accs + r * 128;
    for (int j = 0; j < 8; ++j) acc[j] = first ? _mm512_setzero_ps() : _mm512_load_ps(keep + 16 * j);
    for (int64_t s = s0; s < s1; ++s) {
      const __m512 dwds = _mm512_mul_ps(_mm512_loadu_ps(dw + s * kAmxWeightRows + g0), _mm512_set1_ps(dx[m * S + s]));
#pragma GCC unroll 8   // acc stays in registers
      for (int j = 0; j < 8; ++j) {
        const int64_t b = (s - s0) * 16 + 2 * j;
        const __m512i ev = _mm512_sub_epi32(_mm512_loadu_si512(c + b * kAmxSumStride + 16 * r),
                                            _mm512_loadu_si512(wsum + (s * 16 + 2 * j) * kAmxWeightRows + g0));
        const __m512i od = _mm512_sub_epi32(_mm512_loadu_si512(c + (b + 1) * kAmxSumStride + 16 * r),
                                            _mm512_loadu_si512(wsum + (s * 16 + 2 * j + 1) * kAmxWeightRows + g0));
        const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(ev, _mm512_loadu_si512(se + (s * 8 + j) * kAmxWeightRows + g0)),
                                              _mm512_mullo_epi32(od, _mm512_loadu_si512(so + (s * 8 + j) * kAmxWeightRows + g0)));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dwds, acc[j]);
      }
    }
    if (!last) {
      for (int j = 0; j < 8; ++j) _mm512_store_ps(keep + 16 * j, acc[j]);
      continue;
    }
    // hsum8's order over the 8 lanes, then the bias
    const __m512 h = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6])),
                                   _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7])));
    _mm512_storeu_ps(out + m * ldo + n, _mm512_add_ps(h, bb));
  }
}

// The int8 matmul of weight rows 0..N-1 (a multiple of 32) on AMX tiles (amx_matmul's loops):
// per 16-value sub-block two activation and two weight tiles, four products.
void q8_matmul_amx(int64_t M, int64_t N, int64_t K, int64_t S, const int8_t* xq, const float* dx, const int8_t* qs,
                   const int8_t* sc, const float* d, const float* bias, float* out, int64_t ldo) {
  const int64_t Mp = (M + 31) / 32 * 32;
  std::vector<uint8_t> xa(static_cast<size_t>(Mp / 16 * S * 16 * 256), 0);
  amx8_activations(M, Mp, K, S, xq, xa.data());
  amx_matmul(Mp, N, K, S, [&] {
    struct Int8 {
      using Config = Amx8TileConfig;
      // 16-value sub-blocks; amx8_outputs keeps 16 x 128 partial sums per block
      enum : int64_t { kSubBlocks = 16, kPassSuperblocks = kAmx8Superblocks, kAccFloats = 128 };
      std::vector<int8_t> wb;
      std::vector<int32_t> wsum, se, so;
      std::vector<float> dw;
      int64_t M, K, S;
      const uint8_t* xa;
      const int8_t *qs, *sc;
      const float *d, *dx, *bias;
      float* out;
      int64_t ldo;
      void widen(int64_t n) { amx8_weights(n, K, S, qs, sc, d, wb.data(), wsum.data(), se.data(), so.data(), dw.data()); }
      void products(int32_t* c, int64_t rb, int64_t s, int64_t b) {
        const uint8_t* xs = xa + ((rb * S + s) * 16 + b) * 256;
        const int8_t* ws = wb.data() + (s * 16 + b) * 2 * 256;
        amx_2x2(c, xs, xs + S * 16 * 256, 16, ws, ws + 256, 64);   // activation rows 16 (rb + 1).. second
      }
      void outputs(int64_t blk, int64_t n, int64_t rb, int64_t s0, int64_t s1, const int32_t* c, float* acc) {
        const int64_t rt = blk / 2, wt = blk % 2;   // (activation tile, weight tile)
        amx8_outputs(n + 16 * wt, 16 * wt, rb + rt, s0, s1, M, S, c, wsum.data(), se.data(), so.data(), dw.data(),
                     dx, bias, acc, out, ldo);
      }
    };
    const size_t per = static_cast<size_t>(S * kAmxWeightRows);
    return Int8{std::vector<int8_t>(per * 16 * 16), std::vector<int32_t>(per * 16), std::vector<int32_t>(per * 8),
                std::vector<int32_t>(per * 8), std::vector<float>(per), M, K, S, xa.data(), qs, sc, d, dx, bias,
                out, ldo};
  });
}
#endif

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
              "bias must be a contiguous float32 [N] tensor");
  return bias->data_ptr<float>();
}

void check_out(const torch::Tensor& out, int64_t M, int64_t col0, int64_t N) {
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.stride(1) == 1,
              "out must be a float32 [M, ldo] tensor with unit column stride");
  TORCH_CHECK(out.size(0) == M && col0 >= 0 && col0 + N <= out.size(1), "out is too small");
}

}  // namespace

// x [M, K] float32 -> (xq int8 [M, K] in kernel order, dx float32 [M, S], bsum int32 [M, K/32]:
// each 32-value block's sum).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32, got ", K);
  const int64_t S = (K + kSuper - 1) / kSuper;
  auto xq = at::empty({M, K}, x.options().dtype(torch::kInt8));
  auto dx = at::empty({M, S}, x.options());
  auto bsum = at::empty({M, K / 32}, x.options().dtype(torch::kInt32));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  int32_t* bp = bsum.data_ptr<int32_t>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    alignas(32) int8_t q[kSuper];
    const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t m = b; m < e; ++m) {
      for (int64_t s = 0; s < S; ++s) {
        const int64_t k0 = s * kSuper, len = std::min(kSuper, K - k0), nsub = len / 32;
        const float* xs = xp + m * K + k0;
        // 8 lanes at a time, the scalar definition's values: the maximum is exact in any order
        // (a NaN never wins, as with std::max), nearbyint is vroundps in the current rounding mode, the clamp
        // sends a NaN to -127 as std::min(127, std::max(-127, v)) does
        __m256 mx = _mm256_setzero_ps();
        for (int64_t i = 0; i < len; i += 8) mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xs + i)), mx);
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        float amax = 0.0f;
        for (float v : lanes) amax = std::max(amax, v);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        dp[m * S + s] = amax / 127.0f;
        const __m256 iv = _mm256_set1_ps(inv);
        for (int64_t i = 0; i < len; i += 32) {
          __m256i w[4];
          for (int u = 0; u < 4; ++u) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xs + i + 8 * u), iv),
                                             _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
            w[u] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
          }
          // int32 -> int8 with saturation (exact: |v| <= 127); the packs interleave 128-bit lanes
          const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
          _mm256_store_si256(reinterpret_cast<__m256i*>(q + i),
                             _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        for (int64_t j = 0; j < nsub; ++j) {
          int32_t t = 0;
          for (int i = 0; i < 32; ++i) t += q[j * 32 + i];
          bp[m * (K / 32) + k0 / 32 + j] = t;
        }
        int8_t* dst = qp + m * K + k0;   // the kernel order: groups of four transposed
        for (int64_t t = 0; t < 8; ++t)
          for (int64_t j = 0; j < nsub; ++j) std::memcpy(dst + t * 4 * nsub + 4 * j, q + 32 * j + 4 * t, 4);
      }
    }
  });
  return {xq, dx, bsum};
}

// out[:, col0:col0+N] = dequant(int4 weights) applied to the quantized rows (+ bias).
void q4_matmul(torch::Tensor xq, torch::Tensor dx, torch::Tensor bsum, torch::Tensor qs, torch::Tensor sc,
               torch::Tensor mn, torch::Tensor d, torch::Tensor dmin, c10::optional<torch::Tensor> bias,
               torch::Tensor out, int64_t col0) {
  const int64_t M = xq.size(0), K = xq.size(1), N = qs.size(0);
  const int64_t S = (K + kSuper - 1) / kSuper;
  TORCH_CHECK(K % 64 == 0 && qs.size(1) == K / 2 && sc.size(1) == K / 32 && mn.size(1) == K / 32 &&
              d.size(1) == S && dmin.size(1) == S, "int4 weight does not match in_features ", K);
  TORCH_CHECK(qs.is_contiguous() && sc.is_contiguous() && mn.is_contiguous() && d.is_contiguous() &&
              dmin.is_contiguous() && xq.is_contiguous() && dx.is_contiguous() && bsum.is_contiguous(),
              "int4 operands must be contiguous");
  check_out(out, M, col0, N);
  const float* bp = bias_ptr(bias, N);
  const int8_t* xp = xq.data_ptr<int8_t>();
  const float* dxp = dx.data_ptr<float>();
  const torch::Tensor bsum_f = bsum.to(torch::kFloat32);   // exact: |block sum| <= 32 * 127
  const float* bsp = bsum_f.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const uint8_t* scp = sc.data_ptr<uint8_t>();
  const uint8_t* mnp = mn.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* dmp = dmin.data_ptr<float>();
  float* op = out.data_ptr<float>() + col0;
  const int64_t ldo = out.stride(0);
  int64_t n0 = 0;   // weight rows before n0 are done on AMX tiles
#if KERNEL_AMX
  if (M >= kAmxMinRows && N >= kAmxWeightRows && amx_usable()) {
    n0 = N / kAmxWeightRows * kAmxWeightRows;
    q4_matmul_amx(M, n0, K, S, xp, dxp, bsp, qp, scp, mnp, dp, dmp, bp, op, ldo);
  }
#endif
  for_each_output(M, N, [&](auto R, auto NB, int64_t n, int64_t r) {
#if KERNEL_ZMM
    q4_rows_zmm<decltype(R)::value, decltype(NB)::value>(n, r, K, S, xp, dxp, bsp, qp, scp, mnp, dp, dmp, bp, op, ldo);
#else
    q4_rows<decltype(R)::value, decltype(NB)::value>(n, r, K, S, xp, dxp, bsp, qp, scp, mnp, dp, dmp, bp, op, ldo);
#endif
  }, n0);
}

// out[:, col0:col0+N] = dequant(int8 weights) applied to the quantized rows (+ bias).
void q8_matmul(torch::Tensor xq, torch::Tensor dx, torch::Tensor qs, torch::Tensor sc, torch::Tensor d,
               c10::optional<torch::Tensor> bias, torch::Tensor out, int64_t col0) {
  const int64_t M = xq.size(0), K = xq.size(1), N = qs.size(0);
  const int64_t S = (K + kSuper - 1) / kSuper;
  TORCH_CHECK(K % 32 == 0 && qs.size(1) == K && sc.size(1) == K / 16 && d.size(1) == S,
              "int8 weight does not match in_features ", K);
  TORCH_CHECK(qs.is_contiguous() && sc.is_contiguous() && d.is_contiguous() && xq.is_contiguous() &&
              dx.is_contiguous(), "int8 operands must be contiguous");
  check_out(out, M, col0, N);
  const float* bp = bias_ptr(bias, N);
  const int8_t* xp = xq.data_ptr<int8_t>();
  const float* dxp = dx.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const int8_t* scp = sc.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* op = out.data_ptr<float>() + col0;
  const int64_t ldo = out.stride(0);
  int64_t n0 = 0;   // weight rows before n0 are done on AMX tiles
#if KERNEL_AMX
  if (M >= kAmx8MinRows && N >= kAmxWeightRows && amx_usable()) {
    n0 = N / kAmxWeightRows * kAmxWeightRows;
    q8_matmul_amx(M, n0, K, S, xp, dxp, qp, scp, dp, bp, op, ldo);
  }
#endif
  for_each_output(M, N, [&](auto R, auto NB, int64_t n, int64_t r) {
#if KERNEL_ZMM
    if constexpr (decltype(NB)::value == 1 && decltype(R)::value > 1) q8_rows_zmm<decltype(R)::value>(n, r, K, S, xp, dxp, qp, scp, dp, bp, op, ldo);
    else
#endif
    q8_rows<decltype(R)::value, decltype(NB)::value>(n, r, K, S, xp, dxp, qp, scp, dp, bp, op, ldo);
  }, n0);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "per-row, per-256 int8 activation quantization");
  m.def("q4_matmul", &q4_matmul, "int4 (k-quant) weight x int8 activation matmul");
  m.def("q8_matmul", &q8_matmul, "int8 (k-quant) weight x int8 activation matmul");
  m.def("amx_enabled", [] {
#if KERNEL_AMX
    return amx_usable();
#else
    return false;
#endif
  }, "whether calls of many rows run on AMX tiles (built with them and granted by the OS)");
}
