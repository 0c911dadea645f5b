// Not built: how cudnn_frontend_sdpa_graphs.jsonl was made. cuDNN's own C++ frontend (the
// header-only NVIDIA/cudnn-frontend, which PyTorch uses for its cuDNN attention) builds its SDPA
// forward or backward graph for one shape, with vocabpipe's layouts (q inside fused q|k|v rows,
// K/V in their own rows of a KV_ROWS-row cache, O in (b, s, heads·d) rows), causal (right bound
// 0; the diagonal top-left for a whole sequence, bottom-right for a Seq1F1B chunk whose SQ
// queries see SKV > SQ keys), scale 1/√d, stats kept for training — and lowers it to cuDNN's
// backend without a GPU. A chunk's dK/dV are (b, SKV, kv heads·d) rows of their own (vocabpipe
// adds them to the cache's gradient afterwards). cuDNN's API log then prints the lowered
// operation graph as JSON (one "operationGraph" line), which compare_cudnn_graphs.py holds
// vocabpipe's graphs (attention_cudnn.cc) to.
//
//   g++ -std=c++17 -I<cudnn-frontend>/include -I/usr/local/cuda/include \
//       cudnn_frontend_sdpa_graphs.cc -o fe_sdpa -L/usr/local/cuda/lib64 -lcudnn -lcudart
//   for a in "fwd 2 16 16 1024 1024 1024 64" "bwd 2 16 16 1024 1024 1024 64" \
//            "fwd 1 32 8 512 512 512 128" "bwd 1 32 8 512 512 512 128" \
//            "fwd 2 8 2 256 768 1024 128" "bwd 2 8 2 256 768 1024 128"; do
//     CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=log.txt ./fe_sdpa $a
//     grep '"operationGraph"' log.txt | sed 's/.*val=//; s/;$//' >> cudnn_frontend_sdpa_graphs.jsonl
//     rm log.txt
//   done
//
// Then four graphs as the frontend builds them for cuDNN up to 9.15, whose backward on key
// lengths that are no multiple of 128 it gives a padding mask (lengths = the dims) and M/N/K
// overrides, working around those versions' backward kernels. With cuDNN 9.19 here, the
// frontend's version test for that workaround (node/scaled_dot_product_flash_attention.h,
// `detail::get_backend_version() <= 91500` in the backward node's pre-validation) was made true
// in a scratch copy of its headers when FORCE_WORKAROUND is set, and fe_sdpa rebuilt against it:
//   for a in "fwd 2 2 2 200 200 200 64" "bwd 2 2 2 200 200 200 64" \
//            "fwd 2 4 2 100 170 224 64" "bwd 2 4 2 100 170 224 64"; do
//     FORCE_WORKAROUND=1 CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=log.txt ./fe_sdpa $a  # ... as above
//   done
// and, as for cuDNN 9.0-9.9, whose backward the frontend gives that padding mask a second time
// after lse is subtracted (its test for that made true in the same copy by FORCE_PADDING2), the
// 200 rows again: the forward (as above: nothing of it depends on the version) and
//     FORCE_WORKAROUND=1 FORCE_PADDING2=1 ... ./fe_sdpa bwd 2 2 2 200 200 200 64
//
// Made with cudnn-frontend 1.23.0 (its main branch, 3929da2) and cuDNN 9.19.0 on 2026-11-28; the
// shapes are CudnnAttentionGraphs.DescriptorsFinalizeWithoutADevice's: GPT-2-like (b 2, 16 heads
// of 64, 1024 rows), Llama-like grouped (b 1, 32 query heads on 8, head_dim 128, 512 rows) and a
// grouped Seq1F1B chunk (b 2, 8 query heads on 2, head_dim 128, queries 512-767 of a 1024-row
// cache).
#include <cudnn_frontend.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

namespace fe = cudnn_frontend;

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: fe_sdpa fwd|bwd B H HK SQ SKV KV_ROWS D\n");
    return 2;
  }
  const bool backward = std::string(argv[1]) == "bwd";
  const int64_t b = std::atoi(argv[2]), h = std::atoi(argv[3]), hk = std::atoi(argv[4]),
                s = std::atoi(argv[5]), skv = std::atoi(argv[6]), kv_rows = std::atoi(argv[7]),
                d = std::atoi(argv[8]);
  const int64_t ldq = h * d + 2 * hk * d, kvw = hk * d, w = h * d;
  const bool chunk = skv > s;
  // dK/dV: in the cache's rows for a whole sequence, in rows of their own for a chunk.
  const int64_t dkv_batch = s == skv && skv == kv_rows ? kv_rows * kvw : skv * kvw;
  const auto diagonal =
      chunk ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  g->set_sm_version(90);  // no GPU here to ask
  auto tensor = [&](const char* name, int64_t uid, std::vector<int64_t> dim,
                    std::vector<int64_t> stride) {
    return g->tensor(
        fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
  };
  auto q = tensor("Q", 1, {b, h, s, d}, {s * ldq, d, ldq, 1});
  auto k = tensor("K", 2, {b, hk, skv, d}, {kv_rows * kvw, d, kvw, 1});
  auto v = tensor("V", 3, {b, hk, skv, d}, {kv_rows * kvw, d, kvw, 1});
  if (!backward) {
    auto options = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true);
    options.set_attn_scale(scale)
        .set_diagonal_alignment(diagonal)
        .set_diagonal_band_right_bound(0);
    auto [o, stats] = g->sdpa(q, k, v, options);
    o->set_output(true).set_uid(4).set_dim({b, h, s, d}).set_stride({s * w, d, w, 1});
    stats->set_output(true).set_uid(5).set_data_type(fe::DataType_t::FLOAT);
  } else {
    auto o = tensor("O", 4, {b, h, s, d}, {s * w, d, w, 1});
    auto dout = tensor("dO", 9, {b, h, s, d}, {s * w, d, w, 1});
    auto stats = tensor("Stats", 5, {b, h, s, 1}, {h * s, s, 1, 1});
    stats->set_data_type(fe::DataType_t::FLOAT);
    auto options = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward");
    options.set_attn_scale(scale)
        .set_diagonal_alignment(diagonal)
        .set_diagonal_band_right_bound(0);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
    dq->set_output(true).set_uid(10).set_dim({b, h, s, d}).set_stride({s * ldq, d, ldq, 1});
    dk->set_output(true).set_uid(11).set_dim({b, hk, skv, d}).set_stride({dkv_batch, d, kvw, 1});
    dv->set_output(true).set_uid(12).set_dim({b, hk, skv, d}).set_stride({dkv_batch, d, kvw, 1});
  }
  auto status = g->validate();
  if (status.is_good()) status = g->build_operation_graph(nullptr);
  std::printf("%s %s\n", status.is_good() ? "ok" : "FAIL", status.get_message().c_str());
  return status.is_good() ? 0 : 1;
}
