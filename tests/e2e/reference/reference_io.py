#!/usr/bin/python3
"""What the independent PyTorch references share besides their models: the file formats they
read and write, the batch order of a training run, the AdamW loop and greedy decoding.

  read_safetensors / write_safetensors   F32 tensors by name (the safetensors layout)
  read_checkpoint                        a model folder's tensors: model.safetensors, or
                                         Hugging Face's sharded form (the index and its files)
  read_tokens                            an llm.c .bin token file (uint16 v1 or uint32 v7)
  batch                                  microbatch j of step `step`: (b, s) inputs and targets
  train_adamw                            float64 training with torch.optim.AdamW, its record
  greedy                                 greedy decoding with any next-token-logits function

The model equations stay in each reference (gpt2_reference.py, llama_reference.py, ...), so
every one of them is still written from its paper alone. Only the standard library, numpy and
Debian's python3-torch; no vocabpipe code.
"""
import json
import os
import struct

import numpy as np
import torch


def read_safetensors(path):
    """{name: float32 numpy array} of every tensor in the file."""
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


def read_checkpoint(folder):
    """{name: float32 numpy array} of a model folder in either of Hugging Face's forms: the
    files model.safetensors.index.json's weight_map names, or the single model.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(folder, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        for name, arr in read_safetensors(os.path.join(folder, file)).items():
            assert weight_map.get(name) == file, (name, file)
            out[name] = arr
    assert set(out) == set(weight_map), "weight_map names tensors its files lack"
    return out


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr, dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    text = json.dumps(header).encode()
    text += b" " * ((8 - (len(text) + 8) % 8) % 8)  # the data starts 8-byte aligned
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


def load_parameters(checkpoint, cfg):
    """The checkpoint's tensors as float64 leaves that need gradients; a tied model's lm_head
    copy is dropped so the embedding is its only parameter."""
    raw = read_checkpoint(checkpoint)
    if cfg.get("tie_word_embeddings"):
        raw.pop("lm_head.weight", None)
    return {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in raw.items()}


def train_adamw(p, loss_of, tokens, s, b, m, a, lr_at=None, grad_clip=0.0):
    """`a.steps` steps of torch.optim.AdamW (lr a.lr, betas (a.beta1, a.beta2), eps a.eps;
    weight decay a.weight_decay on matrices only) over the mean of m microbatch losses
    loss_of(inputs, targets). lr_at(step), when given, sets each step's learning rate; grad_clip
    > 0 clips the global gradient norm. Returns {loss.<i>: [loss], grad.<name>: step 0's gradient
    (before clipping), final.<name>: the parameters after the last step}."""
    decay = [t for t in p.values() if t.dim() >= 2]
    no_decay = [t for t in p.values() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    out = {}
    for step in range(a.steps):
        opt.zero_grad()
        total = 0.0
        for j in range(m):
            x, y = batch(tokens, step, j, b, m, s)
            loss = loss_of(x, y) / m
            loss.backward()
            total += loss.item()
        out[f"loss.{step}"] = np.array([total])
        if step == 0:
            for k, t in p.items():
                out["grad." + k] = t.grad.detach().numpy().copy()  # t.grad is reused by later steps
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(p.values()), grad_clip)
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
        opt.step()
    for k, t in p.items():
        out["final." + k] = t.detach().numpy()
    return out


def greedy(next_logits, ids, n):
    """n greedy picks after the prompt `ids`, each from next_logits(prefix) -> (V) computed over
    the whole prefix. Returns {"tokens": picks, "margins": best minus second-best logit per
    pick, "logits": the V logits after the prompt}."""
    ids = list(ids)
    picked, margins, first = [], [], None
    with torch.no_grad():
        for _ in range(n):
            logits = next_logits(ids)
            if first is None:
                first = logits.tolist()
            top2 = torch.topk(logits, 2)
            picked.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            ids.append(picked[-1])
    return {"tokens": picked, "margins": margins, "logits": first}
