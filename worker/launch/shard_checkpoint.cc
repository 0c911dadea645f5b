#include "worker/launch/shard_checkpoint.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "proto/safefs/dir.h"
#include "worker/launch/run_dir.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/safetensors.h"

namespace vp::launch {
namespace fs = std::filesystem;

namespace {

constexpr char kShardKey[] = "vocab_shard.";
// A tensor-parallel slice of a layer tensor: "<dim> <parts> <tensor rank> <t>" (split.h).
constexpr char kSliceKey[] = "tensor_slice.";
constexpr char kManifest[] = "MANIFEST.json";
constexpr char kManifestFormat[] = "vocabpipe-shard-manifest";
constexpr char kModelFile[] = "model.safetensors";
constexpr char kOptimizerFile[] = "optimizer.safetensors";
constexpr char kPieceKey[] = "piece.";  // range files: "piece.<entry>" = its first element

struct FileDigest {
  int64_t bytes = 0;
  std::string sha256;  // lowercase hex
};

// SHA-256 of a file of `dir` (OpenSSL's libcrypto), read in 1 MiB blocks, by handle. With
// `sync` the file is fsynced first: a checkpoint must survive a power loss once its manifest
// is in place, so its data (and the directory entries naming it) reach the disk first.
absl::StatusOr<FileDigest> DigestFile(const safefs::Dir& dir, const std::string& name,
                                      bool sync = false) {
  auto fd = dir.OpenFile(name, O_RDONLY);
  if (!fd.ok()) {
    if (absl::IsNotFound(fd.status())) {
      return absl::NotFoundError(absl::StrCat(dir.PathOf(name), ": cannot open"));
    }
    return fd.status();
  }
  if (sync && fsync(fd->get()) != 0) {
    return absl::InternalError(absl::StrCat(dir.PathOf(name), ": fsync failed"));
  }
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (ctx == nullptr || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("SHA-256: cannot initialise libcrypto's digest");
  }
  std::vector<unsigned char> buf(1 << 20);
  FileDigest d;
  ssize_t n = 0;
  while ((n = read(fd->get(), buf.data(), buf.size())) > 0) {
    EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
    d.bytes += n;
  }
  if (n < 0) return absl::DataLossError(absl::StrCat(dir.PathOf(name), ": read failed"));
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), md, &len);
  static constexpr char kHex[] = "0123456789abcdef";
  for (unsigned int i = 0; i < len; ++i) {
    d.sha256.push_back(kHex[md[i] >> 4]);
    d.sha256.push_back(kHex[md[i] & 15]);
  }
  return d;
}

std::string StepName(int64_t step) { return absl::StrCat("step_", step); }
std::string RankName(int rank) { return absl::StrCat("rank_", rank); }

// <run_dir>/step_<N>/rank_<R> by handle, one component at a time (create: made when missing).
absl::StatusOr<safefs::Dir> ShardFolder(const std::string& run_dir, int64_t step, int rank,
                                        bool create) {
  auto run = safefs::Dir::Open(run_dir);
  if (!run.ok()) return run.status();
  return run->Walk(absl::StrCat(StepName(step), "/", RankName(rank)), create);
}

// The step_<N> folders of a run, newest first.
// A link named step_<N> is one too (it is refused, by name, when it is opened).
std::vector<int64_t> StepFolders(const safefs::Dir& run) {
  std::vector<int64_t> steps;
  auto names = run.List();
  if (!names.ok()) return steps;
  for (const std::string& name : *names) {
    int64_t v = 0;
    const safefs::Kind kind = run.KindOf(name);
    if (name.rfind("step_", 0) == 0 && absl::SimpleAtoi(name.substr(5), &v) && v >= 0 &&
        (kind == safefs::Kind::kDirectory || kind == safefs::Kind::kLink)) {
      steps.push_back(v);
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

// Verifies all `world` shards of `step`; returns the run id they share.
absl::StatusOr<std::string> VerifyStep(const std::string& run_dir, int64_t step, int world) {
  std::string run;
  for (int r = 0; r < world; ++r) {
    auto id = VerifyRankShard(run_dir, step, r, world);
    if (!id.ok()) return id.status();
    if (r == 0) {
      run = *id;
    } else if (*id != run) {
      return absl::DataLossError(absl::StrCat(ShardDir(run_dir, step, r), ": written by run ", *id,
                                              ", rank 0's shard by run ", run));
    }
  }
  return run;
}

// The saved shape of a tensor: vocabulary shards lose their padding rows.
std::vector<int64_t> SavedShape(const engine::ParamTensor& t) {
  std::vector<int64_t> shape = t.shape;
  if (t.vocab_shard) shape[0] = t.valid_rows;
  return shape;
}
size_t SavedNumel(const engine::ParamTensor& t) {
  size_t n = 1;
  for (int64_t d : SavedShape(t)) n *= static_cast<size_t>(d);
  return n;
}

struct ShardRows {
  int64_t begin = 0, rows = 0;
};

absl::StatusOr<ShardRows> ParseShardRows(const std::string& file, const std::string& name,
                                         const std::string& value) {
  std::vector<std::string> parts = absl::StrSplit(value, ' ', absl::SkipEmpty());
  ShardRows r;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &r.begin) ||
      !absl::SimpleAtoi(parts[1], &r.rows) || r.begin < 0 || r.rows < 0) {
    return absl::DataLossError(absl::StrCat(file, ": metadata ", kShardKey, name, " = \"", value,
                                            "\" is not \"<global_row_begin> <rows>\""));
  }
  return r;
}

// A saved tensor-parallel slice: how the whole tensor was cut and which rank's part this is.
struct SliceInfo {
  engine::tp::Split split;
  int rank = 0, size = 1;
};

absl::StatusOr<SliceInfo> ParseSlice(const std::string& file, const std::string& name,
                                     const std::string& value, size_t dims) {
  std::vector<std::string> parts = absl::StrSplit(value, ' ', absl::SkipEmpty());
  SliceInfo s;
  if (parts.size() != 4 || !absl::SimpleAtoi(parts[0], &s.split.dim) ||
      !absl::SimpleAtoi(parts[1], &s.split.parts) || !absl::SimpleAtoi(parts[2], &s.rank) ||
      !absl::SimpleAtoi(parts[3], &s.size) || s.split.dim < 0 ||
      static_cast<size_t>(s.split.dim) >= dims || s.split.parts < 1 || s.size < 2 ||
      s.size > 1024 || s.rank < 0 || s.rank >= s.size) {
    return absl::DataLossError(absl::StrCat(file, ": metadata ", kSliceKey, name, " = \"", value,
                                            "\" is not \"<dim> <parts> <rank> <t>\""));
  }
  return s;
}

// The whole shape of a saved slice of `shape`.
std::vector<int64_t> WholeShape(std::vector<int64_t> shape, const SliceInfo& s) {
  shape[s.split.dim] *= s.size;
  return shape;
}

}  // namespace

std::string OptimizerRangeFile(int replica, int replicas) {
  return absl::StrCat("optimizer-", replica, "-of-", replicas, ".safetensors");
}

