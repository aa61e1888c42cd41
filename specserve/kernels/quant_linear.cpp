// Batch-invariant int8 / int4 linear kernels for x86 CPUs with AVX2 (specserve.kernels).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with
//   * weights in k-quant layouts (superblocks of 256 along k, the last one may be shorter):
//       int4: w = d[n,s] * sc[n,j] * q - dmin[n,s] * mn[n,j], q in 0..15, j = k / 32
//             (llama.cpp's Q4_K, with 8-bit instead of 6-bit sub-block scales and mins)
//       int8: w = d[n,s] * sc[n,j] * q, q in -127..127, sc int8, j = k / 16   (Q6_K generalised)
//   * activations quantized per row and per superblock to int8 (d_x = amax / 127, llama.cpp's Q8_K),
//     stored in the kernel order of specserve.models.quantization.kernel_order: within a superblock
//     of L = 32 B values, position t * 4B + 4b + i holds value 32b + 4t + i, so each group of four
//     consecutive values ("quad") is four contiguous bytes.
//
// Weights are repacked at load into groups of 16 weight rows (specserve.models.quantization's
// PackedWeight; llama.cpp's block_q4_Kx8 and ik_llama.cpp's _R8 types are the same idea): one quad
// of 16 weight rows is 64 contiguous bytes, weight row w in bytes 4w..4w+3, so a vector lane is a
// weight row (an output column). A four-way u8 x s8 dot product of such a vector with one activation
// quad broadcast to every lane (vpdpbusd's embedded broadcast) adds 4 products to each of 16 (zmm)
// or 8 (ymm) outputs: the inner loop is loads and dot products, and a register tile of rows x
// weight-row vectors reuses every weight vector for each row of the tile and every broadcast for
// each vector.
//
// The arithmetic of one output y[m, n], the same on every path (one row or many, any tile, vector
// width or thread count), which is what makes a row's bits independent of the rows beside it
// (speculative verify of k+1 rows == k+1 single-row decodes):
//   for each superblock s, in order:
//     I = sum_j sc[n,j] * (sum of sub-block j's integer products)   exact int32 (< 2^31 below)
//     int4: Mn = sum_j mn[n,j] * (sum of sub-block j's activation integers)   exact int32
//     acc  = fma(float(I),  d[n,s]    * dx[m,s], acc)     (float(.) rounds to nearest once)
//     macc = fma(float(Mn), dmin[n,s] * dx[m,s], macc)   (int4)
//   y = (acc - macc) + bias   (int8: acc + bias)
// Integer sums are exact in any order, and every float operation is one IEEE operation on the same
// operands in the same order in every lane of every path; the file is compiled with
// -ffp-contract=off so the compiler cannot contract scalar steps differently in different loops.
// torch/python.h (pybind11 and the tensor casters) and the few ATen headers used, not
// torch/extension.h: the whole of torch's C++ API takes ~10 s more to compile per build.
#include <torch/python.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>
#include <algorithm>

#include "vec_math.h"
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

// 512-bit vectors (16 weight rows per vector) where build_quant_ops defines SPECSERVE_ZMM (a CPU
// that runs them at full width: specserve.kernels.cpu_runs_512bit_at_full_width); else 256-bit
// ones, with AVX-512 VNNI's vpdpbusd where the CPU has it (KERNEL_VNNI), AVX2's vpmaddubsw /
// vpmaddwd otherwise. All sum the same integers, so all give the same bits.
#if defined(SPECSERVE_ZMM) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KERNEL_ZMM 1
#else
#define KERNEL_ZMM 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KERNEL_VNNI 1
#else
#define KERNEL_VNNI 0
#endif

