#!/usr/bin/python3
"""train_mlp.py: the MLP of examples/train_mlp.c (784-256-10, ReLU,
cross-entropy, Adam lr 1e-3, batch 128, He-uniform init from a fixed seed)
on Fashion-MNIST, written in Python against the dispatch package:

    examples/python/train_mlp.py                       # starts its own server
    examples/python/train_mlp.py --device tcp://127.0.0.1:7070
    examples/python/train_mlp.py --device local --limit 6000

With no --device and no DISPATCH_DEVICE it starts build/dispatch-server on
127.0.0.1 with a free port and trains through it. Prints a progress line
every 100 steps and, per epoch, the mean loss, the test accuracy on the
10,000 test images and the time. Data: Debian's dataset-fashion-mnist
(/usr/share/datasets/fashion-mnist, or $FASHION_MNIST_DIR).
"""
import argparse
import gzip
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
import dispatch  # noqa: E402


def load_idx(path):
    """An IDX file (gzip'd) as a uint8 array of its shape."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    nd = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big")
                 for i in range(nd))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * nd)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: {data.size} bytes for shape {dims}")
    return data.reshape(dims)


def load_split(folder, train):
    pre = "train" if train else "t10k"
    x = load_idx(os.path.join(folder, f"{pre}-images-idx3-ubyte.gz"))
    y = load_idx(os.path.join(folder, f"{pre}-labels-idx1-ubyte.gz"))
    return (x.reshape(len(x), 784).astype(np.float32) / 255.0,
            y.astype(np.int64))


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
        sys.exit(f"train_mlp: {binary} did not start: {line!r}")
    return proc, "tcp://" + m.group(1)


def he_uniform(dev, shape, fan_in, seed):
    """A tracked leaf, uniform in +-sqrt(6/fan_in) (bias: zeros)."""
    if fan_in == 0:
        return dev.zeros(shape).track()
    b = (6.0 / fan_in) ** 0.5
    return dev.uniform(shape, -b, b, seed=seed).track()


def forward(params, x):
    w1, b1, w2, b2 = params
    return (x @ w1 + b1).relu() @ w2 + b2


def evaluate(dev, params, x_test, y_test, batch):
    plain = [p.inner for p in params]  # same storage, nothing recorded
    right = 0
    for s in range(0, len(x_test), batch):
        with dev.scope():
            pred = forward(plain, dev.tensor(x_test[s:s + batch])).argmax(1)
            right += int((pred.numpy() == y_test[s:s + batch]).sum())
    return 100.0 * right / len(x_test)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", help="local, tcp://HOST:PORT, tls://...; "
                    "default: $DISPATCH_DEVICE, else a server started here")
    ap.add_argument("--data", default=os.environ.get(
        "FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0,
                    help="use only the first N training images")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args()

    x_train, y_train = load_split(args.data, True)
    x_test, y_test = load_split(args.data, False)
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]

    server = None
    spec = args.device or os.environ.get("DISPATCH_DEVICE")
    if not spec:
        server, spec = start_server()
        print(f"== started dispatch-server pid {server.pid} ({spec})")
    try:
        with dispatch.device(spec) as dev:
            print(f"== training on {dev.spec}: {len(x_train)} images, "
                  f"batch {args.batch}, {args.epochs} epoch(s)")
            params = [he_uniform(dev, (784, 256), 784, args.seed),
                      he_uniform(dev, (256,), 0, 0),
                      he_uniform(dev, (256, 10), 256, args.seed + 1),
                      he_uniform(dev, (10,), 0, 0)]
            opt = dispatch.Adam(params, lr=args.lr)
            rng = np.random.default_rng(args.seed)
            n, bs = len(x_train), args.batch
            steps = (n + bs - 1) // bs
            for e in range(args.epochs):
                perm = rng.permutation(n)
                t0 = tw = time.perf_counter()
                total = window = 0.0
                for s in range(steps):
                    idx = perm[s * bs:(s + 1) * bs]
                    with dev.scope():
                        x = dev.tensor(x_train[idx])
                        y = dev.tensor(y_train[idx])
                        loss = dispatch.cross_entropy(forward(params, x), y)
                        opt.step(loss.backward())
                        # remote: this read waits for the step, so an
                        # error of this step surfaces here
                        lv = loss.item()
                    if not np.isfinite(lv):
                        sys.exit(f"epoch {e + 1} step {s + 1}: loss {lv}")
                    total += lv
                    window += lv
                    if args.log_every and (s + 1) % args.log_every == 0:
                        now = time.perf_counter()
                        print(f"  epoch {e + 1} step {s + 1:4d}/{steps}  "
                              f"loss {window / args.log_every:.4f}  "
                              f"{args.log_every * bs / (now - tw):6.0f} img/s",
                              flush=True)
                        tw, window = now, 0.0
                t1 = time.perf_counter()
                acc = evaluate(dev, params, x_test, y_test, 1000)
                t2 = time.perf_counter()
                print(f"epoch {e + 1}/{args.epochs}  mean loss "
                      f"{total / steps:.4f}  test accuracy {acc:.2f}%  "
                      f"time {t2 - t0:.1f} s (train {t1 - t0:.1f} s, "
                      f"{n / (t1 - t0):.0f} img/s; eval {t2 - t1:.1f} s)",
                      flush=True)
    except dispatch.DispatchError as err:
        sys.exit(f"train_mlp: {err}")
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
