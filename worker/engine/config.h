// The model's shape, as the engine sees it (filled from vocabpipe.v1.ModelSpec by the runtime;
// the engine does not depend on protobuf).
#pragma once

namespace vp::engine {

struct ModelConfig {
  int layers = 0;
  int hidden = 0;       // h
  int heads = 0;        // h % heads == 0
  int vocab = 0;        // V, the real vocabulary size
  int seq_len = 0;      // s; also the number of learned positions (GPT-2 n_positions)
  int ffn_hidden = 0;   // 4h for GPT-2
  bool tie_embeddings = false;

  int head_dim() const { return hidden / heads; }
};

}  // namespace vp::engine