namespace {

constexpr int64_t kSuper = 256;   // superblock length along k
constexpr int64_t kGroupRows = 16;   // weight rows per packed group (one zmm of int32 lanes)

// Decode and verify read every weight byte once, from memory; the hardware prefetcher alone left a
// one-row call well below the machine's streaming rate (measured on a Xeon with AMX). Each
// sub-block therefore asks for the weight lines kPrefetchBytes ahead in its group's stream (a
// group's bytes are contiguous). A prefetch never faults, so it may run past the tensor's end.
#ifndef SPECSERVE_PREFETCH
#define SPECSERVE_PREFETCH 3072
#endif
constexpr int64_t kPrefetchBytes = SPECSERVE_PREFETCH;

__attribute__((always_inline)) inline void prefetch_ahead(const void* p, int lines) {
  const char* q = static_cast<const char*>(p) + kPrefetchBytes;
  for (int l = 0; l < lines; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T0);
}

__attribute__((always_inline)) inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The vector operations of one width. A vector holds L int32 / float lanes, one weight row each;
// a packed group of 16 weight rows is 16 / L vectors ("halves" on 256-bit builds), vector h of a
// group covering its weight rows h L .. h L + L - 1. The integer dot products:
//   q4_dot(acc, w, x): acc + the products of unsigned nibbles w and signed activations x, in the
//     form q4_finish takes: VNNI vpdpbusd into int32; AVX2 vpmaddubsw's pair sums added as int16
//     (a pair is at most 2 * 15 * 127 = 3,810 and a sub-block adds 8 pairs: 30,480 < 2^15);
//   q4_finish(sub, sc): the sub-block's sum times its scale, int32 (VNNI vpmulld; AVX2 vpmaddwd
//     by the scale in both int16 halves: scale_form);
//   mins(acc, mn, bs): acc + mn.lo * bs.lo + mn.hi * bs.hi over int16 pairs (vpdpwssd / vpmaddwd).
#if KERNEL_ZMM
struct Vec {
  static constexpr int L = 16;
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I bcast(const void* p) { return _mm512_set1_epi32(load_i32(p)); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sc_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I sc_s8(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I scale_form(I sc) { return sc; }
  static void nibbles(I v, I& lo, I& hi) {
    const I m4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(v, m4);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
  }
  static I q4_dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static I q4_finish(I sub, I sc) { return _mm512_mullo_epi32(sub, sc); }
  static I q4_merge(I a, I b) { return _mm512_add_epi32(a, b); }
  static I q8_dot(I acc, I xu, I w) { return _mm512_dpbusd_epi32(acc, xu, w); }
  static I mins(I acc, I mn, I bs) { return _mm512_dpwssd_epi32(acc, mn, bs); }
  // quad t (0..3) of a 6-bit sub-block: the low nibbles of lo (t = 0, 1) or hi (t = 2, 3), the two
  // high bits from hb's bits 2t..2t+1, as unsigned bytes 0..63
  template <int T>
  static I six(I lo, I hi, I hb) {
    const I m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const I nib = T == 0 ? lo : T == 1 ? _mm512_srli_epi16(lo, 4) : T == 2 ? hi : _mm512_srli_epi16(hi, 4);
    const I top = T == 0 ? _mm512_slli_epi16(hb, 4) : T == 1 ? _mm512_slli_epi16(hb, 2) : T == 2 ? hb : _mm512_srli_epi16(hb, 2);
    return _mm512_or_si512(_mm512_and_si512(nib, m4), _mm512_and_si512(top, m30));
  }
  static I shl5(I v) { return _mm512_slli_epi32(v, 5); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static void store(float* p, F v, int64_t n) {   // the first n lanes
    if (n >= L) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
};
#else
struct Vec {
  static constexpr int L = 8;
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bcast(const void* p) { return _mm256_set1_epi32(load_i32(p)); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sc_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I sc_s8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static void nibbles(I v, I& lo, I& hi) {
    const I m4 = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(v, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  }
#if KERNEL_VNNI
  static I scale_form(I sc) { return sc; }
  static I q4_dot(I acc, I w, I x) { return _mm256_dpbusd_epi32(acc, w, x); }
  static I q4_finish(I sub, I sc) { return _mm256_mullo_epi32(sub, sc); }
  static I q4_merge(I a, I b) { return _mm256_add_epi32(a, b); }
  static I q8_dot(I acc, I xu, I w) { return _mm256_dpbusd_epi32(acc, xu, w); }
  static I mins(I acc, I mn, I bs) { return _mm256_dpwssd_epi32(acc, mn, bs); }
#else
  // int32 lanes (|v| < 2^15, either sign) -> both int16 halves = v
  static I scale_form(I sc) {
    return _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16));
  }
  static I q4_dot(I acc, I w, I x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
  static I q4_finish(I sub, I sc16) { return _mm256_madd_epi16(sub, sc16); }
  static I q4_merge(I a, I b) { return _mm256_add_epi16(a, b); }   // two int16 halves of one sub-block sum
  static I mins(I acc, I mn, I bs) { return _mm256_add_epi32(acc, _mm256_madd_epi16(mn, bs)); }
#endif
  template <int T>
  static I six(I lo, I hi, I hb) {   // as the 512-bit one
    const I m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const I nib = T == 0 ? lo : T == 1 ? _mm256_srli_epi16(lo, 4) : T == 2 ? hi : _mm256_srli_epi16(hi, 4);
    const I top = T == 0 ? _mm256_slli_epi16(hb, 4) : T == 1 ? _mm256_slli_epi16(hb, 2) : T == 2 ? hb : _mm256_srli_epi16(hb, 2);
    return _mm256_or_si256(_mm256_and_si256(nib, m4), _mm256_and_si256(top, m30));
  }
  static I shl5(I v) { return _mm256_slli_epi32(v, 5); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static void store(float* p, F v, int64_t n) {   // the first n lanes
    if (n >= L) { _mm256_storeu_ps(p, v); return; }
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(p, tmp, static_cast<size_t>(std::max<int64_t>(n, 0)) * 4);
  }
};
#endif
constexpr int kHalves = kGroupRows / Vec::L;   // vectors per packed group

// The packed int4 operands (specserve.models.quantization.PackedWeight; G = ceil(N / 16) groups,
// J = K / 32 sub-blocks):
//   wq [G, J, 4, 16, 4] uint8: sub-block j's quad pairs c: byte 4w + i's low nibble is weight row
//      16g + w's value 32j + 8c + i, its high nibble value 32j + 8c + 4 + i
//   sc [G, J, 16] uint8 sub-block scales; mn [G, J / 2, 16, 2] int16 the mins of sub-blocks 2p, 2p + 1
//   d, dmin [G, S, 16] float32 superblock scales (rows past N: zeros)
// and the activations: xq [M, K] int8 (kernel order), dx [M, S], bs [M, J] int16 each sub-block's sum.
struct Q4Args {
  int64_t M, N, K, S;
  const int8_t* xq;
  const float* dx;
  const int16_t* bs;
  const uint8_t* wq;
  const uint8_t* sc;
  const int16_t* mn;
  const float* d;
  const float* dmin;
  const float* bias;
  float* out;
  int64_t ldo;
};

// The packed int8 operands: wq [G, K / 16, 4, 16, 4] int8 (16-value sub-block j's quads t: bytes 4w + i
// hold weight row 16g + w's value 16j + 4t + i), sc [G, K / 16, 16] int8, d [G, S, 16] float32,
// corr [G, S, 16] int32 = -128 * sum_j sc[j] * (sum of sub-block j's weights) (the VNNI path's
// activation offset, taken off again); activations xq [M, K] int8 and, for VNNI, xu = xq + 128 as
// unsigned bytes.
struct Q8Args {
  int64_t M, N, K, S;
  const int8_t* xq;
  const uint8_t* xu;
  const float* dx;
  const int8_t* wq;
  const int8_t* sc;
  const int32_t* corr;
  const float* d;
  const float* bias;
  float* out;
  int64_t ldo;
};

// Vector v of the packed tensors: its group, and its first weight row within the group.
struct VecPos {
  int64_t g, lb;
  explicit VecPos(int64_t v) : g(v / kHalves), lb((v % kHalves) * Vec::L) {}
};

// Vector v's part of a packed tensor [G, per_group] whose 16 lanes hold `lane` elements each.
template <typename T>
__attribute__((always_inline)) inline const T* lanes_of(const T* base, int64_t v, int64_t per_group, int64_t lane) {
  const VecPos p(v);
  return base + p.g * per_group + lane * p.lb;
}

// One superblock's float step: acc[r][v] = fma(float(I[r][v]), d[v][s] * dx[r][s], acc[r][v]), d a
// packed [G, S, 16] scale.
template <int MR, int NV>
__attribute__((always_inline)) inline void float_step(Vec::F (&acc)[MR][NV], const Vec::I (&sums)[MR][NV],
                                                      const float* const (&d)[NV], const float* dx, int64_t r0,
                                                      int64_t S, int64_t s) {
  for (int r = 0; r < MR; ++r) {
    const Vec::F ds = Vec::fset1(dx[(r0 + r) * S + s]);
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(Vec::cvt(sums[r][v]), Vec::mul(Vec::fload(d[v] + s * 16), ds), acc[r][v]);
  }
}

// The last step of every output of a tile: lanes past N are not written.
template <int MR, int NV>
__attribute__((always_inline)) inline void store_tile(const Vec::F (&y)[MR][NV], int64_t r0, int64_t v0, int64_t N,
                                                      const float* bias, float* out, int64_t ldo) {
  for (int v = 0; v < NV; ++v) {
    const VecPos p(v0 + v);
    const int64_t n = p.g * kGroupRows + p.lb;
    alignas(64) float bb[Vec::L] = {};
    if (bias) std::memcpy(bb, bias + n, static_cast<size_t>(std::clamp<int64_t>(N - n, 0, Vec::L)) * 4);
    const Vec::F bv = Vec::fload(bb);
    for (int r = 0; r < MR; ++r) Vec::store(out + (r0 + r) * ldo + n, Vec::fadd(y[r][v], bv), N - n);
  }
}

// Rows r0..r0+MR-1 against vectors v0..v0+NV-1 (NV * L weight rows) of an int4 weight: the
// arithmetic in the header, integer sums in registers, one float step per superblock.
template <int MR, int NV>
inline void q4_tile(const Q4Args& a, int64_t r0, int64_t v0) {
  using I = Vec::I;
  using F = Vec::F;
  const int64_t K = a.K, S = a.S, J = K / 32;
  const uint8_t* wg[NV];
  const uint8_t* scg[NV];
  const int16_t* mng[NV];
  const float* dg[NV];
  const float* dmg[NV];
  bool pf[NV];   // one prefetch per group (the halves of a group share its lines)
  for (int v = 0; v < NV; ++v) {
    wg[v] = lanes_of(a.wq, v0 + v, J * 256, 4);
    scg[v] = lanes_of(a.sc, v0 + v, J * 16, 1);
    mng[v] = lanes_of(a.mn, v0 + v, J * 16, 2);
    dg[v] = lanes_of(a.d, v0 + v, S * 16, 1);
    dmg[v] = lanes_of(a.dmin, v0 + v, S * 16, 1);
    pf[v] = VecPos(v0 + v).lb == 0;
  }
  F acc[MR][NV], macc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) { acc[r][v] = Vec::fzero(); macc[r][v] = Vec::fzero(); }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper, B = std::min(kSuper, K - k0) / 32, W = 4 * B, j0 = k0 / 32;
    I isum[MR][NV], msum[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) { isum[r][v] = Vec::zero(); msum[r][v] = Vec::zero(); }
    for (int64_t b = 0; b < B; ++b) {
      const int64_t j = j0 + b;
      I scv[NV], sub[MR][NV];
      for (int v = 0; v < NV; ++v) {
        scv[v] = Vec::scale_form(Vec::sc_u8(scg[v] + j * 16));
        if (pf[v]) prefetch_ahead(wg[v] + j * 256, 4);
      }
      // Small tiles (one or two rows: decode, k = 1 verifies) have few independent dot-product
      // chains; the low and high nibbles then go to separate accumulators, summed after the
      // sub-block (the same integers).
      constexpr bool kSplit = MR * NV <= 2;
      I sub2[kSplit ? MR : 1][kSplit ? NV : 1];
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) {
          sub[r][v] = Vec::zero();
          if constexpr (kSplit) sub2[r][v] = Vec::zero();
        }
#pragma GCC unroll 4
      for (int64_t c = 0; c < 4; ++c) {
        I lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) Vec::nibbles(Vec::load(wg[v] + j * 256 + c * 64), lo[v], hi[v]);
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = a.xq + (r0 + r) * K + k0 + 4 * b;   // quad (b, t) at t * W
          const I xa = Vec::bcast(xr + 2 * c * W), xb = Vec::bcast(xr + (2 * c + 1) * W);
          for (int v = 0; v < NV; ++v) {
            sub[r][v] = Vec::q4_dot(sub[r][v], lo[v], xa);
            if constexpr (kSplit) sub2[r][v] = Vec::q4_dot(sub2[r][v], hi[v], xb);
            else sub[r][v] = Vec::q4_dot(sub[r][v], hi[v], xb);
          }
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) {
          if constexpr (kSplit) sub[r][v] = Vec::q4_merge(sub[r][v], sub2[r][v]);
          isum[r][v] = Vec::add(isum[r][v], Vec::q4_finish(sub[r][v], scv[v]));
        }
    }
    for (int64_t p = 0; p < B / 2; ++p) {   // the mins times the activations' sub-block sums
      I mv[NV];
      for (int v = 0; v < NV; ++v) mv[v] = Vec::load(mng[v] + (j0 / 2 + p) * 32);
      for (int r = 0; r < MR; ++r) {
        const I bs = Vec::bcast(a.bs + (r0 + r) * J + j0 + 2 * p);
        for (int v = 0; v < NV; ++v) msum[r][v] = Vec::mins(msum[r][v], mv[v], bs);
      }
    }
    float_step<MR, NV>(acc, isum, dg, a.dx, r0, S, s);
    float_step<MR, NV>(macc, msum, dmg, a.dx, r0, S, s);
  }
  F y[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) y[r][v] = Vec::sub(acc[r][v], macc[r][v]);
  store_tile<MR, NV>(y, r0, v0, a.N, a.bias, a.out, a.ldo);
}

// The same for an int8 weight. VNNI: the activations offset by 128 as the unsigned operand
// (vpdpbusd's first), the weights signed, and the offset's sum taken off through corr; AVX2: |w|
// against x with w's sign (vpsignb), the pair sums scaled by vpmaddwd. The same integers.
template <int MR, int NV>
inline void q8_tile(const Q8Args& a, int64_t r0, int64_t v0) {
  using I = Vec::I;
  using F = Vec::F;
  const int64_t K = a.K, S = a.S, J = K / 16;
  const int8_t* wg[NV];
  const int8_t* scg[NV];
  const int32_t* cg[NV];
  const float* dg[NV];
  bool pf[NV];
  for (int v = 0; v < NV; ++v) {
    wg[v] = lanes_of(a.wq, v0 + v, J * 256, 4);
    scg[v] = lanes_of(a.sc, v0 + v, J * 16, 1);
    cg[v] = lanes_of(a.corr, v0 + v, S * 16, 1);
    dg[v] = lanes_of(a.d, v0 + v, S * 16, 1);
    pf[v] = VecPos(v0 + v).lb == 0;
  }
  F acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fzero();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper, B = std::min(kSuper, K - k0) / 32, W = 4 * B, j0 = k0 / 16;
    I isum[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) isum[r][v] = KERNEL_VNNI ? Vec::load(cg[v] + s * 16) : Vec::zero();
    for (int64_t jj = 0; jj < 2 * B; ++jj) {   // 16-value sub-block jj: half jj % 2 of block jj / 2
      const int64_t j = j0 + jj, b = jj / 2;
      I scv[NV];
      for (int v = 0; v < NV; ++v) {
        scv[v] = Vec::sc_s8(scg[v] + j * 16);
        if (pf[v]) prefetch_ahead(wg[v] + j * 256, 4);
      }
#if KERNEL_VNNI
      I sub[MR][NV];
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) sub[r][v] = Vec::zero();
#pragma GCC unroll 4
      for (int64_t tt = 0; tt < 4; ++tt) {
        const int64_t t = 4 * (jj % 2) + tt;
        I w[NV];
        for (int v = 0; v < NV; ++v) w[v] = Vec::load(wg[v] + j * 256 + tt * 64);
        for (int r = 0; r < MR; ++r) {
          const I xu = Vec::bcast(a.xu + (r0 + r) * K + k0 + t * W + 4 * b);
          for (int v = 0; v < NV; ++v) sub[r][v] = Vec::q8_dot(sub[r][v], xu, w[v]);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) isum[r][v] = Vec::add(isum[r][v], Vec::q4_finish(sub[r][v], scv[v]));
#else
      I sc16[NV];
      for (int v = 0; v < NV; ++v) sc16[v] = Vec::scale_form(scv[v]);
#pragma GCC unroll 4
      for (int64_t tt = 0; tt < 4; ++tt) {
        const int64_t t = 4 * (jj % 2) + tt;
        I w[NV], aw[NV];
        for (int v = 0; v < NV; ++v) {
          w[v] = Vec::load(wg[v] + j * 256 + tt * 64);
          aw[v] = _mm256_sign_epi8(w[v], w[v]);
        }
        for (int r = 0; r < MR; ++r) {
          const I x = Vec::bcast(a.xq + (r0 + r) * K + k0 + t * W + 4 * b);
          for (int v = 0; v < NV; ++v)
            isum[r][v] = _mm256_add_epi32(isum[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[v], _mm256_sign_epi8(x, w[v])), sc16[v]));
        }
      }
#endif
    }
    float_step<MR, NV>(acc, isum, dg, a.dx, r0, S, s);
  }
  store_tile<MR, NV>(acc, r0, v0, a.N, a.bias, a.out, a.ldo);
}

// The packed 6-bit operands (Q6_K's integers u = q + 32 in 0..63): wq [G, K / 16, 192] uint8, per
// 16-value sub-block j 128 bytes of nibbles (64-byte block c: byte 4w + i's low nibble is the low
// four bits of weight row 16g + w's value 16j + 8c + i, its high nibble those of value 16j + 8c + 4
// + i) then 64 bytes of high bits (byte 4w + i, bits 2t..2t+1: value 16j + 4t + i's top two); sc
// [G, K / 16, 16] int8; sc2 [G, K / 32, 16, 2] int16 the scales of sub-blocks 2p, 2p + 1 side by
// side; d [G, S, 16]. Activations xq and bs [M, K / 16] int16 each 16-value sub-block's sum.
// I = sum_j sc[j] * (sum u x) - 32 * sum_j sc[j] * (sum x): int8's I on the same integers, so the
// same bits as the int8 layout holding them.
struct Q6Args {
  int64_t M, N, K, S;
  const int8_t* xq;
  const float* dx;
  const int16_t* bs;
  const uint8_t* wq;
  const int8_t* sc;
  const int16_t* sc2;
  const float* d;
  const float* bias;
  float* out;
  int64_t ldo;
};

template <int MR, int NV>
inline void q6_tile(const Q6Args& a, int64_t r0, int64_t v0) {
  using I = Vec::I;
  using F = Vec::F;
  const int64_t K = a.K, S = a.S, J = K / 16;
  const uint8_t* wg[NV];
  const int8_t* scg[NV];
  const int16_t* s2g[NV];
  const float* dg[NV];
  bool pf[NV];
  for (int v = 0; v < NV; ++v) {
    wg[v] = lanes_of(a.wq, v0 + v, J * 192, 4);
    scg[v] = lanes_of(a.sc, v0 + v, J * 16, 1);
    s2g[v] = lanes_of(a.sc2, v0 + v, J * 16, 2);
    dg[v] = lanes_of(a.d, v0 + v, S * 16, 1);
    pf[v] = VecPos(v0 + v).lb == 0;
  }
  F acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fzero();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper, B = std::min(kSuper, K - k0) / 32, W = 4 * B, j0 = k0 / 16;
    I isum[MR][NV], msum[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) { isum[r][v] = Vec::zero(); msum[r][v] = Vec::zero(); }
    for (int64_t jj = 0; jj < 2 * B; ++jj) {   // 16-value sub-block jj: half jj % 2 of block jj / 2
      const int64_t j = j0 + jj, b = jj / 2, h = jj % 2;
      I scv[NV], lo[NV], hi[NV], hb[NV];
      for (int v = 0; v < NV; ++v) {
        scv[v] = Vec::scale_form(Vec::sc_s8(scg[v] + j * 16));
        const uint8_t* p = wg[v] + j * 192;
        if (pf[v]) prefetch_ahead(p, 3);
        lo[v] = Vec::load(p);
        hi[v] = Vec::load(p + 64);
        hb[v] = Vec::load(p + 128);
      }
#if KERNEL_VNNI
      I sub[MR][NV];
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) sub[r][v] = Vec::zero();
      auto step = [&](auto T) {
        constexpr int t = decltype(T)::value;
        I u[NV];
        for (int v = 0; v < NV; ++v) u[v] = Vec::six<t>(lo[v], hi[v], hb[v]);
        for (int r = 0; r < MR; ++r) {
          const I x = Vec::bcast(a.xq + (r0 + r) * K + k0 + (4 * h + t) * W + 4 * b);
          for (int v = 0; v < NV; ++v) sub[r][v] = Vec::q4_dot(sub[r][v], u[v], x);
        }
      };
      step(std::integral_constant<int, 0>{});
      step(std::integral_constant<int, 1>{});
      step(std::integral_constant<int, 2>{});
      step(std::integral_constant<int, 3>{});
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) isum[r][v] = Vec::add(isum[r][v], Vec::q4_finish(sub[r][v], scv[v]));
#else
      // a pair sum is at most 2 * 63 * 127 = 16,002: scaled per quad by vpmaddwd
      auto step = [&](auto T) {
        constexpr int t = decltype(T)::value;
        I u[NV];
        for (int v = 0; v < NV; ++v) u[v] = Vec::six<t>(lo[v], hi[v], hb[v]);
        for (int r = 0; r < MR; ++r) {
          const I x = Vec::bcast(a.xq + (r0 + r) * K + k0 + (4 * h + t) * W + 4 * b);
          for (int v = 0; v < NV; ++v)
            isum[r][v] = _mm256_add_epi32(isum[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(u[v], x), scv[v]));
        }
      };
      step(std::integral_constant<int, 0>{});
      step(std::integral_constant<int, 1>{});
      step(std::integral_constant<int, 2>{});
      step(std::integral_constant<int, 3>{});
#endif
    }
    for (int64_t p = 0; p < B; ++p) {   // 32 * sum_j sc[j] * (the activations' sum over sub-block j)
      I sv[NV];
      for (int v = 0; v < NV; ++v) sv[v] = Vec::load(s2g[v] + (k0 / 32 + p) * 32);
      for (int r = 0; r < MR; ++r) {
        const I bs = Vec::bcast(a.bs + (r0 + r) * J + j0 + 2 * p);
        for (int v = 0; v < NV; ++v) msum[r][v] = Vec::mins(msum[r][v], sv[v], bs);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) isum[r][v] = Vec::isub(isum[r][v], Vec::shl5(msum[r][v]));
    float_step<MR, NV>(acc, isum, dg, a.dx, r0, S, s);
  }
  store_tile<MR, NV>(acc, r0, v0, a.N, a.bias, a.out, a.ldo);
}

