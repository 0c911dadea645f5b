#!/usr/bin/python3
"""Independent PyTorch reference for vocabpipe's greedy decoding of a Llama checkpoint.

Reads a checkpoint written by vocabpipe (model.safetensors with LlamaForCausalLM's names,
config.json) and prompt token ids; decodes greedily in float64, recomputing the whole prefix at
every step (no cache, every position rotated from 0), and writes JSON in the format of
gpt2_sample_reference.py:
  {"tokens": [the N picked ids], "margins": [best minus second-best logit, per step],
   "logits": [the V logits after the prompt]}
The forward is llama_reference.py's, written from the published equations (RMSNorm, RoPE in the
rotate-half pairing, grouped-query attention, SwiGLU). Only the standard library, numpy and
Debian's python3-torch; no vocabpipe code.
"""
import argparse
import json

import torch

from llama_reference import logits_of
from reference_io import greedy, read_checkpoint


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompt", required=True, help="comma-separated token ids")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    cfg = json.load(open(a.checkpoint + "/config.json"))
    assert cfg["model_type"] == "llama", cfg
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    p = {k: torch.tensor(v, dtype=torch.float64)
         for k, v in read_checkpoint(a.checkpoint).items()}
    ids = [int(t) for t in a.prompt.split(",")]
    picks = greedy(lambda prefix: logits_of(p, cfg, torch.tensor([prefix], dtype=torch.long))[0, -1],
                   ids, a.tokens)  # (V) after the prefix's last token
    with open(a.out, "w") as f:
        json.dump(picks, f)

if __name__ == "__main__":
    main()
