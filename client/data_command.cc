// `vocabpipe data`: make and check llm.c token files.
//   vocabpipe data synth --vocab V --tokens N --out F [--seed S] [--branching K]
//                        [--format auto|v1|v7]
//   vocabpipe data inspect F [--vocab V]
//   vocabpipe data train-tokenizer TEXT... --vocab-size N --out F [--model-type bpe|unigram]
//                                  [--threads T]
//   vocabpipe data tokenize --tokenizer F TEXT... --out DIR [--name NAME] [--val-fraction X]
//                           [--threads T] [--shard-tokens N]
// Exit codes (commands.h): 0 ok, 1 runtime failure (cannot write), 2 usage or invalid input.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/commands.h"
#include "worker/data/synth.h"
#include "worker/data/text_corpus.h"
#include "worker/data/token_file.h"
#include "worker/data/tokenizer.h"

namespace vp::cli {
namespace {

constexpr int kOk = 0;
constexpr int kFailure = 1;
constexpr int kUsage = 2;

constexpr const char* kUsageText =
    "usage:\n"
    "  vocabpipe data synth --vocab V --tokens N --out F [--seed S] [--branching K]\n"
    "                       [--format auto|v1|v7]\n"
    "      Writes N tokens of a random sparse Markov chain over V tokens (K successors per\n"
    "      token, default 4; seed default 1234) as an llm.c .bin file (uint16 version 1 when\n"
    "      V <= 65536, uint32 version 7 otherwise) and prints the chain's entropy rate, the\n"
    "      loss floor of a model trained on it.\n"
    "  vocabpipe data inspect F [--vocab V]\n"
    "      Prints the header of a token file and validates it (size, and every id < V).\n"
    "  vocabpipe data train-tokenizer TEXT... --vocab-size N --out F\n"
    "                       [--model-type bpe|unigram] [--threads T]\n"
    "      Trains a SentencePiece tokenizer of N tokens on the text files and writes its\n"
    "      model to F.\n"
    "  vocabpipe data tokenize --tokenizer F TEXT... --out DIR [--name NAME]\n"
    "                       [--val-fraction X] [--threads T] [--shard-tokens N]\n"
    "      Tokenizes the text files with tokenizer F into train (and, with X > 0, validation)\n"
    "      token shards in DIR, with the tokenizer beside them.\n";

// Parsed command line: flags (--name value or --name=value) and positional arguments.
struct Parsed {
  std::map<std::string, std::string> flags;
  std::vector<std::string> positional;
};

absl::StatusOr<Parsed> ParseArgs(const Args& args, size_t first,
                                 const std::vector<std::string>& known) {
  Parsed parsed;
  for (size_t i = first; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() < 3 || a.rfind("--", 0) != 0) {
      parsed.positional.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::optional<std::string> value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      std::vector<std::string> dashed;
      for (const std::string& k : known) dashed.push_back("--" + k);
      return absl::InvalidArgumentError(absl::StrCat(
          "--", name, ": unknown flag (known flags: ", absl::StrJoin(dashed, ", "), ")"));
    }
    if (!value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
      }
      value = args[++i];
    }
    if (!parsed.flags.emplace(name, *value).second) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": given more than once"));
    }
  }
  return parsed;
}

// An integer flag in [min, max]; `fallback` when absent (nullopt: required).
absl::StatusOr<int64_t> IntFlag(const Parsed& p, const std::string& name,
                                std::optional<int64_t> fallback, int64_t min, int64_t max) {
  const auto it = p.flags.find(name);
  if (it == p.flags.end()) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": required"));
  }
  const std::string& text = it->second;
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": expected an integer in [", min,
                                                   ", ", max, "], got \"", text, "\""));
  }
  return v;
}

absl::StatusOr<uint64_t> SeedFlag(const Parsed& p) {
  const auto it = p.flags.find("seed");
  if (it == p.flags.end()) return uint64_t{1234};
  const std::string& text = it->second;
  uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seed: expected a non-negative integer, got \"", text, "\""));
  }
  return v;
}

int Usage(std::ostream& err, const std::string& command, const absl::Status& status) {
  err << "vocabpipe data " << command << ": " << status.message() << "\n" << kUsageText;
  return kUsage;
}

