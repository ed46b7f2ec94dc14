"""End-to-end calibration: teacher capture -> per-layer baselines and training -> fuse -> check -> report."""

from __future__ import annotations

import copy
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from quantmla_core.transforms import ContentTransform, RopeTransform

from . import baselines as B
from .adapters import find_mla_layers
from .analysis import dual_path, plot, write_csv
from .capture import LayerData, capture, layer_tensors
from .fuse import equivalence_check, fuse_model, save_fused, write_json
from .objectives import QuantSpec
from .train import Recipe, train_content, train_rope

__all__ = ["CalibrationConfig", "compare_methods", "calibrate", "format_table"]

METHODS = ("rtn", "smoothquant", "quarot", "quantmla")


@dataclass
class CalibrationConfig:
    """CLI-level settings; defaults are DESIGN.md §7's recipe."""

    fmt: str = "C4R4"
    n_train: int = 128
    n_val: int = 32
    seq_len: int = 2048
    batch_size: int = 4  # teacher forward batch
    recipe: Recipe = field(default_factory=Recipe)
    layers: Sequence[int] | None = None  # None = every MLA layer
    baselines: bool = True
    analysis: bool = True
    cache_nmse: float = 0.01
    device: str = "cpu"
    progress: bool = True
    layers_per_pass: int = 4  # teacher forward passes capture this many layers at a time (memory)
    check: bool = True  # quantization-off equivalence check (keeps a copy of the unfused model)


def compare_methods(train: LayerData, val: LayerData, qs: QuantSpec, recipe: Recipe | None = None,
                    baselines: bool = True, progress: bool = False
                    ) -> tuple[dict[str, dict[str, float]], ContentTransform, RopeTransform, dict[str, Any]]:
    """Held-out content and RoPE objectives of every method on one layer.

    Returns ``({"content": {method: nmse}, "rope": {...}}, content_T, rope_T, logs)``.
    """
    spec = train.spec
    res: dict[str, dict[str, float]] = {"content": {}, "rope": {}}
    if baselines:
        res["content"]["rtn"] = B.eval_content(val, B.rtn_content(val), qs)
        res["rope"]["rtn"] = B.eval_rope(val, B.rtn_rope(val), qs)
        res["content"]["quarot"] = B.eval_content(val, B.content_codec(B.quarot_content(val)), qs) \
            if (spec.d_c & (spec.d_c - 1)) == 0 else float("nan")
        res["rope"]["quarot"] = B.eval_rope(val, B.quarot_rope(val), qs) \
            if (spec.d_r & (spec.d_r - 1)) == 0 else float("nan")
    tc, lc = train_content(train, val, qs, recipe, progress)
    tr, lr = train_rope(train, val, qs, recipe, progress)
    if baselines:  # the α-searched init *is* the SmoothQuant-style baseline
        res["content"]["smoothquant"] = lc.init_val
        res["rope"]["smoothquant"] = lr.init_val
    res["content"]["quantmla"] = lc.best_val
    res["rope"]["quantmla"] = lr.best_val
    return res, tc, tr, {"content": asdict(lc), "rope": asdict(lr)}


def format_table(rows: Sequence[dict], methods: Sequence[str] = METHODS) -> str:
    """Markdown table of rows ``{layer, path, <method>: nmse}``."""
    head = "| layer | path | " + " | ".join(methods) + " |"
    sep = "|---|---|" + "---|" * len(methods)
    lines = [head, sep]
    for r in rows:
        vals = " | ".join(f"{r[m]:.4g}" if m in r else "—" for m in methods)
        lines.append(f"| {r['layer']} | {r['path']} | {vals} |")
    return "\n".join(lines)


