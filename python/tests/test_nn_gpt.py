"""examples/python/train_gpt.py, written with dispatch.nn, prints the same
losses as the C example build/examples/train_gpt for the same seed: both
run LOCAL for a few steps and their loss lines (training and validation)
must be identical, digit for digit."""
import os
import re
import subprocess
import sys

import pytest

import dispatch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples" / "python"))
import gpt_data  # noqa: E402

C_BIN = ROOT / "build" / "examples" / "train_gpt"


@pytest.mark.skipif(not os.path.isdir(gpt_data.CORPUS_DIR),
                    reason="no fortunes corpus (Debian fortunes, fortunes-min)")
@pytest.mark.skipif(not C_BIN.exists(), reason="build/examples/train_gpt "
                    "not built")
@pytest.mark.parametrize("precision", ["f32", "bf16", "f16"])
def test_python_gpt_prints_the_c_losses(precision):
    if precision != "f32" and not hasattr(dispatch, "bfloat16"):
        pytest.skip("this package has no half dtypes to read a bf16 or f16 "
                    "tensor's dtype with (issue 24's Python half support)")
    # bf16 / f16: dispatch.autocast and GradScaler against the C example's
    # dispatch_autocast and loss-scaled optimizer (issue 24)
    args = ["--device", "local", "--steps", "3", "--log-every", "1",
            "--sample", "0", "--precision", precision]
    runs = [subprocess.run(cmd + args, capture_output=True, text=True,
                           timeout=300)
            for cmd in ([str(C_BIN)],
                        [sys.executable, str(ROOT / "examples" / "python" /
                                             "train_gpt.py")])]
    lines = []
    for r in runs:
        assert r.returncode == 0, r.stderr
        lines.append(re.findall(r"^step .*loss.*$", r.stdout, re.M))
    assert len(lines[0]) == 4, runs[0].stdout  # 3 steps and validation
    assert lines[0] == lines[1]
