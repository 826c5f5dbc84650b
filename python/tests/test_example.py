"""examples/python/train_mlp.py trains through the session's server: a
short run on the first 2048 images must learn (chance is 10%)."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

DATA = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not os.path.exists(
    os.path.join(DATA, "t10k-images-idx3-ubyte.gz")),
    reason="no Fashion-MNIST (Debian package dataset-fashion-mnist)")
def test_train_mlp_example(server):
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "python" / "train_mlp.py"),
         "--device", server.spec, "--limit", "2048", "--log-every", "8"],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    losses = [float(x) for x in re.findall(r"step +\d+/16  loss ([\d.]+)",
                                           r.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], r.stdout
    m = re.search(r"epoch 1/1  mean loss ([\d.]+)  test accuracy ([\d.]+)%",
                  r.stdout)
    assert m, r.stdout
    assert float(m.group(2)) > 50.0, r.stdout


# examples/python/train_gpt.py (issue 23): the recipe's Python copy and a
# short run of the GPT through the session's server
sys.path.insert(0, str(ROOT / "examples" / "python"))
import gpt_data  # noqa: E402


def test_gpt_recipe_streams_match_the_c_copy():
    # the same figures tests/test_examples.c checks in examples/lib/gpt_data.c
    r = gpt_data.Rng(gpt_data.INIT_SEED)
    w = gpt_data.normal_block(r, 4).tolist()
    assert w == [0.008294395171105862, -0.017837723717093468,
                 0.03459186106920242, 0.01091240905225277]
    r = gpt_data.Rng(gpt_data.BATCH_SEED)
    assert (r.next(), r.next()) == (0xb6a8a9b313caa00b, 0xcb7f284b67d605c9)
    assert gpt_data.Rng(gpt_data.SAMPLE_SEED).uniform() == 0.3898297483912715
    assert [gpt_data.lr_cosine(s) for s in (0, 99, 1050, 2000)] == \
        [3e-05, 0.003, 0.00165, 0.0003]
    # normal_block's vectorised stream continues where Rng.next would
    r = gpt_data.Rng(5)
    gpt_data.normal_block(r, 3)
    q = gpt_data.Rng(5)
    for _ in range(6):
        q.next()
    assert r.state == q.state


@pytest.mark.skipif(not os.path.isdir(gpt_data.CORPUS_DIR),
                    reason="no fortunes corpus (Debian fortunes, fortunes-min)")
def test_train_gpt_example():
    # a server of its own: a step holds about 70 MB of activations, more
    # than the suite's server allows a session
    from conftest import Server
    server = Server(["--max-session-bytes", str(512 << 20),
                     "--max-memory", str(1 << 30)])
    try:
        r = subprocess.run(
            [sys.executable,
             str(ROOT / "examples" / "python" / "train_gpt.py"),
             "--device", server.spec, "--steps", "2", "--log-every", "1",
             "--sample", "5"],
            capture_output=True, text=True, timeout=300)
    finally:
        assert server.stop() == 0, server.stderr()
    assert r.returncode == 0, r.stderr
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", r.stdout)]
    assert len(losses) == 3, r.stdout  # 2 steps and the validation
    assert all(0 < v < 10 for v in losses), r.stdout
    assert "bigram " in r.stdout and "sample:" in r.stdout, r.stdout
