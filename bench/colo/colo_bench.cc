// colo_bench: Attend for a client on the server's host, with its tensors in shared memory
// (attention.v1.SharedMemory), beside the anchor measured in the same process. One JSON line per
// run on stdout.
//
//   colo_bench --target=127.0.0.1:50051 --mode=bound|shm|ipc [--shape=4,16,4096,128]
//       [--dtype=bfloat16] [--clients=1] [--iters=20] [--warmup=3] [--rpc=unary|stream|ring]
//
// bound: the copies a GPU must make for such a request at best, timed with CUDA events on pinned
//   buffers of this process: H2D of q, k, v and D2H of o (the table adds the server's kernel).
// shm:   each of --clients threads (one connection each) places q, k, v in a POSIX shared-memory
//   object of its own, registers it, and sends Attend calls by reference with o written into the
//   object, one call in flight per client; end-to-end latency, requests/s, the server's stage
//   times and the share of the wall time the kernel ran (sum of compute_us / wall).
// ipc:   the same, each client's q, k, v and o in a cudaMalloc of its own, registered by its
//   cudaIpcMemHandle_t: the tensors stay on the GPU. A step that fails (no GPU, an IPC handle the
//   sandbox refuses) prints {"mode": ..., "error": "<the exact error>"} and exits 0, so a script
//   goes on.
// shm and ipc with --clients=N > 1 print as mode shm_xN and ipc_xN.
// --rpc: shm and ipc calls as unary Attend (the client library's, default), as messages of one
//   AttendStream per client, one in flight, the thread polling the stream's completion queue
//   (client/polled_stream.h), or as requests on a request ring per client (OpenRing,
//   client/request_ring.h), one in flight, registered over the client's connection beside its
//   tensors' region: no gRPC message per request, the request copied into a shared-memory slot
//   and the thread spinning for the response in another.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/attention_client.h"
#include "client/cuda_region.h"
#include "client/polled_stream.h"
#include "client/request_builder.h"
#include "client/request_ring.h"
#include "client/shared_memory.h"
#include "client/tensors.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "attention_server address");
ABSL_FLAG(std::string, mode, "shm", "bound | shm | ipc");
ABSL_FLAG(std::string, shape, "4,16,4096,128", "B,H,N,D of q, k, v (BHSD)");
ABSL_FLAG(std::string, dtype, "bfloat16", "float32 | float16 | bfloat16");
ABSL_FLAG(int, clients, 1,
          "shm and ipc: clients sending at once, each with its own connection and region");
ABSL_FLAG(int, iters, 20, "measured calls per client");
ABSL_FLAG(int, warmup, 3, "calls per client before measuring");
ABSL_FLAG(bool, causal, false, "causal mask");
ABSL_FLAG(std::string, rpc, "unary",
          "shm and ipc: unary Attend calls, stream (one polled AttendStream per client) or ring "
          "(one request ring per client)");

namespace attention::bench {
namespace {

using client::Client;
using Clock = std::chrono::steady_clock;

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += (c == '\n') ? ' ' : c;
  }
  return out;
}

int Fail(const std::string& mode, const std::string& error) {
  std::printf("{\"mode\":\"%s\",\"error\":\"%s\"}\n", mode.c_str(), Escape(error).c_str());
  return 0;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Problem {
  std::vector<int64_t> shape;
  v1::DType dtype;
  int64_t bytes = 0;  // of one tensor (q, k, v and o are all the same size)
};

// q's random bytes (k and v take the same: values do not change the time).
std::string RandomBytes(const Problem& p) {
  std::mt19937_64 rng(1);
  const int64_t n = client::NumElements(p.shape);
  return client::MakeTensor(p.dtype, p.shape, client::RandomNormal(n, rng)).data();
}

// The Attend request over region `region`: q, k, v at 0, 1, 2 tensor sizes, o at 3.
v1::AttendRequest RequestByReference(const Problem& p, const std::string& region) {
  v1::AttendRequest r;
  for (auto [t, i] : {std::pair{r.mutable_q(), 0}, {r.mutable_k(), 1}, {r.mutable_v(), 2}}) {
    t->set_dtype(p.dtype);
    for (int64_t s : p.shape) t->add_shape(s);
    *t->mutable_ref() = client::MakeRef(region, i * p.bytes, p.bytes);
  }
  *r.mutable_o_ref() = client::MakeRef(region, 3 * p.bytes, p.bytes);
  r.set_causal(absl::GetFlag(FLAGS_causal));
  return r;
}

struct Samples {
  std::vector<double> e2e_ms, compute_us, h2d_us, d2h_us, queue_us, total_us;
  void Add(const Samples& o) {
    for (auto [a, b] : {std::pair{&e2e_ms, &o.e2e_ms},
                        {&compute_us, &o.compute_us},
                        {&h2d_us, &o.h2d_us},
                        {&d2h_us, &o.d2h_us},
                        {&queue_us, &o.queue_us},
                        {&total_us, &o.total_us}}) {
      a->insert(a->end(), b->begin(), b->end());
    }
  }
};

// The error of a stream or ring (`what`) that ended with `status` while a request waited for its
// answer: an OK end is one without the answer.
absl::Status Ended(const std::string& what, const grpc::Status& status) {
  if (status.ok()) return absl::DataLossError(absl::StrCat(what, " ended without a response"));
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, " ended: ", status.error_message()));
}