absl::Status PrepareShardSave(const std::string& run_dir, int64_t step, int rank) {
  auto dir = ShardFolder(run_dir, step, rank, /*create=*/true);
  if (!dir.ok()) return dir.status();
  if (auto st = dir->Remove(kManifest); !st.ok()) return st;
  return dir->Remove("DONE");
}

absl::Status SaveOptimizerRange(const std::string& run_dir, int64_t step, int rank,
                                const engine::RankModel& model, engine::AdamW& shard, int replica,
                                int replicas) {
  auto dir = ShardFolder(run_dir, step, rank, /*create=*/true);
  if (!dir.ok()) return dir.status();
  const size_t begin = shard.shard_begin(), end = begin + shard.count();
  std::vector<runtime::TensorView> pieces;
  std::map<std::string, std::string> meta = {
      {"format", "vocabpipe-optimizer-range"}, {"adamw_step", absl::StrCat(shard.step())},
      {"replica", absl::StrCat(replica)},      {"replicas", absl::StrCat(replicas)},
      {"range_begin", absl::StrCat(begin)},    {"range_count", absl::StrCat(shard.count())}};
  for (const engine::ParamTensor& t : model.tensors()) {
    // The saved elements of a tensor are the first ones of its flat span (a vocabulary shard
    // loses its padding rows at the end); this replica holds those inside [begin, end).
    const size_t numel = SavedNumel(t);
    const size_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + numel);
    if (lo >= hi) continue;
    const int64_t len = static_cast<int64_t>(hi - lo);
    const std::pair<const char*, const float*> moments[] = {{"exp_avg.", shard.m().data()},
                                                            {"exp_avg_sq.", shard.v().data()}};
    for (const auto& [prefix, base] : moments) {
      const std::string name = prefix + t.name;
      pieces.push_back({name, {len}, base + (lo - begin)});
      meta[kPieceKey + name] = absl::StrCat(lo - t.offset);
    }
  }
  return runtime::WriteSafetensorsAt(*dir, OptimizerRangeFile(replica, replicas), pieces, meta);
}

absl::Status SaveRankShard(const std::string& run_dir, int64_t step, int rank, int world,
                           const engine::RankModel& model, engine::AdamW& optimizer,
                           const std::string& run_id, int optimizer_ranges) {
  // The run, step and shard folders by handle (created when missing): a link planted in
  // place of any of them, or of a file below, is refused and nothing is written through it.
  auto run = safefs::Dir::Open(run_dir);
  if (!run.ok()) return run.status();
  auto step_dir = run->Sub(StepName(step), /*create=*/true);
  if (!step_dir.ok()) return step_dir.status();
  auto dir = step_dir->Sub(RankName(rank), /*create=*/true);
  if (!dir.ok()) return dir.status();
  // First: the shard no longer counts.
  if (auto st = dir->Remove(kManifest); !st.ok()) return st;
  if (auto st = dir->Remove("DONE"); !st.ok()) return st;
  std::vector<runtime::TensorView> weights, moments;
  std::map<std::string, std::string> meta = {{"format", "vocabpipe-shard"},
                                             {"rank", absl::StrCat(rank)},
                                             {"world", absl::StrCat(world)},
                                             {"step", absl::StrCat(step)}};
  for (const engine::ParamTensor& t : model.tensors()) {
    const std::vector<int64_t> shape = SavedShape(t);
    weights.push_back({t.name, shape, model.params() + t.offset});
    if (optimizer_ranges == 0) {
      moments.push_back({"exp_avg." + t.name, shape, optimizer.m().data() + t.offset});
      moments.push_back({"exp_avg_sq." + t.name, shape, optimizer.v().data() + t.offset});
    }
    if (t.vocab_shard) {
      meta[kShardKey + t.name] = absl::StrCat(t.global_row_begin, " ", t.valid_rows);
    }
    const engine::tp::TensorGroup& group = model.tensor_group();
    if (!t.vocab_shard && !t.split.replicated() && group.size() > 1) {
      meta[kSliceKey + t.name] =
          absl::StrCat(t.split.dim, " ", t.split.parts, " ", group.rank(), " ", group.size());
    }
  }
  if (auto st = runtime::WriteSafetensorsAt(*dir, kModelFile, weights, meta); !st.ok()) {
    return st;
  }
  // The files the manifest lists: the model, the optimizer state (one file, or the ranges the
  // replicas wrote: SaveOptimizerRange) and DONE.
  std::vector<std::string> listed = {kModelFile};
  if (optimizer_ranges == 0) {
    if (auto st = runtime::WriteSafetensorsAt(*dir, kOptimizerFile, moments,
                                              {{"adamw_step", absl::StrCat(optimizer.step())}});
        !st.ok()) {
      return st;
    }
    listed.push_back(kOptimizerFile);
  } else {
    for (int r = 0; r < optimizer_ranges; ++r) {
      listed.push_back(OptimizerRangeFile(r, optimizer_ranges));
    }
  }
  listed.push_back("DONE");
  if (auto st = dir->WriteFileAtomically("DONE", absl::StrCat(step, "\n")); !st.ok()) return st;
  nlohmann::json files = nlohmann::json::object();
  for (const std::string& name : listed) {
    auto d = DigestFile(*dir, name, /*sync=*/true);
    if (!d.ok()) return d.status();
    files[name] = {{"bytes", d->bytes}, {"sha256", d->sha256}};
  }
  const nlohmann::json manifest = {{"format", kManifestFormat},
                                   {"version", 1},
                                   {"run_id", run_id},
                                   {"step", step},
                                   {"rank", rank},
                                   {"world", world},
                                   {"tensor", model.tensor_group().size()},
                                   {"files", files}};
  // The manifest goes in by rename once its content is on disk; then the directories, so the
  // names survive too.
  if (auto st = dir->WriteFileAtomically(kManifest, manifest.dump(2) + "\n", /*sync=*/true);
      !st.ok()) {
    return st;
  }
  for (const safefs::Dir* d : {&*dir, &*step_dir, &*run}) {
    if (auto st = d->Sync(); !st.ok()) return st;
  }
  return absl::OkStatus();
}

