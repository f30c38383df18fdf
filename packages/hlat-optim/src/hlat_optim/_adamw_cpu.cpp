// The AdamW update of hlat_optim.adamw.adamw_update as one vectorised CPU loop.
//
// Built on first use by hlat_optim._native (the host compiler, -O3 -march=native
// -ffp-contract=off) and called through ctypes on the raw data of contiguous tensors. Every
// arithmetic operation is the one the reference performs, in the same order and without
// contraction into FMAs, so results are bit-identical to the reference on any input.
//
// Two choices keep the loop fast on CPUs without native bf16 arithmetic:
// - With bf16 states, elements are processed in pairs (2j, 2j+1). Two bf16 values are one
//   32-bit word, so widening to fp32 and narrowing back are a shift or a mask per 32-bit
//   lane, with no cross-lane shuffles; the compiler vectorises the loop over words.
// - Stochastic rounding takes a short path, (bits + r) & 0xFFFF0000, and tracks the largest
//   rounded magnitude of each block of elements. Only if some element of a block was inf,
//   NaN or rounded past the largest bf16 (which the short path gets wrong) is the block
//   rounded again from its fp32 values with the full rules of round_with_bits.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using u32 = uint32_t;
using u16 = uint16_t;

constexpr u32 kLow = 0xFFFF0000u;
constexpr u32 kExp = 0x7F800000u;
constexpr u32 kMant = 0x007FFFFFu;
constexpr u32 kQuietNan = 0x00400000u;
constexpr int64_t kBlock = 256;  // pairs per block of the rounding check

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

// One element (k) and pairs of elements (2j, 2j+1) of a float or bf16 (u16) array.
inline float load1(const float* p, int64_t k) { return p[k]; }
inline float load1(const u16* p, int64_t k) { return f_of(u32(p[k]) << 16); }
inline void load2(const float* p, int64_t j, float& a, float& b) {
  a = p[2 * j];
  b = p[2 * j + 1];
}
inline void load2(const u16* p, int64_t j, float& a, float& b) {
  u32 w;
  std::memcpy(&w, p + 2 * j, 4);
  a = f_of(w << 16);
  b = f_of(w & kLow);
}
// For bf16 arrays the values stored are rounded fp32 bit patterns (low half zero).
inline void store1(float* p, int64_t k, float x, u32) { p[k] = x; }
inline void store1(u16* p, int64_t k, float, u32 r) { p[k] = u16(r >> 16); }
inline void store2(float* p, int64_t j, float a, float b, u32, u32) {
  p[2 * j] = a;
  p[2 * j + 1] = b;
}
inline void store2(u16* p, int64_t j, float, float, u32 ra, u32 rb) {
  u32 w = (ra >> 16) | rb;
  std::memcpy(p + 2 * j, &w, 4);
}

// hlat_optim.rounding.mix32 and hashed_bits, in wrapping unsigned arithmetic.
inline u32 mix32(u32 h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  return h ^ (h >> 16);
}
inline u32 hashed_bits(u32 index, u32 key) { return mix32(index * 0x9E3779B1u + key); }

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
// The short path: equal to round_full whenever the returned magnitude `t` is below kExp.
inline u32 round_short(float x, u32 r, u32& t) {
  u32 i = b_of(x);
  t = (i & 0x7FFFFFFFu) + r;
  return (i + r) & kLow;
}
// torch's float -> bfloat16 conversion (round to nearest even, NaN to 0x7FC0).
inline u32 round_nearest(float x) {
  u32 i = b_of(x);
  u32 r = (i + (((i >> 16) & 1u) + 0x7FFFu)) & kLow;
  return x != x ? 0x7FC00000u : r;
}

struct Hyper {
  float decay, step_size, omb1, beta2, omb2, eps, bc2_sqrt;
};

// kMaster: fp32 master weights; kKahan: a bf16 Kahan compensation (bf16 parameters only).
template <typename P, typename S, bool kMaster, bool kSR, bool kKahan>
struct Policy {
  static constexpr bool kParamSR = kSR && !kMaster && !kKahan && std::is_same_v<P, u16>;
  static constexpr bool kStateSR = kSR && std::is_same_v<S, u16>;
  static constexpr bool kBits = kParamSR || kStateSR;
};

