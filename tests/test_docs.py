"""The generated reference pages (docs/gen_reference.py) list every flag of every parser and every
settings key, so `mkdocs build --strict` in `make test` documents the code as it is."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import msgspec
import pytest

from rlboost.config import Settings

ROOT = Path(__file__).parents[1]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _section(markdown: str, title: str) -> str:
    return markdown.split(f"## `{title}`\n", 1)[1].split("\n## `", 1)[0]


def _options(help_text: str) -> set[str]:
    """Every option string in argparse's own help (its option lines: `  -n N, --name N  help`)."""
    found = set()
    for line in help_text.splitlines():
        if re.match(r"\s{2}-", line):
            head = line.strip().split("  ")[0]  # the option strings, before the help column
            found |= set(re.findall(r"(?:^|, )(--?[A-Za-z][\w.-]*)", head))
    return found


@pytest.mark.slow
def test_cli_reference_lists_every_flag_of_every_parser():
    gen = _gen()
    parsers = gen.command_parsers()
    markdown = gen.cli_markdown()
    from rlboost import cli

    assert {f"rlboost {name}" for name in cli.COMMANDS} <= set(parsers)  # every delegated command's own parser
    assert {"rlboost up", "rlboost bench trace", "rlboost bench faults"} <= set(parsers)
    for title, parser in parsers.items():
        section = _section(markdown, title)
        options = _options(parser.format_help())
        assert options, title
        missing = [o for o in options if f"`{o}`" not in section]
        assert not missing, f"{title}: {missing}"
    run, worker = _section(markdown, "rlboost run"), _section(markdown, "rlboost worker")
    assert "| `--max-staleness` |" in run and "setting `rollout.max_staleness`" in run
    assert "| `--resume` |" in run and "| `--reward` |" in run
    assert "| `--tensor-parallel-size` |" in worker and "| `--drain-grace` |" in worker


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in msgspec.structs.fields(cls):
        key = f"{prefix}{f.name}"
        if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
            out += _keys(f.type, key + ".")
        else:
            out.append(key)
    return out


def test_settings_reference_lists_every_key_with_its_comment():
    markdown = _gen().settings_markdown()
    keys = _keys(Settings)
    assert {"trainer.lr", "worker.ack_wait_s", "services.auth.tls_ca", "log_level"} <= set(keys)
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w.]+)` \|.*$", markdown, re.M)}
    assert [k for k in keys if k not in rows] == []
    assert "## `[services.auth]`" in markdown and "`RLBOOST_SERVICES__AUTH__<KEY>`" in markdown
    assert "small pulls interleave between workers" in rows["worker.fetch_batch"]  # a wrapped comment
    assert "dtype of the published weights" in rows["trainer.publish_dtype"]  # a comment block above
    assert "published" not in rows["trainer.activation_checkpointing"]
    assert '`"spot"`' in rows["worker.pool"] and "`false`" in rows["services.redis_sentinel"]


def test_an_unknown_marker_fails_the_build():
    gen = _gen()
    with pytest.raises(ValueError, match="unknown generated section 'clii'"):
        gen.expand("<!-- rlboost:generate clii -->")
    assert "rlboost_worker_tokens_generated_total" in gen.expand("<!-- rlboost:generate metrics -->")


@pytest.mark.slow
def test_a_flag_the_docs_name_that_no_parser_has_fails_the_build():
    gen = _gen()
    readme = (ROOT / "README.md").read_text()
    pages = [readme] + [p.read_text() for p in (ROOT / "docs").rglob("*.md")]
    assert [gen.unknown_flags(text) for text in pages] == [[]] * len(pages)
    assert "--max-prompt-tokens 256" in readme  # the first run's flags are checked, continuation lines too
    renamed = readme.replace("--max-prompt-tokens 256", "--max-prompt-len 256")
    assert [b.split("  ")[0] for b in gen.unknown_flags(renamed)] == ["rlboost run --max-prompt-len"]
    text = ("`rlboost bench trace --max-instances 0 --hostz 2`, `rlboost run --trainer.lrr 1e-5 run.stepz=3`, "
            "`rlboost/wire.py --nope`, `rlboost COMMAND --whatever`")
    assert [b.split("  ")[0] for b in gen.unknown_flags(text)] == [
        "rlboost bench trace --hostz", "rlboost run --trainer.lrr", "rlboost run run.stepz"]


def test_reading_a_parser_runs_nothing_past_it():
    gen = _gen()

    def main_without_a_parser():
        import asyncio

        asyncio.run(asyncio.sleep(0))  # a bench that would start working before it parses

    with pytest.raises(RuntimeError, match="without parsing"):
        gen._capture(main_without_a_parser)
    import argparse
    import asyncio

    assert asyncio.run(asyncio.sleep(0, "restored")) == "restored"  # nothing stays patched
    assert argparse.ArgumentParser().parse_args([]) == argparse.Namespace()
