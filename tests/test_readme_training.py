"""The CPU commands of the docs page "Training at scale" (docs/guides/training.md) run as written and do
what it says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlboost.trainer.model import init_model_dir
from rlboost.trainer.tasks import get_task

PAGE = Path(__file__).parents[1] / "docs" / "guides" / "training.md"


def _commands() -> list[str]:
    block = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.S)[-1]
    joined = re.sub(r"\\\n\s*", "", block)  # line continuations
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


@pytest.mark.slow
def test_training_at_scale_commands(services, tmp_path):
    nats_url, redis_url = services
    data = tmp_path / "data"
    model = init_model_dir(data / "model", get_task("addition"), seed=5)  # what `ensure_model` finds
    meta = model / "rlboost.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "trained": True}))
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "RLBOOST_DATA_DIR": str(data),
           "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    outs = []
    commands = _commands()
    assert len(commands) == 4
    for cmd in commands:
        p = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{cmd}\n{p.stderr[-3000:]}"
        outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, resumed, fsdp, memory = outs
    assert first["steps"] == 2 and first["precision"] == "fp32"
    assert resumed["run_id"] == first["run_id"] and resumed["resumed_from_step"] == 2 and resumed["steps"] == 3
    assert list((tmp_path / "runs" / "scale" / "tensorboard").glob("events.out.tfevents.*"))
    rows = [json.loads(x) for x in (tmp_path / "runs" / "scale" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["lr"] == pytest.approx(5e-5 / 2)  # warm-up
    assert fsdp["ranks"] == 2 and fsdp["steps"] == 1
    assert list((tmp_path / "runs" / "fsdp" / "checkpoints" / "step-000000" / "state").glob("*.distcp"))
    assert memory["new_peak_bytes"] < memory["old_peak_bytes"]
