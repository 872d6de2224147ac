"""The CUDA / NCCL paths in one prepared run: one line per check, ``PASS``, ``FAIL``, ``SKIP`` or ``INFO``.

Run through ``benchmarks/device_check.sh``, with the machine's own ``python3`` and torch (on
the lent GPU machine), or ``--dry-run`` here on CPU, where only the packages that machine has
may be imported; the checks that need a GPU then say SKIP with the reason.  The checks:

1. the device (name, memory, torch, CUDA and NCCL versions) and which of the newer torch
   APIs the advisor can use are there (per-bucket DDP caps);
2. every module of the advisor imports (a package missing there fails here, named);
3. the option matrix's device-relevant cases with 2 ranks sharing the device over gloo
   (plan ``none`` bitwise DDP, a plan mixing every compressor family leaves every rank with
   the same weights and a loss near DDP's): fp32, static_graph, find_unused_parameters,
   bf16 and fp16 weights, bf16 autocast, fp16 autocast with a GradScaler that overflows at
   first, SyncBatchNorm, no_sync, torch.compile of the DDP model (inductor);
4. world size 1 on NCCL: plan ``none`` bitwise DDP and a mixed plan that trains; each sharded
   (FSDP2) reduce-scatter zeroes a NaN and an Inf without reading anything on the host;
5. every compressor's encode + decode on the device against a device memory copy of the
   same 16M-element bucket;
6. ``autotune`` of a bundled model, 2 ranks sharing the device (advice, speed-ups, seconds).

Each check runs only while the whole run stays within ``--budget-s`` (it says SKIP where
too little time is left).  Every line also goes to ``device_check.json`` in ``--out``.
Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import pkgutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the option matrix lives with the tests

import advisor  # noqa: E402
from advisor.compressors import SegmentLayout, parse  # noqa: E402
from advisor.runtime.timing import measure, time_call  # noqa: E402
from advisor.testbed.launch import free_port, launch_local  # noqa: E402
from advisor.testbed.workloads import build_workload, shard  # noqa: E402

COMPRESSORS = ["fp16", "bf16", "powersgd(rank=1)", "powersgd(rank=4)", "topk(ratio=0.01)", "randomk(ratio=0.01)",
               "qsgd(bits=8)", "qsgd(bits=4)", "intquant(bits=8)", "intquant(bits=8, packed=0)", "signsgd"]
BUCKET = SegmentLayout(tuple(f"layer{i}.weight" for i in range(4)), ((2048, 2048),) * 4)


def matrix_cases(device: str) -> dict:
    gpu = device.startswith("cuda")
    cases = {
        "fp32": {},
        "static_graph": {"ddp": {"static_graph": True}},
        "find_unused_parameters": {"sometimes": True, "ddp": {"find_unused_parameters": True}},
        "bf16 weights": {"dtype": torch.bfloat16},
        "fp16 weights": {"dtype": torch.float16},
        "bf16 autocast": {"autocast": "bf16"},
        "fp16 autocast + GradScaler (overflows at first)": {"autocast": "fp16", "scaler": 2.0 ** 19, "clip": True},
        "no_sync accumulation": {"no_sync": True},
        "torch.compile(ddp), inductor": {"compile_ddp": "inductor"},
    }
    if gpu:
        cases["SyncBatchNorm"] = {"batchnorm": True, "sync_batchnorm": True}
    return {name: {**case, "device": device} for name, case in cases.items()}


#: every line printed, for the JSON written at the end
LINES: list[dict] = []


def line(status: str, name: str, detail: str) -> bool:
    print(f"{status:4}  {name}: {detail}", flush=True)
    LINES.append({"status": status, "check": name, "detail": detail})
    return status != "FAIL"


def check_imports() -> bool:
    """Import every module of the advisor: a package the machine lacks fails here, named."""
    failed = []
    count = 0
    for package in ("advisor", "profilers", "policies"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            count += 1
            try:
                importlib.import_module(info.name)
            except ImportError as exc:
                failed.append(f"{info.name}: {exc}")
    if failed:
        return line("FAIL", "imports", "; ".join(failed)[:600])
    return line("PASS", "imports", f"{count} modules of advisor, profilers and policies")


def check_torch_features() -> bool:
    """Which of the newer torch APIs the advisor uses are there (each is guarded where it is used)."""
    ddp_args = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    features = {"per-bucket DDP caps (bucket_cap_mb_list)": "bucket_cap_mb_list" in ddp_args,
                "torch.compiler.disable": hasattr(torch, "compiler") and hasattr(torch.compiler, "disable"),
                "post-accumulate-grad hooks": hasattr(torch.Tensor, "register_post_accumulate_grad_hook")}
    missing = [k for k, v in features.items() if not v]
    required = [k for k in missing if "bucket_cap_mb_list" not in k]
    detail = f"torch {torch.__version__}: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in features.items())
    return line("FAIL" if required else "INFO", "torch APIs", detail)


def check_device(device: str) -> bool:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return line("FAIL", "device", "CUDA is not available to this torch "
                        f"({torch.__version__}, built for CUDA {torch.version.cuda})")
        p = torch.cuda.get_device_properties(torch.device(device))
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "absent"
        return line("PASS", "device", f"{p.name}, {p.total_memory / 2 ** 30:.0f} GiB, torch {torch.__version__}, "
                    f"CUDA {torch.version.cuda}, NCCL {nccl}")
    return line("PASS", "device", f"cpu, torch {torch.__version__} (dry run: the GPU-only checks skip)")


def check_matrix(device: str, only: list[str] | None = None) -> bool:
    """The option matrix's cases (``only``: those whose names contain one of these words)."""
    from option_programs import option_matrix

    ok = True
    if not device.startswith("cuda"):
        ok &= line("SKIP", "matrix, SyncBatchNorm", "PyTorch's SyncBatchNorm runs on GPUs only")
    cases = {name: case for name, case in matrix_cases(device).items()
             if not only or any(word in name for word in only)}
    if not cases:
        return line("FAIL", "matrix", f"no case matches --cases={','.join(only or [])}; the cases: "
                    f"{'; '.join(matrix_cases(device))}")
    t0 = time.perf_counter()
    try:
        ranks = launch_local(option_matrix, 2, (cases,), timeout=900)
    except Exception as exc:
        return line("FAIL", "matrix, 2 ranks sharing the device over gloo", f"{type(exc).__name__}: {exc}")
    for name in cases:
        results = [r[name] for r in ranks]
        errors = [f"rank {i}: {r['error']}" for i, r in enumerate(results) if r["error"]]
        if errors:
            ok &= line("FAIL", f"matrix, {name}", "; ".join(errors)[:400])
            continue
        gap = max(abs(r["mixed_losses"][-1] - r["ddp_losses"][-1]) / abs(r["ddp_losses"][0]) for r in results)
        good = all(r["none_bitwise"] and r["ranks_agree"] for r in results) and gap <= 0.25 and all(
            math.isfinite(v) for r in results for v in r["mixed_losses"])
        ok &= line("PASS" if good else "FAIL", f"matrix, {name}",
                   f"none bitwise DDP {all(r['none_bitwise'] for r in results)}, ranks agree "
                   f"{all(r['ranks_agree'] for r in results)}, the mixed plan's last loss within {gap:.1%} (of the first) "
                   "of DDP's")
    line("INFO", "matrix", f"{len(cases)} cases x 3 runs in {time.perf_counter() - t0:.0f} s")
    return ok


