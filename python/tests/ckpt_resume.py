"""Save, killed, load, resume: a small Adam training run in a process of
its own (python/tests/test_checkpoint.py runs it; it is also a script to
read, or to run by hand against a server).

    ckpt_resume.py SPEC DIR full N     N steps from the start
    ckpt_resume.py SPEC DIR stop K     K steps, then dispatch.save of the
                                       parameters and Adam's state to
                                       DIR/run.safetensors, then SIGKILL
                                       of this very process (no clean exit)
    ckpt_resume.py SPEC DIR resume N   dispatch.load of that file and of
                                       Adam's state, then steps K..N-1

Each step prints "loss STEP VALUE HEX" (HEX: the float32's bytes); full
and resume end with "param NAME HEX" per parameter, the raw bytes of its
final value, so the test compares the runs bit for bit. SPEC: "local" or
a server's tcp:// address.

The model: a 12-32-5 MLP (relu, cross-entropy) on 24 fixed samples, its
parameters and data drawn on the device from fixed seeds, Adam lr 0.01.
"""
import os
import signal
import sys

import numpy as np

import dispatch

NAMES = ("w1", "b1", "w2", "b2")
SHAPES = ((12, 32), (32,), (32, 5), (5,))


def data(dev):
    x = dev.normal((24, 12), 0.0, 1.0, seed=7)
    y = dev.tensor((np.arange(24) * 3 % 5).astype(np.int64))
    return x, y


def fresh(dev):
    return {n: dev.normal(s, 0.0, 0.3, seed=11 + k)
            for k, (n, s) in enumerate(zip(NAMES, SHAPES))}


def train(dev, params, opt, first, last):
    x, y = data(dev)
    w1, b1, w2, b2 = (params[n] for n in NAMES)
    for step in range(first, last):
        with dev.scope():
            h = (x @ w1 + b1).relu()
            loss = dispatch.cross_entropy(h @ w2 + b2, y)
            opt.step(loss.backward())
            v = np.float32(loss.item())
        print(f"loss {step} {float(v):.9g} {v.tobytes().hex()}", flush=True)


def main(spec, folder, mode, n):
    path = os.path.join(folder, "run.safetensors")
    dev = dispatch.device(spec)
    if mode == "resume":
        state = dispatch.load(path, dev)
        params = {k: state[k].track() for k in NAMES}
        opt = dispatch.Adam([params[k] for k in NAMES], lr=0.01)
        dispatch.load(path, dev, optimizer=opt)
        first = int(state["step"].item())
    else:
        params = {k: t.track() for k, t in fresh(dev).items()}
        opt = dispatch.Adam([params[k] for k in NAMES], lr=0.01)
        first = 0
    train(dev, params, opt, first, n)
    if mode == "stop":
        step = dev.tensor(np.array(n, np.int64))
        dispatch.save(path, {**params, "step": step}, optimizer=opt)
        os.kill(os.getpid(), signal.SIGKILL)  # killed: no bye, no atexit
    for k in NAMES:
        print(f"param {k} {params[k].numpy().tobytes().hex()}", flush=True)
    dev.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[3] not in ("full", "stop", "resume"):
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
