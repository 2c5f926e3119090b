// CPU (AVX2/FMA/F16C) ops for the decode step between the GEMMs: paged decode attention reading the KV pool
// directly (fp32/bf16/fp16 pages, or fp8 e4m3 pages dequantized in registers with their per-token scales),
// rotary embedding + KV store in one pass over the fused qkv rows, residual add + RMSNorm, SiLU * up.
// Threads: at::parallel_for over (sequence, kv head) / rows, serial when the work is small (a parallel region
// on a loaded 2-core box costs more than a short attention).
//
// Layouts (the contract with kernels/cpu/attn.py and kernels/cpu/attn_reference.py):
//   q            [B, H, D] fp32, D contiguous, D % 8 == 0
//   k/v cache    [P, S, KVH, D] contiguous, fp32 | bf16 | fp16 | fp8 e4m3fn (fp8: k/v scale [P, S, KVH] bf16|fp32)
//   block_tables [B, W] int32, context_lens [B] int32
//   qkv          [T, (H + 2 KVH) * D] fp32 rows (q heads, k heads, v heads), D even
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t SMALL_WORK = 1 << 18;   // flops below which an op runs on the calling thread

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 floats, Cephes' polynomial (relative error ~2 ulp); x <= -88 gives 0
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, half));
  x = _mm256_fnmadd_ps(fx, c1, x);
  x = _mm256_fnmadd_ps(fx, c2, x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, half);
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float exp1(float x) {
  alignas(32) float b[8];
  _mm256_store_ps(b, exp8(_mm256_set1_ps(x)));
  return b[0];
}

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x;
      if (e == 15 && m == 7) x = NAN;
      else if (e == 0) x = std::ldexp(static_cast<float>(m), -9);
      else x = std::ldexp(1.0f + m / 8.0f, e - 7);
      v[b] = (b & 128) ? -x : x;
    }
  }
};
const Fp8Table FP8;

enum class Kind { F32, BF16, F16, FP8 };

Kind kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return Kind::F32;
    case at::kBFloat16: return Kind::BF16;
    case at::kHalf: return Kind::F16;
    case at::kFloat8_e4m3fn: return Kind::FP8;
    default: TORCH_CHECK(false, "KV cache dtype ", t.scalar_type(), " is not one of float32, bfloat16, float16, "
                         "float8_e4m3fn");
  }
}

inline float scale_at(const void* base, bool bf16, int64_t i) {
  if (!base) return 1.0f;
  if (bf16) {
    uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return static_cast<const float*>(base)[i];
}

// one cache row of D values -> fp32 in `out` (times `scale` for fp8, as the reference dequantizes)
inline const float* load_row(const void* cache, Kind kind, int64_t row, int64_t d, float scale, float* out) {
  switch (kind) {
    case Kind::F32:
      return static_cast<const float*>(cache) + row * d;
    case Kind::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(cache) + row * d;
      for (int64_t i = 0; i < d; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
      return out;
    }
    case Kind::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(cache) + row * d;
      for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
      return out;
    }
    case Kind::FP8: {
      const uint8_t* p = static_cast<const uint8_t*>(cache) + row * d;
      const __m256 s = _mm256_set1_ps(scale);
      for (int64_t i = 0; i < d; i += 8) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(FP8.v, idx, 4), s));
      }
      return out;
    }
  }
  return out;
}

void check_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 4 && c.is_contiguous() && c.device().is_cpu(), name,
              " must be a contiguous CPU [num_pages, page_size, kv_heads, head_dim] tensor, got shape ", c.sizes(),
              " strides ", c.strides());
}

void check_scale(const std::optional<at::Tensor>& s, const at::Tensor& cache, const char* name) {
  if (kind_of(cache) != Kind::FP8) {
    TORCH_CHECK(!s.has_value(), name, " is only for fp8 caches, the cache is ", cache.scalar_type());
    return;
  }
  TORCH_CHECK(s.has_value(), "an fp8 cache needs ", name);
  TORCH_CHECK(s->is_contiguous() && s->dim() == 3 && s->size(0) == cache.size(0) && s->size(1) == cache.size(1) &&
              s->size(2) == cache.size(2), name, " must be contiguous [", cache.size(0), ", ", cache.size(1), ", ",
              cache.size(2), "], got shape ", s->sizes());
  TORCH_CHECK(s->scalar_type() == at::kBFloat16 || s->scalar_type() == at::kFloat, name,
              " must be bfloat16 or float32, got ", s->scalar_type());
}

