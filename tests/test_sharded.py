"""The sharded optimizer (``DistributedOptimizer(..., shard_state=True)``): LocalBackend.spawn and mpiexec."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml

from mpirun import Job, assert_checks_passed, requires_mpi, run_mpi
from sharded_bodies import (
    KINDS,
    VARIANTS,
    ClipCase,
    ShardCase,
    bad_input_body,
    checkpoints_equal,
    clip_body,
    clip_cases,
    clip_no_sync_body,
    clip_property_body,
    elementwise_body,
    equivalence_body,
    errors_body,
    every_rank_resumed,
    extras_body,
    fixed_case,
    kinds_body,
    load_body,
    memory_body,
    resume_body,
    save_body,
    shard_cases,
    special_parameters_body,
    state_memory_body,
    state_to_body,
    synchronize_body,
    zero_in_place_body,
)


@settings(max_examples=40, deadline=None)
@given(case=shard_cases(KINDS), world=st.integers(1, 5))
def test_sharded_equals_unsharded(case: ShardCase, world: int) -> None:
    flats = dml.LocalBackend.spawn(world, equivalence_body, case, timeout=60)
    assert all(f == flats[0] for f in flats)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_sgd_momentum_and_adam_equal_unsharded(kind: str, variant: str, world: int) -> None:
    dml.LocalBackend.spawn(world, equivalence_body, fixed_case(kind, **VARIANTS[variant]), timeout=60)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_every_elementwise_optimizer(kind: str, world: int) -> None:
    dml.LocalBackend.spawn(world, kinds_body, kind, timeout=60)


@pytest.mark.parametrize("loader", [True, False], ids=["into_sharded", "into_unsharded"])
@pytest.mark.parametrize("saver", [True, False], ids=["from_sharded", "from_unsharded"])
def test_checkpoint_saved_at_3_resumes_at_2_and_1(tmp_path: object, saver: bool, loader: bool) -> None:
    """op=MAX over the same data on every rank makes the run independent of W bit for bit (resume_body)."""
    uninterrupted = dml.LocalBackend.spawn(1, resume_body, 6, None, timeout=60)[0]
    every_rank_resumed(dml.LocalBackend.spawn(3, resume_body, 6, None, timeout=60), uninterrupted, True)
    path = str(tmp_path / "checkpoint.pt")  # type: ignore[operator]
    dml.LocalBackend.spawn(3, save_body, path, 3, saver, timeout=60)
    for world in (2, 1):
        every_rank_resumed(dml.LocalBackend.spawn(world, load_body, path, 3, loader, timeout=60), uninterrupted, loader)


@pytest.mark.parametrize("saver", [True, False], ids=["from_sharded", "from_unsharded"])
def test_checkpoint_averaged_over_different_data_resumes_at_3_2_and_1(tmp_path: object, saver: bool) -> None:
    """dml.AVG, each rank its own batch, saved at 3 ranks: (a) resumed at 3, bit for bit the uninterrupted 3-rank
    run; (b) at 3, 2 and 1 the state right after loading, consolidated again, is bit for bit the saved one
    (resume_body checks it); (c) resumed at 3, 2 and 1, bit for bit the unsharded optimizer resumed at that size
    from the same checkpoint (LocalBackend adds in rank order for both)."""
    path = str(tmp_path / "checkpoint.pt")  # type: ignore[operator]
    dml.LocalBackend.spawn(3, save_body, path, 3, saver, "avg", timeout=60)
    uninterrupted = dml.LocalBackend.spawn(3, resume_body, 6, None, True, "avg", timeout=60)[0]
    every_rank_resumed(dml.LocalBackend.spawn(3, load_body, path, 3, True, "avg", timeout=60), uninterrupted, True)
    for world in (3, 2, 1):
        unsharded = dml.LocalBackend.spawn(world, load_body, path, 3, False, "avg", timeout=60)
        every_rank_resumed(
            dml.LocalBackend.spawn(world, load_body, path, 3, True, "avg", timeout=60), unsharded[0], True
        )
        if world < 3:  # a run that switched world size differs from the uninterrupted one: nothing to compare
            assert not torch.equal(unsharded[0]["model"]["side.weight"], uninterrupted["model"]["side.weight"])


class _Asked(dml.ShardedOptimizer):
    """Records the ``to`` of every ``state_dict`` call ("none given" when the caller passed none)."""

    asked: list[Any]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.asked.append(kwargs.get("to", args[0] if args else "none given"))
        return super().state_dict(*args, **kwargs)


def _save_live_optimizer(backend: dml.Backend, path: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = _Asked(backend, torch.optim.Adam(model.parameters(), lr=0.1))
    opt.asked = []
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(backend.rank))).pow(2).mean().backward()
        opt.step()
    dml.save(backend, {"opt": opt}, path)  # the optimizer itself: dml.save asks every rank for its state
    assert opt.asked == [0], f"dml.save asked for the state with to={opt.asked}, not to=0 (the rank that writes)"
    return opt.state_dict(to=None)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_dml_save_of_the_sharded_optimizer_itself_writes_its_full_state(tmp_path: object, world: int) -> None:
    """dml.save consolidates the state on rank 0 alone (state_dict(to=0)), the rank that writes it."""
    path = str(tmp_path / "opt.pt")  # type: ignore[operator]
    full = dml.LocalBackend.spawn(world, _save_live_optimizer, path, timeout=60)[0]
    saved = dml.LocalBackend.spawn(1, lambda b: dml.load(b, path), timeout=60)[0]["opt"]
    assert saved["param_groups"] == full["param_groups"]
    assert sorted(saved["state"]) == sorted(full["state"]) == [0, 1]
    for i, entries in full["state"].items():
        for k, v in entries.items():
            assert torch.equal(saved["state"][i][k], v), (i, k)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_state_dict_consolidates_on_one_rank_on_the_cpu(world: int) -> None:
    """state_dict(to): rank `to` alone (None on the others), on the CPU; to=None on every rank; a bad `to` raises
    on every rank before any communication; loading None, or what is no state, raises and changes nothing."""
    seen = dml.LocalBackend.spawn(world, state_to_body, timeout=60)
    assert all(s == seen[0] for s in seen) and len(seen[0]) == (12 if world > 1 else 11), seen


@pytest.mark.parametrize("world", [1, 2, 3])
def test_state_round_trip_of_the_memory_check(world: int) -> None:
    """The GPU job's memory body, on the CPU: the round trip through state_dict() and load_state_dict()."""
    every = dml.LocalBackend.spawn(world, state_memory_body, "cpu", timeout=120)
    assert all(e["full"] == every[0]["full"] for e in every)
    assert sum(e["shard"] for e in every) == every[0]["full"], every  # each element's state on one rank


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_errors_are_raised_on_every_rank(world: int, overlap: bool) -> None:
    seen = dml.LocalBackend.spawn(world, errors_body, overlap, timeout=60)
    assert all(s == seen[0] for s in seen) and len(seen[0]) == (10 if world > 1 else 8), seen


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bad_input_raises_before_communication(world: int) -> None:
    for culprit in range(world):
        dml.LocalBackend.spawn(world, bad_input_body, culprit, timeout=60)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_optimizer_state_per_rank_is_a_wth(world: int) -> None:
    every = dml.LocalBackend.spawn(world, memory_body, (7, 30, 5), timeout=60)
    assert sum(e["owned"] for e in every) == every[0]["total"]


