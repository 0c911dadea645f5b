// The coordinator's Prometheus exposition: a CoordinatorObserver feeding
// vp::metrics::MetricsExporter (coordinator/metrics/metrics.h) with job states, merged steps
// and worker counts. Built only when the vp_metrics library is part of the tree.
#pragma once

#include <deque>
#include <memory>
#include <string>

#include "coordinator/metrics/metrics.h"
#include "coordinator/server/coordinator.h"

namespace vp::server {

class PrometheusObserver final : public CoordinatorObserver {
 public:
  // keep_finished: the series of the newest this many finished jobs stay exported; older
  // finished jobs' series are removed (the job store keeps their history).
  explicit PrometheusObserver(std::unique_ptr<metrics::MetricsExporter> exporter,
                              int keep_finished = 100)
      : exporter_(std::move(exporter)), keep_finished_(keep_finished) {}
  void OnJobState(const vocabpipe::v1::Job& job) override;
  void OnStep(const vocabpipe::v1::Job& job, const vocabpipe::v1::StepMetrics& step) override;
  void OnWorkers(int idle, int busy) override;
  metrics::MetricsExporter& exporter() { return *exporter_; }

 private:
  std::unique_ptr<metrics::MetricsExporter> exporter_;
  const int keep_finished_;
  std::deque<std::string> finished_;  // oldest first
};

}  // namespace vp::server
