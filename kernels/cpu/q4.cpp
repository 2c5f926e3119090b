// CPU (AVX2/FMA/F16C) kernels for GGUF-quantized weights, llama.cpp-style: the activation rows are quantized
// to int8 per block of 32 (scale d, and s = d * sum(q) for the min term), then integer dot products per block
// (_mm256_maddubs_epi16 / _mm256_madd_epi16) accumulate in fp32. Threads: at::parallel_for over output rows.
//
// Layouts (the contract with kernels/cpu/__init__.py and kernels/cpu/reference.py):
//   x       [M, K] fp32 contiguous, K % 32 == 0
//   q4_1    [N, K/32 * 20] uint8: per block fp16 d, fp16 m, 16 bytes (byte j = q[j] | q[j + 16] << 4);
//           w = d * q + m (GGUF Q4_1's block; Q4_0 is m = -8 d)
//   q8_0    qweight [N, K] int8, scales [N, K/32] fp16; w = d * q
//   q4_1x8  [G, K/32 * 160] uint8, G = ceil(N / 8): 8 weight rows interleaved per block (llama.cpp's "repack"
//           idea): fp16 d[8], fp16 m[8], then 4 chunks of 32 bytes, chunk j = for row r 0..7 the GGUF bytes
//           4j .. 4j+3 of row r (low nibbles k = 4j + i, high nibbles k = 16 + 4j + i); rows >= N are zero
//   q8_0x8  qs [G, K/32 * 256] int8 (8 chunks of 32 bytes, chunk c = for row r the int8 k = 4c .. 4c+3),
//           d [G, K/32 * 8] fp16
//   out     [M, N] fp32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t QK = 32;
constexpr int64_t Q4_1_BYTES = 20;
constexpr int64_t M_TILE = 4;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// one block of 32 floats -> 32 int8, d, s
inline void quantize_block(const float* x, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
         v3 = _mm256_loadu_ps(x + 24);
  __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float amax = _mm_cvtss_f32(m);
  const float db = amax / 127.f;
  const float id = db != 0.f ? 1.f / db : 0.f;
  const __m256 mul = _mm256_set1_ps(id);
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), R));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), R));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), R));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), R));
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  const int isum = _mm_cvtsi128_si32(t4);
  i0 = _mm256_packs_epi32(i0, i1);
  i2 = _mm256_packs_epi32(i2, i3);
  i0 = _mm256_packs_epi16(i0, i2);
  i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i0);
  *d = db;
  *s = db * static_cast<float>(isum);
}

struct Q8Rows {   // quantized activations: q [M, K], d and s [M, K/32]
  std::vector<int8_t> q;
  std::vector<float> d, s;
  // with a second pass (quantize_rows_x2), else empty: q2 [M, K] what the first pass rounded away in steps of
  // d1 / 256 (d1 the first pass's scale), two [M, K/32] = 1 where a block has it; such a block's integer dot is
  // 256 * dot(q) + dot(q2), exact in int32, and its d is d1 / 256 (s then covers both passes)
  std::vector<int8_t> q2;
  std::vector<uint8_t> two;
};

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  Q8Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  at::parallel_for(0, M * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) quantize_block(x + b * QK, r.q.data() + b * QK, &r.d[b], &r.s[b]);
  });
  return r;
}

// The activations in two int8 passes: q = q(x) as quantize_rows (scale d1), then q2 = what it rounded away,
// x - d1 * q (at most d1 / 2 per value), in steps of d1 / 256 (|q2| <= 128, clamped to 127): about 15 bits per
// value instead of 8. Both int8, so the GEMM tiles run two integer dot products per block and combine them in
// int32 (256 * hi + lo) before the one fp32 epilogue they already had.
// tau > 0: the second pass only for the blocks whose d1 >= tau * the row's largest d1 (the blocks whose rounding
// error is largest in absolute terms); the others keep one pass (two = 0). Each row's choice depends on that row
// alone, so a row's result does not depend on the other rows in the call (batch invariance holds).
Q8Rows quantize_rows_x2(const float* x, int64_t M, int64_t K, float tau) {
  const int64_t nb = K / QK;
  Q8Rows r = quantize_rows(x, M, K);
  r.q2.assign(M * K, 0);
  r.two.assign(M * nb, 0);
  std::vector<float> floor(M, 0.f);   // per row: the smallest first-pass d that gets a second pass
  if (tau > 0.f)
    for (int64_t m = 0; m < M; ++m) {
      const float* d = r.d.data() + m * nb;
      floor[m] = tau * *std::max_element(d, d + nb);
    }
  at::parallel_for(0, M * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float d1 = r.d[b];
      if (d1 == 0.f || d1 < floor[b / nb]) continue;   // an all-zero block, or one left at one pass
      const float step = d1 / 256.f, inv = 1.f / step;
      const float* xb = x + b * QK;
      const int8_t* q = r.q.data() + b * QK;
      int8_t* q2 = r.q2.data() + b * QK;
      int32_t sum1 = 0, sum2 = 0;
      for (int i = 0; i < QK; ++i) {
        const float rest = xb[i] - d1 * static_cast<float>(q[i]);
        const float v = std::nearbyint(rest * inv);
        const int32_t k = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
        q2[i] = static_cast<int8_t>(k);
        sum1 += q[i];
        sum2 += k;
      }
      r.d[b] = step;
      r.s[b] = step * static_cast<float>(256 * sum1 + sum2);
      r.two[b] = 1;
    }
  });
  return r;
}

void check_tau(double tau, const char* op) {
  TORCH_CHECK(tau >= 0.0 && tau <= 1.0, op, ": tau must be in [0, 1], got ", tau);
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be a contiguous CPU float32 [M, K] tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " columns, the weight ", K);
}

// out[m, n] for rows m0 .. m0 + T of one Q4_1 weight row. Two accumulator sets (even / odd blocks) so that
// one row (decode) is not bound by the FMA chain's latency.
template <int T>
inline void q4_1_block(const uint8_t* w, int64_t b, int64_t nb, const Q8Rows& y, int64_t m0, __m256* acc,
                       float* summ) {
  const float dw = f16(w), mw = f16(w + 2);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 4));
  const __m256i qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  for (int t = 0; t < T; ++t) {
    const int64_t r = (m0 + t) * nb + b;
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.q.data() + r * QK));
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qy), _mm256_set1_epi16(1));
    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * y.d[r]), _mm256_cvtepi32_ps(p), acc[t]);
    summ[t] += mw * y.s[r];
  }
}

template <int T>
inline void q4_1_row(const uint8_t* w, int64_t nb, const Q8Rows& y, int64_t K, int64_t m0, float* out,
                     int64_t N) {
  __m256 acc0[T], acc1[T];
  float summ0[T], summ1[T];
  for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps(), summ0[t] = summ1[t] = 0.f;
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    q4_1_block<T>(w + b * Q4_1_BYTES, b, nb, y, m0, acc0, summ0);
    q4_1_block<T>(w + (b + 1) * Q4_1_BYTES, b + 1, nb, y, m0, acc1, summ1);
  }
  if (b < nb) q4_1_block<T>(w + b * Q4_1_BYTES, b, nb, y, m0, acc0, summ0);
  for (int t = 0; t < T; ++t) out[(m0 + t) * N] = hsum(_mm256_add_ps(acc0[t], acc1[t])) + (summ0[t] + summ1[t]);
}

