// Fused CPU kernels of hlat_model: RMSNorm, SwiGLU, the RoPE head split, the cross entropy
// of rows of logits and blocked attention's softmax, forward and backward, each one pass over
// its rows where torch's eager operators make one pass per operation; and causal attention
// flash style (bf16 on AMX tiles or with AVX512-BF16 dot products, fp32 on AVX-512 or AVX2),
// plain or within packed documents, written with intrinsics, the bf16 one also reading q, k
// and v from the fused qkv product with RoPE applied as it reads them.
//
// Built on first use by hlat_model._native (the host compiler, -O3 -march=native) and called
// through ctypes on the raw data of contiguous fp32 or bf16 tensors. All arithmetic is fp32;
// bf16 values are widened by a shift and narrowed once, round to nearest even (NaN stays NaN),
// as torch rounds. Loops are plain C++ that the compiler vectorises, or written with its
// 16-lane vector types where it would not; reductions keep 16 partial sums, combined in a
// fixed order, so results do not depend on the thread count (the weight gradient of RMSNorm
// sums per-part partials, parts fixed by the caller).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#define HLAT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define HLAT_AVX2 1
#include <immintrin.h>
#endif
#if defined(HLAT_AVX512) || defined(HLAT_AVX2)
#define HLAT_F32_FLASH 1  // the fp32 flash attention: AVX-512F, or AVX2 with FMA
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HLAT_BF16 1
#endif
#if defined(HLAT_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HLAT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using u16 = uint16_t;
using u32 = uint32_t;

constexpr int kLanes = 16;

// The same bits as another type of the same size (std::bit_cast before C++20).
template <typename To, typename From>
inline To same_bits(From v) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

// Asks for the cache lines of `bytes` bytes at p ahead of their use: the rows that the
// attention kernels read from the fused qkv product (and the output's gradient) lie a
// position's heads apart, kilobytes, where the hardware's prefetchers, which follow a page,
// miss most of them; `write`: lines about to be written. Built with -DHLAT_NO_PREFETCH (the
// benchmark's other build), nothing.
inline void prefetch_row(const void* p, int64_t bytes, bool write = false) {
#ifndef HLAT_NO_PREFETCH
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
    if (write) {
      __builtin_prefetch(c + i, 1);
    } else {
      __builtin_prefetch(c + i);
    }
  }
#else
  (void)p, (void)bytes, (void)write;
#endif
}

inline u16 to_bf16(float f) {
  const u32 b = same_bits<u32>(f);
  const u32 rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? u16(0x7FC0) : u16(rounded);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const u16* p, int64_t i) { return same_bits<float>(u32(p[i]) << 16); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(u16* p, int64_t i, float v) { p[i] = to_bf16(v); }
// v rounded to T's precision (the value a T tensor would hold), as fp32.
inline float rounded(const float*, float v) { return v; }
inline float rounded(const u16*, float v) { return same_bits<float>(u32(to_bf16(v)) << 16); }

// ---------------------------------------------------------------------------------------
// RMSNorm: out = round(round(x * rstd) * w), rstd = 1 / sqrt(mean(x^2) + eps) per row.

template <typename T>
float sum_of_squares(const T* __restrict x, int64_t dim) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = load(x, j + l);
      lanes[l] += v * v;
    }
  }
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (; j < dim; ++j) {
    const float v = load(x, j);
    s += v * v;
  }
  return s;
}

template <typename T>
float rms_norm_row(const T* __restrict xr, const T* __restrict w, T* __restrict o, int64_t dim,
                   float eps) {
  const float rs = 1.f / std::sqrt(sum_of_squares(xr, dim) / float(dim) + eps);
  for (int64_t j = 0; j < dim; ++j) store(o, j, rounded(o, load(xr, j) * rs) * load(w, j));
  return rs;
}

template <typename T>
void rms_norm_forward(const T* x, const T* w, T* out, float* rstd, int64_t rows, int64_t dim,
                      float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    rstd[r] = rms_norm_row(x + r * dim, w, out + r * dim, dim, eps);
  }
}

// The residual add before a norm: sum = round(x + d), then sum's RMSNorm, row by row, so
// the norm reads each row of the sum while it is in cache.
template <typename T>
void add_rms_norm_forward(const T* x, const T* d, const T* w, T* sum, T* out, float* rstd,
                          int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict xr = x + r * dim;
    const T* __restrict dr = d + r * dim;
    T* __restrict sr = sum + r * dim;
    for (int64_t j = 0; j < dim; ++j) store(sr, j, load(xr, j) + load(dr, j));
    rstd[r] = rms_norm_row(static_cast<const T*>(sr), w, out + r * dim, dim, eps);
  }
}

// grad_x = rstd * (d - n * mean(d * n)) [+ res], d = g * w, n = x * rstd (unrounded), in
// fp32, rounded once; `res` (null for none) is the gradient x gets besides the norm's (the
// residual stream's, when x is a residual add's sum). part[p] holds the sum of g * round(n)
// over the rows of part p (the weight's gradient).
template <typename T>
void rms_norm_backward(const T* g, const T* x, const T* w, const float* rstd, const T* res,
                       T* gx, float* part, int64_t rows, int64_t dim, int parts, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
  for (int p = 0; p < parts; ++p) {
    float* __restrict acc = part + int64_t(p) * dim;
    for (int64_t j = 0; j < dim; ++j) acc[j] = 0.f;
    const int64_t begin = rows * p / parts, end = rows * (p + 1) / parts;
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict gr = g + r * dim;
      const T* __restrict xr = x + r * dim;
      T* __restrict o = gx + r * dim;
      const float rs = rstd[r];
      float lanes[kLanes] = {};
      int64_t j = 0;
      for (; j + kLanes <= dim; j += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          const float gv = load(gr, j + l), n = load(xr, j + l) * rs;
          lanes[l] += gv * load(w, j + l) * n;
          acc[j + l] += gv * rounded(o, n);
        }
      }
      float dot = 0.f;
      for (int l = 0; l < kLanes; ++l) dot += lanes[l];
      for (; j < dim; ++j) {
        const float gv = load(gr, j), n = load(xr, j) * rs;
        dot += gv * load(w, j) * n;
        acc[j] += gv * rounded(o, n);
      }
      dot /= float(dim);
      if (res != nullptr) {
        const T* __restrict rr = res + r * dim;
        for (j = 0; j < dim; ++j) {
          const float n = load(xr, j) * rs;
          store(o, j, (load(gr, j) * load(w, j) - n * dot) * rs + load(rr, j));
        }
      } else {
        for (j = 0; j < dim; ++j) {
          const float n = load(xr, j) * rs;
          store(o, j, (load(gr, j) * load(w, j) - n * dot) * rs);
        }
      }
    }
  }
}

template <typename T>
void sum_parts(const float* part, T* gw, int64_t dim, int parts) {
  for (int64_t j = 0; j < dim; ++j) {
    float s = 0.f;
    for (int p = 0; p < parts; ++p) s += part[int64_t(p) * dim + j];
    store(gw, j, s);
  }
}

// ---------------------------------------------------------------------------------------
// SwiGLU of gate_up = [gate | up] (each row's two halves): out = silu(gate) * up.

// exp(x) within 2 fp32 units in the last place: x = n ln2 + r with ln2 in two parts, exp(r)
// by Cephes' polynomial, 2^n from exponent bits, computed on x clamped to [-87, 88]; below
// -87.4 the result is 0 (exp's true value there is under 1.2e-38, fp32's least normal) and
// above 88.7 inf. NaN stays NaN. Clamps are written as comparisons, which compile to vector
// min/max and blends (fmin/fmax would stay calls).
inline float exp_fast(float x) {
  float c = x > 88.0f ? 88.0f : x;
  c = c < -87.0f ? -87.0f : c;
  const float n = std::floor(c * 1.44269504088896341f + 0.5f);
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float e = (p * r * r + r + 1.0f) * same_bits<float>(u32(int32_t(n) + 127) << 23);
  e = x < -87.4f ? 0.0f : e;
  e = x > 88.72f ? INFINITY : e;
  return e;
}

inline float sigmoid(float v) { return 1.0f / (1.0f + exp_fast(-v)); }

// Where gate and up of output column j lie in a row of gate_up: the two halves (gate j, up
// width + j), or interleaved (gate 2j, up 2j + 1: the fused product's own row order).
template <bool kInterleaved>
inline int64_t gate_at(int64_t j) {
  return kInterleaved ? 2 * j : j;
}
template <bool kInterleaved>
inline int64_t up_at(int64_t j, int64_t width) {
  return kInterleaved ? 2 * j + 1 : width + j;
}

template <bool kInterleaved, typename T>
void swiglu_forward(const T* gate_up, T* out, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict row = gate_up + r * 2 * width;
    T* __restrict o = out + r * width;
    for (int64_t j = 0; j < width; ++j) {
      const float g = load(row, gate_at<kInterleaved>(j));
      store(o, j, g * sigmoid(g) * load(row, up_at<kInterleaved>(j, width)));
    }
  }
}

// d up = d * silu(g); d gate = d * up * s * (1 + g * (1 - s)), s = sigmoid(g).
template <bool kInterleaved, typename T>
void swiglu_backward(const T* grad, const T* gate_up, T* grad_gate_up, int64_t rows,
                     int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict row = gate_up + r * 2 * width;
    const T* __restrict d = grad + r * width;
    T* __restrict out = grad_gate_up + r * 2 * width;
    for (int64_t j = 0; j < width; ++j) {
      const int64_t gi = gate_at<kInterleaved>(j), ui = up_at<kInterleaved>(j, width);
      const float g = load(row, gi), dv = load(d, j), s = sigmoid(g);
      store(out, ui, dv * (g * s));
      store(out, gi, dv * load(row, ui) * (s * (1.0f + g * (1.0f - s))));
    }
  }
}


// ---------------------------------------------------------------------------------------
// q, k and v out of the fused qkv product ([B, S, G, P, D] rows, P = q heads per group + 2),
// RoPE applied to q and k (half-split pairs, fp32 cos/sin of [D/2] per batch and position),
// written as contiguous [B, heads, S, D] tensors; backward the inverse (sin negated).

struct Heads {
  int64_t batch, seq, groups, q_per_kv, head_dim, cos_batch, cos_seq;
};

// dst = rotate(src) by (c, sign * s); in place of each other's halves, as apply_rope.
template <typename S, typename D>
inline void rotate(const S* __restrict src, D* __restrict dst, const float* __restrict c,
                   const float* __restrict s, float sign, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(src, i), x2 = load(src, i + half), sn = sign * s[i];
    store(dst, i, x1 * c[i] - x2 * sn);
    store(dst, i + half, x2 * c[i] + x1 * sn);
  }
}

template <typename T>
inline void copy_row(const T* __restrict src, T* __restrict dst, int64_t n) {
  std::memcpy(dst, src, sizeof(T) * n);
}

