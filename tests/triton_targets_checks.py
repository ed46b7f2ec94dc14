"""Run by ``tests/test_triton_targets.py`` in a subprocess with ``TRITON_INTERPRET=0``: the Triton kernels built for
GPUs this machine does not have (``backends/triton/offline_build.py``): every kernel
the launchers would launch compiles for AMD's MI300X (gfx942), with matrix-core dots where it has dots; the
protected-tile kernel fits devices with little shared memory (MI300X/MI250: 64 KB of LDS; A10/L4/L40S: 99 KB) at
d_c 512 and 1024, and kernel v3 gives way to v2 where it does not fit, in shared memory
or in Blackwell's tensor memory (B200: a v3 build that needs more than 512 columns traps). Offline: triton's own
compiler for each target, no GPU."""

from __future__ import annotations

import pytest
import torch

from quantmla_core.backends.triton import interpreting  # noqa: E402

triton = pytest.importorskip("triton")
if interpreting():  # pragma: no cover - the checks need compiled kernels, not the interpreter's functions
    pytest.skip("run by tests/test_triton_targets.py in a process without TRITON_INTERPRET", allow_module_level=True)
from triton.backends.compiler import GPUTarget  # noqa: E402

from quantmla_core.backends.triton import attention as att  # noqa: E402
from quantmla_core.backends.triton import offline_build as ob  # noqa: E402
from quantmla_core.backends.triton.attention_kernel import protect_kernel  # noqa: E402
from quantmla_core.backends.triton.heuristics import TMEM_COLUMNS, DeviceLimits  # noqa: E402

MI300X = GPUTarget("hip", "gfx942", 64)
#: (target, shared memory a block may use): MI300X and MI250 (64 KB of LDS), sm_86/sm_89 (A10, L4, L40S: 99 KB),
#: sm_90 (H100/H200: 227 KB)
SMALL = [(MI300X, 65536), (GPUTarget("hip", "gfx90a", 64), 65536), (GPUTarget("cuda", 86, 32), 101376)]
HOPPER = (GPUTarget("cuda", 90, 32), 232448)
A100 = (GPUTarget("cuda", 80, 32), 166912)
B200 = GPUTarget("cuda", 100, 32)


def _names(launches) -> list[str]:
    return [launch.name for launch in launches]


def _needs(compiled) -> tuple[int, int]:
    """(shared memory bytes a block, tensor-memory columns) of a compiled kernel."""
    return att.build_needs_of(compiled.metadata)


def _fake_device(monkeypatch, target, limit, tmem=None) -> None:
    """The launcher's view of a GPU: ``limit`` bytes of shared memory a block (checked at every dims), ``tmem``
    tensor-memory columns, and warm-up builds for ``target``."""
    kernels = {"protect": protect_kernel, **{f"split_{v}": k for v, k in att._KERNELS.items()}}

    def build_needs(name, arg_dtypes, consts, options, device_index):
        launch = ob.Launch(name, kernels[name], att.warmup_args(arg_dtypes), dict(consts), dict(options))
        return _needs(ob.compile_launch(launch, target))

    monkeypatch.setattr(att, "device_limits", lambda device, dc, dr: DeviceLimits(shared=limit, tmem=tmem))
    monkeypatch.setattr(att, "_build_needs", build_needs)


@pytest.mark.parametrize("fmt_name, heads, split", [("C4R4", 16, "split_v2"), ("C2R4", 16, "split_v2"),
                                                     ("BF16", 16, "split_v1"), ("C4R4", 128, "split_v3")])
def test_every_kernel_builds_for_mi300x(fmt_name, heads, split):
    """The writer, the split kernel auto picks, the protected-tile and the merge kernel compile for gfx942 (portable
    Triton: nothing NVIDIA-only on the default path); the split and protected-tile kernels' dots become MFMA
    instructions."""
    launches = ob.launches_of(fmt_name, heads)
    assert _names(launches) == ["write", "protect", split, "merge"]
    for launch in launches:
        res = ob.amd_resources(ob.compile_launch(launch, MI300X))
        print(fmt_name, heads, launch.name, res)
        assert res["vgpr"] > 0 and res["occupancy"] >= 1, res
        assert (res["mfma"] > 0) == (launch.name not in ("write", "merge")), res


