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
