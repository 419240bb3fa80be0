"""initialize / initialized / get_distributed_backend / local_rank / total_workers."""

from __future__ import annotations

import pytest

import distutils_ml as dml


class FreshBackend(dml.LocalBackend):
    """A backend type no other test initializes."""


def test_get_before_initialize_names_the_call() -> None:
    assert not dml.initialized(FreshBackend)
    with pytest.raises(RuntimeError, match=r"call dml.initialize\(dml.FreshBackend\) first"):
        dml.get_distributed_backend(FreshBackend)


def test_initialize_once_then_cached() -> None:
    class Once(dml.LocalBackend):
        pass

    dml.initialize(Once)
    first = dml.get_distributed_backend(Once)
    dml.initialize(Once)  # no-op
    assert dml.initialized(Once)
    assert dml.get_distributed_backend(Once) is first
    assert isinstance(first, Once)
    assert dml.local_rank(first) == 0
    assert dml.total_workers(first) == 1


@pytest.mark.parametrize("fn", [dml.initialize, dml.initialized, dml.get_distributed_backend])
def test_instance_instead_of_type_is_a_type_error(fn) -> None:
    with pytest.raises(TypeError, match=r"pass the class instead: .*\(dml.LocalBackend\)"):
        fn(dml.LocalBackend())


@pytest.mark.parametrize("bad", [int, "MPIBackend", None])
def test_non_backend_type_is_a_type_error(bad) -> None:
    with pytest.raises(TypeError, match="allowed: a backend class"):
        dml.initialize(bad)


@pytest.mark.parametrize("fn", [dml.local_rank, dml.total_workers])
def test_rank_queries_want_an_instance(fn) -> None:
    with pytest.raises(TypeError, match="the class LocalBackend"):
        fn(dml.LocalBackend)


def test_a_backend_may_initialize_another_while_it_is_built() -> None:
    # NCCLBackend's constructor initializes MPIBackend: initialize must be re-entrant.
    class Inner(dml.LocalBackend):
        pass

    class Outer(dml.LocalBackend):
        def __init__(self) -> None:
            super().__init__()
            dml.initialize(Inner)
            self.inner = dml.get_distributed_backend(Inner)

    dml.initialize(Outer)
    assert dml.initialized(Inner)
    assert dml.get_distributed_backend(Outer).inner is dml.get_distributed_backend(Inner)
