"""What the first write of a fresh tensor costs, on huge pages and on 4 KiB pages, reused at once or after a pause.

One process, no MPI. Run it twice, once with torch's large tensors on transparent huge pages (what
``distutils-ml launch`` gives ranks) and once without::

    THP_MEM_ALLOC_ENABLE=1 .venv/bin/python benchmarks/hugepages.py [--mib 64] [--pauses 0,10,20]
    THP_MEM_ALLOC_ENABLE=0 .venv/bin/python benchmarks/hugepages.py

For each pause it writes a tensor of ``--mib`` MiB, frees it, sleeps the pause, then times the first
write of a new tensor of the same size (wall and the process's system time), ``--reps`` times. In a
virtual machine whose balloon device reports free memory to the host (virtio-balloon free page
reporting, ``/sys/module/page_reporting/parameters/page_reporting_order``), 2 MiB blocks that stayed
free for a few seconds were handed back to the host, and huge pages made of them are slow to touch
again; 4 KiB pages do not change. ``--json PATH`` writes every time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path


def _system_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def first_write(numel: int, pause_s: float) -> tuple[float, float]:
    """(wall s, system s) of the first write of a fresh tensor, after one as large was freed ``pause_s`` ago."""
    import torch

    old = torch.empty(numel)
    old.fill_(2.0)
    del old
    time.sleep(pause_s)
    s0, t0 = _system_s(), time.perf_counter()
    new = torch.empty(numel)
    new.fill_(1.0)
    wall = time.perf_counter() - t0
    del new
    return wall, _system_s() - s0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="tensor size in MiB (default 64)")
    ap.add_argument("--pauses", default="0,10,20", help="comma-separated seconds between free and reuse")
    ap.add_argument("--reps", type=int, default=4, help="times per pause (default 4)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    reporting = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    order = reporting.read_text().strip() if reporting.exists() else None
    print(f"THP_MEM_ALLOC_ENABLE={thp}; free page reporting order: {order or 'none'}; {args.mib} MiB tensors")
    numel = args.mib * 2**20 // 4
    results = {}
    for pause in (float(p) for p in args.pauses.split(",")):
        runs = [first_write(numel, pause) for _ in range(args.reps)]
        results[str(pause)] = {"wall_s": [w for w, _ in runs], "system_s": [s for _, s in runs]}
        walls = " ".join(f"{w * 1e3:.0f}" for w, _ in runs)
        median = statistics.median(w for w, _ in runs)
        print(f"reused after {pause:g} s: first write {walls} ms (median {median * 1e3:.0f})")
    if args.json:
        meta = {"thp": thp, "page_reporting_order": order, "mib": args.mib}
        Path(args.json).write_text(json.dumps({"args": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
