"""Smoke runs of the benchmark harnesses at CPU scale (they check the harness, not timings)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import memory, serving  # noqa: E402

SMOKE = serving.Workload(layers=2, hidden=64, heads=4, d_c=64, d_r=32, d_nope=16, d_v=16, vocab=128,
                         requests=3, prompt_len=60, output_len=20, budget_bytes=2 * 36_000, max_batch=3,
                         page_size=16, sink=2, local=8)


def test_memory_table_agrees_with_accounting():
    rows = memory.memory_table(lengths=(4096, 131072), device="cpu")
    for r in rows:
        assert abs(r["agreement"] - 1) < 1e-3, r
    at_128k = {r["format"]: r["compression_vs_bf16"] for r in rows if r["length"] == 131072}
    assert at_128k["C4R4"] >= 3.6 and at_128k["C2R4"] >= 6.0


def test_stack_runner_logits_match_model():
    """Prefill + decode through the packed BF16-format cache reproduces the model's own logits."""
    w = SMOKE
    model = serving.build_model(w, "cpu", torch.float32)
    runner = serving.MLAStackRunner(model, "BF16", 10**7, 2, backend="torch", page_size=16)
    seq = [5, 9, 17, 3, 44, 2, 8, 19, 33, 7, 11, 13]
    sid, _ = runner.prefill(seq[:9])
    for t in seq[9:-1]:
        runner.decode([sid], [t])
    ids = torch.tensor([seq[-1]])[:, None]
    pos = torch.tensor([[len(seq) - 1]])
    plan = runner.cache.reserve([(sid, 1)])
    got = runner._forward(ids, pos, plan, decode_ids=[sid])
    want = model(torch.tensor([seq])).logits[:, -1]
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-2


def test_serving_smoke_preempts_bf16_and_finishes(tmp_path):
    rows = serving.run(SMOKE, ["BF16", "C4R4"], "cpu", "torch")
    by = {r["format"]: r for r in rows}
    for r in rows:
        assert r["output_tokens"] == SMOKE.requests * SMOKE.output_len
        assert r["tokens_per_s"] > 0
    assert by["BF16"]["preemptions"] > 0 and by["BF16"]["recomputed_tokens"] > 0
    assert by["C4R4"]["num_pages"] > 2 * by["BF16"]["num_pages"]
    assert by["C4R4"]["max_running"] > by["BF16"]["max_running"]
    json.dumps(rows)


def test_report_writes_tables_between_markers(tmp_path):
    from benchmarks import report

    mem = tmp_path / "memory.json"
    memory.main(["--device", "cpu", "--lengths", "4096,32768", "--out", str(mem)])
    serv = tmp_path / "serving.json"
    serving.main(["--tiny", "--backend", "torch", "--requests", "2", "--prompt-len", "30", "--output-len", "4",
                  "--formats", "BF16,C4R4", "--repeats", "3", "--out", str(serv)])
    doc = json.loads(serv.read_text())
    assert len(doc["repeats"]) == 3 and doc["rows"] == doc["repeats"][doc["shown_repeat"]]
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nhand-written text stays\n")
    for _ in range(2):  # idempotent: the second run replaces, not appends
        report.main(["--memory", str(mem), "--serving", str(serv), "--results", str(results)])
    text = results.read_text()
    assert "hand-written text stays" in text
    assert text.count("<!-- report:memory -->") == 1 and text.count("<!-- report:serving -->") == 1
    assert "| 32,768 | C4R4 |" in text
    assert "3 whole runs in this process" in text and text.count("x, ") >= 2  # the per-run ratios
    assert (tmp_path / "results" / "memory.png").stat().st_size > 1000
    assert (tmp_path / "results" / "serving.png").stat().st_size > 1000


def test_median_repeat_picks_the_middle_ratio():
    runs = [[{"format": "BF16", "throughput_vs_bf16": 1.0}, {"format": "C4R4", "throughput_vs_bf16": x}]
            for x in (3.4, 2.9, 3.1, 3.3)]
    assert serving.median_repeat(runs, "C4R4") == 2  # sorted 2.9, 3.1, 3.3, 3.4: the lower middle, 3.1
    assert serving.median_repeat(runs[:3], "C4R4") == 2
    assert serving.median_repeat(runs, "C2R4") == 0


def test_backend_benchmark_suite_smoke(tmp_path):
    """The pytest-benchmark suite runs at tiny scale (one round) and its JSON feeds the report."""
    import os
    import subprocess
    import sys

    from benchmarks import report

    out = tmp_path / "bench.json"
    env = dict(os.environ, QUANTMLA_BENCH_SCALE="tiny", QUANTMLA_BENCH_ROUNDS="1")
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "benchmark", "--benchmark-enable", "-p", "no:cacheprovider",
                    f"--benchmark-json={out}", "benchmarks/test_backends.py"], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = report.attention_rows(json.loads(out.read_text()))
    impls = {(r["impl"], r["format"]) for r in rows}
    assert ("torch", "C4R4") in impls and any(i == "torch-bmm" for i, _ in impls)
    assert all(r["us"] > 0 and r["gbps"] > 0 for r in rows)