// forward (grad = false): fused -> q, k, v. backward (grad = true): q, k, v (gradients; any
// may be null: zeros) -> fused.
template <typename T>
void rope_heads(const Heads& h, T* fused, T* q, T* k, T* v, const float* cos, const float* sin,
                bool grad, int threads) {
  const int64_t per = h.q_per_kv + 2, d = h.head_dim, half = d / 2;
  const int64_t heads = h.groups * h.q_per_kv, rows = h.batch * h.seq;
  const float sign = grad ? -1.f : 1.f;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / h.seq, t = r % h.seq;
    const float* c = cos + b * h.cos_batch + t * h.cos_seq;
    const float* s = sin + b * h.cos_batch + t * h.cos_seq;
    T* row = fused + r * h.groups * per * d;
    for (int64_t g = 0; g < h.groups; ++g) {
      for (int64_t p = 0; p < per; ++p) {
        T* x = row + (g * per + p) * d;
        T* other;
        if (p < h.q_per_kv) {
          other = q ? q + ((b * heads + g * h.q_per_kv + p) * h.seq + t) * d : nullptr;
        } else if (p == h.q_per_kv) {
          other = k ? k + ((b * h.groups + g) * h.seq + t) * d : nullptr;
        } else {
          other = v ? v + ((b * h.groups + g) * h.seq + t) * d : nullptr;
        }
        if (other == nullptr) {
          std::memset(x, 0, sizeof(T) * d);  // only in backward: an unused output
        } else if (p > h.q_per_kv) {
          grad ? copy_row(other, x, d) : copy_row(x, other, d);
        } else {
          grad ? rotate(other, x, c, s, sign, half) : rotate(x, other, c, s, sign, half);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Cross entropy of rows of logits against target columns (a target < 0 or >= vocab: the
// row is ignored by the caller; its picked logit is 0).

// Written with the compiler's vector types (16 lanes: one AVX-512 register, two AVX2 ones;
// the same operations in the same order on every target): its vectoriser leaves a maximum or
// a sum over lanes written as scalars unvectorised, or half as wide.
using f32x16 = float __attribute__((vector_size(64)));
using u32x16 = u32 __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
using u16x16 = u16 __attribute__((vector_size(32)));

inline f32x16 splat(float v) { return f32x16{} + v; }

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f32x16 load16(const u16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return same_bits<f32x16>(__builtin_convertvector(h, u32x16) << 16);
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
// to_bf16 on 16 lanes: nearest even, NaN to the quiet NaN.
inline void store16(u16* p, f32x16 v) {
  const u32x16 b = same_bits<u32x16>(v);
  const u32x16 rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const u32x16 bits = (b & 0x7FFFFFFFu) > 0x7F800000u ? u32x16{} + 0x7FC0u : rounded;
  const u16x16 h = __builtin_convertvector(bits, u16x16);
  std::memcpy(p, &h, sizeof(h));
}

// Lanes summed in a fixed order (pairwise).
inline float lane_sum(f32x16 v) {
  float half[8];
  for (int l = 0; l < 8; ++l) half[l] = v[l] + v[l + 8];
  for (int l = 0; l < 4; ++l) half[l] += half[l + 4];
  return (half[0] + half[2]) + (half[1] + half[3]);
}

// exp(r) for |r| <= ln(2) / 2 on the lanes of a vector type of the compiler (16 or 8 floats),
// by exp_fast's (Cephes') polynomial.
template <typename V>
inline V exp_reduced_lanes(V r) {
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}
inline f32x16 exp_reduced16v(f32x16 r) { return exp_reduced_lanes(r); }

// exp_fast on 16 lanes: its steps, with n rounded to nearest by adding and subtracting
// 1.5 * 2^23 (floor(x + 0.5) but at ties, where either n is as good).
inline f32x16 exp16v(f32x16 x) {
  f32x16 c = x > 88.0f ? splat(88.0f) : x;
  c = c < -87.0f ? splat(-87.0f) : c;
  const f32x16 shifter = splat(12582912.0f);
  const f32x16 n = (c * 1.44269504088896341f + shifter) - shifter;
  f32x16 r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const i32x16 scale = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 e = exp_reduced16v(r) * same_bits<f32x16>(scale);
  e = x < -87.4f ? f32x16{} : e;
  return x > 88.72f ? splat(INFINITY) : e;
}

// The largest element of a row (NaN is skipped here and comes back through the sum of
// exponentials).
template <typename T>
float row_max(const T* __restrict x, int64_t n) {
  f32x16 m = {};
  m -= INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const f32x16 v = load16(x + j);
    m = v > m ? v : m;
  }
  float best = -INFINITY;
  for (int l = 0; l < kLanes; ++l) best = m[l] > best ? m[l] : best;
  for (; j < n; ++j) best = load(x, j) > best ? load(x, j) : best;
  return best;
}

// The sum of exp(x - shift) over a row, each exponential also written to `keep` where given.
template <typename T>
float sum_exp(const T* __restrict x, int64_t n, float shift, float* __restrict keep = nullptr) {
  f32x16 a = {}, b = {};  // two chains of sums
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    const f32x16 u = exp16v(load16(x + j) - shift), v = exp16v(load16(x + j + kLanes) - shift);
    if (keep != nullptr) {
      store16(keep + j, u);
      store16(keep + j + kLanes, v);
    }
    a += u;
    b += v;
  }
  for (; j + kLanes <= n; j += kLanes) {
    const f32x16 u = exp16v(load16(x + j) - shift);
    if (keep != nullptr) store16(keep + j, u);
    a += u;
  }
  float s = lane_sum(a + b);
  for (; j < n; ++j) {
    const float u = exp_fast(load(x, j) - shift);
    if (keep != nullptr) keep[j] = u;
    s += u;
  }
  return s;
}

// lse[r] = log(sum(exp(x))) and picked[r] = x[target] of each row; with `grad_scale`, the
// row is overwritten with its logits' gradient (softmax(x) - onehot(target)) * grad_scale[r],
// rounded once.
template <typename T>
void xent_forward(T* logits, int64_t rows, int64_t vocab, const int64_t* targets, float* lse,
                  float* picked, const float* grad_scale, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // a row's exponentials, computed once for its sum and kept for its gradient
    std::vector<float> e(grad_scale != nullptr ? static_cast<size_t>(vocab) : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* __restrict x = logits + r * vocab;
      const int64_t t = targets[r];
      const bool counted = t >= 0 && t < vocab;
      const float m = row_max(x, vocab);
      const float s = sum_exp(x, vocab, m, grad_scale != nullptr ? e.data() : nullptr);
      const float target_logit = counted ? load(x, t) : 0.f;
      lse[r] = std::log(s) + m;
      picked[r] = target_logit;
      if (grad_scale != nullptr) {
        const float c = grad_scale[r], inv = 1.f / s;
        int64_t j = 0;
        for (; j + kLanes <= vocab; j += kLanes) store16(x + j, load16(e.data() + j) * inv * c);
        for (; j < vocab; ++j) store(x, j, e[j] * inv * c);
        if (counted) store(x, t, (e[t] * inv - 1.f) * c);
      }
    }
  }
}

// grad[r, j] = (exp(x[r, j] - lse[r]) - [j == target]) * scale[r].
template <typename T>
void xent_backward(const T* logits, int64_t rows, int64_t vocab, const int64_t* targets,
                   const float* lse, const float* scale, T* grad, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict x = logits + r * vocab;
    T* __restrict g = grad + r * vocab;
    const float l = lse[r], c = scale[r];
    const int64_t t = targets[r];
    int64_t j = 0;
    for (; j + kLanes <= vocab; j += kLanes) store16(g + j, exp16v(load16(x + j) - l) * c);
    for (; j < vocab; ++j) store(g, j, exp_fast(load(x, j) - l) * c);
    if (t >= 0 && t < vocab) store(g, t, (exp_fast(load(x, t) - l) - 1.f) * c);
  }
}


// ---------------------------------------------------------------------------------------
// Attention: the softmax of blocks of scores and its backward, in place, for blocked causal
// attention. A block is `rows` queries against `width` keys; with `first` >= 0 it is causal,
// query r of a block (position first + r) seeing keys up to its own position, the rest of
// its row written 0; with `first` < 0 every key counts (the caller masked the scores).

inline int64_t seen_keys(int64_t r, int64_t rows, int64_t width, int64_t first) {
  if (first < 0) return width;
  const int64_t seen = first + r % rows + 1;
  return seen < width ? seen : width;
}

template <typename T>
void attn_softmax(T* scores, int64_t blocks, int64_t rows, int64_t width, int64_t first,
                  int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // each row's exponentials, computed once, then scaled into the row
    std::vector<float> exps(static_cast<size_t>(width));
    float* __restrict e = exps.data();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < blocks * rows; ++r) {
      T* __restrict x = scores + r * width;
      const int64_t seen = seen_keys(r, rows, width, first);
      const float m = row_max(x, seen);
      const float inv = 1.f / sum_exp(x, seen, m, e);
      int64_t j = 0;
      for (; j + kLanes <= seen; j += kLanes) store16(x + j, load16(e + j) * inv);
      for (; j < seen; ++j) store(x, j, e[j] * inv);
      for (j = seen; j < width; ++j) store(x, j, 0.f);
    }
  }
}

// grad = probs * (grad - sum(grad * probs)) per row, overwriting grad.
template <typename T>
void attn_softmax_backward(T* grad, const T* probs, int64_t blocks, int64_t rows,
                           int64_t width, int64_t first, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < blocks * rows; ++r) {
    T* __restrict g = grad + r * width;
    const T* __restrict p = probs + r * width;
    const int64_t seen = seen_keys(r, rows, width, first);
    float lanes[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= seen; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] += load(g, j + l) * load(p, j + l);
    }
    float dot = 0.f;
    for (int l = 0; l < kLanes; ++l) dot += lanes[l];
    for (; j < seen; ++j) dot += load(g, j) * load(p, j);
    for (j = 0; j < seen; ++j) store(g, j, load(p, j) * (load(g, j) - dot));
    for (j = seen; j < width; ++j) store(g, j, 0.f);
  }
}

// acc[b * stride + i] += x[b * n + i] for i < n: bf16 products summed into fp32.
void add_into(float* acc, int64_t stride, const u16* x, int64_t batches, int64_t n,
              int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t b = 0; b < batches; ++b) {
    float* __restrict a = acc + b * stride;
    const u16* __restrict v = x + b * n;
    for (int64_t i = 0; i < n; ++i) a[i] += load(v, i);
  }
}


// ---------------------------------------------------------------------------------------
// What the flash attention kernels share.

constexpr int64_t kAhead = 8;  // rows prefetched ahead in the strided reads
constexpr int kBlock = 32;  // queries and keys per block (on AMX: two tiles of 16 rows)

// Row strides of the transposed operands of the attention kernels: a row more than the
// sequence, so that the rows of a tile (a power of two apart otherwise) fall in different
// sets of the L1 cache instead of evicting each other between the products reusing them.
inline int64_t padded_u32(int64_t seq) { return seq + 16; }
inline int64_t padded_u16(int64_t seq) { return seq + 32; }

// The heads of one call: `groups` key and value heads of `per` query heads each (grouped-query
// attention where per > 1). Query head h = g * per + j of group g reads k and v rows (b, g);
// its q (and dq) rows are those of q (b, g) moved by j * qstep, its out (and lse, and the
// output's gradient) rows (b, h).
struct HeadGroups {
  int64_t groups, per, qstep;
  int64_t count() const { return groups * per; }
};

// The first key each query sees: the first of its document in packed rows (`first`
// [batch][seq], each row's values nondecreasing and first[s] <= s: documents side by side),
// or key 0 (`first` null: plain causal attention). A query then sees the keys from its
// document's first up to its own position.
struct FirstKeys {
  const int64_t* first;
  int64_t seq;
  int64_t at(int64_t b, int64_t s) const { return first ? first[b * seq + s] : 0; }
  // The first key block that query s sees any key of.
  int64_t block(int64_t b, int64_t s) const { return at(b, s) / kBlock * kBlock; }
  // The end of the query blocks, from key block k0's own on, that see any of its keys: the
  // first block whose first query (the least first key of the block) starts after it.
  int64_t queries_end(int64_t b, int64_t k0) const {
    if (!first) return seq;
    int64_t q0 = k0;
    while (q0 < seq && first[b * seq + q0] < k0 + kBlock) q0 += kBlock;
    return q0;
  }
  // Keys of block k0 that query s does not see for being in an earlier document: the block's
  // first `hidden` ones (0 to kBlock).
  int hidden(int64_t b, int64_t s, int64_t k0) const {
    return first ? static_cast<int>(std::clamp<int64_t>(at(b, s) - k0, 0, kBlock)) : 0;
  }
};

