"""A history checker (Jepsen-style) for the checkpoint store's fencing.

Every process of a run that sets `RLBOOST_STORE_HISTORY=<dir>` records each store operation
and the outcome the store gave (`rlboost.checkpoint.History`: claim, append, append_env,
episode, renew, release, finish, with epoch, offset, token count, ok / fail / info). After the
run, `check` reads those histories, the final checkpoints in Redis (tokens, meta, the history
list `rb:{rid}:hist` that the claim and env-append scripts write inside the store) and the
results on RB_RESULTS, and checks the fencing invariants over the whole history, not only the
end counts:

- `overlapping_writes`: accepted appends of a request tile its checkpoint: no two accepted
  writes cover one offset (one accepted writer per offset), and each accepted write's reply is
  its offset + its tokens;
- `stale_writes_accepted`: no write accepted from an epoch older than one the store had already
  issued at or before its offset. The order needs no clocks: a checkpoint only grows, so an
  epoch the store issued (a claim, a `rb:{rid}:hist` line) at length c came before every write
  the store accepted at offset >= c; an older epoch's write there was accepted after it was
  superseded. A finish accepted while a newer epoch exists is stale too (a finished request
  cannot be claimed again, so the newer claim came first);
- `epoch_went_back`: along a checkpoint's offsets, accepted writes' epochs never decrease;
- `unclaimed_writes`: every accepted write's (owner, epoch) was issued by a claim (recorded, or
  in the store's history list);
- `writes_after_release`: no accepted write sent by a process after that process's own release
  of the epoch had been answered (same process: one monotonic clock);
- `results_not_checkpoint`: every result on the stream equals the final checkpoint (tokens,
  logprobs), names the lease that finished it (meta owner and epoch) and a finish of that epoch
  the store accepted, and (given `verify`: the trainer's `PoolClient.verify_result`) is accepted
  by the trainer;
- `trained_twice`: each request has at most one distinct result the trainer would accept, and
  at most one epoch whose finish was accepted;
- `unrecorded_tokens`: checkpoint tokens that no accepted write in the histories covers and no
  write of unknown or refused outcome at that offset explains (a process killed between the
  store's answer and its history line, or a lost reply whose resend was refused). A violation
  only with `strict` (no process was SIGKILLed).

Assumes the store kept its data (no restart that lost it): a rolled-back checkpoint breaks the
tiling by design (see `rlboost bench faults`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlboost import wire
from rlboost.checkpoint import RECORD, CheckpointStore, parse_segment
from rlboost.errors import CorruptCheckpoint

WRITES = ("append", "append_env")
KINDS = ("overlapping_writes", "stale_writes_accepted", "epoch_went_back", "unclaimed_writes",
         "writes_after_release", "results_not_checkpoint", "trained_twice", "unrecorded_tokens")


@dataclass(frozen=True, slots=True)
class Op:
    op: str
    rid: str
    owner: str
    epoch: int
    off: int
    n: int
    res: str  # ok | fail | info
    out: object
    t0: float
    t1: float
    pid: int
    where: str  # file:line, the evidence

    def __str__(self) -> str:
        return (f"{self.op} {self.rid} owner={self.owner or '?'} epoch={self.epoch} off={self.off} n={self.n} "
                f"-> {self.res} {self.out} (pid {self.pid}, {self.where})")


@dataclass(slots=True)
class Final:
    """A request's checkpoint as the store holds it at the end."""
    tokens: list[int]
    logprobs: list[float]
    owner: str
    epoch: int
    finished: bool
    issued: list[tuple[str, int, int]]  # (owner, epoch, offset) of every `rb:{rid}:hist` line


@dataclass
class Report:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    violations: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, what: str, n: int = 1) -> None:
        self.counts[kind] += n
        self.violations.append(f"{kind}: {what}")

    def summary(self, strict: bool) -> dict:
        bad = {k: v for k, v in self.counts.items() if v and (strict or k != "unrecorded_tokens")}
        return {"history_violations": sum(bad.values()), **{f"history_{k}": v for k, v in self.counts.items()},
                **{f"history_{k}": v for k, v in self.stats.items()}}


def load(directory: str | Path) -> list[Op]:
    """Every process's history lines under `directory`; a torn last line (a process killed in
    the middle of its write) is skipped."""
    ops = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for i, line in enumerate(path.read_bytes().splitlines(), 1):
            try:
                d = json.loads(line)
                ops.append(Op(d["op"], d["rid"], d["owner"], int(d["epoch"]), int(d["off"]), int(d["n"]), d["res"],
                              d["out"], float(d["t0"]), float(d["t1"]), int(d["pid"]), f"{path.name}:{i}"))
            except (ValueError, KeyError, TypeError):
                continue
    return ops


