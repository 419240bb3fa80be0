"""Bodies of the step-during-backward tests (``DistributedOptimizer(step_during_backward=True)``), run on
LocalBackend by tests/test_stepping.py and under mpiexec by tests/stepping_job.py (over gloo too).

The property: training with ``step_during_backward=True`` ends with parameters and optimizer state bit-identical
to training with it False, on every rank, for random models, optimizers, bucket sizes, overlap, wire dtypes,
parameters that some ranks leave without a gradient, frozen parameters and micro-batches accumulated inside
``no_sync()``, unsharded and sharded (``shard_state=True``); and the buckets are really stepped during backward
(counted where every gradient is final; sharded: every parameter is stepped when backward returns).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

import distutils_ml as dml

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
}


@dataclass(frozen=True)
class StepCase:
    widths: tuple[int, ...]
    kind: str
    bucket_bytes: int
    overlap: bool
    wire: str | None  # communication_dtype
    unused: str  # "odd": odd ranks leave the side layer without a gradient; "all": every rank does; "": none
    frozen: bool  # the first layer's bias takes no gradient
    micro: int  # micro-batches per step, all but the last inside no_sync()
    steps: int
    seed: int
    shard: bool = False  # shard_state=True (both replicas)


@st.composite
def step_cases(draw: st.DrawFn) -> StepCase:
    widths = tuple(draw(st.lists(st.integers(1, 24), min_size=2, max_size=5)))
    return StepCase(
        widths=widths,
        kind=draw(st.sampled_from(sorted(OPTIMIZERS))),
        bucket_bytes=draw(st.sampled_from([0, 64, 512, 4096, 1 << 20])),
        overlap=draw(st.booleans()),
        wire=draw(st.sampled_from([None, None, "bfloat16"])),
        unused=draw(st.sampled_from(["", "odd", "all"])),
        frozen=draw(st.booleans()),
        micro=draw(st.integers(1, 2)),
        steps=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
        shard=draw(st.booleans()),
    )


class Net(torch.nn.Module):
    """An MLP and a side layer that only some ranks use."""

    def __init__(self, widths: tuple[int, ...], seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layer = torch.nn.Linear(a, b)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(b, a, generator=gen) * 0.3)
                layer.bias.copy_(torch.randn(b, generator=gen) * 0.1)
            layers += [layer, torch.nn.Tanh()]
        self.body = torch.nn.Sequential(*layers[:-1]) if len(layers) > 1 else torch.nn.Identity()
        self.side = torch.nn.Linear(widths[0], 1)
        with torch.no_grad():
            self.side.weight.copy_(torch.randn(1, widths[0], generator=gen))
            self.side.bias.zero_()

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        out = self.body(x).sum(1, keepdim=True)
        return out + self.side(x) if side else out


def _optimizer(case: StepCase, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZERS[case.kind](params)


def equivalence_body(backend: dml.Backend, case: StepCase) -> dict[str, Any]:
    """Two replicas trained alike, one with step_during_backward: bit-identical parameters and state."""
    rank = backend.rank
    base = Net(case.widths, case.seed)
    if case.frozen and len(case.widths) > 1:
        base.body[0].bias.requires_grad_(False)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    wire = getattr(torch, case.wire) if case.wire else None
    opts = [
        dml.DistributedOptimizer(
            backend, _optimizer(case, m), bucket_bytes=case.bucket_bytes, overlap=case.overlap,
            communication_dtype=wire, step_during_backward=during, shard_state=case.shard,
        )
        for m, during in zip(models, (False, True), strict=True)
    ]  # fmt: skip
    assert opts[1].step_during_backward and not opts[0].step_during_backward
    side = case.unused == "" or (case.unused == "odd" and rank % 2 == 0)
    stepped_in_backward = 0
    gen = torch.Generator().manual_seed(case.seed ^ (1000003 * (rank + 1)))
    for _ in range(case.steps):
        batches = [torch.randn(3, case.widths[0], generator=gen) for _ in range(case.micro)]
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            for m, x in enumerate(batches):
                quiet = m < case.micro - 1
                with opt.no_sync() if quiet else contextlib.nullcontext():
                    model(x, side).pow(2).mean().backward()
            if opt.step_during_backward and case.shard:
                # Every shard is stepped, and the parameters allgathered, before backward() returns.
                for (name, p), q in zip(models[0].named_parameters(), model.parameters(), strict=True):
                    assert torch.equal(p, q), f"{name}: after backward, differs by {(p - q).abs().max().item()}"
                stepped_in_backward += sum(1 for p in model.parameters() if p.requires_grad)
            elif opt.step_during_backward:
                stepped_in_backward += len(opt._stepper._stepped)
            opt.step()
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
            assert torch.equal(p, q), f"{name}: step_during_backward differs by {(p - q).abs().max().item()}"
    states = [opt.state_dict(to=None) if case.shard else opt.state_dict() for opt in opts]
    states = [state["state"] for state in states]
    assert sorted(states[0]) == sorted(states[1]), (sorted(states[0]), sorted(states[1]))
    for index, a in states[0].items():  # the same state per parameter (created in another order)
        b = states[1][index]
        assert sorted(a) == sorted(b), (index, sorted(a), sorted(b))
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (index, key)
    _agree_across_ranks(backend, models[1], "")
    trained = sum(1 for p in models[1].parameters() if p.requires_grad)
    if case.unused == "" or (case.unused == "odd" and backend.size == 1):
        # Every gradient was final where its bucket landed: every parameter stepped during backward.
        assert stepped_in_backward == case.steps * trained, (stepped_in_backward, case.steps, trained)
    return {"stepped_in_backward": stepped_in_backward}


def errors_body(backend: dml.Backend, what: str, shard: bool = False) -> str:
    """What cannot be exact raises, on every rank alike (unsharded, or ``shard_state=True``)."""
    model = Net((4, 6, 2), 7)
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=64, shard_state=shard,
        step_during_backward=True,
    )  # fmt: skip
    x = torch.ones(2, 4) * (backend.rank + 1)
    scaler = dml.ShardedGradScaler(backend, "cpu", init_scale=4.0) if shard else torch.amp.GradScaler("cpu", 4.0)
    loss = model(x, True).sum()
    (scaler.scale(loss) if what == "scaler" else loss).backward()
    try:
        if what == "clip" and shard:
            opt.clip_grad_norm_(0.01)
        elif what == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
        elif what == "scaler":
            scaler.step(opt)
        elif what == "replaced":
            model.side.weight.grad = torch.zeros_like(model.side.weight)
            opt.step()
        elif what == "in_place":
            model.side.weight.grad.mul_(0.5)
            opt.step()
        elif what == "data_assigned":  # the same .grad object, other values (its version counter unmoved)
            model.side.weight.grad.data = model.side.weight.grad.data * 0.5
            opt.step()
        elif what == "twice":
            if shard:  # cleared by hand, not by zero_grad(), which the sharded buffers ask for first
                for p in model.parameters():
                    p.grad = None
            model(x, True).sum().backward()
        elif what == "closure":
            opt.step(lambda: model(x, True).sum())
        elif what == "lr":
            opt.param_groups[0]["lr"] = 0.5  # after backward: the buckets were stepped with 0.1
            opt.step()
        else:
            raise AssertionError(what)
    except (RuntimeError, TypeError) as e:
        assert "step_during_backward=True" in str(e), e
        if what == "replaced":  # side.weight, by its name (unsharded) or its place (sharded)
            assert "side.weight" in str(e) or "param_groups[0]['params'][4]" in str(e), e
        if what == "twice":
            _refused_after(opt)
        return str(e)
    raise AssertionError(f"{what}: not refused")


def sharded_agreement_body(backend: dml.Backend, setting: str) -> str:
    """Sharded ranks that differ in ``setting`` (``step_during_backward`` moves the allgathers into backward,
    ``prefetch`` reverses their order across hosts: paired across ranks, they would mix buckets) raise at once."""
    model = Net((4, 6, 2), 7)
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True, **{setting: backend.rank == 0}
    )
    try:
        model(torch.ones(2, 4), True).sum().backward()
    except ValueError as e:
        assert f"{setting}=True" in str(e) and "configured differently" in str(e), e
        opt.zero_grad()
        return str(e)
    raise AssertionError(f"ranks with and without {setting} were not refused")


def _refused_after(opt: dml.DistributedOptimizer, says: str = "step_during_backward=True", after: str = "") -> None:
    """``step()`` refuses (after a refused second backward it would step the stray gradients again)."""
    try:
        opt.step()
    except RuntimeError as e:
        assert says in str(e), e
    else:
        raise AssertionError(f"step() after {after or 'a refused second backward'} stepped")


def _agree_across_ranks(backend: dml.Backend, model: torch.nn.Module, when: str) -> None:
    """Every rank holds the same parameters."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = dml.allgather_object(backend, flat.tolist())
    assert all(r == every[0] for r in every), f"replicas differ across ranks{when}"


