"""Offline instruction report of the CuPy attention kernels v2, v3, v4 and v5 for sm_90 -- no GPU needed.

Compiles ``kernels/attention_v2.cu`` with the machine's ``nvcc`` for sm_90 (the defines the
launcher would use), disassembles the cubin with ``cuobjdump -sass`` and counts the SASS
instructions of the tile loop (the largest backward branch), by opcode, and the stall cycles ptxas encoded in
each instruction (``LoopReport.fixed_wait_cycles``: what ncu reports as the "wait" stall). With ``pure_path`` the
kernel is built with ``QMLA_V2_NO_PROTECTION`` (what the launcher compiles for caches without
sink/local tokens), so the loop holds only the code that tiles without protected tokens run --
the hot path of every cache.

This is the static side of "what limits the kernel": on the H200 the loop issues close to these
counts per tile and warp (benchmarks/RESULTS.md compares them with Nsight Compute). ``hgmma_issue_gaps`` and
``load_positions`` read where ptxas put a loop's matmuls and global loads (their spacing, and which matmuls a load
issues after).

    python -m quantmla_core.backends.cupy.sass_report                 # C4R4 and C2R4, 512/64
    python -m quantmla_core.backends.cupy.sass_report C4R4 256 32

Kernel v4 is reported in its wgmma build (sm_90a, what the launcher runs on an H100/H200), over
packed pages and over bf16 pages; kernel v5 (sm_90a only) per worker warp; kernel v6 (sm_90a only) per
warp of each warpgroup.

Needs ``nvcc`` (CUDA 12.4+) and ``cuobjdump`` + ``nvdisasm`` on PATH or from the
``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels (the ``dev`` extra on x86-64 Linux).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ...formats import PackFormat
from . import KERNEL_DIR, define_options
from .builds import (
    CODES_IN_PLACE,
    V3_STAGES,
    V4_WGMMA_ARCH,
    V5_WORKER_CHOICES,
    V5_WORKERS,
    v2_default_stages,
    v2_defines,
    v3_defines,
    v4_defines,
    v5_defines,
    v5_build_reasons,
    v6_defines,
    v5_zfold,
)

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);")
# cuobjdump prints an instruction's second 64-bit word alone on the next line
_HIGH_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
#: bits of the stall count in an sm_70+ instruction's high word (bits 105-108 of the 128): the cycles the
#: scheduler waits before this warp's next instruction (1: the next cycle)
STALL_SHIFT, STALL_MASK = 41, 0xF


@dataclass(frozen=True)
class LoopReport:
    """Opcode histogram of one loop (``start``/``end``: SASS byte addresses); ``stalls``: per opcode, the stall
    counts ptxas encoded (cycles before the warp's next instruction may issue; empty where the listing lacks the
    instructions' high words)."""

    start: int
    end: int
    opcodes: dict[str, int]
    stalls: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.opcodes.values())

    @property
    def fixed_wait_cycles(self) -> int:
        """Cycles a warp waits on fixed-latency dependencies in one pass of the loop, beyond one issue cycle per
        instruction (what ncu counts as the "wait" stall reason, if every instruction runs once)."""
        return sum(self.stalls.values()) - self.total if self.stalls else 0

    def count(self, *names: str) -> int:
        return sum(self.opcodes.get(n, 0) for n in names)


def find_tool(name: str) -> str | None:
    """Path of a CUDA binary: PATH, then the ``nvidia/cu*/bin`` folders of pip's CUDA wheels."""
    found = shutil.which(name)
    if found:
        return found
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for cand in sorted(Path(site).glob(f"nvidia/*/bin/{name}")):
            if cand.is_file():
                if not os.access(cand, os.X_OK):
                    try:
                        cand.chmod(cand.stat().st_mode | 0o111)  # some wheel installs drop the exec bit
                    except OSError:
                        continue
                return str(cand)
    return None


def missing_tools() -> list[str]:
    """Tools this report needs and cannot find (empty: it can run)."""
    return [t for t in ("nvcc", "cuobjdump", "nvdisasm") if find_tool(t) is None]


def compile_sass(fmt: PackFormat, pure_path: bool = True, row_groups: int = 1, stages: int | None = None,
                 lazy_rescale: bool = False, min_blocks: int = 1, prot_mode: int = 0, tile: int = 32) -> tuple[str, str]:
    """(SASS text, ptxas -v output) of ``qmla_attn_v2`` for ``fmt`` on sm_90 (``prot_mode`` 1: the
    packed-only split kernel of ``QUANTMLA_CUPY_V2_PROTECTED=separate``; ``pure_path`` is then moot)."""
    stages = v2_default_stages(tile) if stages is None else stages
    defines = v2_defines(fmt, row_groups, min_blocks, stages, lazy_rescale, no_protection=pure_path and not prot_mode,
                         prot_mode=prot_mode, tile=tile)
    return _build_sass("attention_v2.cu", defines)


