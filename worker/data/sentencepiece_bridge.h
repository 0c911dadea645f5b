// SentencePiece behind a plugin. Debian's libsentencepiece.so.0 exports its own copy of
// protobuf-lite, which clashes with the system libprotobuf linked by vocabpipe's gRPC code (a
// process linking both crashes at start). So libsentencepiece is linked only into the plugin
// libvp_sentencepiece.so (sentencepiece_plugin.cc), loaded here on first use with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND). This interface is plain C++ (std::string errors) and
// tokenizer.h wraps it into absl::Status.
//
// The plugin is looked for at $VOCABPIPE_SENTENCEPIECE_PLUGIN, next to the executable, in
// ../lib from it, and at the path CMake built it to.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace vp::data::spbridge {

struct TrainParams {
  std::string model_type = "bpe";  // bpe or unigram
  int vocab_size = 0;
  int threads = 1;
  std::string eot_piece;  // the document separator, a control symbol with id 1
};

// Trains a model on `documents` (each one SentencePiece "sentence"). Returns "" on success
// (and the serialized ModelProto in *model), else the error.
std::string Train(const std::vector<std::string_view>& documents, const TrainParams& params,
                  std::string* model);

class Processor {
 public:
  Processor();
  ~Processor();
  Processor(Processor&&) noexcept;
  Processor& operator=(Processor&&) noexcept;

  // "" on success, else the error (also when the plugin cannot be loaded).
  std::string Load(std::string_view serialized);
  // The calls below need a successful Load.
  std::string Encode(std::string_view text, std::vector<int>* ids) const;
  std::string Decode(const std::vector<int>& ids, std::string* text) const;
  int PieceSize() const;
  int PieceToId(std::string_view piece) const;  // UnkId() when absent
  int UnkId() const;
  bool IsByte(int id) const;
  bool IsControl(int id) const;

 private:
  struct Deleter {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Deleter> sp_;
};

}  // namespace vp::data::spbridge
