"""Run by ``tests/test_triton_targets.py`` in a subprocess with ``TRITON_INTERPRET=0``: the Triton kernels built for
GPUs this machine does not have (``backends/triton/offline_build.py``): every kernel
the launchers would launch compiles for AMD's MI300X (gfx942), with matrix-core dots where it has dots; the combine
kernel's shared memory is fitted to devices that give a block less than its plan asks for (MI300X/MI250: 64 KB of
LDS; A10/L4/L40S: 99 KB), and kernel v3 gives way to v2 where it does not fit. Offline: triton's own compiler for
each target, no GPU."""

from __future__ import annotations

import pytest
import torch

import quantmla_core as qm

from quantmla_core.backends.triton import interpreting  # noqa: E402

triton = pytest.importorskip("triton")
if interpreting():  # pragma: no cover - the checks need compiled kernels, not the interpreter's functions
    pytest.skip("run by tests/test_triton_targets.py in a process without TRITON_INTERPRET", allow_module_level=True)
from triton.backends.compiler import GPUTarget  # noqa: E402

from quantmla_core.backends.triton import attention as att  # noqa: E402
from quantmla_core.backends.triton import offline_build as ob  # noqa: E402
from quantmla_core.backends.triton.attention_kernel import protect_combine_kernel  # noqa: E402
from quantmla_core.backends.triton.heuristics import combine_configs, first_fitting  # noqa: E402

MI300X = GPUTarget("hip", "gfx942", 64)
#: (target, shared memory a block may use): MI300X and MI250 (64 KB of LDS), sm_86/sm_89 (A10, L4, L40S: 99 KB),
#: sm_90 (H100/H200: 227 KB)
SMALL = [(MI300X, 65536), (GPUTarget("hip", "gfx90a", 64), 65536), (GPUTarget("cuda", 86, 32), 101376)]
HOPPER = (GPUTarget("cuda", 90, 32), 232448)


def _names(launches) -> list[str]:
    return [launch.name for launch in launches]


@pytest.mark.parametrize("fmt_name, heads, split", [("C4R4", 16, "split_v2"), ("C2R4", 16, "split_v2"),
                                                     ("BF16", 16, "split_v1"), ("C4R4", 128, "split_v3")])
def test_every_kernel_builds_for_mi300x(fmt_name, heads, split):
    """The writer, the split kernel auto picks and the combine kernel compile for gfx942 (portable Triton: nothing
    NVIDIA-only on the default path); the split and combine kernels' dots become MFMA instructions."""
    launches = ob.launches_of(fmt_name, heads)
    assert _names(launches) == ["write", split, "protect_combine"]
    for launch in launches:
        res = ob.amd_resources(ob.compile_launch(launch, MI300X))
        print(fmt_name, heads, launch.name, res)
        assert res["vgpr"] > 0 and res["occupancy"] >= 1, res
        assert (res["mfma"] > 0) == (launch.name != "write"), res


@pytest.mark.parametrize("target, limit", [(GPUTarget("cuda", 100, 32), 232448), (GPUTarget("hip", "gfx950", 64), 163840)],
                         ids=lambda v: getattr(v, "arch", v))
def test_plans_build_and_fit_on_b200_and_mi355x(target, limit):
    """Blackwell B200 (sm_100, 227 KB a block) and MI355X (gfx950, 160 KB of LDS): every kernel the plans launch at 16
    and 128 heads builds and fits as planned."""
    for heads in (16, 128):
        for launch in ob.launches_of("C4R4", heads):
            shared = int(ob.compile_launch(launch, target).metadata.shared)
            print(target.arch, heads, launch.name, shared)
            assert shared <= limit, (launch.name, shared)


def _combine_launch():
    return [launch for launch in ob.launches_of("C4R4", 16) if launch.name == "protect_combine"][0]


def _combine_shared(launch, target, config) -> int:
    variant = ob.Launch(launch.name, launch.kernel, launch.args, {**launch.constexprs, "BLOCK_T": config[0]},
                        {**launch.options, **({"num_stages": config[1]} if config[1] else {})})
    return int(ob.compile_launch(variant, target).metadata.shared)


@pytest.mark.parametrize("target, limit", SMALL + [HOPPER], ids=lambda v: getattr(v, "arch", v))
def test_combine_config_fits_the_device(target, limit):
    """On every device the first fitting combine configuration fits, and on the small ones the plan's own (32 tokens,
    Triton's default stages) does not: without the smaller configurations the launch fails there (Triton's
    OutOfResources)."""
    launch = _combine_launch()
    configs = combine_configs(launch.constexprs["BLOCK_T"])
    needs = {c: _combine_shared(launch, target, c) for c in configs}
    chosen = first_fitting(configs, needs.__getitem__, limit)
    assert needs[chosen] <= limit
    assert (chosen == configs[0]) == (target is HOPPER[0]), needs


