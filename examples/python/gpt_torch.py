#!/usr/bin/python3
"""gpt_torch.py: the PyTorch (1.13, CPU) reference of examples/train_gpt.c,
the character-level GPT of issue 23 on the fortunes corpus:

    examples/python/gpt_torch.py [--steps 2000] [--threads 2]

2 layers, d_model 128, 4 heads, context 64, pre-LayerNorm, MLP 512 with
exact GELU, learned positional embedding, untied output layer; AdamW
(betas 0.9/0.95, eps 1e-8, weight decay 0.1 on the 2-D parameters only),
lr 3e-3 with 100 warmup steps and cosine decay to 3e-4 at step 2000,
batch 32 x 64, gradient clipping at global norm 1.0. Data, batches,
initialisation, validation windows and baselines come from gpt_data.py,
the same rules as the C program (examples/lib/gpt_data.h), so both start
from the same weights and see the same batches.

Prints the training loss of every 100th step, the validation loss at
steps 1000 and 2000 (and at the last step), the add-one bigram and unigram
baselines, tokens/s over the training steps, and a 300-character sample
(seeded sampling from "\\n"). --bench N times N steps only (bench/gpt.c).

Reference run (torch 1.13.1 Debian, 2 threads, 2 cores shared with other
builds): training loss 2.6610 @100, 1.9306 @1000, 1.6333 @2000; validation
1.8986 @1000 and 1.7405 @2000; bigram 2.6172, unigram 3.3777 (vocab 114,
2,576,674 bytes, 2,319,007 train). Step 1's loss, 4.748587, is the C
program's to the printed digit (same weights, same batch).
"""
import argparse
import math
import pathlib
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpt_data as G  # noqa: E402


class GPT:
    """The model as explicit tensors in gpt_data.param_specs order."""

    def __init__(self, vocab_size):
        arrays = G.init_params(vocab_size)
        self.specs = G.param_specs(vocab_size)
        self.p = {n: torch.tensor(arrays[n], requires_grad=True)
                  for n, _, _ in self.specs}

    def params(self):
        return [self.p[n] for n, _, _ in self.specs]

    def groups(self):
        decay = [self.p[n] for n, s, _ in self.specs if len(s) == 2]
        other = [self.p[n] for n, s, _ in self.specs if len(s) != 2]
        return [{"params": decay, "weight_decay": G.WEIGHT_DECAY},
                {"params": other, "weight_decay": 0.0}]

    def logits(self, idx):
        p = self.p
        B, T = idx.shape
        D, H = G.D_MODEL, G.N_HEAD
        hd = D // H
        x = F.embedding(idx, p["wte"]) + p["wpe"][:T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for layer in range(G.N_LAYER):
            q = f"h{layer}."
            h = F.layer_norm(x, (D,), p[q + "ln1.w"], p[q + "ln1.b"], 1e-5)

            def heads(m):
                y = h @ p[q + "w" + m] + p[q + "b" + m]
                return y.view(B, T, H, hd).transpose(1, 2)
            att = heads("q") @ heads("k").transpose(-2, -1) / math.sqrt(hd)
            att = att.masked_fill(~causal, float("-inf")).softmax(-1)
            y = (att @ heads("v")).transpose(1, 2).reshape(B, T, D)
            x = x + y @ p[q + "wo"] + p[q + "bo"]
            h = F.layer_norm(x, (D,), p[q + "ln2.w"], p[q + "ln2.b"], 1e-5)
            h = F.gelu(h @ p[q + "w1"] + p[q + "b1"])
            x = x + h @ p[q + "w2"] + p[q + "b2"]
        x = F.layer_norm(x, (D,), p["lnf.w"], p["lnf.b"], 1e-5)
        return x @ p["wout"] + p["bout"]

    def loss(self, x, y):
        lg = self.logits(x)
        return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1))


def val_loss(model, toks, n_train):
    offs = G.val_offsets(len(toks), n_train)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(offs), G.BATCH):
            x, y = G.windows(toks, n_train, offs[i:i + G.BATCH])
            total += model.loss(torch.from_numpy(x),
                                torch.from_numpy(y)).item() * len(x)
    return total / len(offs)


def sample(model, vocab, n=300):
    rng = G.Rng(G.SAMPLE_SEED)
    ctx = [vocab.index(b"\n"[0])]
    out = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ctx[-G.CTX:]], dtype=torch.int64)
            lg = model.logits(x)[0, -1].double()
            probs = torch.softmax(lg, -1).numpy()
            t = G.sample_pick(rng, probs)
            ctx.append(t)
            out.append(vocab[t])
    return bytes(out).decode("latin-1")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=G.TOTAL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench", type=int, default=0,
                    help="time this many steps after 3 warm-up steps; "
                    "prints 'torch_step_ms X'")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    toks, vocab, n_train = G.load_corpus()
    V = len(vocab)
    print(f"corpus {len(toks)} bytes, vocab {V}, train {n_train}, "
          f"val {len(toks) - n_train}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}", flush=True)
    model = GPT(V)
    opt = torch.optim.AdamW(model.groups(), lr=G.LR_MAX, betas=G.BETAS,
                            eps=G.ADAM_EPS)
    rng = G.Rng(G.BATCH_SEED)
    steps = a.steps if not a.bench else a.bench + 3
    train_s = 0.0
    for step in range(steps):
        if a.bench and step == 3:
            train_s = 0.0
        x, y = G.windows(toks, 0, G.batch_offsets(rng, n_train))
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = G.lr_cosine(step)
        loss = model.loss(torch.from_numpy(x), torch.from_numpy(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.params(), G.CLIP)
        opt.step()
        lv = loss.item()
        train_s += time.perf_counter() - t0
        if a.bench:
            continue
        if (step + 1) % 100 == 0:
            print(f"step {step + 1:5d}  loss {lv:.4f}  "
                  f"lr {G.lr_cosine(step):.2e}", flush=True)
        if step + 1 in (1000, 2000) or step + 1 == steps:
            print(f"step {step + 1:5d}  val loss "
                  f"{val_loss(model, toks, n_train):.4f}", flush=True)
    if a.bench:
        print(f"torch_step_ms {1000.0 * train_s / a.bench:.3f}")
        return
    big, uni = G.baselines(toks, n_train, V)
    print(f"baselines on the same val windows: bigram {big:.4f}  "
          f"unigram {uni:.4f}")
    print(f"tokens/s {steps * G.BATCH * G.CTX / train_s:.0f} "
          f"({1000.0 * train_s / steps:.1f} ms/step)")
    print("sample:\n" + sample(model, vocab))


if __name__ == "__main__":
    main()
