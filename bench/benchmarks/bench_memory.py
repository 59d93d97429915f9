"""Memory: per-rank model state under ZeRO 0-3 at 1 and 2 ranks, memory-state bytes per lane against the formula,
and both at 10x memory at evaluation.

    .venv/bin/python bench/benchmarks/bench_memory.py              # -> bench/results/memory_cpu.json (~6.5 min)
    .venv/bin/python bench/benchmarks/bench_memory.py --skip-zero  # only the state and evaluation figures (~2.5 min)

Bench shape (bench_trainer.py's, at N = M = 128): 4 layers, d_model 256, 4 x 64 heads, d_inner 1024, vocabulary
8192 (one plain softmax, tied), N = M = 128, B = 8 lanes per rank, fp32, Adam (DeepSpeed's torch Adam). Corpus:
WikiText-2 (../shared/data/wikitext-2) prepared with an 8k BPE sentencepiece model, as bench_trainer.py does.
Every process runs with OMP_NUM_THREADS=1 (2 ranks x 1 thread on this 2-core machine); load averages are recorded.

1. ZeRO. One fresh process per (stage, world size): the real Trainer, opened as `memlm train` opens it and stepped
   through its public entry (open_trainer, build, train_step: trainer/loop/train.py; txl, tracking off) for --steps
   optimizer steps, 2 ranks under torchrun, with no checkpoint at the end (fit() would write one, whose write adds
   its own transient to the peak). After build(), the engine's step is wrapped (StepWatch): on the last step it
   takes an inventory of the model-state tensors this rank holds right before engine.step (after the backward:
   gradients live) and right after it. Inventory: every tensor reachable from the module's parameters (p.data, and
   ZeRO-3's partition p.ds_tensor), their .grad, the inner torch optimizer's state (Adam moments) and param groups
   (ZeRO's fp32 master partitions), then every other tensor attribute of the ZeRO optimizer (gradient partitions,
   reduction buckets); deduplicated by storage, counted as storage bytes allocated and as bytes resident
   (pages present in /proc/self/pagemap: a bucket allocated with torch.empty but never written costs address
   space, not memory). Also per rank: RSS when the process starts training (runtime imported, nothing built), the
   peak RSS (getrusage, as the trainer's peak_mem_mb; after every step too, the figure a metrics row reports).
   Expectation (psi parameters, 4 bytes each, W ranks): ZeRO-0 params 4psi + grads 4psi + Adam moments 8psi (the
   fp32 parameters are the master weights); ZeRO-1 params 4psi + grads 4psi + (fp32 master 4psi + moments 8psi)/W;
   ZeRO-2 also grads 4psi/W; ZeRO-3 also params 4psi/W. DeepSpeed keeps its own fp32 master copy even for an fp32
   model, so ZeRO >= 1 at one rank holds 20psi against ZeRO-0's 16psi.
2. Memory state per lane, every arch (transformer, txl, lamemo, rmt with R = 10 memory tokens, rmt + the
   Transformer-XL cache M = 128) in one process, no DeepSpeed: bytes of out.memory after two segments of real
   batches, walking the dataclass fields (numel x element size; "logical"), and the bytes of the storages those
   tensors keep alive ("retained": a slice like keys_in[:, -M:] keeps the whole [B, M + N, D] tensor), divided by
   the lanes, against the formula from the memory dataclasses (TXLMemory in models/txl.py, LaMemoMemory in
   models/lamemo.py, RMTMemory in models/rmt.py: what each field holds per lane). RMT's window BPTT replay window
   (trainer.loop.recurrence.WindowBPTT, k = 3 segments of tokens, targets, reset flags and the caches they read) is a
   separate row. At M and at 10 x M (the configuration `memlm eval --mem-mult 10` builds).
3. Evaluation pass at M = 128 against M = 1280: one fresh process per case, trainer.inference.evaluate.evaluate (the
loop of
   `memlm eval`) over --eval-batches batches of the valid split, 8 lanes, model built by eval_model_config from a
   run config with eval.mem_mult 10 (random weights: the memory use does not depend on them). Figure: the rise of
   the process's peak RSS over its RSS just before the pass (the high-water mark is reset through
   /proc/self/clear_refs, so model building does not mask it); torch has no CPU allocator statistics.
Never part of the test suite; nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memlm.bench.benchmarks.bench_trainer import prepare_corpus  # WikiText-2 with the 8k BPE (V below)
from memlm.bench.common import RESULTS, ROOT, child_env, load_average, write_result
from memlm.bench.interrupt import stop_in_one_line

MiB = 2**20
WORKER_ENV = {"OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "2"}  # 1 thread per process; a rank left waiting: 2 min

L, D, H, E, F, V = 4, 256, 4, 64, 1024, 8192
N = M = 128
LANES = 8
R_TOKENS = 10
K_BPTT = 3
MULT = 10
# (label, arch, mem_len, extra model overrides)
STATE_CASES = [
    ("transformer", "transformer", 0, {}),
    ("txl", "txl", M, {}),
    ("lamemo", "lamemo", M, {}),
    (f"rmt (R={R_TOKENS})", "rmt", 0, {"model.num_mem_tokens": R_TOKENS, "model.bptt_depth": K_BPTT}),
    (f"rmt (R={R_TOKENS}) + cache", "rmt", M, {"model.num_mem_tokens": R_TOKENS, "model.bptt_depth": K_BPTT}),
]


# ---------------------------------------------------------------------------------------------------------------
# Configuration


def overrides(data: Path, arch: str, mem_len: int, **extra) -> dict:
    base = {
        "model.arch": arch, "model.n_layer": L, "model.n_head": H, "model.d_head": E, "model.d_model": D,
        "model.d_inner": F, "model.vocab_size": V, "model.tgt_len": N, "model.mem_len": mem_len,
        "model.dropout": 0.0, "model.dropatt": 0.0, "data.path": str(data), "data.batch_size": LANES,
        "train.warmup_steps": 0, "train.lr": 2.5e-4, "train.save_every": 0, "train.keep_last": 1,
        "train.eval_every": 0, "train.log_every": 1, "tracking.enabled": False, "deepspeed.precision": "fp32",
    }
    base.update(extra)
    return base


# ---------------------------------------------------------------------------------------------------------------
# Process memory


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    """Peak RSS (VmHWM) of this process; resettable through reset_hwm()."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def resident(ptr: int, nbytes: int) -> int:
    """Bytes of [ptr, ptr + nbytes) in pages present in memory (or swapped), from /proc/self/pagemap."""
    import numpy as np

    if nbytes <= 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = ptr // page, (ptr + nbytes - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    except OSError:
        return nbytes
    present = ((entries >> np.uint64(63)) | (entries >> np.uint64(62))) & np.uint64(1)
    return min(nbytes, int(present.sum()) * page)