template <int T>
inline void q8_0_block(const int8_t* w, float dw, int64_t b, int64_t nb, const Q8Rows& y, int64_t m0,
                       __m256* acc) {
  const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i aw = _mm256_sign_epi8(qw, qw);
  for (int t = 0; t < T; ++t) {
    const int64_t r = (m0 + t) * nb + b;
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.q.data() + r * QK));
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(qy, qw)), _mm256_set1_epi16(1));
    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * y.d[r]), _mm256_cvtepi32_ps(p), acc[t]);
  }
}

template <int T>
inline void q8_0_row(const int8_t* w, const uint8_t* ws, int64_t nb, const Q8Rows& y, int64_t m0, float* out,
                     int64_t N) {
  __m256 acc0[T], acc1[T];
  for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    q8_0_block<T>(w + b * QK, f16(ws + 2 * b), b, nb, y, m0, acc0);
    q8_0_block<T>(w + (b + 1) * QK, f16(ws + 2 * b + 2), b + 1, nb, y, m0, acc1);
  }
  if (b < nb) q8_0_block<T>(w + b * QK, f16(ws + 2 * b), b, nb, y, m0, acc0);
  for (int t = 0; t < T; ++t) out[(m0 + t) * N] = hsum(_mm256_add_ps(acc0[t], acc1[t]));
}

template <typename Row>
void over_rows(int64_t M, Row row) {   // full tiles of M_TILE rows, then the rest
  int64_t m0 = 0;
  for (; m0 + M_TILE <= M; m0 += M_TILE) row(std::integral_constant<int, M_TILE>{}, m0);
  switch (M - m0) {
    case 3: row(std::integral_constant<int, 3>{}, m0); break;
    case 2: row(std::integral_constant<int, 2>{}, m0); break;
    case 1: row(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

int64_t grain(int64_t N) { return std::max<int64_t>(8, N / (4 * at::get_num_threads())); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> q8_quantize(const at::Tensor& x) {   // -> q, d, s
  TORCH_CHECK(x.dim() == 2 && x.size(1) % QK == 0, "q8_quantize: x must be [M, K] with K % 32 == 0, got ",
              x.sizes());
  check_x(x, x.size(1), "q8_quantize");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  Q8Rows r = quantize_rows(x.data_ptr<float>(), M, K);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, nb}, x.options()), s = at::empty({M, nb}, x.options());
  std::copy(r.q.begin(), r.q.end(), q.data_ptr<int8_t>());
  std::copy(r.d.begin(), r.d.end(), d.data_ptr<float>());
  std::copy(r.s.begin(), r.s.end(), s.data_ptr<float>());
  return {q, d, s};
}

at::Tensor q4_1_gemm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) % Q4_1_BYTES == 0,
              "q4_1_gemm: weight must be contiguous uint8 [N, K/32 * 20], got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), nb = w.size(1) / Q4_1_BYTES, K = nb * QK;
  check_x(x, K, "q4_1_gemm");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Q8Rows y = quantize_rows(x.data_ptr<float>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      over_rows(M, [&](auto t, int64_t m0) {
        q4_1_row<decltype(t)::value>(wp + n * nb * Q4_1_BYTES, nb, y, K, m0, op + n, N);
      });
    }
  });
  return out;
}

at::Tensor q8_0_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales) {
  TORCH_CHECK(qw.device().is_cpu() && qw.scalar_type() == at::kChar && qw.dim() == 2 && qw.is_contiguous() &&
                  qw.size(1) % QK == 0,
              "q8_0_gemm: qweight must be contiguous int8 [N, K], K % 32 == 0, got ", qw.scalar_type(), " ",
              qw.sizes());
  const int64_t N = qw.size(0), K = qw.size(1), nb = K / QK;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == nb,
              "q8_0_gemm: scales must be contiguous fp16 [", N, ", ", nb, "], got ", scales.scalar_type(), " ",
              scales.sizes());
  check_x(x, K, "q8_0_gemm");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Q8Rows y = quantize_rows(x.data_ptr<float>(), M, K);
  const int8_t* wp = qw.data_ptr<int8_t>();
  const uint8_t* sp = reinterpret_cast<const uint8_t*>(scales.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      over_rows(M, [&](auto t, int64_t m0) {
        q8_0_row<decltype(t)::value>(wp + n * K, sp + n * nb * 2, nb, y, m0, op + n, N);
      });
    }
  });
  return out;
}

// Q4_1 blocks -> fp32 [N, K] written into out (a reused scratch buffer)
at::Tensor q4_1_dequant(const at::Tensor& w, const at::Tensor& out) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) % Q4_1_BYTES == 0,
              "q4_1_dequant: weight must be contiguous uint8 [N, K/32 * 20], got ", w.scalar_type(), " ",
              w.sizes());
  const int64_t N = w.size(0), nb = w.size(1) / Q4_1_BYTES, K = nb * QK;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
                  out.size(1) == K,
              "q4_1_dequant: out must be contiguous float32 [", N, ", ", K, "], got ", out.scalar_type(), " ",
              out.sizes());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const __m128i lo = _mm_set1_epi8(0x0F);
  at::parallel_for(0, N * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = wp + b * Q4_1_BYTES;
      const __m256 d = _mm256_set1_ps(f16(blk)), m = _mm256_set1_ps(f16(blk + 2));
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m128i q[2] = {_mm_and_si128(raw, lo), _mm_and_si128(_mm_srli_epi16(raw, 4), lo)};
      float* o = op + b * QK;
      for (int h = 0; h < 2; ++h) {
        const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[h]));
        const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q[h], 8)));
        _mm256_storeu_ps(o + 16 * h, _mm256_add_ps(_mm256_mul_ps(f0, d), m));   // gguf's order, unfused
        _mm256_storeu_ps(o + 16 * h + 8, _mm256_add_ps(_mm256_mul_ps(f1, d), m));
      }
    }
  });
  return out;
}

// Q8_0 rows [N, K] int8 + fp16 scales -> fp32 [N, K] written into out (a chunk of a head at a time)
at::Tensor q8_0_dequant(const at::Tensor& qw, const at::Tensor& scales, const at::Tensor& out) {
  TORCH_CHECK(qw.scalar_type() == at::kChar && qw.is_contiguous() && qw.dim() == 2 && qw.size(1) % QK == 0 &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == qw.numel() / QK,
              "q8_0_dequant: qweight must be contiguous int8 [N, K] and scales fp16 [N, K/32], got ",
              qw.sizes(), " and ", scales.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == qw.sizes(),
              "q8_0_dequant: out must be contiguous float32 ", qw.sizes(), ", got ", out.sizes());
  const int8_t* wp = qw.data_ptr<int8_t>();
  const uint8_t* sp = reinterpret_cast<const uint8_t*>(scales.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, qw.numel() / QK, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const __m256 d = _mm256_set1_ps(f16(sp + 2 * b));
      for (int h = 0; h < 4; ++h) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + b * QK + 8 * h));
        _mm256_storeu_ps(op + b * QK + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
      }
    }
  });
  return out;
}