namespace {

// The files a manifest's "files" must list: model.safetensors, DONE, and the optimizer state
// as optimizer.safetensors or as the complete set optimizer-R-of-D.safetensors, R in [0, D)
// (ZeRO-1: each replica's range). Anything else listed is refused (a manifest names files of
// its own folder only).
absl::StatusOr<std::vector<std::string>> ShardFilesOf(const nlohmann::json& files) {
  std::vector<std::string> out = {kModelFile, "DONE"};
  int replicas = -1;
  std::vector<bool> seen;
  bool single = false;
  for (const auto& item : files.items()) {
    const std::string& name = item.key();
    if (name == kModelFile || name == "DONE") continue;
    if (name == kOptimizerFile) {
      single = true;
      continue;
    }
    std::vector<std::string> parts = absl::StrSplit(name, absl::ByAnyChar("-."));
    int r = -1, d = -1;
    if (parts.size() != 5 || parts[0] != "optimizer" || parts[2] != "of" ||
        parts[4] != "safetensors" || !absl::SimpleAtoi(parts[1], &r) ||
        !absl::SimpleAtoi(parts[3], &d) || d < 1 || d > 4096 || r < 0 || r >= d ||
        name != OptimizerRangeFile(r, d) || (replicas >= 0 && d != replicas)) {
      return absl::InvalidArgumentError(absl::StrCat("files lists an unexpected file ", name));
    }
    if (replicas < 0) seen.assign(d, false);
    replicas = d;
    seen[r] = true;
  }
  if (single == (replicas >= 0)) {
    return absl::InvalidArgumentError(
        "files must list the optimizer state once: optimizer.safetensors or every "
        "optimizer-R-of-D.safetensors");
  }
  if (single) {
    out.push_back(kOptimizerFile);
  } else {
    for (int r = 0; r < replicas; ++r) {
      if (!seen[r]) {
        return absl::InvalidArgumentError(
            absl::StrCat("files lacks ", OptimizerRangeFile(r, replicas)));
      }
      out.push_back(OptimizerRangeFile(r, replicas));
    }
  }
  return out;
}

// A shard whose manifest verified: the run that wrote it and the files it lists
// (ShardFilesOf's order).
struct VerifiedShard {
  std::string run_id;
  std::vector<std::string> files;
};

// VerifyRankShard on an open shard folder.
absl::StatusOr<VerifiedShard> VerifyShardIn(const safefs::Dir& dir, int64_t step, int rank,
                                            int world) {
  const std::string path = dir.PathOf(kManifest);
  auto text = dir.ReadFile(kManifest, 1 << 20);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir.path(), ": no ", kManifest, "; the shard is incomplete"));
    }
    return text.status();
  }
  const nlohmann::json m = nlohmann::json::parse(*text, nullptr, false);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(path, ": ", why));
  };
  if (m.is_discarded() || !m.is_object()) return bad("not a JSON object");
  if (m.value("format", "") != kManifestFormat) {
    return bad(absl::StrCat("format is not \"", kManifestFormat, "\""));
  }
  const auto integer = [&](const char* key) -> int64_t {
    return m.contains(key) && m[key].is_number_integer() ? m[key].get<int64_t>() : -1;
  };
  if (integer("step") != step) return bad(absl::StrCat("step is not ", step));
  if (integer("rank") != rank) return bad(absl::StrCat("rank is not ", rank));
  if (integer("world") != world) {
    return bad(absl::StrCat("world size ", integer("world"), " is not the plan's ", world));
  }
  if (!m.contains("run_id") || !m["run_id"].is_string()) return bad("run_id is missing");
  if (!m.contains("files") || !m["files"].is_object()) return bad("files is missing");
  auto listed = ShardFilesOf(m["files"]);
  if (!listed.ok()) return bad(std::string(listed.status().message()));
  for (const std::string& name : *listed) {
    const auto it = m["files"].find(name);
    if (it == m["files"].end() || !it->is_object() || !(*it)["bytes"].is_number_integer() ||
        !(*it)["sha256"].is_string()) {
      return bad(absl::StrCat("files.", name, " is missing or malformed"));
    }
    const std::string file = dir.PathOf(name);
    auto d = DigestFile(dir, name);
    if (!d.ok()) {
      if (absl::IsPermissionDenied(d.status())) return d.status();  // a link: named as such
      return absl::DataLossError(absl::StrCat(file, ": listed in the manifest, missing"));
    }
    if (d->bytes != (*it)["bytes"].get<int64_t>() ||
        d->sha256 != (*it)["sha256"].get<std::string>()) {
      return absl::DataLossError(
          absl::StrCat(file, ": content does not match its SHA-256 in ", kManifest,
                       " (the file is corrupt or was changed after the save)"));
    }
  }
  return VerifiedShard{m["run_id"].get<std::string>(), std::move(*listed)};
}

// The shard folder for reading; a missing one is "incomplete" like a missing manifest.
absl::StatusOr<safefs::Dir> ExistingShard(const std::string& run_dir, int64_t step, int rank) {
  auto dir = ShardFolder(run_dir, step, rank, /*create=*/false);
  if (absl::IsNotFound(dir.status())) {
    return absl::FailedPreconditionError(absl::StrCat(ShardDir(run_dir, step, rank), ": no ",
                                                      kManifest, "; the shard is incomplete"));
  }
  return dir;
}

// A read the loaders plan: `count` floats from element `first` of a file's entry into dst.
struct Copy {
  const runtime::SafetensorsReader* file;
  const runtime::TensorEntry* entry;
  uint64_t first, count;
  float* dst;
};

// The AdamW moments of one verified shard, whichever form they were saved in: one
// optimizer.safetensors with each tensor's moments whole, or the replicas' range files with each
// tensor's moments in 1-D pieces (SaveOptimizerRange).
class MomentSource {
 public:
  // shard: what VerifyShardIn found in `dir`.
  static absl::StatusOr<MomentSource> Open(const safefs::Dir& dir, const VerifiedShard& shard) {
    MomentSource src;
    for (const std::string& name : shard.files) {
      if (name == kModelFile || name == "DONE") continue;
      auto f = runtime::SafetensorsReader::OpenAt(dir, name);
      if (!f.ok()) return f.status();
      int64_t step = -1;
      auto it = f->metadata().find("adamw_step");
      if (it == f->metadata().end() || !absl::SimpleAtoi(it->second, &step) || step < 0 ||
          (src.adamw_step_ >= 0 && step != src.adamw_step_)) {
        return absl::DataLossError(
            absl::StrCat(f->path(), ": metadata adamw_step missing, bad or not the other files' (",
                         src.adamw_step_, ")"));
      }
      src.adamw_step_ = step;
      src.ranges_ = name != kOptimizerFile;
      src.files_.push_back(std::make_unique<runtime::SafetensorsReader>(std::move(*f)));
    }
    if (src.ranges_) {
      for (const auto& file : src.files_) {
        for (const auto& [entry_name, entry] : file->tensors()) {
          auto it = file->metadata().find(kPieceKey + entry_name);
          uint64_t first = 0;
          if (it == file->metadata().end() || !absl::SimpleAtoi(it->second, &first) ||
              entry.shape.size() != 1) {
            return absl::DataLossError(absl::StrCat(file->path(), ": entry ", entry_name,
                                                    " is not a 1-D piece with its first element"));
          }
          src.pieces_[entry_name].push_back({file.get(), &entry, first});
        }
      }
      for (auto& [name, list] : src.pieces_) {
        std::sort(list.begin(), list.end(),
                  [](const Piece& a, const Piece& b) { return a.first < b.first; });
      }
    }
    return src;
  }

  int64_t adamw_step() const { return adamw_step_; }
  const std::string& path() const { return files_.front()->path(); }

