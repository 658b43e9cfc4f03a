// chatq's kernels for a decode step on CPU (cpu_kernels.py builds and checks them).
//
// attend: decode attention over the context rows. torch's SDPA kernel tiles for long queries; with a decode step's
// one token per sequence it spends most of its time outside the arithmetic, and the two batched matmuls it could be
// written as run at a fraction of the memory's speed. Here each (sequence, KV head) is one task on torch's thread
// pool: its query heads read each key and value once, in float32, and only up to the sequence's length. It also
// writes the step's new keys and values into the rows, which would otherwise take two more operations per layer.
//
// rms_norm and rotary: the model's RMSNorm and rotary embedding, each one call where transformers' code is six to
// eight small operations, whose dispatch costs more than their arithmetic at a decode step's few rows. Both round
// where transformers' code rounds, so their results are the same.
//
// lora: a layer's LoRA deltas for one group of projections (chatq.worker.lora), one call where torch would take a
// product by A and one by each projection's B for every run of rows of one adapter: dozens of small products a layer.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

void check(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    TORCH_CHECK(t.is_contiguous(), "contiguous tensors only");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), "one dtype for all");
  }
  const auto dtype = tensors[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype ", dtype, " is not built");
}

// bf16 is handled as its bits (uint16_t): c10's conversions from float, and loops over its struct, do not
// vectorize; these do.
using Bf16 = uint16_t;

inline float widen(float x) { return x; }
inline float widen(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x rounded to T's precision, to nearest even as torch rounds (NaN aside).
template <typename T>
inline float narrow(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    float rounded;
    std::memcpy(&rounded, &bits, sizeof bits);
    return rounded;
  }
}

// Stores x, already of T's precision (narrow), as a T.
inline void put(float* at, float x) { *at = x; }
inline void put(Bf16* at, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  *at = static_cast<Bf16>(bits >> 16);
}

// A tensor's data as T, bf16 as its bits.
template <typename T>
T* data(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, Bf16>)
    return reinterpret_cast<Bf16*>(t.data_ptr<at::BFloat16>());
  else
    return t.data_ptr<T>();
}

constexpr int LANES = 16;  // one AVX-512 register of float32 (two AVX2 ones)

// exp(x) for x <= 0 (Cephes' expf) as plain arithmetic, so that the loop calling it vectorizes; std::exp does not.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = __builtin_nearbyintf(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof bits);
  return p;
}

// Softmax of scores[0, n) in place; returns its denominator, left for the output to divide by.
inline float exponentiate(float* scores, int64_t n) {
  float top = scores[0];
  for (int64_t t = 1; t < n; ++t) top = scores[t] > top ? scores[t] : top;
  float sum = 0;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = exp_nonpositive(scores[t] - top);
    sum += scores[t];
  }
  return sum;
}

struct Shape {
  int64_t heads, kv_heads, group, tokens;
};

// A query's score of one key [D], each lane summing every LANES-th product.
template <int D>
inline float dot(const float* q, const float* k) {
  float lanes[LANES] = {0};
  for (int d = 0; d < D; d += LANES)
    for (int l = 0; l < LANES; ++l) lanes[l] += q[d + l] * k[d + l];
  float sum = 0;
  for (int l = 0; l < LANES; ++l) sum += lanes[l];
  return sum;
}

// Each key's and value's cache lines, requested ahead of their use. A row per (sequence, KV head) is a few pages,
// too short a stream for the hardware's prefetcher to reach the memory's speed before it ends.
template <typename T, int D>
inline void prefetch(const T* k, const T* v) {
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(k) + b);
    __builtin_prefetch(reinterpret_cast<const char*>(v) + b);
  }
}

constexpr int64_t AHEAD = 16;  // keys

// One (sequence, KV head): q and out point at its query heads [group, D], k and v at its rows [tokens, D]. Each key
// and each head's sum are local arrays, which the compiler keeps in registers; in the scores' buffer it would load
// and store them at every key, not knowing that they do not overlap the scores.
template <typename T, int D>
void attend_one(const T* q, const T* k, const T* v, int64_t n, float scale, const Shape& s, float* buf, T* out) {
  float* qf = buf;
  float* scores = qf + s.group * D;
  for (int64_t t = 0; t < n && t < AHEAD; ++t) prefetch<T, D>(k + t * D, v + t * D);
  for (int64_t x = 0; x < s.group * D; ++x) qf[x] = widen(q[x]) * scale;
  for (int64_t t = 0; t < n; ++t) {
    if (t + AHEAD < n) prefetch<T, D>(k + (t + AHEAD) * D, v + (t + AHEAD) * D);
    float key[D];
    for (int d = 0; d < D; ++d) key[d] = widen(k[t * D + d]);
    for (int64_t g = 0; g < s.group; ++g) scores[g * n + t] = dot<D>(qf + g * D, key);
  }
  for (int64_t g = 0; g < s.group; ++g) {
    float* p = scores + g * n;
    const float sum = exponentiate(p, n);
    float acc[D] = {0};
    for (int64_t t = 0; t < n; ++t)
      for (int d = 0; d < D; ++d) acc[d] += p[t] * widen(v[t * D + d]);
    for (int d = 0; d < D; ++d) put(out + g * D + d, narrow<T>(acc[d] / sum));
  }
}

