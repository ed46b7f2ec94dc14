"""What a QuantMLA cache does to a model's predictions: teacher-forced next-token NLL with every attention read from
the packed cache, against the unmodified model on the same tokens.

For each format, each sequence is fed as a serving engine would: the first ``prefix`` tokens as a prefill (the
module's own attention, full precision; their latents are written to the cache), then the rest ``chunk`` tokens at a
time as decode steps, whose attention reads the packed pages plus the sink and local-window buffers
(:mod:`quantmla_core.integrations.transformers`). Reported over the decode positions only (where the cache is read):
mean NLL and perplexity, their change against the unmodified model, the mean KL divergence of the next-token
distributions and the top-1 agreement. ``BF16`` (the unquantized page format) is the control: it differs from the
model only by bfloat16 rounding of the cache.

Command line (a local ``transformers`` checkpoint; text files or the calibration's embedded text)::

    python -m quantmla_core.integrations.evaluate --model DIR --formats BF16,C4R4,C2R4 --seq-len 1024 --sequences 4
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .transformers import QuantMLACache, enable_quantmla


@dataclass(frozen=True)
class CacheQuality:
    """One format's result over ``tokens`` decode positions (NLL in nats per token)."""

    format: str
    tokens: int
    nll: float
    nll_reference: float
    kl: float
    top1_agreement: float

    @property
    def delta_nll(self) -> float:
        return self.nll - self.nll_reference

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def perplexity_reference(self) -> float:
        return math.exp(self.nll_reference)


def _logits(model: nn.Module, ids: torch.Tensor, cache=None) -> torch.Tensor:
    # transformers 5.x names the cache argument ``cache`` (``past_key_values`` deprecated), 4.x ``past_key_values``
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=cache is not None, **({name: cache} if cache is not None else {}))
    return out.logits.float()


@torch.no_grad()
def decode_logits(model: nn.Module, ids: torch.Tensor, prefix: int, chunk: int) -> torch.Tensor:
    """Logits [B, T - prefix, vocab] of positions ``prefix .. T-1`` of ``ids`` [B, T], fed as a prefill of ``prefix``
    tokens and then decode steps of ``chunk`` tokens through a :class:`QuantMLACache` (the model must be enabled)."""
    cache = QuantMLACache(model)
    _logits(model, ids[:, :prefix], cache)
    return torch.cat([_logits(model, ids[:, s:s + chunk], cache) for s in range(prefix, ids.shape[1], chunk)], dim=1)


@torch.no_grad()
def evaluate_formats(model: nn.Module, sequences: torch.Tensor, formats: Sequence[str], *, prefix: int = 64,
                     chunk: int = 16, sink: int = 4, local: int = 128, backend: str = "auto") -> list[CacheQuality]:
    """:class:`CacheQuality` of each of ``formats`` over ``sequences`` [N, T] (token ids), with ``sink`` / ``local``
    protected tokens per request. Positions scored: ``prefix .. T-2`` (the next token of each decode position)."""
    if sequences.ndim != 2 or sequences.shape[1] < prefix + 2:
        raise ValueError(f"sequences: expected [N, T] token ids with T >= prefix + 2 = {prefix + 2}, "
                         f"got {list(sequences.shape)}")
    if not 1 <= prefix or not 1 <= chunk:
        raise ValueError(f"prefix, chunk: expected >= 1, got {prefix}, {chunk}")
    device = next(model.parameters()).device
    sums = {fmt: torch.zeros(4, dtype=torch.float64) for fmt in formats}  # NLL, reference NLL, KL, top-1 matches
    for i in range(sequences.shape[0]):  # one sequence at a time: [T, vocab] log-probabilities are large
        ids = sequences[i:i + 1].to(device)
        targets = ids[:, prefix + 1:]
        ref_logp = F.log_softmax(_logits(model, ids)[:, prefix:-1], -1)
        for fmt in formats:
            with enable_quantmla(model, fmt, sink=sink, local=local, backend=backend):
                logp = F.log_softmax(decode_logits(model, ids, prefix, chunk)[:, :-1], -1)
            sums[fmt] += _sums(logp, ref_logp, targets)
    tokens = sequences.shape[0] * (sequences.shape[1] - prefix - 1)
    return [CacheQuality(fmt, tokens, *(sums[fmt] / tokens).tolist()) for fmt in formats]


def _sums(logp: torch.Tensor, ref_logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sums over the positions of log-probabilities [1, T', V] against the reference's, on ``targets`` [1, T']: NLL,
    reference NLL, KL(reference || quantized) and top-1 agreements (float64 [4])."""
    pick = targets.unsqueeze(-1)
    return torch.stack([-logp.gather(-1, pick).sum(), -ref_logp.gather(-1, pick).sum(),
                        (ref_logp.exp() * (ref_logp - logp)).sum(), (logp.argmax(-1) == ref_logp.argmax(-1)).sum()]
                       ).double().cpu()


def format_table(results: Sequence[CacheQuality]) -> str:
    """The results as a plain-text table."""
    lines = [f"{'format':<8} {'tokens':>7} {'NLL':>8} {'dNLL':>9} {'ppl':>9} {'ppl ref':>9} {'KL':>9} {'top-1':>7}"]
    for r in results:
        lines.append(f"{r.format:<8} {r.tokens:>7} {r.nll:>8.4f} {r.delta_nll:>+9.4f} {r.perplexity:>9.3f} "
                     f"{r.perplexity_reference:>9.3f} {r.kl:>9.2e} {r.top1_agreement:>7.2%}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m quantmla_core.integrations.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local transformers checkpoint directory")
    p.add_argument("--formats", default="BF16,C4R4,C2R4", help="comma-separated pack formats (BF16: the control)")
    p.add_argument("--text", nargs="*", default=[], help="text file(s); default: the calibration's embedded text")
    p.add_argument("--sequences", type=int, default=4, help="sequences scored")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prefix", type=int, default=64, help="prefill tokens per sequence (not scored)")
    p.add_argument("--chunk", type=int, default=16, help="tokens per decode step")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda if available)")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (checkpoint's), float32, bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..calibration.capture import make_sequences, read_texts, tokenize

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except Exception:  # tiny test checkpoints carry no tokenizer: byte-level fallback, as the calibration does
        tok = None
        print("no tokenizer in the checkpoint: using UTF-8 bytes modulo the vocabulary", file=sys.stderr)
    ids = tokenize(read_texts(args.text), tok, model.config.get_text_config().vocab_size)
    seqs = make_sequences(ids, args.sequences, args.seq_len, seed=args.seed)
    results = evaluate_formats(model, seqs, [f.strip() for f in args.formats.split(",") if f.strip()],
                               prefix=args.prefix, chunk=args.chunk, sink=args.sink, local=args.local,
                               backend=args.backend)
    print(f"model {args.model} ({model.config.model_type}), {seqs.shape[0]} sequences x {seqs.shape[1]} tokens, "
          f"prefix {args.prefix}, decode chunks of {args.chunk}, sink {args.sink}, local {args.local}, device {device}")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "delta_nll": r.delta_nll} for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