// scores of GN query heads (a GQA group's, rows qsh apart) against every key row, two rows at a time:
// 2 * GN independent FMA chains
template <int GN>
inline void dots(const float* q, int64_t qsh, const float* const* k, int64_t n, int64_t d, float scale, float* out) {
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    __m256 a[GN], c[GN];
    for (int g = 0; g < GN; ++g) a[g] = c[g] = _mm256_setzero_ps();
    const float* k0 = k[t];
    const float* k1 = k[t + 1];
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(k0 + i), x1 = _mm256_loadu_ps(k1 + i);
      for (int g = 0; g < GN; ++g) {
        const __m256 qq = _mm256_loadu_ps(q + g * qsh + i);
        a[g] = _mm256_fmadd_ps(qq, x0, a[g]);
        c[g] = _mm256_fmadd_ps(qq, x1, c[g]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      out[g * n + t] = hsum(a[g]) * scale;
      out[g * n + t + 1] = hsum(c[g]) * scale;
    }
  }
  if (t < n) {
    __m256 a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(k[t] + i);
      for (int g = 0; g < GN; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * qsh + i), x0, a[g]);
    }
    for (int g = 0; g < GN; ++g) out[g * n + t] = hsum(a[g]) * scale;
  }
}

// out[d0 : d0 + 8 NV] = sum_t p[t] * v[t][d0 : d0 + 8 NV], in registers
template <int NV>
inline void pv(const float* p, const float* const* v, int64_t n, int64_t d0, float* out) {
  __m256 a[NV];
  for (int j = 0; j < NV; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const float* r = v[t] + d0;
    for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * j), a[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + d0 + 8 * j, a[j]);
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double sm_scale,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "q must be fp32 [batch, heads, head_dim] contiguous along head_dim, got ", q.scalar_type(), " shape ",
              q.sizes(), " strides ", q.strides());
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "v_cache ", v_cache.scalar_type(), v_cache.sizes(), " != k_cache ", k_cache.scalar_type(),
              k_cache.sizes());
  check_scale(k_scale, k_cache, "k_scale");
  check_scale(v_scale, k_cache, "v_scale");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = k_cache.size(0), S = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "q head_dim = ", D, " != k_cache head_dim = ", k_cache.size(3));
  TORCH_CHECK(D % 8 == 0, "head_dim = ", D, " must be a multiple of 8");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "q heads = ", H, " must be a multiple of kv_heads = ", KVH);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
              block_tables.size(0) == B, "block_tables must be int32 [", B, ", max_pages] contiguous along pages, "
              "got ", block_tables.scalar_type(), " shape ", block_tables.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
              context_lens.size(0) == B, "context_lens must be int32 [", B, "], got ", context_lens.scalar_type(),
              " shape ", context_lens.sizes());
  const int64_t W = block_tables.size(1), G = H / KVH;
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t tstride = block_tables.stride(0);
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= W * S, "context_lens[", b, "] = ", lens[b], " is outside [0, ", W * S,
                "] (", W, " pages of ", S, " tokens)");
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  auto out = at::empty({B, H, D}, q.options());
  const Kind kind = kind_of(k_cache);
  const void* kc = k_cache.data_ptr();
  const void* vc = v_cache.data_ptr();
  const bool scale_bf16 = k_scale.has_value() && k_scale->scalar_type() == at::kBFloat16;
  const void* ks = k_scale.has_value() ? k_scale->data_ptr() : nullptr;
  const void* vs = v_scale.has_value() ? v_scale->data_ptr() : nullptr;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qsb = q.stride(0), qsh = q.stride(1);
  const float scale = static_cast<float>(sm_scale);
  const int64_t work = max_len * D * H * 4;
  const int64_t grain = work * B < SMALL_WORK ? B * KVH : 1;

  at::parallel_for(0, B * KVH, grain, [&](int64_t lo, int64_t hi) {
    const int64_t cap = std::max<int64_t>(max_len, 1);
    std::vector<float> scores(G * cap);
    std::vector<float> kbuf(kind == Kind::F32 ? 0 : cap * D), vbuf(kind == Kind::F32 ? 0 : cap * D);
    std::vector<const float*> krow(cap), vrow(cap);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH, n = lens[b];
      float* o = op + (b * H + kvh * G) * D;
      if (n == 0) {
        std::fill(o, o + G * D, 0.0f);
        continue;
      }
      const int32_t* tb = tables + b * tstride;
      const float* qg = qp + b * qsb + kvh * G * qsh;
      for (int64_t t = 0; t < n; ++t) {   // each row once: a pointer into an fp32 pool, else dequantized
        const int64_t page = tb[t / S];
        TORCH_CHECK(page >= 0 && page < P, "block_tables[", b, ", ", t / S, "] = ", page, " is outside [0, ", P, ")");
        const int64_t r = (page * S + t % S) * KVH + kvh;
        krow[t] = load_row(kc, kind, r, D, scale_at(ks, scale_bf16, r), kbuf.data() + t * D);
        vrow[t] = load_row(vc, kind, r, D, scale_at(vs, scale_bf16, r), vbuf.data() + t * D);
        if (kind == Kind::F32) {   // rows straight from the pool: start their reads now (the scores read them next)
          const char* kp = reinterpret_cast<const char*>(krow[t]);
          const char* vp = reinterpret_cast<const char*>(vrow[t]);
          for (int64_t o = 0; o < D * 4; o += 64) {
            _mm_prefetch(kp + o, _MM_HINT_T1);
            _mm_prefetch(vp + o, _MM_HINT_T1);
          }
        }
      }
      for (int64_t g = 0; g < G; g += 4) {
        float* st = scores.data() + g * n;
        switch (std::min<int64_t>(G - g, 4)) {
          case 1: dots<1>(qg + g * qsh, qsh, krow.data(), n, D, scale, st); break;
          case 2: dots<2>(qg + g * qsh, qsh, krow.data(), n, D, scale, st); break;
          case 3: dots<3>(qg + g * qsh, qsh, krow.data(), n, D, scale, st); break;
          default: dots<4>(qg + g * qsh, qsh, krow.data(), n, D, scale, st); break;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * n;
        float mx = -INFINITY;
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
        const __m256 m8 = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
          __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
          _mm256_storeu_ps(s + t, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum(sum8);
        for (; t < n; ++t) {
          s[t] = exp1(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (t = 0; t < n; ++t) s[t] *= inv;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {   // p @ V, 64 columns at a time in 8 registers
          switch (std::min<int64_t>(D - d0, 64) / 8) {
            case 1: pv<1>(s, vrow.data(), n, d0, o + g * D); break;
            case 2: pv<2>(s, vrow.data(), n, d0, o + g * D); break;
            case 3: pv<3>(s, vrow.data(), n, d0, o + g * D); break;
            case 4: pv<4>(s, vrow.data(), n, d0, o + g * D); break;
            case 5: pv<5>(s, vrow.data(), n, d0, o + g * D); break;
            case 6: pv<6>(s, vrow.data(), n, d0, o + g * D); break;
            case 7: pv<7>(s, vrow.data(), n, d0, o + g * D); break;
            default: pv<8>(s, vrow.data(), n, d0, o + g * D); break;
          }
        }
      }
    }
  });
  return out;
}

namespace {

inline uint16_t to_bf16(float f) {   // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

void store_row(void* cache, Kind kind, int64_t slot, const float* x, int64_t n) {
  switch (kind) {
    case Kind::F32:
      std::memcpy(static_cast<float*>(cache) + slot * n, x, n * sizeof(float));
      return;
    case Kind::BF16: {
      uint16_t* p = static_cast<uint16_t*>(cache) + slot * n;
      for (int64_t i = 0; i < n; ++i) p[i] = to_bf16(x[i]);
      return;
    }
    case Kind::F16: {
      uint16_t* p = static_cast<uint16_t*>(cache) + slot * n;
      for (int64_t i = 0; i < n; ++i) p[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
      return;
    }
    case Kind::FP8:
      TORCH_CHECK(false, "rope_kv_store_ does not quantize to fp8 (use kernels.kv_store)");
  }
}

// Both rope ops: heads of head_dim values of which the first D = cos.size(1) rotate, each q / k head first
// RMS-normalized with q_norm / k_norm when given, then k and v written to their cache slots (slot -1: skipped)
void rope_store(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                const char* op) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1,
              "qkv must be fp32 [tokens, (heads + 2 kv_heads) * head_dim] contiguous along the row, got ",
              qkv.scalar_type(), " shape ", qkv.sizes(), " strides ", qkv.strides());
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin must be contiguous fp32 [max_positions, rotary_dim], got ", cos.sizes(), " and ", sin.sizes());
  const int64_t T = qkv.size(0), D = cos.size(1), Dh = head_dim, nh = num_heads + num_kv_heads;
  TORCH_CHECK(D % 2 == 0 && D <= Dh, "rotary dim ", D, " must be even and <= head_dim ", Dh);
  TORCH_CHECK(qkv.size(1) == (nh + num_kv_heads) * Dh, "qkv row of ", qkv.size(1), " values != (heads ", num_heads,
              " + 2 * kv_heads ", num_kv_heads, ") * head_dim ", Dh);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  for (const auto* nw : {&q_norm, &k_norm})
    if (nw->has_value())
      TORCH_CHECK((*nw)->dim() == 1 && (*nw)->size(0) == Dh && (*nw)->scalar_type() == at::kFloat &&
                      (*nw)->is_contiguous(), "q_norm/k_norm must be contiguous fp32 [", Dh, "], got ",
                  (*nw)->scalar_type(), " ", (*nw)->sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous() &&
              positions.size(0) == T, "positions must be int64 [", T, "], got ", positions.scalar_type(), " shape ",
              positions.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == T, "slot_mapping must be int64 [", T, "], got ", slot_mapping.scalar_type(),
              " shape ", slot_mapping.sizes());
  TORCH_CHECK(k_cache.has_value() == v_cache.has_value(), "k_cache and v_cache come together");
  Kind kind = Kind::F32;
  int64_t slots = 0;
  if (k_cache.has_value()) {
    check_cache(*k_cache, "k_cache");
    check_cache(*v_cache, "v_cache");
    kind = kind_of(*k_cache);
    TORCH_CHECK(kind != Kind::FP8, op, " does not quantize to fp8 (pass no caches, then kernels.kv_store)");
    TORCH_CHECK(k_cache->sizes() == v_cache->sizes() && k_cache->scalar_type() == v_cache->scalar_type(),
                "v_cache ", v_cache->scalar_type(), v_cache->sizes(), " != k_cache ", k_cache->scalar_type(),
                k_cache->sizes());
    TORCH_CHECK(k_cache->size(2) == num_kv_heads && k_cache->size(3) == Dh, "k_cache [.., .., kv_heads, head_dim] = ",
                k_cache->sizes(), ", expected kv_heads ", num_kv_heads, " and head_dim ", Dh);
    slots = k_cache->size(0) * k_cache->size(1);
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0), half = D / 2, kvn = num_kv_heads * Dh;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "positions[", t, "] = ", pos[t], " is outside [0, ", max_pos, ")");
    TORCH_CHECK(slot[t] >= -1 && (slots == 0 || slot[t] < slots), "slot_mapping[", t, "] = ", slot[t],
                " is outside [-1, ", slots, ")");
  }
  float* base = qkv.data_ptr<float>();
  const int64_t rs = qkv.stride(0);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  void* kc = k_cache.has_value() ? k_cache->data_ptr() : nullptr;
  void* vc = v_cache.has_value() ? v_cache->data_ptr() : nullptr;
  const int64_t grain = T * nh * Dh * (qn ? 4 : 3) < SMALL_WORK ? std::max<int64_t>(T, 1) : 1;
  at::parallel_for(0, T, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> x(Dh);
    for (int64_t t = lo; t < hi; ++t) {
      float* r = base + t * rs;
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      for (int64_t h = 0; h < nh; ++h) {
        float* y = r + h * Dh;
        if (qn) {
          double ss = 0.0;
          for (int64_t i = 0; i < Dh; ++i) ss += static_cast<double>(y[i]) * y[i];
          const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(Dh)) + e);
          const float* w = h < num_heads ? qn : kn;
          for (int64_t i = 0; i < Dh; ++i) y[i] = (y[i] * inv) * w[i];
        }
        std::memcpy(x.data(), y, D * sizeof(float));
        // two products and a sum, unfused (-ffp-contract=off): the same bits as torch's x * cos + roll(x) * sin
        for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] + x[i + half] * s[i];
        for (int64_t i = half; i < D; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
      }
      if (kc && slot[t] >= 0) {
        store_row(kc, kind, slot[t], r + num_heads * Dh, kvn);
        store_row(vc, kind, slot[t], r + nh * Dh, kvn);
      }
    }
  });
}

}  // namespace

