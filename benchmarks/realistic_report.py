"""Tables (and a chart) of the fast-path budget on the realistic state, from the result files of one round of runs.

    python benchmarks/realistic_report.py --single results/A-realistic.json --equal results/B-equal-16mib.json \
        --dcp results/C-dcp-realistic.json --convert results/D-convert-realistic.json --out results/realistic-summary

Every ratio is within one run (the same server, the same minutes): client CPU seconds (``getrusage`` of the client
processes, all threads) and wall seconds, medians over reps, against the raw ceiling measured beside it (one raw PUT
of the same bytes; ranged GETs of the same bytes). A fast path's gain is ``1 - fast / reference`` for the operation
it serves, from the per-rep pairs (median), in CPU and in wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

SINGLE_RAW = {"save": "raw: boto3 put_object (single PUT)", "load": "raw: ranged GETs 16MiBx15 (S3Utils.read_ranges_into)"}
SINGLE_PATHS = {"borrowed_parts": ("save", "async save"), "gil_free_copy": ("save", "async save")}
DCP_PATHS = {
    "borrowed_parts": ("save",),
    "gil_free_copy": ("save",),
    "framing_reuse": ("save",),
    "direct_reads": ("load",),
    "scatter_reads": ("load",),
    "span_reads": ("load",),
}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


# ---- single file ---------------------------------------------------------------------------------------------------


def _single_by(doc: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """scenario -> rep -> run (errors left out)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for run in doc["runs"]:
        if "error" not in run:
            out.setdefault(run["scenario"], {})[run["rep"]] = run
    return out


def _operation(scenario: str) -> str:
    for name in ("async save", "sync save", "load"):
        if f"ours: {name}" in scenario:
            return "save" if name == "sync save" else name
    return "save" if "PUT" in scenario or "upload" in scenario else "load"


def single_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    by = _single_by(doc)
    rows = []
    for scenario, reps in by.items():
        op = _operation(scenario)
        raw = by.get(SINGLE_RAW["load" if op == "load" else "save"], {})
        cpu_ratios = [r["client_cpu_s"] / raw[n]["client_cpu_s"] for n, r in reps.items() if n in raw]
        wall_ratios = [r["wall_s"] / raw[n]["wall_s"] for n, r in reps.items() if n in raw]
        rows.append(
            {
                "path": scenario,
                "operation": op,
                "client_cpu_s": _median([r["client_cpu_s"] for r in reps.values()]),
                "wall_s": _median([r["wall_s"] for r in reps.values()]),
                "cpu_x_raw": _median(cpu_ratios),
                "wall_x_raw": _median(wall_ratios),
                "other_cpu_s": _median([r["other_cpu_s"] for r in reps.values()]),
                "blocked_s": _median([r["blocked_s"] for r in reps.values() if "blocked_s" in r and "async" in scenario]),
                "reps": len(reps),
            }
        )
    return rows


def single_gains(doc: dict[str, Any]) -> list[dict[str, Any]]:
    by = _single_by(doc)
    out = []
    for path, operations in SINGLE_PATHS.items():
        for op in operations:
            fast_name = f"ours: {'sync save' if op == 'save' else op}"
            ref_name = f"{fast_name} @ref={path}"
            if fast_name not in by or ref_name not in by:
                continue
            fast, ref = by[fast_name], by[ref_name]
            reps = sorted(set(fast) & set(ref))
            out.append(
                {
                    "path": path,
                    "operation": f"single-file {op}",
                    "cpu_gain": _median([1 - fast[n]["client_cpu_s"] / ref[n]["client_cpu_s"] for n in reps]),
                    "wall_gain": _median([1 - fast[n]["wall_s"] / ref[n]["wall_s"] for n in reps]),
                    "fast_cpu_s": _median([fast[n]["client_cpu_s"] for n in reps]),
                    "ref_cpu_s": _median([ref[n]["client_cpu_s"] for n in reps]),
                    "reps": len(reps),
                }
            )
    return out


# ---- DCP -----------------------------------------------------------------------------------------------------------


