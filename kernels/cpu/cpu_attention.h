// The CPU backend: tiled online-softmax attention (FlashAttention's algorithm on the CPU),
// multithreaded over (batch, head, query tile), float32 accumulation.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "kernels/attention_params.h"

namespace attention::cpu {

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