// Tile shapes: rows x vectors. Up to kManyRows rows (decode, verifies, small trees) the weights
// come from memory: tiles one vector wide (each thread streams one group at a time; two or four
// groups at once measured 1.3-1.5x slower at 1-4 rows on a Zen 5) and as tall as the registers
// allow, so every weight vector is loaded and unpacked once. More rows (prefill, big batches) are
// compute-bound: two vectors per tile, so each activation broadcast serves both (a 2-vector tile
// measured 1.07-1.1x faster at 64 rows). A tile holds 2 * MR * NV integer accumulators in
// registers. The shape never changes a value (each output gets the same operations).
// One or two rows (decode, k = 1 verifies) take a whole group per tile on 256-bit builds too (two
// vectors of 8 rows: half-group tiles measured 1.15-1.25x slower at one row on a Zen 5).
#ifndef SPECSERVE_TILES   // few rows, vectors; many rows, vectors; kManyRows
#if KERNEL_ZMM || KERNEL_VNNI   // 32 vector registers
#define SPECSERVE_TILES 12, 1, 6, 2, 24
#else                           // AVX2: 16
#define SPECSERVE_TILES 4, 1, 4, 1, 24
#endif
#endif
constexpr int kTiles[5] = {SPECSERVE_TILES};
constexpr int kTinyRows = 2, kTinyVecs = kHalves;
constexpr int kFewRows = kTiles[0], kFewVecs = kTiles[1];
constexpr int kManyRowsTile = kTiles[2], kManyVecs = kTiles[3];
constexpr int64_t kManyRows = kTiles[4];
// Activation rows per pass over a thread's weight groups: the pass's activations stay in the
// core's L2 while its weights stream once.
inline int64_t row_block(int64_t K) { return std::clamp<int64_t>(int64_t{384} * 1024 / K, 16, 256); }