#ifdef HLAT_AVX512
// ---------------------------------------------------------------------------------------
// What the attention kernels share (AVX-512F).

constexpr float kLog2e = 1.44269504088896341f;
constexpr int64_t kBand = 256;  // keys whose score gradients the AMX backward keeps for dq

// r[j] = column j of the 16 x 16 u32 matrix whose rows are r[0..15], by shuffles: pairs
// of rows interleaved (32-bit, then 64-bit, within 128-bit lanes), then the 4 x 4 matrix of
// 128-bit lanes transposed: 64 shuffles where gathers would load each element apart.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4i + c]: in 128-bit lane l, column 4l + c of rows 4i .. 4i + 3
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i low_ab = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i high_ab = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i low_cd = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i high_cd = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(low_ab, low_cd, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(low_ab, low_cd, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(high_ab, high_cd, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(high_ab, high_cd, 0xDD);
  }
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}

// dst[i][s] = src[s][i] for a [rows][cols] u32 matrix (row stride ld; rows and cols
// multiples of 16; dst's row stride ldd), 16 x 16 at a time.
void transpose_u32(const u32* src, int64_t ld, int64_t rows, int64_t cols, u32* dst,
                   int64_t ldd) {
  __m512i r[16];
  for (int64_t s0 = 0; s0 < rows; s0 += 16) {
    for (int j = 0; s0 + 16 < rows && j < 16; ++j)
      prefetch_row(src + (s0 + 16 + j) * ld, cols * 4);  // the next 16 rows
    for (int64_t i0 = 0; i0 < cols; i0 += 16) {
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(src + (s0 + j) * ld + i0);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (i0 + j) * ldd + s0, r[j]);
    }
  }
}

// exp_reduced16v on an AVX-512 register.
inline __m512 exp_reduced16(__m512 r) {
  return same_bits<__m512>(exp_reduced16v(same_bits<f32x16>(r)));
}

// exp_fast on 16 lanes (scalef for 2^n).
inline __m512 exp16(__m512 x) {
  const __m512 c =
      _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(c, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  const __m512 y = exp_reduced16(r);
  __m512 e = _mm512_scalef_ps(y, n);
  e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.4f), _CMP_LT_OQ), e,
                           _mm512_setzero_ps());
  e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72f), _CMP_GT_OQ), e,
                           _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), e, x);
}

// 2^t on 16 lanes where t is a softmax's shifted score in base 2 (at most about 0: the
// row's largest score is subtracted), for probabilities rounded to bf16 (or summed as such):
// 2^n times a degree-4 polynomial in f = t - n (|f| <= 1/2), fitted to 2^f by least squares
// weighted for relative error (under 3e-6 relative, where bf16 rounds at 2^-9): a third of
// exp16's instructions. No clamp above (2^t overflows to inf through scalef), and 0 below
// t = -125 (2^t there is under 2.4e-38; lower t would make denormals, slow to compute). -inf
// (a hidden key) gives 0; NaN stays NaN (the unordered comparison keeps it, and max returns
// its second operand).
inline __m512 exp2_shifted16(__m512 t) {
  const __mmask16 kept = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.f), _CMP_NLT_US);
  t = _mm512_max_ps(_mm512_set1_ps(-125.f), t);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(0.009560510516166687f), f,
                             _mm512_set1_ps(0.05591703951358795f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.24024981260299683f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931219696998596f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.9999991655349731f));
  return _mm512_maskz_scalef_ps(kept, y, n);
}

// The lanes of keys 0-15 and 16-31 that query r of a diagonal block sees: keys up to r.
inline __mmask16 seen_low(int r) {
  return r >= 15 ? __mmask16(0xFFFF) : __mmask16((1u << (r + 1)) - 1);
}
inline __mmask16 seen_high(int r) {
  return r < 16 ? __mmask16(0) : r >= 31 ? __mmask16(0xFFFF) : __mmask16((1u << (r - 15)) - 1);
}

// The scores of keys 0-15 (lo) and 16-31 (hi) of a diagonal block that query r does not see
// set to -inf.
inline void hide_unseen(__m512& lo, __m512& hi, int r) {
  lo = _mm512_mask_blend_ps(seen_low(r), _mm512_set1_ps(-INFINITY), lo);
  hi = _mm512_mask_blend_ps(seen_high(r), _mm512_set1_ps(-INFINITY), hi);
}

// The scores of a block's first `hidden` keys (0 to 32: those of an earlier document) set to
// -inf.
inline void hide_first(__m512& lo, __m512& hi, int hidden) {
  if (hidden <= 0) return;
  const auto kept = [](int n) {  // lanes from n on
    return n <= 0 ? __mmask16(0xFFFF) : n >= 16 ? __mmask16(0) : __mmask16(0xFFFF << n);
  };
  lo = _mm512_mask_blend_ps(kept(hidden), _mm512_set1_ps(-INFINITY), lo);
  hi = _mm512_mask_blend_ps(kept(hidden - 16), _mm512_set1_ps(-INFINITY), hi);
}

#endif  // HLAT_AVX512

#ifdef HLAT_BF16
// ---------------------------------------------------------------------------------------
// Causal attention in bf16, forward and backward, flash style: each (batch, head) runs on
// one thread, through blocks of 32 queries and 32 keys, so the scores never leave the
// core's caches. Forward takes a block of 32 queries against all the keys it sees at once:
// their scores (32 rows of fp32, 66 KiB at 512 tokens, 1 MiB at 8,192), an exact softmax of
// each row (no running maximum to rescale by), and the output as one product over all the
// keys, its sums staying in the tiles (or registers). It keeps each query's log-sum-exp for
// backward, which recomputes the probabilities, goes through the keys block by block (each
// key block's gradients one product over all the queries), and sums the queries' gradients
// over bands of kBand keys (one product per query block and band, not one per key block).
// Products accumulate in fp32; the probabilities and the scores' gradients are rounded to
// bf16 for the products that read them, as blocked attention rounds them; the output and
// the three gradients are rounded once at the end.
//
// Its products are 32 x 32 blocks of bf16 pairs (the layout of AMX's tile product) summed
// into fp32, run on AMX tiles (kTiles: built where the compiler targets AMX-BF16, with
// -march=native CPUs that have it) or by AVX512-BF16 dot products of pairs (where it targets
// AVX512-BF16: AMX CPUs too, and AMD's Zen 4 and later); the rest of the kernel is the same
// code for both. Elsewhere hlat_attn_bf16_ready says 0 and the caller keeps blocked attention.

#ifdef HLAT_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: A (16 x 32 bf16), B (16 pairs of rows x 16 columns x 2
// bf16) and C (16 x 16 fp32) alike.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}
#endif  // HLAT_AMX

// The tiles configured for this thread while it runs a kernel's loop (kTiles), else nothing.
template <bool kTiles>
struct TileScope {
  TileScope() {
#ifdef HLAT_AMX
    if constexpr (kTiles) configure_tiles();
#endif
  }
  ~TileScope() {
#ifdef HLAT_AMX
    if constexpr (kTiles) _tile_release();
#endif
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// dst[i][s] = (src[s][2i], src[s][2i + 1]) as one u32: the B layout of a product against
// src transposed (src [rows][dim], row stride ld, both even; dst's row stride ldd u32).
void pack_column_pairs(const u16* src, int64_t ld, int64_t rows, int64_t dim, u32* dst,
                       int64_t ldd) {
  transpose_u32(reinterpret_cast<const u32*>(src), ld / 2, rows, dim / 2, dst, ldd);
}

// pairs[2j + t] = (a, b)[t][j] for j < 32: two rows of 32 bf16 interleaved.
inline void interleave32(const u16* a, const u16* b, u16* pairs) {
  alignas(64) static const uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
  _mm512_storeu_si512(pairs, _mm512_permutex2var_epi16(x, _mm512_load_si512(kLow), y));
  _mm512_storeu_si512(pairs + 32, _mm512_permutex2var_epi16(x, _mm512_load_si512(kHigh), y));
}

// dst[s / 2][d][s % 2] = src[s][d]: the B layout of a product against src (src [rows][dim],
// row stride ld; rows even, dim a multiple of 32).
void pack_row_pairs(const u16* src, int64_t ld, int64_t rows, int64_t dim, u16* dst) {
  for (int64_t s = 0; s < rows; s += 2) {
    if (s + kAhead + 1 < rows) {
      prefetch_row(src + (s + kAhead) * ld, dim * 2);
      prefetch_row(src + (s + kAhead + 1) * ld, dim * 2);
    }
    for (int64_t d = 0; d < dim; d += 32)
      interleave32(src + s * ld + d, src + (s + 1) * ld + d, dst + (s / 2) * 2 * dim + 2 * d);
  }
}

// dst[d][s] = src[s][d] (src [rows][dim], row stride ld; rows a multiple of 32, dim of
// 32; dst's row stride ldd, even): rows interleaved in pairs into `scratch` (rows x dim),
// then its u32 transposed.
void transpose_rows(const u16* src, int64_t ld, int64_t rows, int64_t dim, u16* scratch,
                    u16* dst, int64_t ldd) {
  pack_row_pairs(src, ld, rows, dim, scratch);
  transpose_u32(reinterpret_cast<const u32*>(scratch), dim, rows / 2, dim,
                reinterpret_cast<u32*>(dst), ldd / 2);
}

// 16 floats rounded to bf16 (nearest even) at dst.
inline void store_bf16(u16* dst, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
}

// 16 bf16 at src widened to fp32.
inline __m512 load_bf16(const u16* src) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
}

// c (32 x 32 fp32, rows ldc bytes apart) = (c if `add`, else 0) + the sum over `steps` of
// a_i (32 x 32 bf16 at a + 32 i, rows lda bytes apart) times b_i (16 pairs of rows x 32
// columns at b + i * bstep bytes, rows ldb bytes apart, columns 16-31 64 bytes after 0-15):
// c[r][n] += a_i[r][2p] b_i[p][n][0] + a_i[r][2p + 1] b_i[p][n][1] over the 16 pairs p.
#ifdef HLAT_AMX
inline void amx_product(const u16* a, int64_t lda, const char* b, int64_t ldb, int64_t steps,
                        int64_t bstep, float* c, int64_t ldc, bool add) {
  char* cc = reinterpret_cast<char*>(c);
  if (add) {
    _tile_loadd(0, cc, ldc);
    _tile_loadd(1, cc + 64, ldc);
    _tile_loadd(2, cc + 16 * ldc, ldc);
    _tile_loadd(3, cc + 16 * ldc + 64, ldc);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t i = 0; i < steps; ++i) {
    const char* ai = reinterpret_cast<const char*>(a + 32 * i);
    const char* bi = b + i * bstep;
    _tile_loadd(4, ai, lda);
    _tile_loadd(5, ai + 16 * lda, lda);
    _tile_loadd(6, bi, ldb);
    _tile_loadd(7, bi + 64, ldb);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, cc, ldc);
  _tile_stored(1, cc + 64, ldc);
  _tile_stored(2, cc + 16 * ldc, ldc);
  _tile_stored(3, cc + 16 * ldc + 64, ldc);
}
#endif  // HLAT_AMX

// The same product by AVX512-BF16 dot products: 8 rows of c at a time in 16 registers, each
// pair of a's row broadcast against b's row of pairs (read once per 8 rows, from L1).
inline void dot_product(const u16* a, int64_t lda, const char* b, int64_t ldb, int64_t steps,
                        int64_t bstep, float* c, int64_t ldc, bool add) {
  constexpr int kRows = 8;
  char* cc = reinterpret_cast<char*>(c);
  const char* ab = reinterpret_cast<const char*>(a);
  for (int r0 = 0; r0 < kBlock; r0 += kRows) {
    __m512 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      const float* row = reinterpret_cast<const float*>(cc + (r0 + r) * ldc);
      acc[r][0] = add ? _mm512_loadu_ps(row) : _mm512_setzero_ps();
      acc[r][1] = add ? _mm512_loadu_ps(row + 16) : _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < steps; ++i) {
      const char* ai = ab + r0 * lda + 64 * i;
      const char* bi = b + i * bstep;
#pragma GCC unroll 4
      for (int p = 0; p < 16; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bi + p * ldb);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bi + p * ldb + 64);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          int32_t pair;
          std::memcpy(&pair, ai + r * lda + 4 * p, 4);
          const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      float* row = reinterpret_cast<float*>(cc + (r0 + r) * ldc);
      _mm512_storeu_ps(row, acc[r][0]);
      _mm512_storeu_ps(row + 16, acc[r][1]);
    }
  }
}

