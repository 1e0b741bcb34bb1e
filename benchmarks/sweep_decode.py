"""Launch-configuration sweep of the decode kernel on a GPU.

    python benchmarks/sweep_decode.py

For each candidate (value columns per program, warps) of ``kda.ops.fused_recurrent.DECODE_TUNING``
it times bench.py's decode step (T = 1, H = 32, K = V = 128, float32 state, l2norm in kernel) at
B = 1, 64 and 256: eagerly (a new final state each step, as bench.py's table) and replayed in a
CUDA graph (state updated in place, output preallocated; at B = 1 the eager time is the host's).
Prints TB/s of the state read + written.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))

import bench  # noqa: E402
from kda import fused_recurrent_kda  # noqa: E402
from kda.ops import fused_recurrent as decode_ops  # noqa: E402

CANDIDATES = [(32, 4), (16, 2), (16, 4), (32, 2), (32, 8), (64, 4), (64, 8), (8, 1), (8, 2)]
BATCHES = [1, 64, 256]


def time_us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode='median') * 1e3


def main():
    baseline = dict(decode_ops.DECODE_TUNING)
    print('| BV | warps | B | eager us | graph us | graph TB/s |')
    print('| --- | --- | --- | --- | --- | --- |')
    with torch.inference_mode():
        for BV, warps in CANDIDATES:
            decode_ops.DECODE_TUNING.update(BV=BV, num_warps=warps)
            for B in BATCHES:
                inp, state = bench._decode_inputs(B)
                eager = time_us(lambda: fused_recurrent_kda(**inp, initial_state=state, output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True))
                st, out = state.clone(), torch.empty_like(inp['v'])
                graph = bench._graph_time(lambda: fused_recurrent_kda(
                    **inp, initial_state=st, output_final_state=True, inplace_final_state=True, out=out,
                    use_qk_l2norm_in_kernel=True), lambda f: time_us(f) / 1e3) * 1e3
                _, state_bytes = bench.decode_floor_us(B)
                print(f"| {BV} | {warps} | {B} | {eager:.1f} | {graph:.1f} | "
                      f"{state_bytes / (graph * 1e-6) / 1e12:.2f} |", flush=True)
    decode_ops.DECODE_TUNING.update(baseline)


if __name__ == '__main__':
    main()