template <int NV, int MR, typename F>
__attribute__((always_inline)) inline void dispatch_rows(int64_t R, int64_t r, int64_t v, F& f) {
  if (R == MR) f(std::integral_constant<int, MR>{}, std::integral_constant<int, NV>{}, r, v);
  else if constexpr (MR > 1) dispatch_rows<NV, MR - 1>(R, r, v, f);
}

// Rows m0..m1-1 in tiles of at most MRMAX rows, as even as possible, against vectors v..v+NV-1.
template <int NV, int MRMAX, typename F>
inline void row_tiles(int64_t m0, int64_t m1, int64_t v, F& f) {
  const int64_t rows = m1 - m0, tiles = (rows + MRMAX - 1) / MRMAX;
  for (int64_t t = 0, r = m0; t < tiles; ++t) {
    const int64_t R = rows / tiles + (t < rows % tiles ? 1 : 0);
    dispatch_rows<NV, MRMAX>(R, r, v, f);
    r += R;
  }
}

// Vectors vb..ve-1 in tiles of NV (the last ones one at a time) for rows m0..m1-1.
template <int NV, int MRMAX, typename F>
inline void vector_tiles(int64_t vb, int64_t ve, int64_t m0, int64_t m1, F& f) {
  int64_t v = vb;
  for (; v + NV <= ve; v += NV) row_tiles<NV, MRMAX>(m0, m1, v, f);
  for (; v < ve; ++v) row_tiles<1, MRMAX>(m0, m1, v, f);
}

