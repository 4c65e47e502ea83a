"""One error root: every error rlboost raises on purpose derives from `RlboostError`, and the
CLI turns one into a single line with exit code 2 (the traceback only with --debug)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from rlboost import cli
from rlboost.errors import RlboostError

PACKAGES = ("rlboost", "rlboost.workers", "rlboost.trainer", "rlboost.benchmarks")  # the installed names


def project_errors() -> dict[str, type]:
    found = {}
    for package in PACKAGES:
        pkg = importlib.import_module(package)
        for m in pkgutil.walk_packages(pkg.__path__, f"{package}."):
            try:
                module = importlib.import_module(m.name)
            except ImportError as e:  # an optional engine (vllm) that is not installed here
                if "vllm" in str(e):
                    continue
                raise
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == m.name:
                    found[f"{m.name}.{name}"] = obj
    return found


def test_every_project_error_derives_from_the_root():
    errors = project_errors()
    assert len(errors) > 20  # the walk found them (wire, checkpoint, weights, data, rewards, ...)
    # a private BaseException is a control-flow signal through user code, not an error (verifiers_env's
    # _Suspend: a user's `except Exception` must not swallow it)
    signals = {n for n, e in errors.items() if n.rpartition(".")[2].startswith("_") and not issubclass(e, Exception)}
    assert sorted(n for n, e in errors.items() if not issubclass(e, RlboostError) and n not in signals) == []


@pytest.mark.parametrize("debug", [False, True])
def test_a_refusal_is_one_line_and_exit_2_the_traceback_only_with_debug(tmp_path, capsys, debug):
    missing = tmp_path / "missing.toml"
    code = cli.main([*(["--debug"] if debug else []), "--config", str(missing), "status"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("rlboost: error: ") and str(missing) in err
    assert ("Traceback" in err) is debug
