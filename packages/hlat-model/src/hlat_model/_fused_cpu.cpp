// Fused CPU kernels of hlat_model: RMSNorm, SwiGLU, the RoPE head split, the cross entropy
// of rows of logits and blocked attention's softmax, forward and backward, each one pass over
// its rows where torch's eager operators make one pass per operation.
//
// Built on first use by hlat_model._native (the host compiler, -O3 -march=native) and called
// through ctypes on the raw data of contiguous fp32 or bf16 tensors. All arithmetic is fp32;
// bf16 values are widened by a shift and narrowed once, round to nearest even (NaN stays NaN),
// as torch rounds. Loops are plain C++ that the compiler vectorises; reductions keep 16
// partial sums, combined in a fixed order, so results do not depend on the thread count
// (the weight gradient of RMSNorm sums per-part partials, parts fixed by the caller).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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
void rms_norm_forward(const T* x, const T* w, T* out, float* rstd, int64_t rows, int64_t dim,
                      float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict xr = x + r * dim;
    T* __restrict o = out + r * dim;
    const float rs = 1.f / std::sqrt(sum_of_squares(xr, dim) / float(dim) + eps);
    rstd[r] = rs;
    for (int64_t j = 0; j < dim; ++j) store(o, j, rounded(o, load(xr, j) * rs) * load(w, j));
  }
}

// grad_x = rstd * (d - n * mean(d * n)), d = g * w, n = x * rstd (unrounded), in fp32;
// part[p] holds the sum of g * round(n) over the rows of part p (the weight's gradient).
template <typename T>
void rms_norm_backward(const T* g, const T* x, const T* w, const float* rstd, T* gx,
                       float* part, int64_t rows, int64_t dim, int parts, int threads) {
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
      for (j = 0; j < dim; ++j) {
        const float n = load(xr, j) * rs;
        store(o, j, (load(gr, j) * load(w, j) - n * dot) * rs);
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
template <typename T>
inline void rotate(const T* __restrict src, T* __restrict dst, const float* __restrict c,
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

// The largest element of a row (NaN is skipped here and comes back through the sum of
// exponentials). Written with the compiler's vector types: its vectoriser leaves a maximum
// over lanes written as scalars unvectorised.
using f32x16 = float __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f32x16 load16(const u16* p) {
  using u16x16 = u16 __attribute__((vector_size(32)));
  using u32x16 = u32 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

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

template <typename T>
float sum_exp(const T* __restrict x, int64_t n, float shift) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += exp_fast(load(x, j + l) - shift);
  }
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (; j < n; ++j) s += exp_fast(load(x, j) - shift);
  return s;
}

// lse[r] = log(sum(exp(x))) and picked[r] = x[target] of each row; with `softmax_grad` (fp32
// only), the row is overwritten with softmax(x) - onehot(target).
template <typename T>
void xent_forward(T* logits, int64_t rows, int64_t vocab, const int64_t* targets, float* lse,
                  float* picked, bool softmax_grad, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    T* __restrict x = logits + r * vocab;
    const int64_t t = targets[r];
    const bool counted = t >= 0 && t < vocab;
    const float m = row_max(x, vocab);
    const float s = sum_exp(x, vocab, m);
    lse[r] = std::log(s) + m;
    picked[r] = counted ? load(x, t) : 0.f;
    if (softmax_grad) {
      const float inv = 1.f / s;
      for (int64_t j = 0; j < vocab; ++j) store(x, j, exp_fast(load(x, j) - m) * inv);
      if (counted) store(x, t, load(x, t) - 1.f);
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
    for (int64_t j = 0; j < vocab; ++j) store(g, j, exp_fast(load(x, j) - l) * c);
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
      float lanes[kLanes] = {};
      int64_t j = 0;
      for (; j + kLanes <= seen; j += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          const float v = exp_fast(load(x, j + l) - m);
          e[j + l] = v;
          lanes[l] += v;
        }
      }
      float s = 0.f;
      for (int l = 0; l < kLanes; ++l) s += lanes[l];
      for (; j < seen; ++j) {
        e[j] = exp_fast(load(x, j) - m);
        s += e[j];
      }
      const float inv = 1.f / s;
      for (j = 0; j < seen; ++j) store(x, j, e[j] * inv);
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

}  // namespace

extern "C" {

// Version of the entry points' signatures; the loader checks it.
int hlat_model_abi(void) { return 6; }

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

// `part`: parts x dim fp32 scratch; the weight's gradient `gw` is the sum of the parts.
void hlat_rms_norm_backward(int bf16, const void* g, const void* x, const void* w,
                            const float* rstd, void* gx, void* gw, float* part, int64_t rows,
                            int64_t dim, int parts, int threads) {
  if (bf16) {
    rms_norm_backward(static_cast<const u16*>(g), static_cast<const u16*>(x),
                      static_cast<const u16*>(w), rstd, static_cast<u16*>(gx), part, rows,
                      dim, parts, threads);
    sum_parts(part, static_cast<u16*>(gw), dim, parts);
  } else {
    rms_norm_backward(static_cast<const float*>(g), static_cast<const float*>(x),
                      static_cast<const float*>(w), rstd, static_cast<float*>(gx), part, rows,
                      dim, parts, threads);
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
// picked (fp32, one per row), and with `softmax_grad` (fp32 logits only) overwrites each row
// with its softmax minus the target's one-hot. Backward writes grad (the logits' dtype).
void hlat_xent_forward(int bf16, void* logits, int64_t rows, int64_t vocab,
                       const int64_t* targets, float* lse, float* picked, int softmax_grad,
                       int threads) {
  if (bf16) {
    xent_forward(static_cast<u16*>(logits), rows, vocab, targets, lse, picked, false, threads);
  } else {
    xent_forward(static_cast<float*>(logits), rows, vocab, targets, lse, picked,
                 softmax_grad != 0, threads);
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

}  // extern "C"
