// The AdamW update of hlat_optim.adamw.adamw_update as one vectorised CPU loop.
//
// Built on first use by hlat_optim._native (the host compiler, -O3 -march=native
// -ffp-contract=off) and called through ctypes on the raw data of contiguous tensors. Every
// arithmetic operation is the one the reference performs, in the same order and without
// contraction into FMAs, so results are bit-identical to the reference on any input.
//
// The loop is written with GCC/clang vector extensions: 16 lanes of 32 bits where the target
// has AVX-512 (one zmm register), else 8 (one ymm register on AVX2; the compiler splits them
// for SSE or NEON). What keeps it fast on CPUs without native bf16 arithmetic:
// - With bf16 states, elements are processed in pairs (2j, 2j+1). Two bf16 values are one
//   32-bit word, so widening to fp32 and narrowing back are a shift or a mask per lane, with
//   no cross-lane shuffles.
// - Stochastic rounding takes a short path, (bits + r) & 0xFFFF0000, which is exact unless
//   the value is inf, NaN or above the largest bf16. Each group of two vectors checks for
//   such a magnitude while its fp32 values are still in registers, and only then rounds the
//   group again element by element with the full rules of round_with_bits.
// - All tensors of a step come in one call, and threads take chunks of any tensor, so a small
//   tensor costs no thread start-up of its own.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

#define HLAT_INLINE inline __attribute__((always_inline))

using u32 = uint32_t;
using u16 = uint16_t;

constexpr u32 kLow = 0xFFFF0000u;
constexpr u32 kExp = 0x7F800000u;
constexpr u32 kMant = 0x007FFFFFu;
constexpr u32 kQuietNan = 0x00400000u;
constexpr int32_t kLargestBf16 = 0x7F7F0000;

