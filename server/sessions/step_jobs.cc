#include "server/sessions/step_jobs.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace attention::server {

std::string StepWork::QueriesField(int seq) const {
  return absl::StrCat("entries[", seq, "].q.shape[1] (queries)");
}

StepJobs::StepJobs(SessionStore* store, const Options& options, Observer observe)
    : store_(store), options_(options), observe_(std::move(observe)) {}

std::vector<Job> StepJobs::Jobs(const std::shared_ptr<StepWork>& step, absl::Time deadline,
                                const std::function<bool()>& cancelled) const {
  std::vector<StepWork::Group>& groups = step->groups_;
  for (int i = 0; i < static_cast<int>(step->seqs.size()); ++i) {
    const StepSequence& seq = step->seqs[i];
    auto group = std::find_if(groups.begin(), groups.end(), [&](const StepWork::Group& g) {
      return g.device == seq.device && g.key == seq.key;
    });
    if (group == groups.end()) {
      groups.push_back(StepWork::Group{.device = seq.device, .key = seq.key});
      group = groups.end() - 1;
    }
    group->seqs.push_back(i);
  }
  step->pending_ = static_cast<int>(groups.size());
  std::vector<Job> jobs;
  jobs.reserve(groups.size());
  for (StepWork::Group& group : groups) {
    Job job;
    job.device = group.device;
    job.sessions.reserve(group.seqs.size());
    for (int i : group.seqs) job.sessions.push_back(step->seqs[i].session_id);
    job.keeps = step;  // what the ids view
    job.work = DecodeWork{.key = group.key,
                          .prepare = [this, step, &group] { return Prepare(*step, group); }};
    job.deadline = deadline;
    job.cancelled = [cancelled] { return cancelled(); };
    job.done = [this, step, &group](JobResult result) { Answered(*step, group, result); };
    jobs.push_back(std::move(job));
  }
  return jobs;
}

absl::StatusOr<std::vector<DecodeSequence>> StepJobs::Prepare(StepWork& step,
                                                              StepWork::Group& group) const {
  std::vector<absl::string_view> ids;
  ids.reserve(group.seqs.size());
  for (int i : group.seqs) ids.push_back(step.seqs[i].session_id);
  absl::StatusOr<std::vector<SessionStore::Lease>> acquired = store_->Acquire(step.owner, ids);
  if (!acquired.ok() && step.groups_.size() > 1 &&
      absl::StartsWith(acquired.status().message(), kSealedMarker)) {
    // Clients retry a sealed refusal as a whole, but the Step's other jobs (other devices or
    // shapes) may have appended their rows already: a retry would append them twice. Not
    // retryable, then, and said so.
    return absl::AbortedError(absl::StrCat(
        acquired.status().message().substr(kSealedMarker.size()), "; this Step's ",
        step.groups_.size(),
        " launches (its sessions on other devices or of other shapes) may have appended their "
        "rows: not to be retried as it was"));
  }
  ASSIGN_OR_RETURN(std::vector<SessionStore::Lease> leases, std::move(acquired));
  const size_t n = group.seqs.size();
  std::vector<SessionStore::Lease*> held;
  std::vector<int64_t> new_rows;
  std::vector<KvRows> rows;
  held.reserve(n);
  new_rows.reserve(n);
  rows.reserve(n);
  group.launched.reserve(n);
  double flops = 0;
  for (size_t s = 0; s < group.seqs.size(); ++s) {
    const StepSequence& seq = step.seqs[group.seqs[s]];
    const int64_t length = leases[s].length();
    RETURN_IF_ERROR(CheckQueriesFit([&] { return step.QueriesField(group.seqs[s]); }, seq.rows_q,
                                    seq.rows.rows, length));
    flops += DecodeFlops(group.key, {.length = length + seq.rows.rows, .rows_q = seq.rows_q});
    held.push_back(&leases[s]);
    new_rows.push_back(seq.rows.rows);
    rows.push_back(seq.rows);
    rows.back().memory = group.key.memory;  // where the step's tensors are: its key says
  }
  if (options_.max_request_flops > 0 && flops > options_.max_request_flops) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "step needs ", absl::SixDigits(flops), " FLOPs on ", store_->device_name(group.device),
        ", over the limit of ", absl::SixDigits(options_.max_request_flops),
        " per request (--max_request_flops); nothing was appended"));
  }
  RETURN_IF_ERROR(store_->Reserve(held, new_rows));
  RETURN_IF_ERROR(store_->Append(held, rows));
  for (size_t s = 0; s < group.seqs.size(); ++s) {
    StepSequence& seq = step.seqs[group.seqs[s]];
    SessionStore::Lease& lease = leases[s];
    RETURN_IF_ERROR(store_->NameTokens(lease, seq.tokens));
    seq.length = lease.length();
    group.launched.push_back(DecodeSequence{.pages = lease.page_table(),
                                            .length = lease.length(),
                                            .q = seq.q,
                                            .rows_q = seq.rows_q,
                                            .o = seq.o,
                                            .lse = seq.lse});
  }
  group.leases = std::move(leases);
  return group.launched;
}

void StepJobs::Answered(StepWork& step, StepWork::Group& group, const JobResult& result) const {
  store_->Release(absl::MakeSpan(group.leases));  // first: the sessions' next calls may run
  group.leases.clear();
  if (result.status.ok() && observe_) {
    double flops = 0;
    int64_t tokens = 0;
    for (const DecodeSequence& seq : group.launched) {
      flops += DecodeFlops(group.key, seq);
      tokens += seq.rows_q;
    }
    observe_(result, flops, tokens);
  }
  StepOutcome outcome;
  {
    std::lock_guard<std::mutex> lock(step.mu_);
    StepOutcome& o = step.outcome_;
    if (!result.status.ok() && o.status.ok()) o.status = result.status;
    o.stages.h2d_us += result.stages.h2d_us;
    o.stages.compute_us += result.stages.compute_us;
    o.stages.d2h_us += result.stages.d2h_us;
    o.stages.prepare_us += result.stages.prepare_us;
    o.stages.run_us += result.stages.run_us;
    o.queued = std::max(o.queued, result.queued);
    if (result.device != nullptr &&
        std::find(o.devices.begin(), o.devices.end(), result.device->name) == o.devices.end()) {
      o.devices.push_back(result.device->name);
    }
    if (--step.pending_ > 0) return;
    outcome = std::move(o);
  }
  step.Finished(std::move(outcome));
}

}  // namespace attention::server
