"""The CUDA / NCCL paths in one prepared run: one line per check, ``PASS``, ``FAIL`` or ``SKIP``.

Run on a machine with a GPU (``bash benchmarks/device_check.sh``, or)::

    .venv/bin/python benchmarks/device_check.py --device cuda [--models mlp,small_cnn,tiny_lm]

and on CPU (``--device cpu``) as a dry run of the same script: the checks that need a GPU
(SyncBatchNorm, NCCL) then say SKIP with the reason.  The checks:

1. the device (name, memory, torch, CUDA and NCCL versions);
2. the option matrix's device-relevant cases with 2 ranks sharing the device over gloo
   (plan ``none`` bitwise DDP, a plan mixing every compressor family leaves every rank with
   the same weights and a loss near DDP's): fp32, static_graph, find_unused_parameters,
   bf16 and fp16 weights, bf16 autocast, fp16 autocast with a GradScaler that overflows at
   first, SyncBatchNorm, no_sync, torch.compile of the DDP model (inductor);
3. world size 1 on NCCL: plan ``none`` bitwise DDP and a mixed plan that trains;
4. every compressor's encode + decode on the device against a device memory copy of the
   same 16M-element bucket;
5. ``autotune`` of the bundled models, 2 ranks sharing the device (advice, measured speed-up,
   seconds).

Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the option matrix lives with the tests

from advisor.compressors import SegmentLayout, parse  # noqa: E402
from advisor.runtime.timing import measure, time_call  # noqa: E402
from advisor.testbed.launch import free_port, launch_local  # noqa: E402

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


def line(status: str, name: str, detail: str) -> bool:
    print(f"{status:4}  {name}: {detail}", flush=True)
    return status != "FAIL"


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


def check_matrix(device: str) -> bool:
    from option_programs import option_matrix

    ok = True
    if not device.startswith("cuda"):
        ok &= line("SKIP", "matrix, SyncBatchNorm", "PyTorch's SyncBatchNorm runs on GPUs only")
    cases = matrix_cases(device)
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
    from torch.nn.parallel import DistributedDataParallel as DDP

    import advisor
    from advisor.testbed.workloads import build_workload

    workload = build_workload(spec if ":" in spec else f"advisor.workloads:{spec}")
    model = workload.model.to(device)
    batches = [_to(b, device) for b in workload.batches]
    ddp = DDP(model)
    t0 = time.perf_counter()
    result = advisor.autotune(ddp, workload.loss_fn, batches, workload.optimizer(model), trial_s=20.0)
    if result.hook is not None:
        result.hook.close()
    return {"advice": result.recommendation, "speedup": result.speedup, "seconds": time.perf_counter() - t0}


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
            ok &= line("PASS", f"autotune {spec}", f"advice {r['advice']}; {speed}; {r['seconds']:.0f} s")
        except Exception as exc:
            last = [ln for ln in str(exc).splitlines() if ln.strip()][-2:]
            ok &= line("FAIL", f"autotune {spec}", f"{type(exc).__name__}: {' | '.join(last)[:400]}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="mlp,small_cnn,tiny_lm", help="bundled workloads to autotune")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", default="device,matrix,nccl,compressors,autotune",
                        help="comma-separated subset of the checks")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    ok = check_device(args.device)
    if not ok:
        return 1
    steps = {
        "matrix": lambda: check_matrix(args.device),
        "nccl": lambda: check_nccl(args.device),
        "compressors": lambda: check_compressors(args.device, args.repeats),
        "autotune": lambda: check_autotune(args.device, [m for m in args.models.split(",") if m]),
    }
    for name, step in steps.items():
        if name in only:
            try:
                ok &= step()
            except Exception:
                ok &= line("FAIL", name, traceback.format_exc(limit=3).replace("\n", " | ")[-500:])
    print("ALL PASSED" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