// qkv rows: q and k heads rotated in place (x * cos + rotate_half(x) * sin, HF layout: cos = [c, c],
// sin = [-s, s] tables), then k and v written to their cache slots (slot -1: skipped); caches may be absent
void rope_kv_store_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                    const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(cos.dim() == 2, "cos/sin must be contiguous fp32 [max_positions, head_dim], got ", cos.sizes());
  rope_store(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, cos.size(1),
             std::nullopt, std::nullopt, 0.0, "rope_kv_store_");
}

// rope_kv_store_ for heads of head_dim values of which the first D = cos.size(1) rotate (partial rotary, GLM-4.5),
// each q head first RMS-normalized with q_norm [head_dim] and each k head with k_norm (QK-norm: Qwen3, GLM-4.5
// use_qk_norm) when given; the same fp32 order as torch's rms_norm then x * cos + rotate_half(x) * sin
void rope_norm_kv_store_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                         const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                         const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps) {
  rope_store(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim, q_norm,
             k_norm, eps, "rope_norm_kv_store_");
}

namespace {

inline void norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    a = _mm256_fmadd_ps(v, v, a);
  }
  float ss = hsum(a);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) y[i] = (x[i] * r) * w[i];
}

void check_rows(const at::Tensor& x, const char* name, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == n, name,
              " must be contiguous fp32 [rows, ", n, "], got ", x.scalar_type(), " shape ", x.sizes());
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be contiguous fp32 [hidden], got ", weight.scalar_type(), " shape ", weight.sizes());
  const int64_t n = weight.size(0);
  check_rows(x, "x", n);
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < x.size(0); ++t) norm_row(xp + t * n, weight.data_ptr<float>(), eps, n, yp + t * n);
  return y;
}

