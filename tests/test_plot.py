"""benchmarks/plot.py draws PNG files from JSON files in the benchmarks' --json format."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "benchmarks" / "plot.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def allreduce_json() -> dict[str, Any]:
    """What ``benchmarks/allreduce.py --json`` writes (its main()), for 2 sizes and 2 repetitions."""
    results = {}
    for size, raw in ((4096, 3e-6), (1 << 20, 2.5e-4)):
        results[str(size)] = {
            name: {
                "verified": True,
                "inner": 100 if size == 4096 else 1,
                "median_s": raw * f,
                "min_s": raw * f * 0.8,
                "max_s": raw * f * 1.3,
                "busbw_GBps": size / (raw * f) / 1e9,
                "ratio": f,
                "ratio_of_medians": f,
                "diff_us": (f - 1) * raw * 1e6,
                "vs_gloo": f / 400,
                "times_s": [raw * f, raw * f * 1.1],
            }
            for name, f in (("mpi4py_numpy", 1.0), ("dml_torch", 1.4), ("dml_numpy", 1.1), ("gloo", 400.0))
        }
    return {
        "env": {"world_size": 2, "torch": "2.13.0+cpu", "mpi_library": "Open MPI v5.0.11, package: x", "nproc": 2},
        "args": {"sizes": "4K,1M", "reps": 2, "warmup": 3, "threads": 1, "json": "a.json"},
        "ratio_definition": "median over repetitions of t(contender)/t(mpi4py_numpy) in that rep",
        "results": results,
        "targets": [{"target": "dml_numpy within 3 us of raw at 4 KiB", "measured": "+0.30 us", "pass": True}],
        "call_overhead_us": {},
        "foreign_load": {"wall_s": 1.0, "foreign_cpu_s": 0.01, "foreign_share": 0.005},
        "elapsed_s": 2.0,
    }


def ddp_json(serial: bool = False) -> dict[str, Any]:
    """What ``benchmarks/ddp.py --json`` writes (its main()): 2 models, or the --serial reference."""
    names = (
        {"serial_global": 0.8} if serial else {"ideal_local": 0.6, "ddp_gloo": 1.0, "naive_mpi4py": 0.75, "dml": 0.74}
    )
    results = {}
    for model, base in (("mlp2m", 0.024), ("deep36", 0.022)):
        contenders = {}
        for name, f in names.items():
            t = base * f
            contenders[name] = {
                "mode": "serial" if serial else ("local" if name == "ideal_local" else "dp"),
                "note": "",
                "times_s": [t, t * 1.1, t * 0.9],
                "comm_s": [],
                "param_absmax": 0.5,
                "median_s": t,
                "min_s": t * 0.9,
                "max_s": t * 1.1,
                "comm_median_s": None,
                "comm_share": None,
                "vs_base": None if serial else f,
                "vs_base_of_medians": None if serial else f,
                "vs_best_loop": None if serial else f / 0.75,
                "vs_best_loop_of_medians": None if serial else f / 0.75,
            }
        results[model] = {
            "model": model,
            "widths": [784, 1024, 10],
            "nparams": 1863690,
            "ntensors": 6,
            "global_batch": 128,
            "contenders": contenders,
            "best_loop": None if serial else "naive_mpi4py",
            "foreign_load": {"wall_s": 1.0, "foreign_cpu_s": 0.02, "foreign_share": 0.01},
        }
    return {
        "env": {"world_size": 1 if serial else 2, "torch": "2.13.0+cpu", "nproc": 2, "cpu": "AMD EPYC"},
        "args": {
            "models": "mlp2m,deep36",
            "steps": 3,
            "warmup": 1,
            "batch": 64,
            "threads": 2 if serial else 1,
            "opt": "sgd",
            "serial": serial,
            "ranks": 2,
        },
        "ratio_definition": "median over steps of t(contender)/t(reference) within the same step",
        "results": results,
        "targets": [],
        "foreign_load": {"wall_s": 2.0, "foreign_cpu_s": 0.04, "foreign_share": 0.01},
        "elapsed_s": 3.0,
    }


def write(path: Path, data: dict[str, Any]) -> str:
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def plot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PLOT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_importing_plot_does_not_need_matplotlib() -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        f"sys.path.insert(0, {str(PLOT.parent)!r}); import plot; "
        "sizes, series = plot.allreduce_series({'results': {'1024': {'mpi4py_numpy': {'median_s': 1.0}}}}); "
        "assert sizes == [1024] and series['mpi4py_numpy']['median_s'] == [1.0]"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib: pip install matplotlib")
def test_plot_writes_png_files(tmp_path: Path) -> None:
    a = write(tmp_path / "a.json", allreduce_json())
    d = write(tmp_path / "d.json", ddp_json())
    s = write(tmp_path / "s.json", ddp_json(serial=True))
    out = tmp_path / "figures"
    proc = plot("--allreduce", a, "--ddp", d, s, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("allreduce.png", "ddp.png"):
        png = (out / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000, name
    assert sorted(p.name for p in out.iterdir()) == ["allreduce.png", "ddp.png"]


def test_plot_rejects_the_wrong_json(tmp_path: Path) -> None:
    d = write(tmp_path / "d.json", ddp_json())
    proc = plot("--allreduce", d, "--out", str(tmp_path))
    assert proc.returncode != 0
    assert "not of benchmarks/allreduce.py" in proc.stderr
    assert not list(tmp_path.glob("*.png"))