// Sends warmup + iters calls of `request` one at a time (--rpc: unary calls, messages of one
// stream or requests on one ring); the measured ones into `out`.
absl::Status Drive(Client& client, const v1::AttendRequest& request, Samples* out) {
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  using Stream = client::PolledStream<v1::AttendRequest, v1::AttendResponse>;
  std::unique_ptr<v1::Attention::Stub> stub;
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<client::RequestRing> request_ring;
  const std::string rpc = absl::GetFlag(FLAGS_rpc);
  if (rpc == "stream") {
    stub = v1::Attention::NewStub(client.channel());
    context = client.NewContext({});
    stream = Stream::Start(
        [&](grpc::ClientContext* c, grpc::CompletionQueue* cq) {
          return stub->PrepareAsyncAttendStream(c, cq);
        },
        context.get());
  } else if (rpc == "ring") {
    // One request in flight: one slot each way. A request by reference and its response (o
    // written into the region) are a few hundred bytes: the smallest slot holds them.
    absl::StatusOr<std::unique_ptr<client::RequestRing>> opened = client::RequestRing::Open(
        client, v1::RING_METHOD_ATTEND,
        {.slots = 1, .slot_bytes = ring::kMinSlotBytes, .region = "colo-ring"});
    if (!opened.ok()) return opened.status();
    request_ring = *std::move(opened);
  }
  // One call: unary, or a request out on the stream or ring and its answer in.
  auto call = [&]() -> absl::StatusOr<v1::AttendResponse> {
    v1::AttendResponse response;
    if (stream != nullptr) {
      if (stream->Write(request) && stream->Read(&response)) return response;
      return Ended("AttendStream", stream->Finish());
    }
    if (request_ring != nullptr) {
      if (request_ring->Write(request) && request_ring->Read(&response)) return response;
      return Ended("the request ring", request_ring->Finish());
    }
    return client.Attend(request);
  };
  for (int i = 0; i < warmup + iters; ++i) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<v1::AttendResponse> r = call();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (!r.ok()) return r.status();
    if (i < warmup) continue;
    out->e2e_ms.push_back(ms);
    out->compute_us.push_back(r->timing().compute_us());
    out->h2d_us.push_back(r->timing().h2d_us());
    out->d2h_us.push_back(r->timing().d2h_us());
    out->queue_us.push_back(r->timing().queue_us());
    out->total_us.push_back(r->timing().total_us());
  }
  if (stream != nullptr) {
    stream->WritesDone();
    if (const grpc::Status status = stream->Finish(); !status.ok()) {
      return Ended("AttendStream", status);
    }
  }
  if (request_ring != nullptr) {
    if (const grpc::Status status = request_ring->Finish(); !status.ok()) {
      return Ended("the request ring", status);
    }
  }
  return absl::OkStatus();
}

void Print(const std::string& mode, int clients, const Samples& s, double wall_s, bool pinned) {
  double compute_sum = 0;
  for (double c : s.compute_us) compute_sum += c;
  std::printf(
      "{\"mode\":\"%s\",\"rpc\":\"%s\",\"clients\":%d,\"requests\":%zu,\"wall_s\":%.6g,"
      "\"requests_per_s\":%.6g,\"p50_ms\":%.6g,\"compute_us_p50\":%.6g,"
      "\"h2d_us_p50\":%.6g,\"d2h_us_p50\":%.6g,"
      "\"queue_us_p50\":%.6g,\"server_total_us_p50\":%.6g,\"kernel_busy\":%.6g,\"pinned\":%s}\n",
      mode.c_str(), absl::GetFlag(FLAGS_rpc).c_str(), clients, s.e2e_ms.size(), wall_s,
      s.e2e_ms.size() / wall_s, Median(s.e2e_ms), Median(s.compute_us), Median(s.h2d_us),
      Median(s.d2h_us), Median(s.queue_us), Median(s.total_us), compute_sum * 1e-6 / wall_s,
      pinned ? "true" : "false");
}