// residual += x; x = rms_norm(residual) * weight (both in place)
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be contiguous fp32 [hidden], got ", weight.scalar_type(), " shape ", weight.sizes());
  const int64_t n = weight.size(0);
  check_rows(x, "x", n);
  check_rows(residual, "residual", n);
  TORCH_CHECK(x.size(0) == residual.size(0), "x has ", x.size(0), " rows, residual ", residual.size(0));
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    float* r = rp + t * n;
    float* y = xp + t * n;
    for (int64_t i = 0; i < n; ++i) r[i] = r[i] + y[i];
    norm_row(r, weight.data_ptr<float>(), eps, n, y);
  }
}

// gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
              gate_up.size(1) % 2 == 0, "gate_up must be fp32 [rows, 2 * intermediate] contiguous along the row, "
              "got ", gate_up.scalar_type(), " shape ", gate_up.sizes(), " strides ", gate_up.strides());
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, rs = gate_up.stride(0);
  auto y = at::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gp + t * rs;
    const float* u = g + I;
    float* o = yp + t * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      __m256 x = _mm256_loadu_ps(g + i);
      __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < I; ++i) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
  }
  return y;
}

TORCH_LIBRARY(edgeinfer_cpu_attn, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float sm_scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor", &decode_attention);
  m.def("rope_kv_store_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!)? k_cache, "
        "Tensor(c!)? v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()", &rope_kv_store_);
  m.def("rope_norm_kv_store_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!)? k_cache, "
        "Tensor(c!)? v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim, Tensor? q_norm, "
        "Tensor? k_norm, float eps) -> ()", &rope_norm_kv_store_);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
}