async def finals(store: CheckpointStore, rids: Iterable[str]) -> dict[str, Final]:
    """The final checkpoint of each request, read from the store."""
    out = {}
    for rid in rids:
        data = await store.redis.get(wire.ckpt_tokens_key(rid)) or b""
        rec = np.frombuffer(data[:len(data) - len(data) % RECORD.itemsize], dtype=RECORD)
        owner, epoch, finished = await store.redis.hmget(wire.ckpt_meta_key(rid), "owner", "epoch", "finished")
        issued = []
        for raw in await store.redis.lrange(wire.ckpt_history_key(rid), 0, -1):
            try:
                s = parse_segment(raw)
                issued.append((s.worker_id, s.epoch, s.offset))
            except CorruptCheckpoint:
                continue
        out[rid] = Final(tokens=rec["token"].tolist(), logprobs=rec["logprob"].tolist(),
                         owner=(owner or b"").decode(errors="replace"), epoch=int(epoch or 0),
                         finished=finished == b"1", issued=issued)
    return out


def check(ops: list[Op], final: dict[str, Final], results: list[wire.RolloutResult], strict: bool = True,
          rids: Iterable[str] | None = None, refused: dict[int, str] | None = None) -> Report:
    """Check the invariants (module doc) over the histories `ops`, the final checkpoints and
    the results. `rids`: only these requests (default: every request in the histories).
    `refused`: the trainer's reason for refusing results[i], where it was asked (`check_run`)."""
    rep = Report()
    by_rid: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        by_rid[o.rid].append(o)
    wanted = set(by_rid) if rids is None else set(rids)
    rep.stats = {"ops": sum(len(by_rid[r]) for r in wanted), "requests": len(wanted),
                 "accepted_writes": 0, "refused_writes": 0, "unknown_writes": 0}
    for rid in sorted(wanted):
        _check_request(rid, by_rid.get(rid, []), final.get(rid), rep, strict)
    kept = [i for i, r in enumerate(results) if r.request_id in wanted]
    _check_results([results[i] for i in kept], by_rid, final, rep,
                   {j: (refused or {}).get(i, "") for j, i in enumerate(kept)})
    return rep


def _check_request(rid: str, ops: list[Op], fin: Final | None, rep: Report, strict: bool) -> None:
    writes = [o for o in ops if o.op in WRITES and o.n > 0]
    ok = sorted((o for o in writes if o.res == "ok"), key=lambda o: (o.off, o.t1))
    rep.stats["accepted_writes"] += len(ok)
    rep.stats["refused_writes"] += sum(1 for o in writes if o.res == "fail")
    rep.stats["unknown_writes"] += sum(1 for o in writes if o.res == "info")
    # What the store issued: (owner, epoch, length at issue), from the claims it answered and
    # from its own history list (which also holds claims whose answer never got recorded).
    issued = {(o.owner, o.epoch, o.off) for o in ops if o.op == "claim" and o.res == "ok"}
    issued |= set(fin.issued if fin else ())
    by_epoch = {(owner, epoch) for owner, epoch, _ in issued}

    # One accepted writer per offset; replies consistent with the write.
    for a, b in zip(ok, ok[1:]):
        if b.off < a.off + a.n:
            rep.add("overlapping_writes", f"{rid}: [{a.off},{a.off + a.n}) and [{b.off},{b.off + b.n}) both "
                                          f"accepted:\n    {a}\n    {b}")
        if b.epoch < a.epoch:
            rep.add("epoch_went_back", f"{rid}: epoch {b.epoch} at {b.off} after epoch {a.epoch} at {a.off}:\n"
                                       f"    {a}\n    {b}")
    for w in ok:
        if w.out != w.off + w.n:
            rep.add("overlapping_writes", f"{rid}: the store answered {w.out} to a write of [{w.off},"
                                          f"{w.off + w.n}): {w}")
        newer = [(owner, e, at) for owner, e, at in issued if e > w.epoch and at <= w.off]
        if newer:
            owner, e, at = min(newer, key=lambda x: x[1])
            rep.add("stale_writes_accepted", f"{rid}: epoch {w.epoch} wrote at {w.off} after the store issued "
                                             f"epoch {e} ({owner}) at {at}: {w}")
        if (w.owner, w.epoch) not in by_epoch:
            rep.add("unclaimed_writes", f"{rid}: no claim issued ({w.owner}, {w.epoch}): {w}")
        released = [r for r in ops if r.op == "release" and r.res == "ok" and r.epoch == w.epoch and r.pid == w.pid
                    and r.t1 < w.t0]
        if released:
            rep.add("writes_after_release", f"{rid}: sent after its own release was answered:\n    {released[0]}\n"
                                            f"    {w}")
    fins = [o for o in ops if o.op == "finish" and o.res == "ok"]
    for f in fins:
        newer = [(owner, e) for owner, e, _ in issued if e > f.epoch]
        if newer:
            rep.add("stale_writes_accepted", f"{rid}: finish of epoch {f.epoch} accepted after the store issued "
                                             f"epoch {min(newer, key=lambda x: x[1])}: {f}")
    if len({f.epoch for f in fins}) > 1:
        rep.add("trained_twice", f"{rid}: finishes of epochs {sorted({f.epoch for f in fins})} accepted")
    # Tiling: every checkpoint token is covered by an accepted write, or explained.
    if fin is None:
        return
    length = len(fin.tokens)
    tried = {o.off for o in writes if o.res != "ok"}
    at, gap = 0, 0
    for w in [*ok, None]:
        end = length if w is None else w.off
        if end > at and at not in tried:
            gap += min(end, length) - at
        if w is not None:
            at = max(at, w.off + w.n)
    if ok and ok[-1].off + ok[-1].n > length:
        rep.add("overlapping_writes", f"{rid}: accepted write past the checkpoint's end {length}: {ok[-1]}")
    if gap:
        if strict:
            rep.add("unrecorded_tokens", f"{rid}: {gap} checkpoint tokens no recorded write explains", n=gap)
        else:
            rep.counts["unrecorded_tokens"] += gap


