// A request that keeps one CPU worker busy for a set time, and the wait until the server runs it:
// tests that need requests queued behind a running one (deadlines, a full queue, shutdown) build
// on these rather than on a fixed "slow" shape, whose time changes with the build and the kernel.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "client/attention_client.h"

namespace attention::e2e {

// The blocker: q, k, v [1, 16, seqlen, 64] float32 with seqlen in [512, 4096]. Its float64
// reference costs the client more than the server's run, so tests check only its answer's size
// (ExpectBlockerAnswered); correctness is other tests' subject.
struct Blocker {
  v1::AttendRequest request;
  int64_t seqlen = 0;
  double flops = 0;  // 4 * 16 * 64 * seqlen^2
  // How long it should keep the worker busy at the calibrated speed: less than asked for when
  // seqlen hit its ceiling (a GPU computes the largest blocker in milliseconds).
  absl::Duration busy;
};

// A blocker that keeps one CPU worker busy for about `busy` whatever the build (a sanitizer slows
// the kernel up to fifty-fold, a loaded machine more): `client`'s server first answers a
// calibration request, q, k, v [1, 4, 1024, 16] (0.27 GFLOP), and the blocker is sized from the
// speed it measured. Tests whose point needs the queue held check `busy` and skip where the
// backend is too fast for any blocker (WhyTooFast).
absl::StatusOr<Blocker> CalibratedBlocker(client::Client& client, absl::Duration busy,
                                          std::mt19937_64& rng);

// Why `blocker` cannot hold its worker for `needed` (empty when it can): tests that need the
// queue held that long skip with this message.
std::string WhyTooFast(const Blocker& blocker, absl::Duration needed);

// Expects `response` to be the blocker's answer: OK, its request_id, an o as large as its q.
void ExpectBlockerAnswered(const Blocker& blocker,
                           const absl::StatusOr<v1::AttendResponse>& response);

// Waits until a device runs a batch (attention_device_running_batches >= 1), so that requests
// sent from now on queue behind it; false after 30 s. (A request counted in flight may still be
// decoding: a small one sent then can overtake a large one.)
bool WaitUntilRunning(int metrics_port);

}  // namespace attention::e2e