def test_step_profile_smoke_on_cpu():
    """The step profiler runs the serving stack at a fixed batch and reports a positive step time."""
    from benchmarks import step_profile

    w = serving.Workload(**{**SMOKE.__dict__, "prompt_len": 40})
    row = step_profile.profile(w, "C4R4", 2, steps=2, prof_steps=1, device="cpu")
    assert row["format"] == "C4R4" and row["batch"] == 2 and row["step_ms"] > 0


def test_request_context_len_matches_context():
    from benchmarks.scheduler import Request

    r = Request(0, [5, 6, 7], 4)
    r.generated += [1, 2]
    assert r.context_len == len(r.context) == 5


def test_probe_shapes_runs_each_shape_and_writes_json(tmp_path, monkeypatch):
    """The GPU probes' shape loop (graph_probe.py, kernel_times.py): every HxBxL[xS_q] in order, the protection
    argument split into sink and local, the rows written beside the machine's info."""
    import argparse

    from benchmarks import _mla_bench_common as common

    monkeypatch.setattr(common, "gpu_info", lambda: {"gpu": "stub"})
    seen = []
    args = argparse.Namespace(shapes="16x8x4096,128x2x64x3", protection="4,128", json=str(tmp_path / "rows.json"))
    rows = common.probe_shapes(args, lambda *shape: seen.append(shape) or [{"shape": list(shape)}])
    assert seen == [(16, 8, 4096), (128, 2, 64, 3)] and (args.sink, args.local) == (4, 128)
    assert rows == [{"shape": [16, 8, 4096]}, {"shape": [128, 2, 64, 3]}]
    assert json.loads((tmp_path / "rows.json").read_text()) == {"info": {"gpu": "stub"}, "rows": rows}


def test_workload_builds_caches_of_other_dims_on_cpu():
    """The probes' workload at d_c 256 / d_r 32 (graph_probe --dims): caches of that format written by a CPU writer,
    queries and dense tokens of those widths, and attention over them that matches the dense tokens' own (the
    quantization error of C8R8 only)."""
    import quantmla_core as qm
    from benchmarks._mla_bench_common import Workload

    w = Workload(2, 100, latent_dim=256, rope_dim=32, device="cpu")
    cache = w.build("C8R8", sink=0, local=0, writer="torch")
    assert (cache.format.latent_dim, cache.format.rope_dim) == (256, 32)
    q, r = w.queries(4)
    assert q.shape == (2, 1, 4, 256) and r.shape == (2, 1, 4, 32)
    kv = w.bf16_dense()
    assert kv.shape == (2, 100, 288)
    out = qm.attention(q, r, cache, backend="torch", return_lse=False, **w.attention_kwargs(0.1))
    s = torch.einsum("bhc,blc->bhl", torch.cat([q[:, 0], r[:, 0]], -1).float(), kv.float()) * 0.1
    want = torch.einsum("bhl,blc->bhc", torch.softmax(s, -1), kv[..., :256].float())
    assert out.shape == (2, 1, 4, 256)
    assert torch.allclose(out[:, 0].float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())


def test_index_and_step_probes_run_at_cpu_scale(capsys):
    """``paged_index_probe`` (a step of several allocators, each its own or sharing a StepMemo) and ``hf_step_probe``
    (generate() on a QuantMLACache with and without the memo) at a CPU scale."""
    from benchmarks import hf_step_probe, paged_index_probe

    assert paged_index_probe.per_step_us(2, 100, 3, 3, True) > 0 and paged_index_probe.per_step_us(2, 100, 3, 3, False) > 0
    memo = paged_index_probe.StepMemo()  # empty, so falsy: the probe must still hand it to every allocator
    assert all(p.memo is memo for p in paged_index_probe._allocators(2, 100, 3, 3, memo))
    model = hf_step_probe.tiny_deepseek(2, "cpu", torch.float32)
    from quantmla_core.integrations.transformers import enable_quantmla

    enable_quantmla(model, "C4R4", backend="torch")
    ids = torch.randint(3, 1024, (2, 20), generator=torch.Generator().manual_seed(0))
    (_, hits), (_, none) = (hf_step_probe.step_ms(model, ids, 2, shared) for shared in (True, False))
    assert hits == 2 * 2 + 1 and none == 0  # layer 1 takes layer 0's write and attention plans (a time may be noise)


def test_merge_grid_replaces_the_new_grids_head_counts_only():
    from benchmarks import report

    def bench(h, us, name):
        return {"name": name, "extra_info": {"H": h, "B": 8, "L": 4096, "impl": "cupy", "device_us": us},
                "stats": {"median": us * 1e-6}}

    base = {"machine_info": {"node": "old"}, "benchmarks": [bench(16, 10.0, "a"), bench(128, 20.0, "b"),
                                                              bench(16, 11.0, "c")]}
    new = {"benchmarks": [bench(16, 5.0, "d")]}
    merged = report.merge_grid(base, new)
    assert [b["name"] for b in merged["benchmarks"]] == ["b", "d"]
    assert merged["machine_info"] == {"node": "old"}
    with pytest.raises(ValueError, match="extra_info"):
        report.merge_grid(base, {"benchmarks": [{"name": "x", "extra_info": {}}]})