  // Plans reading elements [first, first + count) of the saved tensor `name` (an exp_avg. or
  // exp_avg_sq. entry) of saved shape `shape` into dst: the pieces must cover the whole tensor
  // exactly once, and the values read must be finite.
  absl::Status Plan(const std::string& name, const std::vector<int64_t>& shape, uint64_t first,
                    uint64_t count, float* dst, std::vector<Copy>* copies) const {
    if (!ranges_) {
      const runtime::SafetensorsReader& f = *files_.front();
      auto e = runtime::CheckedEntry(f, name, shape);
      if (!e.ok()) return e.status();
      if (auto st = f.CheckFinite(name, **e, first, count); !st.ok()) return st;
      copies->push_back({&f, *e, first, count, dst});
      return absl::OkStatus();
    }
    uint64_t numel = 1;
    for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
    auto it = pieces_.find(name);
    uint64_t at = 0;
    if (it != pieces_.end()) {
      for (const Piece& p : it->second) {
        const uint64_t len = static_cast<uint64_t>(p.entry->numel());
        if (p.first != at) break;  // a gap or an overlap: reported below
        const uint64_t lo = std::max(first, p.first), hi = std::min(first + count, p.first + len);
        if (lo < hi) {
          if (auto st = p.file->CheckFinite(name, *p.entry, lo - p.first, hi - lo); !st.ok()) {
            return st;
          }
          copies->push_back({p.file, p.entry, lo - p.first, hi - lo, dst + (lo - first)});
        }
        at += len;
      }
    }
    if (at != numel) {
      return absl::DataLossError(absl::StrCat(path(), " (and the other ranges of its stage): the ",
                                              "pieces of ", name, " cover ", at, " of its ", numel,
                                              " elements from the start"));
    }
    return absl::OkStatus();
  }

 private:
  struct Piece {
    const runtime::SafetensorsReader* file;
    const runtime::TensorEntry* entry;
    uint64_t first;  // element of the saved tensor
  };
  std::vector<std::unique_ptr<runtime::SafetensorsReader>> files_;
  bool ranges_ = false;
  int64_t adamw_step_ = -1;
  std::map<std::string, std::vector<Piece>> pieces_;
};

// The part of a tensor's flat span [offset, offset + n) that an optimizer state holds: a
// whole-buffer AdamW all of it, a ZeRO-1 shard its range. Returns the element interval
// [first, first + count) of the tensor and where element `first` goes in the state.
struct StateSpan {
  uint64_t first = 0, count = 0;
  size_t state_index = 0;
};
StateSpan SpanInState(const engine::AdamW& opt, size_t offset, size_t n) {
  const size_t begin = opt.shard_begin(), end = begin + opt.count();
  const size_t lo = std::max(begin, offset), hi = std::min(end, offset + n);
  if (lo >= hi) return {};
  return {lo - offset, hi - lo, lo - begin};
}

}  // namespace

absl::StatusOr<std::string> VerifyRankShard(const std::string& run_dir, int64_t step, int rank,
                                            int world) {
  auto dir = ExistingShard(run_dir, step, rank);
  if (!dir.ok()) return dir.status();
  auto shard = VerifyShardIn(*dir, step, rank, world);
  if (!shard.ok()) return shard.status();
  return shard->run_id;
}

absl::Status LoadRankShard(const std::string& run_dir, int64_t step, int rank, int world,
                           engine::RankModel& model, engine::AdamW* optimizer) {
  auto dir = ExistingShard(run_dir, step, rank);
  if (!dir.ok()) return dir.status();
  auto shard = VerifyShardIn(*dir, step, rank, world);
  if (!shard.ok()) return shard.status();
  // The shard's files are read in pieces, straight into the model and the optimizer state:
  // headers first, every tensor's shape and values checked (in bounded chunks), then copied,
  // so a bad shard leaves the rank untouched and no second copy of the state is resident.
  auto weights = runtime::SafetensorsReader::OpenAt(*dir, kModelFile);
  if (!weights.ok()) return weights.status();
  const std::string& model_path = weights->path();
  std::vector<Copy> copies;
  auto check = [&](const runtime::SafetensorsReader& f, const std::string& name,
                   const std::vector<int64_t>& shape, float* dst) -> absl::Status {
    auto e = runtime::CheckedEntry(f, name, shape);
    if (!e.ok()) return e.status();
    if (auto st = f.CheckFinite(name, **e, 0, static_cast<uint64_t>((*e)->numel())); !st.ok()) {
      return st;
    }
    copies.push_back({&f, *e, 0, static_cast<uint64_t>((*e)->numel()), dst});
    return absl::OkStatus();
  };
  for (const engine::ParamTensor& t : model.tensors()) {
    if (auto st = check(*weights, t.name, SavedShape(t), model.params() + t.offset); !st.ok()) {
      return st;
    }
    if (t.vocab_shard) {
      auto it = weights->metadata().find(kShardKey + t.name);
      if (it == weights->metadata().end()) {
        return absl::DataLossError(
            absl::StrCat(model_path, ": metadata ", kShardKey, t.name, " is missing"));
      }
      auto rows = ParseShardRows(model_path, t.name, it->second);
      if (!rows.ok()) return rows.status();
      if (rows->begin != t.global_row_begin) {
        return absl::InvalidArgumentError(
            absl::StrCat(model_path, ": tensor ", t.name, " starts at global row ", rows->begin,
                         ", this rank's shard at ", t.global_row_begin,
                         " (the checkpoint was written under another plan)"));
      }
    }
  }
  // The moments (either saved form) of the part of each tensor the state holds: all of it, or
  // under ZeRO-1 the rank's range.
  absl::StatusOr<MomentSource> moments = absl::UnknownError("unread");
  if (optimizer != nullptr) {
    moments = MomentSource::Open(*dir, *shard);
    if (!moments.ok()) return moments.status();
    for (const engine::ParamTensor& t : model.tensors()) {
      const StateSpan span = SpanInState(*optimizer, t.offset, SavedNumel(t));
      if (span.count == 0) continue;
      for (const auto& [prefix, state] :
           {std::pair<const char*, float*>{"exp_avg.", optimizer->m().data()},
            {"exp_avg_sq.", optimizer->v().data()}}) {
        if (auto st = moments->Plan(prefix + t.name, SavedShape(t), span.first, span.count,
                                    state + span.state_index, &copies);
            !st.ok()) {
          return st;
        }
      }
    }
  }
  for (const Copy& c : copies) {
    if (auto st = c.file->Read(*c.entry, c.first, c.count, c.dst); !st.ok()) return st;
  }
  if (optimizer != nullptr) optimizer->set_step(moments->adamw_step());
  return absl::OkStatus();
}

