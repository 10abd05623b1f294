// attn_bench: a load generator for the attention service, in the manner of perf_analyzer and ghz.
// It keeps --concurrency requests in flight (closed loop) or issues --rate requests per second
// (open loop, at most --concurrency in flight; latency counts from the scheduled send time, so a
// server that falls behind is charged for the wait), over unary calls or AttendStream, and reports
// requests/s, payload GB/s, attention TFLOP/s, latency percentiles and errors by code.
//
//   attn_bench --target=localhost:50051 --shape=1,8,128,64 --dtype=float16 --concurrency=32
//       --duration_s=10 [--rate=500] [--rpc=stream] [--json]
//   attn_bench --target=10.0.0.1:50051,10.0.0.2:50051 ...     # round-robin over both
//
// The echo anchor: attn_echo_server (bench/echo) receives the same q, k, v bytes and returns q's.
// --echo drives it instead of the attention service; --echo_target=ADDR runs the attention
// phase and then the same load against the echo server, and reports both side by side (payload
// GB/s ratio, p50 difference), so the service's overhead is set against the transport's limit.
//
// --mode=decode drives KV-resident sessions (attention.v1.Sessions) instead: it creates --sessions
// sessions of --nk rows each (their K/V uploaded once, before and outside the measurement), then
// sends Step calls, each for B of them (--shape=B,H,N,D: B sessions per Step, H query heads, N
// new tokens per session per step), appending each step's N tokens' K/V (--append_kv), and
// reports session-steps/s and tokens/s beside the request figures. Sessions are dropped at the
// end. Each in-flight Step has sessions of its own: --sessions >= B * --concurrency. With
// --rpc=stream each slot sends its Steps over one StepStream.
//
//   attn_bench --mode=decode --sessions=64 --nk=4096 --shape=8,32,1,128 --kv_heads=8
//       --dtype=bfloat16 --causal --concurrency=8 --duration_s=10 --json
//
// --shm (a server with --allow_shared_memory on this host): q, k, v and o live in a POSIX
// shared-memory object registered with the server, and the requests refer to them, so no tensor
// byte crosses the socket (payload GB/s still counts them). In decode mode every Step entry refers
// to the same q (and new K/V rows) and has a place of its own for o.
//
// --rpc=stream --stream_api=ring (a server with --allow_shared_memory on this host): each slot
// sends its requests (Attend, or decode's Steps) over a request ring of its own instead of a gRPC
// stream (attention.v1.SharedMemory.OpenRing, client/request_ring.h): the request is serialized
// into a shared-memory slot and the response read from one, with no gRPC message per request.
// The ring is registered over the connection the slot's requests use, so --shm's references
// resolve.
//
// Exit status: 0 every measured call succeeded; 1 a measured call failed (the first few distinct
// errors are printed on stderr), or sessions could not be created; 2 bad flags.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "bench/echo/echo.grpc.pb.h"
#include "client/attention_client.h"
#include "client/polled_stream.h"
#include "client/request_builder.h"
#include "client/request_ring.h"
#include "client/session.h"
#include "client/shared_memory.h"
#include "client/tensors.h"
#include "client/tool_flags.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/impl/codegen/proto_utils.h"

ABSL_FLAG(std::string, mode, "attend",
          "attend (Attend calls) | decode (Step calls on KV-resident sessions)");
ABSL_FLAG(int64_t, sessions, 0,
          "decode: sessions to create; 0: B * --concurrency (each Step in flight has its own)");
ABSL_FLAG(bool, append_kv, true,
          "decode: each step appends its new tokens' K/V (sessions grow); false: queries only");
ABSL_FLAG(std::string, target, "localhost:50051",
          "server address host:port, or several comma-separated (balanced round-robin)");
ABSL_FLAG(bool, echo, false, "--target is an attn_echo_server: measure the transport alone");
ABSL_FLAG(std::string, echo_target, "",
          "also run the same load against this attn_echo_server after the attention phase");
ABSL_FLAG(std::vector<std::string>, concurrency, {"1"},
          "requests in flight at most (closed loop: always); a list, e.g. 1,2,4,8, runs each in "
          "turn (a sweep), one result each");
ABSL_FLAG(std::optional<double>, rate, std::nullopt,
          "requests per second, evenly spaced (open loop); absent: closed loop");
ABSL_FLAG(double, duration_s, 10, "measured seconds (after the warmup); ignored with --requests");
ABSL_FLAG(int64_t, requests, 0, "measured requests; 0: run for --duration_s");
ABSL_FLAG(double, warmup_s, 1, "seconds of load before measuring starts");
ABSL_FLAG(attention::client::Shape, shape, (attention::client::Shape{1, 8, 128, 64}),
          "B,H,N,D, positive integers: batch, query heads, query length, head dim (decode: "
          "sessions per Step, "
          "query heads, new tokens per session per step, head dim)");
ABSL_FLAG(std::optional<int64_t>, kv_heads, std::nullopt, "key/value heads (default: H)");
ABSL_FLAG(std::optional<int64_t>, nk, std::nullopt,
          "key length (default: N); decode: each session's initial length");
ABSL_FLAG(std::string, dtype, "float16",
          "float32 | float16 | bfloat16 | float8_e4m3 (o in bfloat16)");
ABSL_FLAG(std::string, layout, "bhsd", "bhsd | bshd");
ABSL_FLAG(bool, causal, false, "causal mask (bottom-right aligned)");
ABSL_FLAG(bool, lse, false, "ask for the log-sum-exp too");
ABSL_FLAG(std::string, rpc, "unary",
          "unary (one call per request) | stream (AttendStream; decode: StepStream), one stream "
          "per concurrency slot; chunked (AttendChunked, --chunk_mb chunks sent from the request's "
          "bytes)");
ABSL_FLAG(std::string, stream_api, "callback",
          "--rpc=stream on gRPC's callback API (reactions on gRPC's threads) | sync (a thread per "
          "stream that writes each request and blocks reading its response, polling the "
          "connection itself, as a synchronous model process calls) | poll (as sync, on the async "
          "API: the thread polls its completion queue without sleeping, so no wake-up comes "
          "between the response's arrival and its read; one busy core per stream) | ring (as "
          "sync, over a request ring in shared memory instead of a stream: no gRPC message per "
          "request, the thread spinning for the response; the server needs "
          "--allow_shared_memory on this host)");
ABSL_FLAG(bool, shm, false,
          "q, k, v (decode: each entry's q and new K/V rows) and o in a POSIX shared-memory object "
          "registered with the server (which needs --allow_shared_memory; one --target), sent by "
          "reference");
ABSL_FLAG(int, connections, 1,
          "channels (TCP connections) to the target; the concurrent slots are spread over them");
ABSL_FLAG(double, chunk_mb, 4, "--rpc=chunked: MiB per chunk");
ABSL_FLAG(double, deadline_s, 60, "deadline per unary call, seconds");
ABSL_FLAG(int, max_attempts, 1, "attempts per call on UNAVAILABLE (gRPC retry policy)");
ABSL_FLAG(int, max_message_mb, 1024,
          "largest gRPC message sent or received, MiB (1..2047; the server has its own limit)");
ABSL_FLAG(bool, json, false,
          "print the results as one JSON object per run (per --concurrency value) at the end");
ABSL_FLAG(bool, csv, false, "print the results as CSV at the end: a header line, one row per run");
ABSL_FLAG(bool, progress, true, "print a progress line (with an ETA) on stderr every second");

namespace attention::client {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct LoadSettings {
  int concurrency = 1;
  std::optional<double> rate;
  double duration_s = 10;
  int64_t requests = 0;
  double warmup_s = 1;
  bool stream = false;
  std::string stream_api = "callback";  // --stream_api
  std::string rpc = "unary";            // unary, stream or chunked
  int connections = 1;
  absl::Duration deadline = absl::Seconds(60);
  bool progress = true;
};

// What one finished request tells the recorder.
struct Completion {
  Clock::time_point start;  // sent (closed loop) or scheduled (open loop); warmup or measured
  grpc::Status status;
  int64_t response_bytes = 0;
  v1::ServerTiming timing;  // the server's account of the request; empty from the echo server
  double flops = 0;         // attention FLOPs the request asked for
  // When set, the latency counts from here instead of `start`: the write of a sync stream slot's
  // thread (SyncStreamSlot), later by the bench's own wake-up of that thread.
  std::optional<Clock::time_point> written;
};

// How many distinct failures (code and message) a phase prints; the rest are only counted.
constexpr int kErrorsShown = 5;

const char* CodeName(grpc::StatusCode code);

// Latencies, bytes and error codes of the measured requests, plus a per-second window for the
// progress line. Shared by gRPC's callback threads. The first kErrorsShown distinct failures are
// printed on stderr as they come, warmup included: a count by code does not say what went wrong.
class Recorder {
 public:
  Recorder(std::string name, Clock::time_point measure_from, int64_t request_bytes)
      : name_(std::move(name)), measure_from_(measure_from), request_bytes_(request_bytes) {}

