"""The allreduce and training-step comparisons across two nodes joined by a shaped network link.

Run as root from the repository root (it makes network namespaces; nothing else on the machine
is touched, and everything is removed at the end)::

    .venv/bin/python benchmarks/network.py [--links 10gbit:0.1,1gbit:1] [--json-dir DIR]

For each link (rate, one-way delay in ms) it brings up a 2-node cluster (tests/cluster.py) whose
nodes are joined by tests/delayline.py's shaped link: a TUN device per node, a real-time relay
that holds every packet for the delay, and a tbf qdisc for the rate (this kernel has no netem).
Then, one rank per node:

1. the link alone: round trip and one TCP stream's throughput (tests/delayline.py's probe);
2. ``benchmarks/allreduce.py``: dml.allreduce (torch and NumPy) vs raw mpi4py vs gloo, 4 KiB-64 MiB,
   interleaved in one job; bus bandwidth (2(W-1)/W x bytes / time) against the link's rate;
3. ``benchmarks/ddp.py``: the DistributedOptimizer step vs torch DDP over gloo vs compute only
   (``ideal_local``); *exposed communication* = step - compute only.

Prints markdown tables (pasted into docs/benchmarks/network.md) and writes each job's JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import timeline  # noqa: E402 - benchmarks/timeline.py (beside this script)

import cluster  # noqa: E402 - tests/cluster.py, found through the path above
import delayline  # noqa: E402

PYTHON = str(Path(sys.executable))
SIZES = "4K,64K,1M,16M,64M"


def parse_link(text: str) -> tuple[str, float, float]:
    """``"10gbit:0.1"`` -> (label, bit/s, one-way delay in s)."""
    rate, _, delay_ms = text.partition(":")
    bits = delayline.parse_rate(rate)
    if bits is None or not delay_ms:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RATE:DELAY_MS, e.g. 10gbit:0.1")
    return f"{rate} / {delay_ms} ms", bits, float(delay_ms) / 1e3


def probe(c: cluster.Cluster) -> dict[str, Any]:
    """Round trip and one TCP stream between the nodes, before any MPI job."""
    with delayline.server(c.namespaces[1], c.addresses[1]):
        return delayline.client(c.namespaces[0], c.addresses[1], pings=300, mib=64)


def mpi_job(
    c: cluster.Cluster, script: str, args: list[str], json_path: Path, timeout: float, *, thp: str = "1"
) -> dict[str, Any]:
    """Run ``script`` on 2 ranks, one per node, with gloo on the link too; its JSON. ``thp``: the ranks'
    ``THP_MEM_ALLOC_ENABLE`` (``distutils-ml launch`` gives 1)."""
    argv = [*c.mpiexec_argv(2), "-x", f"PYTHONPATH={ROOT}:{ROOT / 'tests'}", "-x", f"MASTER_ADDR={c.addresses[0]}"]
    argv += ["-x", "GLOO_SOCKET_IFNAME=eth0", "-x", "OMP_NUM_THREADS=1", "-x", f"THP_MEM_ALLOC_ENABLE={thp}"]
    # One core per node, core k for node k: each node's mpiexec daemon would bind its rank to core 0,
    # putting both "nodes" on one core of this machine.
    command = shlex.join([PYTHON, str(ROOT / "benchmarks" / script), *args, "--json", str(json_path)])
    argv += ["--bind-to", "none", "sh", "-c", f'exec taskset -c "$OMPI_COMM_WORLD_RANK" {command}']
    run = c.run(argv, timeout=timeout, cwd=ROOT)
    print(run.output[-6000:], flush=True)
    if run.returncode != 0:
        raise SystemExit(f"{script} failed on the cluster ({run.returncode})")
    return json.loads(json_path.read_text())


def allreduce_table(label: str, rate: float, res: dict[str, Any]) -> str:
    rows = ["| size | raw mpi4py | dml_numpy | dml_torch | gloo | dml_numpy / raw | dml_torch / raw | "
            "dml busbw / link | raw busbw / link |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for nbytes, r in sorted(res["results"].items(), key=lambda kv: int(kv[0])):
        link_Bps = rate / 8
        cell = {k: v["median_s"] for k, v in r.items()}
        size = int(nbytes)
        rows.append(
            f"| {_bytes(size)} | {_t(cell['mpi4py_numpy'])} | {_t(cell['dml_numpy'])} | {_t(cell['dml_torch'])} | "
            f"{_t(cell.get('gloo'))} | {r['dml_numpy']['ratio']:.2f} ({r['dml_numpy']['diff_us']:+.0f} us) | "
            f"{r['dml_torch']['ratio']:.2f} ({r['dml_torch']['diff_us']:+.0f} us) | "
            f"{r['dml_numpy']['busbw_GBps'] * 1e9 / link_Bps:.2f} | "
            f"{r['mpi4py_numpy']['busbw_GBps'] * 1e9 / link_Bps:.2f} |"
        )
    return f"#### allreduce, {label}\n\n" + "\n".join(rows)


def step_table(label: str, res: dict[str, Any], comm_s: dict[str, float] | None = None) -> str:
    rows = ["| model | compute only | dml step | dml step, reduced after backward | DDP (gloo) step | "
            "dml / DDP | exposed comm dml | exposed comm dml after | exposed comm DDP | dml / max(compute, comm) |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, r in res["results"].items():
        cs = r["contenders"]
        comp, dml, ddp = (statistics.median(cs[k]["times_s"]) for k in ("ideal_local", "dml", "ddp_gloo"))
        after = statistics.median(cs["dml_after"]["times_s"]) if "dml_after" in cs else None
        comm = comm_s.get(model) if comm_s else None
        limit = f"{dml / max(comp, comm):.2f}" if comm else "-"
        rows.append(
            f"| {model} ({r['nparams'] / 1e6:.1f} M) | {_t(comp)} | {_t(dml)} | {_t(after)} | {_t(ddp)} | "
            f"{dml / ddp:.2f} | {_t(dml - comp)} | {_t(after - comp if after else None)} | {_t(ddp - comp)} | "
            f"{limit} |"
        )
    if comm_s:
        rows.append("")
        rows.append(
            "comm = one allreduce of all the model's gradients with dml on this link (time of the "
            "allreduce job's nearest size, scaled by bytes): " + ", ".join(f"{m} {_t(c)}" for m, c in comm_s.items())
        )
    return f"#### training step, {label}\n\n" + "\n".join(rows)


def shard_table(label: str, res: dict[str, Any]) -> str | None:
    """Sharded optimizer state (dml_shard) against the unsharded dml and torch's ZeroRedundancyOptimizer."""
    rows = ["| model | dml step | dml_shard step | zero_gloo step | shard / dml | shard / zero | "
            "optimizer state per rank: dml / shard / zero |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, r in res["results"].items():
        cs = r["contenders"]
        if not {"dml", "dml_shard", "zero_gloo"} <= set(cs):
            return None
        dml, shard, zero = (statistics.median(cs[k]["times_s"]) for k in ("dml", "dml_shard", "zero_gloo"))
        names = ("dml", "dml_shard", "zero_gloo")
        mib = " / ".join(f"{cs[k].get('state_bytes_max_rank', 0) / 2**20:.1f}" for k in names)
        rows.append(
            f"| {model} ({r['nparams'] / 1e6:.1f} M) | {_t(dml)} | {_t(shard)} | {_t(zero)} | {shard / dml:.2f} | "
            f"{shard / zero:.2f} | {mib} MiB |"
        )
    return f"#### sharded optimizer state, {label}\n\n" + "\n".join(rows)


def forms_table(label: str, res: dict[str, Any], comm_s: dict[str, float]) -> str | None:
    """The optimizer's forms against DDP over gloo and the limit: dml, step_during_backward (dml_sdb), sharded
    (dml_shard) and sharded with step_during_backward (dml_shard_sdb), those of them that ran."""
    ran = set.intersection(*(set(r["contenders"]) for r in res["results"].values())) if res["results"] else set()
    names = [k for k in ("dml", "dml_sdb", "dml_shard", "dml_shard_sdb") if k in ran]
    head = " | ".join(f"{k} step" for k in names)
    by_ddp = " | ".join(f"{k} / DDP" for k in names)
    by_limit = " | ".join(f"{k} / max(compute, comm)" for k in names)
    rows = [f"| model | {head} | DDP (gloo) step | {by_ddp} | {by_limit} |", "|---" * (2 + 3 * len(names)) + "|"]
    for model, r in res["results"].items():
        cs = r["contenders"]
        if len(names) < 3 or not {"ideal_local", "ddp_gloo", *names} <= set(cs):
            return None
        comp, ddp = (statistics.median(cs[k]["times_s"]) for k in ("ideal_local", "ddp_gloo"))
        steps = [statistics.median(cs[k]["times_s"]) for k in names]
        limit = max(comp, comm_s[model])
        rows.append(
            f"| {model} ({r['nparams'] / 1e6:.1f} M) | {' | '.join(_t(t) for t in steps)} | {_t(ddp)} | "
            f"{' | '.join(f'{t / ddp:.2f}' for t in steps)} | {' | '.join(f'{t / limit:.2f}' for t in steps)} |"
        )
    return f"#### the optimizer's forms, {label}\n\n" + "\n".join(rows)


def model_comm(ar: dict[str, Any], st: dict[str, Any]) -> dict[str, float]:
    """Seconds one dml allreduce of each model's gradients takes on the link: the measured size nearest to the
    model's gradient bytes (at or above it when there is one), scaled linearly by bytes."""
    sizes = {int(k): v for k, v in ar["results"].items()}
    out = {}
    for model, r in st["results"].items():
        nbytes = r["nparams"] * 4
        above = [n for n in sizes if n >= nbytes]
        n = min(above) if above else max(sizes)
        out[model] = sizes[n]["dml_numpy"]["median_s"] * nbytes / n
    return out


def _t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="10gbit:0.1,1gbit:1", help="comma-separated RATE:DELAY_MS (one-way)")
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--models", default="mlp2m,deep36,mlp25m")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step of the training comparison")
    ap.add_argument("--opt", choices=["sgd", "adam"], default="sgd", help="the training comparison's optimizer")
    ap.add_argument("--only", default="ideal_local,ddp_gloo,dml_after,dml", help="benchmarks/ddp.py's contenders")
    ap.add_argument("--no-steps", action="store_true", help="the allreduce comparison only")
    ap.add_argument("--dml-buckets", default="", help="benchmarks/ddp.py's --dml-buckets (dml_bb<S> contenders)")
    ap.add_argument("--json-dir", default="benchmarks/results", help="where each job's JSON goes")
    ap.add_argument("--timeline", action="store_true", help="also benchmarks/timeline.py (5 forms)")
    ap.add_argument("--tag", default="", help="appended to the result files' names (-TAG)")
    ap.add_argument(
        "--thp", choices=["0", "1"], default="1",
        help="the ranks' THP_MEM_ALLOC_ENABLE (default 1, as distutils-ml launch sets it; 0: torch's default)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    reason = cluster.unavailable() or delayline.missing_requirements(need_tc=True)
    if reason:
        print(f"network benchmarks: {reason}", file=sys.stderr)
        return 2
    out = Path(args.json_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = []
    for text in args.links.split(","):
        label, rate, delay = parse_link(text)
        tag = text.replace(":", "_").replace(".", "p") + (f"-batch{args.batch}" if args.batch != 64 else "")
        tag += "" if args.opt == "sgd" else f"-{args.opt}"
        tag += f"-{args.tag}" if args.tag else ""
        start = time.monotonic()
        with cluster.cluster(2, 1, link=(rate, delay)) as c:
            alone = probe(c)
            print(f"## {label}: the link alone: {_probe_text(alone)}", flush=True)
            ar = mpi_job(c, "allreduce.py", ["--sizes", args.sizes, "--reps", str(args.reps)],
                         out / f"network-allreduce-{tag}.json", timeout=900, thp=args.thp)  # fmt: skip
            st = None if args.no_steps else mpi_job(
                c, "ddp.py", ["--models", args.models, "--steps", str(args.steps), "--warmup", "2",
                              "--batch", str(args.batch), "--opt", args.opt, "--only", args.only,
                              *(["--dml-buckets", args.dml_buckets] if args.dml_buckets else [])],
                out / f"network-ddp-{tag}.json", timeout=900, thp=args.thp,
            )  # fmt: skip
            lines = []
            sdb = "--step-during-backward"
            variants = [[], [sdb], ["--shard"], ["--prefetch"], ["--shard", sdb]]
            for extra in variants if args.timeline else []:
                suffix = "".join(e.replace("--", "-") for e in extra)
                res = mpi_job(
                    c, "timeline.py", ["--models", args.models, "--batch", str(args.batch), "--opt", args.opt, *extra],
                    out / f"network-timeline-{tag}{suffix}.json", timeout=900, thp=args.thp,
                )  # fmt: skip
                lines += [timeline.describe(r) for r in res["results"]]
        tables += [f"### {label}\n\nThe link alone: {_probe_text(alone)}.", allreduce_table(label, rate, ar)]
        tables += [step_table(label, st, model_comm(ar, st))] if st and "ddp_gloo" in args.only else []
        sharded = shard_table(label, st) if st else None
        tables += [sharded] if sharded else []
        forms = forms_table(label, st, model_comm(ar, st)) if st else None
        tables += [forms] if forms else []
        tables += ["```text\n" + "\n".join(lines) + "\n```"] if args.timeline else []
        tables.append(f"({time.monotonic() - start:.0f} s)")
    print("\n\n".join(tables))
    return 0


def _probe_text(r: dict[str, Any]) -> str:
    rtt = statistics.median(r["tcp_rtt_s"]) * 1e6
    gbit = r["bytes"] * 8 / r["seconds"] / 1e9
    return f"round trip {rtt:.0f} us (TCP ping-pong, median), one TCP stream {gbit:.2f} Gbit/s"


if __name__ == "__main__":
    sys.exit(main())
