"""Learning the transforms of one layer (DESIGN.md §7 recipe).

Each path is trained with the other exact: AdamW (no weight decay), linear warm-up over the first
10% of steps then cosine decay, gradient-norm clip 1.0, learning rates 3e-3 (content rotation)
and 1e-3 (scales, angles), a random mini-batch of training sequences per step, validation on the
held-out sequences at step 0, every ``val_every`` steps and at the end, keeping the best held-out
state. The scale init is the α formula with α from the grid chosen by held-out objective (this
init is exactly the SmoothQuant-style baseline, so the learned transform never scores worse
than it on the held-out set).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from quantmla_core.transforms import ContentTransform, RopeTransform

from .baselines import ALPHAS, content_codec, eval_content, eval_rope, rope_codec, smooth_content, smooth_rope
from .capture import LayerData
from .objectives import QuantSpec, content_objective, rope_objective

__all__ = ["Recipe", "TrainLog", "train_content", "train_rope", "lr_lambda"]


@dataclass
class Recipe:
    """Calibration hyper-parameters; the defaults are DESIGN.md §7's."""

    steps: int = 300
    lr_rotation: float = 3e-3
    lr_scale: float = 1e-3
    lr_angle: float = 1e-3
    warmup_frac: float = 0.1
    grad_clip: float = 1.0
    val_every: int = 20
    batch_size: int = 4
    alphas: Sequence[float] = ALPHAS
    seed: int = 0


@dataclass
class TrainLog:
    """What happened: chosen α, held-out objective at init and best, step of the best, curve."""

    alpha: float = 0.0
    init_val: float = float("nan")
    best_val: float = float("nan")
    best_step: int = 0
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train loss, val)


def lr_lambda(steps: int, warmup_frac: float):
    """Multiplier: linear warm-up over ``ceil(warmup_frac*steps)`` steps, then cosine to 0."""
    warm = max(1, math.ceil(warmup_frac * steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = (step - warm) / max(1, steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(prog, 1.0)))

    return f


def _loop(params: list[dict], loss_fn, val_fn, module: torch.nn.Module, r: Recipe, n_train: int,
          log: TrainLog, progress: bool, desc: str) -> None:
    opt = torch.optim.AdamW(params, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(r.steps, r.warmup_frac))
    g = torch.Generator().manual_seed(r.seed)
    best_state = copy.deepcopy(module.state_dict())
    best = log.init_val
    it = range(1, r.steps + 1)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(it, desc=desc, unit="step", leave=False)
        it = bar
    loss_v = float("nan")
    for step in it:
        idx = torch.randperm(n_train, generator=g)[: min(r.batch_size, n_train)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(idx)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for grp in params for p in grp["params"]], r.grad_clip)
        opt.step()
        sched.step()
        loss_v = float(loss.detach())
        if step % r.val_every == 0 or step == r.steps:
            v = val_fn()
            log.curve.append((step, loss_v, v))
            if v < best:
                best, log.best_step = v, step
                best_state = copy.deepcopy(module.state_dict())
            if bar is not None:
                bar.set_postfix(train=f"{loss_v:.3g}", val=f"{v:.3g}", best=f"{best:.3g}")
    module.load_state_dict(best_state)
    log.best_val = best


def train_content(train: LayerData, val: LayerData, qs: QuantSpec, recipe: Recipe | None = None,
                  progress: bool = False) -> tuple[ContentTransform, TrainLog]:
    """Learn ``R`` (Cayley from identity) and ``s`` for one layer's content path."""
    r = recipe or Recipe()
    t, alpha, v0 = smooth_content(train, val, qs, r.alphas)
    t = ContentTransform(t.dim, gamma=t.gamma, log_scale=t.log_s.detach(), learn_rotation=True).to(train.u.device)
    log = TrainLog(alpha=alpha, init_val=v0, best_val=v0)
    log.curve.append((0, float("nan"), v0))
    params = [{"params": [t.A], "lr": r.lr_rotation}, {"params": [t.log_s], "lr": r.lr_scale}]
    codec = content_codec(t)
    if r.steps > 0:
        _loop(params, lambda idx: content_objective(train.subset(idx), codec, qs),
              lambda: eval_content(val, codec, qs), t, r, train.n, log, progress, f"content L{train.spec.layer_idx}")
    t.meta.update(method="quantmla", alpha=alpha, best_step=log.best_step, val_objective=log.best_val)
    return t, log


def train_rope(train: LayerData, val: LayerData, qs: QuantSpec, recipe: Recipe | None = None,
               progress: bool = False) -> tuple[RopeTransform, TrainLog]:
    """Learn one angle and one log-scale per RoPE pair for one layer."""
    r = recipe or Recipe()
    spec = train.spec
    t, alpha, v0 = smooth_rope(train, val, qs, spec.rope_layout, spec.cache_rope_layout, r.alphas)
    log = TrainLog(alpha=alpha, init_val=v0, best_val=v0)
    log.curve.append((0, float("nan"), v0))
    params = [{"params": [t.phi], "lr": r.lr_angle}, {"params": [t.log_s], "lr": r.lr_scale}]
    codec = rope_codec(t)
    if r.steps > 0:
        _loop(params, lambda idx: rope_objective(train.subset(idx), codec, qs),
              lambda: eval_rope(val, codec, qs), t, r, train.n, log, progress, f"rope L{spec.layer_idx}")
    t.meta.update(method="quantmla", alpha=alpha, best_step=log.best_step, val_objective=log.best_val)
    return t, log
