// The only code that includes libsentencepiece's headers. Debian's sentencepiece_processor.h
// declares `absl::string_view` as std::string_view, which clashes with Debian's Abseil (its own
// string_view class), so no translation unit may include both. This bridge has a plain C++
// interface (std::string errors, no absl) and tokenizer.h wraps it into absl::Status.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}  // namespace sentencepiece

namespace vp::data::spbridge {

struct TrainParams {
  std::string model_type = "bpe";  // bpe or unigram
  int vocab_size = 0;
  int threads = 1;
  std::string eot_piece;  // the document separator, a control symbol with id 1
};

// Trains a model on `documents` (each one SentencePiece "sentence"). Returns "" on success
// (and the serialized ModelProto in *model), else SentencePiece's error message.
std::string Train(const std::vector<std::string_view>& documents, const TrainParams& params,
                  std::string* model);

class Processor {
 public:
  Processor();
  ~Processor();
  Processor(Processor&&) noexcept;
  Processor& operator=(Processor&&) noexcept;

  // "" on success, else the error.
  std::string Load(std::string_view serialized);
  std::string Encode(std::string_view text, std::vector<int>* ids) const;
  std::string Decode(const std::vector<int>& ids, std::string* text) const;
  int PieceSize() const;
  int PieceToId(std::string_view piece) const;  // unk_id() when absent
  int UnkId() const;
  int EosId() const;
  bool IsByte(int id) const;
  bool IsControl(int id) const;

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};

}  // namespace vp::data::spbridge