// ---- interleaved (x8) kernels: a tile of T activation rows x 8 weight rows per block. The weight chunk
// registers hold 4 k-values of each of the 8 rows; the activation's 4 bytes are broadcast to all 8, so one
// maddubs does 8 rows at once, the int32 lanes are the 8 output columns, and scales/mins are vectors.
constexpr int64_t X8 = 8;
constexpr int64_t Q4X8_BYTES = 160;
constexpr int64_t Q8X8_BYTES = 256;
constexpr int64_t X8_TILE = 4;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline void store8(float* o, __m256 v, int64_t valid) {   // 8 output columns, fewer at the padded end
  if (valid >= X8) {
    _mm256_storeu_ps(o, v);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    for (int64_t i = 0; i < valid; ++i) o[i] = tmp[i];
  }
}

// One block's integer dot of an activation row's 32 int8 qy against the 8 unpacked weight rows q (AVX2).
inline __m256i q4_block_dot(const __m256i* q, const int8_t* qy) {
  __m256i s16 = _mm256_maddubs_epi16(q[0], bcast4(qy));   // <= 16 products of 15 * 127 per lane: no overflow
  for (int j = 1; j < 4; ++j) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(q[j], bcast4(qy + 4 * j)));
  for (int j = 0; j < 4; ++j) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(q[j + 4], bcast4(qy + 16 + 4 * j)));
  return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}

template <int T>
inline void q4_1x8_tile(const uint8_t* wg, int64_t nb, const Q8Rows& y, int64_t m0, float* out, int64_t N,
                        int64_t n0) {
  const __m256i lo = _mm256_set1_epi8(0x0F);
  const bool x2 = !y.two.empty();
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wg + b * Q4X8_BYTES;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
    __m256i q[8];
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 + 32 * j));
      q[j] = _mm256_and_si256(raw, lo);
      q[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo);
    }
    for (int t = 0; t < T; ++t) {
      const int64_t r = (m0 + t) * nb + b;
      if (y.d[r] == 0.f) continue;   // an all-zero block: adds exactly 0
      __m256i s32 = q4_block_dot(q, y.q.data() + r * QK);
      if (x2 && y.two[r])   // the second pass: 256 * hi + lo, exact
        s32 = _mm256_add_epi32(_mm256_slli_epi32(s32, 8), q4_block_dot(q, y.q2.data() + r * QK));
      const __m256 dot = _mm256_cvtepi32_ps(s32);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(y.d[r])), dot, acc[t]);
      acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(y.s[r]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) store8(out + (m0 + t) * N + n0, acc[t], N - n0);
}

// Activation channels kept out of the int8 quantization (zeroed before it) and added back exactly in the tile's
// epilogue: out[m, n] += sum_c xo[m, c] * wo[n, c], wo held per group of 8 weight rows as [G, C, 8] fp32.
struct ExactCols {
  const float* xo = nullptr;   // [M, C]: x[:, idx]
  const float* wo = nullptr;   // [G, C, 8]
  int64_t C = 0;
};

template <int T>
inline void q8_0x8_tile(const int8_t* wg, const uint8_t* dg, int64_t nb, const Q8Rows& y, int64_t m0, float* out,
                        int64_t N, int64_t n0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* w = wg + b * Q8X8_BYTES;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + b * 16)));
    __m256i q[8], a[8];
    for (int c = 0; c < 8; ++c) {
      q[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
      a[c] = _mm256_sign_epi8(q[c], q[c]);
    }
    for (int t = 0; t < T; ++t) {
      const int64_t r = (m0 + t) * nb + b;
      const int8_t* qy = y.q.data() + r * QK;
      __m256i s32 = _mm256_setzero_si256();   // a pair of 128 * 127 products nearly fills int16: madd per chunk
      for (int c = 0; c < 8; ++c) {
        const __m256i p = _mm256_maddubs_epi16(a[c], _mm256_sign_epi8(bcast4(qy + 4 * c), q[c]));
        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(p, ones));
      }
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(y.d[r])), _mm256_cvtepi32_ps(s32), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) store8(out + (m0 + t) * N + n0, acc[t], N - n0);
}

// The exact channels' epilogue, after any ISA level's tiles: out[m, n] = fma(xo[m, c], wo[n, c], out[m, n]) for
// c in order, one rounding each (the stored tile sum is the accumulator, so the bits do not depend on the level).
void add_exact_cols(float* out, int64_t M, int64_t N, const ExactCols& ex) {
  if (ex.C == 0) return;
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = 0; n < N; ++n) {
        float a = out[m * N + n];
        for (int64_t c = 0; c < ex.C; ++c)
          a = std::fma(ex.xo[m * ex.C + c], ex.wo[((n / X8) * ex.C + c) * X8 + n % X8], a);
        out[m * N + n] = a;
      }
  });
}