def check_nccl(device: str) -> bool:
    name = "NCCL, world size 1"
    if not device.startswith("cuda"):
        return line("SKIP", name, "NCCL needs a GPU")
    if not dist.is_nccl_available():
        return line("FAIL", name, "this torch has no NCCL")
    from option_programs import option_matrix

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device(device))
    try:
        r = option_matrix(0, 1, {"fp32": {"device": device}, "bf16 weights": {"device": device,
                                                                             "dtype": torch.bfloat16}})
    finally:
        dist.destroy_process_group()
    bad = {k: v["error"] for k, v in r.items() if v["error"] or not v["none_bitwise"]}
    if bad:
        return line("FAIL", name, json.dumps(bad)[:400])
    return line("PASS", name, ", ".join(f"{k}: none bitwise, mixed last loss {v['mixed_losses'][-1]:.3f} vs DDP's "
                                        f"{v['ddp_losses'][-1]:.3f}" for k, v in r.items()))


#: the sharded reduce-scatters the device check calls, by the plan's name for them
SHARDED_COMMS = ("none", "bf16", "fp16", "intquant(bits=8)", "intquant(bits=4)")


def check_sharded(device: str) -> bool:
    """Each sharded group's reduce-scatter (FSDP2's custom comm), world size 1 on NCCL (gloo in a
    dry run): a NaN and an Inf in its input are zeroed and counted, the output is the input's
    row within the wire's rounding, and on a GPU the call reads nothing on the host
    (``torch.cuda.set_sync_debug_mode("error")`` makes any host read an error)."""
    from advisor.runtime.sharded import ExactReduceScatter, IntReduceScatter

    gpu = device.startswith("cuda")
    backend = "nccl" if gpu else "gloo"
    name = f"sharded comms, world size 1 on {backend}"
    kwargs = {"device_id": torch.device(device)} if gpu else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kwargs)
    ok, done = True, []
    try:
        # the communicator is made at the first collective, outside the debug mode: only the comms are judged
        warm = torch.zeros(2, device=device)
        dist.all_to_all_single(torch.empty_like(warm), warm)
        for label in SHARDED_COMMS:
            config = parse(label)
            if config.name == "intquant":
                bits = config.params["bits"]
                comm, bound = IntReduceScatter(name=label, bits=bits), 1 / ((1 << (bits - 1)) - 1)
            else:
                wire = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[label]
                comm = ExactReduceScatter(wire, name=label)
                bound = {"none": 1e-7, "bf16": 2 ** -8, "fp16": 2 ** -11}[label]
            rows = torch.randn(1, 1 << 20, device=device)
            rows[0, 5], rows[0, 77] = float("nan"), float("inf")
            expected = torch.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)
            out = torch.empty(1 << 20, device=device)
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                comm(out, rows.view(-1), None, dist.ReduceOp.SUM)
            finally:
                if gpu:
                    torch.cuda.set_sync_debug_mode("default")
            events = comm.nonfinite_events  # reads the device's count: after the call, on purpose
            error = float((out - expected).abs().max() / expected.abs().max())
            if events != 1 or not torch.isfinite(out).all() or error > 2 * bound:
                ok &= line("FAIL", f"{name}, {label}", f"non-finite events {events} (expected 1), "
                           f"finite {bool(torch.isfinite(out).all())}, largest error {error:.2e} of the "
                           f"largest value (bound {2 * bound:.1e})")
                continue
            done.append(f"{label} {error:.1e}")
    finally:
        dist.destroy_process_group()
    how = "no host reads inside a call (sync debug mode error)" if gpu else "host reads not checked on a CPU"
    return ok & line("PASS" if ok else "FAIL", name, f"NaN and Inf zeroed and counted once; largest error "
                     f"of the largest value: {', '.join(done)}; {how}")


