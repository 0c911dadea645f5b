// The plan text parser (proto/plan/plan.h, PlanFromText): never crashes; a plan it
// accepts prints to text that parses to the same text again.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "proto/plan/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<vp::planner::Plan> plan = vp::planner::PlanFromText(text);
  if (!plan.ok()) return 0;
  const std::string printed = vp::planner::PlanToText(*plan);
  absl::StatusOr<vp::planner::Plan> again = vp::planner::PlanFromText(printed);
  if (!again.ok() || vp::planner::PlanToText(*again) != printed) std::abort();
  return 0;
}