// ---- the same tiles on VNNI (vpdpbusd: u8 x s8 products, 4 per int32 lane, summed into int32 exactly). The
// integer block dot of each (activation row, weight row) is the same int32 as the AVX2 tiles' maddubs/madd
// chains (those never saturate, see above), and every float op after it is the same op in the same order, so
// the outputs are bit for bit the AVX2 kernels'. Built twice: VEX AVX-VNNI (Alder Lake+, Zen 5) and EVEX
// AVX512-VNNI/VL (Ice Lake+, Zen 4+; 32 vector registers); picked at run time (isa()).
#define EDGEINFER_VNNI_TILES(NAME, TARGET, DPBUSD)                                                              \
  __attribute__((target(TARGET))) inline __m256i q4_block_dot_##NAME(const __m256i* q, const int8_t* qy) {      \
    __m256i s0 = DPBUSD(_mm256_setzero_si256(), q[0], bcast4(qy));                                              \
    __m256i s1 = DPBUSD(_mm256_setzero_si256(), q[4], bcast4(qy + 16));                                         \
    for (int j = 1; j < 4; ++j) {                                                                               \
      s0 = DPBUSD(s0, q[j], bcast4(qy + 4 * j));                                                                \
      s1 = DPBUSD(s1, q[j + 4], bcast4(qy + 16 + 4 * j));                                                       \
    }                                                                                                           \
    return _mm256_add_epi32(s0, s1);                                                                            \
  }                                                                                                             \
  template <int T>                                                                                              \
  __attribute__((target(TARGET))) inline void q4_1x8_tile_##NAME(const uint8_t* wg, int64_t nb, const Q8Rows& y, \
                                                                 int64_t m0, float* out, int64_t N, int64_t n0) { \
    const __m256i lo = _mm256_set1_epi8(0x0F);                                                                  \
    const bool x2 = !y.two.empty();                                                                             \
    __m256 acc[T];                                                                                              \
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();                                                   \
    for (int64_t b = 0; b < nb; ++b) {                                                                          \
      const uint8_t* w = wg + b * Q4X8_BYTES;                                                                   \
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));                  \
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));             \
      __m256i q[8];                                                                                             \
      for (int j = 0; j < 4; ++j) {                                                                             \
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 + 32 * j));              \
        q[j] = _mm256_and_si256(raw, lo);                                                                       \
        q[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo);                                             \
      }                                                                                                         \
      for (int t = 0; t < T; ++t) {                                                                             \
        const int64_t r = (m0 + t) * nb + b;                                                                    \
        if (y.d[r] == 0.f) continue;                                                                            \
        __m256i s32 = q4_block_dot_##NAME(q, y.q.data() + r * QK);                                              \
        if (x2 && y.two[r])                                                                                     \
          s32 = _mm256_add_epi32(_mm256_slli_epi32(s32, 8), q4_block_dot_##NAME(q, y.q2.data() + r * QK));      \
        const __m256 dot = _mm256_cvtepi32_ps(s32);                                                             \
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(y.d[r])), dot, acc[t]);                      \
        acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(y.s[r]), acc[t]);                                           \
      }                                                                                                         \
    }                                                                                                           \
    for (int t = 0; t < T; ++t) store8(out + (m0 + t) * N + n0, acc[t], N - n0);                               \
  }                                                                                                             \
  template <int T>                                                                                              \
  __attribute__((target(TARGET))) inline void q8_0x8_tile_##NAME(const int8_t* wg, const uint8_t* dg, int64_t nb, \
                                                                 const Q8Rows& y, int64_t m0, float* out,       \
                                                                 int64_t N, int64_t n0) {                       \
    __m256 acc[T];                                                                                              \
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();                                                   \
    for (int64_t b = 0; b < nb; ++b) {                                                                          \
      const int8_t* w = wg + b * Q8X8_BYTES;                                                                    \
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + b * 16)));        \
      __m256i q[8], a[8];                                                                                       \
      for (int c = 0; c < 8; ++c) {                                                                             \
        q[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));                                \
        a[c] = _mm256_sign_epi8(q[c], q[c]);                                                                    \
      }                                                                                                         \
      for (int t = 0; t < T; ++t) {                                                                             \
        const int64_t r = (m0 + t) * nb + b;                                                                    \
        const int8_t* qy = y.q.data() + r * QK;                                                                 \
        __m256i s0 = DPBUSD(_mm256_setzero_si256(), a[0], _mm256_sign_epi8(bcast4(qy), q[0]));                  \
        __m256i s1 = DPBUSD(_mm256_setzero_si256(), a[1], _mm256_sign_epi8(bcast4(qy + 4), q[1]));              \
        for (int c = 2; c < 8; c += 2) {                                                                        \
          s0 = DPBUSD(s0, a[c], _mm256_sign_epi8(bcast4(qy + 4 * c), q[c]));                                    \
          s1 = DPBUSD(s1, a[c + 1], _mm256_sign_epi8(bcast4(qy + 4 * c + 4), q[c + 1]));                        \
        }                                                                                                       \
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(y.d[r])),                                     \
                                 _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc[t]);                         \
      }                                                                                                         \
    }                                                                                                           \
    for (int t = 0; t < T; ++t) store8(out + (m0 + t) * N + n0, acc[t], N - n0);                               \
  }

EDGEINFER_VNNI_TILES(avxvnni, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32)
EDGEINFER_VNNI_TILES(avx512vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni", _mm256_dpbusd_epi32)
#undef EDGEINFER_VNNI_TILES

// ---- AVX512-VNNI on 512-bit vectors: TWO x8 groups (16 weight rows) per instruction, the low 256 bits group g,
// the high group g + 1, the activation's 4 bytes broadcast to all 16 lanes. Q4: as above. Q8 x Q8 (AVX-512 has no
// vpsignb): the activations offset to unsigned, u = q + 128 (q ^ 0x80), dot = sum(u * w) - 128 * sum(w), the
// correction from the weights once per block and tile; all exact int32, so again bit for bit the AVX2 kernels'.
#define EDGEINFER_Z "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni"

__attribute__((target(EDGEINFER_Z))) inline __m512i pair_load(const void* a, const void* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

__attribute__((target(EDGEINFER_Z))) inline __m512 pair_f16(const uint8_t* a, const uint8_t* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)))),
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))), 1);
}

__attribute__((target(EDGEINFER_Z))) inline __m512i bcast4z(const void* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

__attribute__((target(EDGEINFER_Z))) inline void store16(float* o, __m512 v, int64_t valid) {
  if (valid >= 16) _mm512_storeu_ps(o, v);
  else _mm512_mask_storeu_ps(o, static_cast<__mmask16>((1u << valid) - 1), v);
}

// One block's integer dot for two x8 groups (16 weight rows) at once (512-bit VNNI).
__attribute__((target(EDGEINFER_Z))) inline __m512i q4_block_dot_z(const __m512i* q, const int8_t* qy) {
  __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], bcast4z(qy));
  __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[4], bcast4z(qy + 16));
  for (int j = 1; j < 4; ++j) {
    s0 = _mm512_dpbusd_epi32(s0, q[j], bcast4z(qy + 4 * j));
    s1 = _mm512_dpbusd_epi32(s1, q[j + 4], bcast4z(qy + 16 + 4 * j));
  }
  return _mm512_add_epi32(s0, s1);
}

template <int T>
__attribute__((target(EDGEINFER_Z))) inline void q4_1x8_pair_z(const uint8_t* wg0, const uint8_t* wg1, int64_t nb,
                                                               const Q8Rows& y, int64_t m0, float* out, int64_t N,
                                                               int64_t n0) {
  const __m512i lo = _mm512_set1_epi8(0x0F);
  const bool x2 = !y.two.empty();
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w0 = wg0 + b * Q4X8_BYTES;
    const uint8_t* w1 = wg1 + b * Q4X8_BYTES;
    const __m512 dw = pair_f16(w0, w1), mw = pair_f16(w0 + 16, w1 + 16);
    __m512i q[8];
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = pair_load(w0 + 32 + 32 * j, w1 + 32 + 32 * j);
      q[j] = _mm512_and_si512(raw, lo);
      q[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo);
    }
    for (int t = 0; t < T; ++t) {
      const int64_t r = (m0 + t) * nb + b;
      if (y.d[r] == 0.f) continue;
      __m512i s32 = q4_block_dot_z(q, y.q.data() + r * QK);
      if (x2 && y.two[r]) s32 = _mm512_add_epi32(_mm512_slli_epi32(s32, 8), q4_block_dot_z(q, y.q2.data() + r * QK));
      const __m512 dot = _mm512_cvtepi32_ps(s32);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(y.d[r])), dot, acc[t]);
      acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(y.s[r]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) store16(out + (m0 + t) * N + n0, acc[t], N - n0);
}

