"""Draw the figures of docs/benchmarks/ from the ``--json`` files of ``allreduce.py`` and ``ddp.py``.

Run from the repository root, after the benchmark runs (matplotlib needed: ``pip install matplotlib``)::

    .venv/bin/python benchmarks/plot.py --allreduce allreduce.json --ddp ddp.json ddp_serial2t.json \\
        --out docs/benchmarks

Writes, into ``--out``:

* ``allreduce.png`` (from ``--allreduce``): left, the median time of one allreduce against the
  message size per contender (log-log; the band is min to max over repetitions); right, the
  ratio ``t/t(mpi4py_numpy)``, the median of the within-repetition ratios as in the script's tables;
* ``ddp.png`` (from ``--ddp``, one or more files, e.g. the 2-rank run and the ``--serial``
  reference): left, the median step time of each contender, one panel per model (whiskers: min
  to max); right, ``t/t(ddp_gloo)``, the median of the within-step ratios (2-rank contenders only:
  a ratio compares contenders of the same run).

Each figure's subtitle names the run it shows (ranks, repetitions or steps, other processes'
load, versions), so an image says what produced it. Either option may be given alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, when run as a script
from common import fmt_bytes

ALLREDUCE_BASE = "mpi4py_numpy"
DDP_BASE = "ddp_gloo"
# Fixed colors, so a contender keeps its color across figures and reruns.
COLORS = {
    "mpi4py_numpy": "#555555",
    "dml_torch": "#1f77b4",
    "dml_numpy": "#ff7f0e",
    "gloo": "#d62728",
    "ideal_local": "#bbbbbb",
    "ddp_gloo": "#d62728",
    "naive_mpi4py": "#2ca02c",
    "gradview_mpi4py_chunk4M": "#9467bd",
    "dml": "#1f77b4",
    "serial_global": "#8c564b",
}
EXTRA_COLORS = ["#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5"]


def color(name: str, order: list[str]) -> str:
    """The contender's fixed color, or one of EXTRA_COLORS for others (``--segments``, ``--dml-buckets``)."""
    if name in COLORS:
        return COLORS[name]
    extra = [n for n in order if n not in COLORS]
    return EXTRA_COLORS[extra.index(name) % len(EXTRA_COLORS)]


def load(path: str, kind: str) -> dict[str, Any]:
    """A benchmark's JSON file, checked to be of ``kind`` (``"allreduce"`` or ``"ddp"``)."""
    with open(path) as f:
        data = json.load(f)
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, dict) or not results:
        raise SystemExit(f"{path}: no 'results' (not a --json file of benchmarks/{kind}.py)")
    is_allreduce = all(key.isdigit() for key in results)
    if is_allreduce != (kind == "allreduce"):
        other = "ddp" if kind == "allreduce" else "allreduce"
        raise SystemExit(f"{path}: this is a --json file of benchmarks/{other}.py, not of benchmarks/{kind}.py")
    return data


def load_share(data: dict[str, Any]) -> str:
    """Other processes' share of the machine during the measurements, as text."""
    share = (data.get("foreign_load") or {}).get("foreign_share")
    return "?" if share is None else f"{100 * share:.0f}%"


