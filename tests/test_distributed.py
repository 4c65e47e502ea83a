"""FSDP2 over 2 ranks (gloo, CPU, under torchrun) trains exactly what one process trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlboost.trainer.model import init_model_dir
from rlboost.trainer.tasks import get_task

SCRIPT = str(Path(__file__).with_name("ranks_train.py"))


@pytest.mark.slow
@pytest.mark.parametrize("off_policy", ["", "tis"])  # "": the default loss; tis: stale tokens, weighted
def test_two_fsdp_ranks_equal_one_process_after_three_steps(tmp_path, off_policy):
    model = init_model_dir(tmp_path / "model", get_task("addition"), seed=3, hidden=64, layers=2, heads=2, mlp=128)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    mode = [off_policy] if off_policy else []
    subprocess.run([sys.executable, SCRIPT, str(model), str(one), *mode], check=True, env=env, timeout=120)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        SCRIPT, str(model), str(two), *mode], env=env, timeout=180, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = load_file(one), load_file(two)
    start = load_file(model / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= 1e-5, k
    assert any((a[k] - start[k]).abs().max().item() > 1e-4 for k in a)  # three steps did move the weights
    if off_policy:  # the ranks' statistics are reduced to what one process sees
        s1, s2 = (json.loads(Path(f"{x}.json").read_text()) for x in (one, two))
        assert s1["off_policy"] == s2["off_policy"] == off_policy
        assert s1["staleness_max"] == s2["staleness_max"] == 2  # prompts 2 mod 3: two versions back
        assert s1["staleness_mean"] == pytest.approx(s2["staleness_mean"]) and 0 < s1["staleness_mean"] < 2
        for k in ("is_ratio_mean", "is_ratio_max", "is_capped"):
            assert s1[k] == pytest.approx(s2[k], rel=1e-5), k
        assert s1["is_capped"] > 0 and s1["is_ratio_max"] > 1.5  # the synthetic mu are far from the model's
