"""``vispe bench scaling``: training throughput per process and peak memory per rank under DDP and FSDP2
(:func:`vispe.distributed.shard_model`) against one process, per encoding, on CPU (gloo) or CUDA (nccl).

Every strategy trains the same model on the same global batch: one process takes all of it, each of the
``--nproc`` processes of DDP / FSDP2 its share. Throughput is samples per second per process (median over timed
steps, after warm-up); "x one process" is that throughput times the process count over the single process's, the
scaling efficiency (1.0 = linear). Peak memory per rank is the bytes this rank keeps (its parameters, gradients and
optimizer state -- FSDP2's local shards) plus the step's peak above them (``torch.profiler`` allocator events on CPU,
``max_memory_allocated`` on CUDA), the largest over the ranks.

Usage::

    vispe bench scaling                                   # 2 CPU processes, none/learned/rope_mixed/comrope_ld/irpe/seqpe
    vispe bench scaling --device cuda --nproc 8           # the same on 8 GPUs
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main"]

#: The registry group whose encodings run without ``--encodings`` (records tagged ``groups=("scaling",)``: one per
#: family the published table covers; a new encoding joins by naming the group in its ``register_encoding``).
DEFAULT_GROUP = "scaling"
STRATEGIES = ("single", "ddp", "fsdp2")


def _model(encoding: str, depth: int, device: Any):
    import timm
    import torch

    import vispe  # noqa: F401

    torch.manual_seed(0)
    return timm.create_model("vispe_vit_small_patch4_32", pos_encoding=encoding, depth=depth, num_classes=10).to(device)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _measure(encoding: str, strategy: str, rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from vispe.benchmarks.speed_measure import _cpu_step_peak
    from vispe.distributed import shard_model

    device = torch.device(f"cuda:{rank}" if args["device"] == "cuda" else "cpu")
    model = _model(encoding, args["depth"], device).train()
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(model, device_ids=[rank] if device.type == "cuda" else None)
    elif strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        runner = shard_model(model, mesh=init_device_mesh(device.type, (world,)))
    else:
        runner = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batch = args["global_batch"] // world
    x = torch.randn(args["global_batch"], 3, 32, 32, generator=g)[rank * batch:(rank + 1) * batch].to(device)
    y = torch.randint(0, 10, (args["global_batch"],), generator=g)[rank * batch:(rank + 1) * batch].to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(runner(x), y)
        extra = model.auxiliary_loss()
        (loss if extra is None else loss + extra).backward()
        opt.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args["warmup"]):
        step()
    times = []
    for _ in range(args["steps"]):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    kept = _local_bytes(model.parameters()) + _local_bytes(p.grad for p in model.parameters())
    kept += _local_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync()
        peak = kept + torch.cuda.max_memory_allocated(device) - before
    else:
        opt.zero_grad(set_to_none=True)
        peak = kept + _cpu_step_peak(step)
    return {"step_s": statistics.median(times), "samples_per_s": batch / statistics.median(times), "peak_bytes": peak}


def _worker(rank: int, world: int, init_file: str, strategy: str, args: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args["threads"])
    backend = "nccl" if args["device"] == "cuda" else "gloo"
    if args["device"] == "cuda":
        torch.cuda.set_device(rank)
    # a file rendezvous: no TCP port to race for with other jobs on the machine
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        rows = {}
        for enc in args["encodings"]:
            try:
                rows[enc] = _measure(enc, strategy, rank, world, args)
            except Exception as err:  # one encoding's failure is a row, not the end of the run
                rows[enc] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()
    from vispe.distributed import end_spawned_worker

    end_spawned_worker()  # the rows are written: no interpreter finalization racing gloo's threads



def run(args: dict[str, Any], log=print) -> list[dict[str, Any]]:
    """Measure every encoding under one process and under each multi-process strategy; the rows of the table."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    torch.set_num_threads(args["threads"])
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for enc in args["encodings"]:
        log(f"[single] {enc}")
        try:
            results[(enc, "single")] = _measure(enc, "single", 0, 1, args)
        except Exception as err:
            results[(enc, "single")] = {"error": f"{type(err).__name__}: {err}"}
    for strategy in args["strategies"]:
        if strategy == "single":
            continue
        log(f"[{strategy}] {args['nproc']} processes: {', '.join(args['encodings'])}")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ranks.json")
            mp.spawn(_worker, args=(args["nproc"], os.path.join(tmp, "rendezvous"), strategy, args, out), nprocs=args["nproc"],
                     join=True)
            per_rank = json.loads(Path(out).read_text())
        for enc in args["encodings"]:
            ranks = [r[enc] for r in per_rank]
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:
                results[(enc, strategy)] = {"error": errors[0]}
                continue
            results[(enc, strategy)] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in ranks),
                                        "step_s": max(r["step_s"] for r in ranks),
                                        "peak_bytes": max(r["peak_bytes"] for r in ranks)}
    rows = []
    for enc in args["encodings"]:
        one = results[(enc, "single")]
        for strategy in args["strategies"]:
            r = dict(results[(enc, strategy)])
            n = 1 if strategy == "single" else args["nproc"]
            row = {"encoding": enc, "strategy": strategy, "processes": n, **r}
            if "error" not in r and "error" not in one:
                row["efficiency"] = r["samples_per_s"] * n / one["samples_per_s"]
                row["memory_x_one_process"] = r["peak_bytes"] / one["peak_bytes"]
            rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = "| encoding | strategy | processes | samples/s per process | x one process (efficiency) | peak MiB per rank | memory x one process |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['encoding']} | {r['strategy']} | {r['processes']} | error: {r['error'][:80]} | | | |")
            continue
        eff = r.get("efficiency")
        mem = r.get("memory_x_one_process")
        lines.append(f"| {r['encoding']} | {r['strategy']} | {r['processes']} | {r['samples_per_s']:.1f} | "
                     f"{'-' if eff is None else f'{eff:.2f}'} | {r['peak_bytes'] / 2**20:.1f} | {'-' if mem is None else f'{mem:.2f}'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from vispe._checks import did_you_mean

    from vispe.benchmarks.grid import benchmark_parser

    p = benchmark_parser("vispe bench scaling", __doc__.split("\n\n")[0], "plain")
    p.add_argument("--encodings", default=None,
                   help=f"comma-separated registry names (default: the registry group {DEFAULT_GROUP!r}, "
                   f"vispe.list_encodings(groups={DEFAULT_GROUP!r}))")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"from {list(STRATEGIES)}")
    p.add_argument("--nproc", type=int, default=2, help="processes of the multi-process strategies")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--depth", type=int, default=4, help="transformer blocks of the ViT-S/4 model at 32 px")
    p.add_argument("--global-batch", type=int, default=32, help="samples per step over all processes")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--out-dir", default="outputs/bench_scaling")
    a = p.parse_args(list(argv) if argv is not None else None)
    from vispe.encodings import get_encoding_class, list_encodings

    text = ",".join(list_encodings(groups=DEFAULT_GROUP)) if a.encodings is None else a.encodings
    encodings = [e.strip() for e in text.split(",") if e.strip()]
    strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]

    for e in encodings:
        get_encoding_class(e)  # an unknown name fails before any process starts
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"--strategies: unknown strategy {s!r}; choose from {list(STRATEGIES)}{did_you_mean(s, STRATEGIES)}")
    for name, v, lo in (("--nproc", a.nproc, 2), ("--depth", a.depth, 1), ("--steps", a.steps, 1), ("--warmup", a.warmup, 0),
                        ("--threads", a.threads, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if a.global_batch < a.nproc or a.global_batch % a.nproc:
        raise ValueError(f"--global-batch {a.global_batch} must be a positive multiple of --nproc {a.nproc}")
    if a.device == "cuda":
        import torch

        if torch.cuda.device_count() < a.nproc:
            raise ValueError(f"--device cuda --nproc {a.nproc}: this machine has {torch.cuda.device_count()} GPU(s)")
    args = {"encodings": encodings, "strategies": ["single", *[s for s in strategies if s != "single"]], "nproc": a.nproc,
            "device": a.device, "depth": a.depth, "global_batch": a.global_batch, "steps": a.steps, "warmup": a.warmup,
            "threads": a.threads}
    t0 = time.perf_counter()
    rows = run(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    import platform

    import torch

    from vispe.benchmarks.speed_report import _machine

    meta = {"command": "vispe bench scaling " + " ".join(argv or sys.argv[1:]), "machine": _machine(torch.device(a.device)),
            "torch": torch.__version__, "python": platform.python_version(), "wall_s": round(time.perf_counter() - t0, 1),
            "loadavg": os.getloadavg(), "date": datetime.date.today().isoformat(), **{k: v for k, v in args.items()}}
    out = Path(a.out_dir)
    from vispe.files import write_json_atomic, write_text_atomic

    write_json_atomic(out / "scaling.json", {"meta": meta, "rows": rows})
    table = format_table(rows)
    write_text_atomic(out / "scaling.md", f"{table}\n\n{meta['machine']}, torch {meta['torch']}, wall {meta['wall_s']} s: `{meta['command']}`\n")
    print(table)
    print(f"\nwall time {meta['wall_s']} s on {meta['machine']}; wrote {out / 'scaling.json'} and {out / 'scaling.md'}")
    return 0
