"""QuantMLA calibration: learn, fuse and verify the cache transforms on ``transformers`` MLA models.

Pipeline (DESIGN.md §7)::

    from quantmla_core.calibration import find_mla_layers, CalibrationConfig, calibrate
    report = calibrate(model, input_ids, CalibrationConfig(fmt="C4R4"), out_dir="fused")

or ``python -m quantmla_core.calibration --model DIR --format C4R4 --out DIR``. Modules:
``adapters`` (model families, module names, RoPE pair layouts), ``capture`` (teacher hooks),
``objectives`` (content / RoPE objectives, quantizer in the loop), ``train`` (recipe),
``baselines`` (RTN, SmoothQuant-style, QuaRot-style), ``fuse`` (fusion, equivalence check),
``analysis`` (dual-path sensitivity), ``pipeline`` (all of it), ``tiny`` (random test models).
Heavy dependencies (transformers, tqdm, matplotlib) are imported lazily.
"""

from .adapters import MLAAdapter, MLALayerSpec, find_mla_layers, register_adapter, rope_pair_indices

__all__ = [
    "MLALayerSpec",
    "MLAAdapter",
    "find_mla_layers",
    "register_adapter",
    "rope_pair_indices",
    "CalibrationConfig",
    "calibrate",
    "Recipe",
]


def __getattr__(name: str):
    if name in ("CalibrationConfig", "calibrate"):
        from . import pipeline

        return getattr(pipeline, name)
    if name == "Recipe":
        from .train import Recipe

        return Recipe
    raise AttributeError(name)
