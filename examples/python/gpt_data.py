"""gpt_data.py: the data, batches, initialisation, schedule and baselines of
the character-level GPT recipe, shared by gpt_torch.py (the PyTorch
reference) and train_gpt.py (the dispatch twin). It is a line-by-line copy
of examples/lib/gpt_data.c, whose header examples/lib/gpt_data.h states the
rules; change both together.

Corpus: the regular files (not symlinks, no .dat/.u8 extension) of
/usr/share/games/fortunes (Debian fortunes + fortunes-min; $GPT_CORPUS_DIR
overrides) sorted by name, concatenated. Vocabulary: the sorted set of the
bytes present; token = rank of the byte. The last n // 10 bytes are the
validation split, the rest the training split.
"""
import math
import os

import numpy as np

CORPUS_DIR = "/usr/share/games/fortunes"
CTX = 64            # context length T
BATCH = 32          # windows per training step
D_MODEL = 128
N_HEAD = 4
N_LAYER = 2
D_MLP = 512
BATCH_SEED = 1337   # splitmix64 stream of the training windows
INIT_SEED = 42      # splitmix64 stream of the normal initialisation
SAMPLE_SEED = 7     # splitmix64 stream of the generated sample
INIT_STD = 0.02
VAL_WINDOWS = 512   # fixed validation windows, evaluated BATCH at a time
LR_MAX, LR_MIN, WARMUP, TOTAL = 3e-3, 3e-4, 100, 2000
BETAS, ADAM_EPS, WEIGHT_DECAY, CLIP = (0.9, 0.95), 1e-8, 0.1, 1.0

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def corpus_files(folder=None):
    folder = folder or os.environ.get("GPT_CORPUS_DIR") or CORPUS_DIR
    names = sorted(os.listdir(folder), key=lambda s: s.encode())
    out = []
    for n in names:
        p = os.path.join(folder, n)
        if n.endswith(".dat") or n.endswith(".u8") or os.path.islink(p):
            continue
        if os.path.isfile(p):
            out.append(p)
    if not out:
        raise FileNotFoundError(f"{folder}: no corpus files "
                                "(install fortunes fortunes-min)")
    return out


def load_corpus(folder=None):
    """(tokens uint8 array, vocab bytes, n_train)."""
    raw = b"".join(open(p, "rb").read() for p in corpus_files(folder))
    vocab = bytes(sorted(set(raw)))
    lut = np.zeros(256, np.uint8)
    for i, b in enumerate(vocab):
        lut[b] = i
    toks = lut[np.frombuffer(raw, np.uint8)]
    n_train = len(toks) - len(toks) // 10
    return toks, vocab, n_train


def splitmix64(state):
    """(new state, output): the reference splitmix64 step."""
    state = (state + GOLDEN) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


class Rng:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state, z = splitmix64(self.state)
        return z

    def uniform(self):
        """[0, 1) with 53 bits."""
        return (self.next() >> 11) * (1.0 / 9007199254740992.0)


def batch_offsets(rng, n_train):
    """BATCH window starts, each next() % (n_train - CTX): the window
    train[o : o + CTX] predicts train[o + 1 : o + CTX + 1]."""
    return [rng.next() % (n_train - CTX) for _ in range(BATCH)]


def windows(toks, base, offsets):
    """(x, y) int64 [len(offsets), CTX] from toks[base + o ...]."""
    idx = np.asarray(offsets, np.int64)[:, None] + base + np.arange(CTX)
    return toks[idx].astype(np.int64), toks[idx + 1].astype(np.int64)


def val_offsets(n_total, n_train):
    """VAL_WINDOWS starts spread over the validation split, relative to
    n_train: i * ((n_val - CTX - 1) // (VAL_WINDOWS - 1))."""
    step = (n_total - n_train - CTX - 1) // (VAL_WINDOWS - 1)
    return [i * step for i in range(VAL_WINDOWS)]


