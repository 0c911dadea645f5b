#include "coordinator/metrics/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace vp::metrics {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;
using prometheus::Labels;

// Step durations range from milliseconds (tiny CPU models in tests) to minutes (large models).
const Histogram::BucketBoundaries& StepBuckets() {
  static const Histogram::BucketBoundaries kBuckets = {
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300};
  return kBuckets;
}

// One stage's figures of a step, checked and converted before anything is recorded.
struct StageFigures {
  int64_t rank = 0;
  int64_t stage = 0;    // the pipeline stage: "stage" when given (data parallelism), else rank
  int64_t replica = 0;  // the data-parallel replica: "replica" when given, else 0
  int64_t tensor = 0;   // the tensor-parallel rank: "tensor" when given, else 0
  std::optional<double> seconds, busy_seconds, compute_wait_seconds;
  std::optional<double> predicted_memory_total;
  std::map<std::string, double> busy, comm, memory;  // per pass / comm kind / memory kind
};

struct StepFigures {
  int64_t step = 0;
  double step_seconds = 0;
  std::optional<double> loss, val_loss, lr, grad_norm, tokens_per_s, mfu, peak_memory_bytes;
  std::optional<double> busy_max_over_mean, memory_max_over_min;
  std::vector<StageFigures> stages;
};

absl::Status NotANumber(const std::string& field) {
  return absl::InvalidArgumentError(absl::StrCat("step.", field, ": must be a number"));
}

// An optional number; `non_negative` for durations, sizes and counts.
absl::Status ReadNumber(const nlohmann::json& obj, const std::string& key, const std::string& path,
                        bool non_negative, std::optional<double>* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return NotANumber(path);
  const double v = it->get<double>();
  if (non_negative && v < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step.", path, ": must be >= 0, got ", v));
  }
  *out = v;
  return absl::OkStatus();
}

// An optional object of non-negative numbers ({"F": 0.1, ...}).
absl::Status ReadNumberMap(const nlohmann::json& obj, const std::string& key,
                           const std::string& path, std::map<std::string, double>* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("step.", path, ": must be an object"));
  }
  for (const auto& [name, value] : it->items()) {
    const std::string sub = absl::StrCat(path, ".", name);
    if (!value.is_number()) return NotANumber(sub);
    const double v = value.get<double>();
    if (v < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step.", sub, ": must be >= 0, got ", v));
    }
    (*out)[name] = v;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepFigures> ParseStep(const nlohmann::json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("step: must be a JSON object");
  StepFigures f;
  auto step = j.find("step");
  if (step == j.end() || !step->is_number_integer() || step->get<int64_t>() < 0) {
    return absl::InvalidArgumentError("step.step: required, an integer >= 0");
  }
  f.step = step->get<int64_t>();
  std::optional<double> step_seconds;
  for (const auto& [key, non_negative, out] :
       {std::tuple{"step_seconds", true, &step_seconds}, std::tuple{"loss", false, &f.loss},
        std::tuple{"val_loss", false, &f.val_loss}, std::tuple{"lr", true, &f.lr},
        std::tuple{"grad_norm", true, &f.grad_norm},
        std::tuple{"tokens_per_s", true, &f.tokens_per_s}, std::tuple{"mfu", true, &f.mfu},
        std::tuple{"peak_memory_bytes", true, &f.peak_memory_bytes},
        std::tuple{"busy_max_over_mean", true, &f.busy_max_over_mean},
        std::tuple{"memory_max_over_min", true, &f.memory_max_over_min}}) {
    if (auto st = ReadNumber(j, key, key, non_negative, out); !st.ok()) return st;
  }
  if (auto it = j.find("stages"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return absl::InvalidArgumentError("step.stages: must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      const nlohmann::json& s = (*it)[i];
      const std::string path = absl::StrCat("stages[", i, "]");
      if (!s.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat("step.", path, ": must be an object"));
      }
      StageFigures stage;
      stage.rank = static_cast<int64_t>(i);
      if (auto r = s.find("rank"); r != s.end()) {
        if (!r->is_number_integer() || r->get<int64_t>() < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("step.", path, ".rank: must be an integer >= 0"));
        }
        stage.rank = r->get<int64_t>();
      }
      stage.stage = stage.rank;
      for (const auto& [key, out] :
           {std::pair{"stage", &stage.stage}, std::pair{"replica", &stage.replica},
            std::pair{"tensor", &stage.tensor}}) {
        if (auto v = s.find(key); v != s.end()) {
          if (!v->is_number_integer() || v->get<int64_t>() < 0) {
            return absl::InvalidArgumentError(
                absl::StrCat("step.", path, ".", key, ": must be an integer >= 0"));
          }
          *out = v->get<int64_t>();
        }
      }
      for (const auto& [key, out] :
           {std::pair{"seconds", &stage.seconds}, std::pair{"busy_seconds", &stage.busy_seconds},
            std::pair{"compute_wait_seconds", &stage.compute_wait_seconds},
            std::pair{"predicted_memory_total", &stage.predicted_memory_total}}) {
        if (auto st = ReadNumber(s, key, absl::StrCat(path, ".", key), true, out); !st.ok()) {
          return st;
        }
      }
      for (const auto& [key, out] : {std::pair{"busy", &stage.busy}, std::pair{"comm", &stage.comm},
                                     std::pair{"memory", &stage.memory}}) {
        if (auto st = ReadNumberMap(s, key, absl::StrCat(path, ".", key), out); !st.ok()) {
          return st;
        }
      }
      f.stages.push_back(std::move(stage));
    }
  }
  // The step takes as long as its slowest stage (MergeStep writes that as step_seconds).
  if (!step_seconds.has_value()) {
    for (const StageFigures& s : f.stages) {
      if (s.seconds.has_value()) step_seconds = std::max(step_seconds.value_or(0.0), *s.seconds);
    }
  }
  if (!step_seconds.has_value()) {
    return absl::InvalidArgumentError(
        "step.step_seconds: required when no stage has \"seconds\" to derive it from");
  }
  f.step_seconds = *step_seconds;
  return f;
}

