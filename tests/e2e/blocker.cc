#include "tests/e2e/blocker.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/request_builder.h"
#include "gtest/gtest.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::e2e {

absl::StatusOr<Blocker> CalibratedBlocker(client::Client& client, absl::Duration busy,
                                          std::mt19937_64& rng) {
  constexpr int64_t kCalibrationN = 1024;
  absl::StatusOr<v1::AttendRequest> calibration =
      client::MakeRandomRequest({.batch = 1,
                                 .heads_q = 4,
                                 .heads_kv = 4,
                                 .seqlen_q = kCalibrationN,
                                 .seqlen_k = kCalibrationN,
                                 .head_dim = 16},
                                rng);
  if (!calibration.ok()) return calibration.status();
  absl::StatusOr<v1::AttendResponse> calibrated = client.Attend(*calibration);
  if (!calibrated.ok()) return calibrated.status();
  const double flops_per_us = 4.0 * 4 * 16 * kCalibrationN * kCalibrationN /
                              std::max(1.0, calibrated->timing().compute_us());
  const double flops_per_token_pair = 4.0 * 16 * 64;
  Blocker blocker;
  blocker.seqlen =
      std::clamp<int64_t>(static_cast<int64_t>(std::sqrt(absl::ToDoubleMicroseconds(busy) *
                                                         flops_per_us / flops_per_token_pair)),
                          512, 4096);
  blocker.flops = flops_per_token_pair * static_cast<double>(blocker.seqlen * blocker.seqlen);
  blocker.busy = absl::Microseconds(blocker.flops / flops_per_us);
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest({.batch = 1,
                                                                         .heads_q = 16,
                                                                         .heads_kv = 16,
                                                                         .seqlen_q = blocker.seqlen,
                                                                         .seqlen_k = blocker.seqlen,
                                                                         .head_dim = 64},
                                                                        rng);
  if (!request.ok()) return request.status();
  blocker.request = *std::move(request);
  return blocker;
}

std::string WhyTooFast(const Blocker& blocker, absl::Duration needed) {
  if (blocker.busy >= needed) return "";
  return absl::StrCat("the backend computes the largest blocker in ",
                      absl::FormatDuration(blocker.busy), ", too fast to hold the queue for ",
                      absl::FormatDuration(needed));
}

void ExpectBlockerAnswered(const Blocker& blocker,
                           const absl::StatusOr<v1::AttendResponse>& response) {
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->request_id(), blocker.request.request_id());
  EXPECT_EQ(response->o().data().size(), blocker.request.q().data().size());
}

bool WaitUntilRunning(int metrics_port) {
  return WaitForMetric(metrics_port, "attention_device_running_batches", {},
                       [](double v) { return v >= 1; }) >= 1;
}

}  // namespace attention::e2e
