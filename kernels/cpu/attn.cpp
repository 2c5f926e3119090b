// CPU (AVX2/FMA/F16C) ops for the decode step between the GEMMs: paged decode attention reading the KV pool
// directly (fp32/bf16/fp16 pages, or fp8 e4m3 / int8 pages dequantized in registers with their per-token scales),
// rotary embedding + KV store in one pass over the fused qkv rows, residual add + RMSNorm, SiLU * up.
// Threads: at::parallel_for over (sequence, kv head) / rows, serial when the work is small (a parallel region
// on a loaded 2-core box costs more than a short attention).
//
// Layouts (the contract with kernels/cpu/attn.py and kernels/cpu/attn_reference.py):
//   q            [B, H, D] fp32, D contiguous, D % 8 == 0
//   k/v cache    [P, S, KVH, D] contiguous, fp32 | bf16 | fp16 | fp8 e4m3fn | int8 (fp8/int8: k/v scale [P, S, KVH]
//                bf16|fp32)
//   block_tables [B, W] int32, context_lens [B] int32
//   qkv          [T, (H + 2 KVH) * D] fp32 rows (q heads, k heads, v heads), D even
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t SMALL_WORK = 1 << 18;   // flops below which an op runs on the calling thread
constexpr int64_t SPLIT = 512;            // decode: keys per task past which a context is split over tasks

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

// 8 / 16 e4m3fn bytes -> fp32 values times 2^-8, exactly, without a table: the byte sign-extended to 16 bits and
// shifted left by 7 puts its 7 magnitude bits on fp16's exponent (low 4 bits) and mantissa (top 3 bits) and
// its sign on bit 15 (bit 14, the shifted sign, is cleared): an fp16 of value * 2^-8 (subnormals included,
// fp16's bias being 8 more than e4m3's), which F16C widens. Callers fold the 2^8 into the row's scale.
inline __m256 fp8x8_scaled_down(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBF80))));
}

inline void fp8x16_scaled_down(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

constexpr float FP8_UNDO = 256.0f;   // the 2^8 the conversions above leave out

// 16 int8 values -> fp32, exactly (sign-extended to 32 bits, converted)
inline void i8x16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

// a quantized row's 16 values as the fused loops read them: fp8 times 2^-8 (FP8_UNDO folded into the row's
// factor), int8 as they are
template <bool I8>
inline void q8x16(const uint8_t* p, __m256& lo, __m256& hi) {
  if constexpr (I8) i8x16(p, lo, hi);
  else fp8x16_scaled_down(p, lo, hi);
}

// fp32 in [-448, 448] -> e4m3fn byte, round to nearest even (torch's float -> float8_e4m3fn on such values)
inline uint8_t fp8_e4m3_encode(float y) {
  uint32_t u;
  std::memcpy(&u, &y, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const float a = std::fabs(y);
  if (std::isnan(a)) return sign | 0x7F;
  if (a < 0.015625f) {                                   // below 2^-6: e4m3 subnormals, steps of 2^-9
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));   // 8 -> 0x08, the smallest normal
  }
  uint32_t b;
  std::memcpy(&b, &a, 4);
  b += 0x7FFFF + ((b >> 20) & 1);                        // 3 mantissa bits, ties to even
  const int e = static_cast<int>(b >> 23) - 127 + 7;
  return sign | static_cast<uint8_t>((e << 3) | ((b >> 20) & 7));
}

enum class Kind { F32, BF16, F16, FP8, I8 };

Kind kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return Kind::F32;
    case at::kBFloat16: return Kind::BF16;
    case at::kHalf: return Kind::F16;
    case at::kFloat8_e4m3fn: return Kind::FP8;
    case at::kChar: return Kind::I8;
    default: TORCH_CHECK(false, "KV cache dtype ", t.scalar_type(), " is not one of float32, bfloat16, float16, "
                         "float8_e4m3fn, int8");
  }
}

inline bool quantized(Kind k) { return k == Kind::FP8 || k == Kind::I8; }

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
    case Kind::I8: {
      const int8_t* p = static_cast<const int8_t*>(cache) + row * d;
      const __m256 s = _mm256_set1_ps(scale);
      for (int64_t i = 0; i < d; i += 8) {
        const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s));
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
  if (!quantized(kind_of(cache))) {
    TORCH_CHECK(!s.has_value(), name, " is only for fp8/int8 caches, the cache is ", cache.scalar_type());
    return;
  }
  TORCH_CHECK(s.has_value(), "an fp8/int8 cache needs ", name);
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

// dots for fp8 / int8 key rows: out[g * n + t] = hsum(q_g . k^_t) * f[t], k^ the row as q8x16 gives it and
// f[t] its scale (* 2^8 for fp8) * sm_scale; two rows at a time (2 * GN independent FMA chains). head_dim % 16 == 0.
template <int GN, bool I8>
inline void dots_fp8(const float* q, int64_t qsh, const uint8_t* const* k, const float* f, int64_t n, int64_t d,
                     float* out) {
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    __m256 a[GN], c[GN];
    for (int g = 0; g < GN; ++g) a[g] = c[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      __m256 x0, x1, y0, y1;
      q8x16<I8>(k[t] + i, x0, x1);
      q8x16<I8>(k[t + 1] + i, y0, y1);
      for (int g = 0; g < GN; ++g) {
        const __m256 q0 = _mm256_loadu_ps(q + g * qsh + i), q1 = _mm256_loadu_ps(q + g * qsh + i + 8);
        a[g] = _mm256_fmadd_ps(q1, x1, _mm256_fmadd_ps(q0, x0, a[g]));
        c[g] = _mm256_fmadd_ps(q1, y1, _mm256_fmadd_ps(q0, y0, c[g]));
      }
    }
    for (int g = 0; g < GN; ++g) {
      out[g * n + t] = hsum(a[g]) * f[t];
      out[g * n + t + 1] = hsum(c[g]) * f[t + 1];
    }
  }
  if (t < n) {
    __m256 a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      __m256 x0, x1;
      q8x16<I8>(k[t] + i, x0, x1);
      for (int g = 0; g < GN; ++g) {
        const __m256 q0 = _mm256_loadu_ps(q + g * qsh + i), q1 = _mm256_loadu_ps(q + g * qsh + i + 8);
        a[g] = _mm256_fmadd_ps(q1, x1, _mm256_fmadd_ps(q0, x0, a[g]));
      }
    }
    for (int g = 0; g < GN; ++g) out[g * n + t] = hsum(a[g]) * f[t];
  }
}

