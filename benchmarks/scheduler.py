"""Continuous-batching scheduler for the cache-pressure serving workload.

A benchmark harness, not an engine: FIFO admission while pages and request rows are free,
one decode step for every running request per iteration, and preemption by recompute when a
decode step needs a page and none is free (the most recently admitted request is evicted; on
re-admission its prompt plus the tokens it had generated are prefilled again). The scheduler
knows nothing about the model: a :class:`Runner` does the prefill and decode work.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence


class Runner(Protocol):
    """What the scheduler drives. Page accounting is per token slot of one (any) layer."""

    page_size: int

    def free_pages(self) -> int: ...

    def free_rows(self) -> int: ...

    def prefill(self, tokens: Sequence[int]) -> tuple[int, int]:
        """Admit a request: write its tokens, return (request id, next token)."""
        ...

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """One token per request -> the next token of each."""
        ...

    def release(self, seq_id: int) -> None: ...


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    generated: list[int] = field(default_factory=list)
    seq_id: int | None = None
    admitted_at: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def context_len(self) -> int:
        """``len(self.context)`` without building the list (the scheduler asks every step)."""
        return len(self.prompt) + len(self.generated)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new


@dataclass
class Stats:
    output_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prefill_tokens: int = 0
    max_running: int = 0
    running_sum: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tokens_per_s"] = self.output_tokens / self.seconds if self.seconds else 0.0
        d["mean_running"] = self.running_sum / self.steps if self.steps else 0.0
        return d


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def serve(runner: Runner, requests: Sequence[Request], max_batch: int, sync=lambda: None) -> Stats:
    """Run every request to completion; returns whole-job statistics (``sync`` waits for the device)."""
    waiting: deque[Request] = deque(requests)
    running: list[Request] = []
    stats = Stats()
    p = runner.page_size
    step = 0
    start = time.perf_counter()
    while waiting or running:
        # admission: FIFO, while the whole context (+1 decode slot) fits in free pages
        while waiting and len(running) < max_batch and runner.free_rows() > 0:
            req = waiting[0]
            need = _pages_for(req.context_len + 1, p)
            if need > runner.free_pages():
                if not running:
                    raise RuntimeError(f"request {req.rid} needs {need} pages; the whole budget has {runner.free_pages()}")
                break
            waiting.popleft()
            if req.generated:
                stats.recomputed_tokens += req.context_len
            stats.prefill_tokens += req.context_len
            req.seq_id, nxt = runner.prefill(req.context)
            req.generated.append(nxt)
            req.admitted_at = step
            stats.output_tokens += 1
            if req.done:
                runner.release(req.seq_id)
            else:
                running.append(req)
        if not running:
            continue
        # make room for this step's tokens: a request whose next token opens a new page needs one
        while True:
            need = sum(1 for r in running if (r.context_len - 1) % p == 0)
            if need <= runner.free_pages():
                break
            victim = max(running, key=lambda r: (r.admitted_at, r.rid))
            running.remove(victim)
            runner.release(victim.seq_id)
            victim.seq_id = None
            waiting.appendleft(victim)
            stats.preemptions += 1
        if not running:
            continue
        # the newest generated token of each request is fed back in
        nxt = runner.decode([r.seq_id for r in running], [r.generated[-1] for r in running])
        step += 1
        stats.steps += 1
        stats.running_sum += len(running)
        stats.max_running = max(stats.max_running, len(running))
        for r, t in zip(list(running), nxt):
            r.generated.append(t)
            stats.output_tokens += 1
            if r.done:
                running.remove(r)
                runner.release(r.seq_id)
    sync()
    stats.seconds = time.perf_counter() - start
    return stats
