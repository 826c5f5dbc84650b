"""The READMEs' Python blocks run as written against the session's server:
python/README.md's first program, then its error example (which uses the
program's names), and the top-level README's block."""
import re
import subprocess
import sys

from conftest import PACKAGE_ENV, ROOT


def test_readme_program(server):
    text = (ROOT / "python" / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    env = dict(PACKAGE_ENV, DISPATCH_DEVICE=server.spec)
    r = subprocess.run([sys.executable, "-c", "".join(blocks)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "dloss/dw = [4. 4. 6. 6.]",
        "-3 DISPATCH_ESHAPE add: shapes [2, 2] and [4, 5] do not broadcast"]


def test_top_readme_python_block(server):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    env = dict(PACKAGE_ENV, DISPATCH_DEVICE=server.spec)
    r = subprocess.run([sys.executable, "-c", blocks[0]], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[[4. 4.]\n [6. 6.]]\n"