// The fp32 math of adamw_update for one element; `w` comes in as the weight to decay.
inline void adam(const Hyper& h, float g, float& m, float& v, float& w) {
  m = m + h.omb1 * (g - m);
  v = v * h.beta2 + h.omb2 * g * g;
  float denom = std::sqrt(v) / h.bc2_sqrt + h.eps;
  w = w * h.decay;
  w = w - h.step_size * (m / denom);
}

// Rounded patterns of (w, m, v) for element `index`; `t` collects the short path's largest
// magnitude.
template <typename P, typename S, bool kMaster, bool kSR, bool kKahan, bool kShort>
inline void round3(float w, float m, float v, u32 index, u32 key, u32& wr, u32& mr, u32& vr,
                   u32& t) {
  using Pol = Policy<P, S, kMaster, kSR, kKahan>;
  u32 bits = 0;
  if constexpr (Pol::kBits) bits = hashed_bits(index, key);
  u32 t1 = 0, t2 = 0, t3 = 0;
  if constexpr (std::is_same_v<P, u16>) {
    if constexpr (Pol::kParamSR) {
      wr = kShort ? round_short(w, bits & 0xFFFFu, t1) : round_full(w, bits & 0xFFFFu);
    } else {
      wr = round_nearest(w);
    }
  }
  if constexpr (std::is_same_v<S, u16>) {
    if constexpr (Pol::kStateSR) {
      u32 rv = mix32(bits ^ 0x5BD1E995u) & 0xFFFFu;
      mr = kShort ? round_short(m, bits >> 16, t2) : round_full(m, bits >> 16);
      vr = kShort ? round_short(v, rv, t3) : round_full(v, rv);
    } else {
      mr = round_nearest(m);
      vr = round_nearest(v);
    }
  }
  if constexpr (kShort) {
    u32 a = t1 > t2 ? t1 : t2;
    a = a > t3 ? a : t3;
    t = t > a ? t : a;
  }
}

// Pairs (2j, 2j+1) when the states are bf16 (then 3 or 4 of the 4 streams are bf16);
// single elements otherwise, where pairs would add a shuffle to every fp32 stream.
template <typename S>
constexpr int64_t kUnit = std::is_same_v<S, u16> ? 2 : 1;

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
template <typename P, typename G, typename S, bool kMaster, bool kKahan>
inline void weight2(const Arrays<P, G, S>& a, int64_t j, float& w0, float& w1) {
  if constexpr (kMaster) {
    load2(a.master, j, w0, w1);
  } else {
    load2(a.param, j, w0, w1);
    if constexpr (kKahan) {
      float c0, c1;
      load2(a.comp, j, c0, c1);
      w0 = w0 + c0;
      w1 = w1 + c1;
    }
  }
}
// What rounding the updated weight to the parameter lost, rounded to bf16.
inline u32 kahan_rest(float w, u32 wr) { return round_nearest(w - f_of(wr)); }