// out[g * osh + d0 : .. + 16] = sum_t w[g * n + t] * v^_t[d0 : d0 + 16] for GN heads: each fp8 value row converted
// once for the whole group (w: a probability times the row's scale (* 2^8 for fp8))
template <int GN, bool I8>
inline void pv_fp8(const float* w, int64_t n, const uint8_t* const* v, int64_t d0, float* out, int64_t osh) {
  __m256 a[GN][2];
  for (int g = 0; g < GN; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m256 x0, x1;
    q8x16<I8>(v[t] + d0, x0, x1);
    for (int g = 0; g < GN; ++g) {
      const __m256 wb = _mm256_set1_ps(w[g * n + t]);
      a[g][0] = _mm256_fmadd_ps(wb, x0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(wb, x1, a[g][1]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    _mm256_storeu_ps(out + g * osh + d0, a[g][0]);
    _mm256_storeu_ps(out + g * osh + d0 + 8, a[g][1]);
  }
}

// f(std::integral_constant<int, GN>, g) for the heads g .. g + GN of G taken four at a time (GN = 4, the rest last)
template <class F>
inline void by_fours(int64_t G, F&& f) {
  for (int64_t g = 0; g < G; g += 4) {
    switch (std::min<int64_t>(G - g, 4)) {
      case 1: f(std::integral_constant<int, 1>{}, g); break;
      case 2: f(std::integral_constant<int, 2>{}, g); break;
      case 3: f(std::integral_constant<int, 3>{}, g); break;
      default: f(std::integral_constant<int, 4>{}, g); break;
    }
  }
}

// ---- fp8 decode with AVX-512 (16 lanes: half the widening instructions per value), where the CPU has it
#define EI_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

EI_AVX512 inline void fp8x32_scaled_down(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16(static_cast<short>(0xBF80)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

EI_AVX512 inline void i8x32(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
}

template <bool I8>
EI_AVX512 inline void q8x32(const uint8_t* p, __m512& lo, __m512& hi) {
  if constexpr (I8) i8x32(p, lo, hi);
  else fp8x32_scaled_down(p, lo, hi);
}

// the horizontal sums of four 16-lane vectors -> [sum x[0], sum x[1], sum x[2], sum x[3]]: pairs interleaved and
// added within each 128-bit lane (unpack ps, then pd), then the four 128-bit lanes added
EI_AVX512 inline __m128 reduce4(const __m512* x) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  const __m512d p0 = _mm512_castps_pd(t0), p1 = _mm512_castps_pd(t1);
  const __m512 t2 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p0, p1)),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p1)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t2),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t2), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

template <int GN, bool I8>
EI_AVX512 inline void dots_fp8_512(const float* q, int64_t qsh, const uint8_t* const* k, const float* f, int64_t n,
                                   int64_t d, float* out) {
  int64_t t = 0;
  // four keys at a time: 4 * GN independent FMA chains, and the four keys' horizontal sums done together by one
  // transposing reduction per head (reduce4) instead of four _mm512_reduce_add_ps (which dominated the loop)
  for (; t + 4 <= n; t += 4) {
    __m512 a[GN][4];
    for (int g = 0; g < GN; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
      __m512 x[4][2];
      for (int j = 0; j < 4; ++j) q8x32<I8>(k[t + j] + i, x[j][0], x[j][1]);
      for (int g = 0; g < GN; ++g) {
        const __m512 q0 = _mm512_loadu_ps(q + g * qsh + i), q1 = _mm512_loadu_ps(q + g * qsh + i + 16);
        for (int j = 0; j < 4; ++j) a[g][j] = _mm512_fmadd_ps(q1, x[j][1], _mm512_fmadd_ps(q0, x[j][0], a[g][j]));
      }
    }
    const __m128 ff = _mm_loadu_ps(f + t);
    for (int g = 0; g < GN; ++g) _mm_storeu_ps(out + g * n + t, _mm_mul_ps(reduce4(a[g]), ff));
  }
  for (; t < n; ++t) {
    __m512 a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
      __m512 x0, x1;
      q8x32<I8>(k[t] + i, x0, x1);
      for (int g = 0; g < GN; ++g) {
        const __m512 q0 = _mm512_loadu_ps(q + g * qsh + i), q1 = _mm512_loadu_ps(q + g * qsh + i + 16);
        a[g] = _mm512_fmadd_ps(q1, x1, _mm512_fmadd_ps(q0, x0, a[g]));
      }
    }
    for (int g = 0; g < GN; ++g) out[g * n + t] = _mm512_reduce_add_ps(a[g]) * f[t];
  }
}

template <int GN, bool I8>
EI_AVX512 inline void pv_fp8_512(const float* w, int64_t n, const uint8_t* const* v, int64_t d0, float* out,
                                 int64_t osh) {
  __m512 a[GN][2];
  for (int g = 0; g < GN; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 x0, x1;
    q8x32<I8>(v[t] + d0, x0, x1);
    for (int g = 0; g < GN; ++g) {
      const __m512 wb = _mm512_set1_ps(w[g * n + t]);
      a[g][0] = _mm512_fmadd_ps(wb, x0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(wb, x1, a[g][1]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    _mm512_storeu_ps(out + g * osh + d0, a[g][0]);
    _mm512_storeu_ps(out + g * osh + d0 + 16, a[g][1]);
  }
}

// AVX-512 (F, BW, VL) on this CPU, unless EDGEINFER_CPU_AVX512=0 (tests run both paths)
bool use_avx512() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  const char* env = std::getenv("EDGEINFER_CPU_AVX512");
  return cpu && !(env && env[0] == '0');
}

// scores s[0 : n] -> softmax probabilities, in place (max, exp, sum in 8 lanes then the tail, normalize); with
// ml: left unnormalized, exp(s - max), and ml[0] = max, ml[1] = the sum (a split's partial, merged later)
inline void softmax_(float* s, int64_t n, float* ml = nullptr) {
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
  if (ml) {
    ml[0] = mx;
    ml[1] = sum;
    return;
  }
  const float inv = 1.0f / sum;
  for (t = 0; t < n; ++t) s[t] *= inv;
}

// GN heads' scores over fp32 rows, then their softmax and p @ V: one query row's attention, as decode and
// prefill both compute it (the same operations in the same order, whatever else is in the batch)
inline void attend_rows(const float* q, int64_t qsh, const float* const* krow, const float* const* vrow, int64_t n,
                        int64_t D, int64_t DV, int64_t G, float scale, float* scores, float* o, float* ml = nullptr) {
  by_fours(G, [&](auto gn, int64_t g) { dots<gn.value>(q + g * qsh, qsh, krow, n, D, scale, scores + g * n); });
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    softmax_(s, n, ml ? ml + 2 * g : nullptr);
    for (int64_t d0 = 0; d0 < DV; d0 += 64) {   // p @ V, 64 columns at a time in 8 registers
      switch (std::min<int64_t>(DV - d0, 64) / 8) {
        case 1: pv<1>(s, vrow, n, d0, o + g * DV); break;
        case 2: pv<2>(s, vrow, n, d0, o + g * DV); break;
        case 3: pv<3>(s, vrow, n, d0, o + g * DV); break;
        case 4: pv<4>(s, vrow, n, d0, o + g * DV); break;
        case 5: pv<5>(s, vrow, n, d0, o + g * DV); break;
        case 6: pv<6>(s, vrow, n, d0, o + g * DV); break;
        case 7: pv<7>(s, vrow, n, d0, o + g * DV); break;
        default: pv<8>(s, vrow, n, d0, o + g * DV); break;
      }
    }
  }
}

// attend_fp8_rows with 16-lane AVX-512 (head_dim % 32 == 0)
template <bool I8>
EI_AVX512 inline void attend_fp8_rows_512(const float* q, int64_t qsh, const uint8_t* const* krow,
                                          const uint8_t* const* vrow, const float* kf, const float* vf, int64_t n,
                                          int64_t D, int64_t DV, int64_t G, float* scores, float* o, float* ml) {
  by_fours(G, [&](auto gn, int64_t g) { dots_fp8_512<gn.value, I8>(q + g * qsh, qsh, krow, kf, n, D, scores + g * n); });
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    softmax_(s, n, ml ? ml + 2 * g : nullptr);
    for (int64_t t = 0; t < n; ++t) s[t] *= vf[t];
  }
  by_fours(G, [&](auto gn, int64_t g) {
    for (int64_t d0 = 0; d0 < DV; d0 += 32) pv_fp8_512<gn.value, I8>(scores + g * n, n, vrow, d0, o + g * DV, DV);
  });
}

