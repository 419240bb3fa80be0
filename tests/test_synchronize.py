"""synchronize on LocalBackend.spawn: every leaf kind, root != 0, mismatches raise on every rank."""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml

import shared
from mpirun import assert_checks_passed, requires_mpi, run_mpi
from sync_job import (
    KeyCase,
    LayoutCase,
    RootOnly,
    custom_keys_body,
    key_cases,
    keys_body,
    late_failure_body,
    layout_cases,
    layouts_body,
    negative_strides_body,
    numpy_keys_body,
    one_rank_layout_body,
    unpicklable_body,
)
from train_bodies import Holder, Pair, make_model, sync_cases, synchronize_body


@settings(max_examples=25, deadline=None)
@given(case=sync_cases(), world=st.integers(1, 4))
def test_every_leaf_kind_ends_as_roots(case: tuple[int, int], world: int) -> None:
    dml.LocalBackend.spawn(world, synchronize_body, case, timeout=60)


def test_one_broadcast_per_dtype() -> None:
    calls: list[tuple] = []

    def fn(b: dml.Backend) -> None:
        original = b._bcast

        def counting(buf: np.ndarray, root: int) -> None:
            if b.rank == 0:
                calls.append((buf.dtype, buf.size))
            original(buf, root)

        b._bcast = counting  # type: ignore[method-assign]
        model = make_model(b.rank)  # float32 weights + BatchNorm's int64 counter
        dml.synchronize(b, {"m": model, "x": torch.zeros(3, dtype=torch.float64)})

    dml.LocalBackend.spawn(2, fn)
    assert sorted(str(d) for d, _ in calls) == ["float32", "float64", "int64"]


def test_structure_mismatch_raises_on_every_rank_before_sending() -> None:
    def fn(b: dml.Backend) -> str:
        x = {"w": torch.zeros(3 if b.rank != 1 else 4)}
        try:
            dml.synchronize(b, x)
        except ValueError as e:
            msg = str(e)
        else:
            msg = "no error"
        buf = np.ones(2)
        dml.allreduce(b, buf, dml.SUM)  # the world is still usable
        assert (buf == b.size).all()
        return msg

    msgs = dml.LocalBackend.spawn(3, fn, timeout=30)
    assert all("rank(s) [1] hold a structure that differs from root 0's" in m for m in msgs), msgs
    assert "x['w'] is an array of shape (4,), dtype float32 on cpu, root's is an array of shape (3,)" in msgs[1]


def test_unpicklable_root_value_raises_everywhere() -> None:
    def fn(b: dml.Backend) -> str:
        try:
            dml.synchronize(b, {"f": (lambda: 0) if b.rank == 0 else None})
        except TypeError as e:
            return str(e)
        return "no error"

    msgs = dml.LocalBackend.spawn(2, fn, timeout=30)
    assert all("cannot be pickled" in m for m in msgs), msgs


def test_bad_arguments() -> None:
    b = dml.LocalBackend()
    with pytest.raises(ValueError, match="root: got 1"):
        dml.synchronize(b, torch.zeros(1), root=1)
    with pytest.raises(TypeError, match="first argument must be a backend"):
        dml.synchronize(torch.zeros(1), b)


# -- structure mismatches: every rank raises, before any array is sent --------------------


@dataclasses.dataclass
class OtherHolder:
    """The same fields as ``Holder``, another type."""

    array: np.ndarray
    label: str


def mismatch_messages(world: int, make: Callable[[int], Any], root: int = 0) -> list[str]:
    """Run ``synchronize(make(rank))`` on ``world`` ranks; return every rank's ValueError message.

    Asserts that no array was broadcast and that a collective right after works.
    """

    def fn(b: dml.Backend) -> str:
        sent: list[int] = []
        original = b._bcast

        def counting(buf: np.ndarray, r: int) -> None:
            sent.append(buf.size)
            original(buf, r)

        b._bcast = counting  # type: ignore[method-assign]
        try:
            dml.synchronize(b, make(b.rank), root=root)
        except ValueError as e:
            msg = str(e)
        else:
            msg = "no error"
        assert sent == [], f"rank {b.rank} broadcast arrays before failing: {sent}"
        buf = np.ones(2)
        dml.allreduce(b, buf, dml.SUM)  # the world is still usable
        assert (buf == b.size).all()
        return msg

    return dml.LocalBackend.spawn(world, fn, timeout=30, stall_timeout=10)


