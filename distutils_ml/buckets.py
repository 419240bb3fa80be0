"""The one bucket machine: how gradients are cut into buckets and sent during (or after) backward.

Both optimizer forms reduce gradients through it: ``GradientReducer`` (:mod:`distutils_ml.reducer`,
each bucket allreduced) and ``ShardedOptimizer`` (:mod:`distutils_ml.sharded`, each bucket
reduce-scattered, the parameters allgathered after the step). They differ only in what they send
per bucket (:meth:`BucketMachine._fill`, :meth:`BucketMachine._communicate`), what goes after the
last bucket (:meth:`BucketMachine._close`) and what they do when a round lands
(:meth:`BucketMachine._finish`), as DDP's communication hooks differ.

Layout (:func:`cut_buckets`). Buckets follow the parameters in reverse order (roughly the order
backward produces their gradients), fixed when the layout is built and identical on every rank,
and are always sent in that order. A gradient of at least ``bucket_bytes`` is a bucket of its own;
smaller ones share buckets of about ``bucket_bytes``, except the first of each group, capped at
``FIRST_BUCKET_BYTES`` (DDP's small first bucket: the link starts early in backward). The two forms
cut by one rule with two stated differences (:class:`CutRule`): the reducer's buckets are grouped by
wire dtype; the sharded form's buckets are ranges of flat buffers of the parameters' dtype, which fix
its shard ownership (not its checkpoints, which hold the full state per parameter), so they are
grouped by parameter dtype, and zero-element parameters have no place.

Rounds. During backward (post-accumulate-grad hooks) a bucket is ready once all its gradients
have been accumulated, and it is sent as soon as every bucket before it has gone; the autograd
engine's final callback sends what is left (buckets whose parameters got no gradient on this rank)
and waits, so when ``backward()`` returns every bucket has landed. With ``overlap`` the buckets go on
the backend's communication thread (:mod:`distutils_ml.commthread`) while backward goes on; without
it they all go from the final callback. Each round records the order in which its buckets became
ready; :func:`encode_order` and :func:`order_mismatch` compare it across ranks in the round's header.

Transport (:func:`ring_array`): a CPU bucket of float32/float64 goes over the gloo transport
(:mod:`distutils_ml.gloo`) where the ranks span hosts, else through the backend.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp
from distutils_ml.gloo import GlooTransport
from distutils_ml.objects import exclusive
from distutils_ml.transport import transport_choice, transport_for
from distutils_ml.watchdog import site_as

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEVICE_BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "NETWORK_BUCKET_BYTES",
    "REDUCER_CUT",
    "SHARDED_CUT",
    "BucketMachine",
    "CutRule",
    "Round",
    "BucketBytes",
    "check_bucket_bytes",
    "check_communication_dtype",
    "comm_stream",
    "cut_buckets",
    "default_bucket_bytes",
    "default_overlap",
    "encode_order",
    "identity_differs",
    "identity_error",
    "in_reentrant_backward",
    "is_slice",
    "machine_identity",
    "order_mismatch",
    "ring_array",
    "spans_hosts",
]

DEFAULT_BUCKET_BYTES = 256 * 1024
#: The default for gradients on a GPU: DDP's 25 MiB. A collective on a GPU costs tens of microseconds
#: of host time (an NCCL call, events, a stream switch) and a GPU step a few milliseconds, so the
#: host's 256 KiB buckets (36 layers: 19 collectives) cost as much as the step (measured on an H200).
DEVICE_BUCKET_BYTES = 25 << 20
#: The first bucket's size per group when ``bucket_bytes`` is larger.
FIRST_BUCKET_BYTES = 1 << 20
NETWORK_BUCKET_BYTES = 4 << 20
#: The dtypes of the buckets the gloo transport carries.
RING_DTYPES = (torch.float32, torch.float64)
_COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STREAMS: dict[Any, Any] = {}
#: Per id() of a parameter, the machine whose hooks it carries (a later one over it takes over:
#: :meth:`BucketMachine._take_over`). A machine holds its parameters, so a live one's ids are not reused.
_OWNERS: dict[int, weakref.ref[BucketMachine]] = {}
_OWNERS_LOCK = threading.RLock()  # LocalBackend's ranks are threads of one process


@dataclass
class _Hooked:
    """A parameter a machine hooked: its AccumulateGrad node (held), its dtype, device and shape then, the handles
    (the tensor's own hook first)."""

    param: torch.Tensor
    node: Any
    dtype: torch.dtype
    device: torch.device
    shape: torch.Size
    handles: list[Any]

    def remove(self, first: int = 0) -> None:
        """Remove its hooks from ``first`` on (1: keep the tensor's own)."""
        for handle in self.handles[first:]:
            handle.remove()
        del self.handles[first:]


def _owners_of(params: list[torch.Tensor], me: BucketMachine) -> list[BucketMachine]:
    """The live machines other than ``me`` that hold hooks on any of ``params``."""
    found: list[BucketMachine] = []
    with _OWNERS_LOCK:
        refs = [_OWNERS.get(id(p)) for p in params]
    for p, ref in zip(params, refs, strict=True):
        other = ref() if ref is not None else None
        if other is not None and other is not me and other not in found:
            entry = other._hooked.get(id(p))
            if entry is not None and entry.param is p:
                found.append(other)
    return found


def check_bucket_bytes(bucket_bytes: Any) -> int:
    """``bucket_bytes`` if it is an int >= 0, else ``ValueError``."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes: got {bucket_bytes!r}; allowed: an int >= 0")
    return bucket_bytes


def check_communication_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` if it is None or a floating-point torch dtype, else ``ValueError``."""
    if dtype is not None and dtype not in _COMM_DTYPES:
        raise ValueError(
            f"communication_dtype: got {dtype!r}; allowed: None, torch.float16, torch.bfloat16, "
            "torch.float32 or torch.float64"
        )
    return dtype


# -- transport ----------------------------------------------------------------------------------


def default_overlap(backend: Backend) -> bool:
    """Whether buckets go on the communication thread by default: ``DML_OVERLAP`` (1/0) if set, else on
    NCCLBackend, and on MPIBackend when its buckets go over a gloo group (ranks on several hosts; deciding
    it makes the group, a collective: if it cannot connect, the buckets go over MPI and overlap is off).

    A thread waiting in an MPI collective polls (Open MPI progresses by spinning), so on one
    host's CPUs it takes the core backward computes on. NCCL reduces on the GPU, and across
    hosts the buckets go over gloo (:mod:`distutils_ml.transport`), whose threads sleep until
    bytes arrive (docs/benchmarks/network.md).
    """
    forced = os.environ.get("DML_OVERLAP", "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    from distutils_ml.backends.nccl import NCCLBackend

    if isinstance(backend, NCCLBackend):
        return True
    choice = transport_choice()
    if choice == "mpi" or (choice == "auto" and not spans_hosts(backend)):
        return False
    return transport_for(backend) is not None


def spans_hosts(backend: Backend) -> bool:
    """Whether the backend's ranks run on several hosts (MPI and NCCL backends know; LocalBackend: no)."""
    hosts = getattr(backend, "hosts", None)
    if hosts is None:
        inner = getattr(backend, "mpi", None)
        hosts = getattr(inner, "hosts", None)
    return bool(hosts) and len(set(hosts)) > 1


class BucketBytes(NamedTuple):
    """Bucket sizes in bytes: for gradients in host memory, and for gradients on a GPU."""

    host: int
    device: int

    @classmethod
    def of(cls, bucket_bytes: Any) -> BucketBytes:
        """``bucket_bytes`` as it is (a ``BucketBytes``), or one checked size for every device."""
        if isinstance(bucket_bytes, BucketBytes):
            return cls(check_bucket_bytes(bucket_bytes.host), check_bucket_bytes(bucket_bytes.device))
        n = check_bucket_bytes(bucket_bytes)
        return cls(n, n)

    def on(self, device: torch.device) -> int:
        """The size for gradients on ``device``."""
        return self.host if device.type == "cpu" else self.device

    def __repr__(self) -> str:  # as the user wrote it, in a message naming ranks that differ
        return str(self.host) if self.host == self.device else f"(host {self.host}, GPU {self.device})"


def default_bucket_bytes(backend: Backend, bucket_bytes: int | None) -> BucketBytes:
    """``bucket_bytes`` for every device, or the defaults: in host memory 256 KiB on one host and
    4 MiB across hosts, on a GPU 25 MiB (DDP's).

    Every bucket costs a network round trip: across hosts, gradients under 4 MiB share
    buckets of about 4 MiB (fewer, larger messages, as DDP's 25 MiB buckets); on one host
    256 KiB measured best (larger gradients reduced in place, never copied). On a GPU each
    bucket costs host time that the GPU's short step cannot hide (``DEVICE_BUCKET_BYTES``).
    """
    if bucket_bytes is not None:
        return BucketBytes.of(bucket_bytes)
    return BucketBytes(NETWORK_BUCKET_BYTES if spans_hosts(backend) else DEFAULT_BUCKET_BYTES, DEVICE_BUCKET_BYTES)


def ring_array(ring: GlooTransport | None, tensor: torch.Tensor, op: ReduceOp) -> np.ndarray | None:
    """The NumPy view of ``tensor`` to send over ``ring`` (the gloo transport across hosts), or None where the
    backend carries it (no transport, a device tensor, a dtype or op it does not reduce)."""
    if ring is None or tensor.device.type != "cpu" or tensor.dtype not in RING_DTYPES:
        return None
    array = tensor.numpy()
    return array if ring.supports(array, op) else None


def comm_stream(device: torch.device) -> Any:
    """The CUDA stream buckets are reduced on, one per device."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def is_slice(grad: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether ``grad`` is already the bucket slice ``flat`` (then nothing needs copying)."""
    return grad.data_ptr() == flat.data_ptr() and grad.dtype == flat.dtype and grad.is_contiguous()


# -- layout -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CutRule:
    """Where the two layouts differ (the module's docstring says why)."""

    #: group by wire dtype (True: a bucket is sent as it lies) or by parameter dtype (a flat buffer of parameters)
    by_wire: bool
    #: zero-element parameters take a place in a bucket
    keep_empty: bool


REDUCER_CUT = CutRule(by_wire=True, keep_empty=True)
SHARDED_CUT = CutRule(by_wire=False, keep_empty=False)


def cut_buckets(
    params: list[torch.Tensor], bucket_bytes: BucketBytes, comm_dtype: torch.dtype | None, rule: CutRule
) -> list[tuple[bool, tuple[torch.dtype, torch.device], list[int]]]:
    """The buckets of ``params`` in the order they are sent: (alone, (dtype, device) of the group, indices).

    With ``limit`` the size for the parameter's device (``BucketBytes.on``): ``alone``, one gradient of at
    least ``limit`` whose group dtype is its own (it can go as it lies). Smaller gradients share a bucket per
    group until it holds ``limit`` (the first one of each group ``min(limit, FIRST_BUCKET_BYTES)``); the buckets
    left open at the end are placed where their last (earliest) parameter is.
    """
    groups: list[tuple[bool, tuple[torch.dtype, torch.device], list[int]]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], list[int]]] = {}  # key -> (members, bytes)
    seen: set[tuple[torch.dtype, torch.device]] = set()
    for i in reversed(range(len(params))):
        p = params[i]
        if not rule.keep_empty and p.numel() == 0:
            continue
        wire = comm_dtype or p.dtype
        key = (wire if rule.by_wire else p.dtype, p.device)
        nbytes = p.numel() * wire.itemsize
        limit = bucket_bytes.on(p.device)
        if nbytes >= limit and key[0] == p.dtype:
            groups.append((True, key, [i]))
            continue
        members, size = open_.setdefault(key, ([], [0]))
        members.append(i)
        size[0] += nbytes
        first = min(limit, FIRST_BUCKET_BYTES)
        if size[0] >= (limit if key in seen else first):
            del open_[key]
            seen.add(key)
            groups.append((False, key, members))
    for key, (members, _) in sorted(open_.items(), key=lambda kv: -min(kv[1][0])):
        groups.append((False, key, members))
    return groups