absl::StatusOr<SavedRanks> SavedRanksOf(const std::string& run_dir, int64_t step) {
  auto dir = ExistingShard(run_dir, step, 0);
  if (!dir.ok()) return dir.status();
  auto text = dir->ReadFile(kManifest, 1 << 20);
  if (!text.ok()) return text.status();
  const nlohmann::json m = nlohmann::json::parse(*text, nullptr, false);
  if (m.is_discarded() || !m.is_object() || !m.contains("world") ||
      !m["world"].is_number_integer() || m["world"].get<int64_t>() < 1 ||
      m["world"].get<int64_t>() > (int64_t{1} << 20)) {
    return absl::DataLossError(
        absl::StrCat(dir->PathOf(kManifest), ": world is missing or not a positive integer"));
  }
  SavedRanks saved{.world = static_cast<int>(m["world"].get<int64_t>()), .tensor = 1};
  if (m.contains("tensor")) {  // absent: saved before tensor parallelism
    if (!m["tensor"].is_number_integer() || m["tensor"].get<int64_t>() < 1 ||
        m["tensor"].get<int64_t>() > 1024) {
      return absl::DataLossError(
          absl::StrCat(dir->PathOf(kManifest), ": tensor is not a positive integer"));
    }
    saved.tensor = static_cast<int>(m["tensor"].get<int64_t>());
  }
  return saved;
}

absl::StatusOr<int> SavedWorld(const std::string& run_dir, int64_t step) {
  auto saved = SavedRanksOf(run_dir, step);
  if (!saved.ok()) return saved.status();
  return saved->world;
}

