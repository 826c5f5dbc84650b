"""The READMEs' Python blocks run as written against the session's server:
python/README.md's first program, then its error example (which uses the
program's names), and the top-level README's block; python/README.md's
group example (its fence says "python group") against a 2-rank MPI job."""
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


def test_readme_group_example(mpi_group):
    text = (ROOT / "python" / "README.md").read_text()
    blocks = re.findall(r"```python group\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    env = dict(PACKAGE_ENV, DISPATCH_GROUP=",".join(mpi_group.specs))
    r = subprocess.run([sys.executable, "-c", blocks[0]], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "all_reduce: [3. 3. 3.] [3. 3. 3.]", r.stdout
    losses = [float(re.fullmatch(r"step \d: loss (\d\.\d{4})", l).group(1))
              for l in lines[1:4]]
    assert losses[0] > losses[1] > losses[2], losses
    assert lines[4:] == ["members identical: True"], r.stdout