# -- the ready order ----------------------------------------------------------------------------


def encode_order(order: np.ndarray, ready_at: list[int], task: int, head_op: ReduceOp, levels: int | None) -> None:
    """Write each bucket's ready position (``ready_at``; -1: not by hooks) into ``order`` (buckets x 3), for a
    header reduced with ``head_op``: with MAX, (not ready here, q, levels-1 - q); else (ready, q, q * q), to sum
    over ranks. q is the position modulo ``levels`` (a header in half precision), or whole (None)."""
    for k, at in enumerate(ready_at):
        ready = at >= 0 and task >= 0
        q = (at % levels if levels else at) if ready else 0
        if head_op is ReduceOp.MAX:
            assert levels is not None
            order[k] = (0.0, q, levels - 1 - q) if ready else (1.0, 0.0, 0.0)
        else:
            order[k] = (1.0, q, q * q) if ready else (0.0, 0.0, 0.0)


def order_mismatch(
    order: np.ndarray, size: int, head_op: ReduceOp, levels: int | None, *, averaged: bool
) -> np.ndarray | None:
    """Per bucket, whether the ranks' ready positions differ, from the reduced ``order`` of
    :func:`encode_order` (``averaged``: reduced with AVG); None where some rank's hooks did not fire
    for every bucket (some parameters unused there): then the order is not comparable."""
    if head_op is ReduceOp.MAX:
        if (order[:, 0] > 0).any():
            return None
        assert levels is not None
        return order[:, 1] != (levels - 1 - order[:, 2])
    count = order[:, 0] * (size if averaged else 1)
    if not np.allclose(count, size):
        return None
    mean = order[:, 1] / order[:, 0]
    return order[:, 2] / order[:, 0] - mean * mean > 1e-3