absl::Status LoadFromShards(const std::string& run_dir, int64_t step, int saved_world,
                            engine::RankModel& model, engine::AdamW* optimizer) {
  // Every saved shard, verified and opened (headers only): the tensors are found by name.
  std::vector<safefs::Dir> dirs;
  std::vector<std::unique_ptr<runtime::SafetensorsReader>> weights;
  std::vector<MomentSource> moments;
  int64_t adamw_step = -1;
  for (int r = 0; r < saved_world; ++r) {
    auto dir = ExistingShard(run_dir, step, r);
    if (!dir.ok()) return dir.status();
    auto shard = VerifyShardIn(*dir, step, r, saved_world);
    if (!shard.ok()) return shard.status();
    auto w = runtime::SafetensorsReader::OpenAt(*dir, kModelFile);
    if (!w.ok()) return w.status();
    weights.push_back(std::make_unique<runtime::SafetensorsReader>(std::move(*w)));
    if (optimizer != nullptr) {
      auto o = MomentSource::Open(*dir, *shard);
      if (!o.ok()) return o.status();
      if (adamw_step >= 0 && o->adamw_step() != adamw_step) {
        return absl::DataLossError(absl::StrCat(o->path(), ": metadata adamw_step ",
                                                o->adamw_step(), " is not the other shards' (",
                                                adamw_step, ")"));
      }
      adamw_step = o->adamw_step();
      moments.push_back(std::move(*o));
    }
    dirs.push_back(std::move(*dir));
  }
  // A piece of a tensor in a saved shard: its global rows [begin, begin + rows) (a vocabulary
  // shard's, from the metadata; the whole tensor's otherwise).
  // A tensor-parallel slice carries its SliceInfo (sliced = true).
  struct Piece {
    int shard = 0;
    int64_t begin = 0, rows = 0;
    bool sliced = false;
    SliceInfo slice;
  };
  std::map<std::string, std::vector<Piece>> pieces;
  for (int r = 0; r < saved_world; ++r) {
    const runtime::SafetensorsReader& f = *weights[r];
    for (const auto& [name, entry] : f.tensors()) {
      Piece piece{.shard = r,
                  .begin = 0,
                  .rows = entry.shape.empty() ? 1 : entry.shape[0],
                  .sliced = false,
                  .slice = {}};
      if (auto meta = f.metadata().find(kSliceKey + name); meta != f.metadata().end()) {
        auto slice = ParseSlice(f.path(), name, meta->second, entry.shape.size());
        if (!slice.ok()) return slice.status();
        piece.sliced = true;
        piece.slice = *slice;
      }
      if (auto meta = f.metadata().find(kShardKey + name); meta != f.metadata().end()) {
        auto rows = ParseShardRows(f.path(), name, meta->second);
        if (!rows.ok()) return rows.status();
        if (entry.shape.empty() || entry.shape[0] != rows->rows) {
          return absl::DataLossError(absl::StrCat(
              f.path(), ": tensor ", name, " does not have the metadata's ", rows->rows, " rows"));
        }
        piece.begin = rows->begin;
      }
      pieces[name].push_back(piece);
    }
  }
  // What this rank reads: for each of its tensors (and moments) the pieces covering its rows,
  // checked (shape, finite) before anything is copied.
  std::vector<Copy> copies;
  // Tensor parallelism on either side (a saved slice, or a slice to load): the whole tensor is
  // put together from the saved parts after the reads, then this rank's slice (or the whole)
  // goes to dst: elements [first, first + count) of it. One whole tensor at a time in memory.
  struct Assembly {
    std::vector<int64_t> whole_shape;
    std::vector<std::vector<float>> parts;  // filled by the planned copies
    std::vector<SliceInfo> infos;           // size 1: the part is the whole tensor
    engine::tp::Split split;                // the loading rank's cut
    int rank = 0, size = 1;
    float* dst = nullptr;
    uint64_t first = 0, count = 0;
  };
  std::vector<std::unique_ptr<Assembly>> assemblies;
  const engine::tp::TensorGroup& group = model.tensor_group();
  // Plans the assembly of `t` (a layer tensor) from `found`'s pieces; dst etc. as above.
  auto plan_assembly = [&](const engine::ParamTensor& t, const std::string& source,
                           const std::vector<Piece>& found, const std::string& prefix, float* dst,
                           uint64_t first, uint64_t count) -> absl::Status {
    auto a = std::make_unique<Assembly>();
    a->whole_shape = t.full_shape;
    a->split = t.split;
    a->rank = group.size() > 1 ? group.rank() : 0;
    a->size = group.size() > 1 && !t.split.replicated() ? group.size() : 1;
    a->dst = dst;
    a->first = first;
    a->count = count;
    std::vector<const Piece*> use;
    for (const Piece& p : found) {
      if (p.sliced) use.push_back(&p);
    }
    if (use.empty()) {
      use.push_back(&found.front());  // saved whole (t = 1 or replicated)
    } else {
      std::vector<bool> seen(static_cast<size_t>(use.front()->slice.size), false);
      for (const Piece* p : use) {
        if (p->slice.size != use.front()->slice.size || seen[p->slice.rank]) {
          return absl::DataLossError(absl::StrCat("checkpoint of step ", step,
                                                  ": the tensor-parallel slices of ", source,
                                                  " do not form one set of ranks"));
        }
        seen[p->slice.rank] = true;
      }
      if (static_cast<int>(use.size()) != use.front()->slice.size) {
        return absl::DataLossError(absl::StrCat("checkpoint of step ", step, ": ", use.size(),
                                                " of the ", use.front()->slice.size,
                                                " tensor-parallel slices of ", source, " saved"));
      }
    }
    for (const Piece* p : use) {
      const runtime::SafetensorsReader& f = *weights[p->shard];
      const runtime::TensorEntry* e = f.Find(source);
      if (e == nullptr) return absl::DataLossError(absl::StrCat(f.path(), ": no ", source));
      const std::vector<int64_t> whole = p->sliced ? WholeShape(e->shape, p->slice) : e->shape;
      if (whole != a->whole_shape) {
        return absl::DataLossError(
            absl::StrCat(f.path(), ": tensor ", source, " is not of the shape this model needs"));
      }
      a->infos.push_back(p->sliced ? p->slice : SliceInfo{});
      a->parts.emplace_back(static_cast<size_t>(e->numel()));
      float* buf = a->parts.back().data();
      if (prefix.empty()) {
        if (auto st = f.CheckFinite(source, *e, 0, e->numel()); !st.ok()) return st;
        copies.push_back({&f, e, 0, static_cast<uint64_t>(e->numel()), buf});
      } else if (auto st =
                     moments[p->shard].Plan(prefix + source, e->shape, 0, e->numel(), buf, &copies);
                 !st.ok()) {
        return st;
      }
    }
    assemblies.push_back(std::move(a));
    return absl::OkStatus();
  };
  const engine::ParamTensor* twin = model.tied_output_copy();
  const std::string embedding = engine::EmbeddingTensorName(model.config());
  // prefix "" reads the weights into params (base = the flat parameter buffer); "exp_avg." and
  // "exp_avg_sq." the moments into `state` (whole, or a ZeRO-1 shard: only its range).
  auto plan_tensor = [&](const engine::ParamTensor& t, const std::string& prefix, float* base,
                         const engine::AdamW* state) -> absl::Status {
    const std::vector<int64_t> shape = SavedShape(t);
    const int64_t begin = t.vocab_shard ? t.global_row_begin : 0;
    const int64_t rows = shape.empty() ? 1 : shape[0];
    int64_t cols = 1;
    for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
    // The tied output copy of a plan that is not vocabulary-sharded is wte's twin: a run saved
    // under another plan may hold only wte.
    std::string source = t.name;
    if (!pieces.contains(source) && &t == twin) source = embedding;
    auto found = pieces.find(source);
    if (found == pieces.end()) {
      return absl::DataLossError(absl::StrCat(ShardDir(run_dir, step, 0), " .. ", saved_world - 1,
                                              ": no shard holds tensor ", t.name));
    }
    const bool load_slice = !t.vocab_shard && !t.split.replicated() && group.size() > 1;
    const bool saved_slices = std::any_of(found->second.begin(), found->second.end(),
                                          [](const Piece& p) { return p.sliced; });
    if (!t.vocab_shard && (load_slice || saved_slices)) {
      if (prefix.empty()) {
        return plan_assembly(t, source, found->second, prefix, base + t.offset, 0, t.count());
      }
      const StateSpan span = SpanInState(*state, t.offset, t.count());
      if (span.count == 0) return absl::OkStatus();
      return plan_assembly(t, source, found->second, prefix, base + span.state_index, span.first,
                           span.count);
    }
    int64_t covered = 0;
    std::vector<bool> row_done(static_cast<size_t>(rows), false);
    for (const Piece& piece : found->second) {
      const int64_t lo = std::max(begin, piece.begin);
      const int64_t hi = std::min(begin + rows, piece.begin + piece.rows);
      if (lo >= hi) continue;
      if (row_done[static_cast<size_t>(lo - begin)]) continue;  // a duplicate (tied twin)
      // The piece's shape comes from its weights; the moments have the same.
      const runtime::SafetensorsReader& f = *weights[piece.shard];
      const std::string& name = source;
      const runtime::TensorEntry* e = f.Find(name);
      int64_t e_cols = 1;
      if (e != nullptr) {
        for (size_t i = 1; i < e->shape.size(); ++i) e_cols *= e->shape[i];
      }
      if (e == nullptr || e->shape.size() != shape.size() ||
          (e->shape.empty() ? 1 : e->shape[0]) != piece.rows || e_cols != cols) {
        return absl::DataLossError(absl::StrCat(f.path(), ": tensor ", name,
                                                " is missing or not of the shape this rank needs"));
      }
      const uint64_t first = static_cast<uint64_t>((lo - piece.begin) * cols);
      const uint64_t count = static_cast<uint64_t>((hi - lo) * cols);
      const size_t offset = t.offset + static_cast<size_t>((lo - begin) * cols);
      if (prefix.empty()) {
        if (auto st = f.CheckFinite(name, *e, first, count); !st.ok()) return st;
        copies.push_back({&f, e, first, count, base + offset});
      } else if (const StateSpan span = SpanInState(*state, offset, count); span.count > 0) {
        if (auto st = moments[piece.shard].Plan(prefix + source, e->shape, first + span.first,
                                                span.count, base + span.state_index, &copies);
            !st.ok()) {
          return st;
        }
      }
      for (int64_t row = lo; row < hi; ++row) row_done[static_cast<size_t>(row - begin)] = true;
      covered += hi - lo;
    }
    if (covered != rows) {
      return absl::DataLossError(absl::StrCat("checkpoint of step ", step, " (", saved_world,
                                              " ranks): the shards cover ", covered, " of the ",
                                              rows, " rows of ", t.name, " this rank needs"));
    }
    return absl::OkStatus();
  };
  for (const engine::ParamTensor& t : model.tensors()) {
    if (auto st = plan_tensor(t, "", model.params(), nullptr); !st.ok()) return st;
    if (optimizer != nullptr) {
      if (auto st = plan_tensor(t, "exp_avg.", optimizer->m().data(), optimizer); !st.ok()) {
        return st;
      }
      if (auto st = plan_tensor(t, "exp_avg_sq.", optimizer->v().data(), optimizer); !st.ok()) {
        return st;
      }
    }
  }
  for (const Copy& c : copies) {
    if (auto st = c.file->Read(*c.entry, c.first, c.count, c.dst); !st.ok()) return st;
  }
  for (const auto& a : assemblies) {
    size_t numel = 1;
    for (const int64_t d : a->whole_shape) numel *= static_cast<size_t>(d);
    std::vector<float> whole;
    if (a->parts.size() == 1 && a->infos[0].size == 1) {
      whole = std::move(a->parts[0]);  // saved whole
    } else {
      whole.resize(numel);
      for (size_t i = 0; i < a->parts.size(); ++i) {
        const SliceInfo& s = a->infos[i];
        engine::tp::PlaceSlice(a->parts[i].data(), a->whole_shape, s.split, s.rank, s.size,
                               whole.data());
      }
    }
    const engine::tp::Split split = a->size > 1 ? a->split : engine::tp::Split{};
    const size_t local = numel / a->size;
    if (a->first == 0 && a->count == local) {  // the whole slice (weights, an unsharded state)
      engine::tp::SliceTensor(whole.data(), a->whole_shape, split, a->rank, a->size, a->dst);
      continue;
    }
    std::vector<float> mine(local);  // a ZeRO-1 range covers part of it
    engine::tp::SliceTensor(whole.data(), a->whole_shape, split, a->rank, a->size, mine.data());
    std::copy_n(mine.data() + a->first, a->count, a->dst);
  }
  if (optimizer != nullptr) optimizer->set_step(adamw_step);
  return absl::OkStatus();
}

