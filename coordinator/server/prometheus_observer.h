// The coordinator's Prometheus exposition: a CoordinatorObserver feeding
// vp::metrics::MetricsExporter (coordinator/metrics/metrics.h) with job states, merged steps
// and worker counts. Built only when the vp_metrics library is part of the tree.
#pragma once

#include <memory>

#include "coordinator/metrics/metrics.h"
#include "coordinator/server/coordinator.h"

namespace vp::server {

class PrometheusObserver final : public CoordinatorObserver {
 public:
  explicit PrometheusObserver(std::unique_ptr<metrics::MetricsExporter> exporter)
      : exporter_(std::move(exporter)) {}
  void OnJobState(const vocabpipe::v1::Job& job) override;
  void OnStep(const vocabpipe::v1::Job& job, const vocabpipe::v1::StepMetrics& step) override;
  void OnWorkers(int idle, int busy) override;
  metrics::MetricsExporter& exporter() { return *exporter_; }

 private:
  std::unique_ptr<metrics::MetricsExporter> exporter_;
};

}  // namespace vp::server
