#!/usr/bin/python3
"""Independent PyTorch reference for vocabpipe's greedy decoding.

Reads a GPT-2 checkpoint written by vocabpipe (model.safetensors with Hugging Face names,
config.json) and prompt token ids; decodes greedily in float64, recomputing the whole prefix at
every step (no cache), and writes JSON:
  {"tokens": [the N picked ids], "margins": [logit of the best minus the second best, per step],
   "logits": [the V logits after the prompt]}
The forward is written from the GPT-2 equations: pre-LayerNorm blocks (eps 1e-5), causal
softmax attention scaled by 1/sqrt(head size), a tanh-GELU MLP, the final LayerNorm and the
output projection (wte when tie_word_embeddings). Only the standard library, numpy and
Debian's python3-torch; no vocabpipe code.
"""
import argparse
import json
import math

import torch

from reference_io import greedy, read_checkpoint


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, w, b):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * w + b


def next_logits(p, cfg, ids):
    """Logits after the last of `ids` (T tokens): the whole prefix, one causal forward."""
    C, nh = cfg["n_embd"], cfg["n_head"]
    T = len(ids)
    idx = torch.tensor(ids, dtype=torch.long)
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:T]  # (T, C)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(cfg["n_layer"]):
        pre = f"transformer.h.{l}."
        h = layer_norm(x, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"])
        qkv = h @ p[pre + "attn.c_attn.weight"] + p[pre + "attn.c_attn.bias"]  # (T, 3C)
        q, k, v = (t.reshape(T, nh, C // nh).transpose(0, 1) for t in qkv.split(C, dim=1))
        scores = (q @ k.transpose(1, 2)) / math.sqrt(C // nh)  # (nh, T, T)
        scores = scores.masked_fill(~causal, float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(T, C)
        x = x + y @ p[pre + "attn.c_proj.weight"] + p[pre + "attn.c_proj.bias"]
        h = layer_norm(x, p[pre + "ln_2.weight"], p[pre + "ln_2.bias"])
        x = x + gelu(h @ p[pre + "mlp.c_fc.weight"] + p[pre + "mlp.c_fc.bias"]) \
            @ p[pre + "mlp.c_proj.weight"] + p[pre + "mlp.c_proj.bias"]
    x = layer_norm(x[-1], p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
    head = p["transformer.wte.weight"] if cfg.get("tie_word_embeddings") else p["lm_head.weight"]
    return head @ x  # (V)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompt", required=True, help="comma-separated token ids")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cfg = json.load(open(a.checkpoint + "/config.json"))
    p = {k: torch.tensor(v, dtype=torch.float64)
         for k, v in read_checkpoint(a.checkpoint).items()}
    ids = [int(t) for t in a.prompt.split(",")]
    with open(a.out, "w") as f:
        json.dump(greedy(lambda prefix: next_logits(p, cfg, prefix), ids, a.tokens), f)

if __name__ == "__main__":
    main()
