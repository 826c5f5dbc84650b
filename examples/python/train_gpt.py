#!/usr/bin/python3
"""train_gpt.py: the character-level GPT of examples/train_gpt.c, written
in Python against the dispatch package (the same model, recipe, batches
and initial weights: gpt_data.py, the copy of examples/lib/gpt_data.h):

    examples/python/train_gpt.py                  # starts its own server
    examples/python/train_gpt.py --device local --steps 200
    examples/python/train_gpt.py --device tcp://127.0.0.1:7070

With no --device and no DISPATCH_DEVICE it starts build/dispatch-server on
127.0.0.1 with a free port and trains through it. Prints the training loss
every --log-every steps, the validation loss at step 1000 and at the end
beside the add-one bigram and unigram baselines, tokens/s and a sample.
"""
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


class GPT:
    """Parameters as tracked leaves in gpt_data.param_specs order."""

    def __init__(self, dev, vocab_size):
        arrays = G.init_params(vocab_size)
        self.specs = G.param_specs(vocab_size)
        self.vocab_size = vocab_size
        self.params = [dev.tensor(arrays[n]).track()
                       for n, _, _ in self.specs]
        self.p = {n: t for (n, _, _), t in zip(self.specs, self.params)}

    def decay(self):
        return [G.WEIGHT_DECAY if len(s) == 2 else 0.0
                for _, s, _ in self.specs]

    def logits(self, idx, train=True):
        """idx [B, T] int64 -> logits [B * T, V]."""
        p = self.p if train else {n: t.inner for n, t in self.p.items()}
        B, T = idx.shape
        D, H = G.D_MODEL, G.N_HEAD
        x = dispatch.embedding(idx, p["wte"]) + \
            dispatch.slice(p["wpe"], 0, 0, T)
        for layer in range(G.N_LAYER):
            q = f"h{layer}."
            h = dispatch.layer_norm(x, D, p[q + "ln1.w"], p[q + "ln1.b"],
                                    1e-5)

            def heads(m, h=h, q=q):
                y = h @ p[q + "w" + m] + p[q + "b" + m]
                return y.reshape(B, T, H, D // H).permute(0, 2, 1, 3)
            a = dispatch.attention(heads("q"), heads("k"), heads("v"),
                                   is_causal=True)
            a = a.permute(0, 2, 1, 3).reshape(B, T, D)
            x = x + (a @ p[q + "wo"] + p[q + "bo"])
            h = dispatch.layer_norm(x, D, p[q + "ln2.w"], p[q + "ln2.b"],
                                    1e-5)
            h = dispatch.gelu(h @ p[q + "w1"] + p[q + "b1"])
            x = x + (h @ p[q + "w2"] + p[q + "b2"])
        x = dispatch.layer_norm(x, D, p["lnf.w"], p["lnf.b"], 1e-5)
        return (x @ p["wout"] + p["bout"]).reshape(B * T, self.vocab_size)


def val_loss(dev, model, toks, n_train):
    offs = G.val_offsets(len(toks), n_train)
    total = 0.0
    for i in range(0, len(offs), G.BATCH):
        x, y = G.windows(toks, n_train, offs[i:i + G.BATCH])
        with dev.scope():
            lg = model.logits(dev.tensor(x), train=False)
            total += dispatch.cross_entropy(
                lg, dev.tensor(y.ravel())).item() * len(x)
    return total / len(offs)


def sample(dev, model, vocab, n):
    rng = G.Rng(G.SAMPLE_SEED)
    ctx = [vocab.index(b"\n"[0])]
    out = []
    for _ in range(n):
        c = ctx[-G.CTX:]
        with dev.scope():
            lg = model.logits(dev.tensor(np.array([c], np.int64)),
                              train=False)
            last = lg[len(c) - 1].numpy().astype(np.float64)
        e = np.exp(last - last.max())
        t = G.sample_pick(rng, e / e.sum())
        ctx.append(t)
        out.append(vocab[t])
    return bytes(out).decode("latin-1")


def train(dev, args, toks, vocab, n_train):
    model = GPT(dev, len(vocab))
    opt = dispatch.AdamW(model.params, lr=G.LR_MAX, betas=G.BETAS,
                         eps=G.ADAM_EPS, weight_decay=model.decay(),
                         clip=G.CLIP)
    print(f"== training on {dev.spec}: "
          f"{sum(int(np.prod(s)) for _, s, _ in model.specs)} parameters, "
          f"{args.steps} steps of {G.BATCH} x {G.CTX}", flush=True)
    rng = G.Rng(G.BATCH_SEED)
    train_s = 0.0
    for step in range(args.steps):
        x, y = G.windows(toks, 0, G.batch_offsets(rng, n_train))
        t0 = time.perf_counter()
        with dev.scope():
            loss = dispatch.cross_entropy(model.logits(dev.tensor(x)),
                                          dev.tensor(y.ravel()))
            grads = loss.backward()
            opt.lr = dispatch.lr_cosine(step, G.WARMUP, G.TOTAL, G.LR_MAX,
                                        G.LR_MIN)
            opt.step(grads)
            lv = loss.item()  # remote: waits for the step
        train_s += time.perf_counter() - t0
        if not np.isfinite(lv):
            sys.exit(f"train_gpt: step {step + 1}: loss {lv}")
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1:5d}  loss {lv:.6f}  "
                  f"lr {G.lr_cosine(step):.2e}", flush=True)
        if step + 1 == G.TOTAL // 2 and step + 1 < args.steps:
            print(f"step {step + 1:5d}  val loss "
                  f"{val_loss(dev, model, toks, n_train):.6f}", flush=True)
    print(f"step {args.steps:5d}  val loss "
          f"{val_loss(dev, model, toks, n_train):.6f}")
    big, uni = G.baselines(toks, n_train, len(vocab))
    print(f"baselines on the same val windows: bigram {big:.4f}  "
          f"unigram {uni:.4f}")
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