inline float f_of(u32 b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline u32 b_of(float f) {
  u32 b;
  std::memcpy(&b, &f, 4);
  return b;
}

// ---------------------------------------------------------------------------------------
// Scalar forms: the tail of a tensor and the exact re-rounding of a flagged group.

inline float load1(const float* p, int64_t k) { return p[k]; }
inline float load1(const u16* p, int64_t k) { return f_of(u32(p[k]) << 16); }
// For bf16 arrays the values stored are rounded fp32 bit patterns (low half zero).
inline void store1(float* p, int64_t k, float x, u32) { p[k] = x; }
inline void store1(u16* p, int64_t k, float, u32 r) { p[k] = u16(r >> 16); }

// hlat_optim.rounding.mix32 and hashed_bits, in wrapping unsigned arithmetic; T is u32 or a
// vector of u32.
template <typename T>
HLAT_INLINE T mix32(T h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  return h ^ (h >> 16);
}
constexpr u32 kGolden = 0x9E3779B1u;
template <typename T>
HLAT_INLINE T hashed_bits(T index, u32 key) {
  return mix32<T>(index * kGolden + key);
}

// hlat_optim.rounding.round_with_bits: all cases.
inline u32 round_full(float x, u32 r) {
  u32 i = b_of(x);
  u32 rounded = (i + r) & kLow;
  bool special = (i & kExp) == kExp;
  bool over = (rounded & kExp) == kExp;
  rounded = over ? rounded - 0x10000u : rounded;
  u32 kept = (i & kLow) | ((i & kMant) != 0 ? kQuietNan : 0u);
  return special ? kept : rounded;
}
// torch's float -> bfloat16 conversion (round to nearest even, NaN to 0x7FC0).
inline u32 round_nearest(float x) {
  u32 i = b_of(x);
  u32 r = (i + (((i >> 16) & 1u) + 0x7FFFu)) & kLow;
  return x != x ? 0x7FC00000u : r;
}

struct Hyper {
  float decay, step_size, omb1, beta2, omb2, eps, inv_bc2_sqrt;
  // The gradients' multiplier (a clipping coefficient, rounded to bf16 for bf16 gradients)
  // where `scaled`: each gradient is multiplied by it and rounded to its own dtype first, as
  // an in-place multiply of the gradient tensor would leave it.
  float grad_scale;
  bool scaled;
};
constexpr size_t kHyperFloats = 7;  // per tensor in the caller's table

// kMaster: fp32 master weights; kKahan: a bf16 Kahan compensation (bf16 parameters only).
template <typename P, typename S, bool kMaster, bool kSR, bool kKahan>
struct Policy {
  static constexpr bool kParamSR = kSR && !kMaster && !kKahan && std::is_same_v<P, u16>;
  static constexpr bool kStateSR = kSR && std::is_same_v<S, u16>;
  static constexpr bool kBits = kParamSR || kStateSR;
};

inline float root(float x) { return std::sqrt(x); }

// Vectors of kLanes lanes of 32 bits (and kLanes bf16 values): one register of the widest
// kind the target has. Note: the width follows the target's registers, as a value held in two
// registers gains nothing and takes registers the loop needs; hence the choice at build time.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef u32 vu __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef u16 vh __attribute__((vector_size(2 * kLanes)));
using Lanes = std::make_integer_sequence<int, kLanes>;

#if defined(__clang__)
#define HLAT_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define HLAT_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

HLAT_INLINE vf root(vf x) {
#if defined(__AVX512F__)
  return (vf)_mm512_sqrt_ps((__m512)x);
#elif defined(__AVX__)
  return (vf)_mm256_sqrt_ps((__m256)x);
#else
  for (int l = 0; l < kLanes; ++l) x[l] = std::sqrt(x[l]);
  return x;
#endif
}

// The fp32 math of adamw_update; `w` comes in as the weight to decay. F is float or vf.
template <typename F>
HLAT_INLINE void adam(const Hyper& h, F g, F& m, F& v, F& w) {
  m = m + h.omb1 * (g - m);
  v = v * h.beta2 + h.omb2 * g * g;
  F denom = root(v) * h.inv_bc2_sqrt + h.eps;
  w = w * h.decay;
  w = w - h.step_size * (m / denom);
}

// Rounded patterns of (w, m, v) for element `index`, with the full rules.
template <typename P, typename S, bool kMaster, bool kSR, bool kKahan>
inline void round3(float w, float m, float v, u32 index, u32 key, u32& wr, u32& mr, u32& vr) {
  using Pol = Policy<P, S, kMaster, kSR, kKahan>;
  u32 bits = 0;
  if constexpr (Pol::kBits) bits = hashed_bits<u32>(index, key);
  if constexpr (std::is_same_v<P, u16>) {
    wr = Pol::kParamSR ? round_full(w, bits & 0xFFFFu) : round_nearest(w);
  }
  if constexpr (std::is_same_v<S, u16>) {
    if constexpr (Pol::kStateSR) {
      mr = round_full(m, bits >> 16);
      vr = round_full(v, (bits * 0x2C1B3C6Du) >> 16);
    } else {
      mr = round_nearest(m);
      vr = round_nearest(v);
    }
  }
}

template <typename P, typename G, typename S>
struct Arrays {
  P* __restrict param;
  const G* __restrict grad;
  S* __restrict exp_avg;
  S* __restrict exp_avg_sq;
  float* __restrict master;  // fp32 master weights, or null
  u16* __restrict comp;      // bf16 Kahan compensation, or null
};

// The weight an update starts from: the master weight, else the parameter (plus its Kahan
// compensation).
template <typename P, typename G, typename S, bool kMaster, bool kKahan>
inline float weight1(const Arrays<P, G, S>& a, int64_t k) {
  if constexpr (kMaster) return load1(a.master, k);
  if constexpr (kKahan) return load1(a.param, k) + load1(a.comp, k);
  return load1(a.param, k);
}
// What rounding the updated weight to the parameter lost, rounded to bf16.
inline u32 kahan_rest(float w, u32 wr) { return round_nearest(w - f_of(wr)); }

// g times the gradients' multiplier, rounded to the gradient's dtype G.
template <typename G>
HLAT_INLINE float scale1(float g, float s) {
  if constexpr (std::is_same_v<G, u16>) {
    return f_of(round_nearest(g * s));
  } else {
    return g * s;
  }
}

// Element k alone (the tail of a tensor).
template <typename P, typename G, typename S, bool kMaster, bool kSR, bool kKahan>
void update_one(const Arrays<P, G, S>& a, const Hyper& h, u32 key, u32 offset, int64_t k) {
  float g = load1(a.grad, k), m = load1(a.exp_avg, k), v = load1(a.exp_avg_sq, k);
  if (h.scaled) g = scale1<G>(g, h.grad_scale);
  float w = weight1<P, G, S, kMaster, kKahan>(a, k);
  adam(h, g, m, v, w);
  u32 wr = 0, mr = 0, vr = 0;
  round3<P, S, kMaster, kSR, kKahan>(w, m, v, u32(k) + offset, key, wr, mr, vr);
  if constexpr (kMaster) a.master[k] = w;
  if constexpr (kKahan) store1(a.comp, k, 0.f, kahan_rest(w, wr));
  store1(a.param, k, w, wr);
  store1(a.exp_avg, k, m, mr);
  store1(a.exp_avg_sq, k, v, vr);
}

// ---------------------------------------------------------------------------------------
// Vector forms.

HLAT_INLINE bool any_lane(vi c) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)c, (__m512i)c) != 0;
#elif defined(__AVX__)
  return !_mm256_testz_si256((__m256i)c, (__m256i)c);
