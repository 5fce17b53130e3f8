"""Worker processes of the distributed tests (CPU ranks, gloo)."""
import time

import torch.multiprocessing as mp


def run_ranks(target, args_of, world: int, timeout: float):
    """Run ``target(*args_of(rank))`` in ``world`` spawned processes. A rank still running after
    ``timeout`` seconds is killed, so a hung collective fails the test instead of hanging it; every
    rank must exit with status 0."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(rank)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert all(p.exitcode == 0 for p in procs), f"worker exit codes {[p.exitcode for p in procs]}"