// Every series one job created, so RemoveJob can drop them.
struct JobSeries {
  std::optional<std::pair<std::string, std::string>> schedule_vocab;  // fixed by the first step
  std::set<std::string> states;                                       // states ever set
  std::set<const void*> known;
  std::vector<std::function<void()>> removers;
};

template <typename T, typename... Args>
T& Track(JobSeries& job, Family<T>& family, const Labels& labels, Args&&... args) {
  T& metric = family.Add(labels, std::forward<Args>(args)...);
  if (job.known.insert(&metric).second) {
    job.removers.push_back([&family, &metric] { family.Remove(&metric); });
  }
  return metric;
}

}  // namespace

struct MetricsExporter::Impl {
  template <typename Builder>
  static auto& Build(Builder builder, prometheus::Registry& r, const char* name, const char* help) {
    return builder.Name(name).Help(help).Register(r);
  }

  Impl()
      : registry(std::make_shared<prometheus::Registry>()),
        step_duration(Build(prometheus::BuildHistogram(), *registry,
                            "vocabpipe_step_duration_seconds",
                            "Wall time of a training step (its slowest stage).")),
        last_step_duration(Build(prometheus::BuildGauge(), *registry,
                                 "vocabpipe_last_step_duration_seconds",
                                 "Wall time of the job's latest step.")),
        last_step(Build(prometheus::BuildGauge(), *registry, "vocabpipe_last_step",
                        "Index of the job's latest recorded step.")),
        steps(Build(prometheus::BuildCounter(), *registry, "vocabpipe_steps_total",
                    "Training steps recorded.")),
        tokens(Build(prometheus::BuildCounter(), *registry, "vocabpipe_tokens_total",
                     "Tokens trained on (tokens_per_s x step seconds per step).")),
        tokens_per_second(Build(prometheus::BuildGauge(), *registry, "vocabpipe_tokens_per_second",
                                "Throughput of the latest step.")),
        mfu(Build(prometheus::BuildGauge(), *registry, "vocabpipe_mfu_ratio",
                  "Model FLOPs utilisation of the latest step (0-1).")),
        loss(Build(prometheus::BuildGauge(), *registry, "vocabpipe_loss",
                   "Training loss of the latest step.")),
        val_loss(Build(prometheus::BuildGauge(), *registry, "vocabpipe_val_loss",
                       "Validation loss of the latest evaluation (train.eval_every).")),
        learning_rate(Build(prometheus::BuildGauge(), *registry, "vocabpipe_learning_rate",
                            "Learning rate of the latest step.")),
        grad_norm(Build(prometheus::BuildGauge(), *registry, "vocabpipe_grad_norm",
                        "Global gradient norm of the latest step (before clipping).")),
        peak_memory(Build(prometheus::BuildGauge(), *registry, "vocabpipe_peak_memory_bytes",
                          "Largest per-stage peak memory of the latest step.")),
        bubble(Build(prometheus::BuildGauge(), *registry, "vocabpipe_pipeline_bubble_ratio",
                     "Idle share of the pipeline in the latest step: "
                     "1 - sum(stage busy seconds) / (stages x step seconds).")),
        busy_imbalance(Build(prometheus::BuildGauge(), *registry, "vocabpipe_stage_busy_imbalance",
                             "Max over mean of the stages' busy seconds (1 = balanced).")),
        memory_imbalance(Build(prometheus::BuildGauge(), *registry,
                               "vocabpipe_stage_memory_imbalance",
                               "Max over min of the stages' peak memory (1 = balanced).")),
        job_info(Build(prometheus::BuildGauge(), *registry, "vocabpipe_job_info",
                       "Always 1; labels name the job's schedule and vocabulary layout.")),
        stage_memory(Build(prometheus::BuildGauge(), *registry, "vocabpipe_stage_memory_bytes",
                           "Measured peak memory of a stage by kind.")),
        stage_predicted_memory(Build(prometheus::BuildGauge(), *registry,
                                     "vocabpipe_stage_predicted_memory_bytes",
                                     "Planner's predicted peak memory of a stage by kind.")),
        pass_seconds(Build(prometheus::BuildCounter(), *registry, "vocabpipe_pass_seconds_total",
                           "Compute seconds of a stage by pass kind.")),
        comm_seconds(Build(prometheus::BuildCounter(), *registry, "vocabpipe_comm_seconds_total",
                           "Communication seconds of a stage by kind.")),
        stage_busy(Build(prometheus::BuildCounter(), *registry,
                         "vocabpipe_stage_busy_seconds_total", "Compute seconds of a stage.")),
        stage_compute_wait(Build(prometheus::BuildCounter(), *registry,
                                 "vocabpipe_stage_compute_wait_seconds_total",
                                 "Seconds a stage's compute stream waited on communication.")),
        stage_busy_ratio(Build(prometheus::BuildGauge(), *registry, "vocabpipe_stage_busy_ratio",
                               "Busy share of a stage in the latest step (0-1).")),
        job_state(Build(prometheus::BuildGauge(), *registry, "vocabpipe_job_state",
                        "1 for the job's current state, 0 for the others.")),
        job_data_replicas(Build(prometheus::BuildGauge(), *registry, "vocabpipe_job_data_replicas",
                                "Data-parallel replicas the job runs at now.")),
        job_requested_data_replicas(
            Build(prometheus::BuildGauge(), *registry, "vocabpipe_job_requested_data_replicas",
                  "Data-parallel replicas the job asked for (parallel.data).")),
        workers(Build(prometheus::BuildGauge(), *registry, "vocabpipe_workers",
                      "Registered workers by state.")) {}