def _replicas(
    backend: dml.Backend, model: torch.nn.Module, shard: bool, overlap: bool, bucket_bytes: int = 0, **kw: Any
) -> list[Any]:
    """(model, optimizer) twice, the second with step_during_backward."""
    out = []
    for during in (False, True):
        m = copy.deepcopy(model)
        opt = dml.DistributedOptimizer(
            backend, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
            bucket_bytes=bucket_bytes, overlap=overlap, shard_state=shard, step_during_backward=during, **kw,
        )  # fmt: skip
        out.append((m, opt))
    return out


def _same_everywhere(backend: dml.Backend, pairs: list[Any]) -> None:
    (a, _), (b, _) = pairs
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: step_during_backward differs by {(p - q).abs().max().item()}"
    _agree_across_ranks(backend, b, "")


def load_between_body(backend: dml.Backend, shard: bool, overlap: bool, side_everywhere: bool = True) -> str:
    """``load_state_dict()`` between a backward that stepped and ``step()`` would replace the state those steps made
    (silently: the loaded momentum was never used): refused, nothing loaded; ``step()`` then ends the step as if the
    call had not been made, and after it the same state loads. Refused on every rank alike, also where this rank
    stepped nothing (``side_everywhere=False``: rank 0 alone has the side layer's gradient, and all the parameters
    share one bucket, which only rank 0 can step as it lands)."""
    pairs = _replicas(backend, Net((4, 6, 2), 5), shard, overlap, bucket_bytes=0 if side_everywhere else 1 << 20)
    x = torch.ones(2, 4) * (backend.rank + 1)
    side = side_everywhere or backend.rank == 0
    saved = []
    for model, opt in pairs:  # a first step makes momentum buffers to save
        model(x, True).sum().backward()
        opt.step()
        opt.zero_grad()
        saved.append(opt.state_dict(to=None) if shard else opt.state_dict())
    for model, _ in pairs:
        model(x * 2, side).sum().backward()
    opt, message = pairs[1][1], None
    try:
        opt.load_state_dict(saved[1])
    except RuntimeError as e:
        assert "load_state_dict()" in str(e) and "Nothing was loaded" in str(e), e
        message = str(e)
    assert message is not None, "load_state_dict() between a backward that stepped and step(): not refused"
    for _, o in pairs:
        o.step()
    _same_everywhere(backend, pairs)
    for _, o in pairs:  # after step() it loads, in either form
        o.load_state_dict(saved[0])
    return message


