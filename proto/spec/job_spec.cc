// Job spec loading: a generic YAML -> protobuf mapping by reflection, defaults, validation.
#include "proto/spec/job_spec.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"

namespace vp::spec {
namespace {

namespace pb = google::protobuf;
using vocabpipe::v1::JobSpec;

// One problem with one field. `path` is the dotted field path ("train.lr"); `line` is 1-based
// or 0 when the error does not come from a place in the text (validation rules).
struct FieldError {
  std::string path;
  std::string message;
  int line = 0;
  int column = 0;
};

std::string FormatError(const FieldError& e) {
  std::string s = absl::StrCat(e.path.empty() ? "(root)" : e.path, ": ", e.message);
  if (e.line > 0) absl::StrAppend(&s, " (line ", e.line, ", column ", e.column, ")");
  return s;
}

std::string JoinErrors(const std::vector<FieldError>& errors) {
  std::vector<std::string> lines;
  lines.reserve(errors.size());
  for (const FieldError& e : errors) lines.push_back(FormatError(e));
  return absl::StrJoin(lines, "\n");
}

std::string Child(const std::string& parent, std::string_view name) {
  return parent.empty() ? std::string(name) : absl::StrCat(parent, ".", std::string(name));
}

// ---------------------------------------------------------------------------------------------
// Scalar parsing. YAML scalars arrive as text; a quoted scalar (tag "!") is always a string,
// so `lr: "0.1"` is rejected for a number field, as JSON would.

bool IsQuoted(const YAML::Node& node) { return node.Tag() == "!"; }

// parallel.pipeline, data and tensor: integers that may also be `auto` under parallel.world;
// parallel.seq_chunks, which may be `auto` with a Seq1F1B (or auto) schedule.
bool IsLayoutAxis(const pb::FieldDescriptor* field) {
  const std::string& name = field->full_name();
  return name == "vocabpipe.v1.ParallelSpec.pipeline" || name == "vocabpipe.v1.ParallelSpec.data" ||
         name == "vocabpipe.v1.ParallelSpec.tensor" ||
         name == "vocabpipe.v1.ParallelSpec.seq_chunks";
}

// Well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, at most U+10FFFF).
bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + static_cast<size_t>(n) >= s.size()) return false;  // cut short
    for (int k = 1; k <= n; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

// The longest scalar or key an error message quotes back.
constexpr size_t kMaxEchoBytes = 40;

// A key as an error's field path shows it: escaped, cut to kMaxEchoBytes.
std::string ShownKey(const std::string& key) {
  if (key.size() > kMaxEchoBytes) {
    return absl::StrCat(absl::CHexEscape(key.substr(0, kMaxEchoBytes)), "...");
  }
  return absl::CHexEscape(key);
}

std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Scalar:
      // Short values are quoted back (`got "fast"`); longer ones only by size, so an error
      // never echoes a line of whatever file was handed in as a spec.
      if (node.Scalar().size() > kMaxEchoBytes || node.Scalar().find('\n') != std::string::npos) {
        return absl::StrCat("a ", node.Scalar().size(), "-byte text");
      }
      return absl::StrCat("\"", absl::CHexEscape(node.Scalar()), "\"");
    default:
      return "nothing";
  }
}

// What a whole document is, never what it holds (for documents that are not job specs at all).
std::string RootKind(const YAML::Node& root) {
  if (root.Type() == YAML::NodeType::Null) return "an empty document";
  if (root.Type() == YAML::NodeType::Scalar) {
    return absl::StrCat("a ", root.Scalar().size(), "-byte text");
  }
  return Describe(root);
}

std::string_view StripPlus(std::string_view s) {
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  return s;
}

bool ParseDouble(std::string_view text, double* out) {
  text = StripPlus(text);
  if (text.empty()) return false;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, *out, std::chars_format::general);
  return ec == std::errc() && ptr == end;
}

// Integers: plain decimal, or an integral floating literal such as 8e9 (handy for byte
// budgets) as long as it is exactly representable.
bool ParseInt64(std::string_view text, int64_t* out, bool* out_of_range) {
  *out_of_range = false;
  std::string_view t = StripPlus(text);
  if (t.empty()) return false;
  const char* end = t.data() + t.size();
  auto [ptr, ec] = std::from_chars(t.data(), end, *out);
  if (ptr == end && ec == std::errc()) return true;
  if (ptr == end && ec == std::errc::result_out_of_range) {
    *out_of_range = true;
    return false;
  }
  double d;
  if (!ParseDouble(text, &d) || !std::isfinite(d) || d != std::floor(d)) return false;
  if (std::fabs(d) > 9007199254740992.0) {  // 2^53: beyond it the literal is not exact
    *out_of_range = true;
    return false;
  }
  *out = static_cast<int64_t>(d);
  return true;
}

bool ParseUint64(std::string_view text, uint64_t* out, bool* out_of_range) {
  *out_of_range = false;
  std::string_view t = StripPlus(text);
  if (t.empty() || t.front() == '-') return false;
  const char* end = t.data() + t.size();
  auto [ptr, ec] = std::from_chars(t.data(), end, *out);
  if (ptr == end && ec == std::errc()) return true;
  if (ptr == end && ec == std::errc::result_out_of_range) *out_of_range = true;
  return false;
}

bool ParseBool(std::string_view text, bool* out) {
  const std::string t = absl::AsciiStrToLower(std::string(text));
  if (t == "true" || t == "yes" || t == "on") {
    *out = true;
    return true;
  }
  if (t == "false" || t == "no" || t == "off") {
    *out = false;
    return true;
  }
  return false;
}

std::string ExpectedType(const pb::FieldDescriptor* field) {
  using FD = pb::FieldDescriptor;
  switch (field->cpp_type()) {
    case FD::CPPTYPE_INT32:
    case FD::CPPTYPE_INT64:
      return "an integer";
    case FD::CPPTYPE_UINT32:
    case FD::CPPTYPE_UINT64:
      return "a non-negative integer";
    case FD::CPPTYPE_DOUBLE:
    case FD::CPPTYPE_FLOAT:
      return "a number";
    case FD::CPPTYPE_BOOL:
      return "a boolean (true or false)";
    case FD::CPPTYPE_STRING:
      return "a string";
    case FD::CPPTYPE_MESSAGE:
      return "a mapping";
    case FD::CPPTYPE_ENUM: {
      std::vector<std::string> names;
      for (int i = 0; i < field->enum_type()->value_count(); ++i) {
        names.push_back(field->enum_type()->value(i)->name());
      }
      return absl::StrCat("one of ", absl::StrJoin(names, ", "));
    }
  }
  return "a value";
}

// ---------------------------------------------------------------------------------------------
// The generic YAML -> message mapping.

class YamlToProto {
 public:
  // Paths of fields that were present with a non-null value, and of fields that had an error
  // (their validation errors are not reported on top of the parse error).
  std::set<std::string> present;
  std::set<std::string> failed;
  std::vector<FieldError> errors;