def normal_block(rng, n):
    """n normals * INIT_STD as float32: for each value two draws u1, u2,
    u1 = ((a >> 11) + 1) / 2^53 in (0, 1], u2 = (b >> 11) / 2^53,
    z = sqrt(-2 ln u1) * cos(2 pi u2) (Box-Muller, the cosine half only).
    Vectorised: splitmix64's i-th output depends only on seed + i * GOLDEN."""
    k = np.arange(1, 2 * n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        s = np.uint64(rng.state) + k * np.uint64(GOLDEN)
        z = s
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    rng.state = (rng.state + 2 * n * GOLDEN) & MASK64
    a, b = z[0::2], z[1::2]
    u1 = ((a >> np.uint64(11)) + np.uint64(1)).astype(np.float64) \
        / 9007199254740992.0
    u2 = (b >> np.uint64(11)).astype(np.float64) / 9007199254740992.0
    g = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)
    return (INIT_STD * g).astype(np.float32)


def param_specs(vocab_size):
    """[(name, shape, init)] in the fixed order; init is 'normal' (draws
    from the INIT_SEED stream in this order), 'zeros' or 'ones'. Matrices
    are [in, out] (y = x @ W + b). decay = 2-D (matrices, embeddings)."""
    D, V = D_MODEL, vocab_size
    s = [("wte", (V, D), "normal"), ("wpe", (CTX, D), "normal")]
    for layer in range(N_LAYER):
        p = f"h{layer}."
        s += [(p + "ln1.w", (D,), "ones"), (p + "ln1.b", (D,), "zeros")]
        for m in ("q", "k", "v", "o"):
            s += [(p + "w" + m, (D, D), "normal"),
                  (p + "b" + m, (D,), "zeros")]
        s += [(p + "ln2.w", (D,), "ones"), (p + "ln2.b", (D,), "zeros"),
              (p + "w1", (D, D_MLP), "normal"), (p + "b1", (D_MLP,), "zeros"),
              (p + "w2", (D_MLP, D), "normal"), (p + "b2", (D,), "zeros")]
    s += [("lnf.w", (D,), "ones"), ("lnf.b", (D,), "zeros"),
          ("wout", (D, V), "normal"), ("bout", (V,), "zeros")]
    return s


def init_params(vocab_size):
    """{name: float32 array} from INIT_SEED."""
    rng = Rng(INIT_SEED)
    out = {}
    for name, shape, kind in param_specs(vocab_size):
        n = int(np.prod(shape))
        if kind == "normal":
            out[name] = normal_block(rng, n).reshape(shape)
        elif kind == "ones":
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = np.zeros(shape, np.float32)
    return out


def lr_cosine(step, warmup=WARMUP, total=TOTAL, lr_max=LR_MAX,
              lr_min=LR_MIN):
    """dispatch_lr_cosine's formula."""
    if step < warmup:
        return lr_max * (step + 1) / warmup
    if step >= total:
        return lr_min
    t = (step - warmup) / (total - warmup)
    return lr_min + 0.5 * (1.0 + math.cos(math.pi * t)) * (lr_max - lr_min)


def baselines(toks, n_train, vocab_size):
    """(bigram, unigram) add-one losses in nats/char, counted on the
    training split and evaluated on the targets of the validation windows
    (the same predictions the model's validation loss averages)."""
    V = vocab_size
    tr = toks[:n_train].astype(np.int64)
    uni = np.bincount(tr, minlength=V).astype(np.float64)
    big = np.bincount(tr[:-1] * V + tr[1:], minlength=V * V)
    big = big.reshape(V, V).astype(np.float64)
    offs = val_offsets(len(toks), n_train)
    x, y = windows(toks, n_train, offs)
    x, y = x.ravel(), y.ravel()
    p_big = (big[x, y] + 1.0) / (big[x].sum(axis=1) + V)
    p_uni = (uni[y] + 1.0) / (n_train + V)
    return float(-np.log(p_big).mean()), float(-np.log(p_uni).mean())


def sample_pick(rng, probs):
    """Inverse-CDF pick with one uniform() draw over float64 probs; the
    last index when rounding leaves u above the total."""
    u = rng.uniform()
    c = 0.0
    for i, p in enumerate(probs):
        c += float(p)
        if u < c:
            return i
    return len(probs) - 1