def versions(env: dict[str, Any]) -> str:
    """``torch 2.13.0+cpu, Open MPI v5.0.11, 2 x AMD EPYC``, from a run's ``env``."""
    parts = [f"torch {env.get('torch', '?')}"]
    if env.get("mpi_library"):
        parts.append(env["mpi_library"].split(",")[0])
    parts.append(f"{env.get('nproc', '?')} x {env.get('cpu', '?')}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- allreduce
def allreduce_series(data: dict[str, Any]) -> tuple[list[int], dict[str, dict[str, list[float]]]]:
    """Sizes (bytes, ascending) and, per contender, its median/min/max times (s) and ratios per size.

    A contender missing at some size gets NaN there.
    """
    results = data["results"]
    sizes = sorted(int(s) for s in results)
    names: list[str] = []
    for s in sizes:
        names += [n for n in results[str(s)] if n not in names]
    nan = float("nan")
    series: dict[str, dict[str, list[float]]] = {}
    for name in names:
        rows = [results[str(s)].get(name) for s in sizes]
        series[name] = {
            key: [r[key] if r is not None and r.get(key) is not None else nan for r in rows]
            for key in ("median_s", "min_s", "max_s", "ratio")
        }
    return sizes, series


def allreduce_title(data: dict[str, Any]) -> str:
    """The subtitle: what run the figure shows."""
    env, args = data.get("env", {}), data.get("args", {})
    return (
        f"{env.get('world_size', '?')} ranks, float32 SUM in place, {args.get('reps', '?')} repetitions per size; "
        f"other processes' load {load_share(data)}; {versions(env)}"
    )


def plot_allreduce(plt: Any, data: dict[str, Any], path: Path, dpi: int) -> None:
    """``allreduce.png``: time per op and ratio to raw mpi4py against message size."""
    sizes, series = allreduce_series(data)
    order = list(series)
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
    for name, s in series.items():
        c = color(name, order)
        width = 2.2 if name.startswith("dml") else 1.4
        ax_t.plot(sizes, [t * 1e6 for t in s["median_s"]], "o-", color=c, lw=width, ms=4, label=name)
        ax_t.fill_between(sizes, [t * 1e6 for t in s["min_s"]], [t * 1e6 for t in s["max_s"]], color=c, alpha=0.12)
        if name != ALLREDUCE_BASE:
            ax_r.plot(sizes, s["ratio"], "o-", color=c, lw=width, ms=4, label=name)
    ax_r.axhline(1.0, color=COLORS[ALLREDUCE_BASE], lw=1.2, ls="--", label=f"{ALLREDUCE_BASE} (= 1)")
    for ax in (ax_t, ax_r):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [fmt_bytes(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("message size")
        ax.grid(True, which="major", alpha=0.3)
    ratios = [r for n, s in series.items() if n != ALLREDUCE_BASE for r in s["ratio"] if math.isfinite(r) and r > 0]
    low, high = min([*ratios, 1.0]) / 1.5, max([*ratios, 1.0]) * 1.5
    ticks = [t for t in (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 100, 300, 1000, 3000, 10000) if low <= t <= high]
    ax_r.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax_t.set_ylabel("median time per allreduce (µs)")
    ax_t.set_title("time per op (band: min to max)")
    ax_r.set_ylabel(f"t / t({ALLREDUCE_BASE}), lower is better")
    ax_r.set_title("ratio to raw mpi4py (median of per-repetition ratios)")
    ax_t.legend(fontsize=8)
    ax_r.legend(fontsize=8)
    fig.suptitle(f"Allreduce: distutils_ml vs raw mpi4py vs gloo\n{allreduce_title(data)}", fontsize=10)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)


# ----------------------------------------------------------------------------- ddp
def ddp_series(runs: list[dict[str, Any]]) -> tuple[list[str], dict[str, dict[str, dict[str, Any]]]]:
    """Models in order of appearance and, per contender label, per model: the contender's results.

    Contenders of later files that repeat an earlier name are labelled ``name (run k)``; the
    ``--serial`` reference is labelled with its thread count.
    """
    models: list[str] = []
    series: dict[str, dict[str, dict[str, Any]]] = {}
    first_run: dict[str, int] = {}  # label -> the run that introduced it
    for k, data in enumerate(runs, start=1):
        args = data.get("args", {})
        for model, res in data["results"].items():
            if model not in models:
                models.append(model)
            for name, r in res["contenders"].items():
                label = name
                if name == "serial_global":
                    label = f"serial_global (1 process, {args.get('threads', '?')} threads)"
                if first_run.setdefault(label, k) != k:
                    label = f"{label} (run {k})"
                series.setdefault(label, {})[model] = r
    return models, series


def ddp_title(runs: list[dict[str, Any]]) -> str:
    """The subtitle: what runs the figure shows."""
    lines = []
    for data in runs:
        env, args = data.get("env", {}), data.get("args", {})
        if args.get("serial"):
            threads, batch = args.get("threads", "?"), args.get("batch", "?")
            where = f"1 process, {threads} threads, global batch {batch} x {args.get('ranks', '?')}"
        else:
            where = f"{env.get('world_size', '?')} ranks, batch {args.get('batch', '?')}/rank"
        lines.append(
            f"{where}, {args.get('steps', '?')} steps, {args.get('opt', '?')}; "
            f"other processes' load {load_share(data)}; {versions(env)}"
        )
    return "\n".join(lines)


def model_label(runs: list[dict[str, Any]], model: str) -> str:
    """``mlp2m\\n1.86 M params, 6 tensors``."""
    for data in runs:
        res = data["results"].get(model)
        if res is not None and "nparams" in res:
            return f"{model}\n{res['nparams'] / 1e6:.2f} M params, {res['ntensors']} tensors"
    return model


def plot_ddp(plt: Any, runs: list[dict[str, Any]], path: Path, dpi: int) -> None:
    """``ddp.png``: median step time per model (one panel each) and the ratio to DDP for every model."""
    models, series = ddp_series(runs)
    order = [label.partition(" (")[0] for label in series]
    with_ratio = [label for label, per in series.items() if any(r.get("vs_base") is not None for r in per.values())]
    fig = plt.figure(figsize=(12, 5), layout="constrained")
    left, right = fig.subfigures(1, 2, width_ratios=[1.1, 1])
    time_axes = left.subplots(1, len(models), squeeze=False)[0]
    ax_r = right.subplots()

    def style(label: str) -> dict[str, Any]:
        return {
            "color": color(label.partition(" (")[0], order),
            "edgecolor": "black",
            "lw": 0.5,
            "hatch": "//" if label.startswith("dml") else None,
            "label": label,
        }

    # Left: one panel per model (linear ms; models differ 10x or more in step time).
    for ax, model in zip(time_axes, models, strict=True):
        labels = [label for label in series if model in series[label]]
        for i, label in enumerate(labels):
            r = series[label][model]
            ms = r["median_s"] * 1e3
            ax.bar(i, ms, 0.8, **style(label))
            lo, hi = ms - r["min_s"] * 1e3, r["max_s"] * 1e3 - ms
            ax.errorbar(i, ms, yerr=[[lo], [hi]], fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
        ax.set_xticks([])
        ax.set_title(model_label(runs, model), fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    time_axes[0].set_ylabel("median step time (ms)")
    left.suptitle("one training step (whiskers: min to max)", fontsize=11)

    # Right: t/t(ddp_gloo) of the contenders that ran beside DDP, grouped by model.
    nan = float("nan")
    width = 0.8 / max(1, len(with_ratio))
    for i, label in enumerate(with_ratio):
        rows = [series[label].get(m) for m in models]
        xs = [j + (i - (len(with_ratio) - 1) / 2) * width for j in range(len(models))]
        ratio = [r["vs_base"] if r and r.get("vs_base") is not None else nan for r in rows]
        ax_r.bar_label(ax_r.bar(xs, ratio, width, **style(label)), fmt="%.2f", fontsize=7, padding=1)
    ax_r.axhline(1.0, color=COLORS[DDP_BASE], lw=1.2, ls="--")
    ratios = [r["vs_base"] for label in with_ratio for r in series[label].values() if r.get("vs_base") is not None]
    ax_r.set_ylim(0, max([1.0, *ratios]) * 1.15)
    ax_r.set_xticks(range(len(models)), [model_label(runs, m) for m in models], fontsize=8)
    ax_r.set_ylabel(f"t / t({DDP_BASE}), lower is better")
    ax_r.grid(True, axis="y", alpha=0.3)
    ax_r.set_axisbelow(True)
    right.suptitle("ratio to torch DDP over gloo (median of per-step ratios)", fontsize=11)

    handles = {h.get_label(): h for ax in time_axes for h in ax.get_legend_handles_labels()[0]}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(6, len(handles)), fontsize=8)
    fig.suptitle(
        f"Training step: DistributedOptimizer vs torch DDP vs hand-written loops\n{ddp_title(runs)}", fontsize=10
    )
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Parse options, load the JSON files, write the PNG files; print their paths."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allreduce", metavar="JSON", help="a --json file of benchmarks/allreduce.py")
    ap.add_argument(
        "--ddp", metavar="JSON", nargs="+", help="--json files of benchmarks/ddp.py (2-rank run, --serial reference)"
    )
    ap.add_argument("--out", default="docs/benchmarks", help="folder for the PNG files (default docs/benchmarks)")
    ap.add_argument("--dpi", type=int, default=110, help="resolution (default 110)")
    args = ap.parse_args(argv)
    if not args.allreduce and not args.ddp:
        ap.error("give --allreduce and/or --ddp")
    allreduce = load(args.allreduce, "allreduce") if args.allreduce else None
    ddp = [load(p, "ddp") for p in args.ddp or []]

    import matplotlib  # here, so that importing this module does not need matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if allreduce is not None:
        plot_allreduce(plt, allreduce, out / "allreduce.png", args.dpi)
        print(f"wrote {out / 'allreduce.png'}")
    if ddp:
        plot_ddp(plt, ddp, out / "ddp.png", args.dpi)
        print(f"wrote {out / 'ddp.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
