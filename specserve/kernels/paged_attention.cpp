// Batch-invariant paged attention for x86 CPUs with AVX2 (specserve.attention.cpu_backend).
//
// out[t, h] = sum_j softmax_j(scale * q[t, h] . K[j, g]) V[j, g], g = h / (H / Hkv), over the keys j
// that query row t may see, read from the paged caches through their flat slots:
//   * the first prefix[t] keys of the row's sequence, in position order (causal rows: the context
//     and the new tokens up to and including the row itself), then
//   * of the next block_len[t] keys (a draft block: tree verification, or a draft head growing a
//     tree level by level), those whose mask[t, j] is set.
//
// Why our own kernel: the PyTorch backend calls scaled_dot_product_attention once per row and layer
// (a fused batched call rounds a row differently with the number and padding of the rows next to
// it), which costs tens of microseconds per call in the host alone. Here one call serves a layer:
// every (row, kv head) pair is one task run by one thread with the same instruction sequence
// whatever the batch holds (the scores of its keys in position order, their maximum, exp, the sum
// and the weighted values accumulated in position order), so a row's bits depend on its own query
// and visible keys only: a decode, a (k+1)-row verify, a tree node and a prefill row over the same
// keys give the same result. Within a task the work is blocked for speed, never reordered: scores of
// 2 heads x 4 keys at once (8 independent dot-product chains hide the fma latency) and weighted
// values of 2 heads x 32 lanes held in registers over all keys, each score and output lane with the
// operations it gets alone. Tasks run kv-head-major, in chunks of equal work (a prefill's rows grow
// longer). Compiled with -ffp-contract=off; every fused multiply-add is explicit.
// torch/python.h (pybind11 and the tensor casters) and the few ATen headers used, not
// torch/extension.h: the whole of torch's C++ API takes ~10 s more to compile per build.
#include <torch/python.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>
#include <cmath>

#include "vec_math.h"
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// 8 cache values as float32: float32 as is, float16 by F16C's exact widening, bfloat16 by a shift
// (exact too). A 16-bit cache halves the bytes a step reads; every path widens the same way.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// 8 float32 values into the cache's type, rounded to nearest even as torch's .to(dtype) does.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(at::BFloat16* p, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) p[i] = c10::BFloat16(f[i]);   // c10's round-to-nearest-even (NaN kept)
}

// Keys and values are read row by row through the slots, scattered over pages: from memory each
// row costs a full latency unless it is requested ahead. kAhead rows ahead covers the latency at
// the loops' pace (a 1,000-token context in 28 layers' float16 caches, more than the last-level cache
// holds: 115 -> 55 us a layer; 4 ahead 68 us, 16 ahead 62 us).
constexpr int64_t kAhead = 8;

template <typename C>
inline void prefetch_row(const C* p, int64_t n) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(C)); off += 64) _mm_prefetch(b + off, _MM_HINT_T0);
}

inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 0x1));
  return _mm_cvtss_f32(lo);
}

inline float hmax8(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 0x1));
  return _mm_cvtss_f32(lo);
}

// exp(x) for x <= 0, 8 lanes (vec_math.h's exp8); lanes below -87 (exp < 2^-125) give 0: their
// weight is far below a float's resolution of 1, the largest weight.
inline __m256 exp_nonpositive(__m256 x) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), specserve::exp8(x));
}

// Scores of NI query heads x NJ keys, each pair's dot product one chain: the product of the first
// 8 lanes, fmas over the rest in lane-block order, hsum8, times scale. The block's chains
// interleave (which hides the fma latency), and each still gets the operations it gets alone.
template <int NI, int NJ, typename C>
inline void score_block(const float* qi, int64_t D, const C* const* kj, float scale, float* si, int64_t L) {
  __m256 acc[NI][NJ];
  for (int i = 0; i < NI; ++i)
    for (int j = 0; j < NJ; ++j) acc[i][j] = _mm256_mul_ps(_mm256_loadu_ps(qi + i * D), load8(kj[j]));
  for (int64_t x = 8; x < D; x += 8) {
    __m256 qv[NI];
    for (int i = 0; i < NI; ++i) qv[i] = _mm256_loadu_ps(qi + i * D + x);
    for (int j = 0; j < NJ; ++j) {
      const __m256 kv = load8(kj[j] + x);
      for (int i = 0; i < NI; ++i) acc[i][j] = _mm256_fmadd_ps(qv[i], kv, acc[i][j]);
    }
  }
  for (int i = 0; i < NI; ++i)
    for (int j = 0; j < NJ; ++j) si[i * L + j] = hsum8(acc[i][j]) * scale;
}