// yu: the activations' int8 q ^ 0x80 (= q + 128 as uint8), [M, K]
template <int T>
__attribute__((target(EDGEINFER_Z))) inline void q8_0x8_pair_z(const int8_t* wg0, const int8_t* wg1,
                                                               const uint8_t* dg0, const uint8_t* dg1, int64_t nb,
                                                               const uint8_t* yu, const Q8Rows& y, int64_t m0,
                                                               float* out, int64_t N, int64_t n0) {
  const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* w0 = wg0 + b * Q8X8_BYTES;
    const int8_t* w1 = wg1 + b * Q8X8_BYTES;
    const __m512 dw = pair_f16(dg0 + b * 16, dg1 + b * 16);
    __m512i q[8];
    __m512i c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      q[c] = pair_load(w0 + 32 * c, w1 + 32 * c);
      q[c + 1] = pair_load(w0 + 32 * c + 32, w1 + 32 * c + 32);
      c0 = _mm512_dpbusd_epi32(c0, off, q[c]);
      c1 = _mm512_dpbusd_epi32(c1, off, q[c + 1]);
    }
    const __m512i corr = _mm512_add_epi32(c0, c1);   // 128 * sum(w) per weight row
    for (int t = 0; t < T; ++t) {
      const int64_t r = (m0 + t) * nb + b;
      const uint8_t* u = yu + r * QK;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bcast4z(u), q[0]);
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bcast4z(u + 4), q[1]);
      for (int c = 2; c < 8; c += 2) {
        s0 = _mm512_dpbusd_epi32(s0, bcast4z(u + 4 * c), q[c]);
        s1 = _mm512_dpbusd_epi32(s1, bcast4z(u + 4 * c + 4), q[c + 1]);
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(s0, s1), corr));
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(y.d[r])), dot, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) store16(out + (m0 + t) * N + n0, acc[t], N - n0);
}

// the instruction set of the x8 GEMMs: 0 = AVX2 (maddubs), 1 = AVX-VNNI (256-bit), 2 = AVX512-VNNI/VL on 256-bit
// vectors, 3 = AVX512-VNNI on 512-bit vectors (pairs of groups; an odd last group on level 2); the best this CPU
// has unless x8_isa() chose a lower one (the tests compare them all)
int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
    return 3;
  if (__builtin_cpu_supports("avxvnni")) return 1;
  return 0;
}
const int BEST_ISA = detect_isa();
int g_isa = BEST_ISA;
int64_t g_z_min_rows = 4;   // level 3 only from this many activation rows (below: level 2; measured in the engine,
                            // 1 and 2 rows ran slower on 512-bit than on 256-bit vectors, docs/KERNELS.md)

template <typename Tile>
void over_tiles(int64_t M, Tile tile) {   // full tiles of X8_TILE activation rows, then the rest
  int64_t m0 = 0;
  for (; m0 + X8_TILE <= M; m0 += X8_TILE) tile(std::integral_constant<int, X8_TILE>{}, m0);
  switch (M - m0) {
    case 3: tile(std::integral_constant<int, 3>{}, m0); break;
    case 2: tile(std::integral_constant<int, 2>{}, m0); break;
    case 1: tile(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

int64_t groups_of(int64_t n) { return (n + X8 - 1) / X8; }

void check_x8(const at::Tensor& w, int64_t n, int64_t row_bytes, at::ScalarType dtype, const char* op,
              const char* what) {
  TORCH_CHECK(n >= 0, op, ": n must be >= 0, got ", n);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == dtype && w.dim() == 2 && w.is_contiguous() &&
                  w.size(0) == groups_of(n) && w.size(1) % row_bytes == 0,
              op, ": ", what, " must be contiguous ", dtype, " [ceil(", n, " / 8) = ", groups_of(n), ", K/32 * ",
              row_bytes, "], got ", w.scalar_type(), " ", w.sizes());
}

void q4_1x8_run(const Q8Rows& y, int64_t M, const at::Tensor& w, int64_t n, float* op);

at::Tensor q4_1x8_gemm(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  check_x8(w, n, Q4X8_BYTES, at::kByte, "q4_1x8_gemm", "weight");
  const int64_t nb = w.size(1) / Q4X8_BYTES, K = nb * QK;
  check_x(x, K, "q4_1x8_gemm");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  q4_1x8_run(quantize_rows(x.data_ptr<float>(), M, K), M, w, n, out.data_ptr<float>());
  return out;
}

// q4_1x8_gemm on activations quantized in two int8 passes (quantize_rows_x2): each block's two integer dots
// combined exactly in int32 (256 * hi + lo) before the fp32 epilogue, so every ISA level still gives the same
// bits; ~15-bit activations for the integer work of about 2M rows but the epilogue and stores of M
at::Tensor q4_1x8_gemm_residual(const at::Tensor& x, const at::Tensor& w, int64_t n, double tau) {
  check_x8(w, n, Q4X8_BYTES, at::kByte, "q4_1x8_gemm_residual", "weight");
  const int64_t nb = w.size(1) / Q4X8_BYTES, K = nb * QK;
  check_x(x, K, "q4_1x8_gemm_residual");
  check_tau(tau, "q4_1x8_gemm_residual");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  q4_1x8_run(quantize_rows_x2(x.data_ptr<float>(), M, K, static_cast<float>(tau)), M, w, n, out.data_ptr<float>());
  return out;
}

// the x8 tiles over M rows of quantized activations y, into op [M, n]
void q4_1x8_run(const Q8Rows& y, int64_t M, const at::Tensor& w, int64_t n, float* op) {
  const int64_t G = w.size(0), nb = w.size(1) / Q4X8_BYTES;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int isa = g_isa == 3 && M < g_z_min_rows ? 2 : g_isa;
  if (isa == 3) {   // pairs of groups
    const int64_t P = (G + 1) / 2;
    at::parallel_for(0, P, std::max<int64_t>(1, P / (4 * at::get_num_threads())), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t g = 2 * p;
        over_tiles(M, [&](auto t, int64_t m0) {
          constexpr int T = decltype(t)::value;
          const uint8_t* wg = wp + g * nb * Q4X8_BYTES;
          if (g + 1 < G) q4_1x8_pair_z<T>(wg, wg + nb * Q4X8_BYTES, nb, y, m0, op, n, g * X8);
          else q4_1x8_tile_avx512vnni<T>(wg, nb, y, m0, op, n, g * X8);
        });
      }
    });
    return;
  }
  at::parallel_for(0, G, std::max<int64_t>(1, G / (4 * at::get_num_threads())), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      over_tiles(M, [&](auto t, int64_t m0) {
        constexpr int T = decltype(t)::value;
        const uint8_t* wg = wp + g * nb * Q4X8_BYTES;
        if (isa >= 2) q4_1x8_tile_avx512vnni<T>(wg, nb, y, m0, op, n, g * X8);
        else if (isa == 1) q4_1x8_tile_avxvnni<T>(wg, nb, y, m0, op, n, g * X8);
        else q4_1x8_tile<T>(wg, nb, y, m0, op, n, g * X8);
      });
  });
}