// The product on AMX tiles (kTiles) or by dot products.
template <bool kTiles>
inline void tiles_product(const u16* a, int64_t lda, const char* b, int64_t ldb, int64_t steps,
                          int64_t bstep, float* c, int64_t ldc, bool add = false) {
#ifdef HLAT_AMX
  if constexpr (kTiles) {
    amx_product(a, lda, b, ldb, steps, bstep, c, ldc, add);
    return;
  }
#endif
  dot_product(a, lda, b, ldb, steps, bstep, c, ldc, add);
}

// 32 floats (lo: 0-15, hi: 16-31) rounded to bf16 (nearest even) and stored at dst; lo and
// hi become the rounded values.
inline void round_to_bf16(__m512& lo, __m512& hi, u16* dst) {
  const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  _mm512_storeu_si512(dst, b);
  lo = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16));
  hi = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16));
}

// pairs[i][2j + t] = rows[2i + t][j] for 32 rows of 32 bf16: the B layout of a product over
// the rows.
inline void interleave_row_pairs(const u16* rows, int64_t ld, u16* pairs) {
  for (int i = 0; i < 16; ++i)
    interleave32(rows + 2 * i * ld, rows + (2 * i + 1) * ld, pairs + i * 2 * kBlock);
}

// The softmax of bf16_attention_forward's query block over its keys (scores: the products,
// unscaled, kBlock rows ld floats apart, keys from .. keys - 1, the last block diagonal; -inf
// where a key is hidden): the probabilities rounded to bf16 into probs (rows as far apart),
// each row's log-sum-exp into lse and the inverse of its sum (of the rounded probabilities,
// which the output sums) into inv. Each row is read twice: its maximum, then its exponentials
// in base 2 (the scale, a positive factor, goes into the exponent with the maximum).
void softmax_rows(const float* scores, int64_t ld, int64_t from, int64_t keys, float scale,
                  u16* probs, float* lse, float* inv) {
  const __m512 vscale2 = _mm512_set1_ps(scale * kLog2e);
  const int64_t last = keys - kBlock;  // the diagonal block's first key
  for (int r = 0; r < kBlock; ++r) {
    const float* x = scores + r * ld;
    u16* p = probs + r * ld;
    __m512 lo = _mm512_loadu_ps(x + last), hi = _mm512_loadu_ps(x + last + 16);
    hide_unseen(lo, hi, r);
    __m512 mx0 = lo, mx1 = hi;
    for (int64_t j = from; j < last; j += 32) {
      mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(x + j));
      mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(x + j + 16));
    }
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1)) * scale;
    const __m512 shift = _mm512_set1_ps(mx * kLog2e);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t j = from; j < last; j += 32) {
      __m512 p0 = exp2_shifted16(_mm512_fmsub_ps(_mm512_loadu_ps(x + j), vscale2, shift));
      __m512 p1 = exp2_shifted16(_mm512_fmsub_ps(_mm512_loadu_ps(x + j + 16), vscale2, shift));
      round_to_bf16(p0, p1, p + j);
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
    }
    __m512 p0 = exp2_shifted16(_mm512_fmsub_ps(lo, vscale2, shift));
    __m512 p1 = exp2_shifted16(_mm512_fmsub_ps(hi, vscale2, shift));
    round_to_bf16(p0, p1, p + last);
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum0, p0),
                                                         _mm512_add_ps(sum1, p1)));
    lse[r] = mx + std::log(sum);
    inv[r] = 1.f / sum;
  }
}

// Rows of one operand of attention: row (b, h, s) at base + b * batch + h * head + s * pos.
template <typename T>
struct Rows {
  T* base;
  int64_t batch, head, pos;
  T* at(int64_t b, int64_t h) const { return base + b * batch + h * head; }
};

// RoPE's tables (rows of dim / 2 fp32 at cos + b * batch + s * pos, the same for sin),
// applied to q and k as the kernels read them, and inversely to their gradients.
struct Rope {
  const float *cos, *sin;
  int64_t batch, pos;
  const float* cos_at(int64_t b, int64_t p) const { return cos + b * batch + p * pos; }
  const float* sin_at(int64_t b, int64_t p) const { return sin + b * batch + p * pos; }
};

// The `rows` rows of src (pos elements apart) rotated by RoPE at positions first.. (forward
// sign 1) into dst, rows dim apart; rounded once, as the RoPE head split rounds.
void rotated_rows(const u16* src, int64_t pos, int64_t rows, int64_t dim, const Rope& rope,
                  int64_t b, int64_t first, u16* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    if (r + kAhead < rows) prefetch_row(src + (r + kAhead) * pos, dim * 2);
    rotate(src + r * pos, dst + r * dim, rope.cos_at(b, first + r), rope.sin_at(b, first + r),
           1.f, dim / 2);
  }
}

// A row of dim fp32 sums rounded to bf16 at dst, rotated back by RoPE at (b, s) (the
// gradient of a rotated operand) where `rope` is given.
void store_row(const float* src, int64_t dim, const Rope* rope, int64_t b, int64_t s,
               u16* dst) {
  if (rope != nullptr) {
    rotate(src, dst, rope->cos_at(b, s), rope->sin_at(b, s), -1.f, dim / 2);
    return;
  }
  for (int64_t d = 0; d < dim; d += 16) store_bf16(dst + d, _mm512_loadu_ps(src + d));
}


// Causal attention of q, k, v into out's rows; lse [batch * heads][seq] fp32. seq and dim
// multiples of 32. With `rope`, q and k are rotated as they are read; with `fk.first`, each
// query sees the keys of its own document only, and the key blocks before its query block's
// first are skipped. Each (batch, group) runs on one thread: its keys and values are packed
// once for all its query heads.
template <bool kTiles>
void bf16_attention_forward(Rows<const u16> q, Rows<const u16> k, Rows<const u16> v,
                            const Rope* rope, Rows<u16> out, float* lse, int64_t batch,
                            HeadGroups heads, int64_t seq, int64_t dim, float scale,
                            FirstKeys fk, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const TileScope<kTiles> tiles;
    const int64_t kld = padded_u32(seq), sld = padded_u32(seq);
    std::vector<u32> kp(static_cast<size_t>(kld * dim / 2));
    std::vector<u16> vp(static_cast<size_t>(seq * dim));
    std::vector<float> block(static_cast<size_t>(kBlock * dim));
    // a query block's scores against all its keys, and their probabilities
    std::vector<float> scores(static_cast<size_t>(kBlock * sld));
    std::vector<u16> probs(scores.size());
    // with RoPE: the rotated keys, and a block of rotated queries
    std::vector<u16> krot(rope ? static_cast<size_t>(seq * dim) : 0);
    std::vector<u16> qrot(rope ? static_cast<size_t>(kBlock * dim) : 0);
    float inv[kBlock];
#pragma omp for schedule(dynamic)
    for (int64_t bg = 0; bg < batch * heads.groups; ++bg) {
      const int64_t b = bg / heads.groups, g = bg % heads.groups;
      const u16* kh = k.at(b, g);
      int64_t kpos = k.pos;
      if (rope) {
        rotated_rows(kh, k.pos, seq, dim, *rope, b, 0, krot.data());
        kh = krot.data();
        kpos = dim;
      }
      pack_column_pairs(kh, kpos, seq, dim, kp.data(), kld);
      pack_row_pairs(v.at(b, g), v.pos, seq, dim, vp.data());
      const char* keys = reinterpret_cast<const char*>(kp.data());
      for (int64_t j = 0; j < heads.per; ++j) {
        const int64_t h = g * heads.per + j;
        const u16* qh = q.at(b, g) + j * heads.qstep;
        u16* outh = out.at(b, h);
        float* lseh = lse + (b * heads.count() + h) * seq;
        for (int64_t q0 = 0; q0 < seq; q0 += kBlock) {
          // keys from .. q0 + 31, the last block diagonal: scores, softmax, then the output's
          // products over all the keys at once (the sums stay in the tiles)
          const int64_t from = fk.block(b, q0), end = q0 + kBlock;
          // this block's output rows (written at its end), the next block's query rows
          for (int r = 0; r < kBlock; ++r) {
            prefetch_row(outh + (q0 + r) * out.pos, dim * 2, true);
            if (end < seq) prefetch_row(qh + (end + r) * q.pos, dim * 2);
          }
          const u16* qb = qh + q0 * q.pos;
          int64_t qpos = q.pos;
          if (rope) {
            rotated_rows(qb, q.pos, kBlock, dim, *rope, b, q0, qrot.data());
            qb = qrot.data();
            qpos = dim;
          }
          for (int64_t k0 = from; k0 < end; k0 += kBlock)
            tiles_product<kTiles>(qb, qpos * 2, keys + k0 * 4, kld * 4, dim / 32,
                                  16 * kld * 4, scores.data() + k0, sld * 4);
          // the keys of earlier documents that a row's block reads hidden
          for (int r = 0; fk.first && r < kBlock; ++r) {
            float* row = scores.data() + r * sld;
            std::fill(row + from, row + fk.at(b, q0 + r), -INFINITY);
          }
          softmax_rows(scores.data(), sld, from, end, scale, probs.data(), lseh + q0, inv);
          for (int64_t d = 0; d < dim; d += 32)
            tiles_product<kTiles>(probs.data() + from, sld * 2,
                                  reinterpret_cast<const char*>(vp.data() + from * dim) + 4 * d,
                                  dim * 4, (end - from) / kBlock, 16 * dim * 4,
                                  block.data() + d, dim * 4);
          for (int r = 0; r < kBlock; ++r) {
            const __m512 scale_r = _mm512_set1_ps(inv[r]);
            const float* o = block.data() + r * dim;
            u16* dst = outh + (q0 + r) * out.pos;
            for (int64_t d = 0; d < dim; d += 16)
              store_bf16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), scale_r));
          }
        }
      }
    }
  }
}