  void Add(const Completion& c) {
    const Clock::time_point now = Clock::now();
    const double latency = Seconds(now - c.written.value_or(c.start));
    std::lock_guard<std::mutex> lock(mu_);
    window_.push_back(latency);
    if (!c.status.ok()) {
      ++window_errors_;
      std::pair<grpc::StatusCode, std::string> error{c.status.error_code(),
                                                     c.status.error_message()};
      if (shown_errors_.size() < kErrorsShown && shown_errors_.insert(error).second) {
        std::fprintf(stderr, "attn_bench: %s: call failed: %s: %s\n", name_.c_str(),
                     CodeName(error.first), error.second.c_str());
      }
    }
    if (c.start < measure_from_) return;
    last_completion_ = std::max(last_completion_, now);
    ++measured_;
    if (!c.status.ok()) {
      ++errors_[c.status.error_code()];
      return;
    }
    latencies_.push_back(latency);
    timings_.push_back(c.timing);
    payload_bytes_ += request_bytes_ + c.response_bytes;
    flops_ += c.flops;
  }

  // Latencies and error count since the last call.
  std::pair<std::vector<double>, int64_t> TakeWindow() {
    std::lock_guard<std::mutex> lock(mu_);
    std::pair<std::vector<double>, int64_t> out{std::move(window_), window_errors_};
    window_.clear();
    window_errors_ = 0;
    return out;
  }

  Clock::time_point measure_from() const { return measure_from_; }
  int64_t measured() {
    std::lock_guard<std::mutex> lock(mu_);
    return measured_;
  }
  // Only after the run (no callbacks left).
  std::vector<double>& latencies() { return latencies_; }
  const std::vector<v1::ServerTiming>& timings() const { return timings_; }
  const std::map<grpc::StatusCode, int64_t>& errors() const { return errors_; }
  int64_t payload_bytes() const { return payload_bytes_; }
  double flops() const { return flops_; }
  Clock::time_point last_completion() const { return last_completion_; }

 private:
  const std::string name_;
  const Clock::time_point measure_from_;
  const int64_t request_bytes_;
  std::mutex mu_;
  std::set<std::pair<grpc::StatusCode, std::string>> shown_errors_;
  int64_t measured_ = 0;  // completions of measured requests, failed ones included
  std::vector<double> window_;
  int64_t window_errors_ = 0;
  std::vector<double> latencies_;
  std::vector<v1::ServerTiming> timings_;
  std::map<grpc::StatusCode, int64_t> errors_;
  int64_t payload_bytes_ = 0;
  double flops_ = 0;
  Clock::time_point last_completion_ = measure_from_;
};

// One request in flight at a time. `done` runs on a gRPC thread; `retire` says the slot cannot
// carry more requests (its stream ended).
class Slot {
 public:
  using DoneFn = std::function<void(Slot*, const Completion&, bool retire)>;
  virtual ~Slot() = default;
  virtual void Send(Clock::time_point start) = 0;
  // Ends the slot's stream, if it has one, and waits for it; no request may be in flight.
  virtual void Close() {}
};

// How to call one service: the attention service and the echo service differ only here.
template <class Req, class Resp>
struct Rpcs {
  std::function<void(grpc::ClientContext*, const Req*, Resp*, std::function<void(grpc::Status)>)>
      unary;
  std::function<void(grpc::ClientContext*, grpc::ClientBidiReactor<Req, Resp>*)> stream;
  std::function<std::unique_ptr<grpc::ClientReaderWriter<Req, Resp>>(grpc::ClientContext*)>
      sync_stream;
  // The stub's PrepareAsync call of the stream (--stream_api=poll).
  std::function<std::unique_ptr<grpc::ClientAsyncReaderWriter<Req, Resp>>(grpc::ClientContext*,
                                                                          grpc::CompletionQueue*)>
      async_stream;
  // Opens a request ring of its own on the connection the requests' regions belong to
  // (--stream_api=ring); unset for the echo service, which serves no rings.
  std::function<absl::StatusOr<std::unique_ptr<RequestRing>>()> ring;
  std::function<int64_t(const Resp&)> response_bytes;
  std::function<v1::ServerTiming(const Resp&)> timing;
  std::function<double(const Resp&)> flops;
};

// Sends `requests` in turn, one at a time (decode mode: each names its own sessions).
template <class Req, class Resp>
class UnarySlot final : public Slot {
 public:
  UnarySlot(absl::Span<const Req> requests, const Rpcs<Req, Resp>& rpcs, absl::Duration deadline,
            DoneFn done)
      : requests_(requests), rpcs_(rpcs), deadline_(deadline), done_(std::move(done)) {}

  void Send(Clock::time_point start) override {
    struct Call {
      grpc::ClientContext context;
      Resp response;
    };
    auto* call = new Call;
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + deadline_));
    const Req* request = &requests_[next_];
    next_ = (next_ + 1) % requests_.size();
    rpcs_.unary(&call->context, request, &call->response, [this, call, start](grpc::Status s) {
      std::unique_ptr<Call> owned(call);
      Completion c{start, s};
      if (s.ok()) {
        c.response_bytes = rpcs_.response_bytes(owned->response);
        c.timing = rpcs_.timing(owned->response);
        c.flops = rpcs_.flops(owned->response);
      }
      // The context holds a channel reference: it must go before `done_` lets the run end and
      // the channel's owner release it, or the channel would be destroyed on this gRPC thread.
      owned.reset();
      done_(this, c, /*retire=*/false);
    });
  }

 private:
  const absl::Span<const Req> requests_;
  size_t next_ = 0;  // Send runs only while no request of this slot is in flight
  const Rpcs<Req, Resp>& rpcs_;
  const absl::Duration deadline_;
  DoneFn done_;
};

// One AttendChunked call at a time, on a thread of its own (Client::AttendChunked blocks).
class ChunkedSlot final : public Slot {
 public:
  ChunkedSlot(const v1::AttendRequest& request, Client* client, int64_t chunk_bytes,
              absl::Duration deadline, double flops, DoneFn done)
      : request_(request),
        client_(client),
        chunk_bytes_(chunk_bytes),
        deadline_(deadline),
        flops_(flops),
        done_(std::move(done)) {}
  ~ChunkedSlot() override {
    if (thread_.joinable()) thread_.join();
  }

  void Send(Clock::time_point start) override {
    if (thread_.joinable()) thread_.join();  // the previous call is done: its `done` ran
    thread_ = std::thread([this, start] {
      absl::StatusOr<v1::AttendResponse> r =
          client_->AttendChunked(request_, chunk_bytes_, CallOptions{.deadline = deadline_});
      Completion c{start, r.ok() ? grpc::Status::OK
                                 : grpc::Status(static_cast<grpc::StatusCode>(r.status().code()),
                                                std::string(r.status().message()))};
      if (r.ok()) {
        c.response_bytes = static_cast<int64_t>(r->o().data().size() + r->lse().data().size());
        c.timing = r->timing();
        c.flops = flops_;
      }
      done_(this, c, /*retire=*/false);
    });
  }

 private:
  const v1::AttendRequest& request_;
  Client* const client_;
  const int64_t chunk_bytes_;
  const absl::Duration deadline_;
  const double flops_;
  DoneFn done_;
  std::thread thread_;
};

// A stream carrying one request at a time, `requests` in turn: write, read its response, repeat.
// The response can arrive before the write's completion; a request is done when both have come,
// since the next write may start only after the last one completed.
template <class Req, class Resp>
class StreamSlot final : public Slot, public grpc::ClientBidiReactor<Req, Resp> {
 public:
  StreamSlot(absl::Span<const Req> requests, const Rpcs<Req, Resp>& rpcs, DoneFn done)
      : requests_(requests), rpcs_(rpcs), done_(std::move(done)) {
    rpcs_.stream(&context_, this);
    this->StartCall();
  }

  void Send(Clock::time_point start) override {
    start_ = start;
    in_flight_ = true;
    pending_ = 2;
    const Req* request = &requests_[next_];
    next_ = (next_ + 1) % requests_.size();
    this->StartRead(&response_);
    this->StartWrite(request);
  }

  void Close() override {
    if (!finished_.load()) this->StartWritesDone();
    ended_.get_future().wait();
  }

 private:
  // A failed write shows as a failed read.
  void OnWriteDone(bool /*ok*/) override {
    if (--pending_ == 0) Complete();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is over; OnDone brings its status
    if (--pending_ == 0) Complete();
  }

  void Complete() {
    in_flight_ = false;
    done_(this,
          Completion{start_, grpc::Status::OK, rpcs_.response_bytes(response_),
                     rpcs_.timing(response_), rpcs_.flops(response_)},
          /*retire=*/false);
  }