def load_while_rescaled_body(backend: dml.Backend) -> None:
    """Unsharded, while the gradients are rescaled (``average_over``, as ``dml.join`` does) no bucket is stepped during
    backward, so ``load_state_dict()`` before ``step()`` loads and ``step()`` steps with the loaded state, as torch's
    optimizer does: the same as without ``step_during_backward``."""
    pairs = _replicas(backend, Net((4, 6, 2), 5), False, False)
    x = torch.ones(2, 4) * (backend.rank + 1)
    for model, opt in pairs:
        model(x, True).sum().backward()
        opt.step()
        opt.zero_grad()
        saved = opt.state_dict()
        opt.average_over(max(1, backend.size - 1))
        model(x * 2, True).sum().backward()
        opt.load_state_dict(saved)
        opt.step()
    _same_everywhere(backend, pairs)


def load_after_failed_round_body(backend: dml.Backend, shard: bool) -> None:
    """A backward whose step raised ends no stepped round: restoring the last checkpoint, as its error says, loads
    (step() refuses that round anyway); after zero_grad() training goes on, the replicas in agreement."""
    dml.ShardedOptimizer.register_elementwise(Flaky)
    model = Net((4, 5, 2), 9)
    opt = dml.DistributedOptimizer(
        backend, Flaky(model.parameters(), lr=0.1, momentum=0.9), bucket_bytes=0, shard_state=shard,
        step_during_backward=True,
    )  # fmt: skip
    x = torch.ones(2, 4) * (backend.rank + 1)
    model(x, True).sum().backward()
    opt.step()
    opt.zero_grad()
    checkpoint = (copy.deepcopy(model.state_dict()), opt.state_dict(to=None) if shard else opt.state_dict())
    inner = opt.shard_optimizer if shard else opt.optimizer
    inner.fail = backend.rank == 1 or backend.size == 1 or not shard  # unsharded: fails everywhere, alike
    try:
        model(x * 2, True).sum().backward()
    except (RuntimeError, MemoryError):
        pass
    else:
        raise AssertionError("the failing step was not reported")
    inner.fail = False
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])  # the restore: refused before
    opt.zero_grad()
    model(x, True).sum().backward()
    opt.step()
    _agree_across_ranks(backend, model, " after the restore")