def _last_differs(world: int, same: Callable[[int], Any], other: Callable[[int], Any]) -> Callable[[int], Any]:
    return lambda rank: other(rank) if rank == world - 1 else same(rank)


def _t(rank: int) -> torch.Tensor:
    return torch.full((2,), float(rank))


STRUCTURE_CASES = {
    "dict keys": (
        lambda r: {"a": _t(r), "b": r},
        lambda r: {"a": _t(r), "c": r},
        "x is a dict with keys ['a', 'c'], root's is a dict with keys ['a', 'b']",
    ),
    "list vs tuple": (
        lambda r: {"v": [_t(r), r]},
        lambda r: {"v": (_t(r), r)},
        "x['v'] is a tuple of length 2, root's is a list of length 2",
    ),
    "lengths": (
        lambda r: [_t(r), r],
        lambda r: [_t(r), r, r],
        "x is a list of length 3, root's is a list of length 2",
    ),
    "namedtuple vs tuple": (
        lambda r: {"p": Pair(_t(r), r)},
        lambda r: {"p": (_t(r), r)},
        "x['p'] is a tuple of length 2, root's is a Pair of length 2",
    ),
    "dataclass types": (
        lambda r: Holder(np.zeros(2) + r, "h"),
        lambda r: OtherHolder(np.zeros(2) + r, "h"),
        "x is an OtherHolder with fields ['array', 'label'], root's is a Holder with fields ['array', 'label']",
    ),
    "array vs plain value": (
        lambda r: {"a": _t(r), "b": None},
        lambda r: {"a": _t(r), "b": _t(r)},
        "x['b'] is an array of shape (2,), dtype float32 on cpu, root's is a plain value",
    ),
    "module parameters": (
        make_model,
        lambda r: make_model(r, bn=False),
        "x is a Sequential (torch.nn.modules.container.Sequential) with 4 parameters and buffers",
    ),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(STRUCTURE_CASES))
def test_structure_difference_raises_on_every_rank(case: str, world: int) -> None:
    same, other, detail = STRUCTURE_CASES[case]
    msgs = mismatch_messages(world, _last_differs(world, same, other))
    bad = f"rank(s) [{world - 1}] hold a structure that differs from root 0's"
    assert all(bad in m for m in msgs), msgs
    assert detail in msgs[-1], msgs[-1]


@pytest.mark.parametrize("world", [2, 3])
def test_structure_difference_on_root_other_than_0(world: int) -> None:
    # Rank 0 differs from root 1: rank 0 names the difference, every rank raises.
    msgs = mismatch_messages(world, lambda r: {"a": _t(r), "b": r} if r else {"a": _t(r), "c": r}, root=1)
    assert all("rank(s) [0] hold a structure that differs from root 1's" in m for m in msgs), msgs
    assert "x is a dict with keys ['a', 'c'], root's is a dict with keys ['a', 'b']" in msgs[0]


def _adam(rank: int, drop: int = 0, step: bool = False) -> torch.optim.Optimizer:
    model = make_model(rank, bn=False)
    params = list(model.parameters())
    opt = torch.optim.Adam(params[: len(params) - drop], lr=0.1)
    if step:
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    return opt


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("where", "root"), [("non-root has fewer", 0), ("root has fewer", 0), ("root 1", 1)])
def test_optimizer_parameter_count_difference_raises_on_every_rank(world: int, where: str, root: int) -> None:
    # root's state exists (it has stepped), so without the check other ranks would create entries for it
    def make(rank: int) -> torch.optim.Optimizer:
        fewer = (rank == root) == (where == "root has fewer")
        return _adam(rank, drop=1 if fewer else 0, step=rank == root)

    msgs = mismatch_messages(world, make, root=root)
    bad = [r for r in range(world) if r != root]
    assert all(f"rank(s) {bad} hold a structure that differs from root {root}'s" in m for m in msgs), msgs
    for r in bad:
        assert "optimizer 0 has" in msgs[r] and "parameters, root's has" in msgs[r], msgs[r]


