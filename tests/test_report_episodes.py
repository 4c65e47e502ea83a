"""The live table of a run on episodes shows the environment's side (issue 40): each step's
tool calls and environment errors per episode, as two narrow columns; a single-turn run's
table is as it was."""

from __future__ import annotations

import io

from rich.console import Console

from rlboost.trainer.report import COLUMNS, RunReport

SINGLE = {"step": 0, "reward": 0.5, "eval_acc": None, "tokens_per_s": 812.3, "live_workers": 2, "step_s": 4.1}
# an episode run's row, as trainer/episodes/scoring.py's EpisodeStats.row writes its fields
EPISODE = {**SINGLE, "episodes": 8, "tool_calls_mean": 1.375, "turns_mean": 2.5, "episode_success": 0.5,
           "episode_ends": {"done": 6, "env_error": 2}, "tool_errors_mean": 0.125, "tool_timeouts_mean": 0.0,
           "env_errors_mean": 0.25, "env/lookups": 1.5}


def _report(tmp_path, *rows: dict) -> RunReport:
    report = RunReport(tmp_path, len(rows))
    for r in rows:
        report.step(r)
    report.metrics.close()
    return report


def _rendered(report: RunReport) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(report._table())
    return out.getvalue().splitlines()


def test_an_episode_runs_lines_show_its_tool_calls_and_environment_errors(tmp_path, capsys):
    _report(tmp_path, EPISODE)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "calls=1.38" in line and "env_err=0.25" in line, line
    # beside the reward, before the throughput columns
    assert line.index("eval=") < line.index("calls=") < line.index("env_err=") < line.index("tok/s="), line


def test_a_single_turn_runs_lines_and_table_are_as_they_were(tmp_path, capsys):
    report = _report(tmp_path, SINGLE)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "calls=" not in line and "env_err" not in line
    assert line == "  ".join(f"{label}={SINGLE.get(key)}" for key, label in COLUMNS)
    header = next(x for x in _rendered(report) if "reward" in x)
    assert "calls" not in header and "env_err" not in header


def test_the_episode_table_gains_two_narrow_columns(tmp_path, capsys):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    single = _report(tmp_path / "a", SINGLE)
    episodes = _report(tmp_path / "b", EPISODE, {**EPISODE, "step": 1, "tool_calls_mean": 2.0, "env_errors_mean": 0.0})
    rows = _rendered(episodes)
    header = next(x for x in rows if "reward" in x)
    assert "calls" in header and "env_err" in header
    assert any("1.38" in x and "0.25" in x for x in rows) and any("2.00" in x and "0.00" in x for x in rows), rows
    # narrow: two columns of a few characters each, not the row's every episode field
    width = max(map(len, rows)) - max(map(len, _rendered(single)))
    assert 0 < width <= 20, width
