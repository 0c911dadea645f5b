#include "coordinator/server/prometheus_observer.h"

#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>

namespace vp::server {

void PrometheusObserver::OnJobState(const vocabpipe::v1::Job& job) {
  if (auto st = exporter_->SetJobState(job.id(), JobStateName(job.state())); !st.ok()) {
    std::cerr << "vocabpipe-coordinator: metrics: " << st.message() << std::endl;
  }
  const int replicas = std::max(1, job.spec().parallel().data());
  if (auto st = exporter_->SetJobReplicas(
          job.id(), replicas, job.requested_data() > 0 ? job.requested_data() : replicas);
      !st.ok()) {
    std::cerr << "vocabpipe-coordinator: metrics: " << st.message() << std::endl;
  }
  // Pruning: a finished job's series stay until keep_finished_ newer jobs have finished.
  if (IsTerminal(job.state()) &&
      std::find(finished_.begin(), finished_.end(), job.id()) == finished_.end()) {
    finished_.push_back(job.id());
    while (static_cast<int>(finished_.size()) > keep_finished_) {
      exporter_->RemoveJob(finished_.front());
      finished_.pop_front();
    }
  }
}

void PrometheusObserver::OnStep(const vocabpipe::v1::Job& job,
                                const vocabpipe::v1::StepMetrics& m) {
  // The step's metrics.jsonl line (proto/runlog): per-stage passes, comm and memory too.
  nlohmann::json step = nlohmann::json::parse(m.line_json(), nullptr, false);
  if (step.is_discarded()) {
    std::cerr << "vocabpipe-coordinator: metrics: step " << m.step() << " has no line" << std::endl;
    return;
  }
  if (auto st = exporter_->RecordStep(job.id(), job.plan().schedule(), job.plan().vocab(), step);
      !st.ok()) {
    std::cerr << "vocabpipe-coordinator: metrics: " << st.message() << std::endl;
  }
}

void PrometheusObserver::OnWorkers(int idle, int busy) {
  exporter_->SetWorkerCount("idle", idle);
  exporter_->SetWorkerCount("busy", busy);
}

}  // namespace vp::server
