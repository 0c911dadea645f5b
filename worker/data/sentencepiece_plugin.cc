// libvp_sentencepiece.so: the only code that includes and links libsentencepiece.
//
// Debian's libsentencepiece.so.0 carries its own copy of protobuf-lite and exports its
// symbols, which clash with the system libprotobuf that vocabpipe's gRPC code links: a process
// linking both crashes while loading. So this plugin is a shared library that
// sentencepiece_bridge.cc loads with dlopen(RTLD_LOCAL | RTLD_DEEPBIND), keeping
// sentencepiece's protobuf out of the process' global symbol scope. Its interface is the
// extern "C" functions below. No absl header may be included here either (sentencepiece's
// header declares absl::string_view as std::string_view, Debian's Abseil has its own class).
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace {

using Processor = sentencepiece::SentencePieceProcessor;

class DocumentIterator final : public sentencepiece::SentenceIterator {
 public:
  DocumentIterator(const char* const* docs, const size_t* lens, size_t count)
      : docs_(docs), lens_(lens), count_(count) {
    if (count_ > 0) current_.assign(docs_[0], lens_[0]);
  }
  bool done() const override { return index_ >= count_; }
  void Next() override {
    ++index_;
    if (index_ < count_) current_.assign(docs_[index_], lens_[index_]);
  }
  const std::string& value() const override { return current_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const char* const* docs_;
  const size_t* lens_;
  size_t count_;
  size_t index_ = 0;
  std::string current_;
};

void SetError(const sentencepiece::util::Status& st, std::string* error) {
  if (!st.ok()) *error = st.message();
}

}  // namespace

extern "C" {

// Trains on `count` documents; on failure *error is set.
void vp_sp_train(const char* const* docs, const size_t* lens, size_t count, const char* model_type,
                 int vocab_size, int threads, const char* eot_piece, std::string* model,
                 std::string* error) {
  // Identity normalization, no dummy prefix, whitespace kept and byte fallback: decoding the
  // ids of any UTF-8 text gives the text back byte for byte.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", model_type},
      {"vocab_size", std::to_string(vocab_size)},
      {"num_threads", std::to_string(threads)},
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
      {"eos_piece", eot_piece},
      {"bos_id", "-1"},
      {"pad_id", "-1"},
      {"minloglevel", "2"},
  };
  DocumentIterator it(docs, lens, count);
  SetError(sentencepiece::SentencePieceTrainer::Train(args, &it, model), error);
}

// Ownership passes to the caller, which frees it with vp_sp_delete (a unique_ptr deleter).
void* vp_sp_new() { return std::make_unique<Processor>().release(); }
void vp_sp_delete(void* p) { delete static_cast<Processor*>(p); }

void vp_sp_load(void* p, const char* data, size_t size, std::string* error) {
  SetError(static_cast<Processor*>(p)->LoadFromSerializedProto(std::string_view(data, size)),
           error);
}

void vp_sp_encode(const void* p, const char* text, size_t size, std::vector<int>* ids,
                  std::string* error) {
  SetError(static_cast<const Processor*>(p)->Encode(std::string_view(text, size), ids), error);
}

void vp_sp_decode(const void* p, const std::vector<int>* ids, std::string* text,
                  std::string* error) {
  SetError(static_cast<const Processor*>(p)->Decode(*ids, text), error);
}

int vp_sp_piece_size(const void* p) { return static_cast<const Processor*>(p)->GetPieceSize(); }
int vp_sp_piece_to_id(const void* p, const char* piece, size_t size) {
  return static_cast<const Processor*>(p)->PieceToId(std::string_view(piece, size));
}
int vp_sp_unk_id(const void* p) { return static_cast<const Processor*>(p)->unk_id(); }
int vp_sp_is_byte(const void* p, int id) { return static_cast<const Processor*>(p)->IsByte(id); }
int vp_sp_is_control(const void* p, int id) {
  return static_cast<const Processor*>(p)->IsControl(id);
}

}  // extern "C"
