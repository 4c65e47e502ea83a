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


@pytest.mark.parametrize("ttl", ["0.5", "7200"])
def test_run_lease_ttl_is_checked(ttl):
    assert load_settings(None, environ={}).run.lease_ttl_s == 20.0
    with pytest.raises(ConfigError, match=r"run.lease_ttl_s: must be in \[1, 3600\]"):
        load_settings(None, environ={"RLBOOST_RUN__LEASE_TTL_S": ttl})


def test_bad_environment_value_is_refused():
    with pytest.raises(ConfigError, match="slots"):
        load_settings(None, environ={"RLBOOST_WORKER__SLOTS": "lots"})


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml", environ={})


# ---------------------------------------------------------------- the training sections


def test_overrides_beat_environment_beat_file_and_name_the_key(tmp_path):
    from rlboost.config import parse_overrides

    f = tmp_path / "rb.toml"
    f.write_text('[trainer]\nlr = 0.1\nprecision = "fp64"\n[run]\nloggers = ["tensorboard"]\n')
    s = load_settings(f, environ={"RLBOOST_TRAINER__LR": "0.2"},
                      overrides=parse_overrides(["--trainer.lr", "1e-5", "rollout.prompts=4", "--run.steps=3"]))
    assert s.trainer.lr == 1e-5 and s.trainer.precision == "fp64" and s.run.loggers == ["tensorboard"]
    assert s.rollout.prompts == 4 and s.run.steps == 3
    with pytest.raises(ConfigError, match="trainer.precision"):
        load_settings(None, environ={}, overrides=parse_overrides(["trainer.precision=fp8"]))
    with pytest.raises(ConfigError, match="lrr"):
        load_settings(None, environ={}, overrides=parse_overrides(["trainer.lrr=1"]))
    with pytest.raises(ConfigError, match="run.loggers"):
        load_settings(None, environ={}, overrides=parse_overrides(['run.loggers=["mlflow"]']))


def test_invariants_are_checked_in_the_settings():
    with pytest.raises(ConfigError, match="worker.lease_ttl_s"):
        load_settings(None, environ={"RLBOOST_WORKER__LEASE_TTL_S": "12", "RLBOOST_WORKER__ACK_WAIT_S": "10"})
    with pytest.raises(ConfigError, match="rollout.t_seed_floor"):
        load_settings(None, environ={"RLBOOST_ROLLOUT__T_SEED_FLOOR": "5", "RLBOOST_ROLLOUT__T_SEED": "1"})


def test_effective_settings_round_trip_through_toml(tmp_path):
    import msgspec

    from rlboost.config import dump_toml, parse_overrides

    s = load_settings(None, environ={"RLBOOST_SERVICES__NATS_PASSWORD": "secret"},
                      overrides=parse_overrides(["trainer.betas=[0.8, 0.95]", "run.chaos=1:kill", "worker.slots=7"]))
    f = tmp_path / "settings.toml"
    f.write_text(dump_toml(s))
    again = load_settings(f, environ={})
    assert "secret" not in f.read_text()  # credentials come from the environment again
    s.services.nats_password = ""
    assert msgspec.to_builtins(again) == msgspec.to_builtins(s)


def test_the_data_section_sets_the_run_s_data_and_reward_and_flags_override(tmp_path):
    from rlboost.trainer.command import parse

    f = tmp_path / "rb.toml"
    f.write_text('[data]\ntrain = "t.jsonl"\neval = "e.jsonl"\nreward = "r.py:score"\nmax_response_tokens = 64\n'
                 'messages_key = "conversation"\n')
    s = load_settings(f, environ={})
    ds = parse([], s=s).settings.data
    assert (ds.train, ds.eval, ds.reward, ds.max_response_tokens) == ("t.jsonl", "e.jsonl", "r.py:score", 64)
    assert ds.messages_key == "conversation"
    assert parse(["--reward", "math", "--max-response-tokens", "32"], s=s).settings.data.reward == "math"
    with pytest.raises(ConfigError, match="trian"):
        f.write_text('[data]\ntrian = "typo.jsonl"\n')
        load_settings(f, environ={})
