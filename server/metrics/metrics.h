// Prometheus metrics for the server (names, types and labels per docs/API.md; dashboards depend
// on them). Label values are bounded sets (rpc names, status codes, devices, stages): never a
// request id. Latencies and sizes are histograms, so they can be aggregated across replicas.
// Request metrics are updated on the request path; device memory and busy ratio are sampled from
// the scheduler when /metrics is scraped (Watch); the process metrics (process_metrics.h) are
// read then too.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "server/executors/executor.h"
#include "server/scheduling/scheduler.h"

namespace attention::server {

// What is running, exported as attention_build_info{version, backend, cuda} = 1.
struct BuildInfo {
  std::string version;
  std::string backend;  // "cpu" or "cuda"
  std::string cuda;     // the CUDA toolkit version built with, or "none"
};

class Metrics {
 public:
  // attention_device_busy_ratio covers at least this much recent wall time by default (more
  // when scrapes come further apart: then it covers the time since the previous scrape).
  static constexpr absl::Duration kBusyWindow = absl::Seconds(10);

  // Ends a Watch when destroyed.
  class SchedulerWatch {
   public:
    explicit SchedulerWatch(Metrics* metrics) : metrics_(metrics) {}
    ~SchedulerWatch();
    SchedulerWatch(const SchedulerWatch&) = delete;
    SchedulerWatch& operator=(const SchedulerWatch&) = delete;

   private:
    Metrics* const metrics_;
  };

  explicit Metrics(const BuildInfo& build);
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves /metrics over HTTP on `address` ("host:port"; port 0 picks a free one) and returns
  // the port bound.
  absl::StatusOr<int> Serve(const std::string& address);
  // The text exposition /metrics would answer now.
  std::string Scrape() const;

  // Per request: Started when it arrives, Finished once when it is answered.
  void RequestStarted();
  void RequestFinished(absl::string_view rpc, absl::StatusCode code, absl::Duration elapsed,
                       int64_t request_bytes, int64_t response_bytes);
  // Per executed request.
  void StagesObserved(absl::Duration queued, const StageTimes& stages);
  // `launch_size`: the requests in the launch this one led, observed once per launch; 0 for the
  // other requests of a batch.
  void Computed(const std::string& device, double flops, int64_t query_tokens, int launch_size = 1);
  void SetQueueDepth(int depth);
  // Request rings served now (streams/request_rings.h).
  void SetRequestRings(int rings);
  // Socket streams served now (streams/socket_streams.h).
  void SetSocketStreams(int sockets);
  void SetDeviceMemoryTotal(const std::string& device, int64_t bytes);

  // KV-resident sessions (session_store.h), per device: sessions held, bytes of the pages they
  // hold (a page forks share counted once), the pool's free and total pages and the pages more
  // than one session holds, and the cached prefix pages no session holds; expirations after the
  // TTL; the duration of each decode step (one KvPagePool::Decode call).
  void SetKvCache(const std::string& device, int64_t sessions, int64_t resident_bytes,
                  int64_t pages_free, int64_t pages_total, int64_t pages_shared,
                  int64_t pages_cached);
  // Shared prefixes (CreateSessionRequest.prefix_tokens), per device: a lookup's full pages of
  // the prefix found cached and not, and the bytes of pages it shared; cached pages taken back.
  void PrefixLookedUp(const std::string& device, int64_t hit_blocks, int64_t missed_blocks,
                      int64_t shared_bytes);
  void PrefixPagesEvicted(const std::string& device, int64_t pages);
  // The host tier (--kv_host_bytes), per device: its bytes holding pages of cold sessions and its
  // capacity; pages moved out to it and back (counters), and each session's restore's duration.
  void SetKvHostTier(const std::string& device, int64_t bytes_used, int64_t bytes_total);
  void KvHostTierMoved(const std::string& device, int64_t spilled_pages, int64_t restored_pages,
                       double restore_seconds);
  void SessionsExpired(int count);
  void DecodeStepObserved(const std::string& device, absl::Duration elapsed);

  // Until the returned handle is destroyed (before `scheduler` is), every scrape first samples
  // the scheduler: each device's memory (used and total) and busy ratio. Also exports the queue's
  // capacity, so alerts can compare the depth with it. The busy ratio covers `busy_window`.
  [[nodiscard]] std::unique_ptr<SchedulerWatch> Watch(const Scheduler& scheduler,
                                                      absl::Duration busy_window = kBusyWindow);

