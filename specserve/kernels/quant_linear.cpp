// Batch-invariant int8 / int4 linear kernels for x86 CPUs with AVX2 (specserve.kernels).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with
//   * weights in k-quant layouts (superblocks of 256 along k, the last one may be shorter):
//       int4: w = d[n,s] * sc[n,j] * q - dmin[n,s] * mn[n,j], q in 0..15, j = k / 32
//             (llama.cpp's Q4_K, with 8-bit instead of 6-bit sub-block scales and mins)
//       int8: w = d[n,s] * sc[n,j] * q, q in -127..127, sc int8, j = k / 16   (Q6_K generalised)
//   * activations quantized per row and per superblock to int8 (d_x = amax / 127, llama.cpp's Q8_K).
//
// Integer products are summed exactly in int32 within a superblock, then each superblock adds
// one float term in a fixed order. Every output element is computed by one thread with the same
// instruction sequence whatever the number of rows M, the row's place in the batch or the thread
// count, so a row's result is bitwise independent of what it is multiplied with (speculative
// verify of k+1 rows == k+1 single-row decodes). Compiled with -ffp-contract=off so the compiler
// cannot fuse the scalar float operations differently in different loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kSuper = 256;   // superblock length along k
constexpr int64_t kRowBlock = 64; // rows processed per pass over a thread's weight rows

// acc + the pairwise int16 products of p and s, in int32 (vpmaddwd + vpaddd). An AVX-512 VNNI
// build with vpdpwssd fusing the two measured no faster on Zen 4: the multiplies are the limit.
inline __m256i madd_acc(__m256i acc, __m256i p, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
}

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

// One int4 output element block: rows r0..r0+R-1 of the activations against weight row n.
template <int R>
inline void q4_rows(int64_t n, int64_t r0, int64_t K, int64_t S, const int8_t* xq, const float* dx,
                    const int32_t* bsum, const uint8_t* qs, const uint8_t* sc, const uint8_t* mn,
                    const float* d, const float* dmin, const float* bias, float* out, int64_t ldo) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R], macc[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); macc[r] = _mm256_setzero_ps(); }
  const uint8_t* wq = qs + n * (K / 2);
  const uint8_t* wsc = sc + n * (K / 32);
  const uint8_t* wmn = mn + n * (K / 32);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper;
    const int64_t len = std::min(kSuper, K - k0);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < len / 64; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (k0 + c * 64) / 2));
      const __m256i lo = _mm256_and_si256(v, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      const int64_t j = (k0 + c * 64) / 32;
      const __m256i slo = _mm256_set1_epi16(static_cast<int16_t>(wsc[j]));
      const __m256i shi = _mm256_set1_epi16(static_cast<int16_t>(wsc[j + 1]));
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + (r0 + r) * K + k0 + c * 64;
        const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
        const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
        isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(lo, xlo), slo);
        isum[r] = madd_acc(isum[r], _mm256_maddubs_epi16(hi, xhi), shi);
      }
    }
    // Sub-block mins times the rows' sub-block sums: 8 int32 lanes, one per sub-block (a short
    // last superblock reads only its own sub-blocks).
    const int64_t j0 = k0 / 32, nsub = len / 32;
    __m256i mv;
    if (nsub == 8) {
      mv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wmn + j0)));
    } else {
      alignas(32) int32_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t j = 0; j < nsub; ++j) tmp[j] = wmn[j0 + j];
      mv = _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
    }
    const float dw = d[n * S + s], dm = dmin[n * S + s];
    for (int r = 0; r < R; ++r) {
      const float ds = dx[(r0 + r) * S + s];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(dw * ds), acc[r]);
      const int32_t* br = bsum + (r0 + r) * (K / 32) + j0;
      __m256i bv;
      if (nsub == 8) {
        bv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(br));
      } else {
        alignas(32) int32_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t j = 0; j < nsub; ++j) tmp[j] = br[j];
        bv = _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
      }
      macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mv, bv)), _mm256_set1_ps(dm * ds), macc[r]);
    }
  }
  const float b = bias ? bias[n] : 0.0f;
  for (int r = 0; r < R; ++r) out[(r0 + r) * ldo + n] = (hsum8(acc[r]) - hsum8(macc[r])) + b;
}

