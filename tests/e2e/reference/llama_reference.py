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
import struct

import numpy as np
import torch


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32", e
        b, end = e["data_offsets"]
        out[name] = np.frombuffer(data[b:end], dtype="<f4").reshape(e["shape"]).copy()
    return out


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr, dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    text = json.dumps(header).encode()
    text += b" " * ((8 - (len(text) + 8) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_tokens(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        magic, version, count = int(header[0]), int(header[1]), int(header[2])
        dtype = {(20240520, 1): "<u2", (20240801, 7): "<u4"}[(magic, version)]
        return np.frombuffer(f.read(), dtype=dtype)[:count].astype(np.int64)


def batch(tokens, step, j, b, m, s):
    """Sample k = (step*m + j)*b + t reads tokens [k*s, k*s + s + 1), wrapping."""
    n = len(tokens)
    rows = []
    for t in range(b):
        k = (step * m + j) * b + t
        rows.append([tokens[(k * s + i) % n] for i in range(s + 1)])
    rows = torch.tensor(rows, dtype=torch.long)
    return rows[:, :-1], rows[:, 1:]


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
    raw = read_safetensors(a.checkpoint + "/model.safetensors")
    if cfg.get("tie_word_embeddings"):
        raw.pop("lm_head.weight", None)
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in raw.items()}
    decay = [t for t in p.values() if t.dim() >= 2]
    no_decay = [t for t in p.values() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    tokens = read_tokens(a.data)
    s, b, m = a.seq_len or cfg["max_position_embeddings"], a.microbatch_size, a.microbatches
    out = {}
    with torch.no_grad():
        out["logits"] = logits_of(p, cfg, batch(tokens, 0, 0, b, m, s)[0]).numpy()
    for step in range(a.steps):
        opt.zero_grad()
        total = 0.0
        for j in range(m):
            x, y = batch(tokens, step, j, b, m, s)
            loss = loss_of(p, cfg, x, y) / m
            loss.backward()
            total += loss.item()
        out[f"loss.{step}"] = np.array([total])
        if step == 0:
            for k, t in p.items():
                out["grad." + k] = t.grad.detach().numpy().copy()
        opt.step()
    for k, t in p.items():
        out["final." + k] = t.detach().numpy()
    write_safetensors(a.out, out)


if __name__ == "__main__":
    main()
