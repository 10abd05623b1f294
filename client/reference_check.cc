#include "client/reference_check.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/tensors.h"
#include "kernels/attention_params.h"
#include "kernels/reference/reference_attention.h"

namespace attention::client {
namespace {

absl::StatusOr<DType> KernelDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT8_E4M3:
      return DType::kFloat8E4M3;
    default:
      return absl::InvalidArgumentError("request dtype is unspecified");
  }
}

absl::Status ExpectShape(const char* name, const v1::Tensor& tensor, v1::DType dtype,
                         absl::Span<const int64_t> shape) {
  if (tensor.dtype() != dtype ||
      !std::equal(shape.begin(), shape.end(), tensor.shape().begin(), tensor.shape().end())) {
    return absl::InvalidArgumentError(
        absl::StrCat("response ", name, " is ", DTypeName(tensor.dtype()), " [",
                     absl::StrJoin(tensor.shape(), ", "), "], expected ", DTypeName(dtype), " [",
                     absl::StrJoin(shape, ", "), "]"));
  }
  return absl::OkStatus();
}

// ||a - b|| / ||b||, with 0 / 0 = 0.
double RelativeError(absl::Span<const float> a, absl::Span<const double> b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// reference::Forward over (batch item, query head) pairs on several threads. The float64
// reference is plain loops (27 s for client/README.md's first example on one core) and the pairs
// are independent: each is a problem of its own (one item, one head, the whole problem's strides)
// whose output is scattered to the positions the whole problem's would use. o and lse as in
// reference::Forward; returns the threads used.
absl::StatusOr<int> ParallelForward(const AttentionParams& p, std::vector<double>* o,
                                    std::vector<double>* lse) {
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.head_dim <= 0 ||
      p.heads_q % p.heads_kv != 0) {
    return absl::InvalidArgumentError("request shapes do not fit together");
  }
  const bool varlen = p.is_varlen();
  const int64_t rows = varlen ? p.total_q : p.seqlen_q;
  const int64_t batch_extent = varlen ? 1 : p.batch;
  o->assign((batch_extent - 1) * p.o_batch_stride + (p.heads_q - 1) * p.o_head_stride +
                (rows - 1) * p.o_row_stride + p.value_head_dim(),
            0.0);
  if (lse != nullptr) {
    lse->assign(batch_extent * p.heads_q * rows, -std::numeric_limits<double>::infinity());
  }
  const int64_t width = static_cast<int64_t>(DTypeSize(p.dtype));
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t pairs = p.batch * p.heads_q;
  const int threads =
      static_cast<int>(std::clamp<int64_t>(std::thread::hardware_concurrency(), int64_t{1}, pairs));
  std::atomic<int64_t> next{0};
  std::mutex mu;
  absl::Status status;
  auto work = [&] {
    std::vector<double> pair_o, pair_lse;
    for (int64_t pair; (pair = next.fetch_add(1)) < pairs;) {
      const int64_t b = pair / p.heads_q, h = pair % p.heads_q, hk = h / group;
      AttentionParams one = p;
      one.batch = one.heads_q = one.heads_kv = 1;
      // Varlen batch strides are 0: an item's rows start at its cu_seqlens entry.
      one.q = static_cast<const char*>(p.q) + (b * p.q_batch_stride + h * p.q_head_stride) * width;
      one.k = static_cast<const char*>(p.k) + (b * p.k_batch_stride + hk * p.k_head_stride) * width;
      one.v = static_cast<const char*>(p.v) + (b * p.v_batch_stride + hk * p.v_head_stride) * width;
      if (p.sinks != nullptr) one.sinks = p.sinks + h;  // the pair's one head's sink
      if (varlen) {
        one.cu_seqlens_q = p.cu_seqlens_q + b;
        one.cu_seqlens_k = p.cu_seqlens_k + b;
      }
      if (absl::Status s = reference::Forward(one, &pair_o, lse ? &pair_lse : nullptr); !s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        status.Update(s);
        return;
      }
      const int64_t q0 = varlen ? p.cu_seqlens_q[b] : 0;
      const int64_t nq = varlen ? p.cu_seqlens_q[b + 1] - q0 : p.seqlen_q;
      for (int64_t i = q0; i < q0 + nq; ++i) {
        std::copy_n(pair_o.begin() + i * p.o_row_stride, p.value_head_dim(),
                    o->begin() + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride);
        if (lse) (*lse)[b * p.lse_batch_stride + h * p.lse_head_stride + i] = pair_lse[i];
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (!status.ok()) return status;
  return threads;
}

}  // namespace

double ErrorBound(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return 1e-5;
    case v1::DTYPE_FLOAT8_E4M3:
      return 4e-2;
    default:
      return 1e-2;
  }
}

bool WithinBound(const CheckResult& result, v1::DType dtype) {
  const double bound = ErrorBound(dtype);
  return result.relative_error <= bound &&
         (!result.lse_checked || result.lse_relative_error <= bound);
}

absl::StatusOr<CheckResult> CheckResponse(const v1::AttendRequest& request,
                                          const v1::AttendResponse& response) {
  const v1::Tensor& q = request.q();
  const v1::Tensor& k = request.k();
  absl::StatusOr<DType> dtype = KernelDType(q.dtype());
  if (!dtype.ok()) return dtype.status();
  const bool varlen = request.cu_seqlens_q_size() > 0;
  if (q.shape_size() != (varlen ? 3 : 4) || k.shape_size() != q.shape_size()) {
    return absl::InvalidArgumentError("request q/k ranks do not fit its layout");
  }

  // q: [B, Hq, Nq, D] (BHSD), [B, Nq, Hq, D] (BSHD) or [total_q, Hq, D] (varlen); k, v alike.
  AttentionParams p;
  p.dtype = *dtype;
  p.q = q.data().data();
  p.k = k.data().data();
  p.v = request.v().data().data();
  const bool bshd = request.layout() == v1::LAYOUT_BSHD;
  std::vector<int32_t> cu_q(request.cu_seqlens_q().begin(), request.cu_seqlens_q().end());
  std::vector<int32_t> cu_k(request.cu_seqlens_k().begin(), request.cu_seqlens_k().end());
  if (varlen) {
    if (cu_q.size() != cu_k.size() || cu_q.size() < 2) {
      return absl::InvalidArgumentError("request cu_seqlens do not fit together");
    }
    p.batch = static_cast<int64_t>(cu_q.size()) - 1;
    p.heads_q = q.shape(1);
    p.heads_kv = k.shape(1);
    p.head_dim = q.shape(2);
    p.total_q = q.shape(0);
    p.total_k = k.shape(0);
    for (int64_t b = 0; b < p.batch; ++b) {
      p.seqlen_q = std::max<int64_t>(p.seqlen_q, cu_q[b + 1] - cu_q[b]);
      p.seqlen_k = std::max<int64_t>(p.seqlen_k, cu_k[b + 1] - cu_k[b]);
    }
    p.cu_seqlens_q = cu_q.data();
    p.cu_seqlens_k = cu_k.data();
  } else {
    p.batch = q.shape(0);
    p.heads_q = q.shape(bshd ? 2 : 1);
    p.seqlen_q = q.shape(bshd ? 1 : 2);
    p.heads_kv = k.shape(bshd ? 2 : 1);
    p.seqlen_k = k.shape(bshd ? 1 : 2);
    p.head_dim = q.shape(3);
  }
  // v's last dim: a V head dim of its own (MLA), o's too.
  const v1::Tensor& v = request.v();
  if (v.shape_size() == q.shape_size() && v.shape(v.shape_size() - 1) != p.head_dim) {
    p.v_head_dim = v.shape(v.shape_size() - 1);
  }
  p.SetContiguousStrides(bshd ? Layout::kBSHD : Layout::kBHSD);
  p.softmax_scale = request.has_softmax_scale()
                        ? request.softmax_scale()
                        : static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.head_dim)));
  if (request.has_window_left()) p.window_left = request.window_left();
  if (request.has_window_right()) p.window_right = request.window_right();
  if (request.causal()) p.window_right = 0;
  if (request.mask_alignment() == v1::MASK_ALIGN_TOP_LEFT)
    p.mask_alignment = MaskAlignment::kTopLeft;
  // float8: the reference runs on the dequantised values (each element times its descale).
  if (request.has_q_descale()) p.q_descale = request.q_descale();
  if (request.has_k_descale()) p.k_descale = request.k_descale();
  if (request.has_v_descale()) p.v_descale = request.v_descale();
  // The open-model options.
  if (request.sinks_size() > 0) p.sinks = request.sinks().data();
  if (request.has_softcap()) p.softcap = request.softcap();
  if (request.has_chunk_size()) p.chunk_size = request.chunk_size();

  std::vector<double> ref_o, ref_lse;
  const int64_t lse_size = varlen ? p.heads_q * p.total_q : p.batch * p.heads_q * p.seqlen_q;
  absl::StatusOr<int> threads =
      ParallelForward(p, &ref_o, request.return_lse() ? &ref_lse : nullptr);
  if (!threads.ok()) return threads.status();

  // o is shaped as q but for its last dim, V's head dim.
  std::vector<int64_t> o_shape(q.shape().begin(), q.shape().end());
  o_shape.back() = p.value_head_dim();
  // o comes back in bfloat16 for float8 inputs, else in q's dtype.
  const v1::DType o_dtype = q.dtype() == v1::DTYPE_FLOAT8_E4M3 ? v1::DTYPE_BFLOAT16 : q.dtype();
  if (absl::Status s = ExpectShape("o", response.o(), o_dtype, o_shape); !s.ok()) return s;
  absl::StatusOr<std::vector<float>> o = TensorToFloat(response.o());
  if (!o.ok()) return o.status();
  ref_o.resize(o->size());

  CheckResult result;
  result.reference_threads = *threads;
  result.relative_error = RelativeError(*o, ref_o);
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < o->size(); ++i) {
    // A NaN anywhere must fail: std::max would drop it, so test it explicitly.
    const double diff = std::abs((*o)[i] - ref_o[i]);
    max_diff = std::isnan(diff) ? diff : std::max(max_diff, diff);
    if (std::isnan(max_diff)) break;
    max_ref = std::max(max_ref, std::abs(ref_o[i]));
  }
  result.max_relative_error = max_ref > 0 ? max_diff / max_ref : max_diff;
  if (std::isnan(result.relative_error)) {
    result.relative_error = std::numeric_limits<double>::infinity();
  }

  if (request.return_lse()) {
    const std::vector<int64_t> lse_shape =
        varlen ? std::vector<int64_t>{p.heads_q, p.total_q}
               : std::vector<int64_t>{p.batch, p.heads_q, p.seqlen_q};
    if (absl::Status s = ExpectShape("lse", response.lse(), v1::DTYPE_FLOAT32, lse_shape);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<std::vector<float>> lse = TensorToFloat(response.lse());
    if (!lse.ok()) return lse.status();
    ref_lse.resize(lse_size);
    // Rows that see no key are -inf in the reference; they must be -inf here too and are left
    // out of the norm.
    std::vector<float> got;
    std::vector<double> want;
    bool rows_match = true;
    for (int64_t i = 0; i < lse_size; ++i) {
      if (std::isinf(ref_lse[i])) {
        rows_match &= std::isinf((*lse)[i]) && (*lse)[i] < 0;
      } else {
        got.push_back((*lse)[i]);
        want.push_back(ref_lse[i]);
      }
    }
    result.lse_checked = true;
    // An LSE is a log: its float32 rounding error is absolute (about eps times the logits), so
    // near 0 a purely relative measure is ill-conditioned. Each element's scale counts as at least
    // 1: ||lse - ref|| / (||ref|| + sqrt(n)).
    double diff = 0, norm = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      diff += (got[i] - want[i]) * (got[i] - want[i]);
      norm += want[i] * want[i];
    }
    const double scale = std::sqrt(norm) + std::sqrt(static_cast<double>(got.size()));
    result.lse_relative_error =
        rows_match ? std::sqrt(diff) / scale : std::numeric_limits<double>::infinity();
    if (std::isnan(result.lse_relative_error)) {
      result.lse_relative_error = std::numeric_limits<double>::infinity();
    }
  }
  return result;
}

}  // namespace attention::client
