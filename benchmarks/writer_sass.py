"""Offline SASS count of the writer kernels for sm_90 -- no GPU needed.

Compiles the CuPy writer (``kernels/writer.cu`` with the launcher's defines, bfloat16 input) with
``nvcc``, or the Triton writer at the GPU launch shape (one token per one-warp program) through
Triton's own pipeline, disassembles with ``cuobjdump`` and prints the static instruction count by
opcode. For CuPy it also counts the straight-line path a token takes through the quantizer: from
the start to the protection-buffer test (the first predicated EXIT after the seq id / position
loads), slow-path branches of the divisions included but not the subroutines they call. On the
H200 that path matched Nsight Compute's executed instructions per token within 1 % (672 vs 667
before stop 14's change, 464 vs 461 after; benchmarks/RESULTS.md "Stop 14").

    python benchmarks/writer_sass.py cupy C4R4 [--source OTHER_writer.cu]
    python benchmarks/writer_sass.py triton C4R4 [--source OTHER_writer_kernel.py]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import inspect
import os
import re
import subprocess
import tempfile

from quantmla_core import PackFormat
from quantmla_core.backends.cupy.sass_report import _INSTR, _build_sass, find_tool


_PREDICATED = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+)\s")


def _opcodes(sass: str) -> list[tuple[str, str, str]]:
    """(guard predicate or "", opcode, operands) of every instruction but NOP."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m and m.group(2) != "NOP":
            guard = _PREDICATED.match(line)
            out.append((guard.group(1) if guard else "", m.group(2), m.group(3)))
    return out


def cupy_token_path(ins: list[tuple[str, str, str]]) -> int:
    """Instructions from the start to the first predicated EXIT after six or more global loads."""
    loads = 0
    for n, (pred, op, _) in enumerate(ins, 1):
        loads += op.startswith("LDG")
        if op == "EXIT" and pred and loads >= 6:
            return n
    raise ValueError("no protection-buffer test found: the kernel's structure changed")


def cupy_sass(fmt: PackFormat, source: str | None) -> str:
    from quantmla_core.backends.cupy.writer import writer_defines

    return _build_sass(os.path.abspath(source) if source else "writer.cu", writer_defines(fmt, "bfloat16"))[0]


def triton_sass(fmt: PackFormat, source: str | None) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantmla_core.backends.triton.common import page_layout_constexprs

    if source:
        spec = importlib.util.spec_from_file_location("writer_kernel_under_test", source)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        kernel = mod.write_kernel
    else:
        from quantmla_core.backends.triton.writer_kernel import write_kernel as kernel
    consts = dict(IN_BF16=True, PROT_BF16=True, QUANT=True, DC=fmt.latent_dim, DR=fmt.rope_dim,
                  CBITS=fmt.content_bits, RBITS=fmt.rope_bits, CG=fmt.content_group_size, RG=fmt.rope_group_size,
                  **page_layout_constexprs(fmt), BLOCK_T=1)
    types = dict(latent_ptr="*bf16", rope_ptr="*bf16", slot_ptr="*i64", seq_ptr="*i64", pos_ptr="*i64",
                 lens_ptr="*i64", pages_ptr="*u8", sink_ptr="*bf16", local_ptr="*bf16", stride_latent="i32",
                 stride_rope="i32", N="i32", num_slots="i32", max_seqs="i32", SINK="i32", LOCAL="i32")
    params = list(inspect.signature(kernel.fn).parameters)
    consts = {k: v for k, v in consts.items() if k in params}
    signature = {p: "constexpr" if p in consts else types[p] for p in params}
    constexprs = {(params.index(k),): v for k, v in consts.items()}
    aligned = {(params.index(p),): [["tt.divisibility", 16]] for p in types
               if types[p].startswith("*") or p.startswith("stride")}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([find_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend", choices=("cupy", "triton"))
    ap.add_argument("format", nargs="?", default="C4R4")
    ap.add_argument("--source", default=None, help="another writer.cu / writer_kernel.py to count instead")
    args = ap.parse_args(argv)
    fmt = PackFormat.parse(args.format)
    sass = (cupy_sass if args.backend == "cupy" else triton_sass)(fmt, args.source)
    ins = _opcodes(sass)
    hist = collections.Counter(op for _, op, _ in ins)
    line = f"{args.backend} writer {fmt.name}: {len(ins)} static instructions"
    if args.backend == "cupy":
        line += f", {cupy_token_path(ins)} on a token's straight-line path"
    print(line)
    print("   ", ", ".join(f"{op} {n}" for op, n in hist.most_common(24)))


if __name__ == "__main__":
    main()
