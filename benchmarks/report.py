"""Turn benchmark JSON into the tables and plots of ``benchmarks/RESULTS.md``.

    python -m benchmarks.report --memory M.json --attention A.json --serving S.json
    python -m benchmarks.report --merge-grid NEW.json --into results/h200_bench_grid.json  # then --attention

Each table is written between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` markers
in RESULTS.md (added at the end when absent), so hand-written text around them survives.
Plots go to ``results/*.png`` beside RESULTS.md. Attention results are pytest-benchmark JSON whose
``extra_info`` carries ``impl``, ``format``, ``H``, ``B``, ``L`` (and optionally ``gbps``,
``tflops``); latency is the median.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _machine_line(doc: dict) -> str:
    m = doc.get("machine", {})
    dev = m.get("gpu") or m.get("cpu")
    bits = [f"device: {dev}"]
    for k in ("driver", "torch", "triton", "cupy", "numba", "flashinfer", "transformers"):
        if m.get(k):
            bits.append(f"{k} {m[k]}")
    return "; ".join(bits) + f"; command: `{doc.get('command', '?')}`"


# ---------------------------------------------------------------------------- memory
def memory_section(doc: dict, plots: Path) -> tuple[str, list[Path]]:
    rows = doc["rows"]
    lines = [_machine_line(doc), "", "| L | format | real allocation | memory_bytes() | real / accounted | vs BF16 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['length']:,} | {r['format']} | {_fmt_bytes(r['real_bytes'])} | {_fmt_bytes(r['memory_bytes'])} "
                     f"| {r['agreement']:.5f} | {r['compression_vs_bf16']:.2f}x |")
    return "\n".join(lines), [_plot_memory(rows, plots)]


def _plot_memory(rows: list[dict], plots: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    by = defaultdict(list)
    for r in rows:
        by[r["format"]].append((r["length"], r["real_bytes"] / 2**20))
    for name, pts in by.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache allocation per request per layer (MiB)")
    ax.set_title("Real cache allocation vs context")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    out = plots / "memory.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- attention
def attention_rows(doc: dict) -> list[dict]:
    """One row per timed attention call: impl (backend, "flashinfer" or "torch-bmm"), format,
    H, B, L, µs (``extra_info["device_us"]``, the CUDA-event median, when present; else the
    pytest-benchmark wall-clock median), GB/s and TFLOP/s (from ``params`` and ``extra_info``)."""
    rows = []
    for b in doc.get("benchmarks", []):
        e, p = b.get("extra_info", {}), b.get("params") or {}
        if not {"H", "B", "L"} <= set(e) or e.get("op", "attention") != "attention":
            continue
        name = b.get("name", "")
        impl = e.get("impl") or p.get("backend") or ("flashinfer" if "flashinfer" in name else "torch-bmm" if "torch" in name else name)
        rows.append({"impl": impl, "format": e.get("format") or p.get("fmt") or "BF16", "H": e["H"], "B": e["B"], "L": e["L"],
                     "gbps": e.get("gbps", e.get("GBps")), "tflops": e.get("tflops", e.get("TFLOPs")),
                     "us": e["device_us"] if "device_us" in e else b["stats"]["median"] * 1e6,
                     "wall_us": b["stats"]["median"] * 1e6})
    return rows


def attention_section(doc: dict, plots: Path, baseline: str = "flashinfer") -> tuple[str, list[Path]]:
    rows = attention_rows(doc)
    base = {(r["H"], r["B"], r["L"]): r["us"] for r in rows if r["impl"] == baseline and r["format"] == "BF16"}
    if not base:  # FlashInfer absent: normalise to the library's own BF16 path
        baseline = "library BF16"
        base = {(r["H"], r["B"], r["L"]): r["us"] for r in rows if r["format"] == "BF16" and r["impl"] not in ("flashinfer", "torch-bmm")}
    first = next((b.get("extra_info", {}) for b in doc.get("benchmarks", [])), {})
    lines = [_machine_line({"machine": first, "command": doc.get("command", "pytest benchmarks/test_attention_gpu.py (see text)")}), "",
             f"Latency is the median (CUDA events via `triton.testing.do_bench` where recorded, else wall clock with a sync per call); ratio = latency / {baseline} BF16 latency at the same shape (lower is better).", "",
             "| H | B | L | impl | format | µs | ratio | GB/s | TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["H"], r["B"], r["L"], r["impl"], r["format"])):
        ref = base.get((r["H"], r["B"], r["L"]))
        ratio = f"{r['us'] / ref:.3f}" if ref else "—"
        gbps = f"{r['gbps']:.0f}" if r.get("gbps") is not None else "—"
        tf = f"{r['tflops']:.1f}" if r.get("tflops") is not None else "—"
        lines.append(f"| {r['H']} | {r['B']} | {r['L']:,} | {r['impl']} | {r['format']} | {r['us']:.1f} | {ratio} | {gbps} | {tf} |")
    return "\n".join(lines), _plot_attention(rows, base, baseline, plots)


def _plot_attention(rows: list[dict], base: dict, baseline: str, plots: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outs = []
    for heads in sorted({r["H"] for r in rows}):
        batches = sorted({r["B"] for r in rows if r["H"] == heads})
        fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False)
        for ax, b in zip(axes[0], batches):
            series = defaultdict(list)
            for r in rows:
                key = (r["H"], r["B"], r["L"])
                if r["H"] == heads and r["B"] == b and key in base:
                    series[f"{r['impl']} {r['format']}"].append((r["L"], r["us"] / base[key]))
            for name, pts in sorted(series.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_title(f"H={heads}, B={b}")
            ax.set_xlabel("context length")
            ax.set_ylabel(f"latency / {baseline} BF16")
            ax.grid(True, alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        out = plots / f"attention_H{heads}.png"
        fig.savefig(out, dpi=120)
        plt.close(fig)
        outs.append(out)
    return outs


# ---------------------------------------------------------------------------- serving
def serving_section(doc: dict, plots: Path) -> tuple[str, list[Path]]:
    w = doc["workload"]
    lines = [_machine_line(doc), "",
             f"{w['requests']} requests × ({w['prompt_len']} prompt ±10% + {w['output_len']} output tokens), {w['layers']} layers, "
             f"cache budget {_fmt_bytes(w['budget_bytes'])}, max batch {w['max_batch']}.", "",
             "| format | backend | pages/layer | output tok/s | vs BF16 | preemptions | recomputed tokens | mean batch | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['format']} | {r['backend']} | {r['num_pages']:,} | {r['tokens_per_s']:.1f} | {r['throughput_vs_bf16']:.2f}x "
                     f"| {r['preemptions']} | {r['recomputed_tokens']:,} | {r['mean_running']:.1f} | {r['seconds']:.1f} |")
    if doc.get("repeats"):
        per = {}
        for rows in doc["repeats"]:
            for r in rows:
                if r["format"] != "BF16" and r.get("throughput_vs_bf16") is not None:
                    per.setdefault(r["format"], []).append(f"{r['throughput_vs_bf16']:.2f}x")
        lines += ["", f"{len(doc['repeats'])} whole runs in this process, the formats in turn in each; the table is run "
                  f"{doc['shown_repeat'] + 1} (the median C4R4 ratio). Ratio to BF16 of the same run, per run: "
                  + "; ".join(f"{name} {', '.join(v)}" for name, v in per.items()) + "."]
    return "\n".join(lines), [_plot_serving(doc["rows"], plots)]


def _plot_serving(rows: list[dict], plots: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    names = [r["format"] for r in rows]
    vals = [r["tokens_per_s"] for r in rows]
    bars = ax.bar(names, vals, color=["#888", "#2a7", "#27a", "#a72"][: len(rows)])
    for bar, r in zip(bars, rows):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['throughput_vs_bf16']:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("whole-job output tokens/s")
    ax.set_title("Serving under one cache budget")
    fig.tight_layout()
    out = plots / "serving.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- RESULTS.md
def merge_grid(base: dict, new: dict) -> dict:
    """``base`` (pytest-benchmark JSON) with every attention row of the head counts that ``new`` times replaced
    by ``new``'s rows: a fresh run of one H's grid (e.g. ``run_h200_report.sh grid16``) into the combined file."""
    heads = {b["extra_info"]["H"] for b in new.get("benchmarks", []) if "H" in b.get("extra_info", {})}
    if not heads:
        raise ValueError("the new grid has no benchmark with extra_info['H']")
    kept = [b for b in base.get("benchmarks", []) if b.get("extra_info", {}).get("H") not in heads]
    return {**base, "benchmarks": kept + list(new["benchmarks"])}


def replace_section(text: str, name: str, body: str) -> str:
    start, end = f"<!-- report:{name} -->", f"<!-- /report:{name} -->"
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text)
    return text.rstrip() + f"\n\n{block}\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", help="JSON from python -m benchmarks.memory --out")
    ap.add_argument("--attention", help="pytest-benchmark JSON (--benchmark-json)")
    ap.add_argument("--serving", help="JSON from python -m benchmarks.serving --out")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--merge-grid", help="pytest-benchmark JSON of one or more H's grids to merge into --into")
    ap.add_argument("--into", help="the combined grid JSON --merge-grid rewrites (its rows of those H replaced)")
    args = ap.parse_args(argv)
    if args.merge_grid:
        if not args.into:
            ap.error("--merge-grid needs --into (the combined grid JSON to rewrite)")
        merged = merge_grid(json.loads(Path(args.into).read_text()), json.loads(Path(args.merge_grid).read_text()))
        Path(args.into).write_text(json.dumps(merged, indent=1) + "\n")
        print(f"merged {args.merge_grid} into {args.into}: {len(merged['benchmarks'])} benchmarks")
    path = Path(args.results)
    plots = path.parent / "results"
    plots.mkdir(exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    for name, src, fn in (("memory", args.memory, memory_section), ("attention", args.attention, attention_section),
                          ("serving", args.serving, serving_section)):
        if src:
            body, made = fn(json.loads(Path(src).read_text()), plots)
            links = "\n".join(f"![{p.stem}](results/{p.name})" for p in made)
            text = replace_section(text, name, body + "\n\n" + links)
            print(f"{name}: table and {len(made)} plot(s) written")
    path.write_text(text)


if __name__ == "__main__":
    main()