def test_optimizer_group_sizes_are_compared() -> None:
    def make(rank: int) -> torch.optim.Optimizer:
        params = list(make_model(rank, bn=False).parameters())
        split = 1 if rank == 0 else 2
        return torch.optim.SGD([{"params": params[:split]}, {"params": params[split:]}], lr=0.1)

    msgs = mismatch_messages(2, make)
    assert all("rank(s) [1] hold a structure" in m for m in msgs), msgs
    assert "with 4 parameters in groups of [2, 2], root's is a SGD" in msgs[1], msgs[1]
    assert "in groups of [1, 3]" in msgs[1], msgs[1]


def test_failed_synchronize_leaves_optimizer_state_untouched() -> None:
    def fn(b: dml.Backend) -> int:
        opt = _adam(b.rank, step=b.rank == 0)
        with pytest.raises(ValueError, match="differs from root"):
            dml.synchronize(b, {"opt": opt, "x": _t(b.rank) if b.rank else None})
        return len(opt.state)

    assert dml.LocalBackend.spawn(2, fn, timeout=30) == [4, 0]


@pytest.mark.parametrize("world", [2, 3])
def test_dict_key_order_does_not_matter(world: int) -> None:
    def fn(b: dml.Backend) -> None:
        keys = ["w", "b"] if b.rank % 2 else ["b", "w"]
        x = {k: torch.full((i + 1,), float(b.rank)) for i, k in enumerate(sorted(keys))}
        x = {k: x[k] for k in keys}
        out = dml.synchronize(b, x, root=world - 1)
        assert list(out) == keys, "each rank keeps its own key order"
        for k in keys:
            assert out[k] is x[k] and (out[k] == world - 1).all()

    dml.LocalBackend.spawn(world, fn, timeout=30)


@pytest.mark.parametrize(("world", "root"), [(2, 1), (3, 2), (3, 1)])
def test_optimizer_state_only_on_root_other_than_0(world: int, root: int) -> None:
    def fn(b: dml.Backend) -> None:
        opt = _adam(b.rank, step=b.rank == root)
        expected = _adam(root, step=True)
        dml.synchronize(b, opt, root=root)
        assert opt.param_groups[0]["lr"] == 0.1
        for p, q in zip(opt.param_groups[0]["params"], expected.param_groups[0]["params"], strict=True):
            mine, theirs = opt.state[p], expected.state[q]
            assert sorted(mine) == sorted(theirs)
            for k, v in theirs.items():
                assert mine[k].device == v.device and mine[k].dtype == v.dtype and torch.equal(mine[k], v)

    dml.LocalBackend.spawn(world, fn, timeout=30)


def test_created_state_uses_roots_device_not_the_parameters() -> None:
    from distutils_ml.tree import match_state, state_skeleton

    # Adam keeps ``step`` on the CPU next to a CUDA parameter; "meta" stands in for CUDA here.
    def adam_on(device: str) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        p = torch.nn.Parameter(torch.zeros((), device=device))
        return torch.optim.Adam([p]), p

    root_opt, rp = adam_on("meta")
    root_opt.state[rp] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros((), device="meta"), "note": "x"}
    mine, p = adam_on("meta")
    created = match_state(mine, state_skeleton(root_opt), "x")[0]
    assert created["step"].device.type == "cpu" and created["step"].shape == ()
    assert created["exp_avg"].device == p.device
    assert created["note"] is None  # a plain value: root's replaces it
    assert not mine.state, "nothing is installed before every rank agrees"