# ---------------------------------------------------------------------------------------------------------------
# Tensor inventory


class Inventory:
    """Tensors by category, each storage counted once (first category wins)."""

    def __init__(self):
        self.seen: dict[int, str] = {}
        self.rows: list[dict] = []

    def add(self, category: str, path: str, t) -> None:
        import torch

        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":  # meta tensors hold nothing
            return
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self.seen:
            return
        self.seen[ptr] = category
        self.rows.append({"category": category, "path": path, "shape": list(t.shape), "dtype": str(t.dtype),
                          "logical_bytes": t.numel() * t.element_size(), "storage_bytes": nbytes,
                          "resident_bytes": resident(ptr, nbytes)})

    def sweep(self, obj, path: str, category_of, depth: int = 4, visited: set | None = None) -> None:
        """Every tensor reachable through lists, dicts and DeepSpeed / torch.optim objects' attributes."""
        import torch

        visited = set() if visited is None else visited
        if id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.add(category_of(path), path, obj)
            if obj.is_leaf and obj.grad is not None:
                self.add("grads", path + ".grad", obj.grad)
        elif isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                self.sweep(x, f"{path}[{i}]", category_of, depth, visited)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self.sweep(v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", category_of, depth,
                           visited)
        elif depth > 0 and not isinstance(obj, torch.nn.Module) and hasattr(obj, "__dict__"):
            module = type(obj).__module__
            if module.startswith("deepspeed") or module.startswith("torch.optim"):
                for k, v in vars(obj).items():
                    self.sweep(v, f"{path}.{k}", category_of, depth - 1, visited)

    def totals(self) -> dict:
        out: dict = {}
        for row in self.rows:
            c = out.setdefault(row["category"], {"storage_bytes": 0, "resident_bytes": 0, "tensors": 0})
            c["storage_bytes"] += row["storage_bytes"]
            c["resident_bytes"] += row["resident_bytes"]
            c["tensors"] += 1
        return out


def other_category(path: str) -> str:
    """Category of a ZeRO optimizer attribute by its name: gradient partitions and reduction buckets (ipg) are
    gradients, fp32 partitions are master weights."""
    name = path.lower()
    if "grad" in name or "ipg" in name:
        return "grads"
    if "fp32" in name:
        return "master"
    return "other"