// A sequence's new key and value [KVH, D] into its row, at its last position.
template <typename T, int D>
void append(const T* k, const T* v, int64_t row, int64_t at, const Shape& s, T* k_rows, T* v_rows) {
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    const int64_t place = ((row * s.kv_heads + h) * s.tokens + at) * D;
    std::memcpy(k_rows + place, k + h * D, D * sizeof(T));
    std::memcpy(v_rows + place, v + h * D, D * sizeof(T));
  }
}

template <typename T, int D>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_rows,
                at::Tensor& v_rows, const at::Tensor& rows, const at::Tensor& lens, double scale, at::Tensor& out) {
  const Shape s{q.size(1), k.size(1), q.size(1) / k.size(1), v_rows.size(2)};
  const T* qp = data<T>(q);
  T* kp = data<T>(k_rows);
  T* vp = data<T>(v_rows);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t j = 0; j < q.size(0); ++j)
    append<T, D>(data<T>(k) + j * s.kv_heads * D, data<T>(v) + j * s.kv_heads * D, rp[j], lp[j] - 1, s, kp, vp);
  T* op = data<T>(out);
  at::parallel_for(0, q.size(0) * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(s.group * (D + s.tokens));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t j = i / s.kv_heads, h = i % s.kv_heads;
      const int64_t head = j * s.heads + h * s.group, row = rp[j] * s.kv_heads + h;
      attend_one<T, D>(qp + head * D, kp + row * s.tokens * D, vp + row * s.tokens * D, lp[j],
                       static_cast<float>(scale), s, buf.data(), op + head * D);
    }
  });
}

template <typename T>
void by_head_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_rows,
                 at::Tensor& v_rows, const at::Tensor& rows, const at::Tensor& lens, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return attend_all<T, 64>(q, k, v, k_rows, v_rows, rows, lens, scale, out);
    case 128: return attend_all<T, 128>(q, k, v, k_rows, v_rows, rows, lens, scale, out);
    default: TORCH_CHECK(false, "head_dim ", q.size(2), " is not built");
  }
}

}  // namespace

// q [B, H, D] and out in batch order; the step's new keys and values k, v [B, KVH, D]; the rows k_rows, v_rows
// [rows, KVH, tokens, D]. Sequence j, in row rows[j] and of lens[j] tokens with its new one, has its new key and
// value written at lens[j] - 1 and attends over its lens[j] tokens.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_rows,
                  at::Tensor& v_rows, const at::Tensor& rows, const at::Tensor& lens, double scale) {
  check({q, k, v, k_rows, v_rows});
  TORCH_CHECK(rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 rows and lengths");
  TORCH_CHECK(rows.numel() == q.size(0) && lens.numel() == q.size(0), "one row and length per sequence");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2), "k, v [B, KVH, D]");
  TORCH_CHECK(v_rows.dim() == 4 && v_rows.size(1) == k.size(1) && v_rows.size(3) == q.size(2) &&
                  k_rows.sizes() == v_rows.sizes(),
              "k_rows, v_rows [rows, KVH, tokens, D]");
  for (int64_t j = 0; j < q.size(0); ++j) {
    const int64_t row = rows.data_ptr<int64_t>()[j], n = lens.data_ptr<int64_t>()[j];
    TORCH_CHECK(row >= 0 && row < v_rows.size(0) && n >= 1 && n <= v_rows.size(2), "row or length out of range");
  }
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16)
    by_head_dim<Bf16>(q, k, v, k_rows, v_rows, rows, lens, scale, out);
  else
    by_head_dim<float>(q, k, v, k_rows, v_rows, rows, lens, scale, out);
  return out;
}