// Elements [unit_begin * U, unit_end * U) with U = kUnit<S>.
template <typename P, typename G, typename S, bool kMaster, bool kSR, bool kKahan>
void update_range(Arrays<P, G, S> a, Hyper h, u32 key, u32 offset, int64_t unit_begin,
                  int64_t unit_end) {
  using Pol = Policy<P, S, kMaster, kSR, kKahan>;
  constexpr int64_t U = kUnit<S>;
  // fp32 values of a block, kept for the full rounding when the short path may be wrong.
  float wb[2 * kBlock], mb[2 * kBlock], vb[2 * kBlock];
  for (int64_t jb = unit_begin; jb < unit_end; jb += kBlock) {
    const int64_t je = jb + kBlock < unit_end ? jb + kBlock : unit_end;
    u32 t = 0;
    for (int64_t j = jb; j < je; ++j) {
      const int64_t b = U * (j - jb);
      if constexpr (U == 2) {
        float g0, g1, m0, m1, v0, v1, w0, w1;
        load2(a.grad, j, g0, g1);
        load2(a.exp_avg, j, m0, m1);
        load2(a.exp_avg_sq, j, v0, v1);
        weight2<P, G, S, kMaster, kKahan>(a, j, w0, w1);
        adam(h, g0, m0, v0, w0);
        adam(h, g1, m1, v1, w1);
        const u32 index = u32(2 * j) + offset;
        u32 wr0 = 0, wr1 = 0, mr0 = 0, mr1 = 0, vr0 = 0, vr1 = 0;
        round3<P, S, kMaster, kSR, kKahan, true>(w0, m0, v0, index, key, wr0, mr0, vr0, t);
        round3<P, S, kMaster, kSR, kKahan, true>(w1, m1, v1, index + 1u, key, wr1, mr1, vr1, t);
        if constexpr (Pol::kBits) {
          wb[b] = w0;
          wb[b + 1] = w1;
          mb[b] = m0;
          mb[b + 1] = m1;
          vb[b] = v0;
          vb[b + 1] = v1;
        }
        if constexpr (kMaster) store2(a.master, j, w0, w1, 0u, 0u);
        if constexpr (kKahan) store2(a.comp, j, 0.f, 0.f, kahan_rest(w0, wr0), kahan_rest(w1, wr1));
        store2(a.param, j, w0, w1, wr0, wr1);
        store2(a.exp_avg, j, m0, m1, mr0, mr1);
        store2(a.exp_avg_sq, j, v0, v1, vr0, vr1);
      } else {
        float g = load1(a.grad, j), m = load1(a.exp_avg, j), v = load1(a.exp_avg_sq, j);
        float w = weight1<P, G, S, kMaster, kKahan>(a, j);
        adam(h, g, m, v, w);
        u32 wr = 0, mr = 0, vr = 0;
        round3<P, S, kMaster, kSR, kKahan, true>(w, m, v, u32(j) + offset, key, wr, mr, vr, t);
        if constexpr (Pol::kBits) {
          wb[b] = w;
          mb[b] = m;
          vb[b] = v;
        }
        if constexpr (kMaster) a.master[j] = w;
        if constexpr (kKahan) store1(a.comp, j, 0.f, kahan_rest(w, wr));
        store1(a.param, j, w, wr);
        store1(a.exp_avg, j, m, mr);
        store1(a.exp_avg_sq, j, v, vr);
      }
    }
    if constexpr (Pol::kBits) {
      if (t >= kExp) {  // an inf, NaN or overflow in this block: round it again exactly
        for (int64_t k = U * jb; k < U * je; ++k) {
          const int64_t b = k - U * jb;
          u32 wr = 0, mr = 0, vr = 0, unused = 0;
          round3<P, S, kMaster, kSR, kKahan, false>(wb[b], mb[b], vb[b], u32(k) + offset, key,
                                                    wr, mr, vr, unused);
          store1(a.param, k, wb[b], wr);
          store1(a.exp_avg, k, mb[b], mr);
          store1(a.exp_avg_sq, k, vb[b], vr);
        }
      }
    }
  }
}

// The last element of an odd-length tensor.
template <typename P, typename G, typename S, bool kMaster, bool kSR, bool kKahan>
void update_one(Arrays<P, G, S> a, Hyper h, u32 key, u32 offset, int64_t k) {
  float g = load1(a.grad, k), m = load1(a.exp_avg, k), v = load1(a.exp_avg_sq, k);
  float w = weight1<P, G, S, kMaster, kKahan>(a, k);
  adam(h, g, m, v, w);
  u32 wr = 0, mr = 0, vr = 0, unused = 0;
  round3<P, S, kMaster, kSR, kKahan, false>(w, m, v, u32(k) + offset, key, wr, mr, vr, unused);
  if constexpr (kMaster) a.master[k] = w;
  if constexpr (kKahan) store1(a.comp, k, 0.f, kahan_rest(w, wr));
  store1(a.param, k, w, wr);
  store1(a.exp_avg, k, m, mr);
  store1(a.exp_avg_sq, k, v, vr);
}

// All arrays fp32: a plain loop over elements (nothing to round).
void update_fp32(float* __restrict p, const float* __restrict g, float* __restrict m,
                 float* __restrict v, const Hyper& h, int64_t n, int threads) {
  const int64_t chunk = 1 << 14;
  const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
    for (int64_t k = c * chunk; k < end; ++k) {
      float mk = m[k], vk = v[k], w = p[k];
      adam(h, g[k], mk, vk, w);
      m[k] = mk;
      v[k] = vk;
      p[k] = w;
    }
  }
}

