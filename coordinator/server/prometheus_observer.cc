#include "coordinator/server/prometheus_observer.h"

#include <iostream>
#include <nlohmann/json.hpp>

namespace vp::server {

void PrometheusObserver::OnJobState(const vocabpipe::v1::Job& job) {
  if (auto st = exporter_->SetJobState(job.id(), JobStateName(job.state())); !st.ok()) {
    std::cerr << "vocabpipe-coordinator: metrics: " << st.message() << std::endl;
  }
}

void PrometheusObserver::OnStep(const vocabpipe::v1::Job& job,
                                const vocabpipe::v1::StepMetrics& m) {
  // The merged step in the launcher's metrics.jsonl vocabulary (what RecordStep reads).
  nlohmann::json stages = nlohmann::json::array();
  int64_t peak = 0;
  for (const vocabpipe::v1::StageStats& s : m.stages()) {
    stages.push_back({{"rank", s.rank()},
                      {"busy_seconds", s.busy_seconds()},
                      {"memory", {{"total", s.peak_memory_bytes()}}}});
    peak = std::max(peak, s.peak_memory_bytes());
  }
  nlohmann::json step = {{"step", m.step()},
                         {"step_seconds", m.seconds()},
                         {"lr", m.lr()},
                         {"grad_norm", m.grad_norm()},
                         {"tokens_per_s", m.tokens_per_second()},
                         {"mfu", m.mfu()},
                         {"peak_memory_bytes", peak},
                         {"stages", stages}};
  if (m.has_loss()) step["loss"] = m.loss();
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
