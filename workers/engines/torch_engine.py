"""The torch engine: a Hugging Face causal LM on CPU, batched, with a KV cache.

Sampling is keyed, not stateful: the token at response position i of a request is the
Gumbel-max of the (temperature-scaled, top-k/top-p filtered) logits plus noise that is a pure
hash of (seed, i, vocab index). There is no generator state to carry, so a request
resumed on another worker, in another batch, in chunks of another size, draws exactly the same
noise at every position.

The noise is only half of it: the logits must not depend on the batch either. Batch members,
left padding, and prefill-vs-cached decoding change the order of floating-point reductions;
in float32 that moves a logit by ~1e-6, enough to flip a sample now and then when two perturbed
scores are close. The engine therefore computes in float64 by default: the same
reorderings move logits by ~1e-15, and a flip would need two perturbed scores to tie to 15
digits. For a ~1M-parameter model float64 costs little; `dtype="float32"` trades that
guarantee for speed on bigger models.

A `generate` call feeds each sequence's prompt + tokens so far (left-padded, with explicit
position ids so padding does not shift positions). The worker calls it every
`checkpoint_tokens` tokens and an episode comes back after each tool call, so re-feeding the
whole context each time cost more than the decoding (a 250-token context, 16 new tokens). A
prefix cache (`prefix_cache_mb`) therefore keeps, per request id, the keys and values of what
was fed: the next call feeds only the new tokens (the last sampled one, an episode's tool
result) after them. It is a cache, not state: an entry is used only when its token ids are a
prefix of the sequence's context, the worker may still reshuffle batches freely, a request
resumed elsewhere is simply fed in full, and a weight load empties it (keys and values are the
weights'). Cached and freshly computed keys differ by the same reduction-order noise as batch
composition does, which float64 makes negligible.

Any Hugging Face causal-LM folder loads (`rlboost.modeldir`: safetensors only, local files
only); `device` puts the model on a GPU (`cuda`), sampling noise stays on the CPU.
A request the model cannot serve (a token id outside the vocabulary, a prompt + response
longer than its context) is refused by `check` before admission, and raises `RequestError`
if it reaches `generate` anyway: the worker answers it with an `error` result.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

try:  # per-layer cache objects (transformers >= 4.56); before them, no prefix cache and no reserved room
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover - older transformers
    DynamicLayer = None

from rlboost.logs import get_logger
from rlboost.modeldir import ModelDirError, check_model_dir, load_causal_lm
from rlboost.workers.engines.base import Engine, EngineError, Generated, RequestError, Sequence

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a counter-based hash with full avalanche."""
    with np.errstate(over="ignore"):
        x = (x + _GOLDEN) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache object: `cache` in current transformers
    (5.x, where `past_key_values` is deprecated, a FutureWarning on every call, and goes in 5.40),
    `past_key_values` in older releases and in remote-code models that keep the old signature."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def request_key(seed: int) -> int:
    """The request's seed is its sampling key (base.py); hashed so nearby seeds share nothing."""
    digest = hashlib.blake2b(f"{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def gumbel_noise(keys: list[int], positions: list[int], vocab: int) -> torch.Tensor:
    """(batch, vocab) float64 Gumbel(0, 1) noise, a pure function of (key, position, index)."""
    k = np.asarray(keys, dtype=np.uint64)[:, None]
    p = np.asarray(positions, dtype=np.uint64)[:, None]
    v = np.arange(vocab, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        h = _mix(_mix(k ^ _mix(p)) + v * _GOLDEN)
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)  # in (0, 1), never 0 or 1
    return torch.from_numpy(-np.log(-np.log(u)))


def sample(logits: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> tuple[list[int], list[float]]:
    """Keyed sampling for one decode step. Returns tokens and their logprobs under the
    temperature-scaled full distribution (before top-k/top-p), which is what a trainer
    recomputes; temperature <= 0 is greedy, with logprobs at temperature 1."""
    logits = logits.to(torch.float64)
    temps = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in seqs], dtype=torch.float64)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    filtered = scaled  # each filter is a no-op where no row asks for it: skip its sort
    if any(0 < s.top_k < logits.size(-1) for s in seqs):
        filtered = _top_k(filtered, [s.top_k for s in seqs])
    if any(s.top_p < 1.0 for s in seqs):
        filtered = _top_p(filtered, [s.top_p for s in seqs])
    noisy = filtered + gumbel_noise([request_key(s.seed) for s in seqs], positions, logits.size(-1))
    greedy = torch.tensor([s.temperature <= 0 for s in seqs])
    tokens = torch.where(greedy, scaled.argmax(-1), noisy.argmax(-1))
    return tokens.tolist(), logprobs.gather(1, tokens[:, None])[:, 0].tolist()