  void Fill(const YAML::Node& node, const std::string& path, pb::Message* msg) {
    if (!node.IsMap()) {
      Error(node, path, absl::StrCat("expected a mapping, got ", Describe(node)));
      return;
    }
    const pb::Descriptor* desc = msg->GetDescriptor();
    std::set<std::string> seen;
    for (auto it = node.begin(); it != node.end(); ++it) {
      // Copies: `it->` yields a temporary proxy, so references to its members would dangle
      // (found by fuzz/job_spec_fuzzer.cc under AddressSanitizer). A Node is a handle.
      const YAML::Node key = it->first;
      const YAML::Node value = it->second;
      if (!key.IsScalar()) {
        Error(key, path, absl::StrCat("keys must be field names, got ", Describe(key)));
        continue;
      }
      const std::string& name = key.Scalar();
      const pb::FieldDescriptor* field = desc->FindFieldByName(name);
      const std::string field_path = Child(path, field != nullptr ? name : ShownKey(name));
      if (field == nullptr) {
        std::vector<std::string> known;
        for (int i = 0; i < desc->field_count(); ++i) known.push_back(desc->field(i)->name());
        Error(key, field_path,
              absl::StrCat("unknown field; known fields: ", absl::StrJoin(known, ", ")));
        continue;
      }
      if (!seen.insert(name).second) {
        Error(key, field_path, "duplicate field");
        continue;
      }
      // null (`key:`, `key: ~`, `key: null`) leaves a field unset, so its default applies.
      if (value.IsNull()) continue;
      if (field->is_map()) {
        Error(value, field_path, "map fields are not supported in job specs");
      } else if (field->is_repeated()) {
        FillRepeated(value, field_path, field, msg);
      } else {
        FillSingular(value, field_path, field, msg);
      }
    }
  }

 private:
  void Error(const YAML::Node& node, const std::string& path, std::string message) {
    const YAML::Mark mark = node.Mark();
    FieldError e{path, std::move(message), 0, 0};
    if (!mark.is_null()) {
      e.line = mark.line + 1;
      e.column = mark.column + 1;
    }
    errors.push_back(std::move(e));
    failed.insert(path);
  }

  void FillRepeated(const YAML::Node& value, const std::string& path,
                    const pb::FieldDescriptor* field, pb::Message* msg) {
    if (!value.IsSequence()) {
      Error(value, path, absl::StrCat("expected a sequence, got ", Describe(value)));
      return;
    }
    present.insert(path);
    for (size_t i = 0; i < value.size(); ++i) {
      SetValue(value[i], absl::StrCat(path, "[", i, "]"), field, msg);
    }
  }

  void FillSingular(const YAML::Node& value, const std::string& path,
                    const pb::FieldDescriptor* field, pb::Message* msg) {
    present.insert(path);
    SetValue(value, path, field, msg);
  }

