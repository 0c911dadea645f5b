// No absl header may be included here (see sentencepiece_bridge.h).
#include "worker/data/sentencepiece_bridge.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <unordered_map>

namespace vp::data::spbridge {
namespace {

class DocumentIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit DocumentIterator(const std::vector<std::string_view>& docs) : docs_(docs) {
    if (!docs_.empty()) current_.assign(docs_[0]);
  }
  bool done() const override { return index_ >= docs_.size(); }
  void Next() override {
    ++index_;
    if (index_ < docs_.size()) current_.assign(docs_[index_]);
  }
  const std::string& value() const override { return current_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string_view>& docs_;
  size_t index_ = 0;
  std::string current_;
};

}  // namespace

std::string Train(const std::vector<std::string_view>& documents, const TrainParams& params,
                  std::string* model) {
  // Identity normalization, no dummy prefix, whitespace kept and byte fallback: decoding the
  // ids of any UTF-8 text gives the text back byte for byte.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", params.model_type},
      {"vocab_size", std::to_string(params.vocab_size)},
      {"num_threads", std::to_string(params.threads)},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"byte_fallback", "true"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"character_coverage", "0.9995"},
      {"max_sentence_length", std::to_string(1 << 24)},
      {"input_sentence_size", "0"},
      {"unk_id", "0"},
      {"eos_id", "1"},
      {"eos_piece", params.eot_piece},
      {"bos_id", "-1"},
      {"pad_id", "-1"},
      {"minloglevel", "2"},
  };
  DocumentIterator it(documents);
  const sentencepiece::util::Status st =
      sentencepiece::SentencePieceTrainer::Train(args, &it, model);
  return st.ok() ? std::string() : std::string(st.message());
}

Processor::Processor() : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
Processor::~Processor() = default;
Processor::Processor(Processor&&) noexcept = default;
Processor& Processor::operator=(Processor&&) noexcept = default;

std::string Processor::Load(std::string_view serialized) {
  const sentencepiece::util::Status st = sp_->LoadFromSerializedProto(serialized);
  return st.ok() ? std::string() : std::string(st.message());
}

std::string Processor::Encode(std::string_view text, std::vector<int>* ids) const {
  const sentencepiece::util::Status st = sp_->Encode(text, ids);
  return st.ok() ? std::string() : std::string(st.message());
}

std::string Processor::Decode(const std::vector<int>& ids, std::string* text) const {
  const sentencepiece::util::Status st = sp_->Decode(ids, text);
  return st.ok() ? std::string() : std::string(st.message());
}

int Processor::PieceSize() const { return sp_->GetPieceSize(); }
int Processor::PieceToId(std::string_view piece) const { return sp_->PieceToId(piece); }
int Processor::UnkId() const { return sp_->unk_id(); }
int Processor::EosId() const { return sp_->eos_id(); }
bool Processor::IsByte(int id) const { return sp_->IsByte(id); }
bool Processor::IsControl(int id) const { return sp_->IsControl(id); }

}  // namespace vp::data::spbridge