absl::StatusOr<VerifiedStep> LatestVerifiedStep(const std::string& run_dir, int world,
                                                int64_t max_step) {
  VerifiedStep out;
  auto run = safefs::Dir::Open(run_dir);
  if (!run.ok() && !absl::IsNotFound(run.status())) return run.status();
  // The newest candidate whose shards are there but do not match their manifests (DataLoss),
  // as opposed to a save that never finished (no manifest yet: FailedPrecondition).
  std::string corrupt;
  for (const int64_t step : run.ok() ? StepFolders(*run) : std::vector<int64_t>{}) {
    if (max_step >= 0 && step > max_step) continue;
    // A folder without any rank's shard (a standalone run's, or an export) is no candidate.
    // A link in place of the step folder is one: its verification names it.
    bool any = run->KindOf(StepName(step)) == safefs::Kind::kLink;
    if (auto sd = run->Sub(StepName(step)); sd.ok()) {
      for (int r = 0; r < world && !any; ++r) {
        any = sd->KindOf(RankName(r)) != safefs::Kind::kMissing;
      }
    }
    if (!any) continue;
    // A step saved under another plan (another p) is verified against its own world, which
    // rank 0's manifest records; the resume then re-splits it (LoadFromShards).
    int saved = world;
    if (auto w = SavedWorld(run_dir, step); w.ok()) saved = *w;
    auto run = VerifyStep(run_dir, step, saved);
    if (run.ok()) {
      out.step = step;
      out.world = saved;
      return out;
    }
    out.warnings.push_back(
        absl::StrCat("checkpoint of step ", step, " skipped: ", run.status().message()));
    if (corrupt.empty() && absl::IsDataLoss(run.status())) {
      corrupt = absl::StrCat("step ", step, ": ", run.status().message());
    }
  }
  // Saved training exists but none of it can be trusted: starting over from step 0 would
  // silently throw it away, so the resume stops here and names the file.
  if (!corrupt.empty()) {
    return absl::DataLossError(absl::StrCat(
        run_dir, ": no checkpoint to resume from: a resume needs a step whose shards of all ",
        world, " ranks verify against their MANIFEST.json, and ", out.warnings.size(),
        " saved step(s) do not; newest corrupt ", corrupt,
        ". Restore or remove the corrupt step_<N> folder to continue"));
  }
  // Nothing saved, or only saves that never finished (no manifest): a fresh start loses nothing.
  std::string why =
      absl::StrCat(run_dir, ": no step with verified shards of all ", world, " ranks");
  if (!out.warnings.empty()) absl::StrAppend(&why, " (newest: ", out.warnings.front(), ")");
  return absl::NotFoundError(why);
}

absl::StatusOr<int64_t> LatestShardedStep(const std::string& run_dir, int world) {
  auto latest = LatestVerifiedStep(run_dir, world);
  if (!latest.ok()) return latest.status();
  return latest->step;
}

absl::Status PruneCheckpoints(const std::string& run_dir, int64_t step, int world, int keep_last) {
  if (keep_last <= 0) return absl::OkStatus();
  auto run = safefs::Dir::Open(run_dir);
  if (!run.ok()) return run.status();
  int kept = 0;
  for (const int64_t s : StepFolders(*run)) {
    if (s > step) continue;  // newer than this save: not ours to judge
    if (kept < keep_last) {
      if (VerifyStep(run_dir, s, world).ok()) ++kept;  // a bad step does not count
      continue;
    }
    // By handle, depth first: a link below is removed as a link, its target left alone.
    if (auto st = run->RemoveTree(StepName(s)); !st.ok()) return st;
  }
  return run->Sync();
}