// f(MR, NV, r, v) over every output tile of an M x G-group call, groups split over threads.
template <typename F>
void for_each_tile(int64_t M, int64_t G, int64_t K, F&& f) {
  if (M == 0 || G == 0) return;
  const int64_t block = row_block(K);
  at::parallel_for(0, G, 1, [&](int64_t gb, int64_t ge) {
    const int64_t vb = gb * kHalves, ve = ge * kHalves;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block), rows = m1 - m0;
      if (rows <= kTinyRows) vector_tiles<kTinyVecs, kTinyRows>(vb, ve, m0, m1, f);
      else if (rows <= kManyRows) vector_tiles<kFewVecs, kFewRows>(vb, ve, m0, m1, f);
      else vector_tiles<kManyVecs, kManyRowsTile>(vb, ve, m0, m1, f);
    }
  });
}

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

void check_packed(const torch::Tensor& t, c10::ScalarType dtype, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == numel, what,
              " does not match the packed layout (dtype, contiguity or size)");
}


// One row's activation quantization: x [K] float32 -> q [K] int8 in kernel order, d [S] float32,
// bsum [K / 32] int32 (each 32-value block's sum). The same instructions whichever op produced the
// row (quantize_rows, rms_norm_rows, silu_mul_rows), so a fused op's integers are quantize_rows's.
void quantize_row(const float* xp, int64_t K, int8_t* qp, float* dp, int32_t* bp) {
  alignas(32) int8_t q[kSuper];
  const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const int64_t S = (K + kSuper - 1) / kSuper;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper, len = std::min(kSuper, K - k0), nsub = len / 32;
    const float* xs = xp + k0;
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
    dp[s] = amax / 127.0f;
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
      bp[k0 / 32 + j] = t;
    }
    int8_t* dst = qp + k0;   // the kernel order: groups of four transposed
    for (int64_t t = 0; t < 8; ++t)
      for (int64_t j = 0; j < nsub; ++j) std::memcpy(dst + t * 4 * nsub + 4 * j, q + 32 * j + 4 * t, 4);
  }
}