// out lanes x..x + 8 NV - 1 of NI query heads: sum over the keys in position order of weight
// times value row, fmas from zero (one chain per output lane, as the lanes' own order), then
// times the head's 1 / sum; the accumulators stay in registers over all keys.
template <int NI, int NV, typename C>
inline void value_block(const float* si, int64_t L, const C* vg, int64_t ld, const int64_t* slots, int64_t x,
                        const float* inv, float* oi, int64_t D) {
  __m256 acc[NI][NV];
  for (int i = 0; i < NI; ++i)
    for (int u = 0; u < NV; ++u) acc[i][u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const C* vj = vg + slots[j] * ld + x;
    if (j + kAhead < L) prefetch_row(vg + slots[j + kAhead] * ld + x, 8 * NV);
    __m256 vv[NV];
    for (int u = 0; u < NV; ++u) vv[u] = load8(vj + 8 * u);
    for (int i = 0; i < NI; ++i) {
      const __m256 w = _mm256_broadcast_ss(si + i * L + j);
      for (int u = 0; u < NV; ++u) acc[i][u] = _mm256_fmadd_ps(w, vv[u], acc[i][u]);
    }
  }
  for (int i = 0; i < NI; ++i)
    for (int u = 0; u < NV; ++u)
      _mm256_storeu_ps(oi + i * D + x + 8 * u, _mm256_mul_ps(acc[i][u], _mm256_set1_ps(inv[i])));
}

// One task: query heads g G .. g G + G - 1 of row t (they share kv head g) over the row's visible
// keys. Every (head, key) score and every output lane gets its own operations in key order,
// whatever the blocking: scores in blocks of 2 heads x 4 keys, weighted values in blocks of 2 heads
// x 32 lanes kept in registers over all keys. s: scratch of G * L floats; slots: of L int64.
template <typename C>
void attend(int64_t t, int64_t g, int64_t G, int64_t D, int64_t H, int64_t Hkv, float scale, const float* q,
            const C* kc, const C* vc, const int64_t* seq_slots, int64_t prefix, int64_t block_len,
            const uint8_t* mask, float* out, float* s, int64_t* slots) {
  int64_t L = 0;
  for (int64_t j = 0; j < prefix; ++j) slots[L++] = seq_slots[j];
  for (int64_t j = 0; j < block_len; ++j)
    if (mask[j]) slots[L++] = seq_slots[prefix + j];
  const float* qg = q + (t * H + g * G) * D;   // the G query heads, contiguous
  const int64_t ld = Hkv * D;                  // floats from one slot's rows to the next's
  const C* kg = kc + g * D;
  const C* vg = vc + g * D;
  auto scores = [&](auto NJ, int64_t j) {
    const C* kj[NJ];
    for (int u = 0; u < NJ; ++u) kj[u] = kg + slots[j + u] * ld;
    for (int u = 0; u < NJ && j + u + kAhead < L; ++u) prefetch_row(kg + slots[j + u + kAhead] * ld, D);
    int64_t i = 0;
    for (; i + 2 <= G; i += 2) score_block<2, NJ>(qg + i * D, D, kj, scale, s + i * L + j, L);
    if (i < G) score_block<1, NJ>(qg + i * D, D, kj, scale, s + i * L + j, L);
  };
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) scores(std::integral_constant<int, 4>{}, j);
  for (; j < L; ++j) scores(std::integral_constant<int, 1>{}, j);
  alignas(32) float inv[64];
  for (int64_t i = 0; i < G; ++i) {
    // maximum (exact whatever the order), then the weights and their sum lane by lane: lane l sums
    // the keys j = l mod 8 in position order, then the lanes are added in a fixed tree
    float* si = s + i * L;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(si + j));
    float m = hmax8(mv);
    for (int64_t r = j; r < L; ++r) m = std::max(m, si[r]);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 lsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= L; j += 8) {
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(si + j), mb));
      _mm256_storeu_ps(si + j, p);
      lsum = _mm256_add_ps(lsum, p);
    }
    if (j < L) {   // the last keys in a padded vector: the padding adds exact zeros
      alignas(32) float tmp[8];
      for (int64_t r = 0; r < 8; ++r) tmp[r] = j + r < L ? si[j + r] - m : -INFINITY;
      const __m256 p = exp_nonpositive(_mm256_load_ps(tmp));
      _mm256_store_ps(tmp, p);
      for (int64_t r = j; r < L; ++r) si[r] = tmp[r - j];
      lsum = _mm256_add_ps(lsum, p);
    }
    inv[i] = 1.0f / hsum8(lsum);
  }
  float* og = out + (t * H + g * G) * D;
  auto values = [&](auto NI, int64_t i) {
    int64_t x = 0;
    for (; x + 32 <= D; x += 32) value_block<NI, 4>(s + i * L, L, vg, ld, slots, x, inv + i, og + i * D, D);
    for (; x < D; x += 8) value_block<NI, 1>(s + i * L, L, vg, ld, slots, x, inv + i, og + i * D, D);
  };
  int64_t i = 0;
  for (; i + 2 <= G; i += 2) values(std::integral_constant<int, 2>{}, i);
  if (i < G) values(std::integral_constant<int, 1>{}, i);
}

}  // namespace

