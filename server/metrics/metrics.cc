#include "server/metrics/metrics.h"

#include <algorithm>
#include <exception>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"
#include "server/metrics/process_metrics.h"

namespace attention::server {
namespace {

// Geometric buckets numerator * factor^k / divisor up to the first bound >= last; integer
// numerators keep each bound the double nearest its decimal value (no accumulated rounding).
prometheus::Histogram::BucketBoundaries Geometric(int64_t numerator, int64_t factor, double divisor,
                                                  double last) {
  prometheus::Histogram::BucketBoundaries bounds;
  for (int64_t n = numerator;; n *= factor) {
    bounds.push_back(static_cast<double>(n) / divisor);
    if (bounds.back() >= last) return bounds;
  }
}

// Seconds: 20 us .. ~84 s, doubling (23 buckets): a loopback echo to a long prefill.
const prometheus::Histogram::BucketBoundaries& SecondsBuckets() {
  static const auto* const bounds = new auto(Geometric(20, 2, 1e6, 60));
  return *bounds;
}
// Bytes: 256 B .. 4 GiB, x4 (13 buckets).
const prometheus::Histogram::BucketBoundaries& BytesBuckets() {
  static const auto* const bounds = new auto(Geometric(256, 4, 1, 4.0 * (1 << 30)));
  return *bounds;
}

}  // namespace

Metrics::Metrics(const BuildInfo& build)
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("attention_requests_total")
                    .Help("Requests finished, by rpc and gRPC status code name.")
                    .Register(*registry_)),
      request_duration_(prometheus::BuildHistogram()
                            .Name("attention_request_duration_seconds")
                            .Help("Server time from a request's arrival to its reply.")
                            .Register(*registry_)),
      stage_duration_(prometheus::BuildHistogram()
                          .Name("attention_stage_duration_seconds")
                          .Help("Time per stage of executed requests (queue, h2d, compute, d2h).")
                          .Register(*registry_)),
      request_bytes_(prometheus::BuildHistogram()
                         .Name("attention_request_bytes")
                         .Help("Request payload sizes.")
                         .Register(*registry_)),
      response_bytes_(prometheus::BuildHistogram()
                          .Name("attention_response_bytes")
                          .Help("Response payload sizes.")
                          .Register(*registry_)),
      batch_size_(prometheus::BuildHistogram()
                      .Name("attention_batch_size")
                      .Help("Requests per kernel launch.")
                      .Register(*registry_)),
      inflight_(prometheus::BuildGauge()
                    .Name("attention_inflight_requests")
                    .Help("Requests accepted and not yet answered.")
                    .Register(*registry_)
                    .Add({})),
      queue_depth_(prometheus::BuildGauge()
                       .Name("attention_queue_depth")
                       .Help("Requests waiting for a device.")
                       .Register(*registry_)
                       .Add({})),
      flops_(prometheus::BuildCounter()
                 .Name("attention_flops_total")
                 .Help("Attention FLOPs computed (4 * Hq * D per visible query-key pair).")
                 .Register(*registry_)),
      tokens_(prometheus::BuildCounter()
                  .Name("attention_tokens_total")
                  .Help("Query tokens computed.")
                  .Register(*registry_)),
      device_memory_total_(prometheus::BuildGauge()
                               .Name("attention_device_memory_total_bytes")
                               .Help("Device memory (host RAM for the CPU).")
                               .Register(*registry_)),
      device_memory_used_(prometheus::BuildGauge()
                              .Name("attention_device_memory_used_bytes")
                              .Help("Device memory in use (the server's resident set for the CPU).")
                              .Register(*registry_)),
      device_busy_ratio_(prometheus::BuildGauge()
                             .Name("attention_device_busy_ratio")
                             .Help("Fraction of recent wall time (10 s or more) during which the "
                                   "device ran at least one request.")
                             .Register(*registry_)),
      device_running_batches_(prometheus::BuildGauge()
                                  .Name("attention_device_running_batches")
                                  .Help("Batches (one kernel launch with its copies) running on "
                                        "the device now; the queued ones are "
                                        "attention_queue_depth.")
                                  .Register(*registry_)),
      device_in_service_(prometheus::BuildGauge()
                             .Name("attention_device_in_service")
                             .Help("1 while the device takes work, 0 once a fault took it out of "
                                   "service (until the server restarts).")
                             .Register(*registry_)),
      queue_capacity_(prometheus::BuildGauge()
                          .Name("attention_queue_capacity")
                          .Help("Requests that may wait for a device; more are refused.")
                          .Register(*registry_)
                          .Add({})),
      request_rings_(prometheus::BuildGauge()
                         .Name("attention_request_rings")
                         .Help("Request rings (SharedMemory.OpenRing) served now, each with a "
                               "thread of its own.")
                         .Register(*registry_)
                         .Add({})),
      socket_streams_(prometheus::BuildGauge()
                          .Name("attention_socket_streams")
                          .Help("Socket streams (Sockets.Open, --socket_port) served now, each "
                                "with a thread of its own.")
                          .Register(*registry_)
                          .Add({})),
      queue_stage_(stage_duration_.Add({{"stage", "queue"}}, SecondsBuckets())),
      h2d_stage_(stage_duration_.Add({{"stage", "h2d"}}, SecondsBuckets())),
      compute_stage_(stage_duration_.Add({{"stage", "compute"}}, SecondsBuckets())),
      d2h_stage_(stage_duration_.Add({{"stage", "d2h"}}, SecondsBuckets())),
      sampled_(std::make_shared<Sampled>(this)) {
  prometheus::BuildGauge()
      .Name("attention_build_info")
      .Help("What is running: version, backend and CUDA toolkit; always 1.")
      .Register(*registry_)
      .Add({{"version", build.version}, {"backend", build.backend}, {"cuda", build.cuda}})
      .Set(1);
  sessions_resident_ = &prometheus::BuildGauge()
                            .Name("attention_sessions_resident")
                            .Help("KV-resident sessions held, by device.")
                            .Register(*registry_);
  session_resident_bytes_ = &prometheus::BuildGauge()
                                 .Name("attention_session_resident_bytes")
                                 .Help("Bytes of the KV pages sessions hold, by device.")
                                 .Register(*registry_);
  kv_pages_free_ = &prometheus::BuildGauge()
                        .Name("attention_kv_pages_free")
                        .Help("Free pages of the KV cache, by device.")
                        .Register(*registry_);
  kv_pages_shared_ = &prometheus::BuildGauge()
                          .Name("attention_kv_pages_shared")
                          .Help(
                              "Pages of the KV cache more than one session holds (forks share "
                              "their parent's full pages), by device.")
                          .Register(*registry_);
  kv_pages_cached_ = &prometheus::BuildGauge()
                          .Name("attention_kv_pages_cached")
                          .Help(
                              "Pages of cached prefixes no session holds (taken back, least "
                              "recently used first, when no page is free), by device.")
                          .Register(*registry_);
  kv_prefix_blocks_ = &prometheus::BuildCounter()
                           .Name("attention_kv_prefix_blocks_total")
                           .Help(
                               "Full pages of CreateSession prefixes looked up, by device and "
                               "result (hit: cached and shared; miss).")
                           .Register(*registry_);
  kv_prefix_shared_bytes_ = &prometheus::BuildCounter()
                                 .Name("attention_kv_prefix_shared_bytes_total")
                                 .Help(
                                     "Bytes of cached prefix pages new sessions shared instead of "
                                     "holding their own, by device.")
                                 .Register(*registry_);
  kv_prefix_evicted_pages_ = &prometheus::BuildCounter()
                                  .Name("attention_kv_prefix_evicted_pages_total")
                                  .Help("Cached prefix pages taken back for room, by device.")
                                  .Register(*registry_);
  kv_host_bytes_used_ = &prometheus::BuildGauge()
                             .Name("attention_kv_host_bytes_used")
                             .Help(
                                 "Bytes of the KV host tier holding pages of cold sessions, by "
                                 "device (--kv_host_bytes).")
                             .Register(*registry_);
  kv_host_bytes_total_ = &prometheus::BuildGauge()
                              .Name("attention_kv_host_bytes_capacity")
                              .Help("Bytes of the KV host tier, by device (--kv_host_bytes).")
                              .Register(*registry_);
  kv_host_pages_moved_ = &prometheus::BuildCounter()
                              .Name("attention_kv_host_pages_total")
                              .Help(
                                  "KV pages moved to the host tier (direction spilled) and back "
                                  "into the pool (restored), by device.")
                              .Register(*registry_);
  kv_host_restore_duration_ = &prometheus::BuildHistogram()
                                   .Name("attention_kv_host_restore_duration_seconds")
                                   .Help(
                                       "Bringing one session's pages back from the host tier "
                                       "(copies and bookkeeping), by device.")
                                   .Register(*registry_);
  kv_pages_total_ = &prometheus::BuildGauge()
                         .Name("attention_kv_pages_capacity")
                         .Help("Pages of the KV cache, by device (--kv_cache_fraction).")
                         .Register(*registry_);
  session_expirations_ = &prometheus::BuildCounter()
                              .Name("attention_session_expirations_total")
                              .Help("Sessions removed after --session_ttl_s idle seconds.")
                              .Register(*registry_)
                              .Add({});
  decode_step_duration_ = &prometheus::BuildHistogram()
                               .Name("attention_decode_step_duration_seconds")
                               .Help("One paged decode launch (a Step's sessions of one shape).")
                               .Register(*registry_);
}