// The gradients of bf16_attention_forward for q, k and v, into the rows of dq, dk and dv, from
// its output and lse and the output's gradient; with `rope`, those of the unrotated q and k;
// with `fk.first`, each key block goes through the query blocks that see it only. A group's
// key and value gradients are summed over its query heads in fp32 and rounded once.
template <bool kTiles>
void bf16_attention_backward(Rows<const u16> q, Rows<const u16> k, Rows<const u16> v,
                             const Rope* rope, Rows<const u16> out, Rows<const u16> grad,
                             const float* lse, Rows<u16> dq, Rows<u16> dk, Rows<u16> dv,
                             int64_t batch, HeadGroups heads, int64_t seq, int64_t dim,
                             float scale, FirstKeys fk, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const TileScope<kTiles> tiles;
    const size_t n = static_cast<size_t>(seq * dim);
    const int64_t kld = padded_u32(seq), tld = padded_u16(seq);
    std::vector<u32> kp(static_cast<size_t>(kld * dim / 2)), vp(kp.size());
    std::vector<u16> g(n), kr(n), scratch(n);
    std::vector<u16> gt(static_cast<size_t>(tld * dim)), qt(gt.size());
    std::vector<float> delta(static_cast<size_t>(seq)), dqacc(n);
    // every key block's key and value gradients, transposed ([seq / 32][dim][32]), summed
    // over the group's query heads
    std::vector<float> dkt(n), dvt(n);
    // a key block's key and value gradients, in rows (before rounding)
    std::vector<float> dkrows(static_cast<size_t>(kBlock * dim)), dvrows(dkrows.size());
    // with RoPE: the rotated queries and keys
    std::vector<u16> qrot(rope ? n : 0), krot(rope ? n : 0);
    // a key block's probabilities and score gradients against every query block, in the B
    // layout: its key and value gradients are then one product each, over all the queries
    std::vector<u16> probs_pairs(static_cast<size_t>(seq * kBlock));
    std::vector<u16> dscores_pairs(probs_pairs.size());
    // the score gradients of a band of kBand keys against every query, rows wld apart
    // (288 KiB at 512 tokens, 4.5 MiB at 8,192): the queries' gradients then take the band
    // in one product each
    const int64_t wld = kBand + 32;
    std::vector<u16> dscores(static_cast<size_t>(seq * wld));
    alignas(64) float scores[kBlock * kBlock];
    alignas(64) float dprobs[kBlock * kBlock];
    alignas(64) u16 probs[kBlock * kBlock];
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 vscale2 = _mm512_set1_ps(scale * kLog2e);
#pragma omp for schedule(dynamic)
    for (int64_t bg = 0; bg < batch * heads.groups; ++bg) {
      const int64_t b = bg / heads.groups, grp = bg % heads.groups;
      const u16* kh = k.at(b, grp);
      int64_t kpos = k.pos;
      if (rope) {
        rotated_rows(kh, k.pos, seq, dim, *rope, b, 0, krot.data());
        kh = krot.data();
        kpos = dim;
      }
      pack_column_pairs(kh, kpos, seq, dim, kp.data(), kld);
      pack_column_pairs(v.at(b, grp), v.pos, seq, dim, vp.data(), kld);
      pack_row_pairs(kh, kpos, seq, dim, kr.data());
      for (int64_t j = 0; j < heads.per; ++j) {
        const int64_t h = grp * heads.per + j;
        const u16* qh = q.at(b, grp) + j * heads.qstep;
        int64_t qpos = q.pos;
        if (rope) {
          rotated_rows(qh, q.pos, seq, dim, *rope, b, 0, qrot.data());
          qh = qrot.data();
          qpos = dim;
        }
        const float* lseh = lse + (b * heads.count() + h) * seq;
        const u16* o = out.at(b, h);
        const u16* gr = grad.at(b, h);
        const int64_t os = out.pos, gs = grad.pos;
        // the output's gradient, dense, and delta = rowsum(grad * out)
        for (int64_t s = 0; s < seq; ++s) {
          if (s + kAhead < seq) {
            prefetch_row(gr + (s + kAhead) * gs, dim * 2);
            prefetch_row(o + (s + kAhead) * os, dim * 2);
          }
          __m512 sum = _mm512_setzero_ps();
          for (int64_t d = 0; d < dim; d += 16) {
            std::memcpy(g.data() + s * dim + d, gr + s * gs + d, 32);
            sum = _mm512_fmadd_ps(load_bf16(gr + s * gs + d), load_bf16(o + s * os + d), sum);
          }
          delta[s] = _mm512_reduce_add_ps(sum);
        }
        transpose_rows(g.data(), dim, seq, dim, scratch.data(), gt.data(), tld);
        transpose_rows(qh, qpos, seq, dim, scratch.data(), qt.data(), tld);
        for (int64_t band = 0; band < seq; band += kBand) {
          const int64_t band_end = std::min(band + kBand, seq);
          for (int64_t k0 = band; k0 < band_end; k0 += kBlock) {
            const int64_t queries_end = fk.queries_end(b, k0);
            for (int64_t q0 = k0; q0 < queries_end; q0 += kBlock) {
              u16* ds = dscores.data() + q0 * wld + (k0 - band);
              tiles_product<kTiles>(qh + q0 * qpos, qpos * 2,
                                    reinterpret_cast<const char*>(kp.data() + k0), kld * 4,
                                    dim / 32, 16 * kld * 4, scores, kBlock * 4);
              tiles_product<kTiles>(g.data() + q0 * dim, dim * 2,
                                    reinterpret_cast<const char*>(vp.data() + k0), kld * 4,
                                    dim / 32, 16 * kld * 4, dprobs, kBlock * 4);
              // the probabilities recomputed in base 2 (as forward's), and the scores'
              // gradients p (dp - delta) scale, the scale applied to dp - delta
              for (int r = 0; r < kBlock; ++r) {
                const __m512 shift = _mm512_set1_ps(lseh[q0 + r] * kLog2e);
                const __m512 dl = _mm512_set1_ps(delta[q0 + r] * scale);
                __m512 x0 = _mm512_fmsub_ps(_mm512_load_ps(scores + r * kBlock), vscale2, shift);
                __m512 x1 =
                    _mm512_fmsub_ps(_mm512_load_ps(scores + r * kBlock + 16), vscale2, shift);
                if (k0 == q0) hide_unseen(x0, x1, r);
                hide_first(x0, x1, fk.hidden(b, q0 + r, k0));
                __m512 p0 = exp2_shifted16(x0), p1 = exp2_shifted16(x1);
                round_to_bf16(p0, p1, probs + r * kBlock);
                const __m512 dp0 =
                    _mm512_fmsub_ps(_mm512_load_ps(dprobs + r * kBlock), vscale, dl);
                const __m512 dp1 =
                    _mm512_fmsub_ps(_mm512_load_ps(dprobs + r * kBlock + 16), vscale, dl);
                __m512 ds0 = _mm512_mul_ps(p0, dp0);
                __m512 ds1 = _mm512_mul_ps(p1, dp1);
                round_to_bf16(ds0, ds1, ds + r * wld);
              }
              const int64_t i = (q0 - k0) / kBlock;
              interleave_row_pairs(probs, kBlock, probs_pairs.data() + i * kBlock * kBlock);
              interleave_row_pairs(ds, wld, dscores_pairs.data() + i * kBlock * kBlock);
            }
            // the key block's gradients, transposed ([dim][32]), over all its query blocks
            // (added to the group's earlier heads'): dv^T = grad^T probs, dk^T = q^T dscores
            const int64_t blocks = (queries_end - k0) / kBlock;
            for (int64_t d = 0; d < dim; d += 32) {
              tiles_product<kTiles>(gt.data() + d * tld + k0, tld * 2,
                                    reinterpret_cast<const char*>(probs_pairs.data()), 128,
                                    blocks, kBlock * kBlock * 2,
                                    dvt.data() + k0 * dim + d * kBlock, kBlock * 4, j > 0);
              tiles_product<kTiles>(qt.data() + d * tld + k0, tld * 2,
                                    reinterpret_cast<const char*>(dscores_pairs.data()), 128,
                                    blocks, kBlock * kBlock * 2,
                                    dkt.data() + k0 * dim + d * kBlock, kBlock * 4, j > 0);
            }
          }
          // dq += dscores k over the band's keys that the query block sees (from its first
          // key block, up to the diagonal): the first such band's sums start each query's,
          // the others' are added
          for (int64_t q0 = band; q0 < seq; q0 += kBlock) {
            const int64_t seen = fk.block(b, q0), from = std::max(band, seen);
            const int64_t to = std::min(q0 + kBlock, band_end);
            if (from >= to) continue;
            const char* kb = reinterpret_cast<const char*>(kr.data() + from * dim);
            for (int64_t d = 0; d < dim; d += 32)
              tiles_product<kTiles>(dscores.data() + q0 * wld + (from - band), wld * 2,
                                    kb + 4 * d, dim * 4, (to - from) / kBlock, 16 * dim * 4,
                                    dqacc.data() + q0 * dim + d, dim * 4,
                                    band > seen / kBand * kBand);
          }
        }
        u16* dqh = dq.at(b, grp) + j * heads.qstep;
        for (int64_t s = 0; s < seq; ++s) {
          if (s + kAhead < seq) prefetch_row(dqh + (s + kAhead) * dq.pos, dim * 2, true);
          store_row(dqacc.data() + s * dim, dim, rope, b, s, dqh + s * dq.pos);
        }
      }
      // the key blocks' rows, from the transposed sums, then rounded into dk and dv
      for (int64_t k0 = 0; k0 < seq; k0 += kBlock) {
        const float* dkb = dkt.data() + k0 * dim;
        const float* dvb = dvt.data() + k0 * dim;
        for (int64_t d0 = 0; d0 < dim; d0 += 16)
          for (int j0 = 0; j0 < kBlock; j0 += 16) {
            __m512i rk[16], rv[16];
            for (int i = 0; i < 16; ++i) {
              rk[i] = _mm512_loadu_si512(dkb + (d0 + i) * kBlock + j0);
              rv[i] = _mm512_loadu_si512(dvb + (d0 + i) * kBlock + j0);
            }
            transpose16(rk);
            transpose16(rv);
            for (int r = 0; r < 16; ++r) {
              const int64_t at = (j0 + r) * dim + d0;
              _mm512_storeu_si512(dkrows.data() + at, rk[r]);
              _mm512_storeu_si512(dvrows.data() + at, rv[r]);
            }
          }
        for (int r = 0; r < kBlock; ++r) {
          const int64_t s = k0 + r;
          if (s + kAhead < seq) {
            prefetch_row(dk.at(b, grp) + (s + kAhead) * dk.pos, dim * 2, true);
            prefetch_row(dv.at(b, grp) + (s + kAhead) * dv.pos, dim * 2, true);
          }
          store_row(dkrows.data() + r * dim, dim, rope, b, s, dk.at(b, grp) + s * dk.pos);
          store_row(dvrows.data() + r * dim, dim, nullptr, b, s, dv.at(b, grp) + s * dv.pos);
        }
      }
    }
  }
}
#endif  // HLAT_BF16

#ifdef HLAT_F32_FLASH
// ---------------------------------------------------------------------------------------
// Causal attention in fp32 (AVX-512F, or AVX2 with FMA), forward and backward, flash style as
// the AMX kernel above: each (batch, head) on one thread, blocks of 32 queries against up to
// kKeys keys at a time, an online softmax forward; blocks of 32 keys against up to kQueries
// queries at a time, probabilities recomputed from each query's log-sum-exp, backward. All
// in fp32. The products are register blocks of fused multiply-adds whose first operand is
// read by broadcasts at any strides, so the transposed products of backward need no
// transposed copies; only the keys and values are transposed once per head (the second
// operand of the products against them). Written once over `Lanes`, the fp32 vector of the
// target: 16 lanes of AVX-512, or 8 of AVX2.