#: How many gradient machines (optimizers, reductions in backward, ``allreduce_gradients``' reducers) each backend
#: has made: the k-th one of a backend is the same one on every rank, whose programs make them in the same order.
_MADE: weakref.WeakKeyDictionary[Backend, int] = weakref.WeakKeyDictionary()


def machine_identity(backend: Backend) -> int:
    """The number of a new gradient machine on ``backend`` (0, 1, ...), which each round's header carries: the
    rounds of two machines sharing a backend pair with each other across ranks in the order they happen, and a
    rank whose order differs (one machine had no gradient there in a backward that reached another) would add
    one machine's gradients to another's; the header tells it and every rank raises (:func:`identity_error`)."""
    with _OWNERS_LOCK:
        made = _MADE.get(backend, 0)
        _MADE[backend] = made + 1
    return made


def identity_differs(row: np.ndarray, size: int, head_op: ReduceOp, levels: int | None, *, averaged: bool) -> bool:
    """Whether the ranks' machine numbers (written by :func:`encode_order` as a bucket always ready, into the
    header's ``row`` of 3) differ: the ranks paired rounds of different machines. Not comparable, so False, where
    some rank sent no header of its own (inside ``dml.join``, a rank that has joined sends zeros)."""
    differs = order_mismatch(row.reshape(1, 3), size, head_op, levels, averaged=averaged)
    return differs is not None and bool(differs[0])


