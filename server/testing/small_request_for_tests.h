// Test support: a small bfloat16 request (B=1, H=2, N=64, D=64, q = k = v filled with a small
// positive value) with its own host buffers, for tests that need a request that succeeds.
#pragma once

#include <vector>

#include "kernels/attention_params.h"

namespace attention::server {

struct SmallRequest {
  std::vector<char> q, o;  // q also serves as k and v
  AttentionParams params;

  SmallRequest() {
    params.dtype = DType::kBFloat16;
    params.batch = 1;
    params.heads_q = params.heads_kv = 2;
    params.seqlen_q = params.seqlen_k = 64;
    params.head_dim = 64;
    q.assign(2 * 64 * 64 * 2, 0x3c);  // 0x3c3c: a small positive bfloat16
    o.assign(q.size(), 0);
    params.q = params.k = params.v = q.data();
    params.o = o.data();
    params.SetContiguousStrides(Layout::kBHSD);
  }
};

}  // namespace attention::server
