"""The examples run as documented: under the launcher (2 MPI ranks) and on LocalBackend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpirun import TESTS, mpi_env, requires_mpi

ROOT = TESTS.parent


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 240) -> str:
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@requires_mpi
def test_digits_on_two_mpi_ranks(tmp_path) -> None:
    ckpt = tmp_path / "digits.pt"
    launcher = [sys.executable, "-m", "distutils_ml.launch", "launch", "-n", "2"]
    out = run([*launcher, "examples/digits.py", "--checkpoint", str(ckpt)], env=mpi_env())
    acc = float(out.split("final test accuracy ")[1].split(";")[0])
    assert acc >= 0.95, out
    assert out.count("final test accuracy") == 1, "rank 0 alone logs"
    check_checkpoint(ckpt)


def check_checkpoint(path: Path) -> None:
    """The checkpoint loads with weights_only and holds a model that scores as well as reported."""
    state = torch.load(path, weights_only=True)
    assert set(state) >= {"model", "optimizer", "data", "epochs"} and state["epochs"] == 30
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model.load_state_dict(state["model"])
    assert state["optimizer"]["state"], "Adam's moments are saved"
    assert len(state["rng"]) == 2 and all(set(r) >= {"torch", "numpy", "python"} for r in state["rng"])


def test_digits_on_simulated_ranks(tmp_path: Path) -> None:
    ckpt = tmp_path / "digits.pt"
    out = run([sys.executable, "examples/digits.py", "--ranks", "2", "--checkpoint", str(ckpt)], env=dict(os.environ))
    assert float(out.split("final test accuracy ")[1].split()[0]) >= 0.95, out
    assert "on 2 simulated ranks" in out, out
    check_checkpoint(ckpt)


@requires_mpi
def test_quickstart_on_two_mpi_ranks() -> None:
    launcher = [sys.executable, "-m", "distutils_ml.launch", "launch", "-n", "2"]
    out = run([*launcher, "examples/quickstart.py", "--steps", "60"], env=mpi_env())
    assert "[0/2" in out and "[1/2" not in out, out
    assert float(out.split("final loss ")[1].split()[0]) < 0.1, out


@pytest.mark.parametrize("ranks", [1, 3])
def test_quickstart_on_simulated_ranks(ranks: int) -> None:
    env = dict(os.environ)
    out = run([sys.executable, "examples/quickstart.py", "--ranks", str(ranks), "--steps", "60"], env=env)
    assert f"on {ranks} simulated ranks" in out, out
