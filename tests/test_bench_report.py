"""benchmarks/report.py: a bench's one JSON line (the last on stdout), `--out DIR`, the tables."""

from __future__ import annotations

import argparse
import json

from rlboost.benchmarks import report


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    report.add_out(p)
    return p.parse_args(argv)


def test_without_out_a_bench_writes_nothing_and_ends_with_its_json_line(capsys):
    assert report.out_dir(_args([])) is None
    assert report.finish("x", {"ok": False, "n": 3}, None, ok=False) == 1
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"ok": False, "n": 3}


def test_out_keeps_the_whole_result_and_the_plot_while_the_line_may_be_slimmer(tmp_path, capsys):
    out = report.out_dir(_args(["--out", str(tmp_path / "new")]))
    assert out == tmp_path / "new" and out.is_dir()
    whole = {"policies": {"hybrid": {"throughput": 2.0, "series": [[0, 1]]}}}
    slim = {"policies": {"hybrid": {"throughput": 2.0}}}
    assert report.finish("trace", whole, out, plot=lambda path: path.write_bytes(b"png"), line=slim) == 0
    assert json.loads((out / "trace.json").read_text()) == whole and (out / "trace.png").read_bytes() == b"png"
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == slim


def test_a_bench_that_keeps_files_anyway_gets_a_temp_folder_without_out():
    d = report.out_dir(_args([]), prefix="rlboost-test-report-")
    try:
        assert d is not None and d.is_dir() and d.name.startswith("rlboost-test-report-")
    finally:
        d.rmdir()


def test_a_table_aligns_its_titles_with_their_columns_and_leaves_missing_values_blank(capsys):
    rows = [{"name": "a", "rate": 1234.5, "share": 0.25}, {"name": "bb", "rate": 7.0}]
    report.print_table(rows, [("name", "<4", "name"), ("rate", ">8,.0f", "rate"), ("share", ">+7.0%", "share"),
                              ("twice", ">6", lambda r: 2 * r["rate"])])
    assert capsys.readouterr().out.splitlines() == [
        "name     rate   share  twice",
        "a       1,234    +25% 2469.0",
        "bb          7           14.0"]


def test_every_module_rlboost_bench_lists_takes_the_bench_arguments():
    """`rlboost bench NAME` calls a bench module's top-level `main(argv, settings)`; a helper
    with a `main` of another shape (a host process, a look at data) would be listed and crash."""
    import importlib
    import inspect

    from rlboost import cli

    for name, (package, _) in cli._benchmarks().items():
        main = importlib.import_module(f"{package}.{name}").main
        try:
            inspect.signature(main).bind(["--help"], object())
        except TypeError as e:
            raise AssertionError(f"benchmarks/{name}.py: main cannot be called as main(argv, settings): {e}")
