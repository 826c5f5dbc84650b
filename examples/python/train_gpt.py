#!/usr/bin/python3
"""train_gpt.py: the character-level GPT of examples/train_gpt.c, written
in Python with dispatch.nn modules, dispatch.optim.AdamW with parameter
groups, the CosineWithWarmup schedule and nn.utils.clip_grad_norm_ (the
same model, recipe, batches and initial weights: gpt_data.py, the copy of
examples/lib/gpt_data.h, loaded through load_state_dict). For the same
seed it prints the same losses as the C example:

    examples/python/train_gpt.py                  # starts its own server
    examples/python/train_gpt.py --device local --steps 200
    examples/python/train_gpt.py --device tcp://127.0.0.1:7070
    examples/python/train_gpt.py --precision bf16   # or f16 (issue 24)

With no --device and no DISPATCH_DEVICE it starts build/dispatch-server on
127.0.0.1 with a free port and trains through it. Prints the training loss
every --log-every steps, the validation loss at step 1000 and at the end
beside the add-one bigram and unigram baselines, tokens/s and a sample.
--precision bf16 or f16 trains in mixed precision as the C example does:
dispatch.autocast around the whole run (f32 master weights, matmuls and
attention in half) and, for f16, dispatch.GradScaler.
"""
import contextlib
import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(HERE))
import dispatch  # noqa: E402
import dispatch.nn as nn  # noqa: E402
import dispatch.nn.functional as F  # noqa: E402
from dispatch.optim import lr_scheduler  # noqa: E402
import gpt_data as G  # noqa: E402


def start_server():
    """build/dispatch-server on 127.0.0.1:0; returns (process, spec)."""
    binary = os.environ.get("DISPATCH_SERVER_BIN") or \
        str(ROOT / "build" / "dispatch-server")
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0",
                             "--log-level", "warn"],
                            stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    m = re.match(r"dispatch-server listening on (127\.0\.0\.1:\d+)$",
                 line.strip())
    if not m:
        proc.kill()
        sys.exit(f"train_gpt: {binary} did not start: {line!r}")
    return proc, "tcp://" + m.group(1)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then
    x + mlp(ln2(x)) with an exact-GELU MLP."""

    def __init__(self, dev):
        super().__init__()
        D = G.D_MODEL
        self.ln1 = nn.LayerNorm(D, device=dev)
        self.attn = nn.CausalSelfAttention(D, G.N_HEAD, device=dev)
        self.ln2 = nn.LayerNorm(D, device=dev)
        self.mlp = nn.Sequential(nn.Linear(D, G.D_MLP, device=dev),
                                 nn.GELU(),
                                 nn.Linear(G.D_MLP, D, device=dev))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and learned positional embeddings, N_LAYER blocks, a final
    LayerNorm and the head: the C example's model, with torch's layout
    (Linear weights [out, in]) and parameter names."""

    def __init__(self, dev, vocab_size):
        super().__init__()
        D = G.D_MODEL
        self.vocab_size = vocab_size
        self.wte = nn.Embedding(vocab_size, D, device=dev)
        self.wpe = nn.Embedding(G.CTX, D, device=dev)
        self.h = nn.ModuleList(Block(dev) for _ in range(G.N_LAYER))
        self.ln_f = nn.LayerNorm(D, device=dev)
        self.head = nn.Linear(D, vocab_size, device=dev)

    def forward(self, idx):
        """idx [B, T] int64 -> logits [B * T, V]."""
        B, T = idx.shape
        # positions 0..T-1 are the first T rows of wpe
        x = self.wte(idx) + dispatch.slice(self.wpe.weight, 0, 0, T)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x)).reshape(B * T, self.vocab_size)


def recipe_state_dict(vocab_size):
    """gpt_data's initial weights (its names, matrices [in, out]) under the
    module's names, matrices transposed to [out, in]."""
    arrays = G.init_params(vocab_size)
    sd = {"wte.weight": arrays["wte"], "wpe.weight": arrays["wpe"]}
    proj = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj",
            "o": "attn.out_proj", "1": "mlp.0", "2": "mlp.2"}
    for layer in range(G.N_LAYER):
        c, m = f"h{layer}.", f"h.{layer}."
        for ln in ("ln1", "ln2"):
            sd[m + ln + ".weight"] = arrays[c + ln + ".w"]
            sd[m + ln + ".bias"] = arrays[c + ln + ".b"]
        for k, name in proj.items():
            sd[m + name + ".weight"] = arrays[c + "w" + k].T
            sd[m + name + ".bias"] = arrays[c + "b" + k]
    sd.update({"ln_f.weight": arrays["lnf.w"], "ln_f.bias": arrays["lnf.b"],
               "head.weight": arrays["wout"].T, "head.bias": arrays["bout"]})
    return sd


def val_loss(dev, model, toks, n_train):
    offs = G.val_offsets(len(toks), n_train)
    total = 0.0
    for i in range(0, len(offs), G.BATCH):
        x, y = G.windows(toks, n_train, offs[i:i + G.BATCH])
        with dev.scope(), dispatch.no_grad():
            lg = model(dev.tensor(x))
            total += dispatch.cross_entropy(
                lg, dev.tensor(y.ravel())).item() * len(x)
    return total / len(offs)