// attend_rows on fp8 / int8 pages read in place: kf / vf the rows' scales (* 2^8 for fp8; kf also * sm_scale)
template <bool I8>
inline void attend_fp8_rows(const float* q, int64_t qsh, const uint8_t* const* krow, const uint8_t* const* vrow,
                            const float* kf, const float* vf, int64_t n, int64_t D, int64_t DV, int64_t G,
                            float* scores, float* o, bool avx512, float* ml = nullptr) {
  if (avx512) {
    attend_fp8_rows_512<I8>(q, qsh, krow, vrow, kf, vf, n, D, DV, G, scores, o, ml);
    return;
  }
  by_fours(G, [&](auto gn, int64_t g) { dots_fp8<gn.value, I8>(q + g * qsh, qsh, krow, kf, n, D, scores + g * n); });
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    softmax_(s, n, ml ? ml + 2 * g : nullptr);
    for (int64_t t = 0; t < n; ++t) s[t] *= vf[t];
  }
  by_fours(G, [&](auto gn, int64_t g) {
    for (int64_t d0 = 0; d0 < DV; d0 += 16) pv_fp8<gn.value, I8>(scores + g * n, n, vrow, d0, o + g * DV, DV);
  });
}

// a K/V pool's pointers as the attention loops read them
struct PoolView {
  Kind kind;
  const void *k, *v, *ks, *vs;
  bool scale_bf16;
  PoolView(const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
           const std::optional<at::Tensor>& v_scale)
      : kind(kind_of(k_cache)), k(k_cache.data_ptr()), v(v_cache.data_ptr()),
        ks(k_scale.has_value() ? k_scale->data_ptr() : nullptr), vs(v_scale.has_value() ? v_scale->data_ptr() : nullptr),
        scale_bf16(k_scale.has_value() && k_scale->scalar_type() == at::kBFloat16) {}
};

// q [rows, heads, head_dim] fp32 against a K/V pool: the checks decode and prefill attention share
void check_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                     const char* rows) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, "q must be fp32 [", rows,
              ", heads, head_dim] contiguous along head_dim, got ", q.scalar_type(), " shape ", q.sizes(),
              " strides ", q.strides());
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "v_cache ", v_cache.scalar_type(), v_cache.sizes(), " != k_cache ", k_cache.scalar_type(),
              k_cache.sizes());
  check_scale(k_scale, k_cache, "k_scale");
  check_scale(v_scale, k_cache, "v_scale");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "q head_dim = ", D, " != k_cache head_dim = ", k_cache.size(3));
  TORCH_CHECK(D % 8 == 0, "head_dim = ", D, " must be a multiple of 8");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "q heads = ", H, " must be a multiple of kv_heads = ", KVH);
}