def no_hook_body(backend: dml.Backend, shard: bool, overlap: bool) -> None:
    """Ranks other than 0 run a backward that reaches no parameter (a loss of the input only): their step() reduces
    now, and must run the collectives the other ranks' backward ran."""
    pairs = _replicas(backend, Net((4, 5, 2), 3), shard, overlap)
    x = torch.ones(3, 4).requires_grad_()
    for _ in range(2):
        for model, opt in pairs:
            opt.zero_grad()
            loss = model(x * (backend.rank + 1), True).sum() if backend.rank == 0 else (x * 2).sum()
            loss.backward()
            opt.step()
        _same_everywhere(backend, pairs)


def landing_body(backend: dml.Backend) -> str:
    """Over gloo, the unsharded optimizer's step of a bucket during backward waits for no later bucket: it runs once
    the next bucket's call has been posted (which completes its own), so a call is still in flight at every step of a
    backward but perhaps its last (at the round's close, after every call has completed). Stepping each bucket as its
    call lands, before posting the next one, left the link idle for the step. The results stay those of the plain
    optimizer's steps. Without overlap: with it the steps run on a thread of their own, at no fixed point of the
    calls. (The sharded form steps each bucket before posting the next one: its allgather follows the step.)"""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from distutils_ml.transport import transport_for

    ring = transport_for(backend)
    if ring is None:
        return "no gloo transport"
    torch.manual_seed(0)
    model = dml.synchronize(backend, torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]))
    ref = copy.deepcopy(model)
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), bucket_bytes=0,
        step_during_backward=True, overlap=False,
    )  # fmt: skip
    ref_opt = dml.DistributedOptimizer(  # the same buckets: the same order of sums on 3 ranks or more
        backend, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), bucket_bytes=0
    )
    seen: list[int] = []
    hook = register_optimizer_step_pre_hook(lambda *_: seen.append(ring.in_flight))
    try:
        for t in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * t + backend.rank))
            del seen[:]
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            during = list(seen)
            opt.step()
            assert len(during) >= 3 and all(during[:-1]), during
            ref_opt.zero_grad()
            ref(x).pow(2).sum().backward()
            ref_opt.step()
    finally:
        hook.remove()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), (p - q).abs().max()
    return f"{len(during)} steps during backward"


def reentrant_body(backend: dml.Backend, shard: bool) -> None:
    """The whole model inside ``checkpoint(use_reentrant=True)`` with overlap (odd ranks leave the side layer
    unused): the round is left open by the nested backward and completed by step()."""
    from torch.utils.checkpoint import checkpoint

    pairs = _replicas(backend, Net((4, 5, 2), 5), shard, True)
    side = backend.rank % 2 == 0
    x = (torch.ones(2, 4) * (backend.rank + 1)).requires_grad_()
    for _ in range(2):
        for model, opt in pairs:
            opt.zero_grad()
            checkpoint(model, x, side, use_reentrant=True).sum().backward()
            opt.step()
        _same_everywhere(backend, pairs)


class Flaky(torch.optim.SGD):
    """SGD whose step raises while ``fail`` is set (a rank running out of memory, say)."""

    fail = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.fail:
            raise MemoryError("simulated: out of memory in the optimizer's step")
        return super().step(closure)