int RunSynth(const Args& args, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Parsed> p =
      ParseArgs(args, 1, {"vocab", "tokens", "out", "seed", "branching", "format"});
  if (!p.ok()) return Usage(err, "synth", p.status());
  if (!p->positional.empty()) {
    return Usage(
        err, "synth",
        absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", p->positional[0], "\"")));
  }
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  absl::StatusOr<int64_t> vocab = IntFlag(*p, "vocab", std::nullopt, 2, kInt32Max);
  if (!vocab.ok()) return Usage(err, "synth", vocab.status());
  absl::StatusOr<int64_t> tokens = IntFlag(*p, "tokens", std::nullopt, 1, kInt32Max);
  if (!tokens.ok()) return Usage(err, "synth", tokens.status());
  absl::StatusOr<int64_t> branching = IntFlag(*p, "branching", 4, 2, 256);
  if (!branching.ok()) return Usage(err, "synth", branching.status());
  absl::StatusOr<uint64_t> seed = SeedFlag(*p);
  if (!seed.ok()) return Usage(err, "synth", seed.status());
  const auto out_it = p->flags.find("out");
  if (out_it == p->flags.end() || out_it->second.empty()) {
    return Usage(err, "synth", absl::InvalidArgumentError("--out: required"));
  }
  data::TokenFormat format = data::TokenFormat::kAuto;
  if (const auto it = p->flags.find("format"); it != p->flags.end()) {
    if (it->second == "v1") {
      format = data::TokenFormat::kUint16V1;
    } else if (it->second == "v7") {
      format = data::TokenFormat::kUint32V7;
    } else if (it->second != "auto") {
      return Usage(err, "synth",
                   absl::InvalidArgumentError(absl::StrCat(
                       "--format: expected auto, v1 or v7, got \"", it->second, "\"")));
    }
  }
  if (format == data::TokenFormat::kUint16V1 && *vocab > 65536) {
    return Usage(err, "synth",
                 absl::InvalidArgumentError(absl::StrCat(
                     "--format: v1 stores uint16 ids, too small for --vocab ", *vocab)));
  }
  // The file format follows the vocabulary, not the ids that happen to be drawn: a file for
  // V > 65536 is always uint32 even if no large id was sampled.
  if (format == data::TokenFormat::kAuto) {
    format = *vocab <= 65536 ? data::TokenFormat::kUint16V1 : data::TokenFormat::kUint32V7;
  }

  absl::StatusOr<data::MarkovChain> chain = data::MakeRandomMarkovChain(
      static_cast<int32_t>(*vocab), static_cast<int32_t>(*branching), *seed);
  if (!chain.ok()) return Usage(err, "synth", chain.status());
  const std::vector<uint32_t> ids = data::GenerateTokens(*chain, *tokens, *seed);
  const double entropy = data::EntropyRate(*chain);
  absl::StatusOr<data::TokenFormat> written = data::WriteTokenFile(out_it->second, ids, format);
  if (!written.ok()) {
    err << "vocabpipe data synth: " << written.status().message() << "\n";
    return kFailure;
  }
  out << absl::StrFormat("wrote %d tokens (%s) to %s; entropy rate %.4f nats/token\n", *tokens,
                         data::FormatName(*written), out_it->second, entropy);
  return kOk;
}

int RunInspect(const Args& args, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Parsed> p = ParseArgs(args, 1, {"vocab"});
  if (!p.ok()) return Usage(err, "inspect", p.status());
  if (p->positional.size() != 1) {
    return Usage(
        err, "inspect",
        absl::InvalidArgumentError(p->positional.empty() ? "missing the token file argument"
                                                         : "expected exactly one token file"));
  }
  absl::StatusOr<int64_t> vocab = IntFlag(*p, "vocab", 0, 1, std::numeric_limits<int32_t>::max());
  if (!vocab.ok()) return Usage(err, "inspect", vocab.status());
  const std::string& path = p->positional[0];
  absl::StatusOr<data::TokenFile> file = data::TokenFile::Load(path, *vocab);
  if (!file.ok()) {
    err << "vocabpipe data inspect: " << file.status().message() << "\n";
    return kUsage;  // invalid input
  }
  const data::TokenFileHeader& h = file->header();
  out << path << "\n";
  out << absl::StrFormat("  format:  %s (magic %d)\n", data::FormatName(h.format), h.magic);
  out << absl::StrFormat("  tokens:  %d\n", h.num_tokens);
  out << absl::StrFormat("  bytes:   %d (1024-byte header + %d x %d)\n", h.file_bytes, h.num_tokens,
                         h.bytes_per_token);
  if (h.num_tokens > 0) out << absl::StrFormat("  max id:  %d\n", file->max_id());
  if (*vocab > 0) out << absl::StrFormat("  ids:     all < %d (ok)\n", *vocab);
  return kOk;
}

// The positional TEXT files; at least one.
absl::Status NeedTextFiles(const Parsed& p) {
  if (p.positional.empty()) return absl::InvalidArgumentError("missing the TEXT file arguments");
  return absl::OkStatus();
}

int DefaultThreads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