namespace {

constexpr int64_t SERIAL_ROWS = 64;  // a decode step's rows: less work than waking the thread pool

template <typename T>
void rms_norm_rows(const T* x, const T* w, float eps, int64_t rows, int64_t n, T* out) {
  at::parallel_for(0, rows, SERIAL_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      float sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += widen(xr[i]) * widen(xr[i]);
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      // As transformers: x * rsqrt(mean(x^2) + eps) in float32, rounded to the model's dtype, times the weight.
      for (int64_t i = 0; i < n; ++i)
        put(out + r * n + i, narrow<T>(widen(w[i]) * narrow<T>(widen(xr[i]) * scale)));
    }
  });
}

// x [rows, heads, D] rotated in place by its row's cos and sin [rows, D], as q * cos + rotate_half(q) * sin.
template <typename T>
void rotate(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, SERIAL_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + (r * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = widen(xh[i]), x2 = widen(xh[i + half]);
          // Each product rounded to T before the sum, as transformers' separate operations round them.
          const float a = narrow<T>(x1 * widen(c[i])), b = narrow<T>(-x2 * widen(s[i]));
          const float e = narrow<T>(x2 * widen(c[i + half]));
          const float f = narrow<T>(x1 * widen(s[i + half]));
          put(xh + i, narrow<T>(a + b));
          put(xh + i + half, narrow<T>(e + f));
        }
      }
    }
  });
}

}  // namespace

// x [rows, n]; weight [n].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check({x, weight});
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1), "x [rows, n] and weight [n]");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows(data<Bf16>(x), data<Bf16>(weight), eps, x.size(0), x.size(1), data<Bf16>(out));
  else
    rms_norm_rows(data<float>(x), data<float>(weight), eps, x.size(0), x.size(1), data<float>(out));
  return out;
}

// q [rows, H, D] and k [rows, KVH, D] rotated in place; cos, sin [rows, D].
void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check({q, k, cos, sin});
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && cos.sizes() == sin.sizes(), "q, k [rows, heads, D]");
  TORCH_CHECK(cos.size(0) == q.size(0) && k.size(0) == q.size(0) && cos.size(1) == q.size(2) &&
                  k.size(2) == q.size(2) && q.size(2) % 2 == 0,
              "cos and sin [rows, D]");
  for (auto* x : {&q, &k}) {
    if (x->scalar_type() == at::kBFloat16)
      rotate(data<Bf16>(*x), data<Bf16>(cos), data<Bf16>(sin), x->size(0), x->size(1), x->size(2));
    else
      rotate(data<float>(*x), data<float>(cos), data<float>(sin), x->size(0), x->size(1), x->size(2));
  }
}

namespace {

constexpr int64_t TILE = 4;  // rows of one run multiplied together: each row of A and B is read once for them

// c [TILE, cols] = p [TILE, depth] q [depth, cols], in float32: each column block's sums for the tile's rows stay in
// registers while q's rows stream past once (one inner loop over the lanes, which the compiler vectorizes).
template <typename T>
void product(const float* p, int64_t depth, const T* q, int64_t cols, float* c) {
  static_assert(TILE == 4, "four rows' sums");
  const float *p0 = p, *p1 = p + depth, *p2 = p + 2 * depth, *p3 = p + 3 * depth;
  int64_t j0 = 0;
  for (; j0 + LANES <= cols; j0 += LANES) {
    float s0[LANES] = {}, s1[LANES] = {}, s2[LANES] = {}, s3[LANES] = {};
    for (int64_t k = 0; k < depth; ++k) {
      const T* qk = q + k * cols + j0;
      const float v0 = p0[k], v1 = p1[k], v2 = p2[k], v3 = p3[k];
      for (int l = 0; l < LANES; ++l) {
        const float qv = widen(qk[l]);
        s0[l] += v0 * qv;
        s1[l] += v1 * qv;
        s2[l] += v2 * qv;
        s3[l] += v3 * qv;
      }
    }
    for (int l = 0; l < LANES; ++l) {
      c[j0 + l] = s0[l];
      c[cols + j0 + l] = s1[l];
      c[2 * cols + j0 + l] = s2[l];
      c[3 * cols + j0 + l] = s3[l];
    }
  }
  for (; j0 < cols; ++j0)  // columns past the last whole register
    for (int64_t r = 0; r < TILE; ++r) {
      float sum = 0;
      for (int64_t k = 0; k < depth; ++k) sum += p[r * depth + k] * widen(q[k * cols + j0]);
      c[r * cols + j0] = sum;
    }
}

// One tile's deltas: low = x[rows] A, then each projection's delta = its part of low times its B.
template <typename T>
void lora_tile(const T* x, int64_t in, const T* a, int64_t w, int64_t rank, const std::vector<const T*>& b,
               const std::vector<int64_t>& outs, const std::vector<T*>& deltas, int64_t begin, int64_t end) {
  const int64_t n = end - begin;
  std::vector<float> rows(TILE * in, 0.f), low(TILE * w), part(TILE * rank);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < in; ++i) rows[r * in + i] = widen(x[(begin + r) * in + i]);
  product(rows.data(), in, a, w, low.data());
  for (size_t m = 0; m < b.size(); ++m) {
    const int64_t out = outs[m];
    for (int64_t r = 0; r < TILE; ++r)
      for (int64_t q = 0; q < rank; ++q) part[r * rank + q] = low[r * w + m * rank + q];
    std::vector<float> acc(TILE * out);
    product(part.data(), rank, b[m], out, acc.data());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < out; ++j) put(deltas[m] + (begin + r) * out + j, narrow<T>(acc[r * out + j]));
  }
}