// prefill's QK^T tile: scores of MT query vectors (q[m] pointers, head_dim d) against 16 keys t0 .. t0 + 15 of
// a transposed key block kt [d][npad]: each score is one fp32 FMA chain over d in order from zero, then * scale,
// whatever tile or chunk it is computed in (so prefill rows do not depend on their neighbours)
template <int MT>
inline void qk_tile(const float* const* q, const float* kt, int64_t npad, int64_t t0, int64_t d, float scale,
                    float* const* out) {
  __m256 a[MT][2];
  for (int m = 0; m < MT; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m256 k0 = _mm256_loadu_ps(kt + i * npad + t0), k1 = _mm256_loadu_ps(kt + i * npad + t0 + 8);
    for (int m = 0; m < MT; ++m) {
      const __m256 qb = _mm256_broadcast_ss(q[m] + i);
      a[m][0] = _mm256_fmadd_ps(qb, k0, a[m][0]);
      a[m][1] = _mm256_fmadd_ps(qb, k1, a[m][1]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(out[m] + t0, _mm256_mul_ps(a[m][0], sc));
    _mm256_storeu_ps(out[m] + t0 + 8, _mm256_mul_ps(a[m][1], sc));
  }
}

// prefill's P @ V tile: out[m][d0 : d0 + 16] = sum_{t < n} p[m][t] * v[t][d0 : ..], t in order from zero (pv's
// own chain per element; a row's probabilities past its own keys are zero, which adds exactly nothing)
template <int MT, int NV>   // NV: 8-column registers per vector (2, or 1 for a head_dim's last 8 columns)
inline void pv_tile(const float* const* p, const float* const* v, int64_t n, int64_t d0, float* const* out) {
  __m256 a[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) a[m][j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m256 x[NV];
    for (int j = 0; j < NV; ++j) x[j] = _mm256_loadu_ps(v[t] + d0 + 8 * j);
    for (int m = 0; m < MT; ++m) {
      const __m256 pb = _mm256_broadcast_ss(p[m] + t);
      for (int j = 0; j < NV; ++j) a[m][j] = _mm256_fmadd_ps(pb, x[j], a[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out[m] + d0 + 8 * j, a[m][j]);
}

}  // namespace

namespace {

// decode attention with values of width DV <= D: the first DV values of each v row (DV == D: GQA/MHA pages; MLA
// passes its latent pool as both k and v, DV = kv_lora_rank). Tasks may also split a kv head's query heads into
// chunks of a multiple of 4 (MLA at batch 1 has one kv head for every query head): a head's score and output are
// FMA chains of their own, so the chunking changes no bit.
at::Tensor decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, double sm_scale,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                       int64_t DV) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = k_cache.size(0), S = k_cache.size(1), KVH = k_cache.size(2);
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
  auto out = at::empty({B, H, DV}, q.options());
  const PoolView pool(k_cache, v_cache, k_scale, v_scale);
  const Kind kind = pool.kind;
  const void *kc = pool.k, *vc = pool.v, *ks = pool.ks, *vs = pool.vs;
  const bool scale_bf16 = pool.scale_bf16;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qsb = q.stride(0), qsh = q.stride(1);
  const float scale = static_cast<float>(sm_scale);
  const int64_t work = max_len * D * H * 4;

  // fp8 / int8 pages read in place, no fp32 copy
  const bool fused_fp8 = quantized(kind) && D % 16 == 0 && DV % 16 == 0;
  const float undo = kind == Kind::I8 ? 1.0f : FP8_UNDO;
  const bool avx512 = fused_fp8 && D % 32 == 0 && DV % 32 == 0 && use_avx512();
  // tasks: (sequence, kv head, split of SPLIT keys). A context of up to SPLIT keys is one task written straight to
  // out; a longer one is split (flash-decoding: batch 1 at 4k spreads over the threads), each split's partial
  // (unnormalized p @ V, its max and sum) merged in split order below. The split depends only on the sequence's
  // own length, so a row's result does not depend on its batch.
  struct Task {
    int64_t b, kvh, g0, g1, t0, t1, part;   // heads kvh * G + [g0, g1); part: the split's partial slot, -1 unsplit
  };
  int64_t base = 0;
  for (int64_t b = 0; b < B; ++b) base += KVH * (lens[b] > SPLIT ? (lens[b] + SPLIT - 1) / SPLIT : 1);
  const int64_t threads = at::get_num_threads();
  int64_t GC = G;   // query heads per task
  if (G >= 8 && base < threads) {
    const int64_t chunks = std::min<int64_t>(G / 4, (threads + base - 1) / base);
    GC = ((G + chunks - 1) / chunks + 3) / 4 * 4;
  }
  std::vector<Task> tasks;
  int64_t parts = 0;
  tasks.reserve(base * ((G + GC - 1) / GC));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens[b], ns = n > SPLIT ? (n + SPLIT - 1) / SPLIT : 1;
    for (int64_t kvh = 0; kvh < KVH; ++kvh)
      for (int64_t g0 = 0; g0 < G; g0 += GC)
        for (int64_t sp = 0; sp < ns; ++sp)
          tasks.push_back({b, kvh, g0, std::min(G, g0 + GC), sp * SPLIT, std::min(n, (sp + 1) * SPLIT),
                           ns > 1 ? parts++ : -1});
  }
  std::vector<float> po(parts * GC * DV), pml(parts * GC * 2);   // partials: [part][GC][DV], [part][GC][max, sum]
  const int64_t ntask = static_cast<int64_t>(tasks.size());
  const int64_t grain = work * B < SMALL_WORK ? std::max<int64_t>(ntask, 1) : 1;
  at::parallel_for(0, ntask, grain, [&](int64_t lo, int64_t hi) {
    const int64_t cap = std::max<int64_t>(std::min(max_len, SPLIT), 1);
    std::vector<float> scores(GC * cap);
    const bool buffered = kind != Kind::F32 && !fused_fp8;
    std::vector<float> kbuf(buffered ? cap * D : 0), vbuf(buffered ? cap * D : 0);
    std::vector<const float*> krow(fused_fp8 ? 0 : cap), vrow(fused_fp8 ? 0 : cap);
    std::vector<const uint8_t*> kb(fused_fp8 ? cap : 0), vb(fused_fp8 ? cap : 0);
    std::vector<float> kf(fused_fp8 ? cap : 0), vf(fused_fp8 ? cap : 0);
    for (int64_t i = lo; i < hi; ++i) {
      const Task& task = tasks[i];
      const int64_t b = task.b, kvh = task.kvh, t0 = task.t0, n = task.t1 - task.t0, gn = task.g1 - task.g0;
      float* o = task.part < 0 ? op + (b * H + kvh * G + task.g0) * DV : po.data() + task.part * GC * DV;
      float* ml = task.part < 0 ? nullptr : pml.data() + task.part * GC * 2;
      if (n == 0) {
        std::fill(o, o + gn * DV, 0.0f);
        continue;
      }
      const int32_t* tb = tables + b * tstride;
      const float* qg = qp + b * qsb + (kvh * G + task.g0) * qsh;
      for (int64_t j = 0; j < n; ++j) {   // each row once: a pointer into the pool, else dequantized
        const int64_t t = t0 + j;
        const int64_t page = tb[t / S];
        TORCH_CHECK(page >= 0 && page < P, "block_tables[", b, ", ", t / S, "] = ", page, " is outside [0, ", P, ")");
        const int64_t r = (page * S + t % S) * KVH + kvh;
        if (fused_fp8) {
          kb[j] = static_cast<const uint8_t*>(kc) + r * D;
          vb[j] = static_cast<const uint8_t*>(vc) + r * D;
          kf[j] = scale_at(ks, scale_bf16, r) * undo * scale;
          vf[j] = scale_at(vs, scale_bf16, r) * undo;
          // start every row's read now: rows of one kv head are KVH * D bytes apart across pages, and a cold
          // pool (each layer's KV read once per step) otherwise makes the loops wait on each line in turn
          // (measured at 4k, batch 1, int8: 0.47 ms per layer inside a step against 0.15 ms when cache-warm)
          for (int64_t off = 0; off < D; off += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(kb[j]) + off, _MM_HINT_T0);
            if (off < DV) _mm_prefetch(reinterpret_cast<const char*>(vb[j]) + off, _MM_HINT_T1);
          }
          continue;
        }
        krow[j] = load_row(kc, kind, r, D, scale_at(ks, scale_bf16, r), kbuf.data() + j * D);
        vrow[j] = vc == kc ? krow[j] : load_row(vc, kind, r, D, scale_at(vs, scale_bf16, r), vbuf.data() + j * D);
        if (kind == Kind::F32) {   // rows straight from the pool: start their reads now (the scores read them next)
          const char* kp = reinterpret_cast<const char*>(krow[j]);
          const char* vp = reinterpret_cast<const char*>(vrow[j]);
          for (int64_t off = 0; off < D * 4; off += 64) {
            _mm_prefetch(kp + off, _MM_HINT_T1);
            if (vp != kp && off < DV * 4) _mm_prefetch(vp + off, _MM_HINT_T1);
          }
        }
      }
      if (fused_fp8) {
        if (kind == Kind::I8)
          attend_fp8_rows<true>(qg, qsh, kb.data(), vb.data(), kf.data(), vf.data(), n, D, DV, gn, scores.data(), o,
                                avx512, ml);
        else
          attend_fp8_rows<false>(qg, qsh, kb.data(), vb.data(), kf.data(), vf.data(), n, D, DV, gn, scores.data(), o,
                                 avx512, ml);
      } else {
        attend_rows(qg, qsh, krow.data(), vrow.data(), n, D, DV, gn, scale, scores.data(), o, ml);
      }
    }
  });
  // merge each split sequence's partials, in split order: o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s
  for (int64_t i = 0; i < ntask;) {
    const Task& first = tasks[i];
    if (first.part < 0) {
      ++i;
      continue;
    }
    int64_t ns = 1;
    while (i + ns < ntask && tasks[i + ns].b == first.b && tasks[i + ns].kvh == first.kvh &&
           tasks[i + ns].g0 == first.g0)
      ++ns;
    float* o = op + (first.b * H + first.kvh * G + first.g0) * DV;
    for (int64_t g = 0; g < first.g1 - first.g0; ++g) {
      float mx = -INFINITY;
      for (int64_t sp = 0; sp < ns; ++sp) mx = std::max(mx, pml[(first.part + sp) * GC * 2 + 2 * g]);
      float total = 0.0f;
      std::fill(o + g * DV, o + (g + 1) * DV, 0.0f);
      for (int64_t sp = 0; sp < ns; ++sp) {
        const float* m = pml.data() + (first.part + sp) * GC * 2 + 2 * g;
        const float w = std::exp(m[0] - mx);
        total += w * m[1];
        const float* part = po.data() + ((first.part + sp) * GC + g) * DV;
        for (int64_t d = 0; d < DV; ++d) o[g * DV + d] += w * part[d];
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < DV; ++d) o[g * DV + d] *= inv;
    }
    i += ns;
  }
  return out;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double sm_scale,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  check_attention(q, k_cache, v_cache, k_scale, v_scale, "batch");
  return decode_impl(q, k_cache, v_cache, block_tables, context_lens, sm_scale, k_scale, v_scale, q.size(2));
}

namespace {

// q and a latent pool [P, S, 1, D] as the MLA ops take them: v_dim < D, a multiple of 8 (of 16 on fp8 / int8 pages,
// whose fused path converts 16 values at a time)
void check_mla(const at::Tensor& q, const at::Tensor& cache, const std::optional<at::Tensor>& scale, int64_t v_dim,
               const char* rows) {
  check_attention(q, cache, cache, scale, scale, rows);
  TORCH_CHECK(cache.size(2) == 1, "an MLA cache has one latent row per token: [pages, page_size, 1, D], got ",
              cache.sizes());
  const int64_t D = q.size(2);
  const int64_t step = quantized(kind_of(cache)) ? 16 : 8;
  TORCH_CHECK(v_dim > 0 && v_dim < D && v_dim % step == 0, "v_dim = ", v_dim, " must be in (0, ", D,
              ") and a multiple of ", step);
}

}  // namespace

// MLA decode in the absorbed form over latent pages [P, S, 1, D] (D = kv_lora_rank + rope, 576 for Kimi K2): every
// query head [W_UK^T q_nope, q_pe] scores the whole latent row, and a row's value is its first v_dim values (the
// latent c); one scale per row for fp8 / int8 pages. -> [B, H, v_dim]
at::Tensor mla_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                                const at::Tensor& context_lens, double sm_scale, int64_t v_dim,
                                const std::optional<at::Tensor>& scale) {
  check_mla(q, cache, scale, v_dim, "batch");
  return decode_impl(q, cache, cache, block_tables, context_lens, sm_scale, scale, scale, v_dim);
}

