"""Tensor-parallel runs on ``torch.distributed``: one process per rank, started by ``torchrun``.

The model side is python_ref's (``tp=`` of ``build_gpt2``/``load_gpt2``/``build_llama``/``load_llama``,
see python_ref/tensor_parallel.py); each rank's ``KVCache`` is an ordinary cache made from the
rank's ``model.kv_shape``, so it holds only that rank's key/value heads. This module joins the
process group that torchrun describes in the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): gloo on CPUs, NCCL on CUDA GPUs, one GPU per
process chosen by ``LOCAL_RANK``. The same command runs on one machine or several; only
torchrun's arguments change.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

# Imported before any process group exists, on purpose: when torch._dynamo is first imported
# while a gloo group is alive (python_ref builds tensor-parallel layers on the meta device, which
# imports it), something in that import keeps the group's worker threads alive after
# destroy_process_group(). The interpreter then tears down around them and, now and then, a
# worker releasing its last collective's tensors aborts the process at exit ("terminate called
# without an active exception"). Every rank entry point (the demo, the tensor-parallel benchmark,
# the tests) imports this module before it joins a group.
import torch._dynamo  # noqa: F401
from torch import distributed as dist

from python_ref.tensor_parallel import SINGLE_PROCESS, TensorParallel

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def process_device(device: str | torch.device) -> torch.device:
    """``device`` for this process: ``cuda`` without an index means GPU ``LOCAL_RANK`` (0 when not
    under torchrun), so that the processes of one machine use one GPU each."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def init_tensor_parallel(size: int, device: str | torch.device, timeout_s: float = 600) -> TensorParallel:
    """Join torchrun's process group for a tensor-parallel run over ``size`` ranks on ``device``
    (``cpu``: gloo, ``cuda``: NCCL); returns this process's :class:`TensorParallel`.

    ``size == 1`` outside torchrun is the single-process run and starts nothing. ``timeout_s``
    bounds every collective, so a rank that dies cannot hang the others forever.
    """
    if size < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {size}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if size == 1 and world_size == 1:
        return SINGLE_PROCESS
    if world_size != size:
        raise RuntimeError(
            f"--tp {size} needs {size} processes, one per rank, but WORLD_SIZE is {world_size}"
            + ("" if "WORLD_SIZE" in os.environ else " (not started by torchrun)")
            + f": run it as `torchrun --nproc-per-node {size} -m kvcache_ext.cli demo --tp {size} ...`"
        )
    device = process_device(device)
    if device.type not in BACKENDS:
        raise ValueError(f"tensor parallelism runs on {' or '.join(BACKENDS)}, got device {device}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            BACKENDS[device.type],
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return TensorParallel.from_process_group()


def shutdown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
