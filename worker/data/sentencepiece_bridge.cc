#include "worker/data/sentencepiece_bridge.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <system_error>

#include "worker/sharedlib/shared_library.h"

namespace vp::data::spbridge {
namespace {

constexpr char kPluginName[] = "libvp_sentencepiece.so";

// The plugin's functions (sentencepiece_plugin.cc).
struct Plugin {
  void (*train)(const char* const*, const size_t*, size_t, const char*, int, int, const char*,
                std::string*, std::string*) = nullptr;
  void* (*create)() = nullptr;
  void (*destroy)(void*) = nullptr;
  void (*load)(void*, const char*, size_t, std::string*) = nullptr;
  void (*encode)(const void*, const char*, size_t, std::vector<int>*, std::string*) = nullptr;
  void (*decode)(const void*, const std::vector<int>*, std::string*, std::string*) = nullptr;
  int (*piece_size)(const void*) = nullptr;
  int (*piece_to_id)(const void*, const char*, size_t) = nullptr;
  int (*unk_id)(const void*) = nullptr;
  int (*is_byte)(const void*, int) = nullptr;
  int (*is_control)(const void*, int) = nullptr;
  std::string error;  // why the plugin could not be loaded
};

Plugin LoadPlugin() {
  Plugin p;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("VOCABPIPE_SENTENCEPIECE_PLUGIN"); env && *env) {
    candidates.emplace_back(env);
  }
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back((self.parent_path() / kPluginName).string());
    candidates.push_back((self.parent_path().parent_path() / "lib" / kPluginName).string());
  }
#ifdef VP_SENTENCEPIECE_PLUGIN
  candidates.emplace_back(VP_SENTENCEPIECE_PLUGIN);
#endif
  std::optional<sharedlib::SharedLibrary> lib;
  std::string tried;
  for (const std::string& c : candidates) {
    if (!std::filesystem::exists(c, ec)) {
      tried += (tried.empty() ? "" : ", ") + c;
      continue;
    }
    // Never closed: the process keeps the plugin (and its copy of protobuf) to its end, which
    // resolves its own symbols first (deep bind).
    auto opened = sharedlib::SharedLibrary::Open("the SentencePiece plugin", {c},
                                                 /*deep_bind=*/true);
    if (!opened.ok()) {
      p.error = std::string(opened.status().message());  // names the path and the loader's why
      return p;
    }
    lib = std::move(*opened);
    break;
  }
  if (!lib.has_value()) {
    p.error = std::string("the SentencePiece plugin ") + kPluginName +
              " was not found (looked at " + tried +
              "; set VOCABPIPE_SENTENCEPIECE_PLUGIN to its path)";
    return p;
  }
  const bool ok =
      lib->Bind("vp_sp_train", &p.train).ok() && lib->Bind("vp_sp_new", &p.create).ok() &&
      lib->Bind("vp_sp_delete", &p.destroy).ok() && lib->Bind("vp_sp_load", &p.load).ok() &&
      lib->Bind("vp_sp_encode", &p.encode).ok() && lib->Bind("vp_sp_decode", &p.decode).ok() &&
      lib->Bind("vp_sp_piece_size", &p.piece_size).ok() &&
      lib->Bind("vp_sp_piece_to_id", &p.piece_to_id).ok() &&
      lib->Bind("vp_sp_unk_id", &p.unk_id).ok() && lib->Bind("vp_sp_is_byte", &p.is_byte).ok() &&
      lib->Bind("vp_sp_is_control", &p.is_control).ok();
  if (!ok) p.error = std::string(kPluginName) + ": missing a vp_sp_* function (a stale build?)";
  return p;
}

// Loaded once per process, on first use; immutable afterwards.
const Plugin& GetPlugin() {
  static const Plugin plugin = LoadPlugin();
  return plugin;
}

}  // namespace

void Processor::Deleter::operator()(void* p) const {
  if (p != nullptr) GetPlugin().destroy(p);
}

std::string Train(const std::vector<std::string_view>& documents, const TrainParams& params,
                  std::string* model) {
  const Plugin& p = GetPlugin();
  if (!p.error.empty()) return p.error;
  std::vector<const char*> data;
  std::vector<size_t> lens;
  data.reserve(documents.size());
  lens.reserve(documents.size());
  for (std::string_view d : documents) {
    data.push_back(d.data());
    lens.push_back(d.size());
  }
  std::string error;
  p.train(data.data(), lens.data(), documents.size(), params.model_type.c_str(), params.vocab_size,
          params.threads, params.eot_piece.c_str(), model, &error);
  return error;
}

Processor::Processor() = default;
Processor::~Processor() = default;
Processor::Processor(Processor&&) noexcept = default;
Processor& Processor::operator=(Processor&&) noexcept = default;

std::string Processor::Load(std::string_view serialized) {
  const Plugin& p = GetPlugin();
  if (!p.error.empty()) return p.error;
  sp_.reset(p.create());
  std::string error;
  p.load(sp_.get(), serialized.data(), serialized.size(), &error);
  return error;
}

std::string Processor::Encode(std::string_view text, std::vector<int>* ids) const {
  std::string error;
  GetPlugin().encode(sp_.get(), text.data(), text.size(), ids, &error);
  return error;
}

std::string Processor::Decode(const std::vector<int>& ids, std::string* text) const {
  std::string error;
  GetPlugin().decode(sp_.get(), &ids, text, &error);
  return error;
}

int Processor::PieceSize() const { return GetPlugin().piece_size(sp_.get()); }
int Processor::PieceToId(std::string_view piece) const {
  return GetPlugin().piece_to_id(sp_.get(), piece.data(), piece.size());
}
int Processor::UnkId() const { return GetPlugin().unk_id(sp_.get()); }
bool Processor::IsByte(int id) const { return GetPlugin().is_byte(sp_.get(), id) != 0; }
bool Processor::IsControl(int id) const { return GetPlugin().is_control(sp_.get(), id) != 0; }

}  // namespace vp::data::spbridge
