"""The CPU backend of autopar's groups: gloo with one worker thread per process group.

torch's gloo process group runs collectives on a pool of worker threads, two by
default, so two collectives launched on one group run at once, on one gloo context.
With several collectives in flight per group, which is how a rank program runs (its
launches are placed early and its waits late, passes/lower/schedule.py), gloo then
corrupts the heap: a worker dies in malloc ("malloc(): unaligned tcache chunk
detected", SIGABRT) or segfaults while making a transport buffer
(gloo::transport::tcp::UnboundBuffer). Plain torch shows it without autopar: four
ranks, groups on two axes, up to eight functional all-reduces, all-gathers,
reduce-scatters and all-to-alls in flight, waited in shuffled order: 15 of 34 jobs of
3000 rounds aborted (bench/gloo_stress.py, bench/results/gloo_stress.txt). With one
worker thread per group none of 34 did: a group's collectives then run one after
another, in launch order, which is the same order on every rank, while groups of
different axes still overlap, and compute overlaps all of them.

torch.distributed does not pass options to the gloo groups it makes, so this registers
a backend of its own name whose groups are ProcessGroupGloo made with one thread.
It is registered for CUDA as well as CPU, as gloo itself is: where the default group is
bound to a GPU (init_process_group(device_id=...), how NCCL jobs start), every new group
is asked for its CUDA backend, and one registered for the CPU alone fails to be made
("No backend type associated with device type cuda"). autopar's gloo groups carry only
CPU tensors.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

SERIAL_GLOO = "autopar_gloo"  # the backend's name, as torch.distributed.new_group takes it
WORKER_THREADS = 1


def _make(store, rank: int, size: int, timeout: timedelta):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._threads = WORKER_THREADS
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)


def serial_gloo() -> str:
    """The backend name for new CPU groups, registered with torch.distributed on first use."""
    if SERIAL_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(SERIAL_GLOO, _make, devices=["cpu", "cuda"])
    return SERIAL_GLOO