@pytest.mark.parametrize("target, limit", [(B200, 232448), (GPUTarget("hip", "gfx950", 64), 163840)],
                         ids=lambda v: getattr(v, "arch", v))
def test_launches_build_and_fit_on_b200_and_mi355x(target, limit, monkeypatch):
    """Blackwell B200 (sm_100, 227 KB a block, 512 tensor-memory columns) and MI355X (gfx950, 160 KB of LDS): every
    kernel the launcher runs at 16 and 128 heads builds, fits, and is not a trap."""
    _fake_device(monkeypatch, target, limit, TMEM_COLUMNS if target is B200 else None)
    for fmt_name in ("C4R4", "BF16"):
        for heads in (16, 128):
            for launch in ob.launches_of(fmt_name, heads):
                compiled = ob.compile_launch(launch, target)
                shared, tmem = _needs(compiled)
                print(target.arch, fmt_name, heads, launch.name, shared, tmem)
                assert shared <= limit and tmem <= TMEM_COLUMNS, (launch.name, shared, tmem)
                assert "trap;" not in compiled.asm.get("ptx", ""), launch.name


def _split_launch(fmt_name: str, heads: int, variant: str, monkeypatch):
    monkeypatch.setenv(att.VARIANT_ENV, variant)
    try:
        return [launch for launch in ob.launches_of(fmt_name, heads) if launch.name.startswith("split")][0]
    finally:
        monkeypatch.delenv(att.VARIANT_ENV)


@pytest.mark.parametrize("fmt_name", ["C4R4", "C2R4", "BF16"])
def test_v3_over_tensor_memory_builds_a_trap_on_b200(fmt_name, monkeypatch):
    """Why the launcher checks tensor memory: triton builds kernel v3 at d_c 512 for sm_100 with 832-1,152 columns of
    tensor memory, more than an SM's 512, and the kernel it builds is a trap."""
    compiled = ob.compile_launch(_split_launch(fmt_name, 128, "v3", monkeypatch), B200)
    assert compiled.metadata.tmem_size > TMEM_COLUMNS
    assert "trap;" in compiled.asm["ptx"] and "tcgen05" not in compiled.asm["ptx"]


def test_v2_fits_tensor_memory_on_b200(monkeypatch):
    """The control: v2 (16 rows a program) takes 256 columns and its dots are tcgen05 MMAs, no trap."""
    compiled = ob.compile_launch(_split_launch("C4R4", 16, "v2", monkeypatch), B200)
    assert 0 < compiled.metadata.tmem_size <= TMEM_COLUMNS
    assert "tcgen05.mma" in compiled.asm["ptx"] and "trap;" not in compiled.asm["ptx"]


def _protect_launch(**kw):
    return [launch for launch in ob.launches_of("C4R4", 16, **kw) if launch.name == "protect"][0]


@pytest.mark.parametrize("target, limit", SMALL + [HOPPER], ids=lambda v: getattr(v, "arch", v))
def test_protect_plan_fits_the_device(target, limit):
    """The protected-tile kernel's plan (one tile of 16 tokens a program since stop 45) fits every device at d_c 512
    and 1024, with bfloat16 and float32 queries, where the combine kernel before it needed 166,912 B at 512 (and
    smaller fallback tiles on the 64-99 KB devices). The exception: float32 queries at d_c 1024 on the 99 KB NVIDIA
    devices (139,264 B; the split kernel v1 needs more there, and the launcher refuses the call, tested below)."""
    for dims in ({}, {"latent_dim": 1024, "rope_dim": 64}):
        for dtype in (torch.bfloat16, torch.float32):
            launch = _protect_launch(dtype=dtype, **dims)
            shared = _needs(ob.compile_launch(launch, target))[0]
            print(target.arch, dims, dtype, shared)
            too_big = dims and dtype == torch.float32 and target.arch == 86
            assert launch.constexprs["BLOCK_T"] == 16 and (shared <= limit) != too_big, (dims, dtype, shared)


