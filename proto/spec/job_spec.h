// Job spec loading and validation: YAML or JSON text -> vocabpipe.v1.JobSpec.
//
// The text is mapped onto the protobuf message generically, by reflection: the keys are the
// proto field names, nested messages are nested mappings. JSON is read by the same YAML
// parser (JSON is a subset of YAML 1.2 for every job file we accept). Every error message
// starts with the full field path (`train.lr: expected a number, got "fast"`), and all
// errors are reported, one per line, not just the first. docs/formats.md lists every field,
// its type, default and rule.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::spec {

// Parses YAML or JSON text into a JobSpec, applies defaults and validates it.
// base_dir resolves relative data.path and checkpoint.dir (made absolute).
absl::StatusOr<vocabpipe::v1::JobSpec> ParseJobSpec(std::string_view text,
                                                    std::string_view base_dir);

// Reads a file and calls ParseJobSpec with the file's folder as base_dir; errors start
// with the file path.
absl::StatusOr<vocabpipe::v1::JobSpec> LoadJobSpecFile(const std::string& path);

// Fills every unset optional field with its documented default (job.proto comments).
// checkpoint.dir defaults to "runs/<name>" (relative; ParseJobSpec makes it absolute).
void ApplyDefaults(vocabpipe::v1::JobSpec* spec);

// Checks every rule of docs/formats.md on the spec as if ApplyDefaults had been applied.
// Returns InvalidArgument listing every violated rule, one per line, each starting with the
// field path.
absl::Status ValidateJobSpec(const vocabpipe::v1::JobSpec& spec);

// Renders the spec as block YAML; ParseJobSpec(JobSpecToYaml(s), dir) == s for a valid s
// with absolute paths.
std::string JobSpecToYaml(const vocabpipe::v1::JobSpec& spec);

}  // namespace vp::spec