 private:
  // What the exposer collects: the registry, after sampling the watched scheduler, and the
  // process metrics.
  class Sampled final : public prometheus::Collectable {
   public:
    explicit Sampled(Metrics* metrics) : metrics_(metrics) {}
    std::vector<prometheus::MetricFamily> Collect() const override;

   private:
    Metrics* const metrics_;
  };
  // One point of a device's busy-time history: when, and its busy time then.
  using BusyPoint = std::pair<absl::Time, absl::Duration>;

  void SampleScheduler();
  void Unwatch();

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& request_duration_;
  prometheus::Family<prometheus::Histogram>& stage_duration_;
  prometheus::Family<prometheus::Histogram>& request_bytes_;
  prometheus::Family<prometheus::Histogram>& response_bytes_;
  prometheus::Family<prometheus::Histogram>& batch_size_;
  prometheus::Gauge& inflight_;
  prometheus::Gauge& queue_depth_;
  prometheus::Family<prometheus::Counter>& flops_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Family<prometheus::Gauge>& device_memory_total_;
  prometheus::Family<prometheus::Gauge>& device_memory_used_;
  prometheus::Family<prometheus::Gauge>& device_busy_ratio_;
  prometheus::Family<prometheus::Gauge>& device_running_batches_;
  prometheus::Family<prometheus::Gauge>& device_in_service_;
  prometheus::Gauge& queue_capacity_;
  prometheus::Gauge& request_rings_;
  prometheus::Gauge& socket_streams_;
  // Sessions (registered in the constructor's body).
  prometheus::Family<prometheus::Gauge>* sessions_resident_ = nullptr;
  prometheus::Family<prometheus::Gauge>* session_resident_bytes_ = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_pages_free_ = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_pages_shared_ = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_pages_total_ = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_pages_cached_ = nullptr;
  prometheus::Family<prometheus::Counter>* kv_prefix_blocks_ = nullptr;
  prometheus::Family<prometheus::Counter>* kv_prefix_shared_bytes_ = nullptr;
  prometheus::Family<prometheus::Counter>* kv_prefix_evicted_pages_ = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_host_bytes_used_ = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_host_bytes_total_ = nullptr;
  prometheus::Family<prometheus::Counter>* kv_host_pages_moved_ = nullptr;
  prometheus::Family<prometheus::Histogram>* kv_host_restore_duration_ = nullptr;
  prometheus::Counter* session_expirations_ = nullptr;
  prometheus::Family<prometheus::Histogram>* decode_step_duration_ = nullptr;
  // The stage histograms, looked up once.
  prometheus::Histogram& queue_stage_;
  prometheus::Histogram& h2d_stage_;
  prometheus::Histogram& compute_stage_;
  prometheus::Histogram& d2h_stage_;

  // The metrics of one rpc, and of one device, looked up once: Family::Add builds a label map
  // and searches it under the family's lock on every call, which cost a decode Step ~20k
  // instructions of its ~8 metric updates. prometheus-cpp never moves a metric, and none is
  // removed here.
  struct RpcMetrics {
    prometheus::Histogram* duration;
    prometheus::Histogram* request_bytes;
    prometheus::Histogram* response_bytes;
    absl::flat_hash_map<absl::StatusCode, prometheus::Counter*> requests;  // by code
  };
  struct DeviceMetrics {
    prometheus::Counter* flops;
    prometheus::Counter* tokens;
    // Added at their first observation, so a device shows no series it never fed.
    prometheus::Histogram* batch_size = nullptr;
    prometheus::Histogram* decode_step_duration = nullptr;
    prometheus::Histogram* host_restore_duration = nullptr;
  };
  RpcMetrics& ForRpc(absl::string_view rpc);            // needs cache_mu_
  DeviceMetrics& ForDevice(const std::string& device);  // needs cache_mu_
  std::mutex cache_mu_;  // guards the two below (a pthread lock, which ThreadSanitizer sees)
  absl::flat_hash_map<std::string, RpcMetrics> rpc_metrics_;
  absl::flat_hash_map<std::string, DeviceMetrics> device_metrics_;

  std::mutex watch_mu_;  // guards the three below; a pthread lock, which ThreadSanitizer sees
  const Scheduler* scheduler_ = nullptr;
  absl::Duration busy_window_;
  // Per device, oldest first; the first point is the last one at or before busy_window_ ago.
  std::map<std::string, std::deque<BusyPoint>> busy_history_;

  const std::shared_ptr<Sampled> sampled_;
  // Last, so it is destroyed first: its threads may be collecting until then.
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace attention::server
