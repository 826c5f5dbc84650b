#!/usr/bin/python3
"""make bench rows: the training step of bench/mlp.c (784-256-10 MLP,
relu, cross-entropy, batch 128, SGD through one optim step, then reading
the loss) driven from Python through the dispatch package, against the
same step driven from C, on the local device and on the server of
$DISPATCH_BENCH_REMOTE.

The C step runs in `bench/mlp --steps-on-stdin` (the very step() of
bench/mlp.c), a child process that runs a block of steps when asked and
sleeps on its stdin otherwise; the four models (C and Python, local and
remote) take blocks of 10 steps in turn with a pause between, as
bench/mlp.c does with its models, so load from the rest of the machine
falls on all alike, in an order that rotates every round. Rows: the
median over rounds of the Python block's median step over the C block's
(goal at most 1.1x: the binding's overhead at most 10% of the step, the
note says how much it is), with the spread, judged as bench/bench.h
judges (the C step is a limit: Python beating it by more than 5% is REF
SUSPECT). A third row is the binding's own cost per op: OPS calls of
a + b on two 16-element f32 local tensors (each result dropped) from
Python, against the same dispatch_add calls from C in the driver ("op N"),
blocks in turn, the row's value the per-round difference in microseconds
(no goal: a figure to read beside the step rows).
Same data and seeds on all four, so all four must end at the same loss;
a difference is reported in the note. BENCH_QUICK=1: two rounds of one
step, nothing judged.
Prints CSV rows in bench/bench.h's columns on stdout.
"""
import math
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
import dispatch  # noqa: E402

BATCH, NIN, NHID, NOUT, LR = 128, 784, 256, 10, 0.05
QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")
WARMUP, MAX_ROUNDS, MIN_ROUNDS, BUDGET, BLOCK, GAP = \
    (1, 2, 2, 0.0, 1, 0.001) if QUICK else (3, 20, 6, 15.0, 6, 0.1)
GOAL, SUSPECT, MIN_VERDICT_REPS = 1.1, 1.05, 5
OPS, OP_ROUNDS = (100, 2) if QUICK else (5000, 10)


class Model:
    def __init__(self, name, spec):
        self.name, self.times, self.loss, self.err = name, [], math.nan, ""
        self.dev = None
        if not spec:
            self.err = f"{name}: no server (DISPATCH_BENCH_REMOTE unset)"
            return
        try:
            self.dev = dispatch.device(spec)
            i = np.arange(BATCH * NIN, dtype=np.uint64)
            xs = ((i * 2654435761) % (1 << 32) % 1000).astype(np.float32) \
                / np.float32(1000)
            ys = (np.arange(BATCH) * 7) % NOUT
            self.x = self.dev.tensor(xs.reshape(BATCH, NIN))
            self.y = self.dev.tensor(ys.astype(np.int64))
            shapes = [(NIN, NHID), (NHID,), (NHID, NOUT), (NOUT,)]
            self.p = [self.dev.normal(s, 0.0, 0.01 if k % 2 else 0.05,
                                      seed=100 + k).track()
                      for k, s in enumerate(shapes)]
            self.opt = dispatch.SGD(self.p, lr=LR)
            self.dev.sync()
        except dispatch.DispatchError as e:
            self.err, self.dev = f"{name}: {e}", None

    def step(self, record):
        t0 = time.perf_counter()
        w1, b1, w2, b2 = self.p
        with self.dev.scope():
            h = (self.x @ w1 + b1).relu()
            loss = dispatch.cross_entropy(h @ w2 + b2, self.y)
            self.opt.step(loss.backward())
            self.loss = loss.item()
        t = time.perf_counter() - t0
        if not math.isfinite(self.loss):
            raise ValueError(f"loss is {self.loss}")
        if record:
            self.times.append(t)


def num(v):
    """A figure as bench/bench.h's bench_num_ prints it."""
    if v is None or not math.isfinite(v):
        return "n/a"
    if abs(v) >= 100 or v == 0:
        return f"{v:.0f}"
    return f"{v:.3g}"


def quantile(v, q):
    """bench.h's bench_quantile: nearest rank, a value really measured."""
    if not v:
        return None
    v = sorted(v)
    i = min(max(math.ceil(q * len(v)) - 1, 0), len(v) - 1)
    return v[i]


def verdict(ratios):
    """bench.h's bench_verdict for a time (lower is better) whose
    reference is a limit, goal ratio <= GOAL."""
    if QUICK:
        return "quick"
    if not ratios:
        return "n/a"
    if quantile(ratios, 0.5) < 1 / SUSPECT:
        return "REF SUSPECT"
    if len(ratios) < MIN_VERDICT_REPS:
        return "unclear"
    q1, q3 = quantile(ratios, 0.25), quantile(ratios, 0.75)
    return "met" if q3 <= GOAL else "missed" if q1 > GOAL else "unclear"


def unsettled(ratios):
    """bench.h's bench_unsettled for these rows."""
    v = verdict(ratios)
    if v == "REF SUSPECT":
        return not quantile(ratios, 0.75) < 1 / SUSPECT
    return v == "unclear"


def row(metric, ours, ref, note, unit="ms", ref_name="same step driven "
        "from C", goal=f"ratio<={GOAL}", judged=True):
    """ours, ref: per-round figures, paired by round."""
    ratios = [o / r for o, r in zip(ours, ref) if r]
    fields = ["python", metric, num(quantile(ours, 0.5)),
              num(quantile(ours, 0)), num(quantile(ours, 1)), unit,
              ref_name, num(quantile(ref, 0.5)),
              num(quantile(ratios, 0.5)), num(quantile(ratios, 0.25)),
              num(quantile(ratios, 0.75)), str(len(ratios)),
              goal, verdict(ratios) if judged else "", note]
    print(",".join(f.replace(",", ";").replace("\n", ";") for f in fields),
          flush=True)