#else
  int32_t r = 0;
  for (int l = 0; l < kLanes; ++l) r |= c[l];
  return r != 0;
#endif
}

HLAT_INLINE vu vround_nearest(vf x) {
  vu i = (vu)x;
  vu r = (i + (((i >> 16) & 1u) + 0x7FFFu)) & kLow;
  return x != x ? vu{} + 0x7FC00000u : r;
}
// The short path of round_with_bits; `big` keeps the largest magnitude it was given.
HLAT_INLINE vu vround_short(vf x, vu r, vi& big) {
  vu i = (vu)x;
  vi mag = (vi)(i & 0x7FFFFFFFu);
  big = mag > big ? mag : big;
  return (i + r) & kLow;
}

// A group is 2 * kLanes elements held as two vectors. When the states are bf16 (then 3 or 4 of
// the 4 streams are bf16) the group is kLanes pairs (2j, 2j+1), vector 0 holding the even
// elements and vector 1 the odd ones: two bf16 values are one 32-bit word, so widening to
// fp32 and narrowing back are a shift or a mask per lane. Otherwise vector k holds the
// elements k * kLanes to (k + 1) * kLanes - 1, as pairs would add a shuffle to every fp32
// stream.
template <typename S>
constexpr bool kPairs = std::is_same_v<S, u16>;
constexpr int64_t kGroup = 2 * kLanes;

// Position in the group of lane l of vector k.
template <bool Pairs>
constexpr u32 pos(int k, int l) {
  return u32(Pairs ? 2 * l + k : kLanes * k + l);
}

// The positions of vector k's lanes, times the hash's first multiplier (see update_group).
template <bool Pairs, int... L>
constexpr vu scaled_positions(int k, std::integer_sequence<int, L...>) {
  return vu{(pos<Pairs>(k, L) * kGolden)...};
}

// Even and odd lanes of a:b, and the two halves of interleaving a with b.
template <int... L>
HLAT_INLINE vf evens(vf a, vf b, std::integer_sequence<int, L...>) {
  return HLAT_SHUFFLE(a, b, (2 * L)...);
}
template <int... L>
HLAT_INLINE vf odds(vf a, vf b, std::integer_sequence<int, L...>) {
  return HLAT_SHUFFLE(a, b, (2 * L + 1)...);
}
template <int Half, int... L>
HLAT_INLINE vf interleave(vf a, vf b, std::integer_sequence<int, L...>) {
  return HLAT_SHUFFLE(a, b, (Half * kLanes / 2 + L / 2 + (L % 2) * kLanes)...);
}

template <bool Pairs>
HLAT_INLINE void vload(const u16* p, int64_t e, vf* x) {
  if constexpr (Pairs) {
    vu w;
    std::memcpy(&w, p + e, sizeof(w));
    x[0] = (vf)(w << 16);
    x[1] = (vf)(w & kLow);
  } else {
    for (int k = 0; k < 2; ++k) {
      vh h;
      std::memcpy(&h, p + e + kLanes * k, sizeof(h));
      x[k] = (vf)(__builtin_convertvector(h, vu) << 16);
    }
  }
}
template <bool Pairs>
HLAT_INLINE void vload(const float* p, int64_t e, vf* x) {
  vf a, b;
  std::memcpy(&a, p + e, sizeof(a));
  std::memcpy(&b, p + e + kLanes, sizeof(b));
  if constexpr (Pairs) {
    x[0] = evens(a, b, Lanes{});
    x[1] = odds(a, b, Lanes{});
  } else {
    x[0] = a;
    x[1] = b;
  }
}
template <bool Pairs>
HLAT_INLINE void vstore(u16* p, int64_t e, const vf*, const vu* r) {
  if constexpr (Pairs) {
    vu w = (r[0] >> 16) | r[1];
    std::memcpy(p + e, &w, sizeof(w));
  } else {
    for (int k = 0; k < 2; ++k) {
      vh h = __builtin_convertvector(r[k] >> 16, vh);
      std::memcpy(p + e + kLanes * k, &h, sizeof(h));
    }
  }
}
template <bool Pairs>
HLAT_INLINE void vstore(float* p, int64_t e, const vf* x, const vu*) {
  vf a = x[0], b = x[1];
  if constexpr (Pairs) {
    a = interleave<0>(x[0], x[1], Lanes{});
    b = interleave<1>(x[0], x[1], Lanes{});
  }
  std::memcpy(p + e, &a, sizeof(a));
  std::memcpy(p + e + kLanes, &b, sizeof(b));
}

