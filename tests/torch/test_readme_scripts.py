"""The README's mixed-precision scripts, run as written: each ```python block that starts with ``# amp.py`` or
``# fsdp2.py`` runs in two rank processes with torchrun's environment, against an aggregator of its own, whose
finished jobs then show the completions that the scripts' gradients made."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.cluster import TOKENS, aggregator, repo_env

from intml.testbed.procs import free_port

pytestmark = [pytest.mark.process, pytest.mark.torch]

README = Path(__file__).resolve().parents[2] / "README.md"
LINE = re.compile(r"rank (\d) step (\d+): loss ([\d.]+|nan|inf)")


def script(name: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    [found] = [b for b in blocks if b.startswith(f"# {name}\n")]
    return found


@pytest.mark.parametrize("name", ["amp.py", "fsdp2.py"])
def test_readme_script_runs_as_written(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(script(name))
    with aggregator(idle_timeout=20) as agg:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE,
                                  env={**repo_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "INTML_AGGREGATOR": agg.address, "INTML_TOKEN": TOKENS[0],
                                       "OMP_NUM_THREADS": "1"})
                 for r in range(2)]
        outputs = [p.communicate(timeout=240) for p in procs]
        for p, (out, err) in zip(procs, outputs):
            assert p.returncode == 0, err[-4000:]
        finished = agg.stats()[0]["finished"]
    losses = [[float(m[2]) for m in LINE.findall(out)] for out, _ in outputs]
    assert losses[0] == losses[1], "the ranks' models diverged"  # same data, bit-identical sums
    assert len(losses[0]) >= 10 and losses[0][-1] < losses[0][0], losses[0]
    assert sum(job["counters"].get("completions", 0) for job in finished) > 0, finished
