"""Decode-step time of ``generate()`` on a ``QuantMLACache``: the layers sharing one ``StepMemo`` (the default) against
each layer building its own index arrays and attention plan (``layer.memo = None``), alternated in one process.

A random-weight DeepseekV3 with DeepSeek-V2-Lite's attention (16 heads, d_c 512, d_r 64, 128 + 64 query dims, 128
value dims), a small hidden size and dense MLPs, so that a step is mostly the attention and its host work:

    python benchmarks/hf_step_probe.py [--device cuda] [--layers 27] [--batches 8,32] [--prompt 512] [--new 32]
"""

from __future__ import annotations

import argparse
import time

import torch


def tiny_deepseek(layers: int, device: str, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=layers, max_position_embeddings=8192, n_group=1, topk_group=1, bos_token_id=0,
        eos_token_id=1, pad_token_id=2)
    cfg._attn_implementation = "sdpa"  # the prefill's own attention: eager would hold B x H x L^2 scores
    return transformers.DeepseekV3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def step_ms(model, ids: torch.Tensor, new: int, shared: bool) -> tuple[float, int]:
    """(ms a decode step, the StepMemo's hits in the longest run): ``generate`` of ``new`` + 1 tokens less ``generate``
    of 1 (the prefill), over ``new``. Without ``shared`` every layer builds its own (no memo, no hits)."""
    from quantmla_core.integrations.transformers import QuantMLACache, cache_kwarg

    hits = [0]

    def run(n: int) -> float:
        cache = QuantMLACache(model)
        if not shared:
            for layer in cache.layers:
                layer.memo = None
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2,
                           **{cache_kwarg(model): cache})
        sync()
        hits[0] = max(hits[0], cache.memo.hits if shared else 0)
        return time.perf_counter() - t0

    run(2)  # builds the kernels
    return 1e3 * (run(new + 1) - run(1)) / new, hits[0]


def main() -> None:
    from quantmla_core.integrations.transformers import enable_quantmla

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--format", default="C4R4")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = tiny_deepseek(args.layers, args.device, dtype)
    enable_quantmla(model, args.format, backend=args.backend)
    for b in map(int, args.batches.split(",")):
        ids = torch.randint(3, 1024, (b, args.prompt), generator=torch.Generator().manual_seed(b)).to(args.device)
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for shared in (True, False):
                times[shared].append(step_ms(model, ids, args.new, shared)[0])
        fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        print(f"B{b} L{args.prompt} {args.layers} layers {args.format} {args.backend} on {args.device}: a decode step "
              f"{fmt(times[True])} ms sharing a StepMemo, {fmt(times[False])} ms each layer its own")


if __name__ == "__main__":
    main()