@pytest.mark.parametrize("replace", [False, True], ids=["in_buffer", "grad_replaced"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_clip_grad_norm_from_the_shards(world: int, norm_type: float, replace: bool) -> None:
    norms = dml.LocalBackend.spawn(world, clip_body, norm_type, replace, timeout=60)
    assert all(n == norms[0] for n in norms)


@pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")  # LocalBackend: inf + -inf
@settings(max_examples=60, deadline=None)
@given(case=clip_cases(), world=st.integers(1, 4))
def test_clip_grad_norm_is_torchs_on_the_averaged_gradients(case: ClipCase, world: int) -> None:
    """Norm (NaN, inf, dtype, device), clipped gradients and error_if_nonfinite as torch's clip_grad_norm_ on the
    unsharded optimizer's gradients, for p = 1, 2, inf, 3 and 0.5 with NaN and inf entries."""
    outcomes = dml.LocalBackend.spawn(world, clip_property_body, case, timeout=60)
    assert all(o == outcomes[0] for o in outcomes), outcomes


@pytest.mark.parametrize("world", [1, 2, 3])
def test_clip_grad_norm_inside_no_sync_raises_and_reduces_first_outside(world: int) -> None:
    messages = dml.LocalBackend.spawn(world, clip_no_sync_body, timeout=60)
    assert all(m == messages[0] for m in messages), messages


@pytest.mark.parametrize("how", ["model", "opt"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradients_zeroed_in_place_count_as_cleared(world: int, how: str) -> None:
    seen = dml.LocalBackend.spawn(world, zero_in_place_body, how, timeout=60)
    assert all(s == seen[0] for s in seen) and len(seen[0]) == 3, seen


@pytest.mark.parametrize("world", [1, 2, 3])
def test_only_optimizers_known_to_be_elementwise(world: int) -> None:
    """A LARS-like subclass of SGD is refused (on every rank; before communicating: bad_input_body); the eleven
    torch classes are accepted; a registered elementwise subclass trains as the unsharded optimizer."""
    seen = dml.LocalBackend.spawn(world, elementwise_body, timeout=60)
    assert all(s == seen[0] for s in seen), seen


@pytest.mark.parametrize("step_during_backward", [False, True], ids=["at_step", "during_backward"])
@pytest.mark.parametrize("kind", ["adam", "sgd", "adagrad"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_dtypes_empty_frozen_and_added_parameters(world: int, kind: str, step_during_backward: bool) -> None:
    dml.LocalBackend.spawn(world, special_parameters_body, kind, step_during_backward, timeout=60)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_synchronize_makes_hyperparameters_equal(world: int) -> None:
    dml.LocalBackend.spawn(world, synchronize_body, timeout=60)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sparse_gradients_closures_and_gradients_set_by_hand(world: int) -> None:
    dml.LocalBackend.spawn(world, extras_body, timeout=60)


def test_one_idea_for_users() -> None:
    """shard_state=True gives a ShardedOptimizer (a DistributedOptimizer, a torch Optimizer); False changes nothing."""
    backend = dml.LocalBackend()
    model = torch.nn.Linear(3, 2)
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()), shard_state=True)
    assert type(opt) is dml.ShardedOptimizer
    assert isinstance(opt, dml.DistributedOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert repr(opt).startswith("ShardedOptimizer(op=dml.AVG, optimizer=Adam")
    assert type(dml.DistributedOptimizer(backend, torch.optim.Adam(torch.nn.Linear(2, 2).parameters()))) is (
        dml.DistributedOptimizer
    )
    assert type(dml.ShardedOptimizer(backend, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1))) is (
        dml.ShardedOptimizer
    )
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(opt)
    with pytest.raises(ValueError, match="shard_state"):
        dml.ShardedOptimizer(backend, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1), shard_state=False)

    class Mine(dml.DistributedOptimizer):
        pass

    with pytest.raises(TypeError, match=r"subclass dml\.ShardedOptimizer"):
        Mine(backend, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1), shard_state=True)


SHARDED_CHECKS = [
    *("equivalence", "variants", "kinds", "errors", "bad_input", "memory", "clip", "clip_property", "clip_no_sync"),
    *("zero_in_place", "elementwise", "special", "synchronize", "extras", "state", "state_memory"),
]


# One 3-rank and one 2-rank job hold every check of the tests below that runs over MPI (the gloo job aside), to
# pay MPI's and torch's start-up once per size: first the checkpoints (the 3-rank job saves those the 2-rank job
# resumes), then SHARDED_CHECKS. Each test reads the lines of its own checks ("check NAME passed", per rank).
# The first test to ask runs both jobs: each test that may be the first has the time of both.
JOBS_TIMEOUT = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded-checkpoints")


def _at_3(d: Path) -> list[str]:
    """The 3-rank job's checkpoint checks: saved with MAX (each rank the same data) and with AVG (each rank its own
    batch), the uninterrupted AVG run, and the AVG checkpoint resumed by 3."""
    at3, avg3, whole, same = (d / name for name in ("at3.pt", "avg3.pt", "whole.pt", "same.pt"))
    return [f"save={at3}", f"save={avg3},avg", f"run={whole},6,avg", f"resume={avg3},{same},avg"]


def _at_2(d: Path) -> list[str]:
    """The 2-rank job's: the MAX checkpoint of 3 ranks resumed, and the AVG one resumed sharded and unsharded."""
    at3, avg3, at2, sharded, unsharded = (
        d / name for name in ("at3.pt", "avg3.pt", "at2.pt", "sharded.pt", "unsharded.pt")
    )
    return [f"resume={at3},{at2}", f"resume={avg3},{sharded},avg", f"resume={avg3},{unsharded},avg,unsharded"]


@pytest.fixture(scope="module")
def job_at_3(checkpoints: Path) -> Job:
    return run_mpi(3, ["tests/sharded_job.py", *_at_3(checkpoints), *SHARDED_CHECKS], timeout=280)


@pytest.fixture(scope="module")
def job_at_2(checkpoints: Path, job_at_3: Job) -> Job:
    return run_mpi(2, ["tests/sharded_job.py", *_at_2(checkpoints), *SHARDED_CHECKS], timeout=280)


@requires_mpi
@JOBS_TIMEOUT
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_job_under_mpiexec(ranks: int, request: pytest.FixtureRequest) -> None:
    job = request.getfixturevalue(f"job_at_{ranks}")
    assert_checks_passed(job, SHARDED_CHECKS, ranks)
    assert job.returncode == 0, job.output[-8000:]
    assert "SHARDED CHECKS PASSED: " in job.output and f" on {ranks} ranks" in job.output, job.output[-8000:]


def test_prefetch_is_checked_and_inert_without_gloo() -> None:
    """prefetch=True only with shard_state=True (a bool); without a gloo transport (one host) step() waits as
    before, and training equals prefetch=False's bit for bit."""

    def body(backend: dml.Backend) -> None:
        model = torch.nn.Linear(3, 2)
        with pytest.raises(TypeError, match="prefetch=True: only with shard_state=True"):
            dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), prefetch=True)
        with pytest.raises(TypeError, match="prefetch: got 'yes'"):
            dml.DistributedOptimizer(
                backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True, prefetch="yes"
            )
        models = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
        models[1].load_state_dict(models[0].state_dict())
        opts = [
            dml.DistributedOptimizer(backend, torch.optim.Adam(m.parameters()), shard_state=True, prefetch=flag)
            for m, flag in zip(models, (True, False), strict=True)
        ]
        for step in range(3):
            x = torch.full((2, 3), float(step + backend.rank))
            for m, opt in zip(models, opts, strict=True):
                opt.zero_grad()
                m(x).pow(2).sum().backward()
                opt.step()
            assert opts[0]._arrival_hook is None
        assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True))

    torch.manual_seed(0)
    dml.LocalBackend.spawn(2, body)


