"""The MPI job of tests/test_sharded.py: ``mpiexec -n N python tests/sharded_job.py [CHECK...]``.

Every rank runs the bodies of tests/sharded_bodies.py that LocalBackend runs too. Three checks take a
path: ``save=PATH[,avg]`` trains 3 steps and saves a checkpoint there (``dml.save``); ``resume=PATH,OUT[,avg]
[,unsharded]`` loads it (saved by a job of any size), checks that the state right after loading is the saved
one, trains 3 more steps and saves the result to OUT; ``run=OUT,STEPS[,avg]`` trains STEPS steps from scratch
and saves the result to OUT. Without ``avg`` every rank trains on the same data with ``dml.MAX``, with it each
rank on its own batch with ``dml.AVG`` (``sharded_bodies.resume_body``); ``unsharded`` resumes with
``shard_state=False``. ``ring`` (not run by default) needs ``DML_TRANSPORT=gloo``. Rank 0 ends with
``SHARDED CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
from typing import Any

import distutils_ml as dml

import sharded_bodies as sb
from mpi_main import guarded, hypothesis_check, run_checks


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)

    def variants() -> int:
        for kind in ("sgd", "adam"):
            for changes in sb.VARIANTS.values():
                guarded(sb.equivalence_body, world, sb.fixed_case(kind, **changes))
        return 2 * len(sb.VARIANTS)

    def each(body: Any, *cases: Any) -> int:
        for case in cases:
            guarded(body, world, case)
        return len(cases)

    checks: dict[str, Any] = {
        "equivalence": lambda: hypothesis_check(world, sb.equivalence_body, sb.shard_cases(sb.KINDS), 12),
        "variants": variants,
        "kinds": lambda: each(sb.kinds_body, *sb.KINDS),
        "errors": lambda: [guarded(sb.errors_body, world, overlap) for overlap in (False, True)],
        "bad_input": lambda: each(sb.bad_input_body, *range(world.size)),
        "memory": lambda: guarded(sb.memory_body, world, (7, 30, 5)),
        "clip": lambda: each(sb.clip_body, 2.0, float("inf")),
        "clip_property": lambda: hypothesis_check(world, sb.clip_property_body, sb.clip_cases(), 15),
        "clip_no_sync": lambda: guarded(sb.clip_no_sync_body, world),
        "zero_in_place": lambda: each(sb.zero_in_place_body, "model", "opt"),
        "elementwise": lambda: len(guarded(sb.elementwise_body, world)),
        "special": lambda: each(sb.special_parameters_body, "adam", "adagrad"),
        "synchronize": lambda: guarded(sb.synchronize_body, world) or "ok",
        "extras": lambda: guarded(sb.extras_body, world) or "ok",
        "state": lambda: len(guarded(sb.state_to_body, world)),
        "state_memory": lambda: guarded(sb.state_memory_body, world, "cpu")["full"],
        "ring": lambda: guarded(sb.ring_body, world),
        "prefetch": lambda: [
            guarded(sb.prefetch_body, world, delay, kind) for delay in (0.0, 0.05) for kind in ("tied", "attending")
        ],
    }

    def run_check(name: str) -> Any:
        kind, _, given = name.partition("=")
        if kind not in ("save", "resume", "run"):
            return checks[name]()
        path, *rest = given.split(",")
        op = "avg" if "avg" in rest else "max"
        sharded = "unsharded" not in rest
        if kind == "save":
            return guarded(sb.save_body, world, path, 3, sharded, op)["step"]
        if kind == "resume":
            out, checkpoint = rest[0], guarded(sb.load_body, world, path, 3, sharded, op)
        else:  # run=OUT,STEPS
            out, checkpoint = path, guarded(sb.resume_body, world, int(rest[0]), None, sharded, op)
        dml.save(world, checkpoint, out)
        return checkpoint["step"]

    run_checks(world, names or [c for c in checks if c not in ("ring", "prefetch")], "SHARDED CHECKS PASSED", run_check)


if __name__ == "__main__":
    main(sys.argv[1:])
