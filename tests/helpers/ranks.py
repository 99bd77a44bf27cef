"""Real process groups for the distributed tests: the ranks' processes and a port to meet on."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(fn, nprocs, args):
    """Run fn(rank, *args) in `nprocs` processes and wait for them (torch.multiprocessing's
    start_processes: a rank that raises or dies fails the call). The ranks are forked from a fork
    server that imported torch and nummon once per xdist worker, not started as fresh interpreters
    that each import torch (some 3 s of CPU per rank); the server is a clean single-threaded
    process started for this purpose, so forking it is safe."""
    import multiprocessing

    import torch.multiprocessing as mp

    # read when the server starts (the first call in this process); modules that fail to import
    # are skipped by the server and imported by the ranks themselves
    multiprocessing.set_forkserver_preload(
        [
            "torch",
            "torch._dynamo",
            "torch.distributed",
            "nummon._monitor.monitor",
            "helpers.dist_workers",
            "helpers.models",
        ]
    )
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