absl::StatusOr<int> Metrics::Serve(const std::string& address) {
  // civetweb gives each connection a worker thread from accept until its request has been read
  // and answered, so a connection trickling its headers holds a worker until the request timeout
  // (civetweb's default 30 s, counted from the connection's first byte; prometheus-cpp's default
  // pool is 2 workers), and a scrape queued behind them waits. Workers for a few dozen such
  // connections beside the scrapers (an idle worker is a sleeping thread), and a timeout that
  // drops each after 1 s (a scraper sends its request at once), so a scrape is answered within
  // 2 s while they trickle (tests/python/test_operator.py). Keep-alive stays off (civetweb's
  // default): a scraper's connection gives its worker back after each scrape.
  const std::vector<std::string> options = {"listening_ports",    address,  //
                                            "num_threads",        "128",    //
                                            "request_timeout_ms", "1000"};
  // civetweb reports a failed bind by throwing; it stays inside this call.
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", address,
                     " (--metrics_port): another process holds the port, or the address is not "
                     "this host's (",
                     e.what(), ")"));
  }
  exposer_->RegisterCollectable(sampled_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("metrics: no port bound for ", address));
  }
  return ports.front();
}

std::string Metrics::Scrape() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, sampled_->Collect());
  return out.str();
}

void Metrics::RequestStarted() { inflight_.Increment(); }