def test_launcher_refuses_a_protect_kernel_that_does_not_fit(monkeypatch):
    """Where a device gives less than the protected-tile kernel needs, prepare says which kernel and by how much."""
    _fake_device(monkeypatch, *HOPPER)
    monkeypatch.setattr(att, "device_limits", lambda device, dc, dr: DeviceLimits(shared=20000))
    monkeypatch.setattr(att, "_split_excess", lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"the Triton protected-tile kernel needs \d+ B of shared memory a block, "
                                         r"this GPU gives 20000 B for C4R4"):
        ob.launches_of("C4R4", 16)


def test_launcher_runs_the_protect_plan_on_mi300x_and_sm86(monkeypatch):
    """The launcher checks the plan on the small devices and keeps it (8 warps, 16 tokens); at d_c 1024 with float32
    queries a 99 KB device cannot run the split kernel, and the launcher says why."""
    for target, limit in (SMALL[0], SMALL[2]):
        _fake_device(monkeypatch, target, limit)
        for dtype in (torch.bfloat16, torch.float32):
            protect = _protect_launch(dtype=dtype)
            assert protect.constexprs["BLOCK_T"] == 16 and protect.options["num_warps"] == 8
    with pytest.raises(ValueError, match=r"needs \d+ B of shared memory a block, this GPU gives 101376 B"):
        ob.launches_of("C4R4", 16, dtype=torch.float32, latent_dim=1024, rope_dim=64)


def test_launcher_runs_v2_where_v3_does_not_fit(monkeypatch):
    """At 128 heads auto runs v3, which needs 115 KB of shared memory on NVIDIA: on a 99 KB device (sm_86) it runs
    v2; forced, v3 says why it cannot run."""
    _fake_device(monkeypatch, GPUTarget("cuda", 86, 32), 101376)
    assert _names(ob.launches_of("C4R4", 128)) == ["write", "protect", "split_v2", "merge"]
    monkeypatch.setenv(att.VARIANT_ENV, "v3")
    with pytest.raises(ValueError, match=r"=v3: kernel v3 needs \d+ B of shared memory a block, this GPU gives 101376 B "
                                         r"for C4R4"):
        ob.launches_of("C4R4", 128)
    _fake_device(monkeypatch, *HOPPER)
    monkeypatch.delenv(att.VARIANT_ENV)
    assert _names(ob.launches_of("C4R4", 128)) == ["write", "protect", "split_v3", "merge"]


def test_launcher_runs_v2_where_v3_overflows_tensor_memory(monkeypatch):
    """On a B200 auto runs v2 at 128 heads over packed pages and v1 over BF16 pages (v3 would trap), v3 at d_c 256
    where it fits (512 columns); forced, v3 says why it cannot run."""
    _fake_device(monkeypatch, B200, 232448, TMEM_COLUMNS)
    assert _names(ob.launches_of("C4R4", 128)) == ["write", "protect", "split_v2", "merge"]
    assert _names(ob.launches_of("BF16", 128)) == ["write", "protect", "split_v1", "merge"]
    assert _names(ob.launches_of("C4R4", 128, latent_dim=256, rope_dim=32)) == ["write", "protect", "split_v3", "merge"]
    monkeypatch.setenv(att.VARIANT_ENV, "v3")
    with pytest.raises(ValueError, match=r"=v3: kernel v3 needs \d+ columns of tensor memory, an SM has 512 for C2R4"):
        ob.launches_of("C2R4", 128)


