// Elastic replicas (train.elastic): how many data-parallel replicas an elastic job runs at,
// given the free workers. The global batch is the invariant: the user asked for D replicas of
// M microbatches, so every shape the job runs at is d' replicas of D·M/d' microbatches (a whole
// number), and the samples each step reads, the loss scaling and the summed gradients are the
// same at every d' (docs/operations.md, "Elastic replicas").
//
// Rules (ChooseReplicas):
//   1. enough free workers for D replicas: D (never more than the user asked for);
//   2. otherwise, while shrinking is not allowed yet (the job never lost a worker, or its lost
//      worker's grace has not run out): wait;
//   3. otherwise d' = the most replicas the free workers hold, below D; if D·M does not split
//      over d' it waits (a smaller d' would keep the batch too, but would leave workers idle
//      that the job was promised — it waits for them instead, and says why).
// Pure: no I/O, unit-tested (replica_choice_test).
#pragma once

#include <string>

namespace vp::server {

struct ReplicaChoice {
  int data = 0;           // replicas to run at; 0: wait
  std::string wait = "";  // with data 0, why (empty: the ordinary wait for workers, nothing to add)
};

// `requested_data` D ≥ 1 and `requested_microbatches` M ≥ 1: the job's shape at submit;
// `ranks_per_replica`: p·t; `free_workers`: free workers of the job's device kind;
// `may_shrink`: rule 2 is over; `device`: named in the wait text.
ReplicaChoice ChooseReplicas(int requested_data, int requested_microbatches, int ranks_per_replica,
                             int free_workers, bool may_shrink, const std::string& device);

// "1 replica (m 8)", "2 replicas (m 4)": a shape in the job's events.
std::string ReplicaShape(int data, int microbatches);

}  // namespace vp::server