@requires_mpi
def test_sharded_job_over_gloo() -> None:
    """Over gloo with overlap, step() steps bucket by bucket while the previous bucket's allgather is on the wire:
    the hypothesis equivalence to the unsharded optimizer and the variants (Adam, schedulers, clipping) still hold;
    with prefetch=True the next forward waits per module for its parameters (slowed allgathers: a forward that
    read a parameter early would change the losses)."""
    checks = ["ring", "errors", "equivalence", "variants", "clip", "prefetch"]
    job = run_mpi(3, ["tests/sharded_job.py", *checks], timeout=180, envs=[{"DML_TRANSPORT": "gloo"}] * 3)
    passed = f"SHARDED CHECKS PASSED: {' '.join(checks)} on 3 ranks"
    assert job.returncode == 0 and passed in job.output, job.output[-8000:]


@requires_mpi
@JOBS_TIMEOUT
def test_checkpoint_of_3_mpi_ranks_resumes_on_2(checkpoints: Path, job_at_3: Job, job_at_2: Job) -> None:
    assert_checks_passed(job_at_3, _at_3(checkpoints)[:1], 3)  # saved at 3
    assert_checks_passed(job_at_2, _at_2(checkpoints)[:1], 2)  # resumed at 2
    uninterrupted = dml.LocalBackend.spawn(1, resume_body, 6, None, timeout=60)[0]
    checkpoints_equal(torch.load(checkpoints / "at2.pt", weights_only=True), uninterrupted)