def test_wide_vectors_fit_the_protect_on_hopper_and_name_v1_on_a100(monkeypatch):
    """At d_c 1024 the protected-tile kernel's plan needs 128 KB of shared memory (the combine it replaced: 314 KB):
    on an H200 it runs as planned; on an A100 (163 KB) kernel v1 over BF16 pages (182 KB) says why it cannot run,
    instead of Triton's OutOfResources at launch."""
    _fake_device(monkeypatch, *HOPPER)
    launches = ob.launches_of("C4R4", 16, latent_dim=1024, rope_dim=64)
    assert _names(launches) == ["write", "protect", "split_v2", "merge"]
    protect, merge = launches[1], launches[-1]
    assert protect.constexprs["BLOCK_T"] == 16
    assert all(_needs(ob.compile_launch(launch, HOPPER[0]))[0] <= HOPPER[1] for launch in (protect, merge))
    _fake_device(monkeypatch, *A100)
    with pytest.raises(ValueError, match=r"Triton kernel v1 needs \d+ B of shared memory a block, this GPU gives 166912 B "
                                         r"for BF16"):
        ob.launches_of("BF16", 16, latent_dim=1024, rope_dim=64)


def test_device_limits_check_only_what_a_plan_may_exceed(monkeypatch):
    """Shared memory is checked on devices that give a block less than the plans may ask for at these dims
    (PLANNED_SHARED_MAX at d_c <= 512, d_r <= 64): MI300X's 64 KB and sm_86's 99 KB are limits there, A100's 163 KB and
    H200's 227 KB are not; wider vectors are checked on every GPU. Tensor memory is checked from sm_100."""
    from quantmla_core.backends.triton.heuristics import PLANNED_SHARED_MAX

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(att, "_has_tensor_memory", lambda index: False)
    for device_limit, want in ((65536, 65536), (101376, 101376), (PLANNED_SHARED_MAX, None), (232448, None)):
        monkeypatch.setattr(att, "_device_max_shared", lambda index, v=device_limit: v)
        assert att.device_limits(cuda, 512, 64) == DeviceLimits(shared=want)
        assert att.device_limits(cuda, 256, 32) == DeviceLimits(shared=want)
        assert att.device_limits(cuda, 1024, 64) == DeviceLimits(shared=device_limit)
        assert att.device_limits(cuda, 512, 128) == DeviceLimits(shared=device_limit)
    monkeypatch.setattr(att, "_has_tensor_memory", lambda index: True)
    monkeypatch.setattr(att, "_device_max_shared", lambda index: 232448)
    assert att.device_limits(cuda, 512, 64) == DeviceLimits(shared=None, tmem=TMEM_COLUMNS)
    assert att.device_limits(torch.device("cpu"), 1024, 64) == DeviceLimits()


def test_auto_runs_v3_on_hopper_only(monkeypatch):
    """Off Hopper auto runs v2 over packed pages and v1 over BF16 pages at 128 heads (v3's dots are not warpgroup MMAs
    there); a forced v3 still runs where it fits."""
    monkeypatch.setattr(att, "v3_suits", lambda device: False)
    assert _names(ob.launches_of("C4R4", 128)) == ["write", "protect", "split_v2", "merge"]
    assert _names(ob.launches_of("BF16", 128)) == ["write", "protect", "split_v1", "merge"]
    assert _split_launch("C4R4", 128, "v3", monkeypatch).name == "split_v3"
    monkeypatch.undo()
    assert _names(ob.launches_of("C4R4", 128)) == ["write", "protect", "split_v3", "merge"]  # the control


@pytest.mark.parametrize("capability, hip, hopper", [((9, 0), None, True), ((8, 0), None, False),
                                                     ((8, 6), None, False), ((10, 0), None, False),
                                                     ((12, 0), None, False), ((9, 4), "6.2", False)])