#ifdef HLAT_AVX512
struct Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fms(V a, V b, V c) { return _mm512_fmsub_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float max_of(V x) { return _mm512_reduce_max_ps(x); }
  static float sum_of(V x) { return _mm512_reduce_add_ps(x); }
  static V exp(V x) { return exp16(x); }
  // lanes from `seen` on set to -inf
  static V hide_from(V x, int seen) {
    const __mmask16 kept = seen >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << seen) - 1);
    return _mm512_mask_blend_ps(kept, _mm512_set1_ps(-INFINITY), x);
  }
  // lanes before `hidden` set to -inf
  static V hide_before(V x, int hidden) {
    const __mmask16 kept = hidden >= 16 ? __mmask16(0) : __mmask16(0xFFFF << hidden);
    return _mm512_mask_blend_ps(kept, _mm512_set1_ps(-INFINITY), x);
  }
  // dst[i][s] = src[s][i], rows and cols multiples of 16
  static void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst,
                        int64_t ldd) {
    transpose_u32(reinterpret_cast<const u32*>(src), ld, rows, cols, reinterpret_cast<u32*>(dst),
                  ldd);
  }
};
#else
using f32x8 = float __attribute__((vector_size(32)));

// exp_reduced16v's polynomial on an AVX2 register.
inline __m256 exp_reduced8(__m256 r) {
  return same_bits<__m256>(exp_reduced_lanes(same_bits<f32x8>(r)));
}

// exp16 on 8 lanes: 2^n from exponent bits (n is within [-126, 127] after the clamp).
inline __m256 exp8(__m256 x) {
  const __m256 c =
      _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(c, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), c);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(exp_reduced8(r), _mm256_castsi256_ps(bits));
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(),
                       _mm256_cmp_ps(x, _mm256_set1_ps(-87.4f), _CMP_LT_OQ));
  e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.72f), _CMP_GT_OQ));
  return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