// Causal attention of the prefill rows of q against their sequences' pages (the new rows' K/V already stored):
// register tiles (qk_tile, pv_tile) in which every score and output element is one FMA chain of its own, so a
// row's result does not depend on the chunk or batch it came in, nor on the other rows: a prompt prefilled cold
// and the same prompt's suffix after a prefix-cache hit give the same bits. Keys are copied transposed once per
// (sequence, kv head); values are read in place from an fp32 pool, else dequantized once into fp32 rows (fp8:
// value * scale, the reference's bits).
//   q [T, H, D] fp32 packed by cu_seqlens_q [B + 1] int32; row i of sequence b sits at context_lens[b] -
//   q_len_b + i and sees the keys up to it.
namespace {

// prefill attention with values of width DV <= D (the first DV values of each v row; MLA: DV = kv_lora_rank over
// its latent pool passed as both k and v)
at::Tensor prefill_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens,
                        double sm_scale, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale, int64_t DV) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = k_cache.size(0), S = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables must be int32 [batch, max_pages] contiguous along pages, got ",
              block_tables.scalar_type(), " shape ", block_tables.sizes());
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous() &&
              cu_seqlens_q.size(0) == B + 1, "cu_seqlens_q must be int32 [", B + 1, "], got ",
              cu_seqlens_q.scalar_type(), " shape ", cu_seqlens_q.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
              context_lens.size(0) == B, "context_lens must be int32 [", B, "], got ", context_lens.scalar_type(),
              " shape ", context_lens.sizes());
  const int64_t W = block_tables.size(1), G = H / KVH, tstride = block_tables.stride(0);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, "cu_seqlens_q must run from 0 to the ", T, " rows of q, got ", cu[0],
              " .. ", cu[B]);
  std::vector<int64_t> row0(B + 1, 0);   // each sequence's first key row in the gathered rows
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ql = cu[b + 1] - cu[b];
    TORCH_CHECK(ql >= 0 && lens[b] >= ql && lens[b] <= W * S, "sequence ", b, ": ", ql, " query rows and context ",
                lens[b], " (it must hold them, within ", W, " pages of ", S, " tokens)");
    for (int64_t t = 0; t < lens[b]; ++t) {
      const int64_t page = tables[b * tstride + t / S];
      TORCH_CHECK(page >= 0 && page < P, "block_tables[", b, ", ", t / S, "] = ", page, " is outside [0, ", P, ")");
    }
    row0[b + 1] = row0[b] + lens[b];
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  auto out = at::empty({T, H, DV}, q.options());
  if (T == 0) return out;
  const PoolView pool(k_cache, v_cache, k_scale, v_scale);
  const Kind kind = pool.kind;
  const void *kc = pool.k, *vc = pool.v, *ks = pool.ks, *vs = pool.vs;
  const bool scale_bf16 = pool.scale_bf16;
  // keys transposed per (kv head, sequence): kt [D][npad_b] (npad_b: the context rounded up to 16, zeros after),
  // values as fp32 rows (pointers into an fp32 pool, else dequantized copies: fp8 value * scale, the reference's)
  std::vector<int64_t> prow0(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) prow0[b + 1] = prow0[b] + (lens[b] + 15) / 16 * 16;
  const int64_t rows = row0[B], prows = prow0[B];
  std::vector<float> kt(KVH * prows * D, 0.0f);
  std::vector<const float*> vrow(KVH * rows);
  const bool same = kc == vc;   // MLA: the value is the key row's first DV values
  std::vector<float> vbuf(kind == Kind::F32 ? 0 : KVH * rows * D);
  at::parallel_for(0, KVH * B, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> kx(D);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t kvh = task / B, b = task % B, npad = prow0[b + 1] - prow0[b];
      float* kb = kt.data() + (kvh * prows + prow0[b]) * D;
      for (int64_t t = 0; t < lens[b]; ++t) {
        const int64_t r = (tables[b * tstride + t / S] * S + t % S) * KVH + kvh;
        const int64_t j = kvh * rows + row0[b] + t;
        if (same) {   // one dequantization serves the key (transposed) and the value row
          const float* x = load_row(kc, kind, r, D, scale_at(ks, scale_bf16, r), vbuf.data() + j * D);
          for (int64_t i = 0; i < D; ++i) kb[i * npad + t] = x[i];
          vrow[j] = x;
          continue;
        }
        const float* x = load_row(kc, kind, r, D, scale_at(ks, scale_bf16, r), kx.data());
        for (int64_t i = 0; i < D; ++i) kb[i * npad + t] = x[i];
        vrow[j] = load_row(vc, kind, r, D, scale_at(vs, scale_bf16, r), vbuf.data() + j * D);
      }
    }
  });
  // tasks: (sequence, kv head, block of up to 4 query rows), the blocks of one (sequence, kv head) in zigzag
  // order (first, last, second, ...), so the contiguous ranges parallel_for hands each thread hold similar work
  constexpr int64_t RB = 16;   // rows per task: each K tile (16 keys) stays in L1 for RB * G query vectors
  std::vector<int64_t> tasks;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      const int64_t nb = (cu[b + 1] - cu[b] + RB - 1) / RB;
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t blk = (k % 2 == 0) ? k / 2 : nb - 1 - k / 2;
        tasks.push_back(((blk * KVH) + kvh) * B + b);
      }
    }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qst = q.stride(0), qsh = q.stride(1);
  const float scale = static_cast<float>(sm_scale);
  const int64_t cap = (max_len + 15) / 16 * 16;
  const int64_t grain = max_len * D * H * 4 * T < SMALL_WORK ? static_cast<int64_t>(tasks.size()) : 1;
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), grain, [&](int64_t lo, int64_t hi) {
    const int64_t M = RB * G;   // query vectors of a task: (row, head) pairs
    std::vector<float> scores(M * std::max<int64_t>(cap, 16));
    std::vector<const float*> qv(M);
    std::vector<float*> sv(M), ov(M);
    std::vector<int64_t> nv(M);
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t code = tasks[k], b = code % B, kvh = (code / B) % KVH, blk = code / B / KVH;
      const int64_t ql = cu[b + 1] - cu[b], prefix = lens[b] - ql, npad = prow0[b + 1] - prow0[b];
      const int64_t i0 = blk * RB, rn = std::min<int64_t>(RB, ql - i0), m_n = rn * G;
      const float* kb = kt.data() + (kvh * prows + prow0[b]) * D;
      const float* const* vr = vrow.data() + kvh * rows + row0[b];
      for (int64_t r = 0; r < rn; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t m = r * G + g, row = cu[b] + i0 + r;
          qv[m] = qp + row * qst + (kvh * G + g) * qsh;
          sv[m] = scores.data() + m * cap;
          ov[m] = op + (row * H + kvh * G + g) * DV;
          nv[m] = prefix + i0 + r + 1;                   // keys this row sees
        }
      const int64_t nmax = prefix + i0 + rn, tmax = (nmax + 15) / 16 * 16;
      for (int64_t t0 = 0; t0 < tmax && t0 < npad; t0 += 16)
        for (int64_t m0 = 0; m0 < m_n; m0 += 4) {
          const int64_t mt = std::min<int64_t>(m_n - m0, 4);
          if (nv[m0 + mt - 1] <= t0) continue;             // none of these rows sees this tile (causal)
          by_fours(mt, [&](auto mn, int64_t) { qk_tile<mn.value>(qv.data() + m0, kb, npad, t0, D, scale, sv.data() + m0); });
        }
      for (int64_t m = 0; m < m_n; ++m) {
        softmax_(sv[m], nv[m]);
        std::fill(sv[m] + nv[m], sv[m] + nmax, 0.0f);
      }
      for (int64_t m0 = 0; m0 < m_n; m0 += 4) {
        const int64_t mt = std::min<int64_t>(m_n - m0, 4), n = nv[m0 + mt - 1];
        const float* const* pm = sv.data() + m0;
        float* const* om = ov.data() + m0;
        by_fours(mt, [&](auto mn, int64_t) {
          int64_t d0 = 0;
          for (; d0 + 16 <= DV; d0 += 16) pv_tile<mn.value, 2>(pm, vr, n, d0, om);
          if (d0 < DV) pv_tile<mn.value, 1>(pm, vr, n, d0, om);    // head_dim % 16 == 8
        });
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& context_lens, double sm_scale, const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  check_attention(q, k_cache, v_cache, k_scale, v_scale, "tokens");
  return prefill_impl(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sm_scale, k_scale, v_scale,
                      q.size(2));
}

// MLA prefill in the latent form, causal as prefill_attention: q [T, H, D] absorbed rows against their sequences'
// latent rows, values their first v_dim -> [T, H, v_dim]
at::Tensor mla_prefill_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, double sm_scale,
                                 int64_t v_dim, const std::optional<at::Tensor>& scale) {
  check_mla(q, cache, scale, v_dim, "tokens");
  return prefill_impl(q, cache, cache, block_tables, cu_seqlens_q, context_lens, sm_scale, scale, scale, v_dim);
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
    case Kind::I8:
      TORCH_CHECK(false, "store_row: fp8/int8 rows go through store_quant_row (they need their scales)");
  }
}