  std::shared_ptr<prometheus::Registry> registry;  // outlives `exposer` (it holds a weak_ptr)
  Family<Histogram>& step_duration;
  Family<Gauge>& last_step_duration;
  Family<Gauge>& last_step;
  Family<Counter>& steps;
  Family<Counter>& tokens;
  Family<Gauge>& tokens_per_second;
  Family<Gauge>& mfu;
  Family<Gauge>& loss;
  Family<Gauge>& val_loss;
  Family<Gauge>& learning_rate;
  Family<Gauge>& grad_norm;
  Family<Gauge>& peak_memory;
  Family<Gauge>& bubble;
  Family<Gauge>& busy_imbalance;
  Family<Gauge>& memory_imbalance;
  Family<Gauge>& job_info;
  Family<Gauge>& stage_memory;
  Family<Gauge>& stage_predicted_memory;
  Family<Counter>& pass_seconds;
  Family<Counter>& comm_seconds;
  Family<Counter>& stage_busy;
  Family<Counter>& stage_compute_wait;
  Family<Gauge>& stage_busy_ratio;
  Family<Gauge>& job_state;
  Family<Gauge>& job_data_replicas;
  Family<Gauge>& job_requested_data_replicas;
  Family<Gauge>& workers;

  std::mutex mu;  // guards `jobs` and makes each call's updates one unit
  std::map<std::string, JobSeries, std::less<>> jobs;