@pytest.mark.parametrize("steps", [(2, 0), (3, 1), (1, 3)], ids=["rank_without_state", "fewer", "more"])
@pytest.mark.parametrize("world", [2, 3])
def test_lbfgs_state_with_lists_of_tensors_is_roots(world: int, steps: tuple[int, int]) -> None:
    """LBFGS keeps lists of tensors (its history) in its state: a rank without state, or with a history of another
    length, takes root's (it raised that the structures differ), and every rank then steps as root does."""

    def fn(b: dml.Backend) -> list[float]:
        model = torch.nn.Linear(3, 1)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[0.5, -0.25, 1.0]]))
            model.bias.fill_(0.1)
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)
        x = torch.linspace(-1, 1, 24).reshape(8, 3)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = (model(x) - 1).pow(2).sum()
            loss.backward()
            return loss

        for _ in range(steps[0] if b.rank == 0 else steps[1]):
            opt.step(closure)
        dml.synchronize(b, model)
        dml.synchronize(b, opt)
        state = opt.state[model.weight]
        every = dml.allgather_object(b, {k: v for k, v in state.items() if k != "al"})  # al: scratch, root's too
        assert len(every[0]["old_dirs"]) >= 1, "root's history holds tensors"
        for other in every[1:]:
            assert other.keys() == every[0].keys()
            for k, v in other.items():
                ref = every[0][k]
                if isinstance(v, list):
                    assert len(v) == len(ref) and all(torch.equal(a, c) for a, c in zip(v, ref, strict=True)), k
                else:
                    assert torch.equal(v, ref) if isinstance(v, torch.Tensor) else v == ref, k
        opt.step(closure)
        return [*model.weight.detach().reshape(-1).tolist(), *model.bias.detach().tolist()]

    out = dml.LocalBackend.spawn(world, fn, timeout=60)
    assert all(o == out[0] for o in out), out


# -- property: any two structures either round-trip or raise everywhere -----------------


def _shape_trees() -> st.SearchStrategy[Any]:
    """Trees of dict / list / tuple (never empty) with array sizes at the leaves."""
    return st.recursive(
        st.integers(0, 2),
        lambda kids: (
            st.lists(kids, min_size=1, max_size=3)
            | st.lists(kids, min_size=1, max_size=3).map(tuple)
            | st.dictionaries(st.sampled_from("abc"), kids, min_size=1, max_size=3).map(
                lambda d: dict(sorted(d.items()))
            )
        ),
        max_leaves=6,
    )


def _materialize(spec: Any, rank: int) -> Any:
    """Tensors filled with ``rank``; odd ranks build their dicts in reverse key order."""
    if isinstance(spec, dict):
        items = [(k, _materialize(v, rank)) for k, v in spec.items()]
        return dict(reversed(items) if rank % 2 else items)
    if isinstance(spec, (list, tuple)):
        return type(spec)(_materialize(v, rank) for v in spec)
    return torch.full((spec,), float(rank))


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(2, 3),
    root_draw=st.integers(0, 2),
    odd_draw=st.integers(0, 2),
    spec=_shape_trees(),
    other=st.none() | _shape_trees(),
)
def test_any_structure_round_trips_or_raises_everywhere(
    world: int, root_draw: int, odd_draw: int, spec: Any, other: Any
) -> None:
    root, odd = root_draw % world, odd_draw % world
    other = spec if other is None else other
    same = pytree.tree_structure(spec) == pytree.tree_structure(other) and pytree.tree_leaves(
        spec
    ) == pytree.tree_leaves(other)

    def make(rank: int) -> Any:
        return _materialize(other if rank == odd else spec, rank)

    if same:

        def fn(b: dml.Backend) -> None:
            x = make(b.rank)
            out = dml.synchronize(b, x, root=root)
            assert pytree.tree_structure(out) == pytree.tree_structure(x)
            assert all((t == root).all() for t in pytree.tree_leaves(out))

        dml.LocalBackend.spawn(world, fn, timeout=30)
        return
    msgs = mismatch_messages(world, make, root=root)
    bad = [odd] if odd != root else [r for r in range(world) if r != root]
    assert all(f"rank(s) {bad} hold a structure that differs from root {root}'s" in m for m in msgs), msgs
    named = (f"rank {bad[0]}: x" if len(bad) == 1 else f"ranks {bad}: x") if odd != root else "x"
    assert all(named in m for m in msgs), msgs  # every rank names each difference


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_an_unsendable_leaf_on_one_rank_raises_on_every_rank(bad_rank: int) -> None:
    def fn(b: dml.Backend) -> str:
        leaf = torch.zeros(2, dtype=torch.complex64 if b.rank == bad_rank else torch.float32)
        try:
            dml.synchronize(b, {"w": leaf})
        except (TypeError, ValueError) as e:
            message = str(e)
        else:
            message = "no error"
        assert dml.allreduce(b, np.ones(1), dml.SUM)[0] == dml.total_workers(b), "the world stays usable"
        return message

    messages = dml.LocalBackend.spawn(3, fn, timeout=30)
    assert all("complex64" in m or "differs" in m for m in messages), messages


