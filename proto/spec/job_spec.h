// Job spec loading and validation: YAML or JSON text -> vocabpipe.v1.JobSpec.
//
// The text is mapped onto the protobuf message generically, by reflection: the keys are the
// proto field names, nested messages are nested mappings. JSON is read by the same YAML
// parser (JSON is a subset of YAML 1.2 for every job file we accept). Every error message
// starts with the full field path (`train.lr: expected a number, got "fast"`), and all
// errors are reported, one per line, not just the first. docs/formats.md lists every field,
// its type, default and rule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::spec {

// The largest job spec text accepted (a spec is a few hundred bytes; docs/formats.md).
inline constexpr size_t kMaxJobSpecBytes = 64 * 1024;

// Upper bounds of the spec's sizes, checked by ValidateJobSpec (docs/formats.md, "Limits").
// They bound what the service will try to plan; whether a job within them fits its workers is
// memory admission's question (the coordinator, at submit).
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxHidden = 65536;
inline constexpr int64_t kMaxHeads = 1024;
inline constexpr int64_t kMaxVocabSize = 4 * 1024 * 1024;
inline constexpr int64_t kMaxSeqLen = 131072;
inline constexpr int64_t kMaxFfnHidden = 262144;
inline constexpr double kMaxRopeTheta = 1e12;  // model.rope_theta (llama)
inline constexpr double kDefaultRmsEps = 1e-5;
inline constexpr double kDefaultRopeTheta = 10000.0;
inline constexpr int64_t kMaxPipeline = 256;
inline constexpr int64_t kMaxData = 4096;   // parallel.data
inline constexpr int64_t kMaxTensor = 64;   // parallel.tensor
inline constexpr int64_t kMaxRanks = 4096;  // data x tensor x pipeline: ranks of one job
inline constexpr int64_t kMaxSeqChunks = 64;
inline constexpr int64_t kMaxMicrobatchSize = 4096;
inline constexpr int64_t kMaxMicrobatches = 4096;
inline constexpr int64_t kMaxChunksPerRank = 16;
inline constexpr int64_t kMaxPendingT = 1024;
inline constexpr int64_t kMaxPlanPasses = 262144;  // pipeline x microbatches x seq_chunks x chunks
inline constexpr int64_t kMaxMicrobatchTokens = 1 << 20;  // microbatch_size x seq_len
inline constexpr int64_t kMaxSteps = 100'000'000;  // train.steps, warmup_steps, checkpoint.every
inline constexpr int64_t kMaxThreads = 1024;
inline constexpr size_t kMaxPathBytes = 4096;        // data.path, data.val_path, checkpoint.dir
inline constexpr int64_t kMaxEvalBatches = 1 << 20;  // train.eval_batches

inline constexpr int kMaxDataPaths = 4096;  // entries of data.paths / data.val_paths

// The entries naming the training tokens: {data.path} or data.paths (each a file, a folder or
// a glob; worker/data/token_shards.h resolves them into shards).
std::vector<std::string> DataPathEntries(const vocabpipe::v1::DataSpec& data);
// The validation tokens' entries: {data.val_path}, data.val_paths, or none.
std::vector<std::string> ValPathEntries(const vocabpipe::v1::DataSpec& data);
bool HasValidationData(const vocabpipe::v1::DataSpec& data);

// A job spec is UTF-8 text (the coordinator's SubmitJobRequest.spec_text is a proto3 string,
// which gRPC refuses to carry otherwise). InvalidArgument naming `field`, the byte offset, line
// and column of the first byte that is not valid UTF-8 (overlong forms, surrogates and values
// past U+10FFFF included); never the bytes themselves.
absl::Status CheckUtf8(std::string_view text, std::string_view field = "(root)");

// Parses YAML or JSON text into a JobSpec, applies defaults and validates it. A string field
// that is not UTF-8 is an error naming the field; other bytes that are not (in a comment)
// fail CheckUtf8.
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