namespace {

void check_caches(const torch::Tensor& key_cache, const torch::Tensor& value_cache) {
  const auto dt = key_cache.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kFloat16 || dt == torch::kBFloat16) &&
              value_cache.scalar_type() == dt && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_cache.dim() == 3 && key_cache.sizes() == value_cache.sizes(),
              "caches must be contiguous float32 / float16 / bfloat16 [slots, Hkv, D] tensors of one dtype");
}

// The cache's element type as C for f(C{}).
template <typename F>
void with_cache_type(const torch::Tensor& cache, F&& f) {
  switch (cache.scalar_type()) {
    case torch::kFloat16: f(at::Half{}); break;
    case torch::kBFloat16: f(at::BFloat16{}); break;
    default: f(float{}); break;
  }
}

}  // namespace

// query [T, H, D] float32; key_cache, value_cache [num_slots, Hkv, D] float32, float16 or bfloat16
// (flat pages); seq_slots int64: every sequence's slots in position order, concatenated;
// row_slot_start [T] int64: where row t's sequence starts in seq_slots; prefix, block_len [T] int64;
// mask [T, W] uint8 (W >= max block_len; W = 0 without trees). Returns [T, H, D] float32.
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor seq_slots, torch::Tensor row_slot_start, torch::Tensor prefix,
                              torch::Tensor block_len, torch::Tensor mask, double scale) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && query.dim() == 3 && query.is_contiguous(),
              "query must be a contiguous float32 [T, H, D] tensor");
  check_caches(key_cache, value_cache);
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), Hkv = key_cache.size(1);
  TORCH_CHECK(key_cache.size(2) == D && D % 8 == 0, "head_dim must match the cache and be a multiple of 8, got ", D);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && H / Hkv <= 64, "num_heads ", H, " must be a multiple of num_kv_heads ", Hkv,
              " (at most 64 query heads per kv head)");
  for (const auto* x : {&seq_slots, &row_slot_start, &prefix, &block_len})
    TORCH_CHECK(x->dtype() == torch::kInt64 && x->is_contiguous(), "index tensors must be contiguous int64");
  TORCH_CHECK(row_slot_start.numel() == T && prefix.numel() == T && block_len.numel() == T, "one index per row");
  TORCH_CHECK(mask.dtype() == torch::kUInt8 && mask.dim() == 2 && mask.is_contiguous() && mask.size(0) == T,
              "mask must be a contiguous uint8 [T, W] tensor");
  const int64_t W = mask.size(1);
  const int64_t* ss = seq_slots.data_ptr<int64_t>();
  const int64_t* rs = row_slot_start.data_ptr<int64_t>();
  const int64_t* pf = prefix.data_ptr<int64_t>();
  const int64_t* bl = block_len.data_ptr<int64_t>();
  const uint8_t* mk = mask.data_ptr<uint8_t>();
  int64_t max_len = 0;
  const int64_t num_slots = key_cache.size(0), total = seq_slots.numel();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pf[t] >= 0 && bl[t] >= 0 && bl[t] <= W && rs[t] >= 0 && rs[t] + pf[t] + bl[t] <= total,
                "row ", t, " reads past its sequence's slots");
    max_len = std::max(max_len, pf[t] + bl[t]);
  }
  for (int64_t i = 0; i < total; ++i) TORCH_CHECK(ss[i] >= 0 && ss[i] < num_slots, "slot ", ss[i], " out of range");
  auto out = at::empty_like(query);
  if (T == 0) return out;
  const int64_t G = H / Hkv;
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Tasks (kv head g, row t), g-major (a thread's tasks share one head's keys and values), cut in
  // chunks of about equal work (a row's prefix and draft block, a bound on its visible keys): a
  // prefill's long last rows would otherwise all fall to one thread, since at::parallel_for splits
  // its range statically; 8 chunks per thread even out what the estimate misses. A task's result
  // does not depend on its chunk or thread.
  const int64_t tasks = T * Hkv;
  const int64_t nchunks = std::min<int64_t>(tasks, 8 * at::get_num_threads());
  std::vector<int64_t> bounds{0};
  {
    int64_t row_work = 0;
    for (int64_t t = 0; t < T; ++t) row_work += pf[t] + bl[t] + 16;   // 16: a task's fixed cost in keys
    const double per_chunk = static_cast<double>(row_work * Hkv) / static_cast<double>(nchunks);
    int64_t done = 0;
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t t = task % T;
      done += pf[t] + bl[t] + 16;
      if (done >= per_chunk * static_cast<double>(bounds.size()) && task + 1 < tasks) bounds.push_back(task + 1);
    }
    bounds.push_back(tasks);
  }
  with_cache_type(key_cache, [&](auto tag) {
    using C = decltype(tag);
    const C* kp = static_cast<const C*>(key_cache.data_ptr());
    const C* vp = static_cast<const C*>(value_cache.data_ptr());
    at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> s(static_cast<size_t>(G * std::max<int64_t>(max_len, 1)));
      std::vector<int64_t> slots(static_cast<size_t>(std::max<int64_t>(max_len, 1)));
      for (int64_t task = bounds[c0]; task < bounds[c1]; ++task) {
        const int64_t g = task / T, t = task % T;
        attend(t, g, G, D, H, Hkv, sc, qp, kp, vp, ss + rs[t], pf[t], bl[t], mk + t * W, op, s.data(), slots.data());
      }
    });
  });
  return out;
}