def test_first_fitting_rule():
    configs = ((32, None), (16, None), (16, 1))
    needs = {(32, None): 166912, (16, None): 92672, (16, 1): 51200}
    assert first_fitting(configs, needs.__getitem__, None) == (32, None)
    assert first_fitting(configs, needs.__getitem__, 232448) == (32, None)
    assert first_fitting(configs, needs.__getitem__, 101376) == (16, None)
    assert first_fitting(configs, needs.__getitem__, 65536) == (16, 1)
    with pytest.raises(ValueError, match=r"no configuration fits the device's 40000 B .*\(16, 1\): 51200 B"):
        first_fitting(configs, needs.__getitem__, 40000)
    assert combine_configs(16) == ((16, None), (16, 1))


def _fake_device(monkeypatch, target, limit) -> None:
    """The launcher's view of a GPU: ``limit`` bytes of shared memory a block and warm-up builds for ``target``."""
    from quantmla_core.backends.triton.attention_v2_kernel import split_kernel_v2
    from quantmla_core.backends.triton.attention_v3_kernel import split_kernel_v3

    kernels = {"protect_combine": protect_combine_kernel, "split_v2": split_kernel_v2, "split_v3": split_kernel_v3}

    def shared_bytes(name, arg_dtypes, consts, options, device_index):
        args = tuple(17 if a is int else 1.5 if a is float else a for a in arg_dtypes)
        launch = ob.Launch(name, kernels[name], args, dict(consts), dict(options))
        return int(ob.compile_launch(launch, target).metadata.shared)

    monkeypatch.setattr(att, "max_shared", lambda device: limit)
    monkeypatch.setattr(att, "_shared_bytes", shared_bytes)


def test_launcher_fits_the_combine_to_mi300x(monkeypatch):
    _fake_device(monkeypatch, MI300X, 65536)
    launches = ob.launches_of("C4R4", 16)
    combine = launches[-1]
    assert combine.constexprs["BLOCK_T"] == 16 and att.LAST_LAUNCH["combine_config"] == (16, None)
    assert _combine_shared(combine, MI300X, (16, None)) <= 65536


def test_launcher_fits_the_float32_combine_to_sm86(monkeypatch):
    """Float32 queries plan 16-token combine tiles already (147,456 B on sm_86 with Triton's stages): on a 99 KB
    device the launcher runs them in one stage (73,728 B)."""
    _fake_device(monkeypatch, GPUTarget("cuda", 86, 32), 101376)
    combine = ob.launches_of("C4R4", 16, dtype=torch.float32)[-1]
    assert combine.name == "protect_combine" and att.LAST_LAUNCH["combine_config"] == (16, 1)
    assert combine.options["num_stages"] == 1 and combine.constexprs["BLOCK_T"] == 16


def test_launcher_runs_v2_where_v3_does_not_fit(monkeypatch):
    """At 128 heads auto runs v3, which needs 115 KB of shared memory on NVIDIA: on a 99 KB device (sm_86) it runs
    v2; forced, v3 says why it cannot run."""
    _fake_device(monkeypatch, GPUTarget("cuda", 86, 32), 101376)
    assert _names(ob.launches_of("C4R4", 128)) == ["write", "split_v2", "protect_combine"]
    monkeypatch.setenv(att.VARIANT_ENV, "v3")
    with pytest.raises(ValueError, match=r"=v3: kernel v3 needs \d+ B of shared memory a block for C4R4.*gives 101376 B"):
        ob.launches_of("C4R4", 128)
    _fake_device(monkeypatch, *HOPPER)
    monkeypatch.delenv(att.VARIANT_ENV)
    assert _names(ob.launches_of("C4R4", 128)) == ["write", "split_v3", "protect_combine"]


def test_max_shared_is_a_limit_only_where_the_plans_may_not_fit(monkeypatch):
    """The launcher checks shared memory only on devices that give a block less than the plans may ask for
    (PLANNED_SHARED_MAX): MI300X's 64 KB and sm_86's 99 KB are limits, A100's 163 KB and H200's 227 KB are not."""
    from quantmla_core.backends.triton.heuristics import PLANNED_SHARED_MAX

    cuda = torch.device("cuda", 0)
    for device_limit, want in ((65536, 65536), (101376, 101376), (PLANNED_SHARED_MAX, None), (232448, None)):
        monkeypatch.setattr(att, "_device_max_shared", lambda index, v=device_limit: v)
        assert att.max_shared(cuda) == want
    assert att.max_shared(torch.device("cpu")) is None