// Every expert e over its quantized rows off[e] .. off[e + 1] of y, against its slab w[e], into op rows of
// n: the work items of the experts that have rows share one parallel loop. An item is (expert, group of 8 weight
// rows), or at ISA level 3 (expert, pair of groups): 512-bit tiles for an expert with at least g_z_min_rows rows,
// the 256-bit ones below that (both give the same bits, as in q4_1x8_run)
void moe_tiles(const Q8Rows& y, const int64_t* off, int64_t E, const at::Tensor& w, int64_t n, float* op) {
  const int64_t G = w.size(1), nb = w.size(2) / Q4X8_BYTES;
  const int isa = g_isa;
  const int64_t per = isa == 3 ? 2 : 1, units = (G + per - 1) / per;   // groups per item, items per expert
  std::vector<int64_t> items;   // e * units + u for the experts that have rows
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e])
      for (int64_t u = 0; u < units; ++u) items.push_back(e * units + u);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t I = static_cast<int64_t>(items.size());
  at::parallel_for(0, I, std::max<int64_t>(1, I / (4 * at::get_num_threads())), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = items[i] / units, g = (items[i] % units) * per, r0 = off[e];
      const int64_t rows = off[e + 1] - off[e];
      const uint8_t* wg = wp + (e * G + g) * nb * Q4X8_BYTES;
      over_tiles(rows, [&](auto t, int64_t m0) {
        constexpr int T = decltype(t)::value;
        if (isa == 3 && g + 1 < G && rows >= g_z_min_rows) {
          q4_1x8_pair_z<T>(wg, wg + nb * Q4X8_BYTES, nb, y, r0 + m0, op, n, g * X8);
          return;
        }
        for (int64_t j = 0; j < per && g + j < G; ++j) {
          const uint8_t* wj = wg + j * nb * Q4X8_BYTES;
          if (isa >= 2) q4_1x8_tile_avx512vnni<T>(wj, nb, y, r0 + m0, op, n, (g + j) * X8);
          else if (isa == 1) q4_1x8_tile_avxvnni<T>(wj, nb, y, r0 + m0, op, n, (g + j) * X8);
          else q4_1x8_tile<T>(wj, nb, y, r0 + m0, op, n, (g + j) * X8);
        }
      });
    }
  });
}

void check_experts(const at::Tensor& w, int64_t n, const char* op, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() &&
                  w.size(1) == groups_of(n) && w.size(2) % Q4X8_BYTES == 0,
              op, ": ", what, " must be contiguous uint8 [E, ceil(", n, " / 8) = ", groups_of(n), ", K/32 * ",
              Q4X8_BYTES, "], got ", w.scalar_type(), " ", w.sizes());
}

// Mixture-of-experts: rows of x sorted by expert (expert e owns rows offsets[e] .. offsets[e + 1]), expert e's
// weight the slab w[e] of w [E, ceil(n/8), K/32 * 160]. One call runs every expert over its own rows: the
// activations are quantized once for all of them, and the work items (expert, group of 8 weight rows) share one
// parallel loop, so a step's experts are not E calls from Python. Same tiles as q4_1x8_gemm (256-bit at every
// level from 2 up: they give the same bits as level 3's pairs), with the residual two-pass activations if asked.
at::Tensor q4_1x8_moe_gemm(const at::Tensor& x, const at::Tensor& w, int64_t n, const at::Tensor& offsets,
                           bool residual, double tau) {
  check_tau(tau, "q4_1x8_moe_gemm");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() &&
                  w.size(1) == groups_of(n) && w.size(2) % Q4X8_BYTES == 0,
              "q4_1x8_moe_gemm: weight must be contiguous uint8 [E, ceil(", n, " / 8) = ", groups_of(n),
              ", K/32 * ", Q4X8_BYTES, "], got ", w.scalar_type(), " ", w.sizes());
  const int64_t E = w.size(0), G = w.size(1), nb = w.size(2) / Q4X8_BYTES, K = nb * QK;
  check_x(x, K, "q4_1x8_moe_gemm");
  const int64_t M = x.size(0);
  TORCH_CHECK(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                  offsets.is_contiguous() && offsets.size(0) == E + 1,
              "q4_1x8_moe_gemm: offsets must be contiguous int64 [E + 1 = ", E + 1, "], got ",
              offsets.scalar_type(), " ", offsets.sizes());
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == M, "q4_1x8_moe_gemm: offsets must run from 0 to M = ", M, ", got ", off[0],
              " .. ", off[E]);
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(off[e] <= off[e + 1], "q4_1x8_moe_gemm: offsets must not decrease (expert ", e, ")");
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  const Q8Rows y = residual ? quantize_rows_x2(x.data_ptr<float>(), M, K, static_cast<float>(tau))
                            : quantize_rows(x.data_ptr<float>(), M, K);
  moe_tiles(y, off, E, w, n, out.data_ptr<float>());
  return out;
}

