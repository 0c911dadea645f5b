#!/usr/bin/python3
"""Independent PyTorch reference for vocabpipe's GPT-2 training step.

Reads a checkpoint written by vocabpipe (model.safetensors with Hugging Face GPT-2 names,
config.json), a .bin token file, and the training settings; trains `steps` steps in float64
with torch.optim.AdamW, and writes a safetensors file with
  loss.<i>        per-step mean loss (shape [1])
  grad.<name>     the step-0 gradient of every parameter (before clipping)
  final.<name>    every parameter after the last step
Only the Python standard library, numpy and Debian's python3-torch are used; no vocabpipe code.
"""
import argparse
import json
import math

import torch

from reference_io import load_parameters, read_tokens, train_adamw, write_safetensors


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def forward(p, cfg, idx, targets):
    L, C, nh = cfg["n_layer"], cfg["n_embd"], cfg["n_head"]
    B, T = idx.shape
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:T]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(L):
        pre = f"transformer.h.{l}."
        h = torch.nn.functional.layer_norm(x, (C,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], 1e-5)
        qkv = h @ p[pre + "attn.c_attn.weight"] + p[pre + "attn.c_attn.bias"]
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, nh, C // nh).transpose(1, 2)
        k = k.view(B, T, nh, C // nh).transpose(1, 2)
        v = v.view(B, T, nh, C // nh).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // nh)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[pre + "attn.c_proj.weight"] + p[pre + "attn.c_proj.bias"]
        h = torch.nn.functional.layer_norm(x, (C,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], 1e-5)
        h = gelu_tanh(h @ p[pre + "mlp.c_fc.weight"] + p[pre + "mlp.c_fc.bias"])
        x = x + h @ p[pre + "mlp.c_proj.weight"] + p[pre + "mlp.c_proj.bias"]
    x = torch.nn.functional.layer_norm(x, (C,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], 1e-5)
    head = p["transformer.wte.weight"] if cfg.get("tie_word_embeddings") else p["lm_head.weight"]
    logits = x @ head.T
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(step, a):
    if a.warmup_steps > 0 and step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    if a.lr_schedule == "constant":
        return a.lr
    decay_steps = max(1, a.steps - a.warmup_steps)
    progress = min(1.0, (step - a.warmup_steps) / decay_steps)
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1.0 + math.cos(math.pi * progress))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="folder with model.safetensors, config.json")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-schedule", default="constant")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--min-lr", type=float, default=0.0)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--grad-clip", type=float, default=0.0)
    a = ap.parse_args()

    torch.set_default_dtype(torch.float64)
    cfg = json.load(open(a.checkpoint + "/config.json"))
    p = load_parameters(a.checkpoint, cfg)
    out = train_adamw(p, lambda x, y: forward(p, cfg, x, y), read_tokens(a.data),
                      cfg["n_positions"], a.microbatch_size, a.microbatches, a,
                      lr_at=lambda step: lr_at(step, a), grad_clip=a.grad_clip)
    write_safetensors(a.out, out)

if __name__ == "__main__":
    main()