  void OnDone(const grpc::Status& status) override {
    finished_ = true;
    if (in_flight_) {
      in_flight_ = false;
      done_(this,
            Completion{start_, status.ok() ? grpc::Status(grpc::StatusCode::DATA_LOSS,
                                                          "stream ended without a response")
                                           : status},
            /*retire=*/true);
    }
    ended_.set_value();
  }

  const absl::Span<const Req> requests_;
  size_t next_ = 0;  // Send runs only while no request of this slot is in flight
  const Rpcs<Req, Resp>& rpcs_;
  DoneFn done_;
  grpc::ClientContext context_;
  Resp response_;
  Clock::time_point start_;
  std::atomic<bool> in_flight_{false};  // set by Send, cleared by the callbacks
  std::atomic<int> pending_{0};         // of the write and the read of the request in flight
  std::atomic<bool> finished_{false};
  std::promise<void> ended_;
};

// A stream on gRPC's synchronous API carrying one request at a time, `requests` in turn, on a
// thread of its own: it writes the request and blocks reading its response, polling the
// connection itself, so the response reaches it with no hop between gRPC's threads (the callback
// API runs each reaction on one of gRPC's). In a closed loop (`restamp`) a request's latency
// counts from this thread's write (Completion::written): the wake-up from Send is the bench's own
// hop, which a synchronous caller does not have. Its `start` still says warmup or measured.
// `api` "sync"; "poll": the same on gRPC's async API, the thread polling its own completion queue
// instead of sleeping until the response comes (client/polled_stream.h); "ring": the same over a
// request ring (client/request_ring.h), no gRPC message per request, the thread spinning for the
// response. A ring that cannot be opened fails the slot's first request with the reason.
template <class Req, class Resp>
class SyncStreamSlot final : public Slot {
 public:
  SyncStreamSlot(absl::Span<const Req> requests, const Rpcs<Req, Resp>& rpcs, bool restamp,
                 const std::string& api, DoneFn done)
      : requests_(requests), rpcs_(rpcs), restamp_(restamp), done_(std::move(done)) {
    if (api == "ring") {
      absl::StatusOr<std::unique_ptr<RequestRing>> ring = rpcs_.ring();
      if (ring.ok()) {
        ring_ = *std::move(ring);
      } else {
        ring_error_ = grpc::Status(static_cast<grpc::StatusCode>(ring.status().code()),
                                   std::string(ring.status().message()));
      }
    } else if (api == "poll") {
      polled_ = client::PolledStream<Req, Resp>::Start(rpcs_.async_stream, &context_);
    } else {
      stream_ = rpcs_.sync_stream(&context_);
    }
    thread_ = std::thread([this] { Loop(); });
  }
  ~SyncStreamSlot() override { Close(); }

  void Send(Clock::time_point start) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      start_ = start;
      sending_ = true;
    }
    wake_.notify_one();
  }

  void Close() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    while (true) {
      Clock::time_point start;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [this] { return sending_ || closing_; });
        if (!sending_) break;
        sending_ = false;
        start = start_;
      }
      std::optional<Clock::time_point> written;
      if (restamp_) written = Clock::now();
      const Req& request = requests_[next_];
      next_ = (next_ + 1) % requests_.size();
      if (!Write(request) || !Read(&response_)) {
        const grpc::Status status = Finish();
        Completion c{start, status.ok() ? grpc::Status(grpc::StatusCode::DATA_LOSS,
                                                       "stream ended without a response")
                                        : status};
        c.written = written;
        done_(this, c, /*retire=*/true);
        return;
      }
      Completion c{start, grpc::Status::OK, rpcs_.response_bytes(response_),
                   rpcs_.timing(response_), rpcs_.flops(response_)};
      c.written = written;
      done_(this, c, /*retire=*/false);
    }
    WritesDone();
    Finish().ok();  // the server ends the stream OK once the client half-closes
  }
  bool Write(const Req& request) {
    if (!ring_error_.ok()) return false;
    if (ring_) return ring_->Write(request);
    return polled_ ? polled_->Write(request) : stream_->Write(request);
  }
  bool Read(Resp* response) {
    if (!ring_error_.ok()) return false;
    if (ring_) return ring_->Read(response);
    return polled_ ? polled_->Read(response) : stream_->Read(response);
  }
  void WritesDone() {
    if (ring_) {
      ring_->WritesDone();
    } else if (polled_) {
      polled_->WritesDone();
    } else if (stream_) {
      stream_->WritesDone();
    }
  }
  grpc::Status Finish() {
    if (!ring_error_.ok()) return ring_error_;
    if (ring_) return ring_->Finish();
    return polled_ ? polled_->Finish() : stream_->Finish();
  }

  const absl::Span<const Req> requests_;
  size_t next_ = 0;  // used by the slot's thread only
  const Rpcs<Req, Resp>& rpcs_;
  const bool restamp_;
  DoneFn done_;
  grpc::ClientContext context_;
  // The stream, on the sync API or polled, or the ring (one of the three is set, unless the ring
  // could not be opened: then ring_error_ says why).
  std::unique_ptr<grpc::ClientReaderWriter<Req, Resp>> stream_;
  std::unique_ptr<client::PolledStream<Req, Resp>> polled_;
  std::unique_ptr<RequestRing> ring_;
  grpc::Status ring_error_;
  Resp response_;
  std::mutex mu_;  // guards the three below
  std::condition_variable wake_;
  Clock::time_point start_;
  bool sending_ = false;
  bool closing_ = false;
  std::thread thread_;  // last: started once the rest is set up
};

// A stream slot on the API --stream_api chose.
template <class Req, class Resp>
std::unique_ptr<Slot> MakeStreamSlot(absl::Span<const Req> requests, const Rpcs<Req, Resp>& rpcs,
                                     const LoadSettings& load, Slot::DoneFn done) {
  if (load.stream_api != "callback") {
    return std::make_unique<SyncStreamSlot<Req, Resp>>(requests, rpcs, !load.rate.has_value(),
                                                       load.stream_api, std::move(done));
  }
  return std::make_unique<StreamSlot<Req, Resp>>(requests, rpcs, std::move(done));
}

struct PhaseResult {
  std::string name;
  int64_t ok = 0;
  double elapsed_s = 0;
  double requests_per_s = 0;
  double payload_gb_per_s = 0;
  double tflop_per_s = 0;
  int concurrency = 1;
  double p50 = 0, p90 = 0, p95 = 0, p99 = 0, p999 = 0, max = 0;  // seconds
  // p50 of each ServerTiming field over the requests: queue, h2d, compute, d2h and total (arrival
  // to response ready; p50 - total is what the transport and the client cost).
  double queue_us_p50 = 0, h2d_us_p50 = 0, compute_us_p50 = 0, d2h_us_p50 = 0, server_us_p50 = 0;
  double decode_us_p50 = 0, parse_us_p50 = 0, prepare_us_p50 = 0, run_us_p50 = 0;
  std::map<grpc::StatusCode, int64_t> errors;
  // Decode mode: session-steps and new tokens per second (Step requests carry several sessions,
  // each several tokens).
  bool decode = false;
  double steps_per_s = 0;
  double tokens_per_s = 0;
};

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t i = static_cast<size_t>(p * static_cast<double>(sorted.size() - 1) + 0.5);
  return sorted[std::min(i, sorted.size() - 1)];
}

const char* CodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < 17 ? kNames[i] : "?";
}

std::string ErrorsText(const std::map<grpc::StatusCode, int64_t>& errors) {
  if (errors.empty()) return "none";
  std::vector<std::string> parts;
  for (const auto& [code, n] : errors) parts.push_back(absl::StrCat(CodeName(code), "=", n));
  return absl::StrJoin(parts, " ");
}

