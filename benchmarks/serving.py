"""Cache-pressure serving workload: whole-job throughput of BF16 vs C4R4 vs C2R4 under one budget.

A benchmark harness, not an engine. A real MLA decoder stack (``transformers``'
DeepseekV3 architecture at DeepSeek-V2-Lite's attention shape -- hidden 2048, 16 heads,
d_c 512, d_r 64, d_nope 128, d_v 128 -- random weights, a few layers) serves one fixed request
trace through :mod:`benchmarks.scheduler` (continuous batching, FIFO admission while pages are
free, preemption by recompute). Every format gets the same cache-memory budget; the latent
cache of every layer lives in one multi-layer :class:`~quantmla_core.PagedMLACache`.

Per step the stack runs the model's own modules (norms, projections, MLP/MoE, lm_head).
Attention: prefill runs the module's original full-precision attention over the fresh tokens
and writes every token to the cache in one writer call per layer; decode runs the absorbed
form on the packed cache (``quantmla_core.integrations.transformers`` does the projections).

    python -m benchmarks.serving --out benchmarks/results/serving.json          # H200 scale
    python -m benchmarks.serving --tiny                                          # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

import quantmla_core as qm

from .machine import command_line, machine_info
from .scheduler import Request, serve


@dataclass(frozen=True)
class Workload:
    """Model size, request trace and budget; ``tiny`` runs on a CPU in seconds."""

    layers: int
    hidden: int
    heads: int
    d_c: int
    d_r: int
    d_nope: int
    d_v: int
    vocab: int
    requests: int
    prompt_len: int
    output_len: int
    budget_bytes: int
    max_batch: int
    page_size: int = 64
    sink: int = 4
    local: int = 128
    dense_mlp: bool = False  # True: every layer dense (no MoE routing loop), a flatter step time
    seed: int = 0


#: BF16 holds ~18 full requests in 0.75 GiB (4 layers x 9.2K tokens x 1152 B), C4R4 ~60.
H200 = Workload(layers=4, hidden=2048, heads=16, d_c=512, d_r=64, d_nope=128, d_v=128, vocab=8192,
                requests=64, prompt_len=8192, output_len=1024, budget_bytes=3 * 2**28, max_batch=64)
#: CPU smoke: BF16 holds 2 requests per 100 KB layer budget, C4R4 about 5.
TINY = Workload(layers=2, hidden=64, heads=4, d_c=64, d_r=32, d_nope=16, d_v=16, vocab=256,
                requests=6, prompt_len=220, output_len=40, budget_bytes=2 * 100_000, max_batch=6,
                page_size=16, sink=2, local=8)


def build_model(w: Workload, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Random-weight DeepseekV3ForCausalLM at the workload's attention shape (no q LoRA, like V2-Lite)."""
    from quantmla_core.calibration.tiny import tiny_config
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(w.seed)
    cfg = tiny_config("v3", q_lora=False, hidden=w.hidden, heads=w.heads, d_c=w.d_c, d_r=w.d_r, d_nope=w.d_nope,
                      d_v=w.d_v, layers=w.layers, vocab=w.vocab, max_pos=max(4096, 2 * (w.prompt_len + w.output_len)))
    if w.dense_mlp:
        cfg.first_k_dense_replace = w.layers
    model = DeepseekV3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    return model