// The whole routed-expert MLP of a layer in one call: y[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) *
// up_e(x[t])), e = ids[t, j]. The (token, slot) pairs are counting-sorted by expert; each token's activations are
// quantized once (not once per chosen expert) and their int8 rows gathered into expert order; the gate/up GEMM
// runs every expert over its rows (moe_tiles), silu(gate) * up stays in expert order, is quantized and runs through
// the down GEMM the same way; each token then sums its k rows in slot order times their weights. Nothing is
// handed back to Python between the steps (the grouped GEMM alone left ~25 small torch ops per layer around it).
at::Tensor q4_1x8_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w_gu,
                      const at::Tensor& w_dn, int64_t inter, bool residual, double tau) {
  const char* op = "q4_1x8_moe";
  check_tau(tau, op);
  TORCH_CHECK(inter > 0 && inter % QK == 0, op, ": intermediate size ", inter, " must be a positive multiple of ", QK);
  check_experts(w_gu, 2 * inter, op, "w_gu");
  const int64_t E = w_gu.size(0), H = (w_gu.size(2) / Q4X8_BYTES) * QK;
  check_experts(w_dn, H, op, "w_dn");
  TORCH_CHECK(w_dn.size(0) == E && (w_dn.size(2) / Q4X8_BYTES) * QK == inter, op, ": w_dn ", w_dn.sizes(),
              " must hold ", E, " experts of [", H, ", ", inter, "]");
  check_x(x, H, op);
  const int64_t T = x.size(0);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.is_contiguous() &&
                  ids.size(0) == T, op, ": ids must be contiguous int64 [", T, ", k], got ", ids.scalar_type(), " ",
              ids.sizes());
  TORCH_CHECK(weights.device().is_cpu() && weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  weights.sizes() == ids.sizes(), op, ": weights must be contiguous float32 ", ids.sizes(), ", got ",
              weights.scalar_type(), " ", weights.sizes());
  const int64_t k = ids.size(1), P = T * k, nbh = H / QK;
  at::Tensor out = at::zeros({T, H}, x.options());
  if (P == 0) return out;
  const int64_t* id = ids.data_ptr<int64_t>();
  // order: sorted position -> pair; where: the inverse (-1: a pair whose expert is on another rank, id -1: skipped)
  std::vector<int64_t> off(E + 1, 0), order, where(P, -1);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] >= -1 && id[p] < E, op, ": ids[", p / k, ", ", p % k, "] = ", id[p], " is outside [-1, ", E,
                ")");
    if (id[p] >= 0) ++off[id[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  order.resize(off[E]);
  {
    std::vector<int64_t> cursor(off.begin(), off.end() - 1);
    for (int64_t p = 0; p < P; ++p)
      if (id[p] >= 0) {
        order[cursor[id[p]]] = p;
        where[p] = cursor[id[p]]++;
      }
  }
  const int64_t S = off[E];   // the pairs this call computes
  // the tokens' quantized rows, gathered into expert order (one per pair)
  const Q8Rows qx = residual ? quantize_rows_x2(x.data_ptr<float>(), T, H, static_cast<float>(tau))
                             : quantize_rows(x.data_ptr<float>(), T, H);
  Q8Rows ys{std::vector<int8_t>(S * H), std::vector<float>(S * nbh), std::vector<float>(S * nbh)};
  if (residual) ys.q2.resize(S * H), ys.two.resize(S * nbh);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t src = order[i] / k;
    std::memcpy(ys.q.data() + i * H, qx.q.data() + src * H, H);
    std::memcpy(ys.d.data() + i * nbh, qx.d.data() + src * nbh, nbh * sizeof(float));
    std::memcpy(ys.s.data() + i * nbh, qx.s.data() + src * nbh, nbh * sizeof(float));
    if (residual) {
      std::memcpy(ys.q2.data() + i * H, qx.q2.data() + src * H, H);
      std::memcpy(ys.two.data() + i * nbh, qx.two.data() + src * nbh, nbh);
    }
  }
  const int64_t n1 = 2 * inter;
  std::vector<float> h(S * n1);
  moe_tiles(ys, off.data(), E, w_gu, n1, h.data());
  std::vector<float> act(S * inter);   // silu(gate) * up, expert order
  at::parallel_for(0, S, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* hi = h.data() + i * n1;
      for (int64_t j = 0; j < inter; ++j) {
        const float g = hi[j], u = hi[inter + j];
        act[i * inter + j] = g / (1.0f + std::exp(-g)) * u;
      }
    }
  });
  const Q8Rows ya = residual ? quantize_rows_x2(act.data(), S, inter, static_cast<float>(tau))
                             : quantize_rows(act.data(), S, inter);
  std::vector<float> rows(S * H);
  moe_tiles(ya, off.data(), E, w_dn, H, rows.data());
  const float* wt = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = t * k + j;
        if (where[p] < 0) continue;
        const float w = wt[p];
        const float* a = rows.data() + where[p] * H;
        float* y = o + t * H;
        for (int64_t c = 0; c < H; ++c) y[c] += w * a[c];
      }
  });
  return out;
}

void check_q8x8(const at::Tensor& qs, const at::Tensor& d, int64_t n, const char* op) {
  check_x8(qs, n, Q8X8_BYTES, at::kChar, op, "qs");
  const int64_t G = qs.size(0), nb = qs.size(1) / Q8X8_BYTES;
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 2 && d.size(0) == G &&
                  d.size(1) == nb * X8,
              op, ": d must be contiguous fp16 [", G, ", ", nb * X8, "], got ", d.scalar_type(), " ", d.sizes());
}

at::Tensor q8_0x8_run(const float* x, int64_t M, const at::Tensor& qs, const at::Tensor& d, int64_t n,
                      const ExactCols& ex, const at::TensorOptions& opts) {
  const int64_t G = qs.size(0), nb = qs.size(1) / Q8X8_BYTES, K = nb * QK;
  at::Tensor out = at::empty({M, n}, opts);
  if (M == 0 || n == 0) return out;
  const Q8Rows y = quantize_rows(x, M, K);
  const int8_t* wp = qs.data_ptr<int8_t>();
  const uint8_t* dp = reinterpret_cast<const uint8_t*>(d.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  const int isa = g_isa == 3 && M < g_z_min_rows ? 2 : g_isa;
  if (isa == 3) {   // pairs of groups, on the activations offset to unsigned
    std::vector<uint8_t> yu(M * K);
    for (int64_t i = 0; i < M * K; ++i) yu[i] = static_cast<uint8_t>(y.q[i]) ^ 0x80;
    const int64_t P = (G + 1) / 2;
    at::parallel_for(0, P, std::max<int64_t>(1, P / (4 * at::get_num_threads())), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t g = 2 * p;
        over_tiles(M, [&](auto t, int64_t m0) {
          constexpr int T = decltype(t)::value;
          const int8_t* wg = wp + g * nb * Q8X8_BYTES;
          const uint8_t* dg = dp + g * nb * 16;
          if (g + 1 < G)
            q8_0x8_pair_z<T>(wg, wg + nb * Q8X8_BYTES, dg, dg + nb * 16, nb, yu.data(), y, m0, op, n, g * X8);
          else q8_0x8_tile_avx512vnni<T>(wg, dg, nb, y, m0, op, n, g * X8);
        });
      }
    });
    add_exact_cols(op, M, n, ex);
    return out;
  }
  at::parallel_for(0, G, std::max<int64_t>(1, G / (4 * at::get_num_threads())), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      over_tiles(M, [&](auto t, int64_t m0) {
        constexpr int T = decltype(t)::value;
        const int8_t* wg = wp + g * nb * Q8X8_BYTES;
        const uint8_t* dg = dp + g * nb * 16;
        if (isa >= 2) q8_0x8_tile_avx512vnni<T>(wg, dg, nb, y, m0, op, n, g * X8);
        else if (isa == 1) q8_0x8_tile_avxvnni<T>(wg, dg, nb, y, m0, op, n, g * X8);
        else q8_0x8_tile<T>(wg, dg, nb, y, m0, op, n, g * X8);
      });
  });
  add_exact_cols(op, M, n, ex);
  return out;
}

at::Tensor q8_0x8_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t n) {
  check_q8x8(qs, d, n, "q8_0x8_gemm");
  check_x(x, qs.size(1) / Q8X8_BYTES * QK, "q8_0x8_gemm");
  return q8_0x8_run(x.data_ptr<float>(), x.size(0), qs, d, n, ExactCols{}, x.options());
}

