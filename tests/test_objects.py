"""Object collectives (distutils_ml/objects.py): the bodies of tests/object_bodies.py on simulated
ranks (W = 1..4) and under real mpiexec with 2 and 3 ranks (tests/core_job.py)."""

from __future__ import annotations

import pytest
import torch

import distutils_ml as dml

import object_bodies
import shared
from mpirun import requires_mpi


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("body", object_bodies.BODIES, ids=lambda b: b.__name__)
def test_object_collectives_on_simulated_ranks(world: int, body) -> None:
    dml.LocalBackend.spawn(world, body, timeout=60)


MODES = ["objects", "threads", "debug"]
OBJECTS_JOB = shared.register("objects", "core_job", lambda ranks: MODES, timeout=180)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(OBJECTS_JOB)
def test_object_collectives_threads_and_debug_under_mpiexec(ranks: int) -> None:
    job = shared.job(ranks, OBJECTS_JOB)
    assert job.returncode == 0, job.output[-8000:]
    assert f"CORE JOB PASSED: {' '.join(MODES)} on {ranks} ranks" in job.output, job.output[-8000:]


def test_tensors_and_arrays_travel_beside_the_pickle_not_in_it() -> None:
    """The pickle of a value holding 4 MiB of tensors and 4 MiB of NumPy arrays is a few hundred bytes: their
    bytes are the parts that travel apart (a view adds nothing; a strided array stays in the pickle)."""
    import warnings

    import numpy as np
    import torch

    from distutils_ml.objects import _pack_apart

    t = torch.ones(1 << 20)
    a = np.ones(1 << 19)
    value = {"t": t, "view": t[10:], "a": a, "f": np.asfortranarray(np.ones((512, 256))), "s": np.arange(8)[::2]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's TypedStorage deprecation warnings, say
        data, cause, parts = _pack_apart(lambda: value)
    assert cause is None
    sizes = sorted(p.nbytes if isinstance(p, memoryview) else p.nbytes() for p in parts)
    assert sizes == [1 << 20, 4 << 20, 4 << 20], sizes
    assert len(data) < 2048, len(data)


def test_small_tensors_travel_in_the_pickles_broadcast_and_big_ones_after_it() -> None:
    """Less than 1 MiB of tensors and arrays in all: one broadcast of bytes and one agreement, as a value without
    any; more: then an agreement that every rank made room, and the parts, each big one in place."""
    import numpy as np
    import torch

    def body(backend: dml.Backend) -> list[list[str]]:
        seen: list[list[str]] = []
        backend.observe(lambda name, original, *args: (seen[-1].append(name), original(*args))[1])
        try:
            for value in ({"t": torch.ones(3), "a": np.ones(3)}, {"big": torch.ones(1 << 19), "t": torch.ones(3)}):
                seen.append([])
                got = dml.bcast_object(backend, value if backend.rank == 0 else None)
                assert all(np.array_equal(np.asarray(got[k]), np.asarray(v)) for k, v in value.items())
        finally:
            backend.observe(None)
        return seen

    small, big = ["_bcast_bytes", "_allgather"], ["_bcast_bytes", "_allgather", "_bcast", "_bcast", "_allgather"]
    for seen in dml.LocalBackend.spawn(2, body):
        assert [[n for n in calls if n != "_check_call"] for calls in seen] == [small, big], seen


def test_an_object_collective_holds_no_reference_to_the_value_once_it_returns() -> None:
    """No reference cycle keeps what was sent alive until the garbage collector runs (a pickler that held itself
    through its buffer callback did: a loop of broadcasts grew by 135 MiB every 10 rounds)."""
    import gc
    import weakref

    import numpy as np
    import torch

    backend = dml.LocalBackend()
    gc.disable()
    try:
        for collective in (dml.bcast_object, dml.allgather_object):
            for size in (8, 1 << 18):  # in the pickle's broadcast, and apart
                value = {"a": np.ones(size), "t": torch.ones(size)}
                refs = [weakref.ref(value["a"]), weakref.ref(value["t"])]
                collective(backend, value)
                del value
                assert [r() for r in refs] == [None, None], (collective.__name__, size)
    finally:
        gc.enable()


def test_storages_over_the_same_memory_arrive_whole_and_shared_as_they_were() -> None:
    """Two storages over one array (``torch.from_numpy`` twice: one storage's bytes, shared on arrival) and over a
    part of it (of a slice: a smaller storage at the same address, which must not stand for the whole)."""
    import numpy as np
    import torch

    a = np.arange(10.0)

    def value() -> list[torch.Tensor]:
        return [torch.from_numpy(a[:5]), torch.from_numpy(a), torch.from_numpy(a)]

    def body(backend: dml.Backend) -> None:
        got = dml.bcast_object(backend, value() if backend.rank == 0 else None)
        for received in (got, dml.allgather_object(backend, value())[1 - backend.rank]):
            assert [t.tolist() for t in received] == [a[:5].tolist(), a.tolist(), a.tolist()], received
            if backend.rank == 1 or received is not got:
                ptrs = [t.untyped_storage().data_ptr() for t in received]
                assert ptrs[1] == ptrs[2] != ptrs[0], ptrs

    dml.LocalBackend.spawn(2, body)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("big", [False, True], ids=["inline", "apart"])
@pytest.mark.parametrize(
    "dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32]
)
def test_tensors_of_dtypes_torch_pickles_as_bare_storages(dtype: torch.dtype, big: bool) -> None:
    """torch pickles tensors of these dtypes with an untyped storage (rebuilt by _rebuild_tensor_v3, which reads
    a typed one's attribute): they arrive on every rank, by bcast_object and allgather_object (ranks >= 1 raised
    that they could not unpickle them)."""
    n = (3 << 20) if big else 5

    def body(b: dml.Backend) -> None:
        mine = torch.arange(n, dtype=torch.float32).add(b.rank).to(dtype)
        got = dml.bcast_object(b, {"t": mine, "view": mine[1:4]} if b.rank == 0 else None)
        want = torch.arange(n, dtype=torch.float32).to(dtype)
        assert got["t"].dtype == dtype and torch.equal(got["t"].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got["view"].view(torch.uint8), want[1:4].view(torch.uint8))
        every = dml.allgather_object(b, mine)
        for r, t in enumerate(every):
            expected = torch.arange(n, dtype=torch.float32).add(r).to(dtype)
            assert t.dtype == dtype and torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), r

    dml.LocalBackend.spawn(2, body, timeout=60)
