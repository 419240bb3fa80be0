"""The package's layout (issue 21, item 5): every import points down the layers, none closes a cycle, none takes
a private name from another module. Read from the source with ``ast``: imports at module level and inside
functions count alike; those under ``if TYPE_CHECKING:`` do not (they never run).

docs/architecture.md explains the layers; this table is where each module is placed. A new module fails
``test_every_module_is_placed`` until it is added here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distutils_ml"

#: The layers, lowest first. A module may import modules of its own layer or of lower ones, never of a higher one.
LAYERS = ("foundation", "transport", "collectives", "state", "training", "faces")

#: Every module of the package and its layer: the one place the layout is written down.
LAYER = {
    # foundation: the backend contract, its communication thread, and stall detection that every backend uses
    "distutils_ml.backends.base": "foundation",
    "distutils_ml.watchdog": "foundation",
    "distutils_ml.commthread": "foundation",
    # transport: array handling, the backends, the process's registry of them
    "distutils_ml.arrays": "transport",
    "distutils_ml.backends": "transport",
    "distutils_ml.backends.local": "transport",
    "distutils_ml.backends.mpi": "transport",
    "distutils_ml.backends.failfast": "transport",
    "distutils_ml.backends.nccl": "transport",
    "distutils_ml.registry": "transport",
    # collectives: the backend-first calls a user makes on buffers and objects
    "distutils_ml.collectives": "collectives",
    "distutils_ml.objects": "collectives",
    "distutils_ml.printing": "collectives",
    "distutils_ml.sparse": "collectives",
    "distutils_ml.joined": "collectives",
    # state: root's state in every replica
    "distutils_ml.tree": "state",
    "distutils_ml.agreement": "state",
    "distutils_ml.fused_broadcast": "state",
    "distutils_ml.synchronize": "state",
    "distutils_ml.buffers": "state",
    # training: gradients, optimizers, normalization, data, checkpoints
    "distutils_ml.gloo": "training",
    "distutils_ml.transport": "training",
    "distutils_ml.reducer": "training",
    "distutils_ml.buckets": "training",
    "distutils_ml.optimizer_base": "training",
    "distutils_ml.optimizer": "training",
    "distutils_ml.sharded_rules": "training",
    "distutils_ml.stepping": "training",
    "distutils_ml.sharded_layout": "training",
    "distutils_ml.sharded_state": "training",
    "distutils_ml.sharded_clip": "training",
    "distutils_ml.sharded": "training",
    "distutils_ml.amp": "training",
    "distutils_ml.batchnorm": "training",
    "distutils_ml.uneven": "training",
    "distutils_ml.observations": "training",
    "distutils_ml.data": "training",
    "distutils_ml.evaluation": "training",
    "distutils_ml.streams": "training",
    "distutils_ml.rng": "training",
    "distutils_ml.checkpoint": "training",
    "distutils_ml.trainstate": "training",
    # faces: the public API, and the launcher (a program of its own)
    "distutils_ml": "faces",
    "distutils_ml.launch": "faces",
    "distutils_ml.mpiexec_options": "faces",
    "distutils_ml.supervise": "faces",
    "distutils_ml.restarts": "faces",
    "distutils_ml.sessiondirs": "faces",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import under ``node``, in functions too, except under ``if TYPE_CHECKING:``."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        return [i for child in node.orelse for i in _imports(child)]
    found = [node] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
    return found + [i for child in ast.iter_child_nodes(node) for i in _imports(child)]


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of ``from <node.module> import ...`` written in ``module``."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def edges() -> list[tuple[str, str, list[str], int]]:
    """(importer, imported module, names taken from it, line) for every import of a package module."""
    found = []
    for module, path in MODULES.items():
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found += [(module, a.name, [], node.lineno) for a in node.names if a.name in MODULES]
                continue
            source = _absolute(module, node)
            if source not in MODULES:
                continue
            names = []
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:  # from distutils_ml import checkpoint: the submodule
                    found.append((module, f"{source}.{alias.name}", [], node.lineno))
                else:
                    names.append(alias.name)
            if names:
                found.append((module, source, names, node.lineno))
    return found


def test_every_module_is_placed() -> None:
    unplaced = sorted(set(MODULES) - set(LAYER))
    assert not unplaced, (
        f"module(s) not placed in a layer: {unplaced}. Add each to LAYER in tests/test_layout.py (layers, lowest "
        f"first: {LAYERS}) and its one-line concern to docs/architecture.md"
    )
    gone = sorted(set(LAYER) - set(MODULES))
    assert not gone, f"LAYER in tests/test_layout.py lists module(s) that no longer exist: {gone}"


def test_imports_point_down() -> None:
    upward = [
        f"{importer} ({LAYER[importer]}, line {line}) imports {imported} ({LAYER[imported]})"
        for importer, imported, _, line in edges()
        if importer in LAYER and imported in LAYER and LAYERS.index(LAYER[imported]) > LAYERS.index(LAYER[importer])
    ]
    assert not upward, "imports of a higher layer (layers, lowest first: " + f"{LAYERS}):\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other (strongly connected components of two or more, or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for importer, imported, _, _ in edges():
        graph.setdefault(importer, set()).add(imported)
    cycles = _cycles(graph)
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def test_no_private_name_is_imported_from_another_module() -> None:
    private = [
        f"{importer} (line {line}) imports {name} from {imported}"
        for importer, imported, names, line in edges()
        for name in names
        if name.startswith("_") and importer != imported
    ]
    assert not private, "private names imported from another module (give each a public home):\n" + "\n".join(private)


def test_the_checks_see_lazy_imports_and_skip_type_checking_ones() -> None:
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from distutils_ml.sharded import X\n"
        "def f():\n    from distutils_ml.objects import _y\n"
    )
    found = [(n.module, [a.name for a in n.names]) for n in _imports(ast.parse(source))]
    assert found == [("typing", ["TYPE_CHECKING"]), ("distutils_ml.objects", ["_y"])]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


#: Protected methods of ``Backend`` (backends/base.py): the contract between a backend and the collectives layer
#: above it (the primitives, the entry protocol, the debug check). Modules above may call them on a backend.
BACKEND_CONTRACT = frozenset(
    node.name
    for node in next(
        n
        for n in ast.parse((PACKAGE / "backends" / "base.py").read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "Backend"
    ).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__")
)

#: Private names of other libraries the package uses on purpose, each with why.
OUTSIDE_PRIVATES = {
    "_C": "torch._C._current_graph_task_id: the autograd pass a hook runs in (no public equivalent)",
    "_current_graph_task_id": "see _C",
    "_execution_engine": "torch.autograd.Variable._execution_engine.queue_callback: DDP's end-of-backward callback",
    "_BatchNorm": "torch.nn.modules.batchnorm._BatchNorm: the base class SyncBatchNorm conversion looks for",
    "_foreach_norm": "torch._foreach_norm: clip_grad_norm_ as torch computes it",
    "_foreach_mul_": "torch._foreach_mul_: clip_grad_norm_ as torch computes it",
    "_getframe": "sys._getframe: the call site debug mode reports",
    "_fields": "a namedtuple's public field list",
    "_Options": "torch's ProcessGroupGloo._Options: a gloo group's device (the interface) and timeout, without the "
    "process-wide GLOO_SOCKET_IFNAME",
    "_devices": "see _Options",
    "_version": "torch.Tensor._version: the in-place version counter autograd checks; step_during_backward's check "
    "that no gradient changed after it was stepped",
    "_timeout": "see _Options",
    "_untyped_storage": "torch's TypedStorage._untyped_storage, as torch.save reads it: the object broadcasts' "
    "storages sent beside the pickle (the public .untyped() warns that TypedStorage is deprecated, on every call)",
    "_reconstruct": "numpy's multiarray._reconstruct, the global an array's pickle names: allowed by dml.load under "
    "weights_only, as torch's documentation shows for NumPy arrays",
}


def private_reach(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each private attribute read or written on something other than ``self``/``cls``/``super()``
    that this module does not define itself (its own functions, classes, or ``self.<name>`` attributes)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            own.add(node.attr)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        target = node.value
        if isinstance(target, ast.Name) and target.id in ("self", "cls"):
            continue
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super":
            continue
        if node.attr in own or node.attr in BACKEND_CONTRACT or node.attr in OUTSIDE_PRIVATES:
            continue
        found.append((node.lineno, node.attr))
    return found


def test_no_module_reaches_into_another_modules_objects() -> None:
    reach = [
        f"{module} (line {line}) uses .{name}" for module, path in MODULES.items() for line, name in private_reach(path)
    ]
    assert not reach, (
        "private attributes of objects another module defines (give their owner a public method or property; a "
        "backend's protected methods are the contract only where backends/base.py's Backend declares them):\n"
        + "\n".join(reach)
    )


def test_the_reach_check_sees_reads_and_writes(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "class A:\n    def __init__(self):\n        self._mine = 1\n"
        "    def f(self, other):\n        other._theirs = self._mine + other._mine\n        other._allreduce()\n"
        "        return other._elsewhere\n"
    )
    assert private_reach(source) == [(5, "_theirs"), (7, "_elsewhere")]