  std::unique_ptr<prometheus::Exposer> exposer;  // declared last: stops serving first
  int port = 0;
};

MetricsExporter::MetricsExporter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsExporter::~MetricsExporter() = default;

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Create(
    const std::string& bind_address) {
  auto impl = std::make_unique<Impl>();
  if (!bind_address.empty()) {
    try {
      impl->exposer = std::make_unique<prometheus::Exposer>(bind_address, /*num_threads=*/2);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("--metrics: cannot listen on \"", bind_address, "\": ", e.what()));
    }
    impl->exposer->RegisterCollectable(impl->registry, "/metrics");
    const std::vector<int> ports = impl->exposer->GetListeningPorts();
    if (ports.empty()) {
      return absl::UnavailableError(
          absl::StrCat("--metrics: no port bound for \"", bind_address, "\""));
    }
    impl->port = ports.front();
  }
  return std::unique_ptr<MetricsExporter>(new MetricsExporter(std::move(impl)));
}

int MetricsExporter::port() const { return impl_->port; }

absl::Status MetricsExporter::RecordStep(std::string_view job_id, std::string_view schedule,
                                         std::string_view vocab, const nlohmann::json& step) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must not be empty");
  absl::StatusOr<StepFigures> parsed = ParseStep(step);
  if (!parsed.ok()) return parsed.status();
  const StepFigures& f = *parsed;

  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.jobs.find(job_id);
  if (it == m.jobs.end()) it = m.jobs.emplace(std::string(job_id), JobSeries{}).first;
  JobSeries& job = it->second;
  if (job.schedule_vocab.has_value()) {
    const auto& [s, v] = *job.schedule_vocab;
    if (s != schedule) {
      return absl::InvalidArgumentError(absl::StrCat("schedule: job ", std::string(job_id),
                                                     " was recorded as \"", s, "\", got \"",
                                                     std::string(schedule), "\""));
    }
    if (v != vocab) {
      return absl::InvalidArgumentError(absl::StrCat("vocab: job ", std::string(job_id),
                                                     " was recorded as \"", v, "\", got \"",
                                                     std::string(vocab), "\""));
    }
  } else {
    job.schedule_vocab.emplace(std::string(schedule), std::string(vocab));
  }

  const Labels job_labels = {{"training_job", std::string(job_id)},
                             {"schedule", std::string(schedule)},
                             {"vocab", std::string(vocab)}};
  Track(job, m.job_info, job_labels).Set(1);
  Track(job, m.step_duration, job_labels, StepBuckets()).Observe(f.step_seconds);
  Track(job, m.last_step_duration, job_labels).Set(f.step_seconds);
  Track(job, m.last_step, job_labels).Set(static_cast<double>(f.step));
  Track(job, m.steps, job_labels).Increment();
  if (f.tokens_per_s) {
    Track(job, m.tokens_per_second, job_labels).Set(*f.tokens_per_s);
    // tokens_per_s = tokens per step / step seconds, so this product is the step's tokens.
    Track(job, m.tokens, job_labels).Increment(*f.tokens_per_s * f.step_seconds);
  }
  const std::pair<std::optional<double>, Family<Gauge>*> job_gauges[] = {
      {f.mfu, &m.mfu},
      {f.loss, &m.loss},
      {f.val_loss, &m.val_loss},
      {f.lr, &m.learning_rate},
      {f.grad_norm, &m.grad_norm},
      {f.peak_memory_bytes, &m.peak_memory},
      {f.busy_max_over_mean, &m.busy_imbalance},
      {f.memory_max_over_min, &m.memory_imbalance}};
  for (const auto& [value, family] : job_gauges) {
    if (value) Track(job, *family, job_labels).Set(*value);
  }

  // Bubble: the share of stage-seconds in which no pass ran (waiting on a peer, on
  // communication, or at the ends of the schedule).
  double busy_sum = 0;
  bool all_busy_known = !f.stages.empty();
  for (size_t i = 0; i < f.stages.size(); ++i) {
    const StageFigures& s = f.stages[i];
    // Every rank's series carry its pipeline stage, data-parallel replica and tensor rank (0
    // with one), so dashboards aggregate over replicas or tensor ranks by stage (max, mean) and
    // show their spread.
    const Labels stage_labels = {{"training_job", std::string(job_id)},
                                 {"stage", std::to_string(s.stage)},
                                 {"replica", std::to_string(s.replica)},
                                 {"tensor", std::to_string(s.tensor)},
                                 {"rank", std::to_string(s.rank)}};
    auto with = [&stage_labels](const char* key, const std::string& value) {
      Labels l = stage_labels;
      l.emplace(key, value);
      return l;
    };
    for (const auto& [kind, bytes] : s.memory) {
      Track(job, m.stage_memory, with("kind", kind)).Set(bytes);
    }
    if (s.predicted_memory_total) {
      Track(job, m.stage_predicted_memory, with("kind", "total")).Set(*s.predicted_memory_total);
    }
    for (const auto& [pass, seconds] : s.busy) {
      Track(job, m.pass_seconds, with("pass", pass)).Increment(seconds);
    }
    for (const auto& [kind, seconds] : s.comm) {
      Track(job, m.comm_seconds, with("kind", kind)).Increment(seconds);
    }
    if (s.compute_wait_seconds) {
      Track(job, m.stage_compute_wait, stage_labels).Increment(*s.compute_wait_seconds);
    }
    if (s.busy_seconds) {
      Track(job, m.stage_busy, stage_labels).Increment(*s.busy_seconds);
      busy_sum += *s.busy_seconds;
      if (f.step_seconds > 0) {
        Track(job, m.stage_busy_ratio, stage_labels)
            .Set(std::clamp(*s.busy_seconds / f.step_seconds, 0.0, 1.0));
      }
    } else {
      all_busy_known = false;
    }
  }
  if (all_busy_known && f.step_seconds > 0) {
    const double capacity = static_cast<double>(f.stages.size()) * f.step_seconds;
    Track(job, m.bubble, job_labels).Set(std::clamp(1.0 - busy_sum / capacity, 0.0, 1.0));
  }
  return absl::OkStatus();
}