def sample(dev, model, vocab, n):
    rng = G.Rng(G.SAMPLE_SEED)
    ctx = [vocab.index(b"\n"[0])]
    out = []
    for _ in range(n):
        c = ctx[-G.CTX:]
        with dev.scope(), dispatch.no_grad():
            lg = model(dev.tensor(np.array([c], np.int64)))
            last = lg[len(c) - 1].numpy().astype(np.float64)
        e = np.exp(last - last.max())
        t = G.sample_pick(rng, e / e.sum())
        ctx.append(t)
        out.append(vocab[t])
    return bytes(out).decode("latin-1")


def train(dev, args, toks, vocab, n_train):
    half = args.precision != "f32"
    amp = dispatch.autocast(dtype={"bf16": "bfloat16", "f16": "float16"}
                            [args.precision], device=dev) if half \
        else contextlib.nullcontext()
    with amp:
        _train(dev, args, toks, vocab, n_train)


def _train(dev, args, toks, vocab, n_train):
    # f16: torch.cuda.amp.GradScaler's defaults, inside the step
    scaler = dispatch.GradScaler(enabled=args.precision == "f16")
    model = GPT(dev, len(vocab))
    model.load_state_dict(recipe_state_dict(len(vocab)))
    params = list(model.parameters())
    # weight decay on the matrices and embeddings (2-D) only
    opt = dispatch.optim.AdamW(
        [{"params": [p for p in params if p.ndim == 2],
          "weight_decay": G.WEIGHT_DECAY},
         {"params": [p for p in params if p.ndim != 2],
          "weight_decay": 0.0}],
        lr=G.LR_MAX, betas=G.BETAS, eps=G.ADAM_EPS)
    sched = lr_scheduler.CosineWithWarmup(opt, G.WARMUP, G.TOTAL,
                                          lr_min=G.LR_MIN)
    print(f"== training on {dev.spec}: "
          f"{sum(p.size for p in params)} parameters, "
          f"{args.steps} steps of {G.BATCH} x {G.CTX}, precision "
          f"{args.precision}", flush=True)
    rng = G.Rng(G.BATCH_SEED)
    train_s = 0.0
    for step in range(args.steps):
        x, y = G.windows(toks, 0, G.batch_offsets(rng, n_train))
        t0 = time.perf_counter()
        lr = sched.get_last_lr()[0]
        with dev.scope():
            loss = F.cross_entropy(model(dev.tensor(x)),
                                   dev.tensor(y.ravel()))
            grads = scaler.scale(loss).backward()
            nn.utils.clip_grad_norm_(params, G.CLIP)  # inside the step
            scaler.step(opt, grads)  # opt.step(grads) when not f16
            scaler.update()
            lv = loss.item()  # remote: waits for the step
        sched.step()
        train_s += time.perf_counter() - t0
        if not np.isfinite(lv):
            sys.exit(f"train_gpt: step {step + 1}: loss {lv}")
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1:5d}  loss {lv:.6f}  lr {lr:.2e}",
                  flush=True)
        if step + 1 == G.TOTAL // 2 and step + 1 < args.steps:
            print(f"step {step + 1:5d}  val loss "
                  f"{val_loss(dev, model, toks, n_train):.6f}", flush=True)
    print(f"step {args.steps:5d}  val loss "
          f"{val_loss(dev, model, toks, n_train):.6f}")
    big, uni = G.baselines(toks, n_train, len(vocab))
    print(f"baselines on the same val windows: bigram {big:.4f}  "
          f"unigram {uni:.4f}")
    if scaler.is_enabled():
        print(f"grad scaler: scale {scaler.get_scale():g}, "
              f"{scaler.skipped_steps} steps skipped")
    print(f"tokens/s {args.steps * G.BATCH * G.CTX / train_s:.0f} "
          f"({1000.0 * train_s / args.steps:.1f} ms/step over "
          f"{args.steps} steps)")
    if args.sample:
        print("sample:\n" + sample(dev, model, vocab, args.sample))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", help="local, tcp://HOST:PORT, tls://...; "
                    "default: $DISPATCH_DEVICE, else a server started here")
    ap.add_argument("--steps", type=int, default=G.TOTAL)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--sample", type=int, default=300)
    ap.add_argument("--precision", choices=("f32", "bf16", "f16"),
                    default="f32", help="mixed precision (default f32)")
    args = ap.parse_args()
    toks, vocab, n_train = G.load_corpus()
    server = None
    spec = args.device or os.environ.get("DISPATCH_DEVICE")
    if not spec:
        server, spec = start_server()
        print(f"== started dispatch-server pid {server.pid} ({spec})")
    try:
        with dispatch.device(spec) as dev:
            train(dev, args, toks, vocab, n_train)
    except dispatch.DispatchError as err:
        sys.exit(f"train_gpt: {err}")
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