template <typename T>
void lora_runs(const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& b,
               const std::vector<at::Tensor>& deltas, const at::Tensor& runs) {
  const int64_t in = x.size(1), w = a.size(2), rank = b[0].size(1);
  std::vector<int64_t> outs;
  std::vector<T*> into;
  for (size_t m = 0; m < b.size(); ++m) {
    outs.push_back(b[m].size(2));
    into.push_back(data<T>(deltas[m]));
  }
  // Work items: tiles of the runs' rows, each with its slot.
  const auto* r = runs.data_ptr<int64_t>();
  // Rows in no run (the base model's) get zeros.
  std::vector<bool> covered(x.size(0), false);
  for (int64_t k = 0; k < runs.size(0); ++k)
    std::fill(covered.begin() + r[3 * k + 1], covered.begin() + r[3 * k + 2], true);
  for (size_t m = 0; m < b.size(); ++m)
    for (int64_t row = 0; row < x.size(0); ++row)
      if (!covered[row]) std::memset(into[m] + row * outs[m], 0, outs[m] * sizeof(T));
  std::vector<std::array<int64_t, 3>> tiles;
  for (int64_t k = 0; k < runs.size(0); ++k)
    for (int64_t begin = r[3 * k + 1]; begin < r[3 * k + 2]; begin += TILE)
      tiles.push_back({r[3 * k], begin, std::min(begin + TILE, r[3 * k + 2])});
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const auto [slot, begin, end] = tiles[t];
      std::vector<const T*> bs;
      for (size_t m = 0; m < b.size(); ++m) bs.push_back(data<T>(b[m]) + slot * b[m].stride(0));
      lora_tile(data<T>(x), in, data<T>(a) + slot * a.stride(0), w, rank, bs, outs, into, begin, end);
    }
  });
}

}  // namespace

// x [T, in]; a [slots, in, modules * rank]; b[m] [slots, rank, out_m], each slot's matrix contiguous (the slots may be
// apart: views of one store); deltas[m] [T, out_m], written at the runs' rows; runs [K, 3] int64: (slot, first row,
// end row); deltas' other rows are zeroed.
void lora(const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& b,
          const std::vector<at::Tensor>& deltas, const at::Tensor& runs) {
  std::vector<at::Tensor> all = {x, a[0]};
  for (const auto& t : b) all.push_back(t[0]);
  all.insert(all.end(), deltas.begin(), deltas.end());
  check(all);
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && runs.dim() == 2 && runs.size(1) == 3,
              "runs [K, 3] int64");
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && a.size(1) == x.size(1) && !b.empty() && b.size() == deltas.size() &&
                  a.size(2) == b[0].size(1) * static_cast<int64_t>(b.size()),
              "x [T, in], a [slots, in, modules * rank], b[m] [slots, rank, out]");
  const auto* r = runs.data_ptr<int64_t>();
  for (int64_t k = 0; k < runs.size(0); ++k)
    TORCH_CHECK(0 <= r[3 * k] && r[3 * k] < a.size(0) && 0 <= r[3 * k + 1] && r[3 * k + 1] <= r[3 * k + 2] &&
                    r[3 * k + 2] <= x.size(0),
                "a run outside the slots or rows");
  for (size_t m = 0; m < b.size(); ++m)
    TORCH_CHECK(b[m].size(0) == a.size(0) && b[m].size(1) == b[0].size(1) && deltas[m].size(0) == x.size(0) &&
                    deltas[m].size(1) == b[m].size(2),
                "b[m] [slots, rank, out] and deltas[m] [T, out]");
  if (x.scalar_type() == at::kBFloat16)
    lora_runs<Bf16>(x, a, b, deltas, runs);
  else
    lora_runs<float>(x, a, b, deltas, runs);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora", &lora);
  m.def("attend", &attend);
  m.def("rms_norm", &rms_norm);
  m.def("rotary", &rotary);
}
