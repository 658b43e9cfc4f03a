// Decode attention over the context rows on CPU: one query token per sequence against its keys, in place.
//
// torch's SDPA kernel tiles for long queries; with a decode step's one token per sequence it spends most of its
// time outside the arithmetic, and the two batched matmuls it could be written as run at a fraction of the memory's
// speed. Here each (sequence, KV head) is one task on torch's thread pool: its query heads read each key and value
// once, in float32, and only up to the sequence's length.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

namespace {

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

template <typename T, int D>
float dot(const float* q, const float* k) {
  float lanes[LANES] = {0};
  for (int d = 0; d < D; d += LANES)
    for (int l = 0; l < LANES; ++l) lanes[l] += q[d + l] * k[d + l];
  float sum = 0;
  for (int l = 0; l < LANES; ++l) sum += lanes[l];
  return sum;
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

// One (sequence, KV head): q and out point at its query heads [group, D], k and v at its row [tokens, D].
template <typename T, int D>
void attend_one(const T* q, const T* k, const T* v, int64_t n, float scale, const Shape& s, std::vector<float>& buf,
                T* out) {
  float* qf = buf.data();
  float* acc = qf + s.group * D;
  float* row = acc + s.group * D;
  float* scores = row + D;
  for (int64_t x = 0; x < s.group * D; ++x) qf[x] = static_cast<float>(q[x]) * scale;
  for (int64_t t = 0; t < n; ++t) {
    for (int d = 0; d < D; ++d) row[d] = static_cast<float>(k[t * D + d]);
    for (int64_t g = 0; g < s.group; ++g) scores[g * n + t] = dot<T, D>(qf + g * D, row);
  }
  std::vector<float> sums(s.group);
  for (int64_t g = 0; g < s.group; ++g) sums[g] = exponentiate(scores + g * n, n);
  std::fill(acc, acc + s.group * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    for (int d = 0; d < D; ++d) row[d] = static_cast<float>(v[t * D + d]);
    for (int64_t g = 0; g < s.group; ++g) {
      const float p = scores[g * n + t];
      for (int d = 0; d < D; ++d) acc[g * D + d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < s.group; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] / sums[g]);
}

template <typename T, int D>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                const at::Tensor& lens, double scale, at::Tensor& out) {
  const Shape s{q.size(1), k.size(1), q.size(1) / k.size(1), k.size(2)};
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, q.size(0) * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf((2 * s.group + 1) * D + s.group * s.tokens);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t j = i / s.kv_heads, h = i % s.kv_heads;
      const int64_t head = j * s.heads + h * s.group, row = rp[j] * s.kv_heads + h;
      attend_one<T, D>(qp + head * D, kp + row * s.tokens * D, vp + row * s.tokens * D, lp[j],
                       static_cast<float>(scale), s, buf, op + head * D);
    }
  });
}

template <typename T>
void by_head_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                 const at::Tensor& lens, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return attend_all<T, 64>(q, k, v, rows, lens, scale, out);
    case 128: return attend_all<T, 128>(q, k, v, rows, lens, scale, out);
    default: TORCH_CHECK(false, "head_dim ", q.size(2), " is not built");
  }
}

}  // namespace

// q [B, H, D] and out in batch order; k, v [rows, KVH, tokens, D]; sequence j in row rows[j], of lens[j] tokens.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                  const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 rows and lengths");
  TORCH_CHECK(rows.numel() == q.size(0) && lens.numel() == q.size(0), "one row and length per sequence");
  for (int64_t j = 0; j < q.size(0); ++j) {
    const int64_t row = rows.data_ptr<int64_t>()[j], n = lens.data_ptr<int64_t>()[j];
    TORCH_CHECK(row >= 0 && row < k.size(0) && n >= 1 && n <= k.size(2), "row or length out of range");
  }
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16)
    by_head_dim<at::BFloat16>(q, k, v, rows, lens, scale, out);
  else if (q.scalar_type() == at::kFloat)
    by_head_dim<float>(q, k, v, rows, lens, scale, out);
  else
    TORCH_CHECK(false, "dtype ", q.scalar_type(), " is not built");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attend", &attend); }
