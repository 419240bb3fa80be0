"""The bucket machine's rounds (distutils_ml/buckets.py) under what DDP users do: backward(create_graph=True),
gradient penalties, activation checkpointing with and without reentrant backward, sparse embeddings (reduced as
sparse, SparseAdam, sparse_as_dense); on simulated ranks and
under mpiexec with 2 and 3 ranks, both optimizer forms, overlap on and off (tests/habits_bodies.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.buckets import in_reentrant_backward

import habits_bodies
import shared
from mpirun import requires_mpi

pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_create_graph_accumulates_like_ddp(world: int, overlap: bool) -> None:
    assert dml.LocalBackend.spawn(world, habits_bodies.create_graph_body, overlap, timeout=60) == [3] * world


@settings(max_examples=12, deadline=None)
@given(world=st.integers(1, 3), case=habits_bodies.penalty_cases())
def test_gradient_penalty_matches_one_process(world: int, case: habits_bodies.PenaltyCase) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dml.LocalBackend.spawn(world, habits_bodies.penalty_body, case, timeout=60)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 3), case=habits_bodies.checkpoint_cases())
def test_checkpointed_training_matches_plain(world: int, case: habits_bodies.CheckpointCase) -> None:
    dml.LocalBackend.spawn(world, habits_bodies.checkpoint_body, case, timeout=60)


@pytest.mark.parametrize("form", habits_bodies.FORMS)
@pytest.mark.parametrize("where", ["first", "last", "all"])
def test_every_reentrant_placement_both_forms_and_overlaps(form: str, where: str) -> None:
    for overlap in (False, True):
        case = habits_bodies.CheckpointCase(form, overlap, True, where, None)
        dml.LocalBackend.spawn(2, habits_bodies.checkpoint_body, case, timeout=60)


@pytest.mark.parametrize("form", habits_bodies.FORMS)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_parameter_inside_and_outside_a_reentrant_block(form: str, overlap: bool) -> None:
    got = dml.LocalBackend.spawn(2, habits_bodies.shared_across_body, form, overlap, timeout=60)
    assert got == ["refused" if overlap else "equal"] * 2


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 3), case=habits_bodies.sparse_cases())
def test_sparse_embeddings_train_as_one_process(world: int, case: habits_bodies.SparseCase) -> None:
    dml.LocalBackend.spawn(world, habits_bodies.sparse_embedding_body, case, timeout=60)


def test_reentrant_detection() -> None:
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(in_reentrant_backward())
            return g * 2

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [True] and not in_reentrant_backward()


def test_a_second_backward_after_an_interrupted_one_is_still_refused() -> None:
    """Reentrant backward joins the open round; a new top-level backward after one that raised does not."""

    def body(backend: dml.Backend) -> str:
        model = torch.nn.Linear(3, 1)
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), overlap=False)

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                raise ValueError("boom")

        x = torch.ones(2, 3, requires_grad=True)
        with pytest.raises(ValueError, match="boom"):  # after the parameters' hooks: their round stays open
            model(Boom.apply(x)).sum().backward()
        with pytest.raises(RuntimeError, match="a second backward"):
            model(torch.ones(2, 3)).sum().backward()
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        return "ok"

    assert dml.LocalBackend.spawn(2, body, timeout=60) == ["ok", "ok"]


@pytest.mark.parametrize("replace", [False, True], ids=["in_place", "replaced"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("way", habits_bodies.HOOK_WAYS)
def test_a_users_gradient_hook_runs_before_the_reduction(way: str, overlap: bool, replace: bool) -> None:
    dml.LocalBackend.spawn(2, habits_bodies.user_hook_body, way, overlap, replace, timeout=60)


@pytest.mark.parametrize("op", ["avg", "sum"])
@pytest.mark.parametrize(("first", "second"), habits_bodies.AGAIN)
@pytest.mark.parametrize("world", [2, 3])
def test_a_reduction_created_again_takes_the_parameters_over(world: int, first: str, second: str, op: str) -> None:
    dml.LocalBackend.spawn(world, habits_bodies.created_again_body, first, second, op, timeout=60)


@pytest.mark.parametrize("only_rank_0", [False, True], ids=["everywhere", "on_rank_0"])
@pytest.mark.parametrize("how", ["shape", "dtype"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("way", ["optimizer", "sharded", "sharded_sdb"])
def test_data_replaced_by_another_shape_or_dtype_raises_the_documented_error(
    way: str, overlap: bool, how: str, only_rank_0: bool
) -> None:
    dml.LocalBackend.spawn(2, habits_bodies.changed_data_body, way, overlap, how, only_rank_0, timeout=60)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("way", ["optimizer", "sharded", "reduce_in_backward"])
def test_a_model_converted_or_swapped_after_the_reduction_is_created(way: str, overlap: bool) -> None:
    dml.LocalBackend.spawn(2, habits_bodies.converted_body, way, overlap, timeout=60)


HABITS_JOB = shared.register("habits", "habits_job", timeout=400)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(HABITS_JOB)
def test_habits_under_mpiexec(ranks: int) -> None:
    job = shared.job(ranks, HABITS_JOB)
    assert job.returncode == 0, job.output[-8000:]
    assert "HABITS CHECKS PASSED" in job.output, job.output[-8000:]


# -- the layout: bucket sizes per device -----------------------------------------------------------


def test_default_bucket_sizes_per_device_and_a_given_size_for_every_device() -> None:
    from distutils_ml.buckets import (
        DEFAULT_BUCKET_BYTES,
        DEVICE_BUCKET_BYTES,
        BucketBytes,
        default_bucket_bytes,
    )

    backend = dml.LocalBackend()
    assert default_bucket_bytes(backend, None) == BucketBytes(DEFAULT_BUCKET_BYTES, DEVICE_BUCKET_BYTES)
    assert DEVICE_BUCKET_BYTES == 25 << 20  # DDP's bucket_cap_mb=25
    given = default_bucket_bytes(backend, 1000)
    assert given == BucketBytes(1000, 1000) and repr(given) == "1000"  # messages show what the user wrote
    assert given.on(torch.device("cpu")) == given.on(torch.device("meta")) == 1000
    assert repr(BucketBytes(1, 2)) == "(host 1, GPU 2)"
    for bad in (-1, 1.5, True, "1", BucketBytes(-1, 5), BucketBytes(5, 2.5)):
        with pytest.raises(ValueError, match="bucket_bytes"):
            default_bucket_bytes(backend, bad)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.one_of(st.integers(0, 3000), st.integers(150_000, 700_000)), min_size=1, max_size=24),
    devices=st.lists(st.sampled_from(["cpu", "meta"]), min_size=24, max_size=24),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.float16, torch.float64]), min_size=24, max_size=24),
    host=st.one_of(st.integers(0, 8000), st.integers(1 << 20, 3 << 20)),  # above FIRST_BUCKET_BYTES too
    device=st.one_of(st.integers(0, 8000), st.integers(1 << 20, 3 << 20)),
    sharded=st.booleans(),
    wire=st.sampled_from([None, torch.float16]),
)
def test_each_device_is_cut_by_its_own_size(
    *,
    sizes: list[int],
    devices: list[str],
    dtypes: list[torch.dtype],
    host: int,
    device: int,
    sharded: bool,
    wire: torch.dtype | None,
) -> None:
    # "meta" stands for a GPU: every device that is not the host takes the device size.
    from distutils_ml.buckets import FIRST_BUCKET_BYTES, REDUCER_CUT, SHARDED_CUT, BucketBytes, cut_buckets

    rule = SHARDED_CUT if sharded else REDUCER_CUT
    params = [torch.empty(n, dtype=dtypes[i], device=devices[i]) for i, n in enumerate(sizes)]
    sizes_of = BucketBytes(host, device)
    cut = cut_buckets(params, sizes_of, wire, rule)

    placed = sorted(i for _, _, members in cut for i in members)
    assert placed == [i for i, p in enumerate(params) if rule.keep_empty or p.numel()], "a parameter lost or twice"
    opened: set[tuple[torch.dtype, torch.device]] = set()
    for alone, key, members in cut:
        limit = sizes_of.on(key[1])
        nbytes = [params[i].numel() * (wire or params[i].dtype).itemsize for i in members]
        assert all(params[i].device == key[1] for i in members), "a bucket spans devices"
        assert members == sorted(members, reverse=True), "a bucket's members are not in backward order"
        if alone:
            assert len(members) == 1 and nbytes[0] >= limit and params[members[0]].dtype == key[0]
            continue
        cap = min(limit, FIRST_BUCKET_BYTES) if key not in opened else limit
        opened.add(key)
        assert len(members) == 1 or sum(nbytes[:-1]) < cap, f"bucket {members} went on past its size {cap}"
        assert all(n < limit or params[i].dtype != key[0] for i, n in zip(members, nbytes, strict=True))


def test_a_deep_model_on_a_gpu_makes_few_buckets() -> None:
    # 36 tensors, 18 weights of 288 KiB: on the host each weight goes alone (18 collectives plus the biases);
    # on a GPU (here "meta") they share DDP-sized buckets: the 1 MiB first bucket and one more.
    from distutils_ml.buckets import REDUCER_CUT, cut_buckets, default_bucket_bytes

    sizes = default_bucket_bytes(dml.LocalBackend(), None)
    shapes = [s for _ in range(18) for s in ((256, 288), (256,))]
    host = cut_buckets([torch.empty(s) for s in shapes], sizes, None, REDUCER_CUT)
    gpu = cut_buckets([torch.empty(s, device="meta") for s in shapes], sizes, None, REDUCER_CUT)
    assert sum(alone for alone, _, _ in host) == 18 and len(host) == 19
    assert len(gpu) == 2 and not any(alone for alone, _, _ in gpu)
