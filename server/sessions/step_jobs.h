// A Step's work on its sessions as scheduler jobs, apart from any wire format: the service
// decodes a request into StepSequences (one per sequence: its session, its new K/V rows, its
// queries and where its o and lse go) and hands them on; this groups them by device and decode
// key (one decode job per group, which the scheduler may run in one launch with other Steps'
// jobs), and on the worker each job holds its sessions (leases), checks that every sequence's
// queries fit its session, the FLOP limit, reserves and appends the new rows (all or nothing for
// the job) and gives the launch its sequences. The last job to finish ends the step.
//
// Any kind of Step request reuses it: the unary Step and StepStream's messages today (each entry
// a sequence), a whole layer's batch as packed tensors next (each sequence's q, o and lse then
// point into the packed tensors). A caller derives its per-call state from StepWork, so that the
// step's state and the caller's are one allocation.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/paged_kv.h"
#include "server/scheduling/scheduler.h"
#include "server/sessions/session_store.h"
#include "server/sessions/step_plan.h"

namespace attention::server {

// One sequence of a step. Pointers are host memory valid until the step has Finished, or device
// memory of the session's GPU when key.memory says so (the job appends `rows` with it).
struct StepSequence {
  // The store's id of its session (of its layer): a string the StepWork keeps (its jobs view it
  // until they are destroyed, after the step has Finished).
  absl::string_view session_id;
  int device = 0;  // the session's (SessionStore::Locate)
  DecodeKey key;   // its shape is the session's
  KvRows rows;     // appended before the queries attend
  // The token id of each appended row (StepEntry.tokens), or none: named to the store
  // (SessionStore::NameTokens), so its full pages are cached as shared prefixes.
  absl::Span<const int64_t> tokens;
  const void* q = nullptr;  // [Hq, Nq, D] of the key's dtype
  int64_t rows_q = 0;       // Nq: the session's last Nq positions
  void* o = nullptr;        // [Hq, Nq, D], written by the launch
  float* lse = nullptr;     // [Hq, Nq] float32 when key.lse
  // Set by the job before its launch: the session's rows after the append.
  int64_t length = 0;
};

// How a step ended, once its last job has finished.
struct StepOutcome {
  absl::Status status;               // the first job's failure
  StageTimes stages;                 // summed over the jobs
  absl::Duration queued;             // the longest any job waited
  std::vector<std::string> devices;  // each device it ran on, once
};

// One step's state, shared by its jobs. Fill `owner` and `seqs`, then StepJobs::Jobs.
class StepWork {
 public:
  virtual ~StepWork() = default;

  std::string owner;  // the caller's owner key (SessionStore)
  std::vector<StepSequence> seqs;

  // Runs once, on the worker that finished the last job, every lease of the step released.
  virtual void Finished(StepOutcome outcome) = 0;
  // The field of sequence `seq`'s queries, naming it in a refusal: a Step's entries by default
  // ("entries[2].q.shape[1] (queries)"); a request of another form names its own.
  virtual std::string QueriesField(int seq) const;

 private:
  friend class StepJobs;
  // The sequences of one device and decode key: one decode job.
  struct Group {
    int device = 0;
    DecodeKey key;
    std::vector<int> seqs;  // indices into `seqs`
    // From the job's prepare to its answer: the sessions held and the sequences launched.
    std::vector<SessionStore::Lease> leases;
    std::vector<DecodeSequence> launched;
  };
  std::vector<Group> groups_;
  std::mutex mu_;  // guards the two below
  int pending_ = 0;
  StepOutcome outcome_;
};

class StepJobs {
 public:
  struct Options {
    // Work one step may ask for on one device, FLOPs; 0 = no limit.
    double max_request_flops = 0;
  };
  // Told of each decode job that ran: its result, FLOPs and query tokens (the metrics).
  using Observer = std::function<void(const JobResult& result, double flops, int64_t tokens)>;

  // `store` must outlive this and every job it makes.
  StepJobs(SessionStore* store, const Options& options, Observer observe);

  // The jobs of `step` (its sequences grouped; `deadline` and `cancelled` the call's), to be
  // submitted together (Scheduler::SubmitAll: a step runs whole or not at all). Each holds `step`
  // until it is answered; the last answered calls step->Finished.
  std::vector<Job> Jobs(const std::shared_ptr<StepWork>& step, absl::Time deadline,
                        const std::function<bool()>& cancelled) const;

 private:
  // On the worker: the group's leases, checks, reserve and append; the launch's sequences.
  absl::StatusOr<std::vector<DecodeSequence>> Prepare(StepWork& step, StepWork::Group& group) const;
  void Answered(StepWork& step, StepWork::Group& group, const JobResult& result) const;

  SessionStore* const store_;
  const Options options_;
  const Observer observe_;
};

}  // namespace attention::server