template <int R>
inline void q8_rows(int64_t n, int64_t r0, int64_t K, int64_t S, const int8_t* xq, const float* dx,
                    const int8_t* qs, const int8_t* sc, const float* d, const float* bias, float* out,
                    int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* wq = qs + n * K;
  const int8_t* wsc = sc + n * (K / 16);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t k0 = s * kSuper;
    const int64_t len = std::min(kSuper, K - k0);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < len / 32; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + k0 + c * 32));
      const __m256i aw = _mm256_sign_epi8(w, w);  // |w|: maddubs needs one unsigned operand
      const int64_t j = (k0 + c * 32) / 16;
      const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(wsc[j + 1])),
                                           _mm_set1_epi16(static_cast<int16_t>(wsc[j])));
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xq + (r0 + r) * K + k0 + c * 32));
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
        isum[r] = madd_acc(isum[r], p, scv);
      }
    }
    const float dw = d[n * S + s];
    for (int r = 0; r < R; ++r) {
      const float ds = dx[(r0 + r) * S + s];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(dw * ds), acc[r]);
    }
  }
  const float b = bias ? bias[n] : 0.0f;
  for (int r = 0; r < R; ++r) out[(r0 + r) * ldo + n] = hsum8(acc[r]) + b;
}

// Rows m0..m1-1 in groups of 4 (the remainder runs the same per-row arithmetic with R < 4).
template <typename F>
inline void for_row_groups(int64_t m0, int64_t m1, F&& f) {
  int64_t r = m0;
  for (; r + 4 <= m1; r += 4) f(std::integral_constant<int, 4>{}, r);
  switch (m1 - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// f(R, n, r) for every weight row n (split over threads) and group of R rows starting at r; rows
// in passes of kRowBlock so a thread's weight rows are re-read from cache, not memory.
template <typename F>
void for_each_output(int64_t M, int64_t N, F&& f) {
  if (M == 0 || N == 0) return;
  at::parallel_for(0, N, 16, [&](int64_t nb, int64_t ne) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t n = nb; n < ne; ++n) for_row_groups(m0, m1, [&](auto R, int64_t r) { f(R, n, r); });
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

}  // namespace

// x [M, K] float32 -> (xq int8 [M, K], dx float32 [M, S], bsum int32 [M, K/32]).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32, got ", K);
  const int64_t S = (K + kSuper - 1) / kSuper;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({M, S}, x.options());
  auto bsum = torch::empty({M, K / 32}, x.options().dtype(torch::kInt32));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  int32_t* bp = bsum.data_ptr<int32_t>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      for (int64_t s = 0; s < S; ++s) {
        const int64_t k0 = s * kSuper, len = std::min(kSuper, K - k0);
        const float* xs = xp + m * K + k0;
        float amax = 0.0f;
        for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(xs[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        dp[m * S + s] = amax / 127.0f;
        for (int64_t i = 0; i < len; ++i) {
          float q = std::nearbyint(xs[i] * inv);
          q = std::min(127.0f, std::max(-127.0f, q));
          qp[m * K + k0 + i] = static_cast<int8_t>(q);
        }
      }
      for (int64_t j = 0; j < K / 32; ++j) {
        int32_t t = 0;
        for (int i = 0; i < 32; ++i) t += qp[m * K + j * 32 + i];
        bp[m * (K / 32) + j] = t;
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
  const int32_t* bsp = bsum.data_ptr<int32_t>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const uint8_t* scp = sc.data_ptr<uint8_t>();
  const uint8_t* mnp = mn.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* dmp = dmin.data_ptr<float>();
  float* op = out.data_ptr<float>() + col0;
  const int64_t ldo = out.stride(0);
  for_each_output(M, N, [&](auto R, int64_t n, int64_t r) {
    q4_rows<decltype(R)::value>(n, r, K, S, xp, dxp, bsp, qp, scp, mnp, dp, dmp, bp, op, ldo);
  });
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
  for_each_output(M, N, [&](auto R, int64_t n, int64_t r) {
    q8_rows<decltype(R)::value>(n, r, K, S, xp, dxp, qp, scp, dp, bp, op, ldo);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "per-row, per-256 int8 activation quantization");
  m.def("q4_matmul", &q4_matmul, "int4 (k-quant) weight x int8 activation matmul");
  m.def("q8_matmul", &q8_matmul, "int8 (k-quant) weight x int8 activation matmul");
}