// The rows an activation op writes: float32 [M, K], or the quantized triple of quantize_rows.
struct RowSink {
  bool quantize;
  int64_t K;
  torch::Tensor y, xq, dx, bsum;
  RowSink(const torch::Tensor& like, int64_t M, int64_t K_, bool q) : quantize(q), K(K_) {
    if (q) {
      TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32, got ", K);
      xq = at::empty({M, K}, like.options().dtype(torch::kInt8));
      dx = at::empty({M, (K + kSuper - 1) / kSuper}, like.options().dtype(torch::kFloat32));
      bsum = at::empty({M, K / 32}, like.options().dtype(torch::kInt32));
    } else {
      y = at::empty({M, K}, like.options().dtype(torch::kFloat32));
    }
  }
  // the row's buffer to fill: y's own row, or ``scratch`` that put() then quantizes
  float* row(int64_t m, float* scratch) { return quantize ? scratch : y.data_ptr<float>() + m * K; }
  void put(int64_t m, const float* r) {
    if (quantize)
      quantize_row(r, K, xq.data_ptr<int8_t>() + m * K, dx.data_ptr<float>() + m * dx.size(1),
                   bsum.data_ptr<int32_t>() + m * (K / 32));
  }
  std::vector<torch::Tensor> result() const {
    return quantize ? std::vector<torch::Tensor>{xq, dx, bsum} : std::vector<torch::Tensor>{y};
  }
};

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), what,
              " must be a contiguous float32 [M, K] tensor");
}


}  // namespace

// x [M, K] float32 -> (xq int8 [M, K] in kernel order, dx float32 [M, S], bsum int32 [M, K/32]:
// each 32-value block's sum).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  RowSink sink(x, M, K, true);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) sink.put(m, xp + m * K);
  });
  return sink.result();
}

// RMSNorm of each row (Zhang & Sennrich 2019), with the residual add before it:
//   h = hidden (+ delta);  y = h * (1 / sqrt(sum(h^2) / K + eps)) * weight
// Returns [h, y] (h is hidden itself without delta), or [h, xq, dx, bsum] with quantize: y in
// quantize_rows's form for the next linear. Each row is one thread's fixed instruction sequence
// (the sum of squares in 8 lanes in column order, then a fixed tree), so its bits never depend on
// the other rows.
std::vector<torch::Tensor> rms_norm_rows(torch::Tensor hidden, c10::optional<torch::Tensor> delta,
                                         torch::Tensor weight, double eps, bool quantize) {
  check_rows(hidden, "hidden");
  const int64_t M = hidden.size(0), K = hidden.size(1);
  TORCH_CHECK(K % 8 == 0, "hidden_size must be a multiple of 8, got ", K);
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == K,
              "weight must be a contiguous float32 [", K, "] tensor");
  const bool add = delta.has_value() && delta->defined();
  torch::Tensor h = hidden;
  if (add) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == hidden.sizes(), "delta must have hidden's shape");
    h = at::empty_like(hidden);
  }
  RowSink sink(hidden, M, K, quantize);
  const float* xp = hidden.data_ptr<float>();
  const float* dp = add ? delta->data_ptr<float>() : nullptr;
  float* hp = h.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps), inv_k = 1.0f / static_cast<float>(K);
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(K));
    for (int64_t m = b; m < end; ++m) {
      float* hr = hp + m * K;
      const float* xr = xp + m * K;
      __m256 ss = _mm256_setzero_ps();
      for (int64_t i = 0; i < K; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        if (add) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(dp + m * K + i));
          _mm256_storeu_ps(hr + i, v);
        }
        ss = _mm256_add_ps(ss, _mm256_mul_ps(v, v));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, ss);
      const float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
      const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(sum * inv_k + e));
      float* y = sink.row(m, scratch.data());
      for (int64_t i = 0; i < K; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(hr + i), r), _mm256_loadu_ps(wp + i)));
      sink.put(m, y);
    }
  });
  std::vector<torch::Tensor> out{h};
  for (auto& t : sink.result()) out.push_back(t);
  return out;
}