def compile_sass_v3(fmt: PackFormat, stages: int = V3_STAGES, lazy_rescale: bool = False) -> tuple[str, str]:
    """(SASS text, ptxas -v output) of ``qmla_attn_v3`` for ``fmt`` on sm_90."""
    return _build_sass("attention_v3.cu", v3_defines(fmt, stages, lazy_rescale=lazy_rescale))


def compile_sass_v4(fmt: PackFormat, wgmma: bool = True) -> tuple[str, str]:
    """(SASS text, ptxas -v output) of ``qmla_attn_v4`` for ``fmt`` (packed or bf16 pages): the wgmma
    build for sm_90a, or the ``mma.sync`` build for sm_90."""
    return _build_sass("attention_v4.cu", v4_defines(fmt, wgmma=wgmma), V4_WGMMA_ARCH if wgmma else "sm_90")


def compile_sass_v5(fmt: PackFormat, workers: int = V5_WORKERS, prot_vec: bool = True,
                    codes_in_place: bool = CODES_IN_PLACE, rope_fold: bool | None = None,
                    zfold: bool | None = None) -> tuple[str, str]:
    """(SASS text, ptxas -v output) of ``qmla_attn_v5`` for ``fmt`` with ``workers`` worker warpgroups
    per CTA (an sm_90a build); ``prot_vec``: the protected-row loads of up to 16 bytes (``QMLA_V5_PROT_VEC``;
    False: 4-byte loads); ``codes_in_place``: ``QMLA_CODES_IN_PLACE``; ``rope_fold``: ``QMLA_V5_ROPE_FOLD``;
    ``zfold``: ``QMLA_V5_ZFOLD`` (None: the launcher's defaults)."""
    defines = v5_defines(fmt, workers=workers, prot_vec=prot_vec, codes_in_place=codes_in_place, rope_fold=rope_fold,
                         zfold=zfold)
    return _build_sass("attention_v5.cu", defines, V4_WGMMA_ARCH)


def compile_sass_v6(fmt: PackFormat) -> tuple[str, str]:
    """(SASS text, ptxas -v output) of ``qmla_attn_v6`` for ``fmt`` (an sm_90a build)."""
    return _build_sass("attention_v6.cu", v6_defines(fmt), V4_WGMMA_ARCH)


def compile_sass_source(path: Path, defines: dict[str, int] | None = None,
                        arch: str = V4_WGMMA_ARCH) -> tuple[str, str]:
    """(SASS text, ptxas -v output) of any CUDA source built with the kernels' headers on the include path (the
    probes in benchmarks/, e.g. v7_probe.cu)."""
    return _build_sass(str(Path(path).resolve()), defines or {}, arch)  # an absolute path: KERNEL_DIR / it is it