// A group with an inf, NaN or near-overflow value: every element rounded again exactly.
template <typename P, typename G, typename S, bool kMaster, bool kSR, bool kKahan>
__attribute__((noinline, cold)) void refix(const Arrays<P, G, S>& a, u32 key, u32 offset,
                                           int64_t e, vf w0, vf w1, vf m0, vf m1, vf v0,
                                           vf v1) {
  const vf w[2] = {w0, w1}, m[2] = {m0, m1}, v[2] = {v0, v1};
  for (int k = 0; k < 2; ++k) {
    for (int l = 0; l < kLanes; ++l) {
      const int64_t x = e + pos<kPairs<S>>(k, l);
      u32 r0 = 0, r1 = 0, r2 = 0;
      round3<P, S, kMaster, kSR, kKahan>(w[k][l], m[k][l], v[k][l], u32(x) + offset, key, r0,
                                         r1, r2);
      store1(a.param, x, w[k][l], r0);
      store1(a.exp_avg, x, m[k][l], r1);
      store1(a.exp_avg_sq, x, v[k][l], r2);
    }
  }
}

// The elements [e, e + kGroup) of one tensor.
template <typename P, typename G, typename S, bool kMaster, bool kSR, bool kKahan>
HLAT_INLINE void update_group(const Arrays<P, G, S>& a, const Hyper& h, u32 key, u32 offset,
                              int64_t e) {
  using Pol = Policy<P, S, kMaster, kSR, kKahan>;
  constexpr bool Pairs = kPairs<S>;
  vf g[2], m[2], v[2], w[2];
  vload<Pairs>(a.grad, e, g);
  if (h.scaled) {
    for (int k = 0; k < 2; ++k) {
      if constexpr (std::is_same_v<G, u16>) {
        g[k] = (vf)vround_nearest(g[k] * h.grad_scale);
      } else {
        g[k] = g[k] * h.grad_scale;
      }
    }
  }
  vload<Pairs>(a.exp_avg, e, m);
  vload<Pairs>(a.exp_avg_sq, e, v);
  if constexpr (kMaster) {
    vload<Pairs>(a.master, e, w);
  } else {
    vload<Pairs>(a.param, e, w);
    if constexpr (kKahan) {
      vf c[2];
      vload<Pairs>(a.comp, e, c);
      for (int k = 0; k < 2; ++k) w[k] = w[k] + c[k];
    }
  }
  vu wr[2] = {}, mr[2] = {}, vr[2] = {};
  vi big = {};  // the largest magnitude a short-path rounding was given
  for (int k = 0; k < 2; ++k) {
    adam(h, g[k], m[k], v[k], w[k]);
    vu bits = {};
    if constexpr (Pol::kBits) {
      // hashed_bits(lane + base, key) = mix32(lane * G + (base * G + key)) in wrapping
      // arithmetic: the per-lane product is a constant, which saves a vector multiply.
      constexpr vu lanes_g[2] = {scaled_positions<Pairs>(0, Lanes{}),
                                 scaled_positions<Pairs>(1, Lanes{})};
      bits = mix32<vu>(lanes_g[k] + ((u32(e) + offset) * kGolden + key));
    }
    if constexpr (std::is_same_v<P, u16>) {
      wr[k] = Pol::kParamSR ? vround_short(w[k], bits & 0xFFFFu, big) : vround_nearest(w[k]);
    }
    if constexpr (std::is_same_v<S, u16>) {
      if constexpr (Pol::kStateSR) {
        mr[k] = vround_short(m[k], bits >> 16, big);
        vr[k] = vround_short(v[k], (bits * 0x2C1B3C6Du) >> 16, big);
      } else {
        mr[k] = vround_nearest(m[k]);
        vr[k] = vround_nearest(v[k]);
      }
    }
  }
  if constexpr (kMaster) vstore<Pairs>(a.master, e, w, wr);
  if constexpr (kKahan) {
    vu cr[2];
    for (int k = 0; k < 2; ++k) cr[k] = vround_nearest(w[k] - (vf)wr[k]);
    vstore<Pairs>(a.comp, e, w, cr);
  }
  vstore<Pairs>(a.param, e, w, wr);
  vstore<Pairs>(a.exp_avg, e, m, mr);
  vstore<Pairs>(a.exp_avg_sq, e, v, vr);
  if constexpr (Pol::kBits) {
    if (__builtin_expect(any_lane(big > kLargestBf16), 0)) {
      refix<P, G, S, kMaster, kSR, kKahan>(a, key, offset, e, w[0], w[1], m[0], m[1], v[0],
                                           v[1]);
    }
  }
}