def identity_error(caller: str, identity: int, *, stepped: bool = False) -> RuntimeError:
    """The error every rank raises when a round paired with another machine's round on some rank (``stepped``: its
    buckets were stepped as they landed, ``step_during_backward``)."""
    done = (
        "Its buckets were stepped as they landed (step_during_backward=True) with those wrong sums: restore the last "
        "checkpoint. "
        if stepped
        else "The gradients of this backward are not reduced; do not step them. "
    )
    return RuntimeError(
        f"{caller}: this round's reduction was paired, on some rank, with the reduction of another optimizer or "
        f"gradient reduction on the same backend (this one is number {identity} made on it): several of them share "
        "the backend, and their reductions pair across ranks in the order they happen, which differed between "
        "ranks here. Usually one of them had no gradient on some rank in a backward that reached another one's "
        "parameters (its reduction then waited for step()), or their gradients became ready in another order. "
        f"{done}Make every rank's backward reach the same "
        "optimizers' parameters in the same order (use each one's parameters on every rank, e.g. add "
        "0 * p.sum() of an unused one to the loss), or give all parameters to one DistributedOptimizer. They must "
        "also be created in the same order on every rank"
    )


def order_error(caller: str, k: int, nb: int, names: list[str]) -> RuntimeError:
    """The error every rank raises when bucket ``k`` of ``nb`` (holding ``names``) became ready out of order."""
    return RuntimeError(
        f"{caller}: the gradients became ready in a different order on different ranks (bucket {k} "
        f"of {nb}, holding {', '.join(names[:3])}): the ranks run different models or "
        "different code paths with all parameters used. Every rank must run the same model; parameters "
        "that some ranks do not use are allowed"
    )


# -- rounds -------------------------------------------------------------------------------------

#: The code objects through which the autograd engine runs the backward of a node written in Python
#: (``apply_boxed`` is newer than torch 2.11, which has ``apply`` only).
_PYTHON_NODE_CODES = frozenset(
    f.__code__
    for f in (getattr(torch.autograd.function.BackwardCFunction, name, None) for name in ("apply", "apply_boxed"))
    if f is not None
)