// y <- y H / sqrt(n), H the n x n Sylvester-Hadamard matrix (n a power of two), in place: butterflies of spans
// 1, 2, 4, ... then the scale, the same fp32 operations in the same order as attn_reference.hadamard_heads_
void hadamard_(float* y, int64_t n, float scale) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = y[j], b = y[j + h];
        y[j] = a + b;
        y[j + h] = a - b;
      }
  for (int64_t i = 0; i < n; ++i) y[i] *= scale;
}

// one slot's row of kv_heads heads of d values -> e4m3 / int8 with a scale per head, as kernels.kv_store
// quantizes: scale = max(amax(|x|), 1e-8) / qmax (448 / 127) rounded to the scale's dtype, then x / scale clamped
// to +-qmax, rounded to nearest even (the same bytes as torch's cast / torch.round)
void store_quant_row(void* cache, void* scales, bool scale_bf16, int64_t slot, const float* x, int64_t kv_heads,
                     int64_t d, bool i8) {
  uint8_t* p = static_cast<uint8_t*>(cache) + slot * kv_heads * d;
  const float qmax = i8 ? 127.0f : 448.0f;
  for (int64_t h = 0; h < kv_heads; ++h) {
    const float* r = x + h * d;
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(r[i]));
    float sc = std::max(amax, 1e-8f) / qmax;
    const int64_t si = slot * kv_heads + h;
    if (scale_bf16) {
      const uint16_t bits = to_bf16(sc);
      static_cast<uint16_t*>(scales)[si] = bits;
      const uint32_t u = static_cast<uint32_t>(bits) << 16;
      std::memcpy(&sc, &u, 4);
    } else {
      static_cast<float*>(scales)[si] = sc;
    }
    if (i8) {
      int8_t* o = reinterpret_cast<int8_t*>(p + h * d);
      for (int64_t i = 0; i < d; ++i)   // nearbyint: the default rounding mode, to nearest even
        o[i] = static_cast<int8_t>(std::nearbyint(std::min(std::max(r[i] / sc, -127.0f), 127.0f)));
    } else {
      for (int64_t i = 0; i < d; ++i) p[h * d + i] = fp8_e4m3_encode(std::min(std::max(r[i] / sc, -448.0f), 448.0f));
    }
  }
}