class MLAStackRunner:
    """Drives a transformers MLA model layer by layer on a shared multi-layer paged cache."""

    def __init__(self, model: torch.nn.Module, fmt_name: str, budget_bytes: int, max_seqs: int,
                 sink: int = 4, local: int = 128, backend: str = "auto", page_size: int = 64):
        from quantmla_core.calibration.adapters import find_mla_layers

        self.model = model
        self.specs = find_mla_layers(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        s0 = self.specs[0]
        fmt = qm.PackFormat.parse(fmt_name, latent_dim=s0.d_c, rope_dim=s0.d_r, page_size=page_size)
        protect = (sink, local) if fmt.quantized else (0, 0)
        layers = len(self.specs)
        protect_bytes = max_seqs * sum(protect) * (s0.d_c + s0.d_r) * 2
        num_pages = (budget_bytes // layers - protect_bytes) // fmt.page_bytes
        if num_pages < 1:
            raise ValueError(f"budget_bytes: {budget_bytes} leaves no page for {fmt_name} with {max_seqs} request rows")
        self.cache = qm.PagedMLACache(fmt, num_pages, max_seqs, *protect, device=self.device, backend=backend,
                                      num_layers=layers)
        self.page_size = fmt.page_size
        self.value_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32

    # ---------------------------------------------------------------- scheduler interface
    def free_pages(self) -> int:
        return self.cache.num_free_pages

    def free_rows(self) -> int:
        return len(self.cache._free_rows)

    def release(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    @torch.no_grad()
    def prefill(self, tokens: Sequence[int]) -> tuple[int, int]:
        sid = self.cache.add_request()
        ids = torch.tensor([list(tokens)], device=self.device)
        plan = self.cache.reserve([(sid, len(tokens))])
        positions = torch.arange(len(tokens), device=self.device)[None]
        logits = self._forward(ids, positions, plan, decode_ids=None)
        return sid, int(logits[0].argmax())

    @torch.no_grad()
    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
        lens = [self.cache.seq_len(s) for s in seq_ids]
        plan = self.cache.reserve([(s, 1) for s in seq_ids])
        ids = torch.tensor(list(tokens), device=self.device)[:, None]
        positions = torch.tensor(lens, device=self.device)[:, None]
        logits = self._forward(ids, positions, plan, decode_ids=list(seq_ids))
        return logits.argmax(-1).tolist()

    # ---------------------------------------------------------------- model
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: Any, decode_ids: list[int] | None) -> torch.Tensor:
        """``ids [B, T]`` -> last-token logits ``[B, vocab]``; writes every token's latent to the cache."""
        from quantmla_core.integrations.transformers import _absorbed_forward

        inner = self.model.model
        h = inner.embed_tokens(ids)
        pe = inner.rotary_emb(h, positions)
        table = lens = rows = None
        step: dict[str, Any] = {}  # this step's attention plan, made by the first layer (AttentionPlan)
        if decode_ids is not None:
            table = self.cache.block_table(decode_ids)
            lens = self.cache.seq_lens(decode_ids)
            rows = torch.tensor(decode_ids, device=self.device)
        for i, (layer, spec) in enumerate(zip(inner.layers, self.specs)):
            x = layer.input_layernorm(h)
            if decode_ids is None:
                latent, k_rot = self._latent_and_key(spec, x, pe)
                self.cache.write(plan, latent[0], k_rot[0], layer=i)
                attn = layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]
            else:
                view = _LayerView(self, i, plan, table, lens, rows, step)
                attn = _absorbed_forward(spec, view, x, pe)[0]
            h = h + attn
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h[:, -1]))

    def _latent_and_key(self, spec: Any, x: torch.Tensor, pe: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kv = spec.kv_a_proj_with_mqa(x)
        latent = spec.kv_a_layernorm(kv[..., : spec.d_c]) * spec.latent_scale
        k_rot = spec.apply_rope(kv[..., spec.d_c :].unsqueeze(1), pe)[:, 0]
        return latent.to(self.value_dtype), k_rot.to(self.value_dtype)


class _LayerView:
    """What ``_absorbed_forward`` needs from a cache layer: ``write`` and ``attend`` for this step."""

    def __init__(self, runner: MLAStackRunner, layer: int, plan: Any, table, lens, rows, step: dict[str, Any]):
        self.runner, self.layer, self.plan, self.table, self.lens, self.rows = runner, layer, plan, table, lens, rows
        self.step = step

    def write(self, latent: torch.Tensor, k_rope: torch.Tensor, valid: Any) -> None:
        """latent ``[B, 1, d_c]``, k_rope ``[B, 1, d_r]`` (one new token per request)."""
        c = self.runner.cache
        c.write(self.plan, latent[:, 0].to(self.runner.value_dtype), k_rope[:, 0].to(self.runner.value_dtype), layer=self.layer)

    def attend(self, q_latent: torch.Tensor, q_rope: torch.Tensor, softmax_scale: float) -> torch.Tensor:
        """q ``[B, 1, H, d]`` -> ``[B, 1, H, d_c]``; one attention plan per step, run by every layer."""
        c = self.runner.cache
        layer_cache = c.layer(self.layer)
        attn = self.step.get("attention")
        if attn is None:
            attn = self.step["attention"] = qm.plan_attention(
                layer_cache, block_table=self.table, seq_lens=self.lens, seq_ids=self.rows,
                num_heads=int(q_latent.shape[2]), q_len=int(q_latent.shape[1]), q_dtype=q_latent.dtype,
                softmax_scale=softmax_scale, backend=c.backend)
        return attn.run(q_latent, q_rope, layer_cache, return_lse=False)


def make_trace(w: Workload) -> list[Request]:
    """The same requests for every format: long prompts (±10%), ``output_len`` new tokens each."""
    rng = random.Random(w.seed)
    reqs = []
    for i in range(w.requests):
        n = int(w.prompt_len * rng.uniform(0.9, 1.1))
        reqs.append(Request(i, [rng.randrange(2, w.vocab) for _ in range(n)], w.output_len))
    return reqs


def run(w: Workload, formats: Sequence[str], device: str, backend: str, model: Any = None) -> list[dict]:
    """One whole-job run of ``formats`` in turn on the same trace; rows with the ratio to BF16."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = model if model is not None else build_model(w, device, dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for name in formats:
        runner = MLAStackRunner(model, name, w.budget_bytes, w.max_batch, w.sink, w.local, backend, w.page_size)
        trace = make_trace(w)
        stats = serve(runner, trace, w.max_batch, sync=sync).as_dict()
        stats.update(format=name, num_pages=runner.cache.cache.num_pages, cache_bytes=runner.cache.allocated_bytes(),
                     backend=qm.select_backend(qm.Problem("attention", runner.cache.format, qm.DeviceInfo.of(runner.cache.cache.pages),
                                                          "bfloat16" if dtype == torch.bfloat16 else "float32",
                                                          "bfloat16", w.heads, 1), backend).name)
        rows.append(stats)
        del runner
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    base = next((r for r in rows if r["format"] == "BF16"), None)
    for r in rows:
        r["throughput_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    return rows


def run_repeats(w: Workload, formats: Sequence[str], device: str, backend: str, repeats: int) -> list[list[dict]]:
    """``repeats`` runs of :func:`run`, one after another on one model (the formats interleave, so
    host drift hits them alike); every run has its own ratios to BF16."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build_model(w, device, dtype)
    out = []
    for k in range(repeats):
        out.append(run(w, formats, device, backend, model))
        # a line per finished run, so that a run cut short by a time limit still shows the ones before it
        print(f"run {k + 1}: " + ", ".join(f"{r['format']} {r['tokens_per_s']:.1f} tok/s"
                                          + (f" ({r['throughput_vs_bf16']:.2f}x)" if r["throughput_vs_bf16"] else "")
                                          for r in out[-1]), flush=True)
    return out


def median_repeat(repeats: list[list[dict]], fmt: str) -> int:
    """Index of the run whose ``fmt``/BF16 ratio is the median (the lower middle one for an even
    count); 0 when ``fmt`` or BF16 is missing."""
    ratios = [next((r["throughput_vs_bf16"] for r in rows if r["format"] == fmt), None) for rows in repeats]
    if any(x is None for x in ratios):
        return 0
    order = sorted(range(len(ratios)), key=lambda i: ratios[i])
    return order[(len(order) - 1) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and trace (smoke run)")
    ap.add_argument("--formats", default="BF16,C4R4,C2R4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--dense-mlp", action="store_true", help="dense MLP in every layer instead of MoE after the first")
    ap.add_argument("--repeats", type=int, default=1,
                    help="whole runs of all formats in turn; the tables show the run with the median C4R4 ratio")
    ap.add_argument("--out", default=None, help="write JSON here")
    args = ap.parse_args(argv)
    w = TINY if args.tiny else H200
    over = {k: v for k, v in dict(requests=args.requests, prompt_len=args.prompt_len, output_len=args.output_len).items() if v}
    if args.budget_gib:
        over["budget_bytes"] = int(args.budget_gib * 2**30)
    if args.dense_mlp:
        over["dense_mlp"] = True
    w = Workload(**{**w.__dict__, **over})
    if args.repeats < 1:
        raise SystemExit(f"--repeats: expected >= 1, got {args.repeats}")
    repeats = run_repeats(w, args.formats.split(","), args.device, args.backend, args.repeats)
    shown = median_repeat(repeats, "C4R4")
    print(f"serving: {w.requests} requests x ({w.prompt_len} prompt + {w.output_len} out), {w.layers} layers, "
          f"budget {w.budget_bytes / 2**20:.1f} MiB, device {args.device}")
    for k, rows in enumerate(repeats):
        if len(repeats) > 1:
            print(f"run {k + 1} of {len(repeats)}{' (median C4R4 ratio)' if k == shown else ''}")
        print(f"{'format':<6} {'backend':<9} {'pages':>7} {'tok/s':>9} {'vs BF16':>8} {'preempt':>8} {'recomputed':>11} "
              f"{'mean batch':>11} {'seconds':>8}")
        for r in rows:
            ratio = f"{r['throughput_vs_bf16']:>7.2f}x" if r["throughput_vs_bf16"] is not None else f"{'-':>8}"
            print(f"{r['format']:<6} {r['backend']:<9} {r['num_pages']:>7} {r['tokens_per_s']:>9.1f} {ratio} "
                  f"{r['preemptions']:>8} {r['recomputed_tokens']:>11} {r['mean_running']:>11.1f} {r['seconds']:>8.1f}")
    if args.out:
        doc = {"machine": machine_info(), "command": command_line(), "workload": w.__dict__, "rows": repeats[shown]}
        if len(repeats) > 1:
            doc.update(repeats=repeats, shown_repeat=shown)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