// SwiGLU's activation (Shazeer 2020): gate_up [M, 2I] float32 (gate columns, then up) ->
// silu(gate) * up = gate / (1 + exp(-gate)) * up, [M, I] float32, or its quantized form with
// quantize. Element-wise, one fixed instruction sequence per element.
std::vector<torch::Tensor> silu_mul_rows(torch::Tensor gate_up, bool quantize) {
  check_rows(gate_up, "gate_up");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I && I % 8 == 0, "gate_up must be [M, 2 I] with I a multiple of 8");
  RowSink sink(gate_up, M, I, quantize);
  const float* gp = gate_up.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(I));
    for (int64_t m = b; m < end; ++m) {
      const float* g = gp + m * 2 * I;
      float* y = sink.row(m, scratch.data());
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, specserve::exp8(_mm256_xor_ps(x, sign))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(g + I + i)));
      }
      sink.put(m, y);
    }
  });
  return sink.result();
}

// out[:, col0:col0+N] = the int4 weight (packed, N rows) applied to the quantized rows (+ bias).
void q4_matmul(torch::Tensor xq, torch::Tensor dx, torch::Tensor bsum, torch::Tensor wq, torch::Tensor sc,
               torch::Tensor mn, torch::Tensor d, torch::Tensor dmin, int64_t N, c10::optional<torch::Tensor> bias,
               torch::Tensor out, int64_t col0) {
  const int64_t M = xq.size(0), K = xq.size(1), S = (K + kSuper - 1) / kSuper, G = (N + kGroupRows - 1) / kGroupRows;
  TORCH_CHECK(K % 64 == 0 && xq.is_contiguous() && dx.is_contiguous() && bsum.is_contiguous() &&
              dx.numel() == M * S && bsum.numel() == M * (K / 32), "int4 activations do not match in_features ", K);
  check_packed(wq, torch::kUInt8, G * K * 8, "int4 wq");
  check_packed(sc, torch::kUInt8, G * (K / 32) * 16, "int4 sc");
  check_packed(mn, torch::kInt16, G * (K / 32) * 16, "int4 mn");
  check_packed(d, torch::kFloat32, G * S * 16, "int4 d");
  check_packed(dmin, torch::kFloat32, G * S * 16, "int4 dmin");
  check_out(out, M, col0, N);
  const torch::Tensor bs = bsum.to(torch::kInt16);   // exact: |sub-block sum| <= 32 * 127
  const Q4Args a{M, N, K, S, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), bs.data_ptr<int16_t>(), wq.data_ptr<uint8_t>(),
                 sc.data_ptr<uint8_t>(), mn.data_ptr<int16_t>(), d.data_ptr<float>(), dmin.data_ptr<float>(),
                 bias_ptr(bias, N), out.data_ptr<float>() + col0, out.stride(0)};
  for_each_tile(M, G, K, [&](auto R, auto NV, int64_t r, int64_t v) { q4_tile<decltype(R)::value, decltype(NV)::value>(a, r, v); });
}

// out[:, col0:col0+N] = the int8 weight (packed, N rows) applied to the quantized rows (+ bias).
void q8_matmul(torch::Tensor xq, torch::Tensor dx, torch::Tensor wq, torch::Tensor sc, torch::Tensor corr,
               torch::Tensor d, int64_t N, c10::optional<torch::Tensor> bias, torch::Tensor out, int64_t col0) {
  const int64_t M = xq.size(0), K = xq.size(1), S = (K + kSuper - 1) / kSuper, G = (N + kGroupRows - 1) / kGroupRows;
  TORCH_CHECK(K % 32 == 0 && xq.is_contiguous() && dx.is_contiguous() && dx.numel() == M * S,
              "int8 activations do not match in_features ", K);
  check_packed(wq, torch::kInt8, G * K * 16, "int8 wq");
  check_packed(sc, torch::kInt8, G * (K / 16) * 16, "int8 sc");
  check_packed(corr, torch::kInt32, G * S * 16, "int8 corr");
  check_packed(d, torch::kFloat32, G * S * 16, "int8 d");
  check_out(out, M, col0, N);
  torch::Tensor xu;   // VNNI: the activations + 128, as unsigned bytes
#if KERNEL_VNNI
  xu = at::empty({M, K}, xq.options().dtype(torch::kUInt8));
  {
    const int8_t* src = xq.data_ptr<int8_t>();
    uint8_t* dst = xu.data_ptr<uint8_t>();
    const int64_t n = M * K;
    for (int64_t i = 0; i < n; i += 32)   // K % 32 == 0
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), _mm256_set1_epi8(static_cast<char>(0x80))));
  }
#endif
  const Q8Args a{M, N, K, S, xq.data_ptr<int8_t>(), xu.defined() ? xu.data_ptr<uint8_t>() : nullptr, dx.data_ptr<float>(),
                 wq.data_ptr<int8_t>(), sc.data_ptr<int8_t>(), corr.data_ptr<int32_t>(), d.data_ptr<float>(),
                 bias_ptr(bias, N), out.data_ptr<float>() + col0, out.stride(0)};
  for_each_tile(M, G, K, [&](auto R, auto NV, int64_t r, int64_t v) { q8_tile<decltype(R)::value, decltype(NV)::value>(a, r, v); });
}


