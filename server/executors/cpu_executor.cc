// The CPU executor: runs requests on the CPU backend's thread pool. Its device is the host: the
// CPU model, its cores and its RAM. Its memory in use is this process's resident set (what the
// server holds in RAM: buffers, tensors, code), out of the host's MemTotal.
#include <unistd.h>

#include <fstream>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kernels/cpu/cpu_attention.h"
#include "kernels/cpu/paged_kv_pool.h"
#include "server/executors/executor.h"

namespace attention::server {
namespace {

// The value of the first "key<sep>value" line of `path` whose key is `key`; empty when absent.
std::string ProcField(const char* path, absl::string_view key, char sep) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(line, absl::MaxSplits(sep, 1));
    if (absl::StripAsciiWhitespace(kv.first) == key) {
      return std::string(absl::StripAsciiWhitespace(kv.second));
    }
  }
  return "";
}

DeviceDescription DescribeHost(std::string name) {
  DeviceDescription device;
  device.name = std::move(name);
  device.description = ProcField("/proc/cpuinfo", "model name", ':');
  if (device.description.empty()) device.description = "unknown CPU";
  device.multiprocessors = static_cast<int>(std::thread::hardware_concurrency());
  device.fast_head_dims = cpu::SpecialisedHeadDims();
  // kernels/cpu serves every option, on Attend and on the paged pool's steps.
  device.attend_options = {"sinks", "softcap", "chunk_size", "v_head_dim"};
  device.step_options = {"sinks", "softcap", "chunk_size", "v_head_dim", "v_from_k"};
  // "MemTotal:       16318428 kB"
  int64_t kib = 0;
  if (absl::SimpleAtoi(absl::StripSuffix(ProcField("/proc/meminfo", "MemTotal", ':'), " kB"),
                       &kib)) {
    device.memory_bytes = kib * 1024;
  }
  return device;
}

class CpuExecutor final : public Executor {
 public:
  CpuExecutor(int threads, std::string name)
      : device_(DescribeHost(std::move(name))),
        threads_(threads),
        backend_(cpu::CpuBackendOptions{.threads = threads}) {}

  const DeviceDescription& device() const override { return device_; }

  absl::StatusOr<MemoryUsage> Memory() const override {
    // /proc/self/statm: "size resident shared text lib data dt", in pages.
    std::ifstream statm("/proc/self/statm");
    int64_t size_pages = 0, resident_pages = 0;
    if (!(statm >> size_pages >> resident_pages)) {
      return absl::UnavailableError("cannot read /proc/self/statm");
    }
    return MemoryUsage{.used_bytes = resident_pages * sysconf(_SC_PAGESIZE),
                       .total_bytes = device_.memory_bytes};
  }

  absl::StatusOr<StageTimes> Run(const AttentionParams& host_params) override {
    const absl::Time start = absl::Now();
    absl::Status status = backend_.Forward(host_params);
    if (!status.ok()) return status;
    return StageTimes{.compute_us = absl::ToDoubleMicroseconds(absl::Now() - start)};
  }

 protected:
  // Host memory, reserved but committed only as pages are written.
  absl::StatusOr<std::unique_ptr<KvPagePool>> CreateKvPagePool(int64_t num_pages,
                                                               int64_t page_bytes) override {
    return cpu::MakeKvPagePool(num_pages, page_bytes, threads_);
  }

 private:
  const DeviceDescription device_;
  const int threads_;
  cpu::CpuBackend backend_;
};

}  // namespace

std::unique_ptr<Executor> MakeCpuExecutor(int threads, std::string name) {
  return std::make_unique<CpuExecutor>(threads, std::move(name));
}

}  // namespace attention::server
