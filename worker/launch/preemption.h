// Graceful preemption (SIGTERM from Kubernetes eviction or Slurm): the ranks of a job agree on
// one step after which every rank saves an emergency checkpoint and stops, so the restart
// resumes from it instead of the last periodic checkpoint.
//
// Only the signalled rank knows about the signal, and the ranks are never more than one step
// apart (every step needs every rank), so the agreement goes through the rendezvous store:
//   1. a rank whose SIGTERM flag is set writes <prefix>request at its next step boundary;
//      the others look for it at most every `poll` (one cheap store call, not one per step);
//   2. a rank that has seen it writes <prefix>ack/<rank> = the steps it has done, and from
//      then on reads the acks at every boundary;
//   3. once all `world` acks are there, the stop step is max(ack) + 1, the same on every rank.
// No rank can be past it when it learns it: a rank reading the acks for the first time at
// boundary d did not see the last ack at d - 1, and it could not finish step d - 1 before the
// last rank started it, which that rank does only after writing its ack (>= d - 1).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

namespace vp::launch {

// A rank's exit code after it saved an emergency checkpoint and stopped (EX_TEMPFAIL): the
// daemon reports a preemption, the direct launcher names the step to resume from.
inline constexpr int kPreemptedExitCode = 75;

class PreemptionAgreement {
 public:
  // `prefix`: the attempt's key prefix (the keys of one attempt only); `signalled`: set by the
  // process's SIGTERM handler (may be null: this rank is never the one signalled).
  PreemptionAgreement(gloo::rendezvous::Store& store, std::string prefix, int rank, int world,
                      const std::atomic<bool>* signalled,
                      absl::Duration poll = absl::Milliseconds(250));

  // Called at the boundary after `done` steps. True: every rank stops after this step (save,
  // then exit). Errors: the store failed, or (a broken invariant) the agreed step is behind.
  absl::StatusOr<bool> StopAfter(int64_t done);
  // The agreed stop step, -1 until every rank has acknowledged.
  int64_t stop_step() const { return stop_; }

 private:
  bool Present(const std::vector<std::string>& keys);

  gloo::rendezvous::Store& store_;
  const std::string prefix_;
  const int rank_, world_;
  const std::atomic<bool>* signalled_;
  const absl::Duration poll_;
  absl::Time next_poll_ = absl::InfinitePast();
  bool acked_ = false;
  int64_t stop_ = -1;
};

}  // namespace vp::launch
