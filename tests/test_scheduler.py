"""Serving-harness scheduler: admission, preemption by recompute, and token-exact results.

A fake runner whose next token is a function of the whole context (so a recomputed request must
reproduce exactly what it would have generated undisturbed) and which tracks pages like a real
paged cache.
"""

import pytest

from benchmarks.scheduler import Request, serve


class FakeRunner:
    def __init__(self, num_pages: int, rows: int, page_size: int = 4):
        self.page_size = page_size
        self.pages = num_pages
        self.rows = rows
        self.ctx: dict[int, list[int]] = {}
        self.next_id = 0

    def _used(self) -> int:
        return sum(-(-len(c) // self.page_size) for c in self.ctx.values())

    def free_pages(self) -> int:
        return self.pages - self._used()

    def free_rows(self) -> int:
        return self.rows - len(self.ctx)

    @staticmethod
    def model(context):
        return (sum((i + 1) * t for i, t in enumerate(context)) * 2654435761) % 1000

    def prefill(self, tokens):
        sid = self.next_id
        self.next_id += 1
        self.ctx[sid] = list(tokens)
        assert self.free_pages() >= 0, "prefill overflowed the page budget"
        return sid, self.model(self.ctx[sid])

    def decode(self, seq_ids, tokens):
        out = []
        for s, t in zip(seq_ids, tokens):
            self.ctx[s].append(t)
            out.append(self.model(self.ctx[s]))
        assert self.free_pages() >= 0, "decode overflowed the page budget"
        return out

    def release(self, seq_id):
        del self.ctx[seq_id]


def _requests(n=6, prompt=10, new=9):
    return [Request(i, [(7 * i + j) % 50 for j in range(prompt)], new) for i in range(n)]


def _alone(req):
    ctx = list(req.prompt)
    out = []
    for _ in range(req.max_new):
        out.append(FakeRunner.model(ctx))
        ctx.append(out[-1])
    return out


@pytest.mark.parametrize("pages,expect_preempt", [(200, False), (14, True)])
def test_all_requests_finish_token_exact(pages, expect_preempt):
    reqs = _requests()
    stats = serve(FakeRunner(pages, rows=6), reqs, max_batch=6)
    for r in reqs:
        assert r.generated == _alone(r)
    assert stats.output_tokens == sum(r.max_new for r in reqs)  # recompute keeps generated tokens
    assert (stats.preemptions > 0) == expect_preempt
    assert (stats.recomputed_tokens > 0) == expect_preempt


def test_output_tokens_equal_generated_without_preemption():
    reqs = _requests()
    stats = serve(FakeRunner(200, rows=6), reqs, max_batch=6)
    assert stats.output_tokens == sum(len(r.generated) for r in reqs) == 6 * 9
    assert stats.max_running == 6


def test_rows_and_batch_limit_concurrency():
    reqs = _requests()
    stats = serve(FakeRunner(200, rows=2), reqs, max_batch=6)
    assert stats.max_running <= 2
    stats = serve(FakeRunner(200, rows=6), _requests(), max_batch=3)
    assert stats.max_running <= 3


def test_request_larger_than_budget_is_an_error():
    with pytest.raises(RuntimeError, match="needs 4 pages"):
        serve(FakeRunner(3, rows=2), [Request(0, list(range(13)), 2)], max_batch=2)