def failing_step_body(backend: dml.Backend, overlap: bool) -> str:
    """A shard's step raises on rank 1 only, during backward: every rank raises, after the same collectives (no hang,
    the replicas agree); step() then refuses, and after zero_grad() training goes on."""
    dml.ShardedOptimizer.register_elementwise(Flaky)
    model = Net((4, 5, 2), 9)
    opt = dml.DistributedOptimizer(
        backend, Flaky(model.parameters(), lr=0.1), bucket_bytes=0, overlap=overlap, shard_state=True,
        step_during_backward=True,
    )  # fmt: skip
    x = torch.ones(2, 4) * (backend.rank + 1)
    opt.shard_optimizer.fail = backend.rank == 1 or backend.size == 1
    try:
        model(x, True).sum().backward()
    except RuntimeError as e:
        message = str(e)
        assert "raised on 1 rank(s)" in message, message
    else:
        raise AssertionError("a failing step on one rank was not reported on every rank")
    _refused_after(opt)
    _agree_across_ranks(backend, model, " after the failure")
    opt.shard_optimizer.fail = False
    opt.zero_grad()
    model(x, True).sum().backward()
    opt.step()
    _agree_across_ranks(backend, model, " after training on")
    return message


def disabled_scaler_body(backend: dml.Backend) -> None:
    """``ShardedGradScaler(enabled=False)`` only calls ``opt.step()``: accepted with step_during_backward."""
    pairs = _replicas(backend, Net((4, 5, 2), 4), True, False)
    scaler = dml.ShardedGradScaler(backend, "cpu", enabled=False)
    x = torch.ones(2, 4) * (backend.rank + 1)
    for model, opt in pairs:
        opt.zero_grad()
        scaler.scale(model(x, True).sum()).backward()
        scaler.step(opt)
        scaler.update()
    _same_everywhere(backend, pairs)


class _Boom(torch.autograd.Function):
    """Raises in backward, after the parameters' gradients (it sits on the input): a backward that fails part way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.2)  # the buckets that landed meanwhile were reduced (and stepped)
        raise ValueError("simulated: a backward that fails part way")


def unfinished_backward_body(backend: dml.Backend, shard: bool, during: bool) -> None:
    """A backward that raises on every rank after its buckets were sent (overlap): ``step()`` refuses (the
    gradients are half reduced, and stepping again would step twice); after ``zero_grad()`` training goes on."""
    model = Net((4, 5, 2), 11)
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=0, overlap=True, shard_state=shard,
        step_during_backward=during,
    )  # fmt: skip
    x = torch.ones(2, 4) * (backend.rank + 1)
    opt.zero_grad()
    try:
        model(_Boom.apply(x.requires_grad_()), True).sum().backward()
    except ValueError:
        pass
    else:
        raise AssertionError("the backward did not raise")
    _refused_after(opt, "raised part way", "a backward that raised part way")
    opt.zero_grad()
    model(x.detach(), True).sum().backward()
    opt.step()
    _agree_across_ranks(backend, model, "")


def synchronize_body(backend: dml.Backend) -> None:
    """Sharded, stepping during backward: a reduction outside backward (``synchronize()`` after ``no_sync()``)
    steps too, as every rank's round must; a gradient changed after it makes ``step()`` raise."""
    model = Net((4, 5, 2), 12)
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True, step_during_backward=True
    )
    x = torch.ones(2, 4) * (backend.rank + 1)
    with opt.no_sync():
        model(x, True).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    try:
        opt.step()
    except RuntimeError as e:
        assert "changed in place" in str(e), e
    else:
        raise AssertionError("a gradient changed after synchronize() was not noticed")


def failing_rest_body(backend: dml.Backend) -> str:
    """Rank 1 had no gradient for one layer, so that bucket is stepped at the end of backward, and that step raises
    there: every rank raises (one small allreduce tells them), and ``step()`` refuses everywhere."""
    dml.ShardedOptimizer.register_elementwise(Flaky)
    model = Net((48, 5, 2), 13)  # the side layer's 48 weights: a piece on every rank
    opt = dml.DistributedOptimizer(
        backend, Flaky(model.parameters(), lr=0.1), bucket_bytes=0, overlap=False, shard_state=True,
        step_during_backward=True,
    )  # fmt: skip
    x = torch.ones(2, 48) * (backend.rank + 1)
    side = backend.rank != 1
    original = opt.shard_optimizer.step

    def step_at_the_end(closure: Any = None) -> Any:  # rank 1: fail once the header has landed
        opt.shard_optimizer.fail = backend.rank == 1 and opt._stepped_pending
        return original(closure)

    opt.shard_optimizer.step = step_at_the_end
    try:
        model(x, side).sum().backward()
    except (RuntimeError, MemoryError) as e:
        message = str(e)
        assert backend.rank == 1 or "raised on some rank" in message, message
    else:
        raise AssertionError("a step failing at the end of backward on one rank was not reported on every rank")
    _refused_after(opt)
    return message