# -- nothing fails on one rank after the agreement (issue 11, item 1) -----------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("body", [negative_strides_body, one_rank_layout_body], ids=lambda f: f.__name__)
def test_a_layout_on_one_rank_changes_nothing(body: Callable[[dml.Backend], None], world: int) -> None:
    dml.LocalBackend.spawn(world, body, timeout=60)


@pytest.mark.parametrize("world", [2, 3])
def test_root_value_another_rank_cannot_unpickle_raises_everywhere(world: int) -> None:
    dml.LocalBackend.spawn(world, unpicklable_body, RootOnly, timeout=60)


def test_a_failure_after_the_agreement_ends_the_world() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 failed after every rank agreed to go on \(RuntimeError: copy_"):
        dml.LocalBackend.spawn(3, late_failure_body, timeout=60)


@settings(max_examples=60, deadline=None)
@given(case=layout_cases(), world=st.integers(1, 3))
def test_any_layout_on_any_rank(case: LayoutCase, world: int) -> None:
    dml.LocalBackend.spawn(world, layouts_body, case, timeout=60)


def test_broadcasts_depend_only_on_roots_description() -> None:
    # Rank 1's leaves are laid out differently (transposed, strided, reversed); every rank
    # still calls one flat broadcast per dtype, of the same size.
    def fn(b: dml.Backend) -> list[tuple]:
        calls: list[tuple] = []
        original = b._bcast

        def counting(buf: np.ndarray, root: int) -> None:
            calls.append((buf.shape, str(buf.dtype)))
            original(buf, root)

        b._bcast = counting  # type: ignore[method-assign]
        odd = b.rank == 1
        x = {
            "t": torch.zeros(3, 2).t() if odd else torch.zeros(2, 3),
            "a": np.zeros(8)[::2] if odd else np.zeros(4),
            "r": np.zeros(3)[::-1] if odd else np.zeros(3),
            "c": torch.zeros(2, dtype=torch.float64),
        }
        dml.synchronize(b, x)
        return calls

    calls = dml.LocalBackend.spawn(2, fn, timeout=30)
    assert calls[0] == calls[1] == [((9,), "float64"), ((6,), "float32")], calls  # keys sorted: a, c, r, t


def test_failure_names_every_failing_rank() -> None:
    # Ranks 1 and 2 fail for different reasons; every rank raises one message naming both.
    def fn(b: dml.Backend) -> str:
        w = np.zeros(2)
        if b.rank == 1:
            w.flags.writeable = False
        x = {"w": w, "v": torch.zeros(3 if b.rank == 2 else 2)}
        with pytest.raises(ValueError) as info:
            dml.synchronize(b, x)
        return str(info.value)

    messages = dml.LocalBackend.spawn(3, fn, timeout=30)
    assert len(set(messages)) == 1, messages
    assert "rank(s) [1, 2] cannot take part" in messages[0]
    assert "rank 1: ValueError: x['w']: a read-only array cannot receive root's data" in messages[0]
    assert "rank 2: x['v'] is an array of shape (3,), dtype float32 on cpu, root's is" in messages[0], messages[0]


# -- dict keys matched by value (issue 11, item 2) ------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("body", [numpy_keys_body, custom_keys_body], ids=lambda f: f.__name__)
def test_dict_keys(body: Callable[[dml.Backend], None], world: int) -> None:
    dml.LocalBackend.spawn(world, body, timeout=60)


@settings(max_examples=60, deadline=None)
@given(case=key_cases(), world=st.integers(1, 3))
def test_any_key_order_and_spelling(case: KeyCase, world: int) -> None:
    dml.LocalBackend.spawn(world, keys_body, case, timeout=60)


def test_ordered_dict_order_is_part_of_the_structure() -> None:
    def make(rank: int) -> Any:
        keys = ["b", "a"] if rank else ["a", "b"]
        return collections.OrderedDict((k, _t(rank)) for k in keys)

    msgs = mismatch_messages(2, make)
    assert "x is an OrderedDict with keys ['b', 'a'], root's is an OrderedDict with keys ['a', 'b']" in msgs[1]


def test_keys_of_different_types_are_different_keys() -> None:
    # 1, 1.0 and True are one dict key in Python, but ranks holding different ones hold different structures.
    msgs = mismatch_messages(3, lambda r: {[1, 1.0, True][r]: _t(r)})
    assert "rank 1: x is a dict with keys [1.0], root's is a dict with keys [1]" in msgs[0], msgs
    assert "rank 2: x is a dict with keys [True], root's is a dict with keys [1]" in msgs[0], msgs


@pytest.mark.parametrize(
    ("key", "detail"),
    [
        (float("nan"), "a dict key is NaN"),
        (np.float32("nan"), "a dict key is NaN"),
        (1 + 2j, "a key of type builtins.complex"),
        (("a", frozenset()), "a key of type builtins.frozenset"),
    ],
)
def test_keys_that_cannot_be_matched_are_refused(key: Any, detail: str) -> None:
    def fn(b: dml.Backend) -> None:
        with pytest.raises(TypeError, match=re.escape(detail)):
            dml.synchronize(b, {key: torch.zeros(1)})

    dml.LocalBackend.spawn(2, fn, timeout=30)
    dml.synchronize(dml.LocalBackend(), {"plain": {key: 1}})  # keys of a dict without arrays travel with it


# -- real mpiexec jobs: every check above, with 2 and 3 ranks -------------------------------------


def _sync_checks(ranks: int) -> list[str]:
    return ["reproducers", "layouts", "keys", "batchnorm"] + (["ddp_buffers"] if ranks == 2 else [])


SYNC_JOB = shared.register("sync", "sync_job", _sync_checks)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(SYNC_JOB)
def test_synchronize_and_buffers_under_mpiexec(ranks: int) -> None:
    checks = _sync_checks(ranks)
    job = shared.job(ranks, SYNC_JOB)
    assert job.returncode == 0, job.output[-8000:]
    assert f"SYNC CHECKS PASSED: {' '.join(checks)} on {ranks} ranks" in job.output, job.output[-8000:]
    assert_checks_passed(job, checks, ranks)


@requires_mpi
def test_a_failure_after_the_agreement_aborts_the_job() -> None:
    job = run_mpi(3, ["tests/sync_job.py", "late_failure"], timeout=120)
    assert job.returncode != 0, job.output[-8000:]
    assert "synchronize: rank 1 failed after every rank agreed to go on" in job.output, job.output[-8000:]
    assert "not aborted" not in job.output, job.output[-8000:]
    assert job.seconds < 60, job.seconds


@pytest.mark.parametrize("kind", ["masked", "matrix"])
def test_numpy_subclass_leaves_are_synchronized_in_their_data(kind: str) -> None:
    """A masked array's (or np.matrix's) data is made root's, its mask left as it is; alone in its dtype it went
    through the collectives' refusal of subclasses after the ranks had agreed."""

    def body(backend: dml.Backend) -> tuple[list[float], Any]:
        data = np.arange(4.0) + backend.rank
        leaf = np.ma.array(data, mask=[0, 1, 0, 0]) if kind == "masked" else np.asmatrix(data.reshape(2, 2))
        out = dml.synchronize(backend, {"a": leaf})["a"]
        return np.asarray(out).ravel().tolist(), np.ma.getmaskarray(out).tolist() if kind == "masked" else None

    for values, mask in dml.LocalBackend.spawn(2, body, timeout=30):
        assert values == [0.0, 1.0, 2.0, 3.0] and mask in (None, [False, True, False, False])
