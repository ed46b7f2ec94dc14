"""``model.generate()`` with a QuantMLA cache against the unmodified transformers model.

A DeepSeek-V2-Lite-shaped model (random weights; by default 4 layers at the real attention shape:
hidden 2048, 16 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim
128, no q LoRA, YaRN as in V2-Lite; small MLP and 4 experts so it fits and the MLP does not drown
the attention) prefills an 8K-token prompt and greedily generates 256 tokens:

- ``transformers``: the unmodified model with its default BF16 ``DynamicCache`` (which in
  transformers 5 already holds the compressed MLA latent, 576 values per token and layer);
- ``quantmla <FMT>``: ``enable_quantmla(model, FMT)`` + ``QuantMLACache`` (decode on packed pages).

Reports prefill time, end-to-end and decode tokens/s, the cache bytes (real tensors), the
CUDA peak memory, and a correctness check run first (BF16-format QuantMLA against the
unmodified model on a short prompt: per-step logits error and greedy agreement; prefill logits
of every timed format identical to the unmodified model's). Prints a table and writes JSON.

Not collected by pytest. Usage::

    python benchmarks/hf_generate.py --out results/hf_generate.json            # H200 defaults
    python benchmarks/hf_generate.py --tiny --out /tmp/hf_tiny.json             # CPU smoke run
    python benchmarks/hf_generate.py --formats C4R4,C2R4,BF16 --prompt-len 8192 --new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path of the JSON report")
    p.add_argument("--tiny", action="store_true", help="tiny CPU-sized model and prompt (smoke test)")
    p.add_argument("--formats", default="C4R4", help="comma-separated QuantMLA formats to time (e.g. C4R4,C2R4,BF16)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 8192; tiny 192)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 256; tiny 16)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 102400 as V2-Lite; tiny 256)")
    p.add_argument("--experts", type=int, default=4, help="routed experts (top-2, one shared expert)")
    p.add_argument("--intermediate", type=int, default=1408, help="dense and expert MLP width")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--attn", default="sdpa", help="transformers attention implementation (prefill and baseline)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per configuration (best is reported)")
    p.add_argument("--check-prompt-len", type=int, default=None, help="prompt of the correctness check (default 1024; tiny 96)")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random-weight DeepseekV2ForCausalLM at the V2-Lite attention shape (or tiny)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if args.tiny:
        shape = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=16,
                     v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, vocab_size=args.vocab or 256,
                     max_position_embeddings=4096)
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    else:
        shape = dict(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                     v_head_dim=128, intermediate_size=args.intermediate, moe_intermediate_size=args.intermediate,
                     vocab_size=args.vocab or 102400, max_position_embeddings=163840)
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    cfg = DeepseekV2Config(
        **shape, num_hidden_layers=args.layers, num_key_value_heads=shape["num_attention_heads"], q_lora_rank=None,
        n_routed_experts=args.experts, num_experts_per_tok=min(2, args.experts), n_shared_experts=1,
        first_k_dense_replace=1, rope_parameters=rope, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )
    cfg._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to(device=device, dtype=dtype).eval()
    # HF's init (std 0.02) makes attention almost uniform at this width; draw the attention
    # projections at fan_in^-0.5 so the scores are spread like a trained model's
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and ".self_attn." in name:
                torch.nn.init.normal_(m.weight, std=m.weight.shape[1] ** -0.5)
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_generate(model, ids: torch.Tensor, new_tokens: int, cache: Any, logits: bool = False):
    """Greedy generate of exactly ``new_tokens`` tokens; returns (output, seconds)."""
    from quantmla_core.integrations.transformers import cache_kwarg

    device = ids.device
    key = cache_kwarg(model)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, return_dict_in_generate=True, output_logits=logits, pad_token_id=0, **{key: cache},
    )
    sync(device)
    return out, time.perf_counter() - t0


def dynamic_cache_bytes(cache: Any) -> int:
    """Bytes of the tensors a transformers DynamicCache holds."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(t):
                total += t.numel() * t.element_size()
    return total


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def selected_backend(fmt_name: str, model, backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Name of the backend ``backend`` resolves to for this model's decode attention."""
    import quantmla_core as qm
    from quantmla_core.calibration.adapters import find_mla_layers

    try:
        s = find_mla_layers(model)[0]
        fmt = qm.PackFormat.parse(fmt_name, latent_dim=s.d_c, rope_dim=s.d_r)
        prot = "bfloat16"
        prob = qm.Problem("attention", fmt, qm.DeviceInfo.of(device), "bfloat16" if dtype == torch.bfloat16 else "float32",
                          prot, s.num_heads, 1)
        return qm.select_backend(prob, backend).name
    except Exception as exc:  # report, do not fail the benchmark here
        return f"? ({type(exc).__name__}: {exc})"


def time_config(name: str, model, ids, new_tokens: int, make_cache, repeats: int, device) -> dict[str, Any]:
    """Prefill-only and full runs (best of ``repeats``); the cache of the last full run is measured."""
    best_pre, best_total = float("inf"), float("inf")
    cache = None
    peak_bytes = None
    for _ in range(repeats):
        _, t_pre = run_generate(model, ids, 1, make_cache())
        best_pre = min(best_pre, t_pre)
        peak_reset(device)
        cache = make_cache()
        out, t_total = run_generate(model, ids, new_tokens, cache)
        peak_bytes = peak(device)
        assert out.sequences.shape[1] == ids.shape[1] + new_tokens
        best_total = min(best_total, t_total)
    b = ids.shape[0]
    decode_s = max(best_total - best_pre, 1e-9)
    return {
        "name": name,
        "prefill_s": best_pre,
        "total_s": best_total,
        "tokens_per_s": b * new_tokens / best_total,
        "decode_tokens_per_s": b * (new_tokens - 1) / decode_s,
        "decode_ms_per_step": 1000 * decode_s / max(new_tokens - 1, 1),
        "peak_memory_bytes": peak_bytes,
        "_cache": cache,
    }


@torch.no_grad()
def teacher_forced_logits(model, seq: torch.Tensor, n_prompt: int, cache: Any) -> list[torch.Tensor]:
    """Logits after the prompt and after each following token of ``seq [1, n]`` (the tokens are
    given, not sampled, so one near-tie in bf16 cannot send the two runs down different paths)."""
    from quantmla_core.integrations.transformers import cache_kwarg

    key = cache_kwarg(model)
    out = [model(seq[:, :n_prompt], **{key: cache}).logits[:, -1]]
    for i in range(n_prompt, seq.shape[1] - 1):
        out.append(model(seq[:, i : i + 1], **{key: cache}).logits[:, -1])
    return out


@torch.no_grad()
def correctness_check(model, args, device, dtype, formats: list[str]) -> dict[str, Any]:
    """Teacher-forced comparison on a short prompt: BF16-format QuantMLA against the unmodified
    model (per-step logits error, greedy agreement), and identical prefill logits for every timed
    format. The unmodified model generates the tokens; both runs then read the same tokens."""
    from transformers import DynamicCache

    from quantmla_core.integrations.transformers import QuantMLACache, enable_quantmla

    n_prompt = args.check_prompt_len or (96 if args.tiny else 1024)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(1, model.config.vocab_size, (1, n_prompt), generator=g).to(device)
    steps = 8
    gen, _ = run_generate(model, ids, steps, None)
    seq = gen.sequences
    ref = teacher_forced_logits(model, seq, n_prompt, DynamicCache())
    report: dict[str, Any] = {"prompt_len": n_prompt, "steps": steps, "teacher_forced": True}
    with enable_quantmla(model, "BF16", sink=args.sink, local=min(args.local, n_prompt // 4), backend=args.backend):
        got = teacher_forced_logits(model, seq, n_prompt, QuantMLACache(model))
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    errs = [rel(a, b) for a, b in zip(got, ref)]
    report["bf16_format_step_rel_err"] = errs
    report["bf16_format_greedy_agree"] = [bool(a.argmax() == b.argmax()) for a, b in zip(got, ref)]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    ok = max(errs) < tol
    for fmt in formats:
        with enable_quantmla(model, fmt, sink=args.sink, local=args.local, backend=args.backend):
            o = teacher_forced_logits(model, seq[:, : n_prompt + 2], n_prompt, QuantMLACache(model))
        report[f"{fmt}_prefill_rel_err"] = rel(o[0], ref[0])
        report[f"{fmt}_first_decode_rel_err"] = rel(o[1], ref[1])
        ok = ok and report[f"{fmt}_prefill_rel_err"] < 1e-6
    report["ok"] = bool(ok)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    import quantmla_core as qm
    from quantmla_core.integrations.transformers import QuantMLACache, enable_quantmla

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    prompt_len = args.prompt_len or (192 if args.tiny else 8192)
    new_tokens = args.new_tokens or (16 if args.tiny else 256)
    formats = [f.strip().upper() for f in args.formats.split(",") if f.strip()]

    model = build_model(args, device, dtype)
    cfg = model.config
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, cfg.vocab_size, (args.batch, prompt_len), generator=g).to(device)

    report: dict[str, Any] = {
        "benchmark": "hf_generate",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "quantmla": qm.__version__},
        "model": {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
                                              "qk_nope_head_dim", "v_head_dim", "num_hidden_layers", "vocab_size",
                                              "n_routed_experts", "intermediate_size")},
        "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": args.attn,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batch": args.batch,
        "sink": args.sink,
        "local": args.local,
        "backend_requested": args.backend,
        "backend_selected": {f: selected_backend(f, model, args.backend, device, dtype) for f in formats},
    }
    if not args.skip_check:
        report["check"] = correctness_check(model, args, device, dtype, formats)
        if not report["check"]["ok"]:
            print(f"WARNING: correctness check failed: {report['check']}", file=sys.stderr)

    # warm-up (kernel compilation, allocator) on a short prompt, every configuration
    warm = ids[:, : min(prompt_len, 128)]
    run_generate(model, warm, 2, None)
    for fmt in formats:
        with enable_quantmla(model, fmt, sink=args.sink, local=args.local, backend=args.backend):
            run_generate(model, warm, 3, QuantMLACache(model))

    results = []
    base = time_config("transformers (BF16 DynamicCache)", model, ids, new_tokens,
                       lambda: transformers.DynamicCache(config=cfg), args.repeats, device)
    base["cache_bytes"] = dynamic_cache_bytes(base.pop("_cache"))
    results.append(base)
    for fmt in formats:
        with enable_quantmla(model, fmt, sink=args.sink, local=args.local, backend=args.backend):
            r = time_config(f"quantmla {fmt}", model, ids, new_tokens,
                            lambda: QuantMLACache(model, max_length=prompt_len + new_tokens), args.repeats, device)
        mem = r.pop("_cache").memory_report()
        r["cache_bytes"] = mem["allocated_bytes"]
        r["cache"] = mem
        results.append(r)
    for r in results:
        r["speedup_vs_transformers"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["decode_speedup_vs_transformers"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["cache_ratio_vs_transformers"] = base["cache_bytes"] / r["cache_bytes"] if r["cache_bytes"] else None
    report["results"] = results

    print(f"\n{report['device']}  {report['dtype']}  prompt {prompt_len} + {new_tokens} new, batch {args.batch}, "
          f"{cfg.num_hidden_layers} layers, backend {report['backend_selected']}")
    hdr = f"{'config':34s} {'prefill s':>9s} {'tok/s':>9s} {'decode tok/s':>12s} {'ms/step':>8s} {'cache MiB':>10s} {'x cache':>8s} {'x tok/s':>8s}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['name']:34s} {r['prefill_s']:9.3f} {r['tokens_per_s']:9.1f} {r['decode_tokens_per_s']:12.1f} "
              f"{r['decode_ms_per_step']:8.2f} {r['cache_bytes'] / 2**20:10.2f} {r['cache_ratio_vs_transformers'] or 0:8.2f} "
              f"{r['speedup_vs_transformers']:8.2f}")
    if "check" in report:
        c = report["check"]
        print(f"check: ok={c['ok']}  BF16-format max step logits err {max(c['bf16_format_step_rel_err']):.2e}, "
              f"greedy agree {sum(c['bf16_format_greedy_agree'])}/{len(c['bf16_format_greedy_agree'])} (teacher-forced)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
