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
    raw = read_safetensors(a.checkpoint + "/model.safetensors")
    if cfg.get("tie_word_embeddings"):
        raw.pop("lm_head.weight", None)
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in raw.items()}
    decay = [t for k, t in p.items() if t.dim() >= 2]
    no_decay = [t for k, t in p.items() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    tokens = read_tokens(a.data)
    s, b, m = cfg["n_positions"], a.microbatch_size, a.microbatches
    out = {}
    for step in range(a.steps):
        opt.zero_grad()
        total = 0.0
        for j in range(m):
            x, y = batch(tokens, step, j, b, m, s)
            loss = forward(p, cfg, x, y) / m
            loss.backward()
            total += loss.item()
        out[f"loss.{step}"] = np.array([total])
        if step == 0:
            for k, t in p.items():
                out["grad." + k] = t.grad.detach().numpy().copy()  # t.grad is reused by later steps
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(p.values()), a.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        opt.step()
    for k, t in p.items():
        out["final." + k] = t.detach().numpy()
    write_safetensors(a.out, out)


if __name__ == "__main__":
    main()