void Metrics::RequestFinished(absl::string_view rpc, absl::StatusCode code, absl::Duration elapsed,
                              int64_t request_bytes, int64_t response_bytes) {
  inflight_.Decrement();
  std::lock_guard<std::mutex> lock(cache_mu_);
  RpcMetrics& m = ForRpc(rpc);
  prometheus::Counter*& requests = m.requests[code];
  if (requests == nullptr) {
    // absl's code names are gRPC's canonical names ("OK", "INVALID_ARGUMENT", ...).
    requests =
        &requests_.Add({{"rpc", std::string(rpc)}, {"code", absl::StatusCodeToString(code)}});
  }
  requests->Increment();
  m.duration->Observe(absl::ToDoubleSeconds(elapsed));
  m.request_bytes->Observe(static_cast<double>(request_bytes));
  m.response_bytes->Observe(static_cast<double>(response_bytes));
}

Metrics::RpcMetrics& Metrics::ForRpc(absl::string_view rpc) {
  auto it = rpc_metrics_.find(rpc);
  if (it != rpc_metrics_.end()) return it->second;
  const prometheus::Labels labels = {{"rpc", std::string(rpc)}};
  return rpc_metrics_
      .emplace(rpc, RpcMetrics{.duration = &request_duration_.Add(labels, SecondsBuckets()),
                               .request_bytes = &request_bytes_.Add(labels, BytesBuckets()),
                               .response_bytes = &response_bytes_.Add(labels, BytesBuckets())})
      .first->second;
}

