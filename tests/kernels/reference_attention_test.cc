// The float64 reference on inputs whose answer is known in closed form: with q = 0 every visible
// key gets the same weight, so o is the mean of the visible v rows and lse = log(count). That
// checks masks (bottom-right and top-left windows, Nq != Nk), GQA head mapping, strides and varlen
// offsets.
#include "kernels/reference/reference_attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace attention {
namespace {

struct Expected {
  int64_t lo, hi;  // visible keys, clamped; empty when lo > hi
};

// Visible keys of row i under FlashAttention's bottom-right convention (diagonal key i + nk - nq)
// or torch SDPA's top-left one (diagonal key i), computed directly.
Expected Visible(int64_t i, int64_t nq, int64_t nk, int64_t left, int64_t right, bool top_left) {
  Expected e{0, nk - 1};
  const int64_t diag = top_left ? i : i + nk - nq;
  if (left != kUnboundedWindow) e.lo = std::max<int64_t>(0, diag - left);
  if (right != kUnboundedWindow) e.hi = std::min<int64_t>(nk - 1, diag + right);
  return e;
}

void CheckUniform(Layout layout, int64_t nq, int64_t nk, int64_t left, int64_t right,
                  bool top_left = false) {
  SCOPED_TRACE(testing::Message() << "layout " << static_cast<int>(layout) << " nq " << nq << " nk "
                                  << nk << " window " << left << "," << right
                                  << (top_left ? " top-left" : " bottom-right"));
  AttentionParams p;
  p.batch = 2;
  p.heads_q = 4;
  p.heads_kv = 2;
  p.seqlen_q = nq;
  p.seqlen_k = nk;
  p.head_dim = 3;
  p.window_left = left;
  p.window_right = right;
  p.mask_alignment = top_left ? MaskAlignment::kTopLeft : MaskAlignment::kBottomRight;
  p.softmax_scale = 0.7f;
  p.SetContiguousStrides(layout);
  std::vector<float> q(p.batch * p.heads_q * nq * p.head_dim, 0.0f);
  std::vector<float> k(p.batch * p.heads_kv * nk * p.head_dim, 1.0f);
  std::vector<float> v(k.size());
  // v[b, hk, j, x] = 1000 b + 100 hk + j + x / 8 (exact in float): heads and keys distinguishable.
  auto v_value = [](int64_t b, int64_t hk, int64_t j, int64_t x) {
    return 1000.0 * b + 100.0 * hk + j + x / 8.0;
  };
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t hk = 0; hk < p.heads_kv; ++hk)
      for (int64_t j = 0; j < nk; ++j)
        for (int64_t x = 0; x < p.head_dim; ++x)
          v[b * p.v_batch_stride + hk * p.v_head_stride + j * p.v_row_stride + x] =
              static_cast<float>(v_value(b, hk, j, x));
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.o = q.data();  // ignored by the reference
  std::vector<double> o, lse;
  ASSERT_TRUE(reference::Forward(p, &o, &lse).ok());
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t hk = h / 2;
      for (int64_t i = 0; i < nq; ++i) {
        const Expected e = Visible(i, nq, nk, left, right, top_left);
        const double lse_got = lse[b * p.lse_batch_stride + h * p.lse_head_stride + i];
        for (int64_t x = 0; x < p.head_dim; ++x) {
          const double got = o[b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride + x];
          // Mean of j over [lo, hi] is (lo + hi) / 2.
          const double want = e.lo > e.hi ? 0.0 : v_value(b, hk, 0, x) + (e.lo + e.hi) / 2.0;
          ASSERT_NEAR(got, want, 1e-9) << "b " << b << " h " << h << " i " << i << " x " << x;
        }
        if (e.lo > e.hi) {
          ASSERT_EQ(lse_got, -std::numeric_limits<double>::infinity());
        } else {
          // All logits equal 0 (q = 0): lse = log(count).
          ASSERT_NEAR(lse_got, std::log(static_cast<double>(e.hi - e.lo + 1)), 1e-12);
        }
      }
    }
  }
}

TEST(ReferenceAttentionTest, UniformWeightsGiveMeanOfVisibleValues) {
  for (Layout layout : {Layout::kBHSD, Layout::kBSHD}) {
    CheckUniform(layout, 9, 9, kUnboundedWindow, kUnboundedWindow);
    CheckUniform(layout, 9, 9, kUnboundedWindow, 0);
    CheckUniform(layout, 5, 12, 2, 0);
    CheckUniform(layout, 12, 5, kUnboundedWindow, 0);  // first 7 rows see nothing
    CheckUniform(layout, 12, 5, 1, 1);
    CheckUniform(layout, 7, 7, 0, kUnboundedWindow);
  }
}

TEST(ReferenceAttentionTest, TopLeftAlignmentPutsRowIOnKeyI) {
  for (Layout layout : {Layout::kBHSD, Layout::kBSHD}) {
    CheckUniform(layout, 5, 12, kUnboundedWindow, 0, true);  // keys 5.. seen by no row
    CheckUniform(layout, 12, 5, kUnboundedWindow, 0, true);  // rows 4.. see every key
    CheckUniform(layout, 12, 5, 1, 1, true);                 // rows 7.. see nothing
    CheckUniform(layout, 5, 12, 2, 3, true);
    CheckUniform(layout, 9, 9, 1, 0, true);
  }
}