  // Sets (singular) or appends (repeated) one value.
  void SetValue(const YAML::Node& value, const std::string& path, const pb::FieldDescriptor* field,
                pb::Message* msg) {
    using FD = pb::FieldDescriptor;
    const pb::Reflection* refl = msg->GetReflection();
    const bool repeated = field->is_repeated();
    if (field->cpp_type() == FD::CPPTYPE_MESSAGE) {
      pb::Message* sub = repeated ? refl->AddMessage(msg, field) : refl->MutableMessage(msg, field);
      Fill(value, path, sub);
      return;
    }
    const std::string expected = ExpectedType(field);
    if (!value.IsScalar()) {
      Error(value, path, absl::StrCat("expected ", expected, ", got ", Describe(value)));
      return;
    }
    const std::string& text = value.Scalar();
    const bool quoted = IsQuoted(value);
    auto type_error = [&] {
      Error(value, path,
            absl::StrCat(
                "expected ", expected, ", got ", Describe(value),
                quoted && field->cpp_type() != FD::CPPTYPE_STRING ? " (a quoted string)" : ""));
    };
    switch (field->cpp_type()) {
      case FD::CPPTYPE_INT32:
      case FD::CPPTYPE_INT64: {
        int64_t v;
        bool out_of_range;
        // The layout axes take `auto` (stored as 0; validation wants parallel.world with it).
        if (!quoted && text == "auto" && !repeated && IsLayoutAxis(field)) {
          refl->SetInt32(msg, field, 0);
          return;
        }
        if (quoted || !ParseInt64(text, &v, &out_of_range)) {
          if (!quoted && out_of_range) {
            Error(value, path, absl::StrCat(text, " is out of int64 range"));
          } else {
            type_error();
          }
          return;
        }
        if (field->cpp_type() == FD::CPPTYPE_INT32) {
          if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
            Error(value, path,
                  absl::StrCat(text, " is out of int32 range [-2147483648, 2147483647]"));
            return;
          }
          repeated ? refl->AddInt32(msg, field, static_cast<int32_t>(v))
                   : refl->SetInt32(msg, field, static_cast<int32_t>(v));
        } else {
          repeated ? refl->AddInt64(msg, field, v) : refl->SetInt64(msg, field, v);
        }
        return;
      }
      case FD::CPPTYPE_UINT32:
      case FD::CPPTYPE_UINT64: {
        uint64_t v;
        bool out_of_range;
        if (quoted || !ParseUint64(text, &v, &out_of_range)) {
          if (!quoted && out_of_range) {
            Error(value, path, absl::StrCat(text, " is out of uint64 range"));
          } else {
            type_error();
          }
          return;
        }
        if (field->cpp_type() == FD::CPPTYPE_UINT32) {
          if (v > std::numeric_limits<uint32_t>::max()) {
            Error(value, path, absl::StrCat(text, " is out of uint32 range"));
            return;
          }
          repeated ? refl->AddUInt32(msg, field, static_cast<uint32_t>(v))
                   : refl->SetUInt32(msg, field, static_cast<uint32_t>(v));
        } else {
          repeated ? refl->AddUInt64(msg, field, v) : refl->SetUInt64(msg, field, v);
        }
        return;
      }
      case FD::CPPTYPE_DOUBLE:
      case FD::CPPTYPE_FLOAT: {
        double v;
        if (quoted || !ParseDouble(text, &v)) {
          type_error();
          return;
        }
        if (!std::isfinite(v)) {
          Error(value, path, absl::StrCat("expected a finite number, got ", Describe(value)));
          return;
        }
        if (field->cpp_type() == FD::CPPTYPE_DOUBLE) {
          repeated ? refl->AddDouble(msg, field, v) : refl->SetDouble(msg, field, v);
        } else {
          repeated ? refl->AddFloat(msg, field, static_cast<float>(v))
                   : refl->SetFloat(msg, field, static_cast<float>(v));
        }
        return;
      }
      case FD::CPPTYPE_BOOL: {
        bool v;
        if (quoted || !ParseBool(text, &v)) {
          type_error();
          return;
        }
        repeated ? refl->AddBool(msg, field, v) : refl->SetBool(msg, field, v);
        return;
      }
      case FD::CPPTYPE_STRING:
        // proto3 strings must be UTF-8: a record with other bytes would not parse back from
        // the job store or off the wire (found by fuzz/job_spec_fuzzer.cc).
        if (!ValidUtf8(text)) {
          Error(value, path, "expected a UTF-8 string, got other bytes");
          return;
        }
        repeated ? refl->AddString(msg, field, text) : refl->SetString(msg, field, text);
        return;
      case FD::CPPTYPE_ENUM: {
        const pb::EnumValueDescriptor* ev = field->enum_type()->FindValueByName(text);
        if (ev == nullptr) {
          type_error();
          return;
        }
        repeated ? refl->AddEnum(msg, field, ev) : refl->SetEnum(msg, field, ev);
        return;
      }
      case FD::CPPTYPE_MESSAGE:
        return;  // handled above
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Validation.

constexpr const char* kSchedules[] = {"1f1b", "interleaved", "vhalf",   "vmin",
                                      "zbh1", "zbv",         "seq1f1b", "seq1f1b-interleaved",
                                      "auto"};
constexpr const char* kVocabMethods[] = {"baseline", "redis",  "interlaced",
                                         "vocab1",   "vocab2", "auto"};
constexpr const char* kLrSchedules[] = {"constant", "cosine"};
constexpr const char* kRecomputeModes[] = {"none", "selective", "full"};

// VOCABPIPE_UNVERIFIED_CUDA, a comma list of "data", "tensor" and "recompute": the CUDA paths
// built but not yet verified on a GPU that this process accepts anyway. Set by the GPU bundle's
// run for a path whose GPU tests have just passed in the same run, so one command both tests a
// path and runs its end-to-end job; an operator's switch (the environment of the coordinator,
// the daemons and the ranks), never a field a job can set.
bool UnverifiedCudaAccepted(absl::string_view path) {
  const char* env = std::getenv("VOCABPIPE_UNVERIFIED_CUDA");
  if (env == nullptr) return false;
  for (absl::string_view part : absl::StrSplit(env, ',')) {
    if (absl::StripAsciiWhitespace(part) == path) return true;
  }
  return false;
}

template <size_t N>
bool OneOf(const std::string& v, const char* const (&set)[N]) {
  return std::find(std::begin(set), std::end(set), v) != std::end(set);
}

template <size_t N>
std::string JoinSet(const char* const (&set)[N]) {
  return absl::StrJoin(std::begin(set), std::end(set), ", ");
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

bool ValidDevice(const std::string& device) {
  if (device == "cpu" || device == "cuda") return true;
  if (device.rfind("cuda:", 0) != 0) return false;
  const std::string_view n = std::string_view(device).substr(5);
  return !n.empty() && n.size() <= 4 &&
         std::all_of(n.begin(), n.end(), [](char c) { return absl::ascii_isdigit(c); });
}

std::string Num(double v) { return absl::StrFormat("%g", v); }

// parallel.tensor's rules (docs/tensor-parallel.md): every rank of a tensor group holds
// heads/t query heads, kv_heads/t key/value heads (or all of them, replicated, when the model has
// one), ffn_hidden/t MLP columns, and 1/t of each sequence chunk's tokens (chunk boundaries are
// placed on multiples of t, so seq_len divisible by t makes every chunk so).
template <typename Add>
void ValidateTensorSplit(const vocabpipe::v1::ModelSpec& m, const vocabpipe::v1::ParallelSpec& p,
                         Add& add) {
  const int t = p.tensor();
  if (t < 1 || t > kMaxTensor) return;  // reported by the range check
  if (t > 1 && !p.sequence_parallel()) {
    add("parallel.sequence_parallel",
        absl::StrCat("must be true while parallel.tensor > 1 (got false, tensor ", t,
                     "): only the sequence-parallel split is implemented"));
  }
  if (t == 1) return;
  const auto divisible = [&](const char* field, int64_t value) {
    if (value >= 1 && value % t != 0) {
      add(field, absl::StrCat("must be divisible by parallel.tensor (", value, " % ", t, " != 0)"));
    }
  };
  // The vocabulary is split over the p·t ranks: the methods that keep it whole on a stage, and
  // interlaced (whose passes assume p shards), do not compose with the tensor split.
  if (p.vocab() != "vocab1" && p.vocab() != "vocab2") {
    add("parallel.vocab", absl::StrCat("must be vocab1 or vocab2 while parallel.tensor > 1 (got \"",
                                       absl::CHexEscape(p.vocab()), "\")"));
  }
  divisible("model.heads", m.heads());
  divisible("model.ffn_hidden", m.ffn_hidden());
  divisible("model.seq_len", m.seq_len());
  if (m.architecture() == "llama" && m.kv_heads() > 1 && m.kv_heads() % t != 0) {
    add("model.kv_heads",
        absl::StrCat("must be divisible by parallel.tensor or be 1 (replicated on every tensor "
                     "rank) (",
                     m.kv_heads(), " % ", t, " != 0)"));
  }
}

// The architecture fields: `original` is the spec as written (to tell which llama-only fields
// a gpt2 spec sets), `m` the spec with defaults applied.
template <typename Add>
void ValidateArchitecture(const vocabpipe::v1::ModelSpec& original,
                          const vocabpipe::v1::ModelSpec& m, Add& add) {
  if (m.architecture() != "gpt2" && m.architecture() != "llama") {
    add("model.architecture", absl::StrCat("must be one of gpt2, llama (got \"",
                                           absl::CHexEscape(m.architecture()), "\")"));
    return;
  }
  if (m.architecture() == "gpt2") {
    // GPT-2 has none of these; a value other than the inert default would be silently ignored,
    // so say so instead.
    if (original.has_kv_heads() && original.kv_heads() != m.heads()) {
      add("model.kv_heads", "applies to architecture llama only (GPT-2 attention is multi-head)");
    }
    if (original.has_rms_eps() && original.rms_eps() != kDefaultRmsEps) {
      add("model.rms_eps", "applies to architecture llama only");
    }
    if (original.has_rope_theta() && original.rope_theta() != kDefaultRopeTheta) {
      add("model.rope_theta", "applies to architecture llama only");
    }
    return;
  }
  if (m.kv_heads() < 1) {
    add("model.kv_heads", absl::StrCat("must be >= 1 (got ", m.kv_heads(), ")"));
  } else if (m.kv_heads() > m.heads() && m.heads() >= 1) {
    add("model.kv_heads",
        absl::StrCat("must be <= model.heads (", m.kv_heads(), " > ", m.heads(), ")"));
  } else if (m.heads() >= 1 && m.heads() % m.kv_heads() != 0) {
    add("model.kv_heads",
        absl::StrCat("must divide model.heads (", m.heads(), " % ", m.kv_heads(), " != 0)"));
  }
  // Rotary embeddings rotate pairs of a head's dimensions.
  if (m.hidden() >= 1 && m.heads() >= 1 && m.hidden() % m.heads() == 0 &&
      (m.hidden() / m.heads()) % 2 != 0) {
    add("model.heads", absl::StrCat("must leave an even head dimension for llama's rotary "
                                    "embeddings (hidden / heads = ",
                                    m.hidden() / m.heads(), ")"));
  }
  if (!(m.rms_eps() > 0 && m.rms_eps() <= 1)) {
    add("model.rms_eps", absl::StrCat("must be in (0, 1] (got ", Num(m.rms_eps()), ")"));
  }
  if (!(m.rope_theta() >= 1 && m.rope_theta() <= kMaxRopeTheta)) {
    add("model.rope_theta",
        absl::StrCat("must be in [1, ", Num(kMaxRopeTheta), "] (got ", Num(m.rope_theta()), ")"));
  }
}

std::vector<FieldError> CollectValidationErrors(const JobSpec& original) {
  JobSpec s = original;
  ApplyDefaults(&s);
  std::vector<FieldError> errors;
  auto add = [&](std::string path, std::string message) {
    errors.push_back(FieldError{std::move(path), std::move(message)});
  };
  auto at_least = [&](const std::string& path, int64_t v, int64_t min) {
    if (v < min) add(path, absl::StrCat("must be >= ", min, " (got ", v, ")"));
  };
  // Upper bounds (docs/formats.md, "Limits"): no single size may make a spec that the
  // service cannot even plan; memory admission at submit handles what is within them.
  auto in_range = [&](const std::string& path, int64_t v, int64_t min, int64_t max) {
    if (v < min) {
      add(path, absl::StrCat("must be >= ", min, " (got ", v, ")"));
    } else if (v > max) {
      add(path, absl::StrCat("must be <= ", max, " (got ", v, ")"));
    }
  };

  if (!ValidName(s.name())) {
    add("name",
        absl::StrCat("must match [A-Za-z0-9._-]{1,64} (got \"", absl::CHexEscape(s.name()), "\")"));
  }

  const auto& m = s.model();
  in_range("model.layers", m.layers(), 1, kMaxLayers);
  in_range("model.hidden", m.hidden(), 1, kMaxHidden);
  in_range("model.heads", m.heads(), 1, kMaxHeads);
  if (m.hidden() >= 1 && m.heads() >= 1 && m.hidden() % m.heads() != 0) {
    add("model.heads",
        absl::StrCat("must divide model.hidden (", m.hidden(), " % ", m.heads(), " != 0)"));
  }
  in_range("model.vocab_size", m.vocab_size(), 2, kMaxVocabSize);
  in_range("model.seq_len", m.seq_len(), 1, kMaxSeqLen);
  // An unset ffn_hidden is derived from hidden; only report it when the user wrote it or when
  // hidden itself is valid (otherwise the hidden error already says it all).
  if (original.model().has_ffn_hidden() || m.hidden() >= 1) {
    in_range("model.ffn_hidden", m.ffn_hidden(), 1, kMaxFfnHidden);
  }
  ValidateArchitecture(original.model(), m, add);
  if (m.init_from().size() > kMaxPathBytes) {
    add("model.init_from",
        absl::StrCat("must be at most ", kMaxPathBytes, " bytes (got ", m.init_from().size(), ")"));
  }

  const auto& p = s.parallel();
  // parallel.world (docs/recompute.md, "Choosing the layout"): the job's ranks; pipeline, data
  // and tensor may then be auto (0 here), and microbatches counts the whole step's.
  in_range("parallel.world", p.world(), 0, kMaxRanks);
  const bool layout = p.world() >= 1 && p.world() <= kMaxRanks;
  auto axis = [&](const char* path, int v, int64_t max) {
    if (v == 0 && layout) return;  // auto: the planner chooses
    if (v == 0) {
      add(path, "must be >= 1 (got 0); auto needs parallel.world (the job's ranks)");
      return;
    }
    in_range(path, v, 1, max);
  };
  axis("parallel.pipeline", p.pipeline(), kMaxPipeline);
  axis("parallel.data", p.data(), kMaxData);
  if (layout && p.pipeline() >= 0 && p.data() >= 0 && p.tensor() >= 0) {
    const int64_t fixed = static_cast<int64_t>(std::max(1, p.pipeline())) * std::max(1, p.data()) *
                          std::max(1, p.tensor());
    const bool any_auto = p.pipeline() == 0 || p.data() == 0 || p.tensor() == 0;
    if (!any_auto && fixed != p.world()) {
      add("parallel.world", absl::StrCat("must equal data x tensor x pipeline when none is auto (",
                                         p.world(), " != ", fixed, ")"));
    } else if (p.world() % fixed != 0) {
      add("parallel.world", absl::StrCat("must be a multiple of the axes given (", p.world(), " % ",
                                         fixed, " != 0)"));
    }
    if (p.data() >= 1 && p.microbatches() >= 1 && p.microbatches() % p.data() != 0) {
      add("parallel.microbatches",
          absl::StrCat("must be divisible by parallel.data under parallel.world (the step's ",
                       p.microbatches(), " microbatches over ", p.data(), " replicas)"));
    }
  }
  if (p.zero() == 2 || p.zero() == 3) {
    add("parallel.zero",
        absl::StrCat("must be 0 or 1 (got ", p.zero(), "): ZeRO stages 2 and 3 shard gradients ",
                     "and parameters, which every microbatch of a pipeline step uses again; ",
                     "stage 1 (the optimizer state) is the one that composes with pipelining"));
  } else {
    in_range("parallel.zero", p.zero(), 0, 1);
  }
  axis("parallel.tensor", p.tensor(), kMaxTensor);
  if (p.pipeline() >= 1 && p.data() >= 1 && p.tensor() >= 1 &&
      static_cast<int64_t>(p.pipeline()) * p.data() * p.tensor() > kMaxRanks) {
    add("parallel.data",
        absl::StrCat("data x tensor x pipeline must be <= ", kMaxRanks, " ranks (got ",
                     static_cast<int64_t>(p.pipeline()) * p.data() * p.tensor(), ")"));
  }
  ValidateTensorSplit(m, p, add);
  if (!OneOf(p.schedule(), kSchedules)) {
    add("parallel.schedule", absl::StrCat("must be one of ", JoinSet(kSchedules), " (got \"",
                                          absl::CHexEscape(p.schedule()), "\")"));
  }
  if (!OneOf(p.vocab(), kVocabMethods)) {
    add("parallel.vocab", absl::StrCat("must be one of ", JoinSet(kVocabMethods), " (got \"",
                                       absl::CHexEscape(p.vocab()), "\")"));
  }
  if (!OneOf(p.recompute(), kRecomputeModes) && !(layout && p.recompute() == "auto")) {
    add("parallel.recompute", absl::StrCat("must be one of ", JoinSet(kRecomputeModes),
                                           layout ? ", auto" : " (auto needs parallel.world)",
                                           " (got \"", absl::CHexEscape(p.recompute()), "\")"));
  }
  const bool seq_schedule =
      p.schedule() == "seq1f1b" || p.schedule() == "seq1f1b-interleaved" || p.schedule() == "auto";
  if (p.seq_chunks() == 0) {  // auto: the planner tries k of 2 and 4
    if (!seq_schedule && OneOf(p.schedule(), kSchedules)) {
      add("parallel.seq_chunks",
          absl::StrCat("auto requires schedule seq1f1b, seq1f1b-interleaved or auto (got schedule ",
                       p.schedule(), ")"));
    }
  } else {
    in_range("parallel.seq_chunks", p.seq_chunks(), 1, kMaxSeqChunks);
  }
  if (p.seq_chunks() > 1 && m.seq_len() >= 1 && p.seq_chunks() > m.seq_len()) {
    add("parallel.seq_chunks",
        absl::StrCat("must be <= model.seq_len (", p.seq_chunks(), " > ", m.seq_len(), ")"));
  }
  if (p.seq_chunks() > 1 && OneOf(p.schedule(), kSchedules) && p.schedule() != "seq1f1b" &&
      p.schedule() != "seq1f1b-interleaved" && p.schedule() != "auto") {
    add("parallel.seq_chunks",
        absl::StrCat("> 1 requires schedule seq1f1b, seq1f1b-interleaved or auto (got schedule ",
                     p.schedule(), ")"));
  }
  in_range("parallel.microbatch_size", p.microbatch_size(), 1, kMaxMicrobatchSize);
  in_range("parallel.microbatches", p.microbatches(), 1, kMaxMicrobatches);
  in_range("parallel.chunks_per_rank", p.chunks_per_rank(), 1, kMaxChunksPerRank);
  at_least("parallel.memory_budget_bytes", p.memory_budget_bytes(), 0);
  in_range("parallel.max_pending_t", p.max_pending_t(), 1, kMaxPendingT);
  // The plan has about pipeline x microbatches x seq_chunks x chunks passes of each kind per
  // rank: bound its size, so planning stays quick whatever each size is.
  const int most_seq_chunks = p.seq_chunks() == 0 ? 4 : p.seq_chunks();  // auto: at most 4
  if (p.pipeline() >= 1 && p.microbatches() >= 1 && most_seq_chunks >= 1 &&
      p.chunks_per_rank() >= 1) {
    const int64_t passes = static_cast<int64_t>(p.pipeline()) * p.microbatches() * most_seq_chunks *
                           p.chunks_per_rank();
    if (passes > kMaxPlanPasses) {
      add("parallel",
          absl::StrCat("pipeline x microbatches x seq_chunks x chunks_per_rank must be <= ",
                       kMaxPlanPasses, " (got ", passes, "); the plan would be too large"));
    }
  }
  if (m.seq_len() >= 1 && p.microbatch_size() >= 1 &&
      static_cast<int64_t>(m.seq_len()) * p.microbatch_size() > kMaxMicrobatchTokens) {
    add("parallel.microbatch_size",
        absl::StrCat("microbatch_size x model.seq_len must be <= ", kMaxMicrobatchTokens,
                     " tokens (got ", static_cast<int64_t>(m.seq_len()) * p.microbatch_size(),
                     ")"));
  }

  const auto& t = s.train();
  in_range("train.steps", t.steps(), 0, kMaxSteps);
  if (!(t.lr() > 0)) add("train.lr", absl::StrCat("must be > 0 (got ", Num(t.lr()), ")"));
  if (!OneOf(t.lr_schedule(), kLrSchedules)) {
    add("train.lr_schedule", absl::StrCat("must be one of ", JoinSet(kLrSchedules), " (got \"",
                                          absl::CHexEscape(t.lr_schedule()), "\")"));
  }
  in_range("train.warmup_steps", t.warmup_steps(), 0, kMaxSteps);
  if (!(t.min_lr() >= 0)) {
    add("train.min_lr", absl::StrCat("must be >= 0 (got ", Num(t.min_lr()), ")"));
  } else if (t.lr() > 0 && t.min_lr() > t.lr()) {
    add("train.min_lr",
        absl::StrCat("must be <= train.lr (", Num(t.min_lr()), " > ", Num(t.lr()), ")"));
  }
  if (!(t.weight_decay() >= 0)) {
    add("train.weight_decay", absl::StrCat("must be >= 0 (got ", Num(t.weight_decay()), ")"));
  }
  if (!(t.beta1() >= 0 && t.beta1() < 1)) {
    add("train.beta1", absl::StrCat("must be in [0, 1) (got ", Num(t.beta1()), ")"));
  }
  if (!(t.beta2() >= 0 && t.beta2() < 1)) {
    add("train.beta2", absl::StrCat("must be in [0, 1) (got ", Num(t.beta2()), ")"));
  }
  if (!(t.eps() > 0)) add("train.eps", absl::StrCat("must be > 0 (got ", Num(t.eps()), ")"));
  if (!(t.grad_clip() >= 0)) {
    add("train.grad_clip", absl::StrCat("must be >= 0 (got ", Num(t.grad_clip()), ")"));
  }
  in_range("train.threads", t.threads(), 0, kMaxThreads);
  in_range("train.eval_every", t.eval_every(), 0, kMaxSteps);
  in_range("train.eval_batches", t.eval_batches(), 1, kMaxEvalBatches);
  in_range("train.sample_every", t.sample_every(), 0, kMaxSteps);
  if (t.sample_tokens() < 1) {
    add("train.sample_tokens", absl::StrCat("must be >= 1 (got ", t.sample_tokens(), ")"));
  } else if (m.seq_len() >= 1 && t.sample_tokens() > m.seq_len()) {
    add("train.sample_tokens",
        absl::StrCat("must be <= model.seq_len (", t.sample_tokens(), " > ", m.seq_len(), ")"));
  }
  if (t.eval_every() > 0 && !HasValidationData(s.data())) {
    add("train.eval_every", "needs data.val_path or data.val_paths (the validation tokens)");
  }
  // Evaluation runs the step's plan forward only, m microbatches at a time.
  if (t.eval_batches() >= 1 && p.microbatches() >= 1 && t.eval_batches() % p.microbatches() != 0) {
    add("train.eval_batches",
        absl::StrCat("must be a multiple of parallel.microbatches (", p.microbatches(), "; got ",
                     t.eval_batches(), "): evaluation runs the plan's microbatches as a whole"));
  }

  // A path with a control character (a carriage return, a newline, NUL, DEL) is never a real
  // file's name on purpose, cannot be written back to YAML unchanged (a trailing CR is read as a
  // line break: found by fuzz/job_spec_fuzzer.cc) and would forge lines in logs: refused.
  const auto no_control = [&](const std::string& field, const std::string& value) {
    for (size_t i = 0; i < value.size(); ++i) {
      const auto c = static_cast<unsigned char>(value[i]);
      if (c < 0x20 || c == 0x7f) {
        add(field, absl::StrFormat("must not contain control characters (byte 0x%02x at offset %d)",
                                   c, i));
        return;
      }
    }
  };
  const auto check_entries = [&](const std::string& one, const std::string& many,
                                 const std::string& value, bool has_one,
                                 const google::protobuf::RepeatedPtrField<std::string>& list,
                                 bool required) {
    if (has_one && !list.empty()) {
      add(many, absl::StrCat("give either ", one, " or ", many, ", not both"));
      return;
    }
    if (!list.empty()) {
      if (list.size() > kMaxDataPaths) {
        add(many, absl::StrCat("at most ", kMaxDataPaths, " entries (got ", list.size(), ")"));
      }
      for (int i = 0; i < list.size(); ++i) {
        const std::string field = absl::StrCat(many, "[", i, "]");
        if (list[i].empty()) add(field, "must be a non-empty path");
        no_control(field, list[i]);
        if (list[i].size() > kMaxPathBytes) {
          add(field,
              absl::StrCat("must be at most ", kMaxPathBytes, " bytes (got ", list[i].size(), ")"));
        }
      }
      return;
    }
    if (!has_one) {
      if (required)
        add(one, absl::StrCat("required (a token file, a folder or a glob; or ", many,
                              ": a list of them)"));
      return;
    }
    if (value.empty()) add(one, "must be a non-empty path");
    no_control(one, value);
    if (value.size() > kMaxPathBytes) {
      add(one, absl::StrCat("must be at most ", kMaxPathBytes, " bytes (got ", value.size(), ")"));
    }
  };
  check_entries("data.path", "data.paths", s.data().path(), !s.data().path().empty(),
                s.data().paths(), true);
  check_entries("data.val_path", "data.val_paths", s.data().val_path(), s.data().has_val_path(),
                s.data().val_paths(), false);

  if (s.checkpoint().dir().empty()) add("checkpoint.dir", "must be non-empty");
  no_control("checkpoint.dir", s.checkpoint().dir());
  if (s.model().has_init_from()) no_control("model.init_from", s.model().init_from());
  if (s.checkpoint().dir().size() > kMaxPathBytes) {
    add("checkpoint.dir", absl::StrCat("must be at most ", kMaxPathBytes, " bytes (got ",
                                       s.checkpoint().dir().size(), ")"));
  }
  in_range("checkpoint.every", s.checkpoint().every(), 0, kMaxSteps);
  in_range("checkpoint.keep_last", s.checkpoint().keep_last(), 0, kMaxSteps);
  // At least 1 MiB: a smaller limit only multiplies files (a tensor larger than the limit gets a
  // file of its own anyway); at most 1 PiB.
  in_range("checkpoint.max_shard_bytes", s.checkpoint().max_shard_bytes(), int64_t{1} << 20,
           int64_t{1} << 50);
  in_range("train.max_restarts", s.train().max_restarts(), 0, 1000);

  if (!ValidDevice(s.device())) {
    add("device",
        absl::StrCat("must be cpu, cuda or cuda:N (got \"", absl::CHexEscape(s.device()), "\")"));
  }
  const bool cuda = s.device().rfind("cuda", 0) == 0;
  if (s.precision() != "fp32" && s.precision() != "bf16") {
    add("precision",
        absl::StrCat("must be fp32 or bf16 (got \"", absl::CHexEscape(s.precision()), "\")"));
  } else if (s.precision() == "bf16" && !cuda) {
    add("precision", "bf16 needs device cuda (the CPU engine computes in fp32)");
  }
  // Refused at submit rather than when the ranks connect: what is built for CUDA but has not
  // yet passed its GPU tests — the recomputation (cuda_layer_stack_test), the data-parallel
  // groups and device ZeRO-1 (cuda_pipeline_test's Replicas/CudaDataParallel), tensor
  // parallelism (cuda_parallel_linear_test, cuda_layer_stack_test's TensorParallel cases,
  // cuda_pipeline_test's TensorRanks/CudaDataParallel). Lift a rule once its tests pass on a GPU:
  // the GPU bundle then runs examples/gpu-d2-p2.yaml / gpu-t2-p2.yaml against the CPU (until
  // then it runs them with VOCABPIPE_UNVERIFIED_CUDA once their tests passed in the same run).
  if (cuda && s.parallel().tensor() > 1 && !UnverifiedCudaAccepted("tensor")) {
    add("parallel.tensor",
        absl::StrCat("> 1 needs device cpu in this version (got ", s.parallel().tensor(), " on ",
                     s.device(), "): tensor parallelism on CUDA has not run on a GPU yet"));
  }
  if (cuda && s.parallel().recompute() != "none" &&
      OneOf(s.parallel().recompute(), kRecomputeModes) && !UnverifiedCudaAccepted("recompute")) {
    add("parallel.recompute",
        absl::StrCat("must be none on device cuda in this version (got ", s.parallel().recompute(),
                     " on ", s.device(),
                     "): the CUDA engine's recomputation has not run on a GPU yet"));
  }
  if (cuda && s.parallel().data() > 1 && !UnverifiedCudaAccepted("data")) {
    add("parallel.data",
        absl::StrCat("> 1 needs device cpu in this version (got ", s.parallel().data(), " on ",
                     s.device(), "): data parallelism on CUDA has not run on a GPU yet"));
  }
  if (cuda && s.model().architecture() == "llama" && s.model().heads() >= 1 &&
      s.model().kv_heads() >= 1 && s.model().hidden() % s.model().heads() == 0) {
    // The fused q|k|v row is hidden + 2·kv_heads·head_dim wide, k and v start at hidden and
    // hidden + kv_heads·head_dim: 16-byte aligned only when kv_heads·head_dim is a multiple of 8.
    const int64_t kv_dim =
        static_cast<int64_t>(s.model().kv_heads()) * (s.model().hidden() / s.model().heads());
    if (kv_dim % 8 != 0) {
      add("model.kv_heads",
          absl::StrCat("kv_heads·head_dim must be a multiple of 8 on cuda (got ", kv_dim, ")"));
    }
  }
  if (cuda) {
    // cuBLASLt needs 16-byte aligned rows: bf16 rows of h and f elements.
    if (s.model().hidden() % 8 != 0) {
      add("model.hidden",
          absl::StrCat("must be a multiple of 8 on cuda (got ", s.model().hidden(), ")"));
    }
    if (s.model().ffn_hidden() % 8 != 0) {
      add("model.ffn_hidden",
          absl::StrCat("must be a multiple of 8 on cuda (got ", s.model().ffn_hidden(), ")"));
    }
  }
  return errors;
}

bool Covered(const std::string& path, const std::set<std::string>& failed) {
  for (const std::string& f : failed) {
    if (path == f ||
        (path.size() > f.size() && path.compare(0, f.size(), f) == 0 && path[f.size()] == '.')) {
      return true;
    }
  }
  return false;
}

std::string ResolvePath(const std::string& path, const std::filesystem::path& base) {
  std::filesystem::path p(path);
  if (p.is_relative()) p = base / p;
  return p.lexically_normal().string();
}

// ---------------------------------------------------------------------------------------------
// Emission.

// A string that a YAML reader would take for null, a boolean or a number must be quoted.
bool NeedsQuotes(const std::string& s) {
  if (s.empty()) return true;
  const std::string lower = absl::AsciiStrToLower(s);
  if (lower == "~" || lower == "null" || lower == "true" || lower == "false" || lower == "yes" ||
      lower == "no" || lower == "on" || lower == "off" || lower == "y" || lower == "n") {
    return true;
  }
  double d;
  int64_t i;
  bool oor;
  return ParseDouble(s, &d) || ParseInt64(s, &i, &oor) || oor || lower == ".inf" ||
         lower == "-.inf" || lower == ".nan";
}

std::string ShortestDouble(double v) {
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, ptr);
}

void EmitScalar(YAML::Emitter& out, const pb::Message& msg, const pb::FieldDescriptor* field,
                int index) {
  using FD = pb::FieldDescriptor;
  const pb::Reflection* r = msg.GetReflection();
  const bool rep = field->is_repeated();
  switch (field->cpp_type()) {
    case FD::CPPTYPE_INT32:
      out << (rep ? r->GetRepeatedInt32(msg, field, index) : r->GetInt32(msg, field));
      break;
    case FD::CPPTYPE_INT64:
      out << (rep ? r->GetRepeatedInt64(msg, field, index) : r->GetInt64(msg, field));
      break;
    case FD::CPPTYPE_UINT32:
      out << (rep ? r->GetRepeatedUInt32(msg, field, index) : r->GetUInt32(msg, field));
      break;
    case FD::CPPTYPE_UINT64:
      out << (rep ? r->GetRepeatedUInt64(msg, field, index) : r->GetUInt64(msg, field));
      break;
    case FD::CPPTYPE_DOUBLE:
      out << ShortestDouble(rep ? r->GetRepeatedDouble(msg, field, index)
                                : r->GetDouble(msg, field));
      break;
    case FD::CPPTYPE_FLOAT:
      out << ShortestDouble(rep ? r->GetRepeatedFloat(msg, field, index) : r->GetFloat(msg, field));
      break;
    case FD::CPPTYPE_BOOL:
      out << (rep ? r->GetRepeatedBool(msg, field, index) : r->GetBool(msg, field));
      break;
    case FD::CPPTYPE_STRING: {
      const std::string s =
          rep ? r->GetRepeatedString(msg, field, index) : r->GetString(msg, field);
      if (NeedsQuotes(s)) out << YAML::DoubleQuoted;
      out << s;
      break;
    }
    case FD::CPPTYPE_ENUM:
      out << (rep ? r->GetRepeatedEnum(msg, field, index) : r->GetEnum(msg, field))->name();
      break;
    case FD::CPPTYPE_MESSAGE:
      break;
  }
}

void EmitMessage(YAML::Emitter& out, const pb::Message& msg) {
  const pb::Descriptor* desc = msg.GetDescriptor();
  const pb::Reflection* r = msg.GetReflection();
  out << YAML::BeginMap;
  for (int i = 0; i < desc->field_count(); ++i) {
    const pb::FieldDescriptor* field = desc->field(i);
    if (field->is_repeated()) {
      const int n = r->FieldSize(msg, field);
      if (n == 0) continue;
      out << YAML::Key << field->name() << YAML::Value << YAML::Flow << YAML::BeginSeq;
      for (int j = 0; j < n; ++j) {
        if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
          EmitMessage(out, r->GetRepeatedMessage(msg, field, j));
        } else {
          EmitScalar(out, msg, field, j);
        }
      }
      out << YAML::EndSeq;
      continue;
    }
    // Fields with presence are written when set; proto3 implicit fields (model sizes,
    // data.path) always, so that a missing required value stays visible.
    if (field->has_presence() && !r->HasField(msg, field)) continue;
    out << YAML::Key << field->name() << YAML::Value;
    if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      EmitMessage(out, r->GetMessage(msg, field));
    } else {
      EmitScalar(out, msg, field, -1);
    }
  }
  out << YAML::EndMap;
}

}  // namespace