Metrics::DeviceMetrics& Metrics::ForDevice(const std::string& device) {
  auto it = device_metrics_.find(device);
  if (it != device_metrics_.end()) return it->second;
  const prometheus::Labels labels = {{"device", device}};
  return device_metrics_
      .emplace(device, DeviceMetrics{.flops = &flops_.Add(labels), .tokens = &tokens_.Add(labels)})
      .first->second;
}

void Metrics::StagesObserved(absl::Duration queued, const StageTimes& stages) {
  queue_stage_.Observe(absl::ToDoubleSeconds(queued));
  h2d_stage_.Observe(stages.h2d_us * 1e-6);
  compute_stage_.Observe(stages.compute_us * 1e-6);
  d2h_stage_.Observe(stages.d2h_us * 1e-6);
}

void Metrics::Computed(const std::string& device, double flops, int64_t query_tokens,
                       int launch_size) {
  std::lock_guard<std::mutex> lock(cache_mu_);
  DeviceMetrics& m = ForDevice(device);
  if (launch_size > 0) {
    if (m.batch_size == nullptr) {
      m.batch_size = &batch_size_.Add(
          {{"device", device}}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64});
    }
    m.batch_size->Observe(launch_size);
  }
  m.flops->Increment(flops);
  m.tokens->Increment(static_cast<double>(query_tokens));
}

void Metrics::SetQueueDepth(int depth) { queue_depth_.Set(depth); }

void Metrics::SetRequestRings(int rings) { request_rings_.Set(rings); }

void Metrics::SetSocketStreams(int sockets) { socket_streams_.Set(sockets); }

void Metrics::SetDeviceMemoryTotal(const std::string& device, int64_t bytes) {
  device_memory_total_.Add({{"device", device}}).Set(static_cast<double>(bytes));
}

void Metrics::SetKvCache(const std::string& device, int64_t sessions, int64_t resident_bytes,
                         int64_t pages_free, int64_t pages_total, int64_t pages_shared,
                         int64_t pages_cached) {
  const prometheus::Labels labels = {{"device", device}};
  sessions_resident_->Add(labels).Set(static_cast<double>(sessions));
  session_resident_bytes_->Add(labels).Set(static_cast<double>(resident_bytes));
  kv_pages_free_->Add(labels).Set(static_cast<double>(pages_free));
  kv_pages_total_->Add(labels).Set(static_cast<double>(pages_total));
  kv_pages_shared_->Add(labels).Set(static_cast<double>(pages_shared));
  kv_pages_cached_->Add(labels).Set(static_cast<double>(pages_cached));
}

void Metrics::PrefixLookedUp(const std::string& device, int64_t hit_blocks, int64_t missed_blocks,
                             int64_t shared_bytes) {
  kv_prefix_blocks_->Add({{"device", device}, {"result", "hit"}})
      .Increment(static_cast<double>(hit_blocks));
  kv_prefix_blocks_->Add({{"device", device}, {"result", "miss"}})
      .Increment(static_cast<double>(missed_blocks));
  kv_prefix_shared_bytes_->Add({{"device", device}}).Increment(static_cast<double>(shared_bytes));
}

void Metrics::PrefixPagesEvicted(const std::string& device, int64_t pages) {
  kv_prefix_evicted_pages_->Add({{"device", device}}).Increment(static_cast<double>(pages));
}

void Metrics::SetKvHostTier(const std::string& device, int64_t bytes_used, int64_t bytes_total) {
  const prometheus::Labels labels = {{"device", device}};
  kv_host_bytes_used_->Add(labels).Set(static_cast<double>(bytes_used));
  kv_host_bytes_total_->Add(labels).Set(static_cast<double>(bytes_total));
}