absl::Status MergeShards(const std::string& run_dir, int64_t step, int world,
                         const engine::ModelConfig& config, int64_t max_shard_bytes) {
  if (max_shard_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint.max_shard_bytes: must be positive, got ", max_shard_bytes));
  }
  // Where a piece of an output tensor comes from: a tensor of a rank's open shard file.
  struct Source {
    const runtime::SafetensorsReader* file = nullptr;
    const runtime::TensorEntry* entry = nullptr;
  };
  struct Piece {
    int64_t begin = 0;
    Source source;
  };
  // Only the shards' headers are read here; the data is copied below in bounded chunks, so the
  // merge's memory does not grow with the model.
  std::vector<safefs::Dir> dirs;
  std::vector<std::unique_ptr<runtime::SafetensorsReader>> files;
  std::map<std::string, std::vector<Piece>> sharded;  // name -> pieces
  std::map<std::string, Source> whole;                // name -> tensor
  // Tensor-parallel slices of a layer tensor, put together in memory (one tensor at a time).
  std::map<std::string, std::vector<std::pair<SliceInfo, Source>>> sliced;
  std::vector<std::string> order;  // first-seen order
  for (int r = 0; r < world; ++r) {
    auto dir = ShardFolder(run_dir, step, r, /*create=*/false);
    if (!dir.ok() && !absl::IsNotFound(dir.status())) return dir.status();
    if (!dir.ok() || dir->KindOf(kManifest) == safefs::Kind::kMissing) {
      return absl::FailedPreconditionError(absl::StrCat(ShardDir(run_dir, step, r), ": no ",
                                                        kManifest, "; rank ", r,
                                                        " has not saved step ", step));
    }
    if (auto id = VerifyShardIn(*dir, step, r, world); !id.ok()) return id.status();
    auto f = runtime::SafetensorsReader::OpenAt(*dir, kModelFile);
    if (!f.ok()) return f.status();
    files.push_back(std::make_unique<runtime::SafetensorsReader>(std::move(*f)));
    dirs.push_back(std::move(*dir));
    const runtime::SafetensorsReader& file = *files.back();
    for (const auto& [name, entry] : file.tensors()) {
      // With tied embeddings the output copy of a non-sharded plan is wte's twin: skip it.
      if (config.tie_embeddings && name == "lm_head.weight") continue;
      if (!sharded.contains(name) && !whole.contains(name) && !sliced.contains(name)) {
        order.push_back(name);
      }
      if (auto slice_meta = file.metadata().find(kSliceKey + name);
          slice_meta != file.metadata().end()) {
        auto slice = ParseSlice(file.path(), name, slice_meta->second, entry.shape.size());
        if (!slice.ok()) return slice.status();
        sliced[name].push_back({*slice, Source{&file, &entry}});
        continue;
      }
      auto meta = file.metadata().find(kShardKey + name);
      if (meta != file.metadata().end()) {
        auto rows = ParseShardRows(file.path(), name, meta->second);
        if (!rows.ok()) return rows.status();
        if (entry.shape.size() != 2 || entry.shape[0] != rows->rows) {
          return absl::DataLossError(absl::StrCat(file.path(), ": tensor ", name,
                                                  " does not have the metadata's ", rows->rows,
                                                  " rows"));
        }
        sharded[name].push_back({rows->begin, {&file, &entry}});
      } else {
        whole.emplace(name, Source{&file, &entry});  // duplicates (tied copies) keep the first
      }
    }
  }
  // Every output tensor: its global shape and the pieces that make it, in row order.
  struct Output {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<Source> sources;
    std::vector<std::pair<SliceInfo, Source>> slices;  // a tensor-parallel tensor's parts
  };
  std::map<std::string, Output> merged;
  for (auto& [name, parts] : sliced) {
    const SliceInfo& first = parts.front().first;
    const std::vector<int64_t> shape = WholeShape(parts.front().second.entry->shape, first);
    std::vector<bool> seen(static_cast<size_t>(first.size), false);
    for (const auto& [info, src] : parts) {
      if (info.size != first.size || info.split.dim != first.split.dim ||
          info.split.parts != first.split.parts || seen[info.rank] ||
          WholeShape(src.entry->shape, info) != shape) {
        return absl::DataLossError(absl::StrCat(runtime::CheckpointDir(run_dir, step),
                                                ": the tensor-parallel slices of ", name,
                                                " do not form one tensor"));
      }
      seen[info.rank] = true;
    }
    if (static_cast<int>(parts.size()) != first.size) {
      return absl::DataLossError(absl::StrCat(runtime::CheckpointDir(run_dir, step), ": ",
                                              parts.size(), " of the ", first.size,
                                              " tensor-parallel slices of ", name, " saved"));
    }
    merged.emplace(name, Output{name, shape, {}, parts});
  }
  for (auto& [name, pieces] : sharded) {
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    const int64_t cols = pieces.front().source.entry->shape[1];
    Output out{name, {}, {}, {}};
    int64_t next = 0;
    for (const Piece& p : pieces) {
      // An all-padding shard (more shards than V / 8 rows' worth: a small V over p·t ranks)
      // holds no real row.
      if (p.source.entry->shape[0] == 0) continue;
      if (p.begin != next || p.source.entry->shape[1] != cols) {
        return absl::DataLossError(absl::StrCat(
            runtime::CheckpointDir(run_dir, step), ": vocabulary shards of ", name,
            " do not tile the rows: expected global row ", next, ", a shard starts at ", p.begin));
      }
      out.sources.push_back(p.source);
      next += p.source.entry->shape[0];
    }
    if (next != config.vocab) {
      return absl::DataLossError(absl::StrCat(runtime::CheckpointDir(run_dir, step), ": shards of ",
                                              name, " cover ", next, " rows, the vocabulary has ",
                                              config.vocab));
    }
    out.shape = {next, cols};
    merged.emplace(name, std::move(out));
  }
  std::vector<Output> outputs;
  for (const std::string& name : order) {
    auto m = merged.find(name);
    if (m != merged.end()) {
      outputs.push_back(m->second);
    } else {
      const Source& s = whole.at(name);
      outputs.push_back({name, s.entry->shape, {s}, {}});
    }
  }
  if (config.tie_embeddings) {
    const std::string wte_name = engine::EmbeddingTensorName(config);
    auto wte = merged.find(wte_name);
    if (wte == merged.end()) {
      return absl::DataLossError(
          absl::StrCat(runtime::CheckpointDir(run_dir, step), ": no rank holds ", wte_name));
    }
    outputs.push_back({"lm_head.weight", wte->second.shape, wte->second.sources, {}});
  }
  // The files: one model.safetensors when the tensors fit in max_shard_bytes, else Hugging
  // Face's greedy split in tensor order (a file is closed when the next tensor would take it
  // past the limit; a tensor larger than the limit gets a file of its own).
  std::vector<uint64_t> bytes;
  uint64_t total = 0;
  for (const Output& o : outputs) {
    bytes.push_back(runtime::TensorLayout{o.name, o.shape}.bytes());
    total += bytes.back();
  }
  const std::vector<std::vector<size_t>> groups = runtime::HfShardGroups(bytes, max_shard_bytes);
  if (groups.size() > 99999) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint.max_shard_bytes: ", max_shard_bytes, " splits the model into ",
                     groups.size(), " files, more than the 99999 the file names allow"));
  }

  auto run = safefs::Dir::Open(run_dir);
  if (!run.ok()) return run.status();
  auto out = run->Sub(StepName(step));
  if (!out.ok()) return out.status();
  if (auto st = out->Remove("DONE"); !st.ok()) return st;
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", absl::StrCat(step)}};
  // One copy buffer for the whole merge: the only memory it adds, whatever the model's size.
  std::vector<char> buffer(kMergeChunkBytes);
  std::vector<std::string> written;
  std::map<std::string, std::string> weight_map;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string name = runtime::HfWeightsFileName(g, groups.size());
    std::vector<runtime::TensorLayout> layout;
    for (size_t i : groups[g]) {
      layout.push_back({outputs[i].name, outputs[i].shape});
      weight_map[outputs[i].name] = name;
    }
    runtime::SafetensorsWriter writer(*out, name);
    if (auto st = writer.Begin(layout, meta); !st.ok()) return st;
    for (size_t i : groups[g]) {
      if (!outputs[i].slices.empty()) {  // put together in memory, then appended
        size_t numel = 1;
        for (const int64_t d : outputs[i].shape) numel *= static_cast<size_t>(d);
        std::vector<float> tensor(numel);
        for (const auto& [info, src] : outputs[i].slices) {
          std::vector<float> part(static_cast<size_t>(src.entry->numel()));
          if (auto st = src.file->Read(*src.entry, 0, part.size(), part.data()); !st.ok()) {
            return st;
          }
          engine::tp::PlaceSlice(part.data(), outputs[i].shape, info.split, info.rank, info.size,
                                 tensor.data());
        }
        if (auto st = writer.Append(reinterpret_cast<const char*>(tensor.data()),
                                    tensor.size() * sizeof(float));
            !st.ok()) {
          return st;
        }
        continue;
      }
      for (const Source& src : outputs[i].sources) {
        for (uint64_t done = 0; done < src.entry->bytes;) {
          const uint64_t n = std::min<uint64_t>(buffer.size(), src.entry->bytes - done);
          if (auto st = src.file->ReadBytes(*src.entry, done, n, buffer.data()); !st.ok()) {
            return st;
          }
          if (auto st = writer.Append(buffer.data(), n); !st.ok()) return st;
          done += n;
        }
      }
    }
    if (auto st = writer.Commit(); !st.ok()) return st;
    written.push_back(name);
  }
  if (auto st = runtime::FinishHfWeights(*out, written, weight_map, total); !st.ok()) return st;
  if (auto st = out->WriteFileAtomically("config.json", runtime::HfConfigJson(config),
                                         /*sync=*/true);
      !st.ok()) {
    return st;
  }
  if (auto st = out->WriteFileAtomically("DONE", absl::StrCat(step, "\n"), /*sync=*/true);
      !st.ok()) {
    return st;
  }
  return out->Sync();
}

}  // namespace vp::launch