TEST(ReferenceAttentionTest, OneKeyGivesItsValueAndLogit) {
  // Varlen: two items of (nq, nk) = (2, 1) and (1, 1); each row sees one key, so o = v and
  // lse = scale * q.k.
  const int32_t cu_q[] = {0, 2, 3}, cu_k[] = {0, 1, 2};
  AttentionParams p;
  p.batch = 2;
  p.heads_q = p.heads_kv = 1;
  p.seqlen_q = 2;
  p.seqlen_k = 1;
  p.head_dim = 2;
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  p.total_q = 3;
  p.total_k = 2;
  p.softmax_scale = 0.5f;
  p.SetContiguousStrides(Layout::kBHSD);
  const float q[] = {1, 2, 3, 4, 5, 6}, k[] = {1, 1, -1, 2}, v[] = {7, 8, 9, 10};
  p.q = q;
  p.k = k;
  p.v = v;
  std::vector<double> o, lse;
  ASSERT_TRUE(reference::Forward(p, &o, &lse).ok());
  EXPECT_EQ(o, (std::vector<double>{7, 8, 7, 8, 9, 10}));
  EXPECT_EQ(lse, (std::vector<double>{0.5 * 3, 0.5 * 7, 0.5 * 7}));
}

// The open-model options on answers known in closed form. One item, one head, q = 0 except where
// said, so each visible key has logit 0 and weight 1.
struct OneHead {
  AttentionParams p;
  std::vector<float> q, k, v;
  OneHead(int64_t nq, int64_t nk, int64_t d, int64_t dv) {
    p.batch = p.heads_q = p.heads_kv = 1;
    p.seqlen_q = nq;
    p.seqlen_k = nk;
    p.head_dim = d;
    p.v_head_dim = dv;
    p.softmax_scale = 1.0f;
    p.SetContiguousStrides(Layout::kBHSD);
    q.assign(nq * d, 0.0f);
    k.assign(nk * d, 1.0f);
    v.resize(nk * dv);
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t x = 0; x < dv; ++x) v[j * dv + x] = static_cast<float>(j + 10 * x);
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
  }
  void Run(std::vector<double>* o, std::vector<double>* lse) {
    ASSERT_TRUE(reference::Forward(p, o, lse).ok());
  }
};

TEST(ReferenceAttentionTest, SinkAddsToTheDenominatorOnly) {
  OneHead t(3, 4, 2, 2);
  const float sink = std::log(4.0f);  // exp(sink) = 4: as many as the keys
  t.p.sinks = &sink;
  std::vector<double> o, lse;
  t.Run(&o, &lse);
  // Every row sees the 4 keys of mean value (1.5 + 10 x); the sink halves it.
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t x = 0; x < 2; ++x) EXPECT_NEAR(o[i * 2 + x], (1.5 + 10 * x) / 2, 1e-6);
    EXPECT_NEAR(lse[i], std::log(8.0), 1e-6);
  }
  // A row that sees no key (Nq > Nk, causal): o = 0, lse = the sink.
  OneHead empty(3, 1, 2, 2);
  empty.p.window_right = 0;
  empty.p.sinks = &sink;
  empty.Run(&o, &lse);
  EXPECT_EQ(o[0], 0.0);
  EXPECT_NEAR(lse[0], sink, 1e-6);
}

TEST(ReferenceAttentionTest, SoftcapBoundsTheLogits) {
  OneHead t(1, 2, 1, 1);
  t.q[0] = 30.0f;  // logits 30 (key 0, k = 1) and 0 (key 1, k = 0)
  t.k[1] = 0.0f;
  t.p.softcap = 5.0f;  // 30 -> 5 tanh(6)
  std::vector<double> o, lse;
  t.Run(&o, &lse);
  const double s = 5.0 * std::tanh(6.0);
  EXPECT_NEAR(o[0], 1.0 / (std::exp(s) + 1.0), 1e-9);  // v = 0 (key 0), 1 (key 1)
  EXPECT_NEAR(lse[0], std::log(std::exp(s) + 1.0), 1e-9);
}

TEST(ReferenceAttentionTest, ChunkLimitsKeysToTheQueryChunk) {
  // Causal, chunks of 3 over 8 positions (bottom-right, Nq = Nk): row i sees keys
  // 3 floor(i / 3) .. i.
  OneHead t(8, 8, 1, 1);
  t.p.window_right = 0;
  t.p.chunk_size = 3;
  std::vector<double> o, lse;
  t.Run(&o, &lse);
  for (int64_t i = 0; i < 8; ++i) {
    const int64_t lo = i / 3 * 3;
    EXPECT_NEAR(o[i], (lo + i) / 2.0, 1e-9) << i;
    EXPECT_NEAR(lse[i], std::log(static_cast<double>(i - lo + 1)), 1e-9) << i;
  }
}

TEST(ReferenceAttentionTest, ValueHeadDimOfItsOwn) {
  OneHead t(2, 5, 3, 2);  // QK head dim 3, V head dim 2: o [2, 2]
  std::vector<double> o, lse;
  t.Run(&o, &lse);
  ASSERT_EQ(o.size(), 4u);
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t x = 0; x < 2; ++x) EXPECT_NEAR(o[i * 2 + x], 2.0 + 10 * x, 1e-9);
}

}  // namespace
}  // namespace attention