def calibrate(model: nn.Module, input_ids: torch.Tensor, cfg: CalibrationConfig, out_dir: str | os.PathLike | None = None,
              tokenizer: Any = None, log=print) -> dict[str, Any]:
    """Calibrate every MLA layer of ``model`` on ``input_ids [n_train + n_val, T]``, fuse in place, save.

    The first ``cfg.n_train`` rows train, the rest are held out. Returns the report dict (also
    written to ``out_dir/quantmla_report.json`` with the CSV/PNG analysis when ``out_dir``).
    """
    t0 = time.time()
    specs = find_mla_layers(model)
    if not specs:
        raise ValueError("model: no MLA attention layers found")
    if cfg.layers is not None:
        specs = [s for s in specs if s.layer_idx in set(cfg.layers)]
    teacher = copy.deepcopy(model) if cfg.check else None  # the unfused original, for the equivalence check
    content: dict[int, ContentTransform] = {}
    rope: dict[int, RopeTransform] = {}
    rows, analysis_rows, logs = [], [], {}
    it: Any = specs
    if cfg.progress:
        from tqdm.auto import tqdm

        it = tqdm(specs, desc=f"calibrate {cfg.fmt}", unit="layer")
    caps: dict = {}
    k = max(1, cfg.layers_per_pass)
    for j, s in enumerate(it):
        if s.layer_idx not in caps:  # next group of layers: one teacher pass (the model is still unfused)
            caps = capture(model, specs[j : j + k], input_ids, cfg.batch_size, progress=False)
        data = layer_tensors(caps.pop(s.layer_idx), cfg.device)
        train, val = data.subset(slice(0, cfg.n_train)), data.subset(slice(cfg.n_train, None))
        if val.n == 0:
            raise ValueError(f"input_ids: need more than n_train={cfg.n_train} sequences for a held-out split")
        qs = QuantSpec.from_format(cfg.fmt, s.d_c, s.d_r)
        res, tc, tr, lg = compare_methods(train, val, qs, cfg.recipe, cfg.baselines, cfg.progress)
        content[s.layer_idx], rope[s.layer_idx] = tc.cpu(), tr.cpu()
        logs[s.layer_idx] = lg
        for path in ("content", "rope"):
            rows.append({"layer": s.layer_idx, "path": path, **res[path]})
        if cfg.analysis:
            analysis_rows.append(dual_path(val, qs, cfg.cache_nmse))
        del data, train, val
    fuse_model(model, content, rope)
    check_ids = input_ids[cfg.n_train : cfg.n_train + min(4, input_ids.shape[0] - cfg.n_train)]
    eq = equivalence_check(teacher, model, check_ids) if teacher is not None else {}
    del teacher
    report = {"format": cfg.fmt, "layers": [s.describe() for s in specs], "objectives": rows,
              "analysis": analysis_rows, "equivalence": eq, "train_logs": logs,
              "recipe": asdict(cfg.recipe), "n_train": cfg.n_train, "n_val": input_ids.shape[0] - cfg.n_train,
              "seq_len": int(input_ids.shape[1]), "seconds": time.time() - t0}
    if out_dir is not None:
        meta = {"format": cfg.fmt, "model_type": specs[0].model_type,
                "rope_layout": specs[0].rope_layout, "cache_rope_layout": specs[0].cache_rope_layout}
        save_fused(model, out_dir, content, rope, meta, tokenizer)
        write_json(os.path.join(out_dir, "quantmla_report.json"), report)
        if analysis_rows:
            write_csv(analysis_rows, os.path.join(out_dir, "dual_path.csv"))
            plot(analysis_rows, os.path.join(out_dir, "dual_path.png"), f"dual-path sensitivity ({cfg.fmt})")
        write_csv(rows, os.path.join(out_dir, "objectives.csv"))
    log(f"\nheld-out objectives ({cfg.fmt}; lower is better)\n" + format_table(rows))
    if analysis_rows:
        log("\ndual-path analysis (cache NMSE %g)\n" % cfg.cache_nmse
            + "| layer | content out NMSE | RoPE out NMSE | RoPE/content |\n|---|---|---|---|\n"
            + "\n".join(f"| {r['layer']} | {r['content_out_nmse']:.4g} | {r['rope_out_nmse']:.4g} | {r['ratio']:.3g}x |"
                        for r in analysis_rows))
    if eq:
        log(f"\nquantization-off check: logits rel err {eq['logits_rel_err']:.3g}, max layer rel err "
            f"{max(eq['layer_rel_err'] or [0.0]):.3g}, NLL {eq['nll_original']:.5f} -> {eq['nll_fused']:.5f}")
    return report