@requires_mpi
@JOBS_TIMEOUT
def test_checkpoint_averaged_over_3_mpi_ranks(checkpoints: Path, job_at_3: Job, job_at_2: Job) -> None:
    """dml.AVG, each rank its own batch, saved by 3 MPI ranks: (a) resumed by 3, bit for bit the uninterrupted
    3-rank run (the same collectives on the same data); (b) the state right after each load is bit for bit the
    saved one (checked in the jobs); (c) resumed by 2, bit for bit the unsharded optimizer resumed by 2 (two
    numbers add alike in any order)."""
    assert_checks_passed(job_at_3, _at_3(checkpoints)[1:], 3)
    assert_checks_passed(job_at_2, _at_2(checkpoints)[1:], 2)
    same, whole, sharded, unsharded = (
        torch.load(checkpoints / name, weights_only=True)
        for name in ("same.pt", "whole.pt", "sharded.pt", "unsharded.pt")
    )
    checkpoints_equal(same, whole)
    checkpoints_equal(sharded, unsharded)


def test_a_tied_weight_listed_twice_is_named() -> None:
    def body(b: dml.Backend) -> None:
        emb = torch.nn.Embedding(4, 3)
        head = torch.nn.Linear(3, 4, bias=False)
        head.weight = emb.weight
        with pytest.raises(ValueError, match=r"params'\]\[1\] is the same tensor as .*\[0\] \(a tied weight"):
            dml.DistributedOptimizer(b, torch.optim.Adam([emb.weight, head.weight]), shard_state=True)

    dml.LocalBackend.spawn(2, body)