void ApplyDefaults(JobSpec* spec) {
  if (!spec->has_name()) spec->set_name("job");
  if (!spec->has_device()) spec->set_device("cpu");
  if (!spec->has_precision()) {
    spec->set_precision(spec->device().rfind("cuda", 0) == 0 ? "bf16" : "fp32");
  }

  auto* m = spec->mutable_model();
  if (!m->has_tie_embeddings()) m->set_tie_embeddings(false);
  if (!m->has_architecture()) m->set_architecture("gpt2");
  if (!m->has_init_from()) m->set_init_from("");
  // Set for gpt2 too (every optional field has a value after defaults), where they are inert.
  if (!m->has_kv_heads()) m->set_kv_heads(m->heads());
  if (!m->has_rms_eps()) m->set_rms_eps(kDefaultRmsEps);
  if (!m->has_rope_theta()) m->set_rope_theta(kDefaultRopeTheta);
  if (m->architecture() == "llama") {
    // SwiGLU's three matrices at about the parameters of a 4h GELU MLP: 8h/3, rounded up to a
    // multiple of 8 (Llama rounds to 256; 8 keeps small test models small).
    if (!m->has_ffn_hidden()) {
      const int64_t f = (8 * static_cast<int64_t>(m->hidden()) + 2) / 3;
      m->set_ffn_hidden(static_cast<int32_t>(
          std::clamp<int64_t>((f + 7) / 8 * 8, 0, std::numeric_limits<int32_t>::max())));
    }
  }
  if (!m->has_ffn_hidden()) {
    m->set_ffn_hidden(static_cast<int32_t>(std::clamp<int64_t>(
        4 * static_cast<int64_t>(m->hidden()), 0, std::numeric_limits<int32_t>::max())));
  }

  auto* p = spec->mutable_parallel();
  if (!p->has_pipeline()) p->set_pipeline(1);
  if (!p->has_schedule()) p->set_schedule("1f1b");
  if (!p->has_vocab()) p->set_vocab("vocab2");
  if (!p->has_seq_chunks()) p->set_seq_chunks(1);
  if (!p->has_microbatch_size()) p->set_microbatch_size(1);
  if (!p->has_microbatches()) p->set_microbatches(1);
  if (!p->has_chunks_per_rank()) p->set_chunks_per_rank(2);
  if (!p->has_memory_budget_bytes()) p->set_memory_budget_bytes(0);
  if (!p->has_max_pending_t()) p->set_max_pending_t(1);
  if (!p->has_data()) p->set_data(1);
  if (!p->has_zero()) p->set_zero(0);
  if (!p->has_tensor()) p->set_tensor(1);
  if (!p->has_sequence_parallel()) p->set_sequence_parallel(true);
  if (!p->has_recompute()) p->set_recompute("none");
  if (!p->has_world()) p->set_world(0);

  auto* t = spec->mutable_train();
  if (!t->has_steps()) t->set_steps(10);
  if (!t->has_lr()) t->set_lr(3e-4);
  if (!t->has_lr_schedule()) t->set_lr_schedule("constant");
  if (!t->has_warmup_steps()) t->set_warmup_steps(0);
  if (!t->has_min_lr()) t->set_min_lr(0.0);
  if (!t->has_weight_decay()) t->set_weight_decay(0.1);
  if (!t->has_beta1()) t->set_beta1(0.9);
  if (!t->has_beta2()) t->set_beta2(0.95);
  if (!t->has_eps()) t->set_eps(1e-8);
  if (!t->has_grad_clip()) t->set_grad_clip(0.0);
  if (!t->has_seed()) t->set_seed(1234);
  if (!t->has_threads()) t->set_threads(0);
  if (!t->has_eval_every()) t->set_eval_every(0);
  if (!t->has_eval_batches()) t->set_eval_batches(std::max(1, p->microbatches()));
  if (!t->has_sample_every()) t->set_sample_every(0);
  if (!t->has_sample_tokens()) t->set_sample_tokens(std::clamp(m->seq_len(), 1, 64));
  if (!t->has_max_restarts()) t->set_max_restarts(3);
  if (!t->has_elastic()) t->set_elastic(false);

  auto* d = spec->mutable_data();
  if (!d->has_shuffle()) d->set_shuffle(false);

  auto* c = spec->mutable_checkpoint();
  if (!c->has_dir()) c->set_dir(absl::StrCat("runs/", spec->name()));
  if (!c->has_every()) c->set_every(0);
  if (!c->has_keep_last()) c->set_keep_last(0);
  if (!c->has_max_shard_bytes()) c->set_max_shard_bytes(5'000'000'000);
}

std::vector<std::string> DataPathEntries(const vocabpipe::v1::DataSpec& data) {
  if (!data.paths().empty()) return {data.paths().begin(), data.paths().end()};
  return {data.path()};
}

std::vector<std::string> ValPathEntries(const vocabpipe::v1::DataSpec& data) {
  if (!data.val_paths().empty()) return {data.val_paths().begin(), data.val_paths().end()};
  if (data.has_val_path()) return {data.val_path()};
  return {};
}

bool HasValidationData(const vocabpipe::v1::DataSpec& data) {
  return data.has_val_path() || !data.val_paths().empty();
}

absl::Status ValidateJobSpec(const JobSpec& spec) {
  const std::vector<FieldError> errors = CollectValidationErrors(spec);
  if (errors.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(JoinErrors(errors));
}

absl::Status CheckUtf8(std::string_view text, std::string_view field) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f, min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f, min = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    }
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      ok = (p[i + k] & 0xc0) == 0x80;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    ok = ok && cp >= min && cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
    if (!ok) {
      size_t line = 1, column = 1;
      for (size_t k = 0; k < i; ++k) {
        if (p[k] == '\n') {
          ++line;
          column = 1;
        } else if ((p[k] & 0xc0) != 0x80) {
          ++column;  // columns count characters, not bytes
        }
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: byte %d (line %d, column %d) is not valid UTF-8; a job spec must be UTF-8 text",
          field, i, line, column));
    }
    i += len;
  }
  return absl::OkStatus();
}