template <typename P, typename G, typename S, bool kMaster, bool kSR, bool kKahan>
void update(const Arrays<P, G, S>& a, const Hyper& h, u32 key, u32 offset, int64_t n,
            int threads) {
  if constexpr (std::is_same_v<P, float> && std::is_same_v<G, float> &&
                std::is_same_v<S, float>) {
    update_fp32(a.param, a.grad, a.exp_avg, a.exp_avg_sq, h, n, threads);
    return;
  }
  constexpr int64_t U = kUnit<S>;
  const int64_t units = n / U;
  const int64_t chunk = 64 * kBlock / U;  // units per thread task
  const int64_t chunks = (units + chunk - 1) / chunk;
  if (threads > 1 && chunks > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t end = (c + 1) * chunk < units ? (c + 1) * chunk : units;
      update_range<P, G, S, kMaster, kSR, kKahan>(a, h, key, offset, c * chunk, end);
    }
  } else {
    update_range<P, G, S, kMaster, kSR, kKahan>(a, h, key, offset, 0, units);
  }
  if (n % U) update_one<P, G, S, kMaster, kSR, kKahan>(a, h, key, offset, n - 1);
}

template <typename P, typename G, typename S, bool kMaster, bool kKahan>
void update_sr(const Arrays<P, G, S>& a, const Hyper& h, u32 key, u32 offset, int64_t n,
               int sr, int threads) {
  if (sr) {
    update<P, G, S, kMaster, true, kKahan>(a, h, key, offset, n, threads);
  } else {
    update<P, G, S, kMaster, false, kKahan>(a, h, key, offset, n, threads);
  }
}

template <typename P, typename G, typename S>
int dispatch_weights(const Arrays<P, G, S>& a, const Hyper& h, u32 key, u32 offset, int64_t n,
                     int sr, int threads) {
  if (a.master == nullptr && a.comp == nullptr) {
    update_sr<P, G, S, false, false>(a, h, key, offset, n, sr, threads);
    return 0;
  }
  if constexpr (std::is_same_v<P, u16>) {  // master weights and Kahan: bf16 parameters only
    if (a.master != nullptr && a.comp != nullptr) return 1;
    if (a.master != nullptr) {
      update_sr<P, G, S, true, false>(a, h, key, offset, n, sr, threads);
    } else {
      update_sr<P, G, S, false, true>(a, h, key, offset, n, sr, threads);
    }
    return 0;
  }
  return 1;
}

template <typename P, typename G>
int dispatch_state(int state_bf16, void* p, const void* g, void* m, void* v, float* master,
                   void* comp, const Hyper& h, u32 key, u32 offset, int64_t n, int sr,
                   int threads) {
  u16* c = static_cast<u16*>(comp);
  if (state_bf16) {
    Arrays<P, G, u16> a{static_cast<P*>(p), static_cast<const G*>(g), static_cast<u16*>(m),
                        static_cast<u16*>(v), master, c};
    return dispatch_weights(a, h, key, offset, n, sr, threads);
  }
  Arrays<P, G, float> a{static_cast<P*>(p), static_cast<const G*>(g), static_cast<float*>(m),
                        static_cast<float*>(v), master, c};
  return dispatch_weights(a, h, key, offset, n, sr, threads);
}

}  // namespace

extern "C" {

// Version of this entry point's signature; the loader checks it.
int hlat_adamw_abi(void) { return 2; }

// One AdamW update of n contiguous elements in place. *_bf16 flags say whether an array
// holds bf16 (else fp32); master is null or n fp32 values, comp null or n bf16 values (only
// one of them, and only for bf16 parameters); hyper is adamw_update's 7 floats. Returns 0,
// or 1 for an unsupported combination.
int hlat_adamw_step(void* param, int param_bf16, const void* grad, int grad_bf16,
                    void* exp_avg, void* exp_avg_sq, int state_bf16, float* master, void* comp,
                    const float* hyper, uint32_t key, uint32_t offset, int64_t n, int sr,
                    int threads) {
  Hyper h;
  std::memcpy(&h, hyper, sizeof(h));
  if (param_bf16) {
    return grad_bf16 ? dispatch_state<u16, u16>(state_bf16, param, grad, exp_avg, exp_avg_sq,
                                                master, comp, h, key, offset, n, sr, threads)
                     : dispatch_state<u16, float>(state_bf16, param, grad, exp_avg, exp_avg_sq,
                                                  master, comp, h, key, offset, n, sr, threads);
  }
  return grad_bf16 ? dispatch_state<float, u16>(state_bf16, param, grad, exp_avg, exp_avg_sq,
                                                master, comp, h, key, offset, n, sr, threads)
                   : dispatch_state<float, float>(state_bf16, param, grad, exp_avg, exp_avg_sq,
                                                  master, comp, h, key, offset, n, sr, threads);
}

}  // extern "C"