class CModel:
    """One model inside the C driver process (0 local, 1 remote)."""

    def __init__(self, name, proc, index):
        self.name, self.proc, self.index = name, proc, index
        self.times, self.loss, self.err = [], math.nan, ""

    def ask(self, request):
        """The driver's reply to one request line, less its "ok"."""
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().split()
        if not reply or reply[0] != "ok":
            raise ValueError("C driver: " + (" ".join(reply[1:]) or "no reply"))
        return reply

    def op_block(self, n):
        """Seconds per dispatch_add call from C, n calls."""
        return float(self.ask(f"op {n}")[1])

    def step_block(self, n, record):
        reply = self.ask(f"{self.index} {n}")
        self.loss = float(reply[1])
        if record:
            self.times.extend(float(t) for t in reply[2:])


def main():
    build = os.environ.get("BUILD", "build")
    driver = os.environ.get("DISPATCH_BENCH_MLP_BIN") or \
        str(ROOT / build / "bench" / "mlp")
    remote = os.environ.get("DISPATCH_BENCH_REMOTE")
    proc = subprocess.Popen([driver, "--steps-on-stdin"], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    # order of the turns: C local, Python local, C remote, Python remote
    models = [CModel("C local", proc, 0), Model("Python local", "local"),
              CModel("C remote", proc, 1), Model("Python remote", remote)]
    live = [isinstance(m, CModel) or m.dev is not None for m in models]
    if not remote:
        models[2].err = "no server (DISPATCH_BENCH_REMOTE unset)"
        live[2] = False

    def block(i, n, record):
        m = models[i]
        try:
            if isinstance(m, CModel):
                m.step_block(n, record)
            else:
                for _ in range(n):
                    m.step(record)
        except (dispatch.DispatchError, ValueError) as e:
            m.err = f"{m.name}: {e}"
            live[i] = False

    for i in range(4):
        if live[i]:
            block(i, WARMUP, False)
    # per-round medians of each model's block (ms), paired by round
    meds = [[] for _ in models]

    def ratios(py, c):
        return [a / b for a, b in zip(meds[py], meds[c]) if b]

    start = time.perf_counter()
    for r in range(MAX_ROUNDS):
        if r >= MIN_ROUNDS and (time.perf_counter() - start > BUDGET or not any(
                unsettled(ratios(py, c)) for py, c in ((3, 2), (1, 0)))):
            break
        for k in range(4):
            i = (k + r) % 4
            time.sleep(GAP)
            if live[i]:
                first = len(models[i].times)
                block(i, BLOCK, True)
                got = models[i].times[first:]
                if live[i] and got:
                    meds[i].append(quantile(got, 0.5) * 1e3)
    op_c, op_py, op_err = [], [], ""
    try:
        op_c, op_py = op_overhead(models[0])
    except (dispatch.DispatchError, ValueError) as e:
        op_err = f"per-op: {e}"
    proc.stdin.close()
    proc.wait()
    for m in models:
        print(f"python mlp: {m.name}: " + (m.err or f"{len(m.times) + WARMUP}"
              f" steps, final loss {m.loss:.6f}"), file=sys.stderr)
    # same data, seeds, update and number of steps: the same loss, up to
    # float reassociation (local and remote, C and Python alike)
    agree = ""
    ok = [m for i, m in enumerate(models) if live[i]]
    if len({len(m.times) for m in ok}) == 1 and ok and any(
            abs(m.loss - ok[0].loss) > 1e-3 * (1 + abs(ok[0].loss))
            for m in ok):
        agree = "losses differ: " + "; ".join(
            f"{m.name} {m.loss:.6f}" for m in ok)
    for py, c, what in ((3, 2, "remote"), (1, 0, "local")):
        ours, ref = (meds[py] if live[py] else []), \
            (meds[c] if live[c] else [])
        share = quantile([o / r - 1 for o, r in zip(ours, ref) if r], 0.5)
        note = "; ".join(x for x in (
            models[c].err, models[py].err, agree,
            f"Python overhead {100 * share:.1f}% of the C step (goal <= "
            f"{100 * (GOAL - 1):.0f}%)" if share is not None else "") if x)
        row(f"train step 784-256-10 b128 {what}; driven from Python",
            ours, ref, note)
    over = [(p - c) * 1e6 for p, c in zip(op_py, op_c)]
    py_us = quantile([p * 1e6 for p in op_py], 0.5)
    row("binding overhead per op (a + b; 16xf32 local): Python call minus "
        "C call", over, [c * 1e6 for c in op_c],
        op_err or f"the Python call {num(py_us)} us; {OPS} calls a block",
        unit="us", ref_name="the C call (dispatch_add)", goal="",
        judged=False)
    return 0


def op_overhead(cmodel):
    """Per-round seconds per call: (C, Python), OP_ROUNDS rounds of OPS
    calls each, C and Python in turns that swap every round."""
    dev = dispatch.device("local")
    a, b = dev.ones((16,)), dev.ones((16,))
    c_times, py_times = [], []

    def py_block(n):
        t0 = time.perf_counter()
        for _ in range(n):
            c = a + b  # noqa: F841 (the previous result is dropped here)
        return (time.perf_counter() - t0) / n

    py_block(OPS)  # warm-up of both
    cmodel.op_block(OPS)
    for r in range(OP_ROUNDS):
        time.sleep(GAP)
        if r % 2:
            py_times.append(py_block(OPS))
            c_times.append(cmodel.op_block(OPS))
        else:
            c_times.append(cmodel.op_block(OPS))
            py_times.append(py_block(OPS))
    dev.close()
    return c_times, py_times


if __name__ == "__main__":
    sys.exit(main())