// Rotary embedding (Su et al. 2021, RoFormer; the rotate-half layout of Hugging Face's Llama / Qwen2)
// and the KV write of one layer, from the fused projection's output:
//   qkv [T, (H + 2 Hkv) D] float32 (q heads, k heads, v heads per row), cos / sin [P, D] float32
//   tables, positions [T] int64, slot_mapping [T] int64, key_cache / value_cache [num_slots, Hkv, D].
// Rotated keys and the values go to their slots (rounded to the cache's type); returns the rotated
// queries [T, H, D] float32. Lane i < D/2 is x_i cos_i - x_{i+D/2} sin_i, lane i >= D/2 is
// x_i cos_i + x_{i-D/2} sin_i: each one product, one product and one add or subtract, the operations
// of the PyTorch reference (q * cos + rotate_half(q) * sin), so the same bits.
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                            torch::Tensor slot_mapping, torch::Tensor key_cache, torch::Tensor value_cache,
                            int64_t num_heads) {
  check_caches(key_cache, value_cache);
  const int64_t T = qkv.size(0), Hkv = key_cache.size(1), D = key_cache.size(2), H = num_heads;
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * Hkv) * D,
              "qkv must be a float32 [T, (H + 2 Hkv) D] tensor with unit column stride");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16 for the fused rotary embedding, got ", D);
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && cos.sizes() == sin.sizes(),
              "cos / sin must be contiguous float32 [P, head_dim] tables");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && slot_mapping.dtype() == torch::kInt64 && positions.is_contiguous() &&
              slot_mapping.is_contiguous() && positions.numel() == T && slot_mapping.numel() == T,
              "positions and slot_mapping must be contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is past the rotary table (", cos.size(0), ")");
    TORCH_CHECK(sm[t] >= 0 && sm[t] < key_cache.size(0), "slot ", sm[t], " out of range");
  }
  auto q = at::empty({T, H, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const int64_t ldx = qkv.stride(0), half = D / 2;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  with_cache_type(key_cache, [&](auto tag) {
    using C = decltype(tag);
    C* kp = static_cast<C*>(key_cache.data_ptr());
    C* vp = static_cast<C*>(value_cache.data_ptr());
    at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* x = xp + t * ldx;
        const float* c = cp + pos[t] * D;
        const float* s = sp + pos[t] * D;
        auto rotate = [&](const float* head, auto put) {
          for (int64_t i = 0; i < half; i += 8) {
            const __m256 x1 = _mm256_loadu_ps(head + i), x2 = _mm256_loadu_ps(head + half + i);
            put(i, _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)), _mm256_mul_ps(x2, _mm256_loadu_ps(s + i))));
            put(half + i, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                        _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i))));
          }
        };
        for (int64_t h = 0; h < H; ++h) {
          float* out = qp + (t * H + h) * D;
          rotate(x + h * D, [&](int64_t i, __m256 v) { _mm256_storeu_ps(out + i, v); });
        }
        for (int64_t h = 0; h < Hkv; ++h) {
          C* kout = kp + (sm[t] * Hkv + h) * D;
          C* vout = vp + (sm[t] * Hkv + h) * D;
          rotate(x + (H + h) * D, [&](int64_t i, __m256 v) { store8(kout + i, v); });
          const float* v = x + (H + Hkv + h) * D;
          for (int64_t i = 0; i < D; i += 8) store8(vout + i, _mm256_loadu_ps(v + i));
        }
      }
    });
  });
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention (one task per row and kv head)");
  m.def("rope_write_kv", &rope_write_kv, "rotary embedding of q and k, k and v written to their cache slots");
}