// Both rope ops: heads of head_dim values of which the first D = cos.size(1) rotate, each q / k head first
// RMS-normalized with q_norm / k_norm when given, then k and v written to their cache slots (slot -1: skipped)
void rope_store(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, bool hadamard,
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
  TORCH_CHECK(!hadamard || (Dh >= 2 && (Dh & (Dh - 1)) == 0), op, ": hadamard needs a power-of-two head_dim, got ", Dh);
  const float hscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dh)));   // as Python's 1 / sqrt
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
    check_scale(k_scale, *k_cache, "k_scale");
    check_scale(v_scale, *v_cache, "v_scale");
    if (quantized(kind))
      TORCH_CHECK(k_scale->scalar_type() == v_scale->scalar_type(), op, ": k_scale and v_scale dtypes differ");
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
  void* ksp = k_scale.has_value() ? k_scale->data_ptr() : nullptr;
  void* vsp = v_scale.has_value() ? v_scale->data_ptr() : nullptr;
  const bool scale_bf16 = k_scale.has_value() && k_scale->scalar_type() == at::kBFloat16;
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
        if (hadamard) hadamard_(y, Dh, hscale);
      }
      if (kc && slot[t] >= 0 && quantized(kind)) {
        const bool i8 = kind == Kind::I8;
        store_quant_row(kc, ksp, scale_bf16, slot[t], r + num_heads * Dh, num_kv_heads, Dh, i8);
        store_quant_row(vc, vsp, scale_bf16, slot[t], r + nh * Dh, num_kv_heads, Dh, i8);
      } else if (kc && slot[t] >= 0) {
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
                    const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, bool hadamard) {
  TORCH_CHECK(cos.dim() == 2, "cos/sin must be contiguous fp32 [max_positions, head_dim], got ", cos.sizes());
  rope_store(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, cos.size(1),
             std::nullopt, std::nullopt, 0.0, k_scale, v_scale, hadamard, "rope_kv_store_");
}

