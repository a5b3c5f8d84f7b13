"""Benchmark: save and load throughput of fxpar's sharded checkpoints beside torch's own DCP, and the memory a rank
needs to load a model built on the meta device.

    fxpar t=2        fxpar.save / fxpar.load of the example GPT at t=2 with AdamW's state: each rank writes its
                     shards (the head-interleaved ones as several chunks) and the manifest; load reads them back
    torch DCP        torch.distributed.checkpoint.save / load of the unsharded model's state_dict and the same
                     AdamW state on every rank (d=2: DCP's deduplication splits the replicated tensors between
                     the ranks), the peer a user would otherwise pick

Both write the same bytes of weights and Adam's state, each save into a new directory (removed, untimed, after it
is timed), as a training run saves step after step. The variants run interleaved for R rounds
(common.time_rounds); the table shows MiB/s per rank (a save: checkpoint bytes / ranks; a load: the bytes the rank
reads, its shards for fxpar and the whole checkpoint for torch's unsharded model; over the median seconds) and the
median per-round ratio of the times to torch's. Then, each in fresh processes: the peak resident memory a rank adds
to build the model on the meta device, parallelize it and fxpar.load it, at t=1 (one rank) and t=2 (two ranks),
against the model's own bytes.

Run (2 ranks over gloo, 1 thread each):
    .venv/bin/python benchmarks/checkpoint_io.py
    .venv/bin/python benchmarks/checkpoint_io.py --hidden 1024 --rounds 5
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
import shutil
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

if __package__:
    from benchmarks import common
else:
    import common

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

VARIANTS = ("fxpar t=2", "torch DCP")


def _config(args) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                     attention="sdpa")


def _trained(args):
    """The model, one microbatch, and an AdamW state after one step of the unmodified model."""
    torch.manual_seed(0)
    model = GPT(_config(args))
    ids = torch.randint(0, args.vocab, (2, args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn(model(ids), ids).backward()
    opt.step()
    return model, opt, ids


def run_throughput(args) -> dict:
    import fxpar

    model, opt, ids = _trained(args)
    pm = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(tp=dist.get_world_size()), example_args=(ids,),
                           loss_fn=loss_fn, example_target=ids)
    popt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
    popt.zero_grad()
    pm.step(ids, target=ids)
    popt.step()
    plain = {f"model/{k}": v for k, v in model.state_dict().items()}
    plain |= {f"optim/{k}/{n}": t for (k, p) in model.named_parameters() for n, t in opt.state[p].items()}
    root = _shared_tmp()
    paths = {name: os.path.join(root, name.replace(" ", "_")) for name in VARIANTS}

    def fx_save():
        fxpar.save(paths["fxpar t=2"], pm, optimizer=popt)

    def fx_load():
        fxpar.load(paths["fxpar t=2"], pm, optimizer=popt)

    def torch_save():
        dcp.save(plain, checkpoint_id=paths["torch DCP"])

    def torch_load():
        dcp.load(plain, checkpoint_id=paths["torch DCP"])

    def remove(name):  # untimed: every save writes a new checkpoint, as a training run does
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(paths[name])
        dist.barrier()

    saves = common.time_rounds({"fxpar t=2": fx_save, "torch DCP": torch_save}, args.rounds, 1, 0, barrier=True,
                               reduce=dist.ReduceOp.MAX, after=remove)
    fx_save(), torch_save()
    loads = common.time_rounds({"fxpar t=2": fx_load, "torch DCP": torch_load}, args.rounds, 1, 1, barrier=True,
                               reduce=dist.ReduceOp.MAX)
    sizes = {name: _bytes(path) for name, path in paths.items()}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"save": saves["times"], "load": loads["times"], "bytes": sizes, "ranks": dist.get_world_size(),
            "config": vars(args)}


def run_meta_load(args) -> dict:
    """In fresh processes: the resident memory added by building on meta, parallelizing at t = world, loading."""
    import fxpar

    before = _rss_now()
    with torch.device("meta"):
        model = GPT(_config(args))
    ids = torch.randint(0, args.vocab, (2, args.seq))
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=dist.get_world_size()), example_args=(ids,), loss_fn=loss_fn,
                           example_target=ids)
    fxpar.load(args.checkpoint, pm)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    local = sum(t.numel() * t.element_size() for t in pm.rank.weights.held().values())
    return {"added": peak.item(), "local": local}


def _save_for_meta(args) -> dict:
    model, _, ids = _trained(args)
    import fxpar

    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    pm = fxpar.parallelize(model, fxpar.init_mesh(dp=dist.get_world_size()), example_args=(ids,), loss_fn=loss_fn,
                           example_target=ids)
    fxpar.save(args.checkpoint, pm)
    return {"model": size}


def _shared_tmp() -> str:
    """One temporary directory for all ranks (rank 0 makes it; the others receive its name)."""
    name = [tempfile.mkdtemp(prefix="fxpar-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        total = result["bytes"][name] / 2**20
        # per rank: a save writes 1/ranks of the bytes; a load reads this rank's shards (fxpar) or everything (torch)
        per_rank = {"save": total / result["ranks"], "load": total / result["ranks"] if name == VARIANTS[0] else total}
        row = [name, total]
        for kind in ("save", "load"):
            ratio, q1, q3 = common.paired_ratio(result[kind], name, "torch DCP")
            row += [per_rank[kind] / statistics.median(result[kind][name]), f"{ratio:.2f} ({q1:.2f}-{q3:.2f})"]
        rows.append(row)
    c = result["config"]
    head = (f"checkpoint of the example GPT layers={c['layers']} hidden={c['hidden']} vocab={c['vocab']} with AdamW "
            f"state, {result['ranks']} ranks over gloo, 1 thread/rank, {c['rounds']} interleaved rounds")
    table = tabulate(rows, headers=["variant", "MiB", "save MiB/s/rank", "time vs torch (IQR)", "load MiB/s/rank",
                                    "time vs torch (IQR)"], floatfmt=(None, ".1f", ".1f", None, ".1f", None))
    meta = result.get("meta")
    if meta:
        lines = [f"meta-device model ({meta['model'] / 2**20:.1f} MiB of weights) parallelized and loaded, peak "
                 "resident memory added per rank:"]
        for t, m in sorted(meta["by_t"].items()):
            lines.append(f"  t={t}: {m['added'] / 2**20:.1f} MiB added, {m['local'] / 2**20:.1f} MiB of local "
                         f"weights ({m['local'] / meta['model']:.2f} of the model)")
        table += "\n\n" + "\n".join(lines)
    return head + "\n" + table


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-meta", action="store_true", help="skip the meta-device memory measurement")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    result = common.launch(run_throughput, args)
    if result and not args.no_meta:
        with tempfile.TemporaryDirectory(prefix="fxpar-meta-") as tmp:
            args.checkpoint = os.path.join(tmp, "ckpt")
            meta = common.spawn(_save_for_meta, args, args.nproc, args.timeout)
            meta["by_t"] = {t: common.spawn(run_meta_load, args, t, args.timeout) for t in (1, args.nproc)}
        result["meta"] = meta
    if result:
        print(format_table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