// out[:, col0:col0+N] = the 6-bit weight (packed, N rows) applied to the quantized rows (+ bias).
void q6_matmul(torch::Tensor xq, torch::Tensor dx, torch::Tensor wq, torch::Tensor sc, torch::Tensor sc2,
               torch::Tensor d, int64_t N, c10::optional<torch::Tensor> bias, torch::Tensor out, int64_t col0) {
  const int64_t M = xq.size(0), K = xq.size(1), S = (K + kSuper - 1) / kSuper, G = (N + kGroupRows - 1) / kGroupRows;
  TORCH_CHECK(K % 32 == 0 && xq.is_contiguous() && dx.is_contiguous() && dx.numel() == M * S,
              "int6 activations do not match in_features ", K);
  check_packed(wq, torch::kUInt8, G * K * 12, "int6 wq");
  check_packed(sc, torch::kInt8, G * (K / 16) * 16, "int6 sc");
  check_packed(sc2, torch::kInt16, G * (K / 16) * 16, "int6 sc2");
  check_packed(d, torch::kFloat32, G * S * 16, "int6 d");
  check_out(out, M, col0, N);
  // each 16-value sub-block's activation sum (exact: |.| <= 16 * 127), from the kernel order
  torch::Tensor bs = at::empty({M, K / 16}, xq.options().dtype(torch::kInt16));
  {
    const int8_t* x = xq.data_ptr<int8_t>();
    int16_t* o = bs.data_ptr<int16_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t s = 0; s < S; ++s) {
        const int64_t k0 = s * kSuper, B = std::min(kSuper, K - k0) / 32, W = 4 * B;
        for (int64_t jj = 0; jj < 2 * B; ++jj) {
          int32_t t = 0;
          for (int64_t q = 4 * (jj % 2); q < 4 * (jj % 2) + 4; ++q)
            for (int64_t i = 0; i < 4; ++i) t += x[m * K + k0 + q * W + 4 * (jj / 2) + i];
          o[m * (K / 16) + k0 / 16 + jj] = static_cast<int16_t>(t);
        }
      }
  }
  const Q6Args a{M, N, K, S, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), bs.data_ptr<int16_t>(), wq.data_ptr<uint8_t>(),
                 sc.data_ptr<int8_t>(), sc2.data_ptr<int16_t>(), d.data_ptr<float>(), bias_ptr(bias, N),
                 out.data_ptr<float>() + col0, out.stride(0)};
  for_each_tile(M, G, K, [&](auto R, auto NV, int64_t r, int64_t v) { q6_tile<decltype(R)::value, decltype(NV)::value>(a, r, v); });
}

// The machine's own int8 dot-product peak: `iterations` rounds of ten independent vpdpbusd chains
// (the build's vector width; AVX2: vpmaddubsw + vpmaddwd + vpaddd per 4-way product) on every
// thread. Returns the multiply-adds done (the caller times the call).
int64_t int8_dot_peak(int64_t iterations) {
  std::atomic<int64_t> macs{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      Vec::I acc[10];
      for (int i = 0; i < 10; ++i) acc[i] = Vec::bcast(&i);
      const Vec::I u = Vec::bcast(&iterations), s = Vec::bcast(&t);
      for (int64_t it = 0; it < iterations; ++it) {
        for (int i = 0; i < 10; ++i) {
#if KERNEL_VNNI
          acc[i] = Vec::q8_dot(acc[i], u, s);
#else
          acc[i] = Vec::add(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
        }
        asm volatile("" : : : "memory");
      }
      alignas(64) int32_t sink[Vec::L];
      Vec::I total = acc[0];
      for (int i = 1; i < 10; ++i) total = Vec::add(total, acc[i]);
      std::memcpy(sink, &total, sizeof(sink));
      macs += iterations * 10 * Vec::L * 4 + (sink[0] == 12345 ? 1 : 0);
    }
  });
  return macs.load();
}

// Streaming read of `t`'s bytes on every thread (vector loads, summed so they cannot be skipped);
// the caller times it for the memory's read bandwidth.
int64_t stream_read(torch::Tensor t) {
  TORCH_CHECK(t.is_contiguous(), "stream_read needs a contiguous tensor");
  const uint8_t* p = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t n = t.numel() * t.element_size() / 256;
  std::atomic<int64_t> sum{0};
  at::parallel_for(0, n, 1024, [&](int64_t b, int64_t e) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = b; i < e; ++i) {
      const __m256i* q = reinterpret_cast<const __m256i*>(p + i * 256);
      a0 = _mm256_add_epi64(a0, _mm256_sad_epu8(_mm256_loadu_si256(q), _mm256_setzero_si256()));
      a1 = _mm256_add_epi64(a1, _mm256_sad_epu8(_mm256_loadu_si256(q + 2), _mm256_setzero_si256()));
      a2 = _mm256_add_epi64(a2, _mm256_sad_epu8(_mm256_loadu_si256(q + 4), _mm256_setzero_si256()));
      a3 = _mm256_add_epi64(a3, _mm256_sad_epu8(_mm256_loadu_si256(q + 6), _mm256_setzero_si256()));
      a0 = _mm256_add_epi64(a0, _mm256_sad_epu8(_mm256_loadu_si256(q + 1), _mm256_setzero_si256()));
      a1 = _mm256_add_epi64(a1, _mm256_sad_epu8(_mm256_loadu_si256(q + 3), _mm256_setzero_si256()));
      a2 = _mm256_add_epi64(a2, _mm256_sad_epu8(_mm256_loadu_si256(q + 5), _mm256_setzero_si256()));
      a3 = _mm256_add_epi64(a3, _mm256_sad_epu8(_mm256_loadu_si256(q + 7), _mm256_setzero_si256()));
    }
    alignas(32) int64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    sum += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  });
  return sum.load();
}

// The build's vector width and tile shapes, for reports: {lanes, few-row tile (rows, vectors),
// many-row tile (rows, vectors), rows from which the many-row tile is used}.
std::vector<int64_t> tile_shapes() {
  return {Vec::L, kFewRows, kFewVecs, kManyRowsTile, kManyVecs, kManyRows + 1};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "per-row, per-256 int8 activation quantization");
  m.def("rms_norm_rows", &rms_norm_rows, "residual add and RMSNorm per row, float or quantized for the next linear");
  m.def("silu_mul_rows", &silu_mul_rows, "silu(gate) * up per row, float or quantized for the next linear");
  m.def("q4_matmul", &q4_matmul, "int4 (k-quant, packed) weight x int8 activation matmul");
  m.def("q8_matmul", &q8_matmul, "int8 (k-quant, packed) weight x int8 activation matmul");
  m.def("q6_matmul", &q6_matmul, "6-bit (Q6_K, packed) weight x int8 activation matmul");
  m.def("int8_dot_peak", &int8_dot_peak, "multiply-adds of a tight int8 dot-product loop on every thread");
  m.def("stream_read", &stream_read, "read a tensor on every thread (bandwidth probe)");
  m.def("tile_shapes", &tile_shapes, "vector lanes, the few- and many-row tiles (rows, vectors) and the many-row threshold");
}