def _dcp_by(doc: dict[str, Any]) -> dict[tuple[str, str], dict[int, dict[str, Any]]]:
    out: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for run in doc["runs"]:
        if "error" not in run:
            out.setdefault((run["method"], run.get("layout", "2d")), {})[run["rep"]] = run
    return out


def dcp_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    by = _dcp_by(doc)
    rows = []
    for (method, layout), reps in by.items():
        raw = by.get(("raw", layout), {})
        for op in ("save", "load"):
            runs = {n: r[op] for n, r in reps.items() if op in r}
            if not runs:
                continue
            rows.append(
                {
                    "path": f"{method} ({layout})",
                    "operation": op,
                    "cpu_s_per_gib": _median([r["cpu_s_per_gib"] for r in runs.values()]),
                    "wall_s": _median([r["wall_s"] for r in runs.values()]),
                    "cpu_x_raw": _median(
                        [r["cpu_s_per_gib"] / raw[n][op]["cpu_s_per_gib"] for n, r in runs.items() if n in raw]
                    ),
                    "wall_x_raw": _median([r["wall_s"] / raw[n][op]["wall_s"] for n, r in runs.items() if n in raw]),
                    "identical": all(r.get("identical", True) for r in runs.values()),
                    "reps": len(runs),
                }
            )
    return rows


def dcp_gains(doc: dict[str, Any]) -> list[dict[str, Any]]:
    by = _dcp_by(doc)
    out = []
    for path, operations in DCP_PATHS.items():
        fast, ref = by.get(("ours", "gpt")), by.get((f"ours@ref={path}", "gpt"))
        if not fast or not ref:
            continue
        reps = sorted(set(fast) & set(ref))
        for op in operations:
            out.append(
                {
                    "path": path,
                    "operation": f"DCP {op}",
                    "cpu_gain": _median(
                        [1 - fast[n][op]["cpu_s_per_gib"] / ref[n][op]["cpu_s_per_gib"] for n in reps]
                    ),
                    "wall_gain": _median([1 - fast[n][op]["wall_s"] / ref[n][op]["wall_s"] for n in reps]),
                    "fast_cpu_s": _median([fast[n][op]["cpu_s_per_gib"] for n in reps]),
                    "ref_cpu_s": _median([ref[n][op]["cpu_s_per_gib"] for n in reps]),
                    "reps": len(reps),
                }
            )
    return out


# ---- convert -------------------------------------------------------------------------------------------------------


def convert_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for run in doc["runs"]:
        if "error" not in run:
            by.setdefault(run["method"], {})[run["rep"]] = run
    raw = by.get("raw", {})
    return [
        {
            "path": method,
            "cpu_s_per_gib": _median([r["cpu_s_per_gib"] for r in reps.values()]),
            "wall_s": _median([r["wall_s"] for r in reps.values()]),
            "cpu_x_raw": _median([r["cpu_s_per_gib"] / raw[n]["cpu_s_per_gib"] for n, r in reps.items() if n in raw]),
            "wall_x_raw": _median([r["wall_s"] / raw[n]["wall_s"] for n, r in reps.items() if n in raw]),
            "reps": len(reps),
        }
        for method, reps in by.items()
    ]


# ---- output --------------------------------------------------------------------------------------------------------