// Drives `settings`' load through slots made by `make_slot` and measures it.
PhaseResult RunPhase(const std::string& name, const LoadSettings& settings, int64_t request_bytes,
                     const std::function<std::unique_ptr<Slot>(Slot::DoneFn)>& make_slot) {
  const Clock::time_point t0 = Clock::now();
  const Clock::time_point measure_from = t0 + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(settings.warmup_s));
  const Clock::time_point end =
      measure_from + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(settings.duration_s));
  Recorder recorder(name, measure_from, request_bytes);

  // A slot whose call was answered UNAVAILABLE (no server, a draining one) waits before its next
  // send, doubling from kFirstBackoff to kMaxBackoff, so a dead target is not spun on; any other
  // answer resets its wait.
  constexpr Clock::duration kFirstBackoff = std::chrono::milliseconds(10);
  constexpr Clock::duration kMaxBackoff = std::chrono::seconds(1);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<Slot*, Clock::time_point>> free_slots;  // and when each may send again
  std::map<Slot*, Clock::duration> backoff;
  int in_flight = 0;
  int live_slots = settings.concurrency;
  Slot::DoneFn done = [&](Slot* slot, const Completion& c, bool retire) {
    recorder.Add(c);
    std::lock_guard<std::mutex> lock(mu);
    --in_flight;
    Clock::duration& wait = backoff[slot];
    wait = c.status.error_code() == grpc::StatusCode::UNAVAILABLE
               ? std::clamp(2 * wait, kFirstBackoff, kMaxBackoff)
               : Clock::duration::zero();
    if (retire) {
      --live_slots;
    } else {
      free_slots.emplace_back(slot, Clock::now() + wait);
    }
    cv.notify_all();
  };
  std::vector<std::unique_ptr<Slot>> slots;
  for (int i = 0; i < settings.concurrency; ++i) {
    slots.push_back(make_slot(done));
    free_slots.emplace_back(slots.back().get(), t0);
  }

  std::atomic<bool> running{true};
  std::thread progress([&] {
    if (!settings.progress) return;
    Clock::time_point next = t0;
    while (running.load()) {
      next += std::chrono::seconds(1);
      std::this_thread::sleep_until(next);
      auto [window, errors] = recorder.TakeWindow();
      std::sort(window.begin(), window.end());
      // Time left: to the end of the duration, or the requests left at this second's rate.
      const Clock::time_point now = Clock::now();
      double eta_s = Seconds(end - now);
      if (settings.requests > 0) {
        const double left = static_cast<double>(settings.requests - recorder.measured());
        eta_s = Seconds(std::max(measure_from - now, Clock::duration::zero())) +
                (window.empty() ? std::numeric_limits<double>::infinity()
                                : left / static_cast<double>(window.size()));
      }
      std::fprintf(stderr,
                   "[%s c=%d %5.1fs%s] %6zu done/s  p50 %8.3f ms  p99 %8.3f ms  errors %lld  "
                   "eta %.0fs\n",
                   name.c_str(), settings.concurrency, Seconds(now - t0),
                   now < measure_from ? " warmup" : "", window.size(),
                   Percentile(window, 0.5) * 1e3, Percentile(window, 0.99) * 1e3,
                   static_cast<long long>(errors), std::max(eta_s, 0.0));
    }
  });

  int64_t issued_measured = 0;
  for (int64_t i = 0;; ++i) {
    Slot* slot;
    Clock::time_point ready;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !free_slots.empty() || live_slots == 0; });
      if (live_slots == 0) break;
      std::tie(slot, ready) = free_slots.front();
      free_slots.pop_front();
    }
    // A backing-off slot: the run's end stops the wait (the duration is not stretched).
    std::this_thread::sleep_until(settings.requests > 0 ? ready : std::min(ready, end));
    Clock::time_point start = Clock::now();
    if (settings.rate) {
      const Clock::time_point scheduled =
          t0 + std::chrono::duration_cast<Clock::duration>(
                   std::chrono::duration<double>(static_cast<double>(i) / *settings.rate));
      std::this_thread::sleep_until(scheduled);
      start = scheduled;
    }
    const bool stop = settings.requests > 0 ? issued_measured >= settings.requests : start >= end;
    if (stop) {
      std::lock_guard<std::mutex> lock(mu);
      free_slots.emplace_back(slot, ready);
      break;
    }
    if (start >= measure_from) ++issued_measured;
    {
      std::lock_guard<std::mutex> lock(mu);
      ++in_flight;
    }
    slot->Send(start);
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return in_flight == 0; });
  }
  running = false;
  progress.join();
  for (std::unique_ptr<Slot>& slot : slots) slot->Close();

  PhaseResult r;
  r.name = name;
  r.concurrency = settings.concurrency;
  std::vector<double>& latencies = recorder.latencies();
  std::sort(latencies.begin(), latencies.end());
  r.ok = static_cast<int64_t>(latencies.size());
  r.elapsed_s = Seconds(recorder.last_completion() - measure_from);
  if (r.elapsed_s > 0) {
    r.requests_per_s = static_cast<double>(r.ok) / r.elapsed_s;
    r.payload_gb_per_s = static_cast<double>(recorder.payload_bytes()) / r.elapsed_s / 1e9;
    r.tflop_per_s = recorder.flops() / r.elapsed_s / 1e12;
  }
  r.p50 = Percentile(latencies, 0.5);
  r.p90 = Percentile(latencies, 0.9);
  r.p95 = Percentile(latencies, 0.95);
  r.p99 = Percentile(latencies, 0.99);
  r.p999 = Percentile(latencies, 0.999);
  r.max = latencies.empty() ? 0 : latencies.back();
  auto p50 = [&](double (v1::ServerTiming::*field)() const) {
    std::vector<double> values;
    for (const v1::ServerTiming& t : recorder.timings()) values.push_back((t.*field)());
    std::sort(values.begin(), values.end());
    return Percentile(values, 0.5);
  };
  r.queue_us_p50 = p50(&v1::ServerTiming::queue_us);
  r.h2d_us_p50 = p50(&v1::ServerTiming::h2d_us);
  r.compute_us_p50 = p50(&v1::ServerTiming::compute_us);
  r.d2h_us_p50 = p50(&v1::ServerTiming::d2h_us);
  r.server_us_p50 = p50(&v1::ServerTiming::total_us);
  r.decode_us_p50 = p50(&v1::ServerTiming::decode_us);
  r.parse_us_p50 = p50(&v1::ServerTiming::parse_us);
  r.prepare_us_p50 = p50(&v1::ServerTiming::prepare_us);
  r.run_us_p50 = p50(&v1::ServerTiming::run_us);
  r.errors = recorder.errors();
  return r;
}

void PrintResult(const PhaseResult& r) {
  std::printf("%s: %lld requests in %.2f s: %.1f requests/s, %.3f GB/s payload, %.4f TFLOP/s\n",
              r.name.c_str(), static_cast<long long>(r.ok), r.elapsed_s, r.requests_per_s,
              r.payload_gb_per_s, r.tflop_per_s);
  std::printf("%s: latency ms p50 %.3f  p90 %.3f  p95 %.3f  p99 %.3f  p99.9 %.3f  max %.3f\n",
              r.name.c_str(), r.p50 * 1e3, r.p90 * 1e3, r.p95 * 1e3, r.p99 * 1e3, r.p999 * 1e3,
              r.max * 1e3);
  if (r.decode) {
    std::printf("%s: %.1f session-steps/s, %.1f tokens/s\n", r.name.c_str(), r.steps_per_s,
                r.tokens_per_s);
  }
  if (r.compute_us_p50 > 0) {
    std::printf(
        "%s: server p50 us: queue %.1f  h2d %.1f  compute %.1f  d2h %.1f  arrival to response "
        "%.1f\n",
        r.name.c_str(), r.queue_us_p50, r.h2d_us_p50, r.compute_us_p50, r.d2h_us_p50,
        r.server_us_p50);
  }
  std::printf("%s: errors %s\n", r.name.c_str(), ErrorsText(r.errors).c_str());
}

std::string ResultJson(const PhaseResult& r) {
  std::vector<std::string> errors;
  for (const auto& [code, n] : r.errors)
    errors.push_back(absl::StrCat("\"", CodeName(code), "\":", n));
  const std::string decode = r.decode
                                 ? absl::StrFormat(",\"steps_per_s\":%.6g,\"tokens_per_s\":%.6g",
                                                   r.steps_per_s, r.tokens_per_s)
                                 : "";
  return absl::StrFormat(
      "\"requests\":%d,\"elapsed_s\":%.6g,\"requests_per_s\":%.6g,\"payload_gb_per_s\":%.6g,"
      "\"tflop_per_s\":%.6g,\"p50\":%.6g,\"p90\":%.6g,\"p95\":%.6g,\"p99\":%.6g,\"p999\":%.6g,"
      "\"max\":%.6g,"
      "\"compute_us_p50\":%.6g,\"server_p50_us\":{\"queue\":%.6g,\"h2d\":%.6g,\"d2h\":%.6g,"
      "\"total\":%.6g,\"decode\":%.6g,\"parse\":%.6g,\"prepare\":%.6g,\"run\":%.6g},"
      "\"errors\":{%s}%s",
      r.ok, r.elapsed_s, r.requests_per_s, r.payload_gb_per_s, r.tflop_per_s, r.p50, r.p90, r.p95,
      r.p99, r.p999, r.max, r.compute_us_p50, r.queue_us_p50, r.h2d_us_p50, r.d2h_us_p50,
      r.server_us_p50, r.decode_us_p50, r.parse_us_p50, r.prepare_us_p50, r.run_us_p50,
      absl::StrJoin(errors, ","), decode);
}