// q8_0x8_gemm with the activation channels idx [C] taken out of the int8 quantization (zeroed before it) and
// added back in fp32 against wo [G, C, 8] (the exact fp32 weight columns, from q8_0x8_columns).
at::Tensor q8_0x8_gemm_exact(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t n,
                             const at::Tensor& idx, const at::Tensor& wo) {
  check_q8x8(qs, d, n, "q8_0x8_gemm_exact");
  const int64_t K = qs.size(1) / Q8X8_BYTES * QK;
  check_x(x, K, "q8_0x8_gemm_exact");
  const int64_t C = idx.numel(), M = x.size(0);
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1 && idx.is_contiguous(),
              "q8_0x8_gemm_exact: idx must be a contiguous int64 [C] tensor, got ", idx.scalar_type(), " ", idx.sizes());
  TORCH_CHECK(wo.scalar_type() == at::kFloat && wo.is_contiguous() && wo.dim() == 3 && wo.size(0) == qs.size(0) &&
                  wo.size(1) == C && wo.size(2) == X8,
              "q8_0x8_gemm_exact: wo must be contiguous fp32 [", qs.size(0), ", ", C, ", 8], got ", wo.scalar_type(),
              " ", wo.sizes());
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c)
    TORCH_CHECK(ip[c] >= 0 && ip[c] < K, "q8_0x8_gemm_exact: channel ", ip[c], " out of [0, ", K, ")");
  const float* xp = x.data_ptr<float>();
  std::vector<float> xz(xp, xp + M * K), xo(M * C);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) {
      xo[m * C + c] = xp[m * K + ip[c]];
      xz[m * K + ip[c]] = 0.f;
    }
  return q8_0x8_run(xz.data(), M, qs, d, n, ExactCols{xo.data(), wo.data_ptr<float>(), C}, x.options());
}

// q4_1x8 -> fp32 [n, K] (gguf's values, as q4_1_dequant)
at::Tensor q4_1x8_dequant(const at::Tensor& w, int64_t n, const at::Tensor& out) {
  check_x8(w, n, Q4X8_BYTES, at::kByte, "q4_1x8_dequant", "weight");
  const int64_t nb = w.size(1) / Q4X8_BYTES, K = nb * QK;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == n &&
                  out.size(1) == K,
              "q4_1x8_dequant: out must be contiguous float32 [", n, ", ", K, "], got ", out.scalar_type(), " ",
              out.sizes());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const __m128i lo = _mm_set1_epi8(0x0F);
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t g = row / X8, l = row % X8;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wp + (g * nb + b) * Q4X8_BYTES;
        const __m256 d = _mm256_set1_ps(f16(blk + 2 * l)), m = _mm256_set1_ps(f16(blk + 16 + 2 * l));
        int32_t c[4];
        for (int j = 0; j < 4; ++j) __builtin_memcpy(&c[j], blk + 32 + 32 * j + 4 * l, 4);
        const __m128i raw = _mm_setr_epi32(c[0], c[1], c[2], c[3]);
        const __m128i q[2] = {_mm_and_si128(raw, lo), _mm_and_si128(_mm_srli_epi16(raw, 4), lo)};
        float* o = op + row * K + b * QK;
        for (int h = 0; h < 2; ++h) {
          const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[h]));
          const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q[h], 8)));
          _mm256_storeu_ps(o + 16 * h, _mm256_add_ps(_mm256_mul_ps(f0, d), m));
          _mm256_storeu_ps(o + 16 * h + 8, _mm256_add_ps(_mm256_mul_ps(f1, d), m));
        }
      }
    }
  });
  return out;
}

// q8_0x8 rows [g0 * 8, g0 * 8 + out.size(0)) -> fp32 (a chunk of the head at a time)
at::Tensor q8_0x8_dequant(const at::Tensor& qs, const at::Tensor& d, int64_t row0, const at::Tensor& out) {
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && qs.dim() == 2 &&
                  qs.size(1) % Q8X8_BYTES == 0 && d.scalar_type() == at::kHalf && d.is_contiguous() &&
                  d.numel() * 32 == qs.numel(),
              "q8_0x8_dequant: qs must be contiguous int8 [G, K/32 * 256] and d fp16 [G, K/32 * 8], got ",
              qs.sizes(), " and ", d.sizes());
  const int64_t nb = qs.size(1) / Q8X8_BYTES, K = nb * QK, rows = out.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(1) == K &&
                  row0 >= 0 && row0 + rows <= qs.size(0) * X8,
              "q8_0x8_dequant: out must be contiguous float32 [rows, ", K, "] within the ", qs.size(0) * X8,
              " rows from row0 ", row0, ", got ", out.sizes());
  const int8_t* wp = qs.data_ptr<int8_t>();
  const uint8_t* dp = reinterpret_cast<const uint8_t*>(d.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t row = row0 + i, g = row / X8, l = row % X8;
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 s = _mm256_set1_ps(f16(dp + ((g * nb + b) * X8 + l) * 2));
        const int8_t* blk = wp + (g * nb + b) * Q8X8_BYTES + 4 * l;
        for (int c = 0; c < 8; c += 2) {
          int32_t v[2];
          __builtin_memcpy(&v[0], blk + 32 * c, 4);
          __builtin_memcpy(&v[1], blk + 32 * (c + 1), 4);
          const __m128i q = _mm_setr_epi32(v[0], v[1], 0, 0);
          _mm256_storeu_ps(op + i * K + b * QK + 4 * c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s));
        }
      }
    }
  });
  return out;
}

// isa < 0: leave it; else use the highest level <= isa this CPU runs. Returns the one in use (0 AVX2, 1 AVX-VNNI,
// 2 AVX512-VNNI 256-bit, 3 AVX512-VNNI 512-bit)
// The levels are not a chain: a CPU can have AVX512-VNNI without AVX-VNNI (AMD Zen 4), so a level is lowered
// to the next one below it that this CPU runs, never to one it lacks (an illegal instruction)
bool isa_supported(int level) {
  if (level == 1) return __builtin_cpu_supports("avxvnni");
  return level == 0 || level <= BEST_ISA;
}

int64_t x8_isa(int64_t isa) {
  if (isa >= 0) {
    int level = static_cast<int>(std::min<int64_t>(isa, BEST_ISA));
    while (level > 0 && !isa_supported(level)) --level;
    g_isa = level;
  }
  return g_isa;
}

int64_t x8_z_min_rows(int64_t rows) {   // rows < 0: leave it; returns the one in use
  if (rows >= 0) g_z_min_rows = rows;
  return g_z_min_rows;
}

}  // namespace

TORCH_LIBRARY(edgeinfer_cpu, m) {
  m.def("q8_quantize", &q8_quantize);
  m.def("q4_1_gemm", &q4_1_gemm);
  m.def("q8_0_gemm", &q8_0_gemm);
  m.def("q4_1_dequant", &q4_1_dequant);
  m.def("q8_0_dequant", &q8_0_dequant);
  m.def("q4_1x8_gemm", &q4_1x8_gemm);
  m.def("q4_1x8_gemm_residual", &q4_1x8_gemm_residual);
  m.def("q4_1x8_moe_gemm", &q4_1x8_moe_gemm);
  m.def("q4_1x8_moe", &q4_1x8_moe);
  m.def("q8_0x8_gemm", &q8_0x8_gemm);
  m.def("q8_0x8_gemm_exact", &q8_0x8_gemm_exact);
  m.def("q4_1x8_dequant", &q4_1x8_dequant);
  m.def("q8_0x8_dequant", &q8_0x8_dequant);
  m.def("x8_isa", &x8_isa);
  m.def("x8_z_min_rows", &x8_z_min_rows);
}
