"""GPU timing: ``triton.testing.do_bench`` medians, allocator peaks, CUDA-graph replays."""
from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchSettings:
    """``do_bench``'s warm-up and measurement budgets, in ms."""
    warmup: int = 25
    rep: int = 100

    def describe(self) -> str:
        return f"triton.testing.do_bench median, warmup {self.warmup} ms, rep {self.rep} ms"


FULL = BenchSettings()
QUICK = BenchSettings(10, 30)


def make_bench(settings: BenchSettings = FULL) -> Callable:
    """``bench(fn, grad_to_none=None) -> ms``: one untimed call (compiles, autotunes), then the
    median of ``do_bench``."""
    import torch
    import triton.testing
    has_return_mode = 'return_mode' in inspect.signature(triton.testing.do_bench).parameters

    def bench(fn, grad_to_none=None) -> float:
        fn()
        torch.cuda.synchronize()
        if has_return_mode:
            return float(triton.testing.do_bench(fn, warmup=settings.warmup, rep=settings.rep,
                                                 grad_to_none=grad_to_none, return_mode='median'))
        r = triton.testing.do_bench(fn, warmup=settings.warmup, rep=settings.rep, grad_to_none=grad_to_none,
                                    quantiles=[0.5])
        return float(r[0] if isinstance(r, (list, tuple)) else r)
    return bench


def free_memory() -> None:
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def peak_gib(fn) -> float:
    """Allocator peak of one call of ``fn``, in GiB, whatever was allocated before included."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def graph_replay_ms(step, bench) -> float:
    """Captures ``step`` (which must allocate nothing) in a CUDA graph and times its replay."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return bench(graph.replay)


def raise_clocks(seconds: float = 0.5) -> None:
    """Matrix products for ``seconds``: an idle card's clocks ramp up over the first hundreds of
    ms of work, which would otherwise slow the first timed case (seen: 3x at B = 1 decode)."""
    import torch
    a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        a @ a
    torch.cuda.synchronize()


def error_text(e: BaseException, limit: int = 120) -> str:
    """One line naming the exception, for a table cell."""
    msg = f"{type(e).__name__}: {e}".replace('\n', ' ').replace('|', '/')
    return msg if len(msg) <= limit else msg[:limit - 3] + '...'