def model_state_inventory(engine) -> Inventory:
    import torch

    inv = Inventory()
    module = engine.module
    for name, p in module.named_parameters():
        inv.add("params", f"module.{name}", p.data)
        if hasattr(p, "ds_tensor"):
            inv.add("params", f"module.{name}.ds_tensor", p.ds_tensor)
    for name, p in module.named_parameters():
        if p.grad is not None:
            inv.add("grads", f"module.{name}.grad", p.grad)
    outer = engine.optimizer
    inner = outer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    for i, state in enumerate(getattr(inner, "state", {}).values()):
        for k, v in state.items():
            inv.add("adam_moments" if k != "step" else "other", f"inner.state[{i}].{k}", v)
    for g, group in enumerate(getattr(inner, "param_groups", [])):
        for j, p in enumerate(group["params"]):
            inv.add("master", f"inner.param_groups[{g}][{j}]", p)
            if p.grad is not None:
                inv.add("grads", f"inner.param_groups[{g}][{j}].grad", p.grad)
    if outer is not inner:
        inv.sweep(outer, "optimizer", other_category)
    return inv


def expected_bytes(psi: int, stage: int, world: int) -> dict:
    w = world
    return {
        "params": 4 * psi if stage < 3 else 4 * psi / w,
        "grads": 4 * psi if stage < 2 else 4 * psi / w,
        "master": 0 if stage == 0 else 4 * psi / w,
        "adam_moments": 8 * psi if stage == 0 else 8 * psi / w,
    }


# ---------------------------------------------------------------------------------------------------------------
# 1. ZeRO worker: one rank of a `memlm train` run, hooked