// The run's configuration, in its JSON object: what was measured, beside the figures.
std::string ConfigJson(const ProblemSpec& spec, const LoadSettings& load) {
  return absl::StrFormat(
      "\"config\":{\"target\":\"%s\",\"echo_target\":\"%s\",\"mode\":\"%s\",\"rpc\":\"%s\","
      "\"shape\":[%d,%d,%d,%d],\"kv_heads\":%d,\"nk\":%d,\"dtype\":\"%s\",\"layout\":\"%s\","
      "\"causal\":%s,\"lse\":%s,\"concurrency\":%d,\"rate\":%s,\"duration_s\":%.6g,"
      "\"requests\":%d,\"warmup_s\":%.6g,\"connections\":%d,\"stream_api\":\"%s\"}",
      absl::GetFlag(FLAGS_target), absl::GetFlag(FLAGS_echo_target), absl::GetFlag(FLAGS_mode),
      load.rpc.c_str(), spec.batch, spec.heads_q, spec.seqlen_q, spec.head_dim, spec.heads_kv,
      spec.seqlen_k, DTypeName(spec.dtype), spec.layout == v1::LAYOUT_BSHD ? "bshd" : "bhsd",
      spec.causal ? "true" : "false", spec.return_lse ? "true" : "false", load.concurrency,
      load.rate ? absl::StrCat(*load.rate) : "null", load.duration_s, load.requests, load.warmup_s,
      load.connections, load.stream_api.c_str());
}

// The results of every run (one per --concurrency value), printed together at the end so that
// the last lines are the machine-readable ones: the CSV, then one JSON object per run.
class Outputs {
 public:
  void AddRun(const std::string& json) { json_.push_back(json); }

  void AddPhase(const PhaseResult& r, const ProblemSpec& spec, const LoadSettings& load) {
    int64_t errors = 0;
    for (const auto& [code, n] : r.errors) errors += n;
    failed_ |= errors > 0;
    csv_.push_back(absl::StrFormat(
        "%s,%s,%s,%d;%d;%d;%d,%d,%d,%s,%s,%d,%s,%d,%d,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,"
        "%.6g,%.6g,%.6g",
        absl::GetFlag(FLAGS_mode), r.name,
        absl::StrJoin(absl::StrSplit(absl::GetFlag(FLAGS_target), ','), ";"), spec.batch,
        spec.heads_q, spec.seqlen_q, spec.head_dim, spec.heads_kv, spec.seqlen_k,
        DTypeName(spec.dtype), load.rpc.c_str(), r.concurrency,
        load.rate ? absl::StrCat(*load.rate) : "", r.ok, errors, r.elapsed_s, r.requests_per_s,
        r.payload_gb_per_s, r.tflop_per_s, r.p50, r.p90, r.p95, r.p99, r.p999, r.max,
        r.compute_us_p50, r.server_us_p50));
  }

  // Prints what --csv and --json ask for; the exit status: 1 when a measured call failed.
  int Finish() const {
    if (absl::GetFlag(FLAGS_csv)) {
      std::printf(
          "mode,phase,target,shape,kv_heads,nk,dtype,rpc,concurrency,rate,requests,errors,"
          "elapsed_s,requests_per_s,payload_gb_per_s,tflop_per_s,p50,p90,p95,p99,p999,max,"
          "compute_us_p50,server_us_p50\n");
      for (const std::string& row : csv_) std::printf("%s\n", row.c_str());
    }
    if (absl::GetFlag(FLAGS_json)) {
      for (const std::string& json : json_) std::printf("%s\n", json.c_str());
    }
    std::fflush(stdout);
    if (failed_) std::fprintf(stderr, "attn_bench: some calls failed (errors above)\n");
    return failed_ ? 1 : 0;
  }

 private:
  std::vector<std::string> json_;
  std::vector<std::string> csv_;
  bool failed_ = false;
};

// Attention FLOPs of one request: 4 * D per (query, visible key) pair (QKᵀ and PV), per head.
double AttentionFlops(const ProblemSpec& spec) {
  double pairs = 0;
  for (int64_t i = 0; i < spec.seqlen_q; ++i) {
    const int64_t visible =
        spec.causal ? std::clamp<int64_t>(i + spec.seqlen_k - spec.seqlen_q + 1, 0, spec.seqlen_k)
                    : spec.seqlen_k;
    pairs += static_cast<double>(visible);
  }
  return 4.0 * static_cast<double>(spec.head_dim * spec.batch * spec.heads_q) * pairs;
}

absl::StatusOr<ProblemSpec> SpecFromFlags() {
  ProblemSpec spec;
  const Shape shape = absl::GetFlag(FLAGS_shape);
  spec.batch = shape.batch;
  spec.heads_q = shape.heads;
  spec.seqlen_q = shape.seqlen;
  spec.head_dim = shape.head_dim;
  spec.heads_kv = absl::GetFlag(FLAGS_kv_heads).value_or(spec.heads_q);
  spec.seqlen_k = absl::GetFlag(FLAGS_nk).value_or(spec.seqlen_q);
  if (absl::Status s = CheckKvFlags(spec); !s.ok()) return s;
  absl::StatusOr<v1::DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return dtype.status();
  spec.dtype = *dtype;
  const std::string layout = absl::GetFlag(FLAGS_layout);
  if (layout != "bhsd" && layout != "bshd") {
    return absl::InvalidArgumentError("--layout must be bhsd or bshd");
  }
  spec.layout = layout == "bshd" ? v1::LAYOUT_BSHD : v1::LAYOUT_BHSD;
  spec.causal = absl::GetFlag(FLAGS_causal);
  spec.return_lse = absl::GetFlag(FLAGS_lse);
  return spec;
}

// --shm: a POSIX shared-memory object of `bytes`, registered as "attn-bench" over `client`'s
// channel (a region belongs to the connection that registered it, so requests must use it too).
struct BenchRegion {
  std::unique_ptr<SharedMemoryObject> object;
  std::unique_ptr<SharedMemoryClient> regions;
};
absl::StatusOr<BenchRegion> MakeBenchRegion(const Client& client, int64_t bytes) {
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(absl::StrCat("/attn-bench-", getpid()), bytes);
  if (!object.ok()) return object.status();
  BenchRegion r{*std::move(object), std::make_unique<SharedMemoryClient>(client)};
  if (absl::StatusOr<v1::RegionInfo> info = r.regions->Register("attn-bench", *r.object);
      !info.ok()) {
    return info.status();
  }
  return r;
}

// --stream_api=ring: the slot size for requests of `request_bytes` serialized bytes and responses
// of at most `response_bytes` besides their timing, request id and device: the larger, plus 4 KiB
// for those and the slot's length word, rounded up to the ring's alignment. INVALID_ARGUMENT over
// the ring's largest slot.
absl::StatusOr<int64_t> RingSlotBytes(int64_t request_bytes, int64_t response_bytes) {
  const int64_t need = std::max(request_bytes, response_bytes) + 4096;
  const int64_t bytes = (need + ring::kAlignment - 1) / ring::kAlignment * ring::kAlignment;
  if (bytes > ring::kMaxSlotBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--stream_api=ring: requests of ", request_bytes,
        " serialized bytes and responses of up to ", response_bytes, " need ring slots of ", bytes,
        " bytes, expected at most ", ring::kMaxSlotBytes,
        ": send the tensors by reference (--shm) or a smaller --shape"));
  }
  return std::max(bytes, ring::kMinSlotBytes);
}

// --stream_api=ring: opens a ring over `client` and closes it, so that a server that serves none
// (no --allow_shared_memory, too many rings) is reported before the run rather than as each slot's
// failure in the warmup, which the results do not count.
absl::Status CheckRing(const Client& client, v1::RingMethod method) {
  absl::StatusOr<std::unique_ptr<RequestRing>> ring = RequestRing::Open(
      client, method,
      {.slots = 1, .slot_bytes = ring::kMinSlotBytes, .region = "attn-bench-ring-check"});
  if (!ring.ok()) return ring.status();
  return ToAbslStatus((*ring)->Finish());
}