absl::Status MetricsExporter::SetJobState(std::string_view job_id, std::string_view state) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must not be empty");
  if (state.empty()) return absl::InvalidArgumentError("state: must not be empty");
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.jobs.find(job_id);
  if (it == m.jobs.end()) it = m.jobs.emplace(std::string(job_id), JobSeries{}).first;
  JobSeries& job = it->second;
  job.states.insert(kJobStates.begin(), kJobStates.end());
  job.states.emplace(state);
  for (const std::string& s : job.states) {
    Track(job, m.job_state, {{"training_job", std::string(job_id)}, {"state", s}})
        .Set(s == state ? 1 : 0);
  }
  return absl::OkStatus();
}

absl::Status MetricsExporter::SetJobReplicas(std::string_view job_id, int current, int requested) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: must not be empty");
  if (current < 1 || requested < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("replicas: must be >= 1 (got ", current, " of ", requested, ")"));
  }
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.jobs.find(job_id);
  if (it == m.jobs.end()) it = m.jobs.emplace(std::string(job_id), JobSeries{}).first;
  const Labels labels = {{"training_job", std::string(job_id)}};
  Track(it->second, m.job_data_replicas, labels).Set(current);
  Track(it->second, m.job_requested_data_replicas, labels).Set(requested);
  return absl::OkStatus();
}

void MetricsExporter::SetWorkerCount(std::string_view state, int64_t count) {
  impl_->workers.Add({{"state", std::string(state)}}).Set(static_cast<double>(count));
}

void MetricsExporter::RemoveJob(std::string_view job_id) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.jobs.find(job_id);
  if (it == m.jobs.end()) return;
  for (const auto& remove : it->second.removers) remove();
  m.jobs.erase(it);
}

std::string MetricsExporter::Scrape() const {
  return prometheus::TextSerializer().Serialize(impl_->registry->Collect());
}

}  // namespace vp::metrics