int RunTrainTokenizer(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string cmd = "train-tokenizer";
  absl::StatusOr<Parsed> p = ParseArgs(args, 1, {"vocab-size", "out", "model-type", "threads"});
  if (!p.ok()) return Usage(err, cmd, p.status());
  if (absl::Status s = NeedTextFiles(*p); !s.ok()) return Usage(err, cmd, s);
  absl::StatusOr<int64_t> vocab =
      IntFlag(*p, "vocab-size", std::nullopt, data::kMinTokenizerVocab, 4194304);
  if (!vocab.ok()) return Usage(err, cmd, vocab.status());
  absl::StatusOr<int64_t> threads = IntFlag(*p, "threads", DefaultThreads(), 1, 1024);
  if (!threads.ok()) return Usage(err, cmd, threads.status());
  const auto out_it = p->flags.find("out");
  if (out_it == p->flags.end() || out_it->second.empty()) {
    return Usage(err, cmd, absl::InvalidArgumentError("--out: required"));
  }
  data::TokenizerTrainOptions opt;
  opt.vocab_size = static_cast<int>(*vocab);
  opt.threads = static_cast<int>(*threads);
  if (const auto it = p->flags.find("model-type"); it != p->flags.end())
    opt.model_type = it->second;

  std::vector<std::string> texts;
  std::vector<std::string_view> docs;
  int64_t bytes = 0;
  texts.reserve(p->positional.size());
  for (const std::string& path : p->positional) {
    absl::StatusOr<std::string> text = data::ReadTextFile(path);
    if (!text.ok()) {
      err << "vocabpipe data " << cmd << ": " << text.status().message() << "\n";
      return kUsage;
    }
    texts.push_back(*std::move(text));
    bytes += static_cast<int64_t>(texts.back().size());
  }
  for (const std::string& t : texts) {
    for (std::string_view d : data::SplitDocuments(t)) docs.push_back(d);
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::string> model = data::Tokenizer::Train(docs, opt);
  if (!model.ok()) {
    err << "vocabpipe data " << cmd << ": " << model.status().message() << "\n";
    return kUsage;
  }
  // Check what was trained before writing it.
  absl::StatusOr<data::Tokenizer> tok = data::Tokenizer::FromModel(*model, out_it->second);
  if (!tok.ok()) {
    err << "vocabpipe data " << cmd << ": " << tok.status().message() << "\n";
    return kFailure;
  }
  {
    std::ofstream f(out_it->second, std::ios::binary | std::ios::trunc);
    f.write(model->data(), static_cast<std::streamsize>(model->size()));
    if (!f) {
      err << "vocabpipe data " << cmd << ": " << out_it->second << ": cannot write\n";
      return kFailure;
    }
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out << absl::StrFormat(
      "wrote %s: %s tokenizer, %d tokens (EOT <|endoftext|> = %d), trained on %d files, %d "
      "documents, %d bytes in %.1f s\n",
      out_it->second, opt.model_type, tok->vocab_size(), tok->eot_id(), texts.size(), docs.size(),
      bytes, secs);
  return kOk;
}

// A progress bar on stderr, redrawn in place; only when stderr is a terminal.
class ProgressBar {
 public:
  explicit ProgressBar(std::ostream& err)
      : err_(err), tty_(::isatty(2) != 0 && &err == &std::cerr) {}
  void Update(int64_t done, int64_t total) {
    if (!tty_ || total <= 0) return;
    constexpr int kWidth = 40;
    const int fill = static_cast<int>(kWidth * done / total);
    err_ << "\r[" << std::string(static_cast<size_t>(fill), '#')
         << std::string(static_cast<size_t>(kWidth - fill), ' ')
         << absl::StrFormat("] %5.1f%% %.1f/%.1f MB", 100.0 * static_cast<double>(done) / total,
                            done / 1e6, total / 1e6)
         << std::flush;
    drawn_ = true;
  }
  ~ProgressBar() {
    if (drawn_) err_ << "\n";
  }

 private:
  std::ostream& err_;
  bool tty_;
  bool drawn_ = false;
};

int RunTokenize(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string cmd = "tokenize";
  absl::StatusOr<Parsed> p =
      ParseArgs(args, 1, {"tokenizer", "out", "name", "val-fraction", "threads", "shard-tokens"});
  if (!p.ok()) return Usage(err, cmd, p.status());
  if (absl::Status s = NeedTextFiles(*p); !s.ok()) return Usage(err, cmd, s);
  const auto tok_it = p->flags.find("tokenizer");
  if (tok_it == p->flags.end() || tok_it->second.empty()) {
    return Usage(err, cmd, absl::InvalidArgumentError("--tokenizer: required"));
  }
  const auto out_it = p->flags.find("out");
  if (out_it == p->flags.end() || out_it->second.empty()) {
    return Usage(err, cmd, absl::InvalidArgumentError("--out: required"));
  }
  data::TokenizeOptions opt;
  opt.out_dir = out_it->second;
  if (const auto it = p->flags.find("name"); it != p->flags.end()) {
    opt.name = it->second;
  } else {
    opt.name = std::filesystem::path(out_it->second).lexically_normal().filename().string();
    if (opt.name.empty() || opt.name == "." || opt.name == "..") {
      opt.name = std::filesystem::path(out_it->second)
                     .lexically_normal()
                     .parent_path()
                     .filename()
                     .string();
    }
  }
  if (opt.name.empty() || opt.name.find('/') != std::string::npos) {
    return Usage(err, cmd, absl::InvalidArgumentError("--name: must be a non-empty file name"));
  }
  if (const auto it = p->flags.find("val-fraction"); it != p->flags.end()) {
    double v = 0;
    auto [ptr, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
    if (ec != std::errc() || ptr != it->second.data() + it->second.size() || !(v >= 0) || v > 0.5) {
      return Usage(err, cmd,
                   absl::InvalidArgumentError(absl::StrCat(
                       "--val-fraction: expected a number in [0, 0.5], got \"", it->second, "\"")));
    }
    opt.val_fraction = v;
  }
  absl::StatusOr<int64_t> threads = IntFlag(*p, "threads", DefaultThreads(), 1, 1024);
  if (!threads.ok()) return Usage(err, cmd, threads.status());
  opt.threads = static_cast<int>(*threads);
  absl::StatusOr<int64_t> shard =
      IntFlag(*p, "shard-tokens", 100000000, 1, std::numeric_limits<int32_t>::max());
  if (!shard.ok()) return Usage(err, cmd, shard.status());
  opt.shard_tokens = *shard;

  std::string model;
  {
    std::ifstream f(tok_it->second, std::ios::binary);
    if (!f) {
      err << "vocabpipe data " << cmd << ": --tokenizer: " << tok_it->second << ": cannot open\n";
      return kUsage;
    }
    model.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  absl::StatusOr<data::Tokenizer> tok = data::Tokenizer::FromModel(model, tok_it->second);
  if (!tok.ok()) {
    err << "vocabpipe data " << cmd << ": " << tok.status().message() << "\n";
    return kUsage;
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<data::TokenizeSummary> s;
  {
    ProgressBar bar(err);
    opt.progress = [&bar](int64_t done, int64_t total) { bar.Update(done, total); };
    s = data::TokenizeFiles(p->positional, *tok, model, opt);
  }
  if (!s.ok()) {
    err << "vocabpipe data " << cmd << ": " << s.status().message() << "\n";
    return s.status().code() == absl::StatusCode::kInvalidArgument ||
                   s.status().code() == absl::StatusCode::kNotFound
               ? kUsage
               : kFailure;
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t tokens = s->train_tokens + s->val_tokens;
  for (const std::string& shard_path : s->shards) out << "wrote " << shard_path << "\n";
  out << absl::StrFormat(
      "%d files, %d documents (%d train, %d val), %d bytes -> %d tokens (%d train, %d val), "
      "%.2f bytes/token, %s tokens, vocabulary %d, %.1f s on %d threads\n",
      s->files, s->documents, s->train_documents, s->val_documents, s->bytes, tokens,
      s->train_tokens, s->val_tokens,
      static_cast<double>(s->bytes) / static_cast<double>(std::max<int64_t>(1, tokens)),
      s->bytes_per_token_on_disk == 2 ? "uint16" : "uint32", tok->vocab_size(), secs, opt.threads);
  return kOk;
}

}  // namespace

int RunDataCommand(const Args& args, std::ostream& out, std::ostream& err) {
  if (WantsHelp(args)) {
    out << kUsageText;
    return kOk;
  }
  if (args.empty()) {
    err << "vocabpipe data: missing subcommand (synth, inspect, train-tokenizer or tokenize)\n"
        << kUsageText;
    return kUsage;
  }
  const std::string& sub = args[0];
  if (sub == "synth") return RunSynth(args, out, err);
  if (sub == "inspect") return RunInspect(args, out, err);
  if (sub == "train-tokenizer") return RunTrainTokenizer(args, out, err);
  if (sub == "tokenize") return RunTokenize(args, out, err);
  if (sub == "help" || sub == "--help" || sub == "-h") {
    out << kUsageText;
    return kOk;
  }
  err << "vocabpipe data: unknown subcommand \"" << sub
      << "\" (synth, inspect, train-tokenizer or tokenize)\n"
      << kUsageText;
  return kUsage;
}

}  // namespace vp::cli
