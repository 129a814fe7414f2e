"""What the PyTorch reference scripts need to start and report: one-write output lines, a
fork-based launch of the ranks (mp.spawn's job, after `import torch` so ranks skip it), and
a thread count that holds for OpenBLAS too."""
import ctypes
import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def emit(line):
    """Prints one line with a single write(2): forked ranks share the pipe, and a line
    shorter than PIPE_BUF written at once is never interleaved with another rank's."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def set_threads(n):
    """torch.set_num_threads(n), and the same limit for OpenBLAS's own thread pool.

    Debian's torch is built with BLAS_INFO=generic, so torch.set_num_threads does not reach
    OpenBLAS (libopenblas0-pthread), which keeps one thread per core: a "1 thread" rank then
    runs its GEMMs on both cores at world size 1, and 2 ranks oversubscribe the 2 cores at
    world size 2 (4 BLAS threads). Called in each rank, after the fork."""
    torch.set_num_threads(n)
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "libopenblas" in line}
    for path in sorted(libraries):
        ctypes.CDLL(path).openblas_set_num_threads(n)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(train, world_size, args):
    """Runs train(rank, world_size, args): in this process for one rank, else in forked ranks
    that rendezvous at MASTER_ADDR:MASTER_PORT (a free local port unless set)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if world_size == 1:
        train(0, 1, args)
    else:
        mp.start_processes(train, args=(world_size, args), nprocs=world_size, join=True, start_method="fork")