// Elements [begin, end) of one tensor; begin is a multiple of kGroup.
template <typename P, typename G, typename S, bool kMaster, bool kSR, bool kKahan>
void update_range(const Arrays<P, G, S> a, const Hyper h, u32 key, u32 offset,
                  int64_t begin, int64_t end) {
  // Note: by value, so that the compiler knows the stores through the arrays cannot change
  // the pointers or the hyperparameters and keeps them in registers.
  int64_t e = begin;
  for (; e + kGroup <= end; e += kGroup) {
    update_group<P, G, S, kMaster, kSR, kKahan>(a, h, key, offset, e);
  }
  for (; e < end; ++e) update_one<P, G, S, kMaster, kSR, kKahan>(a, h, key, offset, e);
}

// All arrays fp32: a plain loop over elements (nothing to round).
template <bool kScaled>
void update_fp32_loop(float* __restrict p, const float* __restrict g, float* __restrict m,
                      float* __restrict v, const Hyper& h, int64_t begin, int64_t end) {
  const float s = h.grad_scale;
  for (int64_t k = begin; k < end; ++k) {
    float mk = m[k], vk = v[k], w = p[k];
    adam(h, kScaled ? g[k] * s : g[k], mk, vk, w);
    m[k] = mk;
    v[k] = vk;
    p[k] = w;
  }
}

void update_fp32(float* __restrict p, const float* __restrict g, float* __restrict m,
                 float* __restrict v, const Hyper& h, int64_t begin, int64_t end) {
  if (h.scaled) {
    update_fp32_loop<true>(p, g, m, v, h, begin, end);
  } else {
    update_fp32_loop<false>(p, g, m, v, h, begin, end);
  }
}

// ---------------------------------------------------------------------------------------
// Dispatch: one row of the step's table per tensor.

struct Row {
  int64_t param, grad, exp_avg, exp_avg_sq, master, comp, n, flags, key, offset;
};
constexpr int64_t kParamBf16Flag = 1, kGradBf16Flag = 2, kStateBf16Flag = 4, kSRFlag = 8;

template <typename T>
T* ptr(int64_t address) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(address));
}

template <typename P, typename G, typename S, bool kMaster, bool kKahan>
void run_weights(const Row& r, const Hyper& h, int64_t begin, int64_t end) {
  Arrays<P, G, S> a{ptr<P>(r.param),      ptr<const G>(r.grad), ptr<S>(r.exp_avg),
                    ptr<S>(r.exp_avg_sq), ptr<float>(r.master), ptr<u16>(r.comp)};
  const u32 key = u32(r.key), offset = u32(r.offset);
  if constexpr (std::is_same_v<P, float> && std::is_same_v<G, float> &&
                std::is_same_v<S, float> && !kMaster && !kKahan) {
    update_fp32(a.param, a.grad, a.exp_avg, a.exp_avg_sq, h, begin, end);
  } else if (r.flags & kSRFlag) {
    update_range<P, G, S, kMaster, true, kKahan>(a, h, key, offset, begin, end);
  } else {
    update_range<P, G, S, kMaster, false, kKahan>(a, h, key, offset, begin, end);
  }
}

template <typename P, typename G, typename S>
void run_state(const Row& r, const Hyper& h, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<P, u16>) {
    if (r.master) return run_weights<P, G, S, true, false>(r, h, begin, end);
    if (r.comp) return run_weights<P, G, S, false, true>(r, h, begin, end);
  }
  run_weights<P, G, S, false, false>(r, h, begin, end);
}

