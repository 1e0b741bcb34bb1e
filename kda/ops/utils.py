"""Small helpers shared by the launchers."""
from __future__ import annotations

import functools
import os

import torch

# Triton decides at import time whether @triton.jit functions run in its interpreter, so we read
# the same variable once. With it set, CPU tensors go through the real kernels (slowly); without
# it, CPU tensors are computed by the PyTorch reference path.
INTERPRET = os.environ.get('TRITON_INTERPRET', '0') not in ('', '0')


def use_kernels(x: torch.Tensor) -> bool:
    """True when the Triton kernels can run on tensors living where ``x`` lives."""
    return x.is_cuda or INTERPRET


# Plain integer helpers: in newer Triton, triton.cdiv and triton.next_power_of_2 are JIT-aware
# functions costing about 4 us a call on the host, a quarter of a decode step's Python path.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int, minimum: int = 16) -> int:
    """Block size covering ``n``; at least 16 so that ``tl.dot`` accepts it."""
    return max(1 << (n - 1).bit_length(), minimum)


def on_q_device(fn):
    """``fn(q, ...)`` run with q's CUDA device as the current device. Triton launches a kernel on
    the current device and its current stream, whatever device the pointers belong to, so a
    caller whose tensors live on cuda:1 while cuda:0 is current would get kernels on the wrong
    device (a fault, or with peer access a launch unordered with the caller's stream on cuda:1).
    Anything but a CUDA tensor q (validation then names the error) runs as is, and so does a call
    on the current device: two device queries, where entering and leaving ``torch.cuda.device``
    every call would add its device switches to a decode step's host path."""
    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        if isinstance(q, torch.Tensor) and q.is_cuda and q.get_device() != torch.cuda.current_device():
            with torch.cuda.device(q.device):
                return fn(q, *args, **kwargs)
        return fn(q, *args, **kwargs)
    return wrapper


def contiguous(*xs):
    """Dense copies of non-contiguous views; kernels index with dense strides."""
    return tuple(None if x is None else x.contiguous() for x in xs)


def state_strides(K: int, V: int, state_v_first: bool) -> tuple[int, int]:
    """Element strides (between key rows, between value columns) of a ``[K, V]`` state stored as
    ``[K, V]`` or, value-major, ``[V, K]``."""
    return (1, K) if state_v_first else (V, 1)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def fork(device: torch.device) -> torch.cuda.Stream | None:
    """A side stream of ``device`` that has waited for the current stream's work so far (None off
    CUDA, where ``torch.cuda.stream(None)`` does nothing): launches under
    ``torch.cuda.stream(side)`` then run beside the current stream's next ones until ``join``."""
    if device.type != 'cuda':
        return None
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def join(side: torch.cuda.Stream | None):
    """The current stream waits for ``side`` (``fork``); nothing off CUDA."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