def _build_sass(source: str, defines: dict[str, int], arch: str = "sm_90") -> tuple[str, str]:
    missing = missing_tools()
    if missing:
        raise RuntimeError(f"sass_report needs {', '.join(missing)} (see the module docstring)")
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(find_tool("nvdisasm")).parent), os.environ.get("PATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        # -ftz=true as the launcher's NVRTC builds (compile_cubin), so the counts are those of the kernels that run
        cmd = [find_tool("nvcc"), "-cubin", f"-arch={arch}", "--std=c++17", "-ftz=true", "-Xptxas", "-v",
               f"-I{KERNEL_DIR}", *define_options(defines), "-o", cubin, str(KERNEL_DIR / source)]
        built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if built.returncode:
            raise RuntimeError(f"nvcc failed:\n{built.stderr[-3000:]}")
        dis = subprocess.run([find_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, env=env, timeout=120)
        if dis.returncode:
            raise RuntimeError(f"cuobjdump failed:\n{dis.stderr[-2000:]}")
    return dis.stdout, built.stderr + built.stdout


def _instructions(sass: str) -> list[tuple[int, str, str, int | None]]:
    """(address, opcode, operands, encoded stall count or None) of every instruction of a cuobjdump listing."""
    lines = sass.splitlines()
    ins = []
    for i, line in enumerate(lines):
        m = _INSTR.match(line)
        if m:
            high = _HIGH_WORD.match(lines[i + 1]) if i + 1 < len(lines) else None
            stall = (int(high.group(1), 16) >> STALL_SHIFT) & STALL_MASK if high else None
            ins.append((int(m.group(1), 16), m.group(2), m.group(3), stall))
    return ins


def loops(sass: str) -> list[LoopReport]:
    """Every loop (a backward branch and the instructions it spans), largest first."""
    ins = _instructions(sass)
    index = {addr: i for i, (addr, _, _, _) in enumerate(ins)}
    found = []
    for i, (addr, op, args, _) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in index:
            s = index[int(target.group(1), 16)]
            body = [(o.split(".")[0], st) for _, o, _, st in ins[s : i + 1]]
            hist = collections.Counter(o for o, _ in body)
            stalls: collections.Counter = collections.Counter()
            if all(st is not None for _, st in body):
                for o, st in body:
                    stalls[o] += st
            found.append(LoopReport(ins[s][0], addr, dict(hist), dict(stalls)))
    return sorted(found, key=lambda r: r.total, reverse=True)


def _loop_body(sass: str, loop: LoopReport) -> list[tuple[int, str, str, int | None]]:
    return [ins for ins in _instructions(sass) if loop.start <= ins[0] <= loop.end]


def hgmma_issue_gaps(sass: str, loop: LoopReport) -> collections.Counter:
    """Cycles between consecutive HGMMAs of ``loop`` as ptxas encoded them (the stall counts from one HGMMA up to the
    next), by whether the second takes its A operand from registers: ``Counter({(register_a, cycles): n})``. Pairs
    across a branch or barrier are not counted. On sm_90a an HGMMA whose descriptor a uniform instruction just wrote
    waits ~8 cycles for it (v5's QK, stop 37: 10 cycles apart, against 3 with descriptors ready in registers of
    their own)."""
    gaps: collections.Counter = collections.Counter()
    cycles = None
    for _, op, args, stall in _loop_body(sass, loop):
        if op.startswith("HGMMA"):
            if cycles is not None:
                gaps[(bool(re.search(r"R\d+, R\d+, gdesc", args)), cycles)] += 1
            cycles = 0
        elif op.startswith(("BRA", "BAR", "WARPSYNC")):
            cycles = None
        if cycles is not None and stall is not None:
            cycles += stall
    return gaps


def load_positions(sass: str, loop: LoopReport) -> list[int]:
    """For each global load (LDG) of ``loop``, in order, how many of the loop's HGMMAs come before it: where ptxas
    placed the loads among the matmuls (stop 37: reloads written after QK's second chunk were sunk to its last
    quarter)."""
    seen, where = 0, []
    for _, op, _, _ in _loop_body(sass, loop):
        if op.startswith("HGMMA"):
            seen += 1
        elif op.startswith("LDG"):
            where.append(seen)
    return where


def prologue_loads_and_stores(sass: str) -> str:
    """The global loads ("L": LDG) and shared stores ("S": STS) a kernel issues before its first barrier, in order.
    A prologue that stages data loaded from memory reads "LL...LSS...S" when every load goes out before the first
    store; "LSLS..." is a chain of round trips, each store waiting for its load (stop 38: v6's query copy, 6-8 us of
    a short CTA's time on the H200)."""
    seq = []
    for _, op, _, _ in _instructions(sass):
        if op.startswith("BAR.SYNC"):
            break
        if op.startswith("LDG.") or op.startswith("STS"):
            seq.append("L" if op.startswith("LDG.") else "S")
    return "".join(seq)


def tile_loop(fmt: PackFormat, pure_path: bool = True, lazy_rescale: bool = False, tile: int = 32) -> LoopReport:
    """The tile loop of ``qmla_attn_v2`` (the largest loop) for ``fmt`` with ``tile``-token tiles."""
    return loops(compile_sass(fmt, pure_path, lazy_rescale=lazy_rescale, tile=tile)[0])[0]


def tile_loop_v3(fmt: PackFormat, lazy_rescale: bool = False) -> LoopReport:
    """The 64-token tile loop of ``qmla_attn_v3`` (the largest loop) for ``fmt``."""
    return loops(compile_sass_v3(fmt, lazy_rescale=lazy_rescale)[0])[0]


def tile_loop_v4(fmt: PackFormat, wgmma: bool = True) -> LoopReport:
    """The 64-token tile loop of ``qmla_attn_v4`` (the largest loop) for ``fmt``: every instruction of
    its body, so both the masked and the unmasked softmax path are counted."""
    return loops(compile_sass_v4(fmt, wgmma)[0])[0]


def tile_loop_v5(fmt: PackFormat, workers: int = V5_WORKERS) -> LoopReport:
    """The packed-tile loop of one ``qmla_attn_v5`` worker (the largest loop) for ``fmt``: every
    instruction of its body (masked and unmasked softmax paths, the eager and the skipped rescale)."""
    return tile_loops_v5(fmt, workers)["packed"]


def tile_loops_v5(fmt: PackFormat, workers: int = V5_WORKERS, prot_vec: bool = True,
                  codes_in_place: bool = CODES_IN_PLACE, rope_fold: bool | None = None,
                  zfold: bool | None = None) -> dict[str, LoopReport]:
    """The two tile loops of one ``qmla_attn_v5`` worker, {"packed": ..., "protected": ...}: both hold
    QK's and PV's HGMMA; the packed one dequantizes codes (HADD2 subtracts the zero points), the
    protected one loads bf16 rows (no HADD2)."""
    return v5_loops(compile_sass_v5(fmt, workers, prot_vec, codes_in_place, rope_fold, zfold)[0])


def v5_loops(sass: str) -> dict[str, LoopReport]:
    """The packed and the protected tile loop of a ``qmla_attn_v5`` build's SASS (see ``tile_loops_v5``)."""
    found = [lp for lp in loops(sass) if lp.count("HGMMA")]
    return {"packed": max((lp for lp in found if lp.count("HADD2")), key=lambda lp: lp.total),
            "protected": max((lp for lp in found if not lp.count("HADD2")), key=lambda lp: lp.total)}


def v5_report_workers(fmt: PackFormat) -> list[int]:
    """The worker counts of :data:`V5_WORKER_CHOICES` that v5 builds for ``fmt`` (four only at d_c 256)."""
    return [w for w in V5_WORKER_CHOICES if not v5_build_reasons(fmt, w)]


def main(argv: list[str]) -> None:
    cases = [(argv[0], int(argv[1]), int(argv[2]))] if argv else [("C4R4", 512, 64), ("C2R4", 512, 64)]
    for name, dc, dr in cases:
        fmt = PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
        for pure, lazy, minb, mode, tile in ((True, False, 1, 0, 32), (True, True, 1, 0, 32), (True, False, 3, 0, 32),
                                             (False, False, 1, 0, 32), (False, False, 3, 0, 32), (False, False, 1, 1, 32),
                                             (False, False, 3, 1, 32), (True, False, 1, 0, 64), (False, False, 1, 0, 64)):
            sass, ptxas = compile_sass(fmt, pure, lazy_rescale=lazy, min_blocks=minb, prot_mode=mode, tile=tile)
            regs = re.search(r"Used (\d+) registers", ptxas)
            spills = re.search(r"(\d+) bytes spill stores", ptxas)
            loop = loops(sass)[0]
            top = ", ".join(f"{k} {v}" for k, v in sorted(loop.opcodes.items(), key=lambda kv: -kv[1])[:14])
            path = "pure-tile path" if pure else "whole loop (both specializations)"
            path = "packed-only split kernel (PROTECTED=separate)" if mode == 1 else path
            path += ", lazy rescale (its skip branch included)" if lazy else ""
            path += ", __launch_bounds__(128, 3)" if minb == 3 else ""
            path += ", 64-token tiles" if tile == 64 else ""
            print(f"{name} {dc}/{dr} {path}: {loop.total} instructions per warp per tile ({loop.total * 4 / tile:.0f} "
                  "per token), "
                  f"{loop.count('HMMA')} HMMA, {regs.group(1) if regs else '?'} registers, "
                  f"{spills.group(1) if spills else '?'} B spilled, {loop.count('LDL', 'STL')} local loads/stores in the loop\n    {top}")
        loop, regs, top = _loop_summary(*compile_sass_v3(fmt))
        print(f"{name} {dc}/{dr} kernel v3 (64-token tiles): {loop.total} instructions per warp per tile "
              f"({loop.total * 4 / 64:.0f} per token), {loop.count('HMMA')} HMMA, {regs} registers\n    {top}")
    for name, dc, dr in cases + [("BF16", cases[0][1], cases[0][2])]:
        loop, regs, top = _loop_summary(*compile_sass_v4(PackFormat.parse(name, latent_dim=dc, rope_dim=dr)))
        print(f"{name} {dc}/{dr} kernel v4, wgmma build (64 rows x 64-token tiles, 8 warps): {loop.total} instructions "
              f"per warp per tile, {loop.count('HGMMA')} HGMMA, {regs} registers\n    {top}")
    for name, dc, dr in cases:
        fmt = PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
        builds = [(w, None) for w in v5_report_workers(fmt)]
        if v5_zfold(fmt, zfold=True):  # beside the default, the build with the zero-point fold flipped
            builds.append((V5_WORKERS, not v5_zfold(fmt)))
        for workers, zfold in builds:
            sass, ptxas = compile_sass_v5(fmt, workers, zfold=zfold)
            loop, regs, top = _loop_summary(sass, ptxas)
            spills = re.search(r"(\d+) bytes spill stores", ptxas)
            prot = v5_loops(sass)["protected"]
            gaps = sorted(c for reg_a, c in hgmma_issue_gaps(sass, loop).elements() if reg_a)
            which = "" if zfold is None else f", zero-point fold {'on' if zfold else 'off'}"
            print(f"{name} {dc}/{dr} kernel v5, {workers} workers{which} (16 rows x 64-token tiles, a worker of 4 "
                  "warps): "
                  f"{loop.total} instructions per warp per tile ({loop.total * 4 / 64:.0f} per token), "
                  f"{loop.fixed_wait_cycles} fixed-wait cycles, "
                  f"{loop.count('HGMMA')} HGMMA (QK's {gaps[len(gaps) // 2] if gaps else '?'} cycles apart, median), "
                  f"loads after HGMMA {load_positions(sass, loop)}, {regs} registers, {spills.group(1) if spills else '?'} B spilled, "
                  f"{loop.count('LDL', 'STL')} local loads/stores in the loop; protected tiles {prot.total} "
                  f"instructions per warp per tile\n    {top}")
    for name, dc, dr in cases:
        print(f"{name} {dc}/{dr} kernel v6 (64 rows x 64-token tiles, an attending and a dequantizing warpgroup): "
              + _v6_summary(PackFormat.parse(name, latent_dim=dc, rope_dim=dr)))


def tile_loops_v6(fmt: PackFormat) -> tuple[dict[str, LoopReport], str]:
    """The tile loops of ``qmla_attn_v6`` by role, {"dequantizer": ..., "attender": ..., "protected": ...}, and
    ptxas's register count ("?" if absent). The attender's loop holds QK's HGMMA (the innermost such loop: an
    outer one steps through the segments); the dequantizer's only its half of PV (the largest such loop: the
    packed tiles); "protected": the dequantizer's loop that copies protected tiles (cp.async, LDGSTS)."""
    sass, ptxas = compile_sass_v6(fmt)
    regs = re.search(r"Used (\d+) registers", ptxas)
    found = loops(sass)
    by_role = {
        "attender": min((lp for lp in found if lp.count("HGMMA") > 8), key=lambda lp: lp.total),
        "dequantizer": max((lp for lp in found if 0 < lp.count("HGMMA") <= 8 and not lp.count("LDGSTS")),
                           key=lambda lp: lp.total),
        "protected": max((lp for lp in found if lp.count("LDGSTS")), key=lambda lp: lp.total),
    }
    return by_role, regs.group(1) if regs else "?"


def _v6_summary(fmt: PackFormat) -> str:
    """The two tile loops of ``qmla_attn_v6`` (the dequantizer's and the attender's, per warp and tile)."""
    by_role, regs = tile_loops_v6(fmt)
    text = []
    for role, loop in by_role.items():
        top = ", ".join(f"{k} {v}" for k, v in sorted(loop.opcodes.items(), key=lambda kv: -kv[1])[:12])
        text.append(f"    {role}: {loop.total} instructions per warp per tile, {loop.fixed_wait_cycles} fixed-wait cycles, "
                    f"{loop.count('HGMMA')} HGMMA: {top}")
    return f"{regs} registers\n" + "\n".join(text)


def _loop_summary(sass: str, ptxas: str) -> tuple[LoopReport, str, str]:
    """The largest loop of a build, its register count as ptxas reported it ("?" if absent) and its 14
    most frequent opcodes as text."""
    regs = re.search(r"Used (\d+) registers", ptxas)
    loop = loops(sass)[0]
    top = ", ".join(f"{k} {v}" for k, v in sorted(loop.opcodes.items(), key=lambda kv: -kv[1])[:14])
    return loop, regs.group(1) if regs else "?", top


if __name__ == "__main__":
    main(sys.argv[1:])