template <typename P, typename G>
void run_grad(const Row& r, const Hyper& h, int64_t begin, int64_t end) {
  if (r.flags & kStateBf16Flag) {
    run_state<P, G, u16>(r, h, begin, end);
  } else {
    run_state<P, G, float>(r, h, begin, end);
  }
}

void run(const Row& r, const Hyper& h, int64_t begin, int64_t end) {
  const bool pb = r.flags & kParamBf16Flag, gb = r.flags & kGradBf16Flag;
  if (pb) {
    gb ? run_grad<u16, u16>(r, h, begin, end) : run_grad<u16, float>(r, h, begin, end);
  } else {
    gb ? run_grad<float, u16>(r, h, begin, end) : run_grad<float, float>(r, h, begin, end);
  }
}

struct Task {
  int64_t row, begin, end;
};
constexpr int64_t kChunk = 1 << 15;  // elements per task: a multiple of every group size

// sums[r] = the sum of squares of row r of x (`len` bf16 values), in fp32: kLanes partial
// sums of every kLanes-th element, added in a fixed order, so the result does not depend on
// the thread count. One read of x, no fp32 copy.
void bf16_row_sumsq(const u16* x, int64_t rows, int64_t len, float* sums, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const u16* __restrict row = x + r * len;
    float lanes[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float v = load1(row, j + l);
        lanes[l] += v * v;
      }
    }
    float total = 0.f;
    for (int l = 0; l < kLanes; ++l) total += lanes[l];
    for (; j < len; ++j) total += load1(row, j) * load1(row, j);
    sums[r] = total;
  }
}

}  // namespace

extern "C" {

// The sums of squares of `rows` rows of `len` bf16 values each (see bf16_row_sumsq).
void hlat_bf16_row_sumsq(const uint16_t* x, int64_t rows, int64_t len, float* sums,
                         int threads) {
  bf16_row_sumsq(x, rows, len, sums, threads);
}

// Version of the entry point's signature; the loader checks it.
int hlat_adamw_abi(void) { return 5; }

// One AdamW update, in place, of `count` contiguous tensors. `table` has 10 int64 values per
// tensor: the addresses of param, grad, exp_avg, exp_avg_sq, master (fp32, or 0) and comp
// (bf16 Kahan compensation, or 0), the element count n, flags (1: param is bf16, 2: grad is
// bf16, 4: states are bf16, 8: stochastic rounding), the rounding key and the index offset.
// `hypers` has adamw_update's 7 floats per tensor. `skip` is the data of a torch.bool tensor,
// or null: when it holds true, nothing is updated. `grad_scale` is the data of a 0-d fp32
// tensor, or null: every gradient is read multiplied by it (see Hyper). Returns 0, or 1 + the
// index of the first row with an unsupported combination (then nothing is updated).
int64_t hlat_adamw_step(int64_t count, const int64_t* table, const float* hypers,
                        int threads, const uint8_t* skip, const float* grad_scale) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < count; ++i) {
    Row r;
    std::memcpy(&r, table + 10 * i, sizeof(r));
    const bool extra = r.master != 0 || r.comp != 0;
    if (r.n < 0 || (r.master != 0 && r.comp != 0) || (extra && !(r.flags & kParamBf16Flag))) {
      return 1 + i;
    }
    for (int64_t b = 0; b < r.n; b += kChunk) tasks.push_back({i, b, b + kChunk < r.n ? b + kChunk : r.n});
  }
  // Read here, after the rows are checked, so that a bad row is reported on skipped steps too;
  // the flag is read from the tensor's memory, so the caller never reads it on the host.
  if (skip != nullptr && *skip != 0) return 0;
  const float scale = grad_scale != nullptr ? *grad_scale : 1.0f;
  const float scale_bf16 = f_of(round_nearest(scale));
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && ntasks > 1)
  for (int64_t t = 0; t < ntasks; ++t) {
    const Task& task = tasks[t];
    Row r;
    std::memcpy(&r, table + 10 * task.row, sizeof(r));
    Hyper h;
    std::memcpy(&h, hypers + kHyperFloats * task.row, kHyperFloats * sizeof(float));
    h.scaled = grad_scale != nullptr;
    h.grad_scale = (r.flags & kGradBf16Flag) ? scale_bf16 : scale;
    run(r, h, task.begin, task.end);
  }
  return 0;
}

}  // extern "C"
