"""Settings: defaults < TOML file < environment; bad values are refused with the key named."""

from __future__ import annotations

import pytest

from rlboost.config import ConfigError, load_settings


def test_file_then_environment_override(tmp_path):
    f = tmp_path / "rb.toml"
    f.write_text('[worker]\nslots = 8\npool = "a"\n[services]\nnats_url = "nats://h:1"\n')
    s = load_settings(f, environ={"RLBOOST_WORKER__SLOTS": "64", "RLBOOST_REDIS_URL": "redis://r:2/0"})
    assert s.worker.slots == 64 and s.worker.pool == "a"
    assert s.services.nats_url == "nats://h:1" and s.services.redis_url == "redis://r:2/0"


def test_defaults_without_file(tmp_path):
    s = load_settings(None, environ={"RLBOOST_DATA_DIR": str(tmp_path)})
    assert s.services.data_dir == str(tmp_path) and s.services.bind == "127.0.0.1"
    assert s.worker.checkpoint_tokens == 16 and s.worker.drain_grace_s == 5.0


@pytest.mark.parametrize("toml,match", [
    ("[worker]\nslots = 'many'\n", "slots"),
    ("[worker]\nslotz = 3\n", "slotz"),
    ("not toml [", "rb.toml"),
])
def test_bad_config_is_refused_clearly(tmp_path, toml, match):
    f = tmp_path / "rb.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        load_settings(f, environ={})


def test_bad_environment_value_is_refused():
    with pytest.raises(ConfigError, match="slots"):
        load_settings(None, environ={"RLBOOST_WORKER__SLOTS": "lots"})


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml", environ={})