def _top_k(scores: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = scores.size(-1)
    k = torch.tensor([k if 0 < k < vocab else vocab for k in ks])
    kth = scores.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    p = torch.tensor(ps, dtype=torch.float64)[:, None]
    order = scores.argsort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(scores, dim=-1).gather(1, order)
    drop_sorted = (probs.cumsum(-1) - probs) >= p  # mass before this token already reaches p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return scores.masked_fill(drop & (p < 1.0), float("-inf"))


if DynamicLayer is not None:
    class ReservedLayer(DynamicLayer):
        """A cache layer that writes each step's keys and values into room reserved for the whole
        call instead of concatenating: a concatenation copies the whole cache at every decode step,
        40% of the demo model's decode time. `keys`/`values` are views of the filled part."""

        def __init__(self, room: int) -> None:
            super().__init__()
            self.room = room
            self._k: torch.Tensor | None = None
            self._v: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = 0 if self._k is None else self.keys.shape[-2]
            m = n + key_states.shape[-2]
            if self._k is None or m > self._k.shape[-2]:
                shape = (*key_states.shape[:-2], m + self.room, key_states.shape[-1])
                k, v = key_states.new_empty(shape), value_states.new_empty(shape)
                if n:
                    k[..., :n, :], v[..., :n, :] = self.keys, self.values
                self._k, self._v = k, v
            self._k[..., n:m, :] = key_states
            self._v[..., n:m, :] = value_states
            self.keys, self.values = self._k[..., :m, :], self._v[..., :m, :]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self._k is not None:
                m = self.keys.shape[-2]
                self._k, self._v = self._k[indices], self._v[indices]
                self.keys, self.values = self._k[..., :m, :], self._v[..., :m, :]


def new_cache(room: int) -> DynamicCache:
    """A DynamicCache whose layers keep `room` positions free for the tokens still to come."""
    cache = DynamicCache()
    if DynamicLayer is not None and getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = functools.partial(ReservedLayer, room)
    return cache


class PrefixCache:
    """Keys and values of the token ids each request has fed, least recently used first out,
    within a byte budget. `take` hands an entry over (it is stored again after the call)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._entries: OrderedDict[str, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self.hits = self.misses = 0  # calls' rows that reused an entry / were fed in full

    @staticmethod
    def _size(layers) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)

    def take(self, request_id: str, context: list[int]):
        """(ids, per-layer (keys, values) of shape (heads, len(ids), dim)) when the entry's ids are
        a proper prefix of `context`; else None (and a stale entry is dropped)."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self.bytes -= self._size(entry[1])
            ids = entry[0]
            if len(ids) < len(context) and context[:len(ids)] == ids:
                self.hits += 1
                return entry
        self.misses += 1
        return None

    def put(self, request_id: str, ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        size = self._size(layers)
        if not ids or size > self.max_bytes:
            return
        self._entries[request_id] = (ids, layers)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, old) = self._entries.popitem(last=False)
            self.bytes -= self._size(old)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, model_dir: str, threads: int = 1, dtype: str | torch.dtype = "float64",
                 on_tokens: Callable[[int], None] | None = None, device: str = "cpu",
                 max_model_len: int = 0, prefix_cache_mb: float = 256.0) -> None:
        torch.set_num_threads(threads)
        if isinstance(dtype, str) and dtype not in _DTYPES:
            raise EngineError(f"torch engine dtype {dtype!r}: choose {', '.join(_DTYPES)}")
        self.dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        try:
            info = check_model_dir(self.model_dir)
            self.model = load_causal_lm(self.model_dir, dtype=self.dtype).to(self.device)
        except ModelDirError as e:
            raise EngineError(str(e)) from None
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self._cache_kwarg = cache_kwarg(self.model)
        self.max_model_len = max_model_len or info.max_context  # 0: no limit known
        self.on_tokens = on_tokens  # called with the number of tokens each decode step made
        # 0 = off: every call feeds whole contexts. Turned off for good if the model's cache is not
        # plain per-layer keys and values (sliding windows, linear attention): nothing to splice.
        self.prefix = PrefixCache(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 and DynamicLayer else None
        self._lock = asyncio.Lock()  # generate and load_weights never overlap
        self.log = get_logger(component="torch-engine")

    def set_token_callback(self, fn: Callable[[int], None]) -> bool:
        """Tokens are reported per decode step, so a worker's crash-proof counter also holds the
        tokens of a call that a SIGKILL cut short (what must be regenerated)."""
        self.on_tokens = fn
        return True

    def _load(self, weights_dir: Path) -> None:
        """Checked in full before anything is copied: a shard set that does not fit leaves the
        current weights untouched. A tied output head is absent from the files by design."""
        files = sorted(Path(weights_dir).glob("*.safetensors"))
        if not files:
            raise EngineError(f"no *.safetensors in {weights_dir}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        current = self.model.state_dict()
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = sorted(set(current) - set(state) - tied)
        unexpected = sorted(set(state) - set(current))
        misshapen = sorted(k for k in set(state) & set(current) if state[k].shape != current[k].shape)
        if missing or unexpected or misshapen:
            raise EngineError(f"weights in {weights_dir} do not fit the model: missing {missing}, "
                              f"unexpected {unexpected}, wrong shape {misshapen}")
        self.model.load_state_dict(state, strict=False)
        self.model.tie_weights()

    def check(self, seq: Sequence) -> str | None:
        bad = [t for t in seq.prompt_ids + seq.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary (size {self.vocab_size})"
        need = len(seq.prompt_ids) + seq.max_new_tokens
        if self.max_model_len and need > self.max_model_len:
            return (f"{len(seq.prompt_ids)} prompt + {seq.max_new_tokens} new tokens exceed the model's "
                    f"context of {self.max_model_len}")
        return None

    async def load_weights(self, weights_dir: Path, version: int) -> None:
        async with self._lock:
            t0 = time.monotonic()
            await asyncio.to_thread(self._load, Path(weights_dir))
            if self.prefix is not None:
                self.prefix.clear()  # keys and values were the old weights'
            self.policy_version = version
            self.log.info("weights loaded", policy_version=version, seconds=round(time.monotonic() - t0, 3))

    async def generate(self, batch: list[Sequence], max_tokens: int,
                       stop: threading.Event | None = None) -> list[Generated]:
        async with self._lock:
            return await asyncio.to_thread(self._generate, batch, max_tokens, stop)

    @torch.inference_mode()
    def _generate(self, batch: list[Sequence], max_tokens: int, stop: threading.Event | None) -> list[Generated]:
        for s in batch:
            reason = self.check(s)
            if reason is not None:
                raise RequestError(s.request_id, reason)
        out = [Generated(token_ids=[], logprobs=[], finished=s.done()) for s in batch]
        budget = [0 if s.done() else min(max_tokens, s.max_new_tokens - len(s.token_ids)) for s in batch]
        live = [i for i in range(len(batch)) if budget[i] > 0]
        if not live or (stop is not None and stop.is_set()):
            return out
        contexts = [batch[i].prompt_ids + batch[i].token_ids for i in live]
        cache, mask, next_pos, logits = self._prefill([batch[i].request_id for i in live], contexts,
                                                      max(budget[i] for i in live))
        stops = [s.stops for s in batch]
        fed = {i: c for i, c in zip(live, contexts, strict=True)}  # ids whose keys the cache holds, per row
        while True:
            seqs = [batch[i] for i in live]
            tokens, logprobs = sample(logits, seqs, [len(s.token_ids) + len(out[i].token_ids)
                                                     for s, i in zip(seqs, live, strict=True)])
            keep = []
            for row, (i, tok, lp) in enumerate(zip(live, tokens, logprobs, strict=True)):
                out[i].token_ids.append(tok)
                out[i].logprobs.append(lp)
                if tok in stops[i] or len(batch[i].token_ids) + len(out[i].token_ids) >= batch[i].max_new_tokens:
                    out[i].finished = True
                elif len(out[i].token_ids) < budget[i]:
                    keep.append(row)
            if self.on_tokens is not None:
                self.on_tokens(len(live))
            if not keep or (stop is not None and stop.is_set()):
                self._remember(batch, live, range(len(live)), fed, cache, mask)
                return out
            if len(keep) < len(live):  # finished rows leave the batch and the cache
                kept = set(keep)
                self._remember(batch, live, [r for r in range(len(live)) if r not in kept], fed, cache, mask)
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                mask, next_pos = mask[idx], next_pos[idx]
                tokens = [tokens[r] for r in keep]
                live = [live[r] for r in keep]
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype, device=self.device)], dim=1)
            logits = self._forward(torch.tensor(tokens, device=self.device)[:, None], mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
            for i, tok in zip(live, tokens, strict=True):
                fed[i].append(tok)

    def _prefill(self, request_ids: list[str], contexts: list[list[int]], new_tokens: int):
        """Feed each context, after its cached prefix where there is one: (cache, attention mask,
        next position per row, last logits). Rows are left-padded twice, the cached part to the
        longest cached prefix and the fed part to the longest feed; padding is masked and position
        ids are explicit, so a row's gaps change nothing it attends to."""
        entries = [self.prefix.take(r, c) if self.prefix is not None else None
                   for r, c in zip(request_ids, contexts, strict=True)]
        held = [len(e[0]) if e else 0 for e in entries]
        feeds = [c[n:] for c, n in zip(contexts, held, strict=True)]
        width, past = max(map(len, feeds)), max(held)
        input_ids = torch.tensor([[0] * (width - len(f)) + f for f in feeds], device=self.device)
        fed_mask = torch.tensor([[0] * (width - len(f)) + [1] * len(f) for f in feeds], device=self.device)
        positions = (fed_mask.cumsum(-1) - 1).clamp(min=0) + torch.tensor(held, device=self.device)[:, None]
        cache = new_cache(width + new_tokens)
        if past:
            shapes = next(e[1] for e in entries if e)
            for layer, (k0, _) in enumerate(shapes):
                def padded(e, n: int, which: int) -> torch.Tensor:
                    pad = k0.new_zeros((k0.size(0), past - n, k0.size(2)))
                    return torch.cat([pad, e[1][layer][which]], dim=1) if e else pad
                cache.update(torch.stack([padded(e, n, 0) for e, n in zip(entries, held, strict=True)]),
                             torch.stack([padded(e, n, 1) for e, n in zip(entries, held, strict=True)]), layer)
            past_mask = torch.tensor([[0] * (past - n) + [1] * n for n in held], device=self.device)
            mask = torch.cat([past_mask, fed_mask], dim=1)
        else:
            mask = fed_mask
        logits = self._forward(input_ids, mask, positions, cache)
        if self.prefix is not None and not all(isinstance(layer, DynamicLayer) and not layer.is_sliding
                                               for layer in cache.layers):
            self.log.info("prefix cache off: the model's cache is not plain keys and values per layer")
            self.prefix = None
        return cache, mask, torch.tensor([len(c) for c in contexts], device=self.device), logits

    def _remember(self, batch, live, rows, fed, cache, mask) -> None:
        """Keep the keys and values of `rows` (indices into `live`) for their requests' next call:
        every position fed so far (not the last sampled token, which was never fed)."""
        if self.prefix is None:
            return
        for r in rows:
            i = live[r]
            keep = mask[r].bool()
            layers = [(layer.keys[r][:, keep], layer.values[r][:, keep]) for layer in cache.layers]  # copies
            self.prefix.put(batch[i].request_id, fed[i], layers)

    def _forward(self, input_ids, mask, positions, cache) -> torch.Tensor:
        result = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache})
        return result.logits[:, -1].cpu()  # sampling (keyed noise) runs on the CPU
