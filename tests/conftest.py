"""Every test talks to real servers that this suite starts itself, on free loopback ports."""

from __future__ import annotations

import os
import uuid

import pytest
import pytest_asyncio

from rlboost import bus
from rlboost.checkpoint import CheckpointStore
from rlboost.config import ServicesSettings
from rlboost.services import EmbeddedServices

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """(nats_url, redis_url) of a NATS+JetStream and a Redis started for this test session."""
    data_dir = tmp_path_factory.mktemp("rlboost-data")
    svc = EmbeddedServices(ServicesSettings(data_dir=str(data_dir)))
    st, started = svc.up()
    assert started
    yield svc.nats_url(st), svc.redis_url(st)
    svc.stop_recorded()


@pytest.fixture(scope="session")
def nats_url(services):
    return services[0]


@pytest.fixture(scope="session")
def redis_url(services):
    return services[1]


@pytest_asyncio.fixture
async def nc(nats_url):
    conn = await bus.connect(nats_url)
    yield conn
    await conn.drain()


@pytest_asyncio.fixture
async def js(nc):
    """A JetStream context on freshly reset streams, so tests do not see each other's messages."""
    ctx = nc.jetstream()
    for spec in bus.wire.STREAMS:
        try:
            await ctx.delete_stream(spec.name)
        except Exception:
            pass
    await bus.provision(ctx)
    return ctx


@pytest_asyncio.fixture
async def store(redis_url):
    s = CheckpointStore(redis_url)
    yield s
    await s.close()


@pytest.fixture
def rid():
    """A fresh request id, so Redis state never leaks between tests."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def s3_env():
    """Dummy AWS credentials in the environment (where the S3 store reads them) for the session."""
    from s3server import S3_ENV

    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_ENV.items():
            mp.setenv(k, v)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        yield


@pytest.fixture(scope="session")
def s3_server(s3_env, tmp_path_factory):
    """A real S3 API server (moto's) on a free loopback port, for the session."""
    from s3server import MotoS3

    srv = MotoS3(tmp_path_factory.mktemp("moto") / "moto.log").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def calc_model_dir(tmp_path_factory):
    """A tiny untrained model on the calculator's alphabet (512-token context), marked warm-started."""
    from rlboost.envs import calculator
    from rlboost.trainer.model import build_model, build_tokenizer, save

    tok = build_tokenizer(calculator.ALPHABET)
    model = build_model(len(tok), hidden=64, layers=2, heads=2, mlp=128, max_positions=512, seed=0,
                        pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    # pretend it was warm-started: this test is about the dataflow
    return save(model, tok, tmp_path_factory.mktemp("m") / "calc", meta={"trained": True, "env": "calculator"})


@pytest.fixture(scope="session")
def tool_calling_model_dir(tmp_path_factory):
    """The calculator's character model, tuned for a few seconds to answer the calculator's
    opening with a compact call of its tool (`<tool_call>calc 2+3</tool_call>` then <eos>): its
    episodes make tool calls, what an untrained model never does. Tuned on the whole openings at
    their own positions (right-padded; the model is causal, so the padding after a call changes
    nothing before it): tuned on their last tokens only, the model met the call at other
    positions and on one machine never made it in a run (0 tool calls in 8 episodes)."""
    import math

    import torch

    from rlboost.envs import calculator
    from rlboost.envs.chat import chat_format
    from rlboost.trainer.model import build_model, build_tokenizer, save

    tok = build_tokenizer(calculator.ALPHABET)
    model = build_model(len(tok), hidden=64, layers=2, heads=2, mlp=128, max_positions=512, seed=0,
                        pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    call = tok("<tool_call>calc 2+3</tool_call>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    fmt, env = chat_format(tok, describe_tools=False), calculator.CalculatorEnv(instructions=False)
    prompts = [fmt.prompt_ids(env.opening_messages(r), [calculator.CALC]) for r in calculator.rows("train", 64, seed=99)]

    def batch(qs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((len(qs), max(len(q) for q in qs) + len(call)), tok.pad_token_id)
        y = torch.full_like(x, -100)
        for i, q in enumerate(qs):
            x[i, :len(q) + len(call)] = torch.tensor(q + call)
            y[i, len(q) - 1:len(q) + len(call) - 1] = torch.tensor(call)  # each call token from what precedes it
        return x, y

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for i in range(300):  # ~5 s; the loss ~0.003 a token
        x, y = batch([prompts[(8 * i + j) % len(prompts)] for j in range(8)])
        loss = torch.nn.functional.cross_entropy(model(x).logits.reshape(-1, len(tok)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # the whole call's probability after an opening it was not tuned on
        q = fmt.prompt_ids(env.opening_messages(calculator.rows("test", 1, seed=7)[0]), [calculator.CALC])
        x, y = batch([q])
        p_call = math.exp(-float(torch.nn.functional.cross_entropy(model(x).logits[0], y[0], reduction="sum")))
    assert p_call > 0.5, f"the tuned model makes its call with probability {p_call:.3f} (not tuned enough here)"
    return save(model, tok, tmp_path_factory.mktemp("m") / "caller", meta={"trained": True, "env": "calculator"})


@pytest.fixture(scope="session")
def short_turns_model_dir(tmp_path_factory):
    """The calculator's character model (printable ASCII: reasoning-gym's questions fit), tuned
    for a few steps to end a turn with <eos> about a third of the time: its turns end with a stop
    token, not the turn's budget, so the environment answers them (an untrained model rarely
    stops within 24 tokens, and a turn cut off ends its episode). The episode runs of
    test_episode_training, test_verifiers_env and test_openenv_env play on it."""
    import torch

    from rlboost.envs import calculator
    from rlboost.trainer.model import build_model, build_tokenizer, save

    tok = build_tokenizer(calculator.ALPHABET)
    model = build_model(len(tok), hidden=64, layers=2, heads=2, mlp=128, max_positions=512, seed=0,
                        pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(5):
        x = torch.randint(2, len(tok), (8, 64), generator=torch.Generator().manual_seed(i))
        loss = torch.nn.functional.cross_entropy(model(x).logits.reshape(-1, len(tok)),
                                                 torch.full((8 * 64,), tok.eos_token_id))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save(model, tok, tmp_path_factory.mktemp("m") / "short", meta={"trained": True})
