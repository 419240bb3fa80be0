"""A ``torch.compile``d model trained by both optimizer forms, and the MPI job of tests/test_compile.py.

``mpiexec -n N python tests/compile_job.py`` runs every case of ``CASES`` on every rank; rank 0 ends
with ``COMPILE CHECKS PASSED``. tests/test_compile.py runs the same ``compare_body`` on LocalBackend.

Each case trains the same model twice on the same per-rank batches, eagerly and through
``torch.compile(model)`` (the default backend, inductor), with ``dml.DistributedOptimizer``
(``shard_state`` and ``overlap`` as the case says), and checks that:

- the compiled run's parameters equal the eager run's within ``RTOL``/``ATOL`` (inductor fuses
  and reorders the float32 arithmetic, so the last bits may differ), and are bitwise identical
  on every rank;
- with ``whole_step``, the compiled function runs forward, the loss and ``backward()`` (the library's
  hooks are excluded from tracing, ``torch.compiler.disable``; Dynamo breaks the graph at backward);
- nothing is compiled again after the first step: ``counters["stats"]["unique_graphs"]``, which
  Dynamo increments each time it hands a captured graph to the backend, first compilation or
  recompilation, for any backend, is the same after the last step as after the first (read
  after a barrier, so every rank's first step is done); and there is no graph break.

The caller runs ``torch._dynamo.reset()`` before each case (outside the ranks' threads on
LocalBackend), so every case compiles afresh.
"""

from __future__ import annotations

import faulthandler
import signal
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

import distutils_ml as dml

STEPS = 5
#: Compiled against eager after STEPS steps of AdamW (measured: at most about 1e-7).
RTOL, ATOL = 1e-5, 1e-6
#: Small buckets: every model below has several, sent in order while (overlap) or after backward runs.
BUCKET_BYTES = 1024


@dataclass(frozen=True)
class Case:
    model: str  # "mlp" or "residual"
    shard_state: bool
    overlap: bool
    whole_step: bool = False  # compile the function that runs forward, loss and backward(), not only the model


CASES = [
    Case("mlp", shard_state=False, overlap=False),
    Case("mlp", shard_state=True, overlap=True),
    Case("residual", shard_state=False, overlap=True),
    Case("residual", shard_state=True, overlap=False),
    Case("mlp", shard_state=False, overlap=True, whole_step=True),
    Case("residual", shard_state=True, overlap=True, whole_step=True),
]


class Residual(nn.Module):
    """A residual block between two layers: LayerNorm, GELU, a dropout with p=0 and an add."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 32)
        self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(), nn.Dropout(p=0.0))
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.block(h))


def make_model(name: str) -> nn.Module:
    """The case's model, with the same parameters on every rank and in every run (no global RNG: the
    ranks of LocalBackend are threads)."""
    if name == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
    else:
        model = Residual()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def train(backend: dml.Backend, case: Case, compiled: bool) -> tuple[list[torch.Tensor], list[int]]:
    """STEPS steps on this rank's batches; the parameters, and the graph count before, after the first
    step and at the end."""
    model = make_model(case.model)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = dml.DistributedOptimizer(
        backend, adamw, bucket_bytes=BUCKET_BYTES, overlap=case.overlap, shard_state=case.shard_state
    )
    forward = torch.compile(model) if compiled and not case.whole_step else model

    def backward(x: torch.Tensor, y: torch.Tensor) -> None:
        nn.functional.mse_loss(forward(x), y).backward()

    if compiled and case.whole_step:  # Dynamo breaks the graph at backward(); the library's hooks run eagerly
        backward = torch.compile(backward)
    g = torch.Generator().manual_seed(100 + dml.local_rank(backend))
    counts = []
    for step in range(STEPS):
        if step <= 1:
            dml.barrier(backend)  # every rank's compilation (in the first step) is done, or none has begun
            counts.append(graphs())
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        backward(x, y)
        opt.step()
    dml.barrier(backend)
    counts.append(graphs())
    return [p.detach().clone() for p in model.parameters()], counts


def compare_body(backend: dml.Backend, case: Case) -> dict[str, Any]:
    """The case's checks (the module's docstring); what was compiled and how far the runs are apart."""
    eager, _ = train(backend, case, compiled=False)
    breaks = sum(counters["graph_break"].values())
    compiled, (before, first, last) = train(backend, case, compiled=True)
    assert first > before, f"{case}: nothing was compiled ({before} graphs before the first step, {first} after)"
    assert last == first, f"{case}: compiled again after the first step ({first} graphs after it, {last} after {STEPS})"
    if not case.whole_step:  # a compiled step breaks its graph at backward() (torch's; the count stays bounded)
        assert sum(counters["graph_break"].values()) == breaks, f"{case}: graph breaks {dict(counters['graph_break'])}"
    for p, q in zip(compiled, eager, strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{case}: compiled vs eager: {m}")
    flat = torch.cat([p.reshape(-1) for p in compiled])
    every = dml.allgather(backend, flat, torch.empty(dml.total_workers(backend), flat.numel()))
    assert all(torch.equal(row, flat) for row in every), f"{case}: the ranks' compiled replicas differ"
    worst = max(float((p - q).abs().max()) for p, q in zip(compiled, eager, strict=True))
    return {"graphs": first - before, "max_diff": worst}


def name(case: Case) -> str:
    """The case's name: its check in the MPI job, its test id on LocalBackend."""
    return f"{case.model}-shard{int(case.shard_state)}-overlap{int(case.overlap)}{'-step' if case.whole_step else ''}"


def main() -> None:
    from mpi_main import guarded, run_checks  # here: importing mpi4py.MPI initializes MPI, not in pytest

    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    by_name = {name(case): case for case in CASES}

    def run_check(check: str) -> dict[str, Any]:
        torch._dynamo.reset()  # every case compiles afresh
        return guarded(compare_body, world, by_name[check])

    run_checks(world, list(by_name), "COMPILE CHECKS PASSED", run_check)


if __name__ == "__main__":
    main()
