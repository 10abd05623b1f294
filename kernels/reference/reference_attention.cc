#include "kernels/reference/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/dtype_convert.h"

namespace attention::reference {
namespace {

// Number of elements a strided tensor spans: one past its largest index.
int64_t Extent(int64_t batch_stride, int64_t head_stride, int64_t row_stride, int64_t batch,
               int64_t heads, int64_t rows, int64_t dim) {
  return (batch - 1) * batch_stride + (heads - 1) * head_stride + (rows - 1) * row_stride + dim;
}

}  // namespace

absl::Status Forward(const AttentionParams& p, std::vector<double>* o, std::vector<double>* lse) {
  if (!p.q || !p.k || !p.v) return absl::InvalidArgumentError("q, k and v must be set");
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.head_dim <= 0 ||
      p.heads_q % p.heads_kv != 0) {
    return absl::InvalidArgumentError("bad shapes");
  }
  const int64_t d = p.head_dim;
  const int64_t dv = p.value_head_dim();
  const int64_t group = p.heads_q / p.heads_kv;
  // The dequantised inputs (float8: each element times its tensor's descale), in float64.
  const double q_descale = p.q_descale, k_descale = p.k_descale, v_descale = p.v_descale;
  const bool varlen = p.is_varlen();
  const int64_t q_rows = varlen ? p.total_q : p.seqlen_q;
  o->assign(Extent(p.o_batch_stride, p.o_head_stride, p.o_row_stride, varlen ? 1 : p.batch,
                   p.heads_q, q_rows, dv),
            0.0);
  if (lse != nullptr) {
    lse->assign((varlen ? 1 : p.batch) * p.heads_q * q_rows,
                -std::numeric_limits<double>::infinity());
  }

  std::vector<double> scores;
  std::vector<double> acc(dv);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q0 = varlen ? p.cu_seqlens_q[b] : 0;
    const int64_t k0 = varlen ? p.cu_seqlens_k[b] : 0;
    const int64_t nq = varlen ? p.cu_seqlens_q[b + 1] - q0 : p.seqlen_q;
    const int64_t nk = varlen ? p.cu_seqlens_k[b + 1] - k0 : p.seqlen_k;
    scores.resize(nk);
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t q_base =
            b * p.q_batch_stride + (q0 + i) * p.q_row_stride + h * p.q_head_stride;
        // Key j is visible iff lo <= j <= hi (the window around query i's diagonal key, within
        // its chunk).
        const auto [lo, hi] = VisibleKeys(p, i, nq, nk);
        // The sink, when set, is one more logit in the denominator with no value.
        const double sink =
            p.sinks != nullptr ? p.sinks[h] : -std::numeric_limits<double>::infinity();
        double max_score = sink;
        for (int64_t j = 0; j < nk; ++j) {
          if (j < lo || j > hi) continue;
          const int64_t k_base =
              b * p.k_batch_stride + (k0 + j) * p.k_row_stride + hk * p.k_head_stride;
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) {
            dot += (static_cast<double>(LoadAsFloat(p.q, q_base + x, p.dtype)) * q_descale) *
                   (static_cast<double>(LoadAsFloat(p.k, k_base + x, p.dtype)) * k_descale);
          }
          scores[j] = dot * static_cast<double>(p.softmax_scale);
          if (p.softcap > 0) scores[j] = p.softcap * std::tanh(scores[j] / p.softcap);
          max_score = std::max(max_score, scores[j]);
        }
        const int64_t o_base =
            b * p.o_batch_stride + (q0 + i) * p.o_row_stride + h * p.o_head_stride;
        if (max_score == -std::numeric_limits<double>::infinity()) continue;  // sees no key: o = 0

        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = std::exp(sink - max_score);
        for (int64_t j = std::max<int64_t>(lo, 0); j <= std::min(hi, nk - 1); ++j) {
          const double w = std::exp(scores[j] - max_score);
          sum += w;
          const int64_t v_base =
              b * p.v_batch_stride + (k0 + j) * p.v_row_stride + hk * p.v_head_stride;
          for (int64_t x = 0; x < dv; ++x) {
            acc[x] += w * (static_cast<double>(LoadAsFloat(p.v, v_base + x, p.dtype)) * v_descale);
          }
        }
        for (int64_t x = 0; x < dv; ++x) (*o)[o_base + x] = acc[x] / sum;
        if (lse != nullptr) {
          (*lse)[b * p.lse_batch_stride + h * p.lse_head_stride + q0 + i] =
              max_score + std::log(sum);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace attention::reference