def markdown(summary: dict[str, Any]) -> str:
    lines: list[str] = []
    for key, title in (("single", "Single file, realistic state"), ("equal", "Single file, 32 x 16 MiB float32")):
        rows = summary.get(key)
        if not rows:
            continue
        lines += [
            f"### {title}",
            "",
            "| path | client CPU s | x raw CPU | wall s | x raw wall | other CPU s (contention) | async blocked s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sorted(rows, key=lambda r: (r["operation"] != "save", r["operation"], r["path"])):
            lines.append(
                f"| {r['path']} | {_fmt(r['client_cpu_s'])} | {_fmt(r['cpu_x_raw'])} | {_fmt(r['wall_s'], '{:.1f}')} "
                f"| {_fmt(r['wall_x_raw'])} | {_fmt(r['other_cpu_s'], '{:.1f}')} | {_fmt(r['blocked_s'])} |"
            )
        lines.append("")
    if summary.get("dcp"):
        lines += [
            "### DCP, 2 gloo ranks",
            "",
            "| path (layout) | op | client CPU s/GiB | x raw CPU | wall s | x raw wall | loads identical |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for r in sorted(summary["dcp"], key=lambda r: (r["operation"], r["path"])):
            lines.append(
                f"| {r['path']} | {r['operation']} | {_fmt(r['cpu_s_per_gib'])} | {_fmt(r['cpu_x_raw'])} "
                f"| {_fmt(r['wall_s'], '{:.1f}')} | {_fmt(r['wall_x_raw'])} | {'yes' if r['identical'] else 'NO'} |"
            )
        lines.append("")
    if summary.get("convert"):
        lines += [
            "### Convert (DCP -> one file and back), realistic state",
            "",
            "| path | client CPU s/GiB | x raw CPU | wall s | x raw wall |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in summary["convert"]:
            lines.append(
                f"| {r['path']} | {_fmt(r['cpu_s_per_gib'])} | {_fmt(r['cpu_x_raw'])} | {_fmt(r['wall_s'], '{:.1f}')} "
                f"| {_fmt(r['wall_x_raw'])} |"
            )
        lines.append("")
    if summary.get("gains"):
        lines += [
            "### Each fast path's gain (1 - fast / reference, median of per-rep pairs)",
            "",
            "| fast path | operation | CPU gain | wall gain | CPU fast / reference | reps |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for g in summary["gains"]:
            lines.append(
                f"| {g['path']} | {g['operation']} | {_pct(g['cpu_gain'])} | {_pct(g['wall_gain'])} "
                f"| {_fmt(g['fast_cpu_s'])} / {_fmt(g['ref_cpu_s'])} | {g['reps']} |"
            )
        lines.append("")
    return "\n".join(lines)


def chart(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    gains = summary.get("gains") or []
    if not gains:
        return False
    labels = [f"{g['path']}\n{g['operation']}" for g in gains]
    fig, axis = plt.subplots(figsize=(10, 0.5 + 0.45 * len(gains)))
    ys = range(len(gains))
    axis.barh([y - 0.2 for y in ys], [100 * (g["cpu_gain"] or 0) for g in gains], 0.4, label="client CPU")
    axis.barh([y + 0.2 for y in ys], [100 * (g["wall_gain"] or 0) for g in gains], 0.4, label="wall")
    axis.axvline(5, color="red", linestyle="--", linewidth=1, label="5% budget")
    axis.axvline(-5, color="red", linestyle="--", linewidth=1)
    axis.set_yticks(list(ys), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel("gain over the reference path, % (higher is better)")
    axis.legend(fontsize=8)
    axis.set_title("Fast paths on the realistic state (d=768, 8 layers, 0.9 GiB), SeaweedFS, shared 2-core machine")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single")
    parser.add_argument("--equal")
    parser.add_argument("--dcp")
    parser.add_argument("--convert")
    parser.add_argument("--out", required=True, help="path without suffix: writes .json, .md and .png")
    args = parser.parse_args()
    summary: dict[str, Any] = {"gains": []}
    if args.single:
        doc = json.loads(Path(args.single).read_text())
        summary["single"] = single_rows(doc)
        summary["gains"] += single_gains(doc)
    if args.equal:
        doc = json.loads(Path(args.equal).read_text())
        summary["equal"] = single_rows(doc)
        summary["gains"] += [dict(g, operation=g["operation"] + " (32 x 16 MiB)") for g in single_gains(doc)]
    if args.dcp:
        doc = json.loads(Path(args.dcp).read_text())
        summary["dcp"] = dcp_rows(doc)
        summary["gains"] += dcp_gains(doc)
    if args.convert:
        summary["convert"] = convert_rows(json.loads(Path(args.convert).read_text()))
    summary["sources"] = {k: v for k, v in vars(args).items() if k != "out"}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary)
    out.with_suffix(".md").write_text(text)
    chart(summary, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
