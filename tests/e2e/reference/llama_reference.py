#!/usr/bin/python3
"""Independent PyTorch reference for vocabpipe's Llama training step.

Written from the published equations, not from vocabpipe's code:
  RMSNorm        y = x / sqrt(mean(x^2) + eps) * g                      (Zhang & Sennrich 2019)
  RoPE           rotate pairs of each head's dimensions by pos * theta^(-2i/d)
                 (Su et al., RoFormer), in Hugging Face Llama's "rotate half" pairing:
                 dimension i with i + d/2
  GQA            query head j attends with key/value head j // (heads / kv_heads)
                 (Ainslie et al. 2023)
  SwiGLU MLP     down(silu(gate(x)) * up(x))                             (Shazeer 2020)
  block          x += o(attn(rms1(x)));  x += mlp(rms2(x));  logits = rms_f(x) @ head^T
with nn.Linear weights [out, in] under LlamaForCausalLM's names.

Reads a checkpoint (model.safetensors, config.json), an llm.c .bin token file and the training
settings; trains `steps` steps in float64 with torch.optim.AdamW and writes a safetensors file:
  loss.<i>   per-step mean loss (shape [1])
  grad.<n>   the step-0 gradient of every parameter (before clipping)
  final.<n>  every parameter after the last step
  logits     (b, s, V) logits of step 0's first microbatch under the checkpoint's weights
Only the standard library, numpy and Debian's python3-torch are used.
"""
import argparse
import json
import math

import torch

from reference_io import batch, load_parameters, read_tokens, train_adamw, write_safetensors


def rms_norm(x, g, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * g


def rotary(x, theta):
    """x: (B, heads, T, d). Rotates (x_i, x_{i+d/2}) by pos * theta^(-2i/d)."""
    T, d = x.shape[2], x.shape[3]
    i = torch.arange(d // 2, dtype=torch.float64)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-2.0 * i / d)[None, :]
    c, s = torch.cos(angle), torch.sin(angle)  # (T, d/2)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def logits_of(p, cfg, idx):
    L, C = cfg["num_hidden_layers"], cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = C // nh
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    B, T = idx.shape
    x = p["model.embed_tokens.weight"][idx]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(L):
        pre = f"model.layers.{l}."
        h = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        q = (h @ p[pre + "self_attn.q_proj.weight"].T).view(B, T, nh, d).transpose(1, 2)
        k = (h @ p[pre + "self_attn.k_proj.weight"].T).view(B, T, nkv, d).transpose(1, 2)
        v = (h @ p[pre + "self_attn.v_proj.weight"].T).view(B, T, nkv, d).transpose(1, 2)
        q, k = rotary(q, theta), rotary(k, theta)
        k = k.repeat_interleave(nh // nkv, dim=1)  # head j reads key/value head j // group
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[pre + "self_attn.o_proj.weight"].T
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate = h @ p[pre + "mlp.gate_proj.weight"].T
        up = h @ p[pre + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    x = rms_norm(x, p["model.norm.weight"], eps)
    head = p["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else p["lm_head.weight"]
    return x @ head.T


def loss_of(p, cfg, idx, targets):
    logits = logits_of(p, cfg, idx)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="folder with model.safetensors, config.json")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--seq-len", type=int, default=0, help="default: max_position_embeddings")
    a = ap.parse_args()

    torch.set_default_dtype(torch.float64)
    cfg = json.load(open(a.checkpoint + "/config.json"))
    assert cfg["model_type"] == "llama", cfg
    p = load_parameters(a.checkpoint, cfg)
    tokens = read_tokens(a.data)
    s, b, m = a.seq_len or cfg["max_position_embeddings"], a.microbatch_size, a.microbatches
    with torch.no_grad():
        logits = logits_of(p, cfg, batch(tokens, 0, 0, b, m, s)[0]).numpy()
    out = train_adamw(p, lambda x, y: loss_of(p, cfg, x, y), tokens, s, b, m, a)
    out["logits"] = logits
    write_safetensors(a.out, out)

if __name__ == "__main__":
    main()