// rope_kv_store_ for heads of head_dim values of which the first D = cos.size(1) rotate (partial rotary, GLM-4.5),
// each q head first RMS-normalized with q_norm [head_dim] and each k head with k_norm (QK-norm: Qwen3, GLM-4.5
// use_qk_norm) when given; the same fp32 order as torch's rms_norm then x * cos + rotate_half(x) * sin
void rope_norm_kv_store_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                         const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                         const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                         const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                         bool hadamard) {
  rope_store(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim, q_norm,
             k_norm, eps, k_scale, v_scale, hadamard, "rope_norm_kv_store_");
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

namespace {

// The layers' parameters as decode_layers receives them, per layer (kernels/cpu/attn_reference.py decode_layers
// and backend/model/cpu_decode.py DecodePlan name the same slots)
constexpr int64_t NW = 6;    // weights: qkv, o, gate_up, down (Q4_1 x8; gate_up/down: the dense MLP, or a MoE
                             // layer's shared experts, None without), post norm, next norm
constexpr int64_t NE = 7;    // extras (each may be None): qkv bias, q_norm, k_norm, router [E, H] fp32, the
                             // router's correction bias [E], the experts' gate_up and down (Q4_1 x8, [E, ...])
constexpr int64_t NI = 16;   // ints: qkv_n, o_n, gate_up_n, down_n, heads, kv_heads, head_dim, hadamard, rotary
                             // dim (0: whole heads, no QK-norm: rope_kv_store_), moe, top_k, sigmoid scoring,
                             // n_group, topk_group, norm_topk_prob, expert width
constexpr int64_t NF = 5;    // floats: post_eps, next_eps, sm_scale, qk-norm eps, routed scaling factor

// backend/model/moe.py route() with the same ATen ops in the same order: (weights [T, k] fp32, ids [T, k] int64)
std::pair<at::Tensor, at::Tensor> route(const at::Tensor& logits, const int64_t* in, const double* fl,
                                        const std::optional<at::Tensor>& bias) {
  const int64_t k = in[10];
  if (!in[11]) {   // softmax (Qwen3-MoE)
    auto [w, ids] = at::softmax(logits, -1).topk(k, -1);
    if (in[14]) w = w / w.sum(-1, true);
    return {w, ids};
  }
  const at::Tensor scores = logits.sigmoid();
  at::Tensor choice = bias.has_value() ? scores + bias->to(at::kFloat) : scores;
  const int64_t n_group = in[12];
  if (n_group > 1) {
    const int64_t t = choice.size(0), per = choice.size(1) / n_group;
    const at::Tensor group_scores = std::get<0>(choice.view({t, n_group, per}).topk(std::min<int64_t>(2, per), -1))
                                        .sum(-1);
    const at::Tensor keep = std::get<1>(group_scores.topk(in[13], -1, true, false));
    const at::Tensor mask = at::zeros_like(group_scores, group_scores.options().dtype(at::kBool)).scatter_(1, keep, true);
    choice = choice.masked_fill(mask.logical_not().repeat_interleave(per, 1), -INFINITY);
  }
  const at::Tensor ids = std::get<1>(choice.topk(k, -1, true, false));
  at::Tensor w = scores.gather(1, ids);
  if (in[14]) w = w / (w.sum(-1, true) + 1e-20);
  return {w * fl[4], ids};
}

}  // namespace

// The CPU decode plan's layer loop (backend/model/cpu_decode.py DecodePlan.run) in one call, so a batch-1 step is not
// ~270 op calls from Python (measured: ~0.3 ms of Python and ~0.4 ms of dispatch per token of the default model,
// of a ~4.1 ms forward). The same ops in the same order on the same tensors as the module path (_forward_cpu: the
// layers' forward_cpu), so the same bits: dense layers, QK-norm and partial rotary (Qwen3, GLM-4.5), a qkv bias, and
// Mixture-of-Experts layers (the router and its top-k with the ATen ops moe.route uses, the routed experts in one
// edgeinfer_cpu::q4_1x8_moe call, the shared experts as their MLP module computes them). Per layer l: weights[NW l ..],
// extras[NE l ..], ints[NI l ..], floats[NF l ..] (above); kv[2l], kv[2l+1] the K/V pages; scales[2l], scales[2l+1]
// their fp8/int8 scales (None for other dtypes). x is the residual stream (updated in place), h the first layer's
// normed input; the GEMM is edgeinfer_cpu's q4_1x8_gemm_residual (tau) when residual, else q4_1x8_gemm, through the
// dispatcher (kernels/cpu/q4.cpp is its own extension, loaded before any model that uses this runs).
at::Tensor decode_layers(at::Tensor& x, const at::Tensor& h0, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& tables,
                         const at::Tensor& lens, const c10::List<std::optional<at::Tensor>>& weights, at::TensorList kv,
                         const c10::List<std::optional<at::Tensor>>& scales,
                         const c10::List<std::optional<at::Tensor>>& extras, at::IntArrayRef ints,
                         at::ArrayRef<double> floats, bool residual, double tau) {
  const int64_t L = static_cast<int64_t>(kv.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == NW * L && static_cast<int64_t>(scales.size()) == 2 * L &&
                  static_cast<int64_t>(extras.size()) == NE * L && static_cast<int64_t>(ints.size()) == NI * L &&
                  static_cast<int64_t>(floats.size()) == NF * L,
              "decode_layers: per layer ", NW, " weights, 2 kv, 2 scales, ", NE, " extras, ", NI, " ints and ", NF,
              " floats; got ", weights.size(), ", ", kv.size(), ", ", scales.size(), ", ", extras.size(), ", ",
              ints.size(), ", ", floats.size(), " for ", L, " layers");
  static const auto gemm2 = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("edgeinfer_cpu::q4_1x8_gemm_residual", "")
                                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, double)>();
  static const auto gemm1 = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("edgeinfer_cpu::q4_1x8_gemm", "")
                                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  auto gemm = [&](const at::Tensor& a, const at::Tensor& w, int64_t n) {
    return residual ? gemm2.call(a, w, n, tau) : gemm1.call(a, w, n);
  };
  const int64_t t = x.size(0);
  at::Tensor h = h0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* in = ints.data() + NI * l;
    const double* fl = floats.data() + NF * l;
    auto w = [&](int64_t i) { return weights.get(NW * l + i); };
    auto e = [&](int64_t i) { return extras.get(NE * l + i); };
    const int64_t nh = in[4], nkv = in[5], hd = in[6], q_size = nh * hd;
    const std::optional<at::Tensor> ks = scales.get(2 * l), vs = scales.get(2 * l + 1);
    at::Tensor qkv = gemm(h, *w(0), in[0]);
    if (const auto bias = e(0); bias.has_value()) qkv = qkv + *bias;   // W4A16Linear: y + bias
    if (in[8] == 0) {
      rope_kv_store_(qkv, positions, cos, sin, kv[2 * l], kv[2 * l + 1], slots, nh, nkv, ks, vs, in[7] != 0);
    } else {
      rope_norm_kv_store_(qkv, positions, cos, sin, kv[2 * l], kv[2 * l + 1], slots, nh, nkv, hd, e(1), e(2), fl[3],
                          ks, vs, in[7] != 0);
    }
    const at::Tensor q = qkv.slice(1, 0, q_size).view({t, nh, hd});
    const at::Tensor out = decode_attention(q, kv[2 * l], kv[2 * l + 1], tables, lens, fl[2], ks, vs);
    at::Tensor a = gemm(out.reshape({t, q_size}).contiguous(), *w(1), in[1]);
    add_rms_norm_(a, x, *w(4), fl[0]);
    if (in[9] == 0) {
      h = gemm(silu_mul(gemm(a, *w(2), in[2])), *w(3), in[3]);
    } else {   // SparseMoE.forward: routed experts, then + the shared experts' MLP (MLP.forward: silu(gate) * up)
      static const auto moe = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("edgeinfer_cpu::q4_1x8_moe", "")
                                  .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&, int64_t, bool, double)>();
      const auto [rw, ids] = route(at::matmul(a, e(3)->t()), in, fl, e(4));
      h = moe.call(a, ids, rw.contiguous(), *e(5), *e(6), in[15], residual, tau);
      if (w(2).has_value()) {
        const auto gu = gemm(a, *w(2), in[2]).chunk(2, -1);
        h = h + gemm(at::silu(gu[0]) * gu[1], *w(3), in[3]);
      }
    }
    add_rms_norm_(h, x, *w(5), fl[1]);
  }
  return h;
}

TORCH_LIBRARY(edgeinfer_cpu_attn, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float sm_scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor", &decode_attention);
  m.def("mla_decode_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor context_lens, float sm_scale, "
        "int v_dim, Tensor? scale=None) -> Tensor", &mla_decode_attention);
  m.def("mla_prefill_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor cu_seqlens_q, "
        "Tensor context_lens, float sm_scale, int v_dim, Tensor? scale=None) -> Tensor", &mla_prefill_attention);
  m.def("rope_kv_store_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!)? k_cache, "
        "Tensor(c!)? v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, Tensor(d!)? k_scale=None, "
        "Tensor(e!)? v_scale=None, bool hadamard=False) -> ()", &rope_kv_store_);
  m.def("rope_norm_kv_store_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!)? k_cache, "
        "Tensor(c!)? v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim, Tensor? q_norm, "
        "Tensor? k_norm, float eps, Tensor(d!)? k_scale=None, Tensor(e!)? v_scale=None, bool hadamard=False) -> ()",
        &rope_norm_kv_store_);
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
        "Tensor context_lens, float sm_scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
        &prefill_attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("decode_layers(Tensor(a!) x, Tensor h, Tensor positions, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor tables, Tensor lens, Tensor?[] weights, Tensor(b!)[] kv, Tensor?[] scales, Tensor?[] extras, "
        "int[] ints, float[] floats, bool residual, float tau) -> Tensor", &decode_layers);
}