class StepWatch:
    """Stands in for a built trainer's engine.step (an instance attribute shadows DeepSpeedEngine.step): on the
    optimizer step it is armed for, the model-state inventory and the RSS right before the step (train_step calls
    it after the backward, so the gradients are live) and right after it."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step
        self.armed = False
        self.snapshots: dict[str, Inventory] = {}
        self.rss: dict[str, int] = {}
        engine.step = self

    def __call__(self, *args, **kwargs):
        watched = self.armed and self.engine.is_gradient_accumulation_boundary()
        if watched:
            self.snapshots["before_step"] = model_state_inventory(self.engine)
            self.rss["before_step"] = rss_bytes()
        result = self.step(*args, **kwargs)
        if watched:
            self.snapshots["after_step"] = model_state_inventory(self.engine)
            self.rss["after_step"] = rss_bytes()
        return result


def zero_worker(args) -> None:
    import torch

    from memlm.trainer.config.run_config import config_from_dict
    from memlm.trainer.loop.train import open_trainer, peak_memory_mb
    from memlm.trainer.runtime import distributed

    distributed.setup_env()
    torch.set_num_threads(1)
    import deepspeed  # noqa: F401  (the runtime a rank carries, imported before the baseline)

    rss_start = rss_bytes()
    ds_settings = {f"deepspeed.{k}": int(v) for k, v in (item.split("=", 1) for item in args.ds or [])}
    cfg = config_from_dict({}, overrides(Path(args.data), "txl", M, **{
        "train.steps": args.steps, "deepspeed.zero_stage": args.stage, **ds_settings}))
    # The trainer as `memlm train` runs it (data checked, run folder claimed, this process set up, then the engine,
    # the stream and the memory), stepped here rather than by fit(): fit() ends with a checkpoint, whose write would
    # add its own transient to the peak.
    trainer = open_trainer(cfg, Path(args.run_dir))
    trainer.build()
    rss_after_build = rss_bytes()
    watch = StepWatch(trainer.engine)
    losses, peaks = [], []
    t0 = time.time()
    for step in range(1, args.steps + 1):
        watch.armed = step == args.steps
        row = trainer.train_step()
        losses.append(row["loss"])
        peaks.append(peak_memory_mb(trainer.device))  # the peak_mem_mb a metrics row of `memlm train` reports
    wall = time.time() - t0
    params = list(trainer.engine.module.parameters())
    result = {
        "rank": trainer.rank, "world_size": trainer.info.world_size, "stage": args.stage, "steps": args.steps,
        "psi": sum(int(getattr(p, "ds_numel", p.numel())) for p in params),
        "zero3_persistent_numel": sum(int(p.ds_numel) for p in params if getattr(p, "ds_persist", False)),
        "rss_start_mb": rss_start / MiB, "rss_after_build_mb": rss_after_build / MiB,
        "rss_before_step_mb": watch.rss["before_step"] / MiB, "rss_after_step_mb": watch.rss["after_step"] / MiB,
        "rss_end_mb": rss_bytes() / MiB, "peak_rss_mb": peak_memory_mb("cpu"),
        "metrics_peak_mem_mb": peaks, "losses": losses, "wall_s": wall, "loadavg": load_average(),
        # per-tensor rows of 64 KiB and more (the totals count every tensor)
        "inventory": {k: {"totals": inv.totals(), "tensors": [t for t in inv.rows if t["storage_bytes"] >= 65536]}
                      for k, inv in watch.snapshots.items()},
    }
    Path(args.json).with_name(f"{Path(args.json).stem}-rank{trainer.rank}.json").write_text(json.dumps(result) + "\n")


# ZeRO-3 brought to its sharded footprint with the two settings DeepSpeed's defaults leave large (a gradient bucket
# of 2M elements instead of 5e8, no whole-parameter persistence): the `--zero3-sharded` cases.
ZERO3_SHARDED = ("reduce_bucket_size=2000000", "param_persistence_threshold=0")


def run_zero_case(args, data: Path, work: Path, stage: int, world: int, ds: tuple[str, ...] = ()) -> list[dict]:
    tag = f"zero{stage}-w{world}" + ("-tuned" if ds else "")
    out = work / f"{tag}.json"
    worker = [str(Path(__file__).resolve()), "--worker", "zero", "--stage", str(stage), "--steps", str(args.steps),
              "--data", str(data), "--run-dir", str(work / f"run-{tag}"), "--json", str(out),
              *(a for item in ds for a in ("--ds", item))]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
                if world > 1 else [sys.executable])
    proc = subprocess.run([*launcher, *worker], cwd=ROOT, env=child_env(**WORKER_ENV), capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"ZeRO-{stage} at {world} rank(s) failed:\n{proc.stderr[-4000:]}")
    return [json.loads(out.with_name(f"{out.stem}-rank{r}.json").read_text()) for r in range(world)]


def summarize_rank(rank_result: dict) -> dict:
    psi, stage, world = rank_result["psi"], rank_result["stage"], rank_result["world_size"]
    before = rank_result["inventory"]["before_step"]["totals"]
    after = rank_result["inventory"]["after_step"]["totals"]
    cats = ("params", "grads", "master", "adam_moments", "other")
    measured = {c: before.get(c, {}).get("storage_bytes", 0) for c in cats}
    measured_resident = {c: before.get(c, {}).get("resident_bytes", 0) for c in cats}
    after_storage = {c: after.get(c, {}).get("storage_bytes", 0) for c in cats}
    expected = expected_bytes(psi, stage, world)
    persistent = rank_result["zero3_persistent_numel"]
    return {
        "rank": rank_result["rank"], "psi": psi,
        "before_step_storage_bytes": measured, "before_step_resident_bytes": measured_resident,
        "after_step_storage_bytes": after_storage,
        "expected_bytes": expected,
        # ZeRO-3 keeps parameters of <= stage3_param_persistence_threshold (1e5) elements whole on every rank as
        # well as partitioned (one rank: nothing is partitioned).
        "expected_zero3_params_with_persistence": ((4 * persistent + 4 * psi / world if world > 1 else 4 * psi)
                                                   if stage == 3 else None),
        "zero3_persistent_numel": persistent if stage == 3 else None,
        "model_state_total_resident": sum(measured_resident.values()),
        "model_state_total_storage": sum(measured.values()),
        "model_state_total_expected": sum(expected.values()),
        "rss_start_mb": rank_result["rss_start_mb"], "rss_after_build_mb": rank_result["rss_after_build_mb"],
        "rss_before_step_mb": rank_result["rss_before_step_mb"], "rss_after_step_mb": rank_result["rss_after_step_mb"],
        "peak_rss_mb": rank_result["peak_rss_mb"], "peak_minus_start_mb": rank_result["peak_rss_mb"] -
        rank_result["rss_start_mb"], "metrics_peak_mem_mb": rank_result["metrics_peak_mem_mb"],
        "losses": rank_result["losses"], "loadavg": rank_result["loadavg"],
    }


# ---------------------------------------------------------------------------------------------------------------
# 2. Memory-state bytes per lane


def state_bytes(state) -> tuple[int, int, dict]:
    """(logical bytes, retained storage bytes, logical bytes per field) of every tensor in a memory state."""
    import torch

    logical, storages, fields = 0, {}, {}

    def walk(obj, name):
        nonlocal logical
        if isinstance(obj, torch.Tensor):
            b = obj.numel() * obj.element_size()
            logical += b
            fields[name] = fields.get(name, 0) + b
            s = obj.untyped_storage()
            if s.nbytes():
                storages[s.data_ptr()] = s.nbytes()
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, name)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), f"{name}.{f.name}" if name else f.name)

    walk(state, "")
    return logical, sum(storages.values()), fields


def formula_per_lane(arch: str, mem_len: int, r_tokens: int = 0) -> dict:
    """Bytes per lane from the memory dataclasses' fields (models/txl.py, lamemo.py, rmt.py; fp32 = 4 bytes, bool
    flags 1 byte)."""
    m = mem_len
    if arch in ("transformer", "txl"):  # TXLMemory: L x [M, D] layer inputs + [M] valid
        terms = {"hidden L*M*D*4": L * m * D * 4, "valid M": m}
    elif arch == "lamemo":  # LaMemoMemory: [M, D] embeddings + L x [M, H, E] C + L x [M, H] S (fp32) + [M] valid
        terms = {"embed M*D*4": m * D * 4, "context L*M*H*E*4": L * m * H * E * 4, "lognorm L*M*H*4": L * m * H * 4,
                 "valid M": m}
    else:  # RMTMemory: [R, D] memory tokens + fresh flag + TXLMemory cache with M slots
        terms = {"tokens R*D*4": r_tokens * D * 4, "fresh 1": 1, "cache hidden L*M*D*4": L * m * D * 4,
                 "cache valid M": m}
    return {"terms": terms, "total": sum(terms.values())}


def window_formula_per_lane(mem_len: int, k: int) -> dict:
    """WindowBPTT.window: k Segments of tokens [N] int64, targets [N] int64, reset flag, and the cache they read."""
    per_segment = {"tokens N*8": N * 8, "targets N*8": N * 8, "reset 1": 1,
                   "cache hidden L*M*D*4": L * mem_len * D * 4, "cache valid M": mem_len}
    return {"terms_per_segment": per_segment, "k": k, "total": k * sum(per_segment.values())}


def memory_states(data: Path) -> dict:
    import torch

    from memlm.data_pipeline.stream import LaneStream
    from memlm.models import build_model, map_memory
    from memlm.trainer.config.run_config import config_from_dict, eval_model_config
    from memlm.trainer.loop.recurrence import WindowBPTT

    torch.set_num_threads(1)
    stream = LaneStream(data, "valid", lanes=LANES, seg_len=N, mode="eval")
    batches = [next(iter_) for iter_ in [iter(stream)] for _ in range(K_BPTT + 2)]
    result = {}
    for label, arch, mem_len, extra in STATE_CASES:
        rows = {}
        mults = (1, MULT) if mem_len else (1,)
        for mult in mults:
            ev = {"eval.mem_mult": float(mult)} if mult > 1 else {}
            cfg = config_from_dict({}, {**overrides(data, arch, mem_len, **extra), **ev})
            mcfg = eval_model_config(cfg)
            torch.manual_seed(0)
            model = build_model(mcfg).eval()
            memory = model.init_memory(LANES)
            init_logical, init_storage, _ = state_bytes(memory)
            with torch.no_grad():
                for b in batches[:2]:
                    out = model(b.tokens, memory, reset=b.reset, targets=b.targets)
                    memory = map_memory(torch.Tensor.detach, out.memory)
            logical, storage, fields = state_bytes(memory)
            formula = formula_per_lane(arch, mcfg.mem_len, mcfg.num_mem_tokens)
            row = {
                "mem_len": mcfg.mem_len, "init_memory_bytes_per_lane": init_logical / LANES,
                "init_memory_storage_per_lane": init_storage / LANES,
                "logical_bytes_per_lane": logical / LANES, "retained_storage_bytes_per_lane": storage / LANES,
                "formula_bytes_per_lane": formula["total"], "formula_terms": formula["terms"],
                "fields_bytes_per_lane": {k: v / LANES for k, v in fields.items()},
                "matches_formula": logical / LANES == formula["total"],
            }
            if arch == "rmt":  # the replay window of the trainer's default schedule, k = bptt_depth segments
                rec = WindowBPTT(model.init_memory(LANES), "cpu", mcfg.bptt_depth)
                feed = iter(batches)
                with torch.no_grad():
                    for _ in range(K_BPTT + 1):
                        rec.step(model, lambda: next(feed))
                        rec.advance()
                w_logical, w_storage, w_fields = state_bytes(rec.window)
                wf = window_formula_per_lane(mcfg.mem_len, len(rec.window))
                row["replay_window"] = {
                    "segments": len(rec.window), "logical_bytes_per_lane": w_logical / LANES,
                    "retained_storage_bytes_per_lane": w_storage / LANES, "formula_bytes_per_lane": wf["total"],
                    "formula_terms_per_segment": wf["terms_per_segment"],
                    "matches_formula": w_logical / LANES == wf["total"],
                }
            rows[f"x{mult}"] = row
            del model, memory, out
        result[label] = rows
    return result


# ---------------------------------------------------------------------------------------------------------------
# 3. Evaluation peak


def eval_worker(args) -> None:
    import torch

    from memlm.models import build_model
    from memlm.trainer.config.run_config import config_from_dict, eval_model_config
    from memlm.trainer.inference.evaluate import evaluate

    torch.set_num_threads(1)
    label, arch, mem_len, extra = next(c for c in STATE_CASES if c[0] == args.case)
    ev = {"eval.mem_mult": float(args.mult)} if args.mult > 1 else {}
    cfg = config_from_dict({}, {**overrides(Path(args.data), arch, mem_len, **extra), **ev})
    mcfg = eval_model_config(cfg)
    torch.manual_seed(0)
    model = build_model(mcfg)
    rss_before = rss_bytes()
    hwm_reset = reset_hwm()
    hwm_before = hwm_bytes()
    t0 = time.perf_counter()
    result = evaluate(model, args.data, "valid", lanes=LANES, seg_len=N, max_batches=args.eval_batches)
    wall = time.perf_counter() - t0
    peak = hwm_bytes()
    top = profile_forward(model, Path(args.data)) if args.profile else None
    Path(args.json).write_text(json.dumps({
        "case": label, "mem_len": mcfg.mem_len, "rss_before_mb": rss_before / MiB, "hwm_reset": hwm_reset,
        "hwm_before_mb": hwm_before / MiB, "peak_rss_mb": peak / MiB, "peak_rise_mb": (peak - rss_before) / MiB,
        "tokens": result["tokens"], "batches": args.eval_batches, "wall_s": wall, "loadavg": load_average(),
        "profile_top_ops_by_allocated_mb": top,
    }) + "\n")


def profile_forward(model, data: Path) -> list:
    """After the measured pass: one profiled evaluation forward (memory carried from a first one); the ops that
    allocate the most CPU memory, summed over the forward (allocations, not a peak: where the transients come
    from)."""
    import torch

    from memlm.data_pipeline.stream import LaneStream

    stream = iter(LaneStream(data, "valid", lanes=LANES, seg_len=N, mode="eval"))
    model.eval()
    memory = model.init_memory(LANES)
    with torch.no_grad():
        b = next(stream)
        memory = model(b.tokens, memory, reset=b.reset, targets=b.targets).memory
        b = next(stream)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            model(b.tokens, memory, reset=b.reset, targets=b.targets)
    # aten::empty* and resize_ are the allocations made inside other ops (einsum's copies, index's output):
    # leave them out so the list names the ops themselves
    rows = [(e.key, e.self_cpu_memory_usage, e.count) for e in prof.key_averages()
            if not e.key.startswith(("aten::empty", "aten::resize_"))]
    rows.sort(key=lambda r: -r[1])
    return [{"op": k, "self_allocated_mb": m / MiB, "calls": c} for k, m, c in rows[:6]]


def run_eval_case(args, data: Path, work: Path, label: str, mult: int) -> dict:
    out = work / f"eval-{label.replace(' ', '_').replace('(', '').replace(')', '').replace('=', '')}-x{mult}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "eval", "--case", label, "--mult", str(mult),
           "--data", str(data), "--eval-batches", str(args.eval_batches), "--json", str(out), "--profile"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(**WORKER_ENV), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluation {label} x{mult} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------------------------
# Report


def mb(x: float) -> str:
    return f"{x / MiB:.1f}"


def rise(row: dict) -> str:
    runs = row.get("peak_rise_mb_runs", [row["peak_rise_mb"]])
    return f"{row['peak_rise_mb']:.0f} ({min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else f"{runs[0]:.0f}"


def print_tables(report: dict) -> None:
    if "zero" in report:
        print("\n### ZeRO: model-state tensors per rank after the backward of the last step (MiB resident; "
              "measured / expected)\n")
        print("| stage | W | rank | params | grads | fp32 master | Adam m, v | total | total allocated |")
        print("|---|---|---|---|---|---|---|---|---|")
        for case in report["zero"]:
            for r in case["ranks"]:
                got, exp = r["before_step_resident_bytes"], r["expected_bytes"]
                params_exp = mb(exp["params"])
                if r["expected_zero3_params_with_persistence"] is not None:
                    params_exp += f" ({mb(r['expected_zero3_params_with_persistence'])})"
                print(f"| {case['stage']} | {case['world_size']} | {r['rank']} | {mb(got['params'])} / "
                      f"{params_exp} | {mb(got['grads'])} / {mb(exp['grads'])} | {mb(got['master'])} / "
                      f"{mb(exp['master'])} | {mb(got['adam_moments'])} / {mb(exp['adam_moments'])} | "
                      f"{mb(r['model_state_total_resident'])} / {mb(r['model_state_total_expected'])} | "
                      f"{mb(r['model_state_total_storage'])} |")
        print("\n### ZeRO: RSS per rank (MiB)\n")
        print("| stage | W | rank | start (runtime imported) | after engine build | before last step | peak "
              "(= peak_mem_mb) | peak - start |")
        print("|---|---|---|---|---|---|---|---|")
        for case in report["zero"]:
            for r in case["ranks"]:
                print(f"| {case['stage']} | {case['world_size']} | {r['rank']} | {r['rss_start_mb']:.0f} | "
                      f"{r['rss_after_build_mb']:.0f} | {r['rss_before_step_mb']:.0f} | {r['peak_rss_mb']:.0f} | "
                      f"{r['peak_minus_start_mb']:.0f} |")
    if "state" in report:
        print("\n### Memory state per lane (bytes): measured (logical) / formula; retained storage\n")
        print("| arch | M | measured | formula | retained storage | M = 10x | formula | retained |")
        print("|---|---|---|---|---|---|---|---|")
        for label, rows in report["state"].items():
            one, ten = rows["x1"], rows.get(f"x{MULT}")
            tail = (f"{ten['logical_bytes_per_lane']:,.0f} | {ten['formula_bytes_per_lane']:,} | "
                    f"{ten['retained_storage_bytes_per_lane']:,.0f}" if ten else "n/a | n/a | n/a")
            print(f"| {label} | {one['mem_len']} | {one['logical_bytes_per_lane']:,.0f} | "
                  f"{one['formula_bytes_per_lane']:,} | {one['retained_storage_bytes_per_lane']:,.0f} | {tail} |")
            if "replay_window" in one:
                w1, w10 = one["replay_window"], ten["replay_window"] if ten else None
                tail = (f"{w10['logical_bytes_per_lane']:,.0f} | {w10['formula_bytes_per_lane']:,} | "
                        f"{w10['retained_storage_bytes_per_lane']:,.0f}" if w10 else "n/a | n/a | n/a")
                print(f"| {label}: replay window k={w1['segments']} | {one['mem_len']} | "
                      f"{w1['logical_bytes_per_lane']:,.0f} | {w1['formula_bytes_per_lane']:,} | "
                      f"{w1['retained_storage_bytes_per_lane']:,.0f} | {tail} |")
    if "eval" in report:
        print("\n### Evaluation pass (8 lanes): rise of peak RSS over the RSS before it (MiB, median "
              "(range) of fresh processes)\n")
        print("| arch | M | peak rise | state (8 lanes, retained) | M = 10x | peak rise | state (retained) | "
              "top allocating op at 10x (MiB per forward) |")
        print("|---|---|---|---|---|---|---|---|")
        for label, rows in report["eval"].items():
            st = report.get("state", {}).get(label, {})
            one, ten = rows["x1"], rows.get(f"x{MULT}")
            s1 = st.get("x1", {}).get("retained_storage_bytes_per_lane", 0) * LANES
            s10 = st.get(f"x{MULT}", {}).get("retained_storage_bytes_per_lane", 0) * LANES
            top = (ten or one).get("profile_top_ops_by_allocated_mb") or [{"op": "", "self_allocated_mb": 0}]
            tail = f"{ten['mem_len']} | {rise(ten)} | {mb(s10)}" if ten else "n/a | n/a | n/a"
            print(f"| {label} | {one['mem_len']} | {rise(one)} | {mb(s1)} | {tail} | "
                  f"{top[0]['op']} {top[0]['self_allocated_mb']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per ZeRO run")
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--eval-repeats", type=int, default=2, help="fresh processes per evaluation case (median)")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--skip-zero", action="store_true")
    parser.add_argument("--zero3-sharded", action="store_true",
                        help=f"also ZeRO-3 with deepspeed.{' and deepspeed.'.join(ZERO3_SHARDED)} at each world size")
    parser.add_argument("--ds", action="append", help=argparse.SUPPRESS)  # worker: deepspeed.KEY=INT settings
    parser.add_argument("--skip-state", action="store_true")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--data", help="an already prepared WikiText-2 BPE-8k folder (else prepared here)")
    parser.add_argument("--out", default=str(RESULTS / "memory_cpu.json"))
    # worker modes (the bench launches itself)
    parser.add_argument("--worker", choices=["zero", "eval"])
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--run-dir")
    parser.add_argument("--json")
    parser.add_argument("--case")
    parser.add_argument("--mult", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="eval worker: also profile one forward")
    args = parser.parse_args()
    if args.worker == "zero":
        zero_worker(args)
        return
    if args.worker == "eval":
        eval_worker(args)
        return

    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_memory-"))
    started = time.time()
    report: dict = {
        "benchmark": "memory", "torch": torch.__version__, "nproc": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(), "threads_per_process": 1,
        "loadavg_before": load_average(),
        "config": {"n_layer": L, "d_model": D, "n_head": H, "d_head": E, "d_inner": F, "vocab": V, "tgt_len": N,
                   "mem_len": M, "lanes_per_rank": LANES, "precision": "fp32", "optimizer": "Adam (torch_adam)",
                   "rmt_mem_tokens": R_TOKENS, "rmt_bptt_depth": K_BPTT, "eval_mem_mult": MULT,
                   "corpus": "WikiText-2, spm-bpe 8k", "zero_steps": args.steps, "eval_batches": args.eval_batches,
                   "eval_repeats": args.eval_repeats},
    }
    try:
        data = Path(args.data) if args.data else prepare_corpus(work)
        if not args.skip_zero:
            report["zero"] = []
            for world in args.worlds:
                for stage in args.stages:
                    ranks = run_zero_case(args, data, work, stage, world)
                    case = {"stage": stage, "world_size": world, "ranks": [summarize_rank(r) for r in ranks],
                            "raw": ranks}
                    report["zero"].append(case)
                    r0 = case["ranks"][0]
                    print(f"ZeRO-{stage} W={world}: rank 0 model state {mb(r0['model_state_total_resident'])} MiB "
                          f"resident (expected {mb(r0['model_state_total_expected'])}), peak RSS "
                          f"{r0['peak_rss_mb']:.0f} MiB", flush=True)
        if args.zero3_sharded:
            report["zero3_sharded"] = {"settings": list(ZERO3_SHARDED), "cases": []}
            for world in args.worlds:
                ranks = run_zero_case(args, data, work, 3, world, ZERO3_SHARDED)
                case = {"stage": 3, "world_size": world, "ranks": [summarize_rank(r) for r in ranks], "raw": ranks}
                report["zero3_sharded"]["cases"].append(case)
                r0 = case["ranks"][0]
                print(f"ZeRO-3 W={world} with {', '.join(ZERO3_SHARDED)}: rank 0 model state "
                      f"{mb(r0['model_state_total_resident'])} MiB resident (expected "
                      f"{mb(r0['model_state_total_expected'])}), peak RSS {r0['peak_rss_mb']:.0f} MiB", flush=True)
        if not args.skip_state:
            report["state"] = memory_states(data)
            print("memory states done", flush=True)
        if not args.skip_eval:
            report["eval"] = {}
            for label, arch, mem_len, _ in STATE_CASES:
                mults = (1, MULT) if mem_len else (1,)
                report["eval"][label] = {}
                for m in mults:
                    runs = [run_eval_case(args, data, work, label, m) for _ in range(args.eval_repeats)]
                    rises = [r["peak_rise_mb"] for r in runs]
                    report["eval"][label][f"x{m}"] = {
                        **runs[0], "peak_rise_mb": statistics.median(rises), "peak_rise_mb_runs": rises,
                        "loadavg": [r["loadavg"] for r in runs]}
                print(f"eval {label}: " + ", ".join(f"M={r['mem_len']} peak rise {r['peak_rise_mb']:.1f} MiB"
                                                   for r in report["eval"][label].values()), flush=True)
        report["loadavg_after"] = load_average()
        report["wall_s"] = time.time() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.out, report)
    print_tables(report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
