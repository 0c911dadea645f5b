// The job spec parser (proto/spec/job_spec.h) on arbitrary text: it must never crash, and a
// spec it accepts must survive a round trip through JobSpecToYaml.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "proto/spec/job_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<vocabpipe::v1::JobSpec> spec = vp::spec::ParseJobSpec(text, "/base");
  if (!spec.ok()) return 0;
  if (!vp::spec::ValidateJobSpec(*spec).ok()) std::abort();  // accepted means valid
  absl::StatusOr<vocabpipe::v1::JobSpec> again =
      vp::spec::ParseJobSpec(vp::spec::JobSpecToYaml(*spec), "/base");
  if (!again.ok() || again->SerializeAsString() != spec->SerializeAsString()) std::abort();
  return 0;
}