def _check_results(results: list[wire.RolloutResult], by_rid: dict[str, list[Op]], final: dict[str, Final],
                   rep: Report, refused: dict[int, str]) -> None:
    """`refused`: why the trainer refused a result (by its index in `results`), where it was asked."""
    accepted: dict[str, set] = defaultdict(set)
    for i, r in enumerate(results):
        fin = final.get(r.request_id)
        why = refused.get(i, "")
        if why:
            why = f"the trainer refuses it: {why}"
        elif fin is None or not fin.finished:
            why = "its checkpoint is not finished"
        elif (fin.owner, fin.epoch) != (r.worker_id, r.epoch):
            why = f"it names lease {r.worker_id}/{r.epoch}, the store's is {fin.owner}/{fin.epoch}"
        elif (r.token_ids != fin.tokens
              or np.float32(r.logprobs).tobytes() != np.float32(fin.logprobs).tobytes()):
            why = f"its {len(r.token_ids)} tokens differ from the checkpoint's {len(fin.tokens)}"
        elif not any(o.op == "finish" and o.res == "ok" and o.epoch == r.epoch for o in by_rid.get(r.request_id, [])):
            why = f"no accepted finish of epoch {r.epoch} was recorded"
        if why:
            rep.add("results_not_checkpoint", f"{r.request_id}: result of {r.worker_id}/{r.epoch}: {why}")
        else:
            accepted[r.request_id].add((r.epoch, tuple(r.token_ids)))
    for rid, distinct in accepted.items():
        if len(distinct) > 1:
            rep.add("trained_twice", f"{rid}: {len(distinct)} distinct results would be accepted")


async def check_run(directory: str | Path, store: CheckpointStore, results: list[wire.RolloutResult],
                    strict: bool = True, rids: Iterable[str] | None = None, show: int = 20,
                    verify: Callable[[wire.RolloutResult], Awaitable[str]] | None = None) -> dict:
    """Load the histories under `directory` and the final checkpoints, check, print the first
    `show` violations with their evidence; the counts (`Report.summary`). `verify`: the
    trainer's acceptance of a result ('' or why not: `PoolClient.verify_result`)."""
    ops = load(directory)
    wanted = set(rids) if rids is not None else {o.rid for o in ops}
    refused = {}
    if verify is not None:
        for i, r in enumerate(results):
            if r.request_id in wanted and (why := await verify(r)):
                refused[i] = why
    rep = check(ops, await finals(store, wanted), results, strict, wanted, refused)
    for v in rep.violations[:show]:
        print(f"history violation {v}", flush=True)
    if len(rep.violations) > show:
        print(f"... {len(rep.violations) - show} more history violations", flush=True)
    return rep.summary(strict)