absl::StatusOr<JobSpec> ParseJobSpec(std::string_view text, std::string_view base_dir) {
  if (text.size() > kMaxJobSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("(root): the job spec has ", text.size(),
                                                   " bytes, more than the limit of ",
                                                   kMaxJobSpecBytes, " bytes"));
  }
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    // yaml-cpp's messages may end with a piece of the text ("unknown escape character: X");
    // only the part before the first colon is shown.
    std::string what = e.msg.substr(0, e.msg.find(':'));
    return absl::InvalidArgumentError(
        absl::StrFormat("(root): invalid YAML/JSON at line %d, column %d: %s", e.mark.line + 1,
                        e.mark.column + 1, what));
  }
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat("(root): expected a mapping of job spec fields, got ", RootKind(root),
                     " (not a job spec)"));
  }
  {
    // A mapping none of whose keys is a JobSpec field is some other file (a config, a
    // manifest): refuse it as a whole, without quoting its keys.
    bool any_known = false;
    for (auto it = root.begin(); it != root.end() && !any_known; ++it) {
      any_known = it->first.IsScalar() &&
                  JobSpec::descriptor()->FindFieldByName(it->first.Scalar()) != nullptr;
    }
    if (!any_known && root.size() > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("(root): not a job spec: none of its ", root.size(),
                       " top-level keys is a job spec field (name, model, parallel, train, data, "
                       "checkpoint, device, precision)"));
    }
  }

  JobSpec spec;
  YamlToProto mapper;
  try {
    mapper.Fill(root, "", &spec);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrFormat("(root): invalid YAML/JSON: %s", e.msg));
  }

  std::vector<FieldError> errors = std::move(mapper.errors);
  // Required fields: proto3 cannot tell a missing model.hidden from 0, the text can.
  std::set<std::string> skip = mapper.failed;
  if (!mapper.present.contains("model")) {
    if (!mapper.failed.contains("model")) {
      errors.push_back(
          FieldError{"model", "required (with layers, hidden, heads, vocab_size, seq_len)"});
    }
    skip.insert("model");
  } else {
    for (const char* f : {"layers", "hidden", "heads", "vocab_size", "seq_len"}) {
      const std::string path = Child("model", f);
      if (!mapper.present.contains(path) && !mapper.failed.contains(path)) {
        errors.push_back(FieldError{path, "required"});
        skip.insert(path);
      }
    }
  }
  if (!mapper.present.contains("data.path") && !mapper.present.contains("data.paths") &&
      !Covered("data.path", mapper.failed) && !Covered("data.paths", mapper.failed)) {
    errors.push_back(FieldError{"data.path", "required (or data.paths: a list of shards)"});
    skip.insert("data.path");
  }
  for (FieldError& e : CollectValidationErrors(spec)) {
    if (!Covered(e.path, skip)) errors.push_back(std::move(e));
  }
  if (!errors.empty()) return absl::InvalidArgumentError(JoinErrors(errors));
  // Every string field was checked above, naming the field; bytes that are not UTF-8 can still
  // sit in a comment or a key, and the text (a proto3 string when it is sent) must be UTF-8.
  if (absl::Status st = CheckUtf8(text); !st.ok()) return st;
  if (absl::Status st = CheckUtf8(base_dir, "base_dir"); !st.ok()) return st;

  ApplyDefaults(&spec);
  std::error_code ec;
  std::filesystem::path base(base_dir.empty() ? std::string(".") : std::string(base_dir));
  base = std::filesystem::absolute(base, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat("(root): cannot resolve base directory \"",
                                                   std::string(base_dir), "\": ", ec.message()));
  }
  if (!spec.data().path().empty()) {
    spec.mutable_data()->set_path(ResolvePath(spec.data().path(), base));
  }
  for (std::string& p : *spec.mutable_data()->mutable_paths()) p = ResolvePath(p, base);
  if (spec.data().has_val_path()) {
    spec.mutable_data()->set_val_path(ResolvePath(spec.data().val_path(), base));
  }
  for (std::string& p : *spec.mutable_data()->mutable_val_paths()) p = ResolvePath(p, base);
  spec.mutable_checkpoint()->set_dir(ResolvePath(spec.checkpoint().dir(), base));
  if (!spec.model().init_from().empty()) {
    spec.mutable_model()->set_init_from(ResolvePath(spec.model().init_from(), base));
  }
  return spec;
}

absl::StatusOr<JobSpec> LoadJobSpecFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec(errno, std::generic_category());
    return absl::NotFoundError(absl::StrCat(path, ": cannot open job spec: ", ec.message()));
  }
  std::string text(kMaxJobSpecBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxJobSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": (root): larger than the job spec limit of ", kMaxJobSpecBytes, " bytes"));
  }
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  absl::StatusOr<JobSpec> spec = ParseJobSpec(text, dir.string());
  if (!spec.ok()) {
    // Every line starts with the file, like a compiler diagnostic.
    std::vector<std::string> lines = absl::StrSplit(spec.status().message(), '\n');
    for (std::string& line : lines) line = absl::StrCat(path, ": ", line);
    return absl::Status(spec.status().code(), absl::StrJoin(lines, "\n"));
  }
  return spec;
}

std::string JobSpecToYaml(const JobSpec& spec) {
  YAML::Emitter out;
  out.SetIndent(2);
  EmitMessage(out, spec);
  return absl::StrCat(out.c_str(), "\n");
}

}  // namespace vp::spec