// Decode mode (see the file comment): `spec` gives the sessions' shape (Hkv, D, dtype, layout of
// their first rows), their first length (seqlen_k), the sessions per Step (batch), the query
// heads and the new tokens per session per step (seqlen_q).
int RunDecode(const ProblemSpec& spec, LoadSettings load, absl::Span<const int> concurrencies,
              const ClientOptions& options) {
  const int64_t per_step = spec.batch;
  const int max_concurrency = *std::max_element(concurrencies.begin(), concurrencies.end());
  const int64_t session_count = absl::GetFlag(FLAGS_sessions) > 0 ? absl::GetFlag(FLAGS_sessions)
                                                                  : per_step * max_concurrency;
  if (session_count < per_step * max_concurrency) {
    std::fprintf(stderr,
                 "attn_bench: decode needs --sessions >= B * --concurrency (each Step in flight "
                 "has sessions of its own)\n");
    return 2;
  }
  const bool append = absl::GetFlag(FLAGS_append_kv);
  std::mt19937_64 rng(std::random_device{}());
  auto random_tensor = [&](const std::vector<int64_t>& shape) {
    return MakeTensor(spec.dtype, shape, RandomNormal(NumElements(shape), rng));
  };

  // Every session starts from the same random rows: k, v [Hkv, Nk, D] (or [Nk, Hkv, D]).
  const SessionSpec session_spec{spec.dtype, spec.heads_kv, spec.head_dim, spec.layout};
  const std::vector<int64_t> context_shape =
      spec.layout == v1::LAYOUT_BSHD
          ? std::vector<int64_t>{spec.seqlen_k, spec.heads_kv, spec.head_dim}
          : std::vector<int64_t>{spec.heads_kv, spec.seqlen_k, spec.head_dim};
  const v1::Tensor context_k = random_tensor(context_shape);
  const v1::Tensor context_v = random_tensor(context_shape);
  Client client(options);
  if (load.stream_api == "ring") {
    if (absl::Status s = CheckRing(client, v1::RING_METHOD_STEP); !s.ok()) {
      std::fprintf(stderr, "attn_bench: --stream_api=ring: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  SessionClient session_client(client);
  std::vector<Session> sessions;
  sessions.reserve(session_count);
  const Clock::time_point create_start = Clock::now();
  for (int64_t i = 0; i < session_count; ++i) {
    absl::StatusOr<Session> session = session_client.Create(session_spec, &context_k, &context_v);
    if (!session.ok()) {
      std::fprintf(stderr, "attn_bench: creating session %lld: %s\n", static_cast<long long>(i),
                   session.status().ToString().c_str());
      return 1;  // the sessions made so far are dropped by their destructors
    }
    sessions.push_back(*std::move(session));
  }
  std::printf("attn_bench: created %lld sessions of %lld rows (%.2f MiB of K/V each) in %.2f s\n",
              static_cast<long long>(session_count), static_cast<long long>(spec.seqlen_k),
              static_cast<double>(2 * context_k.data().size()) / (1 << 20),
              Seconds(Clock::now() - create_start));

  // Each entry's q [Hq, N, D] and, with --append_kv, new rows k, v [Hkv, N, D].
  const v1::Tensor q = random_tensor({spec.heads_q, spec.seqlen_q, spec.head_dim});
  const v1::Tensor new_k = random_tensor({spec.heads_kv, spec.seqlen_q, spec.head_dim});
  const v1::Tensor new_v = random_tensor({spec.heads_kv, spec.seqlen_q, spec.head_dim});
  // --shm: q, new_k and new_v once in a shared-memory object that every entry refers to, then one
  // o place per (slot, entry): o place i * B + t for entry t of slot i's Steps, which the slot
  // sends one at a time. o is shaped and typed like q (sessions hold no float8).
  BenchRegion region;
  v1::Tensor q_in, new_k_in, new_v_in;  // the entries' tensors: by reference, or the bytes
  const int64_t o_bytes = static_cast<int64_t>(q.data().size());
  int64_t o_base = 0;
  if (absl::GetFlag(FLAGS_shm)) {
    const int64_t q_bytes = o_bytes, kv_bytes = static_cast<int64_t>(new_k.data().size());
    o_base = q_bytes + 2 * kv_bytes;
    absl::StatusOr<BenchRegion> made =
        MakeBenchRegion(client, o_base + max_concurrency * per_step * o_bytes);
    if (!made.ok()) {
      std::fprintf(stderr, "attn_bench: --shm: %s\n", made.status().ToString().c_str());
      return 1;
    }
    region = *std::move(made);
    char* base = region.object->data();
    PlaceTensor(q, "attn-bench", 0, base, &q_in);
    PlaceTensor(new_k, "attn-bench", q_bytes, base, &new_k_in);
    PlaceTensor(new_v, "attn-bench", q_bytes + kv_bytes, base, &new_v_in);
  } else {
    q_in = q;
    new_k_in = new_k;
    new_v_in = new_v;
  }
  Rpcs<v1::StepRequest, v1::StepResponse> rpcs;
  rpcs.unary = [&](grpc::ClientContext* c, const v1::StepRequest* request,
                   v1::StepResponse* response, std::function<void(grpc::Status)> f) {
    session_client.stub().async()->Step(c, request, response, std::move(f));
  };
  rpcs.stream = [&](grpc::ClientContext* c,
                    grpc::ClientBidiReactor<v1::StepRequest, v1::StepResponse>* r) {
    session_client.stub().async()->StepStream(c, r);
  };
  rpcs.sync_stream = [&](grpc::ClientContext* c) { return session_client.stub().StepStream(c); };
  rpcs.async_stream = [&](grpc::ClientContext* c, grpc::CompletionQueue* cq) {
    return session_client.stub().PrepareAsyncStepStream(c, cq);
  };
  // One Step in flight per slot: a ring of one slot each way, over the connection of the sessions'
  // client, which registered --shm's region. ring_slot_bytes is set per run, from its requests.
  int64_t ring_slot_bytes = 0;
  int rings_opened = 0;
  rpcs.ring = [&] {
    return RequestRing::Open(client, v1::RING_METHOD_STEP,
                             {.slots = 1,
                              .slot_bytes = ring_slot_bytes,
                              .region = absl::StrCat("attn-bench-ring-", rings_opened++)});
  };
  rpcs.response_bytes = [](const v1::StepResponse& r) {
    int64_t bytes = 0;
    for (const v1::StepResult& result : r.results()) {
      bytes += static_cast<int64_t>(result.o().data().size() + result.lse().data().size());
    }
    return bytes;
  };
  rpcs.timing = [](const v1::StepResponse& r) { return r.timing(); };
  // Each session's N queries over its length after the step.
  rpcs.flops = [&spec](const v1::StepResponse& r) {
    double flops = 0;
    for (const v1::StepResult& result : r.results()) {
      ProblemSpec one = spec;
      one.batch = 1;
      one.seqlen_k = result.length();
      flops += AttentionFlops(one);
    }
    return flops;
  };

  Outputs outputs;
  for (const int concurrency : concurrencies) {
    load.concurrency = concurrency;
    // Slot i steps its own sessions, a run of consecutive ones (at least B: --sessions >= B *
    // concurrency), B at a time, in turn. The server places each new session on the device with
    // the most free pages, so consecutive sessions alternate over equal devices and each Step
    // spans all of them.
    std::vector<std::vector<v1::StepRequest>> slot_requests(load.concurrency);
    for (int i = 0; i < load.concurrency; ++i) {
      std::vector<const Session*> own;
      for (int64_t j = i * session_count / load.concurrency;
           j < (i + 1) * session_count / load.concurrency; ++j) {
        own.push_back(&sessions[j]);
      }
      const int64_t owned = static_cast<int64_t>(own.size());
      for (int64_t r = 0; r < owned / std::gcd(owned, per_step); ++r) {
        v1::StepRequest& request = slot_requests[i].emplace_back();
        for (int64_t t = 0; t < per_step; ++t) {
          v1::StepEntry* entry = request.add_entries();
          entry->set_session_id(own[(r * per_step + t) % owned]->id());
          *entry->mutable_q() = q_in;
          if (append) {
            *entry->mutable_k() = new_k_in;
            *entry->mutable_v() = new_v_in;
          }
          if (region.object != nullptr) {
            *entry->mutable_o_ref() =
                MakeRef("attn-bench", o_base + (i * per_step + t) * o_bytes, o_bytes);
          }
        }
        request.set_causal(spec.causal);
        request.set_return_lse(spec.return_lse);
      }
    }
    const int64_t request_bytes =
        per_step * static_cast<int64_t>(q.data().size() +
                                        (append ? new_k.data().size() + new_v.data().size() : 0));
    if (load.stream_api == "ring") {
      // Each result's o (unless written into the region), lse ([Hq, N] float32), and 256 bytes
      // for its session id, length and the tensors' shapes.
      const int64_t result_bytes = (region.object != nullptr ? 0 : o_bytes) +
                                   (spec.return_lse ? spec.heads_q * spec.seqlen_q * 4 : 0) + 256;
      size_t largest = 0;
      for (const std::vector<v1::StepRequest>& requests : slot_requests) {
        for (const v1::StepRequest& request : requests) {
          largest = std::max(largest, request.ByteSizeLong());
        }
      }
      absl::StatusOr<int64_t> slot_bytes =
          RingSlotBytes(static_cast<int64_t>(largest), per_step * result_bytes);
      if (!slot_bytes.ok()) {
        std::fprintf(stderr, "attn_bench: %s\n",
                     std::string(slot_bytes.status().message()).c_str());
        return 2;
      }
      ring_slot_bytes = *slot_bytes;
    }
    std::printf(
        "attn_bench: decode, %lld sessions, %lld per Step, Hq=%lld Hkv=%lld D=%lld %s, "
        "%lld new tokens per session-step%s%s, concurrency %d, %s, request payload %.2f "
        "KiB%s\n",
        static_cast<long long>(session_count), static_cast<long long>(per_step),
        static_cast<long long>(spec.heads_q), static_cast<long long>(spec.heads_kv),
        static_cast<long long>(spec.head_dim), DTypeName(spec.dtype),
        static_cast<long long>(spec.seqlen_q), append ? " (K/V appended)" : "",
        spec.causal ? ", causal" : "", load.concurrency,
        load.rate ? absl::StrCat("rate ", *load.rate, "/s").c_str() : "closed loop",
        static_cast<double>(request_bytes) / 1024,
        region.object != nullptr ? " (in shared memory)" : "");

    int next_slot = 0;
    PhaseResult result =
        RunPhase("decode", load, request_bytes, [&](Slot::DoneFn done) -> std::unique_ptr<Slot> {
          absl::Span<const v1::StepRequest> requests = slot_requests[next_slot++];
          if (load.stream) {
            return MakeStreamSlot(requests, rpcs, load, std::move(done));
          }
          return std::make_unique<UnarySlot<v1::StepRequest, v1::StepResponse>>(
              requests, rpcs, load.deadline, std::move(done));
        });
    result.decode = true;
    result.steps_per_s = result.requests_per_s * static_cast<double>(per_step);
    result.tokens_per_s = result.steps_per_s * static_cast<double>(spec.seqlen_q);
    PrintResult(result);
    outputs.AddPhase(result, spec, load);
    outputs.AddRun(absl::StrCat("{", ResultJson(result), ",", ConfigJson(spec, load), "}"));
  }

  int64_t drop_errors = 0;
  for (Session& session : sessions) drop_errors += session.Drop().ok() ? 0 : 1;
  std::printf("attn_bench: dropped %lld sessions, %lld failed\n",
              static_cast<long long>(session_count), static_cast<long long>(drop_errors));
  if (region.regions != nullptr) region.regions->Unregister("attn-bench").IgnoreError();
  return outputs.Finish();
}

int Main() {
  absl::StatusOr<ProblemSpec> spec = SpecFromFlags();
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const std::string rpc = absl::GetFlag(FLAGS_rpc);
  LoadSettings load;
  std::vector<int> concurrencies;
  for (const std::string& value : absl::GetFlag(FLAGS_concurrency)) {
    int c = 0;
    concurrencies.push_back(absl::SimpleAtoi(value, &c) ? c : 0);
  }
  load.rate = absl::GetFlag(FLAGS_rate);
  load.duration_s = absl::GetFlag(FLAGS_duration_s);
  load.requests = absl::GetFlag(FLAGS_requests);
  load.warmup_s = absl::GetFlag(FLAGS_warmup_s);
  load.stream = rpc == "stream";
  const std::string stream_api = absl::GetFlag(FLAGS_stream_api);
  load.stream_api = stream_api;
  load.rpc = rpc;
  load.connections = absl::GetFlag(FLAGS_connections);
  load.deadline = absl::Seconds(absl::GetFlag(FLAGS_deadline_s));
  load.progress = absl::GetFlag(FLAGS_progress);
  const int connections = absl::GetFlag(FLAGS_connections);
  const int64_t chunk_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_chunk_mb) * (1 << 20));
  if (connections < 1 || chunk_bytes < 1) {
    std::fprintf(stderr, "attn_bench: --connections and --chunk_mb must be > 0\n");
    return 2;
  }
  if (stream_api != "callback" && stream_api != "sync" && stream_api != "poll" &&
      stream_api != "ring") {
    std::fprintf(stderr, "attn_bench: --stream_api must be callback, sync, poll or ring, got %s\n",
                 stream_api.c_str());
    return 2;
  }
  if (stream_api == "ring" && rpc != "stream") {
    std::fprintf(stderr, "attn_bench: --stream_api=ring needs --rpc=stream, got --rpc=%s\n",
                 rpc.c_str());
    return 2;
  }
  if (stream_api == "ring" &&
      (absl::GetFlag(FLAGS_echo) || !absl::GetFlag(FLAGS_echo_target).empty())) {
    std::fprintf(stderr,
                 "attn_bench: --stream_api=ring needs the attention service (the echo server "
                 "serves no rings): no --echo or --echo_target\n");
    return 2;
  }
  if (mode == "decode" && (rpc == "chunked" || connections != 1)) {
    std::fprintf(stderr,
                 "attn_bench: --mode=decode takes --rpc unary or stream on one connection\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_shm) && (connections != 1 || rpc == "chunked")) {
    // Regions belong to the connection that registered them; chunked calls carry bytes.
    std::fprintf(stderr, "attn_bench: --shm needs --connections=1 and --rpc unary or stream\n");
    return 2;
  }
  if (!spec.ok() || (rpc != "unary" && rpc != "stream" && rpc != "chunked") ||
      (mode != "attend" && mode != "decode") || concurrencies.empty() ||
      *std::min_element(concurrencies.begin(), concurrencies.end()) < 1 ||
      (load.rate && *load.rate <= 0)) {
    std::fprintf(stderr, "attn_bench: %s\n",
                 !spec.ok() ? std::string(spec.status().message()).c_str()
                            : "--rpc must be unary, stream or chunked, --mode attend or decode, "
                              "--concurrency integers >= 1, --rate > 0");
    return 2;
  }
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.deadline = load.deadline;
  options.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (max_message_mb < 1 || max_message_mb > 2047) {
    std::fprintf(stderr, "attn_bench: --max_message_mb: expected 1..2047, got %d\n",
                 max_message_mb);
    return 2;
  }
  options.max_message_bytes = max_message_mb << 20;
  if (mode == "decode") return RunDecode(*spec, load, concurrencies, options);

  std::mt19937_64 rng(std::random_device{}());
  absl::StatusOr<v1::AttendRequest> request = MakeRandomRequest(*spec, rng);
  if (!request.ok()) {
    std::fprintf(stderr, "attn_bench: %s\n", std::string(request.status().message()).c_str());
    return 2;
  }
  const int64_t request_bytes = static_cast<int64_t>(
      request->q().data().size() + request->k().data().size() + request->v().data().size());
  const double flops = AttentionFlops(*spec);
  std::printf("attn_bench: %s, %s, concurrency %s, %s, request payload %.2f MiB\n",
              DescribeProblem(*spec).c_str(), rpc.c_str(),
              absl::StrJoin(concurrencies, ",").c_str(),
              load.rate ? absl::StrCat("rate ", *load.rate, "/s").c_str() : "closed loop",
              static_cast<double>(request_bytes) / (1 << 20));

  // The echo service, fed the same bytes.
  bench::EchoRequest echo_request;
  echo_request.set_q(request->q().data());
  echo_request.set_k(request->k().data());
  echo_request.set_v(request->v().data());
  Rpcs<bench::EchoRequest, bench::EchoReply> echo_rpcs;
  std::unique_ptr<bench::Echo::Stub> echo_stub;

  auto channel_for = [&](const std::string& target) {
    options.target = target;
    grpc::ChannelArguments args = MakeChannelArguments(options);
    // A connection of its own: channels with equal arguments would share one subchannel.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(ChannelTarget(target), grpc::InsecureChannelCredentials(),
                                     args);
  };
  // --connections channels to the attention target; slot i uses channel i % connections.
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<Rpcs<v1::AttendRequest, v1::AttendResponse>> per_connection(connections);
  std::vector<std::unique_ptr<v1::Attention::Stub>> stubs;
  int next_connection = 0;
  auto attention_slot = [&](Slot::DoneFn done) -> std::unique_ptr<Slot> {
    const int c = next_connection++ % connections;
    if (rpc == "chunked") {
      return std::make_unique<ChunkedSlot>(*request, clients[c].get(), chunk_bytes, load.deadline,
                                           flops, std::move(done));
    }
    if (load.stream) {
      return MakeStreamSlot(absl::MakeConstSpan(&*request, 1), per_connection[c], load,
                            std::move(done));
    }
    return std::make_unique<UnarySlot<v1::AttendRequest, v1::AttendResponse>>(
        absl::MakeConstSpan(&*request, 1), per_connection[c], load.deadline, std::move(done));
  };
  auto echo_slot = [&](Slot::DoneFn done) -> std::unique_ptr<Slot> {
    if (load.stream) {
      return MakeStreamSlot(absl::MakeConstSpan(&echo_request, 1), echo_rpcs, load,
                            std::move(done));
    }
    return std::make_unique<UnarySlot<bench::EchoRequest, bench::EchoReply>>(
        absl::MakeConstSpan(&echo_request, 1), echo_rpcs, load.deadline, std::move(done));
  };

  const bool echo_only = absl::GetFlag(FLAGS_echo);
  const std::string echo_target =
      echo_only ? absl::GetFlag(FLAGS_target) : absl::GetFlag(FLAGS_echo_target);
  if (!echo_target.empty()) {
    echo_stub = bench::Echo::NewStub(channel_for(echo_target));
    echo_rpcs.unary = [&](grpc::ClientContext* c, const bench::EchoRequest* q, bench::EchoReply* r,
                          std::function<void(grpc::Status)> f) {
      echo_stub->async()->Echo(c, q, r, std::move(f));
    };
    echo_rpcs.stream = [&](grpc::ClientContext* c,
                           grpc::ClientBidiReactor<bench::EchoRequest, bench::EchoReply>* r) {
      echo_stub->async()->EchoStream(c, r);
    };
    echo_rpcs.sync_stream = [&](grpc::ClientContext* c) { return echo_stub->EchoStream(c); };
    echo_rpcs.async_stream = [&](grpc::ClientContext* c, grpc::CompletionQueue* cq) {
      return echo_stub->PrepareAsyncEchoStream(c, cq);
    };
    echo_rpcs.response_bytes = [](const bench::EchoReply& r) {
      return static_cast<int64_t>(r.o().size());
    };
    echo_rpcs.timing = [](const bench::EchoReply&) { return v1::ServerTiming(); };
    // The attention the same bytes would ask for, so both phases report comparable TFLOP/s.
    echo_rpcs.flops = [flops](const bench::EchoReply&) { return flops; };
  }

  // --shm: the tensors go into a shared-memory object registered over the attention channel (the
  // only one: regions belong to the connection), and the request refers to them; o is written
  // there.
  BenchRegion region;
  int64_t o_in_region = 0;
  // --stream_api=ring: each slot's ring, one request in flight, on its connection's Client (the
  // one that registered --shm's region); its slot size once the request is final.
  int64_t ring_slot_bytes = 0;
  int rings_opened = 0;
  if (!echo_only) {
    for (int i = 0; i < connections; ++i) {
      std::shared_ptr<grpc::Channel> channel = channel_for(absl::GetFlag(FLAGS_target));
      clients.push_back(std::make_unique<Client>(channel, options));
      v1::Attention::Stub* stub = stubs.emplace_back(v1::Attention::NewStub(channel)).get();
      Rpcs<v1::AttendRequest, v1::AttendResponse>& r = per_connection[i];
      // Sent from the request's own bytes (EncodeInPlace: no serialization copy of the tensors)
      // through the generic stub; the response parsed by protobuf.
      auto generic = std::make_shared<grpc::GenericStub>(channel);
      r.unary = [generic](grpc::ClientContext* c, const v1::AttendRequest* q, v1::AttendResponse* a,
                          std::function<void(grpc::Status)> f) {
        struct Buffers {
          grpc::ByteBuffer out, in;
        };
        auto buffers = std::make_shared<Buffers>();
        buffers->out = EncodeInPlace(*q);
        generic->UnaryCall(
            c, "/attention.v1.Attention/Attend", {}, &buffers->out, &buffers->in,
            [buffers, a, f = std::move(f)](grpc::Status s) {
              if (s.ok() &&
                  !grpc::SerializationTraits<v1::AttendResponse>::Deserialize(&buffers->in, a)
                       .ok()) {
                s = grpc::Status(grpc::StatusCode::INTERNAL, "the response does not parse");
              }
              f(std::move(s));
            });
      };
      r.stream = [stub](grpc::ClientContext* c,
                        grpc::ClientBidiReactor<v1::AttendRequest, v1::AttendResponse>* a) {
        stub->async()->AttendStream(c, a);
      };
      r.sync_stream = [stub](grpc::ClientContext* c) { return stub->AttendStream(c); };
      r.async_stream = [stub](grpc::ClientContext* c, grpc::CompletionQueue* cq) {
        return stub->PrepareAsyncAttendStream(c, cq);
      };
      r.ring = [client = clients.back().get(), &ring_slot_bytes, &rings_opened] {
        return RequestRing::Open(*client, v1::RING_METHOD_ATTEND,
                                 {.slots = 1,
                                  .slot_bytes = ring_slot_bytes,
                                  .region = absl::StrCat("attn-bench-ring-", rings_opened++)});
      };
      r.response_bytes = [](const v1::AttendResponse& a) {
        return static_cast<int64_t>(a.o().data().size() + a.lse().data().size());
      };
      r.timing = [](const v1::AttendResponse& a) { return a.timing(); };
      r.flops = [flops](const v1::AttendResponse&) { return flops; };
    }
    if (absl::GetFlag(FLAGS_shm)) {
      o_in_region = static_cast<int64_t>(request->q().data().size());
      absl::StatusOr<BenchRegion> made = MakeBenchRegion(*clients[0], request_bytes + o_in_region);
      if (!made.ok()) {
        std::fprintf(stderr, "attn_bench: --shm: %s\n", made.status().ToString().c_str());
        return 1;
      }
      region = *std::move(made);
      // q, k, v one after another, then o.
      int64_t at = 0;
      for (v1::Tensor* t : {request->mutable_q(), request->mutable_k(), request->mutable_v()}) {
        const int64_t bytes = static_cast<int64_t>(t->data().size());
        PlaceTensor(v1::Tensor(*t), "attn-bench", at, region.object->data(), t);
        at += bytes;
      }
      *request->mutable_o_ref() = MakeRef("attn-bench", at, o_in_region);
    }
    if (stream_api == "ring") {
      // o (unless written into the region) in q's dtype (bfloat16 for float8) and lse, float32.
      const int64_t rows = spec->batch * spec->heads_q * spec->seqlen_q;
      const int64_t o_bytes =
          region.object != nullptr
              ? 0
              : rows * spec->head_dim *
                    (spec->dtype == v1::DTYPE_FLOAT8_E4M3 ? 2 : DTypeBytes(spec->dtype));
      absl::StatusOr<int64_t> slot_bytes =
          RingSlotBytes(static_cast<int64_t>(request->ByteSizeLong()),
                        o_bytes + (spec->return_lse ? rows * 4 : 0));
      if (!slot_bytes.ok()) {
        std::fprintf(stderr, "attn_bench: %s\n",
                     std::string(slot_bytes.status().message()).c_str());
        return 2;
      }
      ring_slot_bytes = *slot_bytes;
      if (absl::Status s = CheckRing(*clients[0], v1::RING_METHOD_ATTEND); !s.ok()) {
        std::fprintf(stderr, "attn_bench: --stream_api=ring: %s\n", s.ToString().c_str());
        return 1;
      }
    }
  }

  Outputs outputs;
  for (const int concurrency : concurrencies) {
    load.concurrency = concurrency;
    std::vector<PhaseResult> results;
    if (!echo_only) results.push_back(RunPhase("attention", load, request_bytes, attention_slot));
    if (!echo_target.empty()) results.push_back(RunPhase("echo", load, request_bytes, echo_slot));
    for (const PhaseResult& r : results) {
      PrintResult(r);
      outputs.AddPhase(r, *spec, load);
    }

    std::string json;
    if (results.size() == 2) {
      const PhaseResult& a = results[0];
      const PhaseResult& e = results[1];
      const double ratio = e.payload_gb_per_s > 0 ? a.payload_gb_per_s / e.payload_gb_per_s : 0;
      std::printf(
          "attention/echo: payload GB/s ratio %.3f, p50 - echo p50 = %.1f us "
          "(server compute p50 %.1f us)\n",
          ratio, (a.p50 - e.p50) * 1e6, a.compute_us_p50);
      json = absl::StrCat(
          "{", ResultJson(a), ",\"echo\":{", ResultJson(e),
          absl::StrFormat("},\"payload_ratio_vs_echo\":%.6g,\"p50_minus_echo_s\":%.6g}", ratio,
                          a.p50 - e.p50));
    } else {
      json = absl::StrCat("{", ResultJson(results[0]), "}");
    }
    json.insert(json.size() - 1, absl::StrCat(",", ConfigJson(*spec, load)));
    outputs.AddRun(json);
  }
  if (region.regions != nullptr) region.regions->Unregister("attn-bench").IgnoreError();
  return outputs.Finish();
}

}  // namespace
}  // namespace attention::client

int main(int argc, char** argv) {
  // As attention_server (server/main.cc says why): the client's side of every call takes gRPC's
  // locks too.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  attention::client::ParseToolFlags(
      argc, argv,
      "attn_bench --target=HOST:PORT[,HOST:PORT...] [--concurrency=N] [--rate=R] "
      "[--duration_s=S | --requests=N] [--shape=B,H,N,D] [--rpc=unary|stream] "
      "[--stream_api=callback|sync|poll|ring] "
      "[--echo | --echo_target=HOST:PORT] [--json]\n"
      "attn_bench --mode=decode --sessions=S --nk=CONTEXT --shape=SESSIONS_PER_STEP,H,NEW_TOKENS,D "
      "[--kv_heads=HKV] [--causal] ...",
      __FILE__);
  return attention::client::Main();
}
