"""Run a function on W spawned ranks over gloo (the CPU backend) and collect what each returns.

Each rank joins a file rendezvous in a scratch folder with a short collective timeout, so a
rank that fails makes its peers fail too instead of hanging; the parent also kills any rank
still alive after ``timeout`` seconds. ``fn(rank, world, *args)`` must be a module-level
function (spawned processes import it by name).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 20


def _rank_main(rank: int, world: int, folder: str, fn, args, collective_timeout: float = COLLECTIVE_TIMEOUT_S,
               backend: str = "gloo") -> None:
    out = Path(folder) / f"rank{rank}.pt"
    torch.set_num_threads(1)  # W ranks on a few cores: intra-op threads of every rank would fight for them
    try:
        if backend == "nccl":  # one GPU per rank (the cuda-marked tests)
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{folder}/rendezvous",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        torch.save({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, folder: Path, timeout: float = 120.0,
              collective_timeout: float = COLLECTIVE_TIMEOUT_S, backend: str = "gloo") -> list[dict]:
    """Per rank: ``{"ok": True, "result": ...}`` or ``{"ok": False, "error": ..., "trace": ...}``.

    ``collective_timeout``: how long a rank waits in a collective before it raises. ``backend``:
    "gloo" (CPU), or "nccl" with rank r on GPU r.
    """
    folder.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(folder), fn, args, collective_timeout, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    hung = []
    for rank, p in enumerate(procs):
        p.join(timeout)
        if p.is_alive():
            hung.append(rank)
            p.kill()
            p.join()
    if hung:
        raise AssertionError(f"ranks {hung} still running after {timeout} s: a collective hung")
    outcomes = []
    for rank in range(world):
        path = folder / f"rank{rank}.pt"
        if not path.exists():
            raise AssertionError(f"rank {rank} exited (code {procs[rank].exitcode}) without a result")
        outcomes.append(torch.load(path, weights_only=False))
    return outcomes


def results(outcomes: list[dict]) -> list:
    """Each rank's result; the first failure's traceback if any rank failed."""
    for rank, o in enumerate(outcomes):
        if not o["ok"]:
            raise AssertionError(f"rank {rank} failed: {o['error']}\n{o['trace']}")
    return [o["result"] for o in outcomes]