def test_hopper_is_sm90_on_cuda(capability, hip, hopper, monkeypatch):
    """sm_90 is Hopper; ROCm reports MI300X as capability 9.4, which is not."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    major = att._nvidia_major.__wrapped__(0)
    assert (major == 9) is hopper
    monkeypatch.setattr(att, "_nvidia_major", lambda index: major)
    assert att.v3_suits(torch.device("cuda", 0)) is hopper
    assert att.v3_suits(torch.device("cpu")) is True


def test_sass_counts_show_v3_spilling_in_its_loop_on_a100(monkeypatch):
    """What ``auto``'s Hopper-only rule for v3 rests on (offline_build.nvidia_resources): on sm_80 v3's tile loop holds
    spill stores and loads, on sm_90 far fewer, and v2's loop stores none on either."""
    a100 = ob.nvidia_resources(ob.compile_launch(_split_launch("C4R4", 128, "v3", monkeypatch), A100[0]))
    hopper = ob.nvidia_resources(ob.compile_launch(_split_launch("C4R4", 128, "v3", monkeypatch), HOPPER[0]))
    print(a100, hopper)
    assert a100["sass_in_loops"] > 0 and a100["stl_in_loops"] > 10 * hopper["stl_in_loops"] > 0
    assert a100["mma_sync"] > 0 and a100["wgmma"] == 0 and hopper["wgmma"] > 0
    for target in (A100[0], HOPPER[0]):
        v2 = ob.nvidia_resources(ob.compile_launch(_split_launch("C4R4", 16, "v2", monkeypatch), target))
        assert v2["sass_in_loops"] > 0 and v2["stl_in_loops"] == 0 and not v2["trap"]
    assert ob.nvidia_resources(ob.compile_launch(_split_launch("C4R4", 128, "v3", monkeypatch), B200))["trap"]


@pytest.mark.parametrize("target", [HOPPER[0], MI300X], ids=lambda t: str(t.arch))
def test_every_launch_states_fp_fusion(target):
    """Every launch asks for fused multiply-adds itself (triton 3.10 turns the default off; the results and tolerances
    were measured with it on), and the compiled kernels carry that option on NVIDIA and AMD."""
    from quantmla_core.backends.triton.common import FP_FUSION

    launches = ob.launches_of("C4R4", 16) + ob.launches_of("C4R4", 128)[1:]
    assert FP_FUSION is True
    for launch in launches:
        assert launch.options.get("enable_fp_fusion") is True, (launch.name, launch.options)
        assert ob.compile_launch(launch, target).metadata.enable_fp_fusion is True


@pytest.mark.parametrize("heads,split", [(16, "split_v2"), (128, "split_v3")])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_pdl_builds_for_hopper(monkeypatch, heads, split, mode):
    """``QUANTMLA_TRITON_PDL`` on an sm_90 (the launcher's device check faked). 1: the split kernel lets its dependents
    launch after its tile loop, and the merge kernel, launched with ``launch_pdl``, waits for its predecessor before
    its first load. 2: also the protected-tile kernel, launched with PDL after the split kernel, lets the merge launch
    and waits for the split kernel after its last store. 0: none of these instructions, plain launches."""
    monkeypatch.setenv(att.PDL_ENV, str(mode))
    monkeypatch.setattr(att, "pdl_unsupported", lambda device: None)
    launches = ob.launches_of("C4R4", heads)
    by_name = {launch.name: launch for launch in launches}
    order = ["protect", split] if mode < 2 else [split, "protect"]
    assert _names(launches) == ["write", *order, "merge"]
    for name, built, launched in (("protect", mode == 2, mode == 2), (split, mode > 0, False),
                                  ("merge", mode > 0, mode > 0)):
        assert by_name[name].constexprs["PDL"] is built and by_name[name].options.get("launch_pdl", False) is launched
    ptx = {name: ob.compile_launch(by_name[name], HOPPER[0]).asm["ptx"] for name in ("protect", split, "merge")}

    def has(name, op):
        return f"griddepcontrol.{op}" in ptx[name]

    assert (has(split, "launch_dependents"), has(split, "wait")) == (mode > 0, False)
    assert (has("merge", "launch_dependents"), has("merge", "wait")) == (False, mode > 0)
    assert (has("protect", "launch_dependents"), has("protect", "wait")) == (mode == 2, mode == 2)
    if mode:  # the merge waits before its first load of a partial; the protected tiles after their last store
        assert ptx["merge"].index("griddepcontrol.wait") < ptx["merge"].index("ld.global")
    if mode == 2:
        assert ptx["protect"].rindex("st.global") < ptx["protect"].index("griddepcontrol.wait")