def in_reentrant_backward() -> bool:
    """Whether the calling thread runs inside the backward of an autograd node written in Python: a backward started
    there (``torch.utils.checkpoint(..., use_reentrant=True)`` recomputes and runs one) is nested in an outer one.

    Read from this thread's Python stack: the engine runs every Python node's backward through
    ``BackwardCFunction.apply``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _PYTHON_NODE_CODES:
            return True
        frame = frame.f_back
    return False


@dataclass
class Round:
    """One reduction: which parameters fired, which buckets are ready and which have gone."""

    task: int  # the autograd graph task of its backward; -1: a reduction called directly
    waiting: list[int]  # per bucket: parameters not yet accumulated
    ready_at: list[int]  # per bucket: position in the order buckets became ready; -1: not by hooks
    has: list[bool]  # per parameter: this rank had a gradient when its bucket went
    changed: bool = False  # the parameters changed since the layout was built
    allocated: list[int] = field(default_factory=list)  # parameters given zeros to send
    fired: set[int] = field(default_factory=set)
    ready: int = 0
    sent: int = 0
    events: list[tuple[torch.device, Any]] = field(default_factory=list)  # (device, CUDA event) per bucket
    # backward(create_graph=True): per parameter, its gradient with autograd history, and the detached copy sent
    # in its place (None: its values went through a flat bucket)
    graphs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    sparse_seen: set[int] = field(default_factory=set)  # parameters with a sparse gradient in a dense bucket here
    sparse: dict[int, torch.Tensor | None] = field(default_factory=dict)  # reduced sparse gradients (None: nobody's)
    skip: bool = False  # a backward that only accumulates (no_sync, backward_passes_per_step): nothing is sent
    nested: bool = False  # hooks came from a backward run inside a node of this one (reentrant checkpointing)
    deferred: bool = False  # the task that started it ended inside an outer backward, which finishes it
    # step_during_backward over gloo, unsharded: the bucket whose call was left in flight, stepped once the next
    # bucket's call has been posted (which completes it) or at the round's close: the next bucket never waits for it
    landing: int | None = None


def _outside_compilation(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` excluded from Dynamo's tracing, as ``torch.compiler.disable(fn)`` does, without importing
    ``torch._dynamo`` (1.4 s of every rank's start) in a process that never compiles: while Dynamo is not loaded
    nothing can trace ``fn``, which is called as it is; once it is, through ``torch._disable_dynamo`` (what
    ``torch.optim`` uses for the same reason; Dynamo does not trace into it)."""
    disabled = getattr(torch, "_disable_dynamo", torch.compiler.disable)(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" in sys.modules:
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


class BucketMachine(abc.ABC):
    """Backward rounds over buckets: the hooks, the ready order, the final callback, the jobs.

    A subclass holds the layout (``_params``, ``_index`` from ``id(param)``, ``_bucket_of`` per parameter,
    -1 for none, and ``_buckets``, each with its ``params``) and says what happens per bucket. It sets
    ``caller`` (error messages), ``backend`` (None until attached) and ``overlap``, registers
    :meth:`_hook` as the post-accumulate-grad hook of its parameters and calls :meth:`_init_rounds`.
    """

    caller: str
    backend: Any
    overlap: bool
    _params: list[torch.Tensor]
    _index: dict[int, int]
    _bucket_of: list[int]
    _buckets: list[Any]
    _ring: GlooTransport | None  # the gloo transport across hosts, whose calls a round may leave in flight

    def _init_rounds(self) -> None:
        self._round: Round | None = None
        #: what took over this machine's parameters (a later optimizer or reduction over some of them), or None
        self.displaced_by: str | None = None
        self._hooked: dict[int, _Hooked] = {}  # per id(param) hooked: its node, what it was, the handles
        self._shape_changed = False  # a hook saw a parameter of another shape before its round began

    # -- hooks ------------------------------------------------------------------------------

    def _quiesce_owners(self, params: list[torch.Tensor]) -> None:
        """Let an earlier machine over any of ``params`` finish what it has in flight into them (before their layout
        changes); it keeps them until :meth:`_take_over`."""
        for other in _owners_of(params, self):
            other._quiesce()

    def _quiesce(self) -> None:  # noqa: B027 - optional: a machine with transfers in flight waits for them
        """Finish the transfers in flight into the parameters."""

    def _take_over(self, params: list[torch.Tensor]) -> None:
        """Make this machine the one that reduces ``params``' gradients: an earlier machine hooked on any of them
        (an optimizer created again, for a new phase or after the model changed) is displaced first, all its hooks
        removed (its reduction would run beside this one's: twice with SUM, or raise that the parameters changed).
        The registry holds ids, not references (a weak reference would stop ``torch.utils.swap_tensors``)."""
        for other in _owners_of(params, self):
            other._displace(self.caller)
        with _OWNERS_LOCK:
            for key in [k for k, ref in _OWNERS.items() if ref() is None]:
                del _OWNERS[key]
            for p in params:
                _OWNERS[id(p)] = weakref.ref(self)

    def _displace(self, by: str) -> None:
        """Another machine took over some of this one's parameters: remove every hook; later use raises."""
        self._unhook()
        self.displaced_by = by

    def _unhook(self) -> None:
        """Remove this machine's hooks (a subclass removes its others too) and give up its parameters."""
        for entry in self._hooked.values():
            entry.remove()
            with _OWNERS_LOCK:
                ref = _OWNERS.get(id(entry.param))
                if ref is not None and ref() is self:
                    del _OWNERS[id(entry.param)]
        self._hooked = {}

    def _node_prehook(self) -> Callable[[Any], None] | None:
        """A pre-hook for each parameter's AccumulateGrad node (None: none)."""
        return None

    def _hook_on(self, params: list[torch.Tensor]) -> None:
        """Hook ``params`` (those hooked already keep their hooks; the others lose theirs): :meth:`_hook` runs once
        backward has accumulated a parameter's gradient.

        The hook is a post-hook of the parameter's AccumulateGrad node, as DDP's and Horovod's are: it runs after
        every hook on the tensor, a user's ``register_post_accumulate_grad_hook`` registered later included, so the
        bucket goes with ``.grad`` as those hooks left it (a hook on the tensor itself ran before them, and with
        ``overlap`` its bucket left before they changed it). The node is held (a leaf keeps it only while someone
        does). A hook on the tensor notices, from the parameter's dtype, device and shape, when it changed since:
        ``.data`` of another dtype or device gives it a new node, to which the post-hook moves (in that backward,
        where it still runs after the tensor's hooks); of another shape, torch keeps the held node, whose gradient
        then has the old shape, and the round is marked changed (it raises on every rank). Hooks already in place
        are kept, so a plan rebuilt inside a backward never touches the hooks of a node that is running."""
        self._take_over(params)
        kept: dict[int, _Hooked] = {}
        for p in params:
            entry = self._hooked.pop(id(p), None)
            if entry is not None and entry.param is p:
                kept[id(p)] = entry
                continue
            if entry is not None:
                entry.remove()
            entry = _Hooked(p, None, p.dtype, p.device, p.shape, [])
            kept[id(p)] = entry
            if p.layout != torch.strided:  # no node to hold (view_as has no sparse kernel): the plan refuses it
                entry.handles.append(p.register_post_accumulate_grad_hook(self._hook))
                continue
            entry.handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._check_node, entry)))
            self._attach_node(entry, torch.autograd.graph.get_gradient_edge(p).node)
        for entry in self._hooked.values():
            entry.remove()
        self._hooked = kept

    def _attach_node(self, entry: _Hooked, node: Any) -> None:
        """Hold ``node`` for ``entry``'s parameter and hook it (its post-hook; the subclass's pre-hook)."""
        entry.node = node
        entry.handles.append(node.register_hook(functools.partial(self._after_accumulate, entry.param)))
        prehook = self._node_prehook()
        if prehook is not None:
            entry.handles.append(node.register_prehook(prehook))

    def _after_accumulate(self, param: torch.Tensor, grad_inputs: Any, grad_outputs: Any) -> None:
        """Post-hook of ``param``'s AccumulateGrad node."""
        self._hook(param)

    def _check_node(self, entry: _Hooked, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of ``param`` (it runs before the node's post-hook): follow a changed parameter."""
        if param.dtype == entry.dtype and param.device == entry.device and param.shape == entry.shape:
            return
        node = torch.autograd.graph.get_gradient_edge(param).node
        if node is not entry.node:  # another dtype or device: a new node, hooked now (its post-hooks run next)
            entry.remove(first=1)
            self._attach_node(entry, node)
            entry.dtype, entry.device, entry.shape = param.dtype, param.device, param.shape
        grad = param.grad
        if param.shape != entry.shape or (grad is not None and grad.shape != param.shape):
            self._stale_shape()

    def _stale_shape(self) -> None:
        """A parameter's ``.data`` took another shape while its node was held: its gradient has the old one. This
        backward's round is marked changed (every rank raises); an optimizer created again holds a fresh node."""
        self._shape_changed = True
        if self._round is not None:
            self._round.changed = True

    def _sited(self, job: Callable[[], None]) -> Callable[[], None]:
        """``job`` run inside :meth:`_site` (on the communication thread); ``job`` itself outside debug mode."""
        if not self._compares_sites():
            return job

        def sited() -> None:
            with self._site():
                job()

        return sited

    def _site(self) -> contextlib.AbstractContextManager[None]:
        """Inside: the round's collectives are made, for debug mode's comparison across ranks, at one call site,
        wherever the round is driven from (a hook, the communication thread, ``step()``): a rank whose backward
        reached no parameter reduces in ``step()`` what the others reduced in backward, and that is no mismatch.
        Outside debug mode no call site is compared, and nothing is set (a hook runs per parameter)."""
        if not self._compares_sites():
            return contextlib.nullcontext()
        return site_as(f"the gradient reduction of {self.caller}")

    def _compares_sites(self) -> bool:
        return self.backend is not None and bool(self.backend.debug)

    # -- what a subclass says ---------------------------------------------------------------

    @abc.abstractmethod
    def _skip_this_backward(self) -> bool:
        """Asked once per backward, at its first hook: True leaves its gradients unreduced."""

    @abc.abstractmethod
    def _begin(self, backend: Backend, *, now: bool) -> bool:
        """Before a round (``now``: a reduction called directly): build or check the layout; whether the
        parameters changed since it was built."""

    @abc.abstractmethod
    def _fill(self, state: Round, k: int) -> torch.Tensor:
        """Bucket ``k``'s gradients, ready to send (``state.has`` records which this rank had)."""

    @abc.abstractmethod
    def _communicate(self, backend: Backend, k: int, tensor: torch.Tensor) -> None:
        """Bucket ``k``'s collective on ``tensor``."""

    @abc.abstractmethod
    def _finish(self, backend: Backend, state: Round) -> None:
        """After every bucket landed: the gradients in place and the round's checks."""

    @abc.abstractmethod
    def _reduced_in_backward(self) -> None:
        """After a round that ran during a backward."""

    def _adopt(self, param: torch.Tensor) -> None:  # noqa: B027 - optional: layouts that own .grad override it
        """A hook saw ``param.grad`` (its layout may take it in)."""

    def _close(self, backend: Backend, state: Round) -> Callable[[], None] | None:
        """After the last bucket: a collective to run after them (the default: none)."""
        return None

    def _landed(self, state: Round, k: int) -> None:  # noqa: B027 - optional: the default does nothing
        """Bucket ``k``'s collective has completed (on the thread and stream that ran it)."""

    # -- rounds -----------------------------------------------------------------------------

    def _new_round(self, task: int, changed: bool) -> Round:
        changed, self._shape_changed = changed or self._shape_changed, False
        nb = len(self._buckets)
        waiting = [len(b.params) for b in self._buckets]
        return Round(task, waiting, [-1] * nb, [False] * len(self._params), changed)

    def _reduce_now(self, backend: Backend) -> None:
        """One round now, outside backward (one thread at a time: the round is several collectives).

        A round a reentrant backward left open (its outermost backward had no hook of ours to end it) is
        completed instead: its buckets, some perhaps sent already, go as they would have at its end.
        """
        state = self._round
        with self._site():
            if state is not None and state.deferred and not state.skip:
                self._complete(backend, state)
                return
            with exclusive(backend, self.caller):
                state = self._new_round(-1, self._begin(backend, now=True))
                self._flush(backend, state, overlap=False)
                self._finish(backend, state)

    @_outside_compilation  # torch.compile around backward() runs the hooks as Python: collectives are not traced
    def _hook(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``param.grad`` holds this backward's gradient."""
        with self._site():
            self._accumulated(param)

    def _accumulated(self, param: torch.Tensor) -> None:
        backend = self.backend
        assert backend is not None
        task = torch._C._current_graph_task_id()
        state = self._round
        if state is not None and state.task != task:
            state = self._other_task(backend, state, task)
        if state is None:
            state = self._start(backend, task)
        if state.skip:
            self._adopt(param)
            return
        i = self._index.get(id(param))
        if i is None or self._params[i] is not param:  # a parameter of another layout: the set changed
            state.changed = True
            return
        self._adopt(param)
        if i in state.fired:
            if 0 <= self._bucket_of[i] < state.sent:
                self._twice(i)
            return
        state.fired.add(i)
        k = self._bucket_of[i]
        if k < 0:
            return
        state.waiting[k] -= 1
        if state.waiting[k] == 0:
            state.ready_at[k] = state.ready
            state.ready += 1
            if self.overlap:
                self._send_ready(backend, state)
            if state.nested and state.ready == len(self._buckets):
                # A reentrant backward may end where no hook of ours sees it: finish once every bucket is ready.
                self._complete(backend, state)

    def _start(self, backend: Backend, task: int) -> Round:
        """The first hook of a backward: decide whether it reduces; if so check the layout. Queue the final callback."""
        if self._skip_this_backward():  # decided once per backward
            state = self._round = Round(task, [], [], [], skip=True)
        else:
            changed = self._begin(backend, now=False)
            state = self._round = self._new_round(task, changed)
        state.nested = in_reentrant_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return state

    def _other_task(self, backend: Backend, state: Round, task: int) -> Round | None:
        """A hook of another autograd graph task than the open round's: the round it belongs to (None: a new one)."""
        if in_reentrant_backward():  # run inside a node of a running backward (reentrant checkpointing)
            state.nested = True
            return state
        if state.deferred and task < state.task:  # the backward around the reentrant one that opened the round
            state.task, state.deferred = task, False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            return state
        if state.deferred:  # the backward that left it open has ended: it is complete
            if state.skip:
                self._round = None
            else:
                self._complete(backend, state)
            return None
        self._second_backward()
        return None

    def _twice(self, i: int) -> None:
        """A gradient added to a parameter whose bucket this backward already sent: raise (on every rank alike)."""
        self._reset_round()
        raise RuntimeError(
            f"{self.caller}: parameter {i} received a second gradient in one backward after its bucket was sent "
            "(it is used both inside and outside a block checkpointed with use_reentrant=True, whose nested "
            "backward adds to it later); that gradient would be lost. Checkpoint with use_reentrant=False, or "
            "create the optimizer with overlap=False (buckets then leave at the end of backward)"
        )

    def _second_backward(self) -> None:
        state = self._round
        assert state is not None
        self._reset_round()
        raise RuntimeError(
            f"{self.caller}: a second backward() started before the gradients of the previous one were reduced "
            f"(it {'was interrupted' if state.sent < len(self._buckets) else 'has not finished'}: "
            f"{state.sent} of {len(self._buckets)} buckets sent). Gradients are reduced before backward() "
            "returns; run one backward at a time on one thread, and after a backward that raised, clear the "
            "gradients (zero_grad()) before the next one"
        )

    @_outside_compilation
    def _end_of_backward(self) -> None:
        """Final callback of the autograd engine: send what is left, wait, finish."""
        backend, state = self.backend, self._round
        if backend is None or state is None:
            return
        if in_reentrant_backward():  # a backward inside a node of another: that one ends the round
            state.deferred = True
            return
        if state.skip:
            self._round = None
            return
        with self._site():
            self._complete(backend, state)

    def _complete(self, backend: Backend, state: Round) -> None:
        """Send what is left, wait, finish the round (which ran during a backward)."""
        try:
            if self.overlap:
                self._flush(backend, state, overlap=True)
            else:
                with exclusive(backend, self.caller):
                    self._flush(backend, state, overlap=False)
            self._finish(backend, state)
        finally:
            self._round = None
        self._reduced_in_backward()

    def unfinished_round(self) -> bool:
        """Whether a backward opened a round and raised before its end after sending a bucket (a round not left
        open by a reentrant backward on purpose): some gradients may be reduced, others not. One that sent nothing
        is forgotten here: its gradients are whole, and a reduction now covers them."""
        state = self._round
        if state is None or state.skip or state.deferred:
            return False
        if state.sent == 0:
            self._reset_round()
            return False
        return True

    def has_deferred_round(self) -> bool:
        """Whether a round that a reentrant backward left open awaits completion (by :meth:`_reduce_now`)."""
        state = self._round
        return state is not None and state.deferred and not state.skip

    def _reset_round(self) -> None:
        """Forget a round a failed backward left unfinished (after its sent buckets have gone, and its gloo calls
        left in flight have landed: none may land later in buffers another round uses)."""
        if self._round is not None and self.backend is not None and not self.backend.in_collective():
            self.backend.wait_for_comm_thread(errors=False)
        self._round = None
        self._settle_in_flight()

    def _settle(self) -> None:
        """Complete the gloo calls left in flight (none without a gloo transport)."""
        if self._ring is not None:
            self._ring.settle()

    def _settle_in_flight(self) -> None:
        """After a round that failed part way: complete the gloo calls it left in flight, so that none lands later
        in buffers another round uses. On this thread where it holds the backend (it made them, and the
        communication thread cannot run); else on the communication thread, after its queued jobs (which may post
        more). A failure there breaks the transport (every later call raises) and is not raised here."""
        ring, backend = self._ring, self.backend
        if ring is None or backend is None:
            return
        if backend.in_collective():
            self._settle_here()
            return
        backend.wait_for_comm_thread(errors=False)
        if ring.in_flight:
            worker = backend.comm_thread()
            worker.submit(ring.settle)
            worker.wait(errors=False)

    def _settle_here(self) -> None:
        """As :meth:`_settle_in_flight`, on this thread, which holds the backend (the calls were made on it)."""
        if self._ring is not None and self._ring.in_flight:
            with contextlib.suppress(Exception):
                self._ring.settle()

    # -- sending ----------------------------------------------------------------------------

    def _send_ready(self, backend: Backend, state: Round) -> None:
        """Send, in bucket order, every bucket that is ready and has only sent buckets before it."""
        while state.sent < len(self._buckets) and state.waiting[state.sent] == 0:
            self._send(backend, state, state.sent, overlap=True)

    def _flush(self, backend: Backend, state: Round, *, overlap: bool) -> None:
        """Send every bucket not sent yet, in order (their missing gradients count as zeros), then
        what :meth:`_close` adds, then wait. If that raises, the gloo calls left in flight are completed first
        (where they were made): none may land later in buffers another round uses."""
        try:
            while state.sent < len(self._buckets):
                self._send(backend, state, state.sent, overlap=overlap)
            last = self._close(backend, state)
            if overlap:
                worker = backend.comm_thread()
                if last is not None:
                    worker.submit(self._sited(last))
                worker.wait()
                for device, event in state.events:  # the next kernels on the autograd stream see the reduced grads
                    torch.cuda.current_stream(device).wait_event(event)
            elif last is not None:
                last()
        except BaseException:
            if overlap:
                self._settle_in_flight()
            else:
                self._settle_here()
            raise

    def _send(self, backend: Backend, state: Round, k: int, *, overlap: bool) -> None:
        state.sent += 1
        tensor = self._fill(state, k)
        if not overlap:
            self._communicate(backend, k, tensor)
            self._landed(state, k)
            return
        backend.comm_thread().submit(self._job(backend, k, tensor, state))

    def _job(self, backend: Backend, k: int, tensor: torch.Tensor, state: Round) -> Callable[[], None]:
        if not tensor.is_cuda:

            def job() -> None:
                self._communicate(backend, k, tensor)
                self._landed(state, k)

            return self._sited(job)
        # The gradient kernels run on the autograd stream: the bucket goes on a stream of its own after them.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        stream = comm_stream(tensor.device)
        done = torch.cuda.Event()
        state.events.append((tensor.device, done))

        def run() -> None:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                tensor.record_stream(stream)
                self._communicate(backend, k, tensor)
                self._landed(state, k)
                done.record(stream)

        return self._sited(run)