def check_compressors(device: str, repeats: int) -> bool:
    x = torch.randn(BUCKET.numel, device=device)
    y = torch.empty_like(x)
    copy = time_call(lambda: y.copy_(x), repeats=repeats, device=device)
    ok = line("INFO", "compressors", f"16M-element bucket; device memory copy {copy * 1e3:.3f} ms "
              f"({2 * x.numel() * 4 / copy / 1e9:.0f} GB/s read+write)")
    for label in COMPRESSORS:
        try:
            t = measure(parse(label).build(), BUCKET, world_size=2, repeats=repeats, grad=x, device=device)
            total = t.encode_s + t.decode_s
            ok &= line("PASS", f"compressor {label}", f"encode {t.encode_s * 1e3:.3f} ms + decode "
                       f"{t.decode_s * 1e3:.3f} ms = {total / copy:.1f}x the copy")
        except Exception as exc:
            ok &= line("FAIL", f"compressor {label}", f"{type(exc).__name__}: {exc}")
    return ok


def _autotune_on_device(rank: int, world: int, spec: str, device: str) -> dict:
    workload = build_workload(spec if ":" in spec else f"advisor.workloads:{spec}")
    model = workload.model.to(device)
    batches = [_to(b, device) for b in shard(workload.batches, rank, world)]
    held_out = [_to(b, device) for b in workload.held_out] if workload.held_out else None
    ddp = DistributedDataParallel(model)
    t0 = time.perf_counter()
    result = advisor.autotune(ddp, workload.loss_fn, batches, workload.optimizer(model), held_out=held_out,
                              trial_s=30.0, max_rounds=4)
    if result.hook is not None:
        result.hook.close()
    trial = result.accuracy
    evidence = (f"trial {trial.steps} steps, could detect {trial.detectable:.2%}"
                + (" (powered)" if trial.powered else " (not powered)") if trial is not None else "no trial")
    return {"advice": result.recommendation, "speedup": result.speedup, "evidence": evidence,
            "seconds": time.perf_counter() - t0}


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return type(batch)(_to(b, device) for b in batch)