client::ClientOptions Options() {
  client::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  o.deadline = absl::Seconds(120);
  return o;
}

// A client on a connection of its own (regions belong to the connection).
std::unique_ptr<Client> OwnConnection() {
  client::ClientOptions o = Options();
  grpc::ChannelArguments args = client::MakeChannelArguments(o);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return std::make_unique<Client>(
      grpc::CreateCustomChannel(o.target, grpc::InsecureChannelCredentials(), args), o);
}

int RunBound(const Problem& p) {
  const int iters = absl::GetFlag(FLAGS_iters);
  void *host = nullptr, *dev = nullptr;
  cudaEvent_t a, b, c;
  cudaError_t err = cudaHostAlloc(&host, 4 * p.bytes, cudaHostAllocPortable);
  if (err == cudaSuccess) err = cudaMalloc(&dev, 4 * p.bytes);
  if (err == cudaSuccess) err = cudaEventCreate(&a);
  if (err == cudaSuccess) err = cudaEventCreate(&b);
  if (err == cudaSuccess) err = cudaEventCreate(&c);
  if (err != cudaSuccess)
    return Fail("bound",
                absl::StrCat("CUDA: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  std::memset(host, 1, 4 * p.bytes);
  std::vector<double> h2d, d2h;
  for (int i = 0; i < iters + 2; ++i) {
    cudaEventRecord(a);
    cudaMemcpyAsync(dev, host, 3 * p.bytes, cudaMemcpyHostToDevice);
    cudaEventRecord(b);
    cudaMemcpyAsync(static_cast<char*>(host) + 3 * p.bytes, static_cast<char*>(dev) + 3 * p.bytes,
                    p.bytes, cudaMemcpyDeviceToHost);
    cudaEventRecord(c);
    cudaEventSynchronize(c);
    float in_ms = 0, out_ms = 0;
    cudaEventElapsedTime(&in_ms, a, b);
    cudaEventElapsedTime(&out_ms, b, c);
    if (i >= 2) {
      h2d.push_back(in_ms * 1e3);
      d2h.push_back(out_ms * 1e3);
    }
  }
  std::printf(
      "{\"mode\":\"bound\",\"in_bytes\":%lld,\"out_bytes\":%lld,\"h2d_us_p50\":%.6g,"
      "\"d2h_us_p50\":%.6g,\"h2d_gb_per_s\":%.6g}\n",
      static_cast<long long>(3 * p.bytes), static_cast<long long>(p.bytes), Median(h2d),
      Median(d2h), 3 * p.bytes / Median(h2d) * 1e-3);
  cudaFreeHost(host);
  cudaFree(dev);
  return 0;
}

// --mode as printed: "<mode>_xN" for N clients at once.
std::string ModeName(const std::string& mode) {
  const int clients = absl::GetFlag(FLAGS_clients);
  return clients > 1 ? absl::StrCat(mode, "_x", clients) : mode;
}

// One client of a shm or ipc run: a connection of its own (regions belong to the connection)
// with its region registered, its request by reference into that region, and what it measured.
struct RegionClient {
  std::unique_ptr<Client> client;
  std::unique_ptr<client::SharedMemoryClient> regions;
  std::string region;
  v1::AttendRequest request;
  bool pinned = false;
  Samples samples;
  absl::Status status;
};

// Connects `c` and registers its region as `name` through `register_region`.
absl::Status Connect(
    const Problem& p, const std::string& name,
    const std::function<absl::StatusOr<v1::RegionInfo>(client::SharedMemoryClient&)>&
        register_region,
    RegionClient& c) {
  c.client = OwnConnection();
  c.regions = std::make_unique<client::SharedMemoryClient>(*c.client);
  absl::StatusOr<v1::RegionInfo> info = register_region(*c.regions);
  if (!info.ok()) return info.status();
  c.region = name;
  c.pinned = info->pinned();
  c.request = RequestByReference(p, name);
  return absl::OkStatus();
}

// Drives all clients at once, a thread each, unregisters their regions and prints their merged
// samples as `mode`.
int DriveAll(const std::string& mode, std::vector<RegionClient>& all) {
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> threads;
  for (RegionClient& c : all) {
    threads.emplace_back([&c] { c.status = Drive(*c.client, c.request, &c.samples); });
  }
  for (std::thread& t : threads) t.join();
  // Wall time of the measured part, roughly: the warmup calls are taken off pro rata.
  const double total_s = std::chrono::duration<double>(Clock::now() - start).count();
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  const double wall_s = total_s * iters / (warmup + iters);
  for (RegionClient& c : all) c.regions->Unregister(c.region).IgnoreError();
  Samples merged;
  bool pinned = true;
  for (const RegionClient& c : all) {
    if (!c.status.ok()) return Fail(mode, absl::StrCat("Attend: ", c.status.ToString()));
    merged.Add(c.samples);
    pinned = pinned && c.pinned;
  }
  Print(mode, static_cast<int>(all.size()), merged, wall_s, pinned);
  return 0;
}

int RunShm(const Problem& p) {
  const std::string mode = ModeName("shm");
  const std::string data = RandomBytes(p);
  std::vector<std::unique_ptr<client::SharedMemoryObject>> objects;
  std::vector<RegionClient> all(absl::GetFlag(FLAGS_clients));
  for (size_t i = 0; i < all.size(); ++i) {
    absl::StatusOr<std::unique_ptr<client::SharedMemoryObject>> object =
        client::SharedMemoryObject::Create(absl::StrCat("/colo-bench-", getpid(), "-", i),
                                           4 * p.bytes);
    if (!object.ok()) return Fail(mode, object.status().ToString());
    client::SharedMemoryObject& o = *objects.emplace_back(*std::move(object));
    for (int t = 0; t < 3; ++t) std::memcpy(o.data() + t * p.bytes, data.data(), p.bytes);
    const std::string name = absl::StrCat("colo", i);
    if (absl::Status s = Connect(
            p, name, [&](client::SharedMemoryClient& regions) { return regions.Register(name, o); },
            all[i]);
        !s.ok()) {
      return Fail(mode, absl::StrCat("Register: ", s.ToString()));
    }
  }
  return DriveAll(mode, all);
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};

int RunIpc(const Problem& p) {
  const std::string mode = ModeName("ipc");
  const std::string data = RandomBytes(p);
  // Before `all`: freed once the clients' connections (and so their regions) are gone.
  std::vector<std::unique_ptr<void, CudaFree>> allocations;
  std::vector<RegionClient> all(absl::GetFlag(FLAGS_clients));
  for (size_t i = 0; i < all.size(); ++i) {
    void* dev = nullptr;
    cudaError_t err = cudaMalloc(&dev, 4 * p.bytes);
    allocations.emplace_back(dev);
    for (int t = 0; t < 3 && err == cudaSuccess; ++t) {
      err = cudaMemcpy(static_cast<char*>(dev) + t * p.bytes, data.data(), p.bytes,
                       cudaMemcpyHostToDevice);
    }
    if (err != cudaSuccess) {
      return Fail(mode, absl::StrCat("client CUDA: ", cudaGetErrorName(err), ": ",
                                     cudaGetErrorString(err)));
    }
    const std::string name = absl::StrCat("colo-ipc", i);
    if (absl::Status s = Connect(
            p, name,
            [&](client::SharedMemoryClient& regions) {
              return client::RegisterCudaAllocation(regions, name, dev, 4 * p.bytes);
            },
            all[i]);
        !s.ok()) {
      return Fail(mode, absl::StrCat("Register: ", s.ToString()));
    }
  }
  return DriveAll(mode, all);
}

int Main() {
  Problem p;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_shape), ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) {
      std::fprintf(stderr, "colo_bench: --shape: expected B,H,N,D\n");
      return 2;
    }
    p.shape.push_back(v);
  }
  absl::StatusOr<v1::DType> dtype = client::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (p.shape.size() != 4 || !dtype.ok()) {
    std::fprintf(stderr, "colo_bench: --shape B,H,N,D and --dtype float32|float16|bfloat16\n");
    return 2;
  }
  p.dtype = *dtype;
  p.bytes = client::NumElements(p.shape) * client::DTypeBytes(p.dtype);
  if (const std::string rpc = absl::GetFlag(FLAGS_rpc);
      rpc != "unary" && rpc != "stream" && rpc != "ring") {
    std::fprintf(stderr, "colo_bench: --rpc: expected unary, stream or ring, got %s\n",
                 rpc.c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_clients) < 1) {
    std::fprintf(stderr, "colo_bench: --clients: expected at least 1\n");
    return 2;
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "bound") return RunBound(p);
  if (mode == "shm") return RunShm(p);
  if (mode == "ipc") return RunIpc(p);
  std::fprintf(stderr, "colo_bench: --mode: expected bound, shm or ipc\n");
  return 2;
}

}  // namespace
}  // namespace attention::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attention::bench::Main();
}