void Metrics::KvHostTierMoved(const std::string& device, int64_t spilled_pages,
                              int64_t restored_pages, double restore_seconds) {
  if (spilled_pages > 0) {
    kv_host_pages_moved_->Add({{"device", device}, {"direction", "spilled"}})
        .Increment(static_cast<double>(spilled_pages));
  }
  if (restored_pages == 0) return;
  kv_host_pages_moved_->Add({{"device", device}, {"direction", "restored"}})
      .Increment(static_cast<double>(restored_pages));
  std::lock_guard<std::mutex> lock(cache_mu_);
  prometheus::Histogram*& duration = ForDevice(device).host_restore_duration;
  if (duration == nullptr) {
    duration = &kv_host_restore_duration_->Add({{"device", device}}, SecondsBuckets());
  }
  duration->Observe(restore_seconds);
}

void Metrics::SessionsExpired(int count) { session_expirations_->Increment(count); }

void Metrics::DecodeStepObserved(const std::string& device, absl::Duration elapsed) {
  std::lock_guard<std::mutex> lock(cache_mu_);
  prometheus::Histogram*& duration = ForDevice(device).decode_step_duration;
  if (duration == nullptr) {
    duration = &decode_step_duration_->Add({{"device", device}}, SecondsBuckets());
  }
  duration->Observe(absl::ToDoubleSeconds(elapsed));
}

std::unique_ptr<Metrics::SchedulerWatch> Metrics::Watch(const Scheduler& scheduler,
                                                        absl::Duration busy_window) {
  queue_capacity_.Set(scheduler.max_queue());
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(watch_mu_);
  scheduler_ = &scheduler;
  busy_window_ = busy_window;
  busy_history_.clear();
  for (const DeviceLoad& load : scheduler.device_loads()) {
    busy_history_[load.device->name].emplace_back(now, load.busy);
  }
  return std::make_unique<SchedulerWatch>(this);
}

Metrics::SchedulerWatch::~SchedulerWatch() { metrics_->Unwatch(); }

void Metrics::Unwatch() {
  // Waits for a sample in progress: the scheduler may go once this returns.
  std::lock_guard<std::mutex> lock(watch_mu_);
  scheduler_ = nullptr;
}

void Metrics::SampleScheduler() {
  std::lock_guard<std::mutex> lock(watch_mu_);
  if (scheduler_ == nullptr) return;
  const absl::Time now = absl::Now();
  for (const DeviceLoad& load : scheduler_->device_loads()) {
    const prometheus::Labels labels = {{"device", load.device->name}};
    device_in_service_.Add(labels).Set(load.lost.ok() ? 1 : 0);
    device_running_batches_.Add(labels).Set(load.running);
    if (load.memory.ok()) {
      device_memory_used_.Add(labels).Set(static_cast<double>(load.memory->used_bytes));
      device_memory_total_.Add(labels).Set(static_cast<double>(load.memory->total_bytes));
    }
    // Busy ratio since the last point at or before busy_window_ ago: drop the points before it.
    std::deque<BusyPoint>& history = busy_history_[load.device->name];
    history.emplace_back(now, load.busy);
    while (history.size() > 2 && history[1].first <= now - busy_window_) history.pop_front();
    const auto [since, busy_then] = history.front();
    if (now > since) {
      const double ratio = absl::FDivDuration(load.busy - busy_then, now - since);
      device_busy_ratio_.Add(labels).Set(std::clamp(ratio, 0.0, 1.0));
    }
  }
}

std::vector<prometheus::MetricFamily> Metrics::Sampled::Collect() const {
  metrics_->SampleScheduler();
  std::vector<prometheus::MetricFamily> families = metrics_->registry_->Collect();
  for (prometheus::MetricFamily& family : CollectProcessMetrics()) {
    families.push_back(std::move(family));
  }
  return families;
}

}  // namespace attention::server
