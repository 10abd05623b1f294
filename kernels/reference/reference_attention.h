// The float64 oracle: plain loops over the definition, obviously right, slow. Tests only.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "kernels/attention_params.h"

namespace attention::reference {

// Computes attention of p (host pointers; p.o and p.lse are ignored) in float64, on the inputs
// as values (float8: each element times its tensor's descale, in float64).
// o gets the output in the same element positions p.o would use (sized to hold them);
// lse, when not null, gets [B, Hq, Nq] (varlen: [Hq, total_q]) in the positions p.lse would use.
// Rows that see no key get o = 0 and lse = -inf (with sinks, lse = the head's sink). Serves every
// option of AttentionParams (sinks, softcap, chunk_size, v_head_dim).
absl::Status Forward(const AttentionParams& p, std::vector<double>* o, std::vector<double>* lse);

}  // namespace attention::reference