struct Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fms(V a, V b, V c) { return _mm256_fmsub_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float max_of(V x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  static float sum_of(V x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
  static V exp(V x) { return exp8(x); }
  static V hide_from(V x, int seen) {
    const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    const __m256 kept = _mm256_cmp_ps(lane, _mm256_set1_ps(float(seen)), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, kept);
  }
  static V hide_before(V x, int hidden) {
    const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    const __m256 kept = _mm256_cmp_ps(lane, _mm256_set1_ps(float(hidden)), _CMP_GE_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, kept);
  }
  // dst[i][s] = src[s][i], rows and cols multiples of 8: 8 x 8 at a time by shuffles.
  static void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst,
                        int64_t ldd) {
    for (int64_t s0 = 0; s0 < rows; s0 += 8)
      for (int64_t i0 = 0; i0 < cols; i0 += 8) {
        __m256 r[8], t[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + (s0 + j) * ld + i0);
        for (int j = 0; j < 8; j += 2) {
          t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
          t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
        }
        // r[4h + c]: in 128-bit lane l, column 4l + c of rows 4h .. 4h + 3
        for (int h = 0; h < 8; h += 4) {
          r[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
          r[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
          r[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
          r[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
        }
        for (int c = 0; c < 4; ++c) {
          _mm256_storeu_ps(dst + (i0 + c) * ldd + s0, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
          _mm256_storeu_ps(dst + (i0 + 4 + c) * ldd + s0,
                           _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
        }
      }
  }
};
#endif

using LaneV = Lanes::V;
constexpr int kW = Lanes::kWidth;
constexpr int kRowVecs = kBlock / kW;  // vectors of a block's row of 32 scores

// c[r][W j + l] (rows ldc apart) = (c if add, else 0) + the sum over k < kn of
// a[r * am + k * ak] * b[k * ldb + W j + l], for r < R and j < NV (W the lanes).
template <int R, int NV>
inline void fma_block(const float* a, int64_t am, int64_t ak, const float* b, int64_t ldb,
                      int64_t kn, float* c, int64_t ldc, bool add) {
  LaneV acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      acc[r][j] = add ? Lanes::load(c + r * ldc + kW * j) : Lanes::zero();
  for (int64_t k = 0; k < kn; ++k) {
    LaneV bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = Lanes::load(b + k * ldb + kW * j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const LaneV av = Lanes::set1(a[r * am + k * ak]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = Lanes::fma(av, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) Lanes::store(c + r * ldc + kW * j, acc[r][j]);
}

// C [m][n] (rows ldc apart) = (C if add, else 0) + A B, A(r, k) = a[r * am + k * ak]
// (kn columns), B rows ldb apart; m a multiple of 8, n of 32. AVX-512: 64 columns at a
// time by 4 rows, the rest 32 at a time by 8 rows; AVX2 (16 registers): 16 columns by 6
// rows (12 accumulators), the rest by 4 and 2.
//
// Note: 4 rows (8 accumulators) are just as many products as two FMA units of latency 4
// keep in flight, with no slack; on a 2-core AVX2-only AMD EPYC (Zen 3), 6 rows made the
// fp32 flash attention's forward + backward 1.36-1.48x faster at the shapes of
// test_attention_kernels.
inline void fma_product(const float* a, int64_t am, int64_t ak, const float* b, int64_t ldb,
                        int64_t kn, float* c, int64_t ldc, int64_t m, int64_t n, bool add) {
  int64_t c0 = 0;
  if constexpr (kW == 16) {
    for (; c0 + 64 <= n; c0 += 64)
      for (int64_t r0 = 0; r0 < m; r0 += 4)
        fma_block<4, 4>(a + r0 * am, am, ak, b + c0, ldb, kn, c + r0 * ldc + c0, ldc, add);
    for (; c0 < n; c0 += 32)
      for (int64_t r0 = 0; r0 < m; r0 += 8)
        fma_block<8, 2>(a + r0 * am, am, ak, b + c0, ldb, kn, c + r0 * ldc + c0, ldc, add);
  } else {
    for (; c0 < n; c0 += 16) {
      int64_t r0 = 0;
      for (; r0 + 6 <= m; r0 += 6)
        fma_block<6, 2>(a + r0 * am, am, ak, b + c0, ldb, kn, c + r0 * ldc + c0, ldc, add);
      for (; r0 + 4 <= m; r0 += 4)
        fma_block<4, 2>(a + r0 * am, am, ak, b + c0, ldb, kn, c + r0 * ldc + c0, ldc, add);
      for (; r0 < m; r0 += 2)
        fma_block<2, 2>(a + r0 * am, am, ak, b + c0, ldb, kn, c + r0 * ldc + c0, ldc, add);
    }
  }
}

// Score vector c of a query's row (keys kW * c onward): the keys before `hidden` (an earlier
// document's) and from `seen` on (after the query) set to -inf.
inline LaneV hide_unseen(LaneV x, int c, int hidden, int seen) {
  if (seen < kW * (c + 1)) x = Lanes::hide_from(x, std::max(seen - kW * c, 0));
  if (hidden > kW * c) x = Lanes::hide_before(x, std::min(hidden - kW * c, kW));
  return x;
}

// The scores of a block's row loaded into x, scaled and `shift` subtracted, those of keys the
// query does not see (hide_unseen) set to -inf.
inline void load_scores(const float* row, LaneV vscale, LaneV shift, int hidden, int seen,
                        LaneV x[kRowVecs]) {
  for (int c = 0; c < kRowVecs; ++c)
    x[c] = hide_unseen(Lanes::fms(Lanes::load(row + kW * c), vscale, shift), c, hidden, seen);
}

// Keys per step of the fp32 forward: a query block's scores against up to this many keys
// at once (a multiple of kBlock), so that each query row's maximum, sum and rescaled output
// are updated once per kKeys keys instead of once per kBlock.
constexpr int64_t kKeys = 256;
// Queries per step of the fp32 backward: a key block's probabilities and their gradients for
// up to this many queries at once (a multiple of kBlock), so that its dk and dv rows are
// loaded and stored once per kQueries queries.
constexpr int64_t kQueries = 128;

// q: [batch * groups.count()][seq][dim] fp32, k and v [batch * groups.groups][seq][dim]
// (query head h = g * per + j reads key and value head g; groups.qstep unused: q's heads are
// seq * dim apart); out row (b, h, s) at out + b * ob + h * oh + s * os; lse
// [batch * heads][seq]. seq and dim multiples of 32. With `fk.first`, each query sees the
// keys of its own document only, and the key blocks before its query block's first are
// skipped. Each (batch, group) runs on one thread: its keys are transposed once for all its
// query heads. Each block of kBlock queries takes its keys kKeys at a time (the last step
// ends at the block's diagonal).
void f32_attention_forward(const float* q, const float* k, const float* v, float* out,
                           int64_t ob, int64_t oh, int64_t os, float* lse, int64_t batch,
                           HeadGroups groups, int64_t seq, int64_t dim, float scale,
                           FirstKeys fk, int threads) {
  const int64_t heads = groups.count(), hs = seq * dim;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t kld = padded_u32(seq);
    std::vector<float> kt(static_cast<size_t>(kld * dim)), acc(static_cast<size_t>(kBlock * dim));
    alignas(64) float scores[kBlock * kKeys];
    float m[kBlock], l[kBlock];
    const LaneV vscale = Lanes::set1(scale);
    const LaneV hidden_score = Lanes::set1(-INFINITY);
#pragma omp for schedule(dynamic)
    for (int64_t bg = 0; bg < batch * groups.groups; ++bg) {
      const int64_t b = bg / groups.groups, g = bg % groups.groups;
      const float* vh = v + bg * hs;
      Lanes::transpose(k + bg * hs, dim, seq, dim, kt.data(), kld);
      for (int64_t j = 0; j < groups.per; ++j) {
        const int64_t h = g * groups.per + j, bh = b * heads + h;
        const float* qh = q + bh * hs;
        float* outh = out + b * ob + h * oh;
        for (int64_t q0 = 0; q0 < seq; q0 += kBlock) {
          std::fill(m, m + kBlock, -INFINITY);
          std::fill(l, l + kBlock, 0.f);
          const int64_t from = fk.block(b, q0), end = q0 + kBlock;
          for (int64_t k0 = from; k0 < end; k0 += kKeys) {
            const int64_t width = std::min(kKeys, end - k0);
            const int vecs = static_cast<int>(width / kW);
            fma_product(qh + q0 * dim, dim, 1, kt.data() + k0, kld, dim, scores, kKeys, kBlock,
                        width, false);
            for (int r = 0; r < kBlock; ++r) {
              float* row = scores + r * kKeys;
              // keys of the step that query q0 + r sees: from `hidden` (its document's first)
              // to `seen` (itself)
              const int seen = static_cast<int>(std::min<int64_t>(q0 + r + 1 - k0, width));
              const int hidden =
                  fk.first ? static_cast<int>(std::clamp<int64_t>(fk.at(b, q0 + r) - k0, 0, width))
                           : 0;
              // pass 1: the scaled scores (hidden ones -inf) written back, and their maximum
              LaneV top = hidden_score;
              for (int c = 0; c < vecs; ++c) {
                const LaneV x =
                    hide_unseen(Lanes::mul(Lanes::load(row + kW * c), vscale), c, hidden, seen);
                Lanes::store(row + kW * c, x);
                top = Lanes::max(top, x);
              }
              const float mx = std::max(m[r], Lanes::max_of(top));
              if (mx == -INFINITY) {  // no key of the row seen yet: nothing to add
                std::fill(row, row + width, 0.f);
                continue;
              }
              // pass 2: the probabilities against the new maximum, and their sum
              const float alpha = exp_fast(m[r] - mx);
              const LaneV shift = Lanes::set1(mx);
              LaneV total = Lanes::zero();
              for (int c = 0; c < vecs; ++c) {
                const LaneV pc = Lanes::exp(Lanes::sub(Lanes::load(row + kW * c), shift));
                Lanes::store(row + kW * c, pc);
                total = Lanes::add(total, pc);
              }
              l[r] = l[r] * alpha + Lanes::sum_of(total);
              m[r] = mx;
              if (k0 == from) continue;  // no output before the first step
              // the output so far, rescaled to the new maximum
              float* o = acc.data() + r * dim;
              const LaneV a = Lanes::set1(alpha);
              for (int64_t d = 0; d < dim; d += kW)
                Lanes::store(o + d, Lanes::mul(Lanes::load(o + d), a));
            }
            fma_product(scores, kKeys, 1, vh + k0 * dim, dim, width, acc.data(), dim, kBlock,
                        dim, k0 > from);
          }
          for (int r = 0; r < kBlock; ++r) {
            const LaneV inv = Lanes::set1(1.f / l[r]);
            const float* o = acc.data() + r * dim;
            float* dst = outh + (q0 + r) * os;
            for (int64_t d = 0; d < dim; d += kW)
              Lanes::store(dst + d, Lanes::mul(Lanes::load(o + d), inv));
            lse[bh * seq + q0 + r] = m[r] + std::log(l[r]);
          }
        }
      }
    }
  }
}

// The gradients of f32_attention_forward for q, k and v (laid out as those), from its output
// and lse and the output's gradient, rows (b, h, s) of out and grad at base + b * xb + h * xh
// + s * xs. A group's key and value gradients are summed over its query heads in place.
void f32_attention_backward(const float* q, const float* k, const float* v, const float* out,
                            int64_t ob, int64_t oh, int64_t os, const float* grad, int64_t gb,
                            int64_t gh, int64_t gs, const float* lse, float* dq, float* dk,
                            float* dv, int64_t batch, HeadGroups groups, int64_t seq,
                            int64_t dim, float scale, FirstKeys fk, int threads) {
  const int64_t heads = groups.count(), hs = seq * dim;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t kld = padded_u32(seq);
    std::vector<float> kt(static_cast<size_t>(kld * dim)), vt(kt.size());
    std::vector<float> delta(static_cast<size_t>(seq));
    alignas(64) float probs[kQueries * kBlock];
    alignas(64) float dscores[kQueries * kBlock];
    const LaneV vscale = Lanes::set1(scale);
#pragma omp for schedule(dynamic)
    for (int64_t bg = 0; bg < batch * groups.groups; ++bg) {
      const int64_t b = bg / groups.groups, g = bg % groups.groups;
      const float* kh = k + bg * hs;
      float* dkh = dk + bg * hs;
      float* dvh = dv + bg * hs;
      Lanes::transpose(kh, dim, seq, dim, kt.data(), kld);
      Lanes::transpose(v + bg * hs, dim, seq, dim, vt.data(), kld);
      for (int64_t j = 0; j < groups.per; ++j) {
        const int64_t h = g * groups.per + j, bh = b * heads + h;
        const float* qh = q + bh * hs;
        const float* o = out + b * ob + h * oh;
        const float* gr = grad + b * gb + h * gh;
        float* dqh = dq + bh * hs;
        for (int64_t s = 0; s < seq; ++s) {
          LaneV sum = Lanes::zero();
          for (int64_t d = 0; d < dim; d += kW)
            sum = Lanes::fma(Lanes::load(gr + s * gs + d), Lanes::load(o + s * os + d), sum);
          delta[s] = Lanes::sum_of(sum);
        }
        std::fill(dqh, dqh + seq * dim, 0.f);
        for (int64_t k0 = 0; k0 < seq; k0 += kBlock) {
          const int64_t queries_end = fk.queries_end(b, k0);
          for (int64_t q0 = k0; q0 < queries_end; q0 += kQueries) {
            const int64_t rows = std::min(kQueries, queries_end - q0);
            fma_product(qh + q0 * dim, dim, 1, kt.data() + k0, kld, dim, probs, kBlock, rows,
                        kBlock, false);
            fma_product(gr + q0 * gs, gs, 1, vt.data() + k0, kld, dim, dscores, kBlock, rows,
                        kBlock, false);
            for (int r = 0; r < rows; ++r) {
              float* p = probs + r * kBlock;
              float* ds = dscores + r * kBlock;
              const LaneV shift = Lanes::set1(lse[bh * seq + q0 + r]);
              const LaneV dl = Lanes::set1(delta[q0 + r]);
              LaneV x[kRowVecs];
              // the block's keys up to the query's own
              const int seen = static_cast<int>(std::min<int64_t>(q0 + r + 1 - k0, kBlock));
              load_scores(p, vscale, shift, fk.hidden(b, q0 + r, k0), seen, x);
              for (int c = 0; c < kRowVecs; ++c) {
                const LaneV pc = Lanes::exp(x[c]);
                Lanes::store(p + kW * c, pc);
                // the scores' gradients: p (dp - delta), scaled as the scores were
                const LaneV dpc = Lanes::sub(Lanes::load(ds + kW * c), dl);
                Lanes::store(ds + kW * c, Lanes::mul(Lanes::mul(pc, dpc), vscale));
              }
            }
            // the first write of a key block's dk and dv rows: its diagonal block, first head
            const bool first = q0 == k0 && j == 0;
            // dv += probs^T grad, dk += dscores^T q, dq += dscores k
            fma_product(probs, 1, kBlock, gr + q0 * gs, gs, rows, dvh + k0 * dim, dim, kBlock,
                        dim, !first);
            fma_product(dscores, 1, kBlock, qh + q0 * dim, dim, rows, dkh + k0 * dim, dim,
                        kBlock, dim, !first);
            fma_product(dscores, kBlock, 1, kh + k0 * dim, dim, kBlock, dqh + q0 * dim, dim,
                        rows, dim, true);
          }
        }
      }
    }
  }
}
#endif  // HLAT_F32_FLASH

}  // namespace

extern "C" {

// Version of the entry points' signatures; the loader checks it.
int hlat_model_abi(void) { return 14; }

// `bf16`: 1 when every tensor argument is bf16 (held as uint16), 0 when fp32; rstd and part
// are fp32. Rows are contiguous, `dim` (or 2 * `width`) elements each.
void hlat_rms_norm_forward(int bf16, const void* x, const void* w, void* out, float* rstd,
                           int64_t rows, int64_t dim, float eps, int threads) {
  if (bf16) {
    rms_norm_forward(static_cast<const u16*>(x), static_cast<const u16*>(w),
                     static_cast<u16*>(out), rstd, rows, dim, eps, threads);
  } else {
    rms_norm_forward(static_cast<const float*>(x), static_cast<const float*>(w),
                     static_cast<float*>(out), rstd, rows, dim, eps, threads);
  }
}

// `sum` = x + d (rounded), `out` its RMSNorm.
void hlat_add_rms_norm_forward(int bf16, const void* x, const void* d, const void* w, void* sum,
                               void* out, float* rstd, int64_t rows, int64_t dim, float eps,
                               int threads) {
  if (bf16) {
    add_rms_norm_forward(static_cast<const u16*>(x), static_cast<const u16*>(d),
                         static_cast<const u16*>(w), static_cast<u16*>(sum),
                         static_cast<u16*>(out), rstd, rows, dim, eps, threads);
  } else {
    add_rms_norm_forward(static_cast<const float*>(x), static_cast<const float*>(d),
                         static_cast<const float*>(w), static_cast<float*>(sum),
                         static_cast<float*>(out), rstd, rows, dim, eps, threads);
  }
}

// `part`: parts x dim fp32 scratch; the weight's gradient `gw` is the sum of the parts.
// `res`: null, or a gradient added to the input's (x's dtype, contiguous rows).
void hlat_rms_norm_backward(int bf16, const void* g, const void* x, const void* w,
                            const float* rstd, const void* res, void* gx, void* gw,
                            float* part, int64_t rows, int64_t dim, int parts, int threads) {
  if (bf16) {
    rms_norm_backward(static_cast<const u16*>(g), static_cast<const u16*>(x),
                      static_cast<const u16*>(w), rstd, static_cast<const u16*>(res),
                      static_cast<u16*>(gx), part, rows, dim, parts, threads);
    sum_parts(part, static_cast<u16*>(gw), dim, parts);
  } else {
    rms_norm_backward(static_cast<const float*>(g), static_cast<const float*>(x),
                      static_cast<const float*>(w), rstd, static_cast<const float*>(res),
                      static_cast<float*>(gx), part, rows, dim, parts, threads);
    sum_parts(part, static_cast<float*>(gw), dim, parts);
  }
}

// `interleaved`: 1 when gate and up alternate in each row of gate_up, 0 for its two halves.
void hlat_swiglu_forward(int bf16, const void* gate_up, void* out, int64_t rows,
                         int64_t width, int interleaved, int threads) {
  if (bf16 && interleaved) {
    swiglu_forward<true>(static_cast<const u16*>(gate_up), static_cast<u16*>(out), rows,
                         width, threads);
  } else if (bf16) {
    swiglu_forward<false>(static_cast<const u16*>(gate_up), static_cast<u16*>(out), rows,
                          width, threads);
  } else if (interleaved) {
    swiglu_forward<true>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows,
                         width, threads);
  } else {
    swiglu_forward<false>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows,
                          width, threads);
  }
}

void hlat_swiglu_backward(int bf16, const void* grad, const void* gate_up, void* grad_gate_up,
                          int64_t rows, int64_t width, int interleaved, int threads) {
  if (bf16 && interleaved) {
    swiglu_backward<true>(static_cast<const u16*>(grad), static_cast<const u16*>(gate_up),
                          static_cast<u16*>(grad_gate_up), rows, width, threads);
  } else if (bf16) {
    swiglu_backward<false>(static_cast<const u16*>(grad), static_cast<const u16*>(gate_up),
                           static_cast<u16*>(grad_gate_up), rows, width, threads);
  } else if (interleaved) {
    swiglu_backward<true>(static_cast<const float*>(grad), static_cast<const float*>(gate_up),
                          static_cast<float*>(grad_gate_up), rows, width, threads);
  } else {
    swiglu_backward<false>(static_cast<const float*>(grad), static_cast<const float*>(gate_up),
                           static_cast<float*>(grad_gate_up), rows, width, threads);
  }
}

// `table`: batch, seq, groups, q heads per group, head_dim, and the element strides of cos
// and sin over batch and position. `grad`: 0 forward (fused -> q, k, v), 1 backward.
void hlat_rope_heads(int bf16, const int64_t* table, void* fused, void* q, void* k, void* v,
                     const float* cos, const float* sin, int grad, int threads) {
  Heads h;
  std::memcpy(&h, table, sizeof(h));
  if (bf16) {
    rope_heads(h, static_cast<u16*>(fused), static_cast<u16*>(q), static_cast<u16*>(k),
               static_cast<u16*>(v), cos, sin, grad != 0, threads);
  } else {
    rope_heads(h, static_cast<float*>(fused), static_cast<float*>(q), static_cast<float*>(k),
               static_cast<float*>(v), cos, sin, grad != 0, threads);
  }
}

// Cross entropy over `rows` rows of `vocab` logits; targets are int64. Forward writes lse and
// picked (fp32, one per row), and with `grad_scale` (fp32, one per row; null: none) overwrites
// each row with its logits' gradient. Backward writes grad (the logits' dtype).
void hlat_xent_forward(int bf16, void* logits, int64_t rows, int64_t vocab,
                       const int64_t* targets, float* lse, float* picked,
                       const float* grad_scale, int threads) {
  if (bf16) {
    xent_forward(static_cast<u16*>(logits), rows, vocab, targets, lse, picked, grad_scale,
                 threads);
  } else {
    xent_forward(static_cast<float*>(logits), rows, vocab, targets, lse, picked, grad_scale,
                 threads);
  }
}

// 1 + the index of the first label that is neither `ignore` nor in [0, vocab), else 0: read
// on the host, where the labels live, without a tensor operation.
int64_t hlat_xent_first_bad(const int64_t* labels, int64_t rows, int64_t vocab,
                            int64_t ignore) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = labels[r];
    if (t != ignore && (t < 0 || t >= vocab)) return r + 1;
  }
  return 0;
}

void hlat_xent_backward(int bf16, const void* logits, int64_t rows, int64_t vocab,
                        const int64_t* targets, const float* lse, const float* scale,
                        void* grad, int threads) {
  if (bf16) {
    xent_backward(static_cast<const u16*>(logits), rows, vocab, targets, lse, scale,
                  static_cast<u16*>(grad), threads);
  } else {
    xent_backward(static_cast<const float*>(logits), rows, vocab, targets, lse, scale,
                  static_cast<float*>(grad), threads);
  }
}

// Softmax of `blocks` x `rows` rows of `width` scores, in place (see attn_softmax).
void hlat_attn_softmax(int bf16, void* scores, int64_t blocks, int64_t rows, int64_t width,
                       int64_t first, int threads) {
  if (bf16) {
    attn_softmax(static_cast<u16*>(scores), blocks, rows, width, first, threads);
  } else {
    attn_softmax(static_cast<float*>(scores), blocks, rows, width, first, threads);
  }
}

void hlat_attn_softmax_backward(int bf16, void* grad, const void* probs, int64_t blocks,
                                int64_t rows, int64_t width, int64_t first, int threads) {
  if (bf16) {
    attn_softmax_backward(static_cast<u16*>(grad), static_cast<const u16*>(probs), blocks,
                          rows, width, first, threads);
  } else {
    attn_softmax_backward(static_cast<float*>(grad), static_cast<const float*>(probs), blocks,
                          rows, width, first, threads);
  }
}

// fp32 `acc` (batches of `n` elements, `stride` apart) += bf16 `x` (batches of n, dense).
void hlat_add_bf16_into_fp32(float* acc, int64_t stride, const void* x, int64_t batches,
                             int64_t n, int threads) {
  add_into(acc, stride, static_cast<const u16*>(x), batches, n, threads);
}

// 1 where the AMX attention kernels were built and the OS lets this process use the tiles
// (asked once), else 0.
int hlat_attn_amx_ready(void) {
#ifdef HLAT_AMX
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM
  static const int ready = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return ready;
#else
  return 0;
#endif
}

// 1 where the bf16 attention kernels were built with AVX512-BF16 dot products (the compiler
// targets AVX512-BF16), else 0.
int hlat_attn_bf16_ready(void) {
#ifdef HLAT_BF16
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"

namespace {
// Whether the bf16 kernels can run on AMX tiles (`tiles`) or dot products.
bool bf16_ready(int tiles) { return tiles ? hlat_attn_amx_ready() : hlat_attn_bf16_ready(); }

#ifdef HLAT_BF16
// bf16_attention_forward or _backward (`fn`, a generic lambda taking the product's kind as
// std::bool_constant) on AMX tiles where `tiles`, else by dot products.
template <typename Fn>
void on_products(int tiles, Fn&& fn) {
#ifdef HLAT_AMX
  if (tiles) {
    fn(std::true_type{});
    return;
  }
#endif
  fn(std::false_type{});
}
#endif
}  // namespace

extern "C" {

// Causal attention of bf16 q [batch * heads][seq][dim] and k, v [batch * kv_heads][seq][dim]
// (see bf16_attention_forward; heads a multiple of kv_heads, each key and value head read by
// heads / kv_heads query heads side by side), on AMX tiles where `tiles` is 1, else by
// AVX512-BF16 dot products; seq and dim multiples of 32. `first`: null (causal attention), or
// each query's first key [batch][seq] int64 (packed documents: see FirstKeys). Returns 0, or -1
// (nothing done) where hlat_attn_amx_ready (`tiles`) or hlat_attn_bf16_ready says 0, or the
// heads do not group.
int hlat_attn_bf16_forward(int tiles, const void* q, const void* k, const void* v, void* out,
                           int64_t ob, int64_t oh, int64_t os, float* lse, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t seq, int64_t dim,
                           float scale, const int64_t* first, int threads) {
  if (!bf16_ready(tiles) || kv_heads <= 0 || heads % kv_heads != 0) return -1;
#ifdef HLAT_BF16
  const int64_t hs = seq * dim, per = heads / kv_heads, kvs = kv_heads * hs;
  on_products(tiles, [&](auto kind) {
    bf16_attention_forward<decltype(kind)::value>(
        {static_cast<const u16*>(q), heads * hs, per * hs, dim},
        {static_cast<const u16*>(k), kvs, hs, dim}, {static_cast<const u16*>(v), kvs, hs, dim},
        nullptr, {static_cast<u16*>(out), ob, oh, os}, lse, batch, HeadGroups{kv_heads, per, hs},
        seq, dim, scale, FirstKeys{first, seq}, threads);
  });
#endif
  return 0;
}

// The gradients of hlat_attn_bf16_forward's inputs (dk and dv summed over each key and value
// head's query heads); returns as it does.
int hlat_attn_bf16_backward(int tiles, const void* q, const void* k, const void* v,
                            const void* out, int64_t ob, int64_t oh, int64_t os,
                            const void* grad, int64_t gb, int64_t gh, int64_t gs,
                            const float* lse, void* dq, void* dk, void* dv, int64_t batch,
                            int64_t heads, int64_t kv_heads, int64_t seq, int64_t dim,
                            float scale, const int64_t* first, int threads) {
  if (!bf16_ready(tiles) || kv_heads <= 0 || heads % kv_heads != 0) return -1;
#ifdef HLAT_BF16
  const int64_t hs = seq * dim, per = heads / kv_heads, qs = heads * hs, kvs = kv_heads * hs;
  on_products(tiles, [&](auto kind) {
    bf16_attention_backward<decltype(kind)::value>(
        {static_cast<const u16*>(q), qs, per * hs, dim},
        {static_cast<const u16*>(k), kvs, hs, dim}, {static_cast<const u16*>(v), kvs, hs, dim},
        nullptr, {static_cast<const u16*>(out), ob, oh, os},
        {static_cast<const u16*>(grad), gb, gh, gs}, lse,
        {static_cast<u16*>(dq), qs, per * hs, dim}, {static_cast<u16*>(dk), kvs, hs, dim},
        {static_cast<u16*>(dv), kvs, hs, dim}, batch, HeadGroups{kv_heads, per, hs}, seq, dim,
        scale, FirstKeys{first, seq}, threads);
  });
#endif
  return 0;
}

// The bf16 attention reading q, k and v from the fused product qkv [batch, seq, groups,
// per + 2, dim] (each group's `per` query heads, then its key and value head, rows side by
// side; groups side by side; batch and position any strides), RoPE applied to q and k as
// they are read (tables as hlat_rope_heads's). `table`: batch, seq, groups, per, dim, qkv's
// element strides over batch and position, and those of cos and sin. out's heads are the
// query heads, group by group. `first` and the return as hlat_attn_bf16_forward's.
int hlat_attn_bf16_rope_forward(int tiles, const void* qkv, const int64_t* table,
                                const float* cos, const float* sin, void* out, int64_t ob,
                                int64_t oh, int64_t os, float* lse, float scale,
                                const int64_t* first, int threads) {
  if (!bf16_ready(tiles)) return -1;
#ifdef HLAT_BF16
  const int64_t batch = table[0], seq = table[1], per = table[3], dim = table[4];
  const int64_t bs = table[5], pos = table[6], stride = (per + 2) * dim;
  const HeadGroups heads{table[2], per, dim};
  const u16* q = static_cast<const u16*>(qkv);
  const Rope rope{cos, sin, table[7], table[8]};
  on_products(tiles, [&](auto kind) {
    bf16_attention_forward<decltype(kind)::value>(
        {q, bs, stride, pos}, {q + per * dim, bs, stride, pos},
        {q + (per + 1) * dim, bs, stride, pos},
        &rope, {static_cast<u16*>(out), ob, oh, os}, lse, batch, heads, seq, dim, scale,
        FirstKeys{first, seq}, threads);
  });
#endif
  return 0;
}

// Its gradient for qkv (grad_qkv: the same strides), from its output, lse and the output's
// gradient.
int hlat_attn_bf16_rope_backward(int tiles, const void* qkv, const int64_t* table,
                                 const float* cos, const float* sin, const void* out,
                                 int64_t ob, int64_t oh, int64_t os, const void* grad,
                                 int64_t gb, int64_t gh, int64_t gs, const float* lse,
                                 void* grad_qkv, float scale, const int64_t* first,
                                 int threads) {
  if (!bf16_ready(tiles)) return -1;
#ifdef HLAT_BF16
  const int64_t batch = table[0], seq = table[1], per = table[3], dim = table[4];
  const int64_t bs = table[5], pos = table[6], stride = (per + 2) * dim;
  const HeadGroups heads{table[2], per, dim};
  const u16* q = static_cast<const u16*>(qkv);
  u16* dq = static_cast<u16*>(grad_qkv);
  const Rope rope{cos, sin, table[7], table[8]};
  on_products(tiles, [&](auto kind) {
    bf16_attention_backward<decltype(kind)::value>(
        {q, bs, stride, pos}, {q + per * dim, bs, stride, pos},
        {q + (per + 1) * dim, bs, stride, pos}, &rope,
        {static_cast<const u16*>(out), ob, oh, os}, {static_cast<const u16*>(grad), gb, gh, gs},
        lse, {dq, bs, stride, pos}, {dq + per * dim, bs, stride, pos},
        {dq + (per + 1) * dim, bs, stride, pos}, batch, heads, seq, dim, scale,
        FirstKeys{first, seq}, threads);
  });
#endif
  return 0;
}

// 1 where the fp32 attention kernels were built (the compiler targets AVX-512F, or AVX2 and
// FMA), else 0.
int hlat_attn_f32_ready(void) {
#ifdef HLAT_F32_FLASH
  return 1;
#else
  return 0;
#endif
}

// Causal attention of fp32 q [batch * heads][seq][dim] and k, v [batch * kv_heads][seq][dim]
// (see f32_attention_forward; heads a multiple of kv_heads); seq and dim multiples of 32;
// `first` as hlat_attn_bf16_forward's. Returns 0, or -1 (nothing done) where
// hlat_attn_f32_ready says 0 or the heads do not group.
int hlat_attn_f32_forward(const float* q, const float* k, const float* v, float* out,
                          int64_t ob, int64_t oh, int64_t os, float* lse, int64_t batch,
                          int64_t heads, int64_t kv_heads, int64_t seq, int64_t dim,
                          float scale, const int64_t* first, int threads) {
  if (kv_heads <= 0 || heads % kv_heads != 0) return -1;
#ifdef HLAT_F32_FLASH
  f32_attention_forward(q, k, v, out, ob, oh, os, lse, batch,
                        HeadGroups{kv_heads, heads / kv_heads, 0}, seq, dim, scale,
                        FirstKeys{first, seq}, threads);
  return 0;
#else
  return -1;
#endif
}

// The gradients of hlat_attn_f32_forward's inputs (dk and dv summed over each key and value
// head's query heads); returns as it does.
int hlat_attn_f32_backward(const float* q, const float* k, const float* v, const float* out,
                           int64_t ob, int64_t oh, int64_t os, const float* grad, int64_t gb,
                           int64_t gh, int64_t gs, const float* lse, float* dq, float* dk,
                           float* dv, int64_t batch, int64_t heads, int64_t kv_heads,
                           int64_t seq, int64_t dim, float scale, const int64_t* first,
                           int threads) {
  if (kv_heads <= 0 || heads % kv_heads != 0) return -1;
#ifdef HLAT_F32_FLASH
  f32_attention_backward(q, k, v, out, ob, oh, os, grad, gb, gh, gs, lse, dq, dk, dv, batch,
                         HeadGroups{kv_heads, heads / kv_heads, 0}, seq, dim, scale,
                         FirstKeys{first, seq}, threads);
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