def check_autotune(device: str, models: list[str]) -> bool:
    ok = True
    for spec in models:
        try:
            r = launch_local(_autotune_on_device, 2, (spec, device), timeout=600)[0]
            sp = r["speedup"]
            speed = (f"vs fp32 {sp.get('measured_vs_fp32', math.nan):.2f}x measured "
                     f"({sp.get('predicted_vs_fp32', math.nan):.2f}x predicted), vs 16-bit "
                     f"{sp.get('measured_vs_16bit', math.nan):.2f}x ({sp.get('predicted_vs_16bit', math.nan):.2f}x)")
            ok &= line("PASS", f"autotune {spec}", f"advice {r['advice']}; {speed}; {r['evidence']}; "
                       f"{r['seconds']:.0f} s")
        except Exception as exc:
            last = [ln for ln in str(exc).splitlines() if ln.strip()][-2:]
            ok &= line("FAIL", f"autotune {spec}", f"{type(exc).__name__}: {' | '.join(last)[:400]}")
    return ok


CHECKS = ("device", "imports", "matrix", "nccl", "sharded", "compressors", "autotune")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="text_lm", help="bundled workloads to autotune")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cases", default="", help="the matrix cases whose names contain one of these "
                                                    "comma-separated words (default: every case)")
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of the checks")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="the whole run's wall-time budget; checks that would start past it are skipped")
    parser.add_argument("--out", default=None, help="a folder for device_check.json")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    only = set(args.only.split(","))
    ok = check_device(args.device)
    if ok:
        ok &= check_torch_features()
        steps = {
            "imports": check_imports,
            "matrix": lambda: check_matrix(args.device, [w for w in args.cases.split(",") if w]),
            "nccl": lambda: check_nccl(args.device),
            "sharded": lambda: check_sharded(args.device),
            "compressors": lambda: check_compressors(args.device, args.repeats),
            "autotune": lambda: check_autotune(args.device, [m for m in args.models.split(",") if m]),
        }
        #: the least time each check is given to run, to skip rather than be cut off
        needs = {"imports": 5, "matrix": 60, "nccl": 10, "sharded": 10, "compressors": 10, "autotune": 60}
        for name, step in steps.items():
            if name not in only:
                continue
            left = args.budget_s - (time.perf_counter() - t0)
            if left < needs[name]:
                line("SKIP", name, f"{left:.0f} s of the {args.budget_s:g} s budget left, it needs {needs[name]} s")
                continue
            started = time.perf_counter()
            try:
                ok &= step()
            except Exception:
                ok &= line("FAIL", name, traceback.format_exc(limit=3).replace("\n", " | ")[-500:])
            line("INFO", f"{name} took", f"{time.perf_counter() - started:.0f} s")
    seconds = time.perf_counter() - t0
    print("ALL PASSED" if ok else "SOME CHECKS FAILED", f"in {seconds:.0f} s", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "device_check.json").write_text(json.dumps(
            {"passed": bool(ok), "seconds": seconds, "device": args.device, "torch": torch.__version__,
             "lines": LINES}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
