// The CPU backend: tiled online-softmax attention (FlashAttention's algorithm on the CPU),
// multithreaded over (batch, head, query tile), float32 accumulation.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/attention_params.h"

namespace attention::cpu {

// The head dims the CPU kernel specialises, for a server's list of the fastest ones: none. One code
// path serves every head dim (register blocks of 16 features looped over D, cpu_attention.cc); the
// only shape-dependent fast path is float32 V read in place when D is a multiple of 16, which is no
// list of head dims. cuda::SpecialisedHeadDims() (kernels/cuda/ops/limits.h) is the CUDA backend's.
inline std::vector<int> SpecialisedHeadDims() { return {}; }

struct CpuBackendOptions {
  int threads = 0;  // compute threads (the caller plus a pool); 0 = the CPUs this process may use
};

// Owns a thread pool; Forward may be called from several threads at once.
class CpuBackend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options = {});
  ~CpuBackend();
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  // Computes p.o (and p.lse when set). All pointers are host memory.
  absl::Status Forward(const AttentionParams& p);

  int threads() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attention::cpu
