"""``chunk_kda``: validation, the autograd Function and the launches of the chunk kernels.

Forward: stage 1 (``kernels/chunk_intra.py``: cumulative decay, decayed keys and queries, the
in-chunk matrices and M), then one sweep over the chunks that carries the state and forms the
outputs, applying M inside (``kernels/chunk_state_output.py``); for one long sequence whose
sweep leaves SMs room, both in time segments, each segment's sweep beside the next segment's
stage 1 (``forward_segments``). Backward recomputes stage 1's
per-token tensors from the saved inputs and keeps the forward's in-chunk matrices Aqk, A' and M
(``[B, T, HV, BT]`` each; nothing ``[.., K]``- or state-sized is kept between forward and backward
unless ``disable_recompute=True``); it carries the state again, storing every chunk's state and
corrections (``kernels/chunk_state.py``), then runs the state-gradient sweep
(``kernels/chunk_state_bwd.py``) and the per-chunk gradient kernels
(``kernels/chunk_intra_bwd.py``). Launch configurations: ``TUNING`` below.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, fields

import torch
import triton.language as tl

from kda.kernels.chunk_intra import chunk_cumsum_kernel, chunk_pair_fwd_kernel, chunk_solve_kernel
from kda.kernels.chunk_intra_bwd import (chunk_gate_bwd_kernel, chunk_intra_bwd_kernel, chunk_pair_bwd_kernel,
                                         gate_param_grad_kernel)
from kda.kernels.chunk_state import chunk_state_fwd_kernel
from kda.kernels.chunk_state_output import chunk_state_output_fwd_kernel
from kda.kernels.chunk_state_bwd import chunk_state_bwd_kernel
from kda.ops.gate import KernelGate, activate_beta, activate_gate, bounded_decay, kernel_beta
from kda.ops.l2norm import l2norm_bwd, l2norm_fwd
from kda.ops.utils import (INTERPRET, cdiv, contiguous, fork, join, next_pow2, on_q_device,
                           state_strides, use_kernels)
from kda.ops.validation import (_expect_bool, cast_intermediate_states, refuse_unsupported,
                                resolve_state_v_first, validate_activations, validate_chunk_size,
                                validate_inputs, validate_states_dtype, warn_if_head_first)
from kda.reference import chunk_kda_reference

DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Rows of a sub-block of the in-chunk matrices: the smallest tile tl.dot takes.
BC = 16


@dataclass(frozen=True)
class ChunkLayout:
    """Where the chunks are. ``NT``: chunks per sequence (fixed length only); ``total``: chunks
    over all sequences; for varlen, ``rows[c] = (first row, valid rows)`` of global chunk c,
    ``offsets[n]`` = first global chunk of sequence n, and ``order``: the sequences by chunk count,
    most first, the order in which the state sweeps start them."""
    BT: int
    NT: int
    total: int
    rows: torch.Tensor | None
    offsets: torch.Tensor | None
    order: torch.Tensor | None


# The last varlen chunk map built and its key (see chunk_layout).
_last_varlen_layout: tuple | None = None


def chunk_layout(B: int, T: int, BT: int, seq_offsets: list[int] | None,
                 cu_seqlens: torch.Tensor | None) -> ChunkLayout:
    """The chunk map; for varlen built on ``cu_seqlens``' device from it (``seq_offsets`` is its
    host copy, which gives the sizes). Device operations, not a host-built table copied over: a
    copy from pageable host memory waits for the GPU to drain first, and the kernels launched
    after it then start one by one behind the host (H200, the benchmark's varlen batch: 0.23 ms
    of idle GPU in a 3.65 ms forward).

    A model calls every layer with the same sequence bounds, and building the map takes ~20 small
    kernels (~0.035 ms on the H200 for the benchmark's varlen batch): the last varlen map is kept
    and returned again for the same host offsets, chunk size, device and stream. The map is a
    function of those alone: ``cu_seqlens`` holds the host offsets' values (read from it, or
    ``cu_seqlens_cpu``, which must match it, API.md). Same stream: a map built on another one
    might not be written yet. Neither kept nor reused inside a CUDA graph capture or a
    ``torch.compile`` trace: a captured map is written only when the graph replays, and a graph
    must own the memory it reads (a kept map is freed when the next one replaces it)."""
    global _last_varlen_layout
    if seq_offsets is None:
        NT = cdiv(T, BT)
        return ChunkLayout(BT, NT, B * NT, None, None, None)
    if (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()) or torch.compiler.is_compiling():
        return varlen_chunk_layout(BT, seq_offsets, cu_seqlens)
    stream = torch.cuda.current_stream(cu_seqlens.device) if cu_seqlens.is_cuda else None
    key = (cu_seqlens.device, stream, BT, tuple(seq_offsets))
    last = _last_varlen_layout
    if last is not None and last[0] == key:
        return last[1]
    layout = varlen_chunk_layout(BT, seq_offsets, cu_seqlens)
    _last_varlen_layout = (key, layout)
    return layout


def varlen_chunk_layout(BT: int, seq_offsets: list[int], cu_seqlens: torch.Tensor) -> ChunkLayout:
    """``chunk_layout``'s varlen map, built anew."""
    total = sum(cdiv(e - s, BT) for s, e in zip(seq_offsets, seq_offsets[1:]))
    cu = cu_seqlens.long()
    counts = (cu[1:] - cu[:-1] + BT - 1) // BT
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    # output_size: the size is known here, so repeat_interleave does not read counts back. It
    # trusts cu_seqlens_cpu to hold cu_seqlens' values (API.md); checking would cost the sync.
    seq = torch.repeat_interleave(counts, output_size=total)
    first = cu[seq] + (torch.arange(total, device=cu.device) - offsets[seq]) * BT
    rows = torch.stack([first, torch.clamp(cu[seq + 1] - first, max=BT)], 1)
    # Stable: sequences of as many chunks keep their order.
    order = torch.sort(counts, descending=True, stable=True).indices
    # First rows past int32 stay int64 (the kernels load either).
    rows = rows.int() if seq_offsets[-1] < 2 ** 31 else rows
    return ChunkLayout(BT, 0, total, rows, offsets.int(), order.int())


# Launch configuration of each chunk kernel: block sizes (capped by the head dims at launch) and
# Triton launch options. Chosen on the H200 with benchmarks/sweep.py (figures in BENCHMARKS.md);
# the sweep edits this table in place to time alternatives. The state slice [K, BV] of the
# sequential stages lives in registers in float32.
TUNING = {
    # H200 sweeps at 3598f32 + this table's changes, (8, 4096, 16), ms a call. maxnreg caps the
    # registers a thread so more programs fit an SM. cumsum: 0.308 capped at 96 (0.322 not, 0.407
    # at 64). pair_fwd: with the key slices outermost (thirteenth session) 0.327 at 1 warp (4
    # stages 0.326, 2 stages 0.338; 2 warps 0.481, capped at 128 0.560; 1 warp capped at 192
    # 0.417; 64-wide 0.451, 16-wide 0.453). With more than one warp, the products' left operand
    # [16, BK] is held whole by every warp, and so are the exponentials formed in its layout.
    # solve: 0.138 at 1 warp (0.308 at 2, 0.417 at 4: its [16, 16] blocks fill one warp); with
    # its products as tf32x3 (9ae34fc) still 1 warp: 0.170 against 0.396 at 2, 0.668 at 4; with
    # the gathered substitution (thirteenth session) 0.114 against 0.255 at 2 warps.
    # Not swept again since 6b02cbb, where the forward's cumsum build stopped writing the decayed
    # keys and queries (0.143 ms; ptxas: 28 B of spills at the 96 cap) and the pair products
    # started (0.444 ms; 251 registers at 1 warp, no spills). The inference build that
    # normalizes raw q and k itself (L2NORM) has an entry of its own, pair_fwd_norms (timed
    # end to end, not by this sweep): 255 registers at 1 warp, no spills (ptxas, triton 3.6).
    # 'cumsum' / 'cumsum_raw': the forward's builds (c only); '_decayed': the backward recompute's
    # (c and the decayed keys and queries).
    'cumsum': dict(BK=64, num_warps=4, maxnreg=96),
    'cumsum_decayed': dict(BK=64, num_warps=4, maxnreg=96),
    # The raw gate's builds (the activation inside). Before the split (sixteenth session, H200,
    # Kimi step at (8, 4096, 16), ms a launch averaged over the forward's and the recompute's
    # builds, which shared one entry): 64-wide with 4 warps 0.240 capped at 96 (now
    # cumsum_raw_decayed's setting), 0.249 uncapped, 0.317 with 8 warps; 32-wide 0.28-0.29 (2 or
    # 4 warps); 128-wide with 8 warps 0.299. The forward's build alone (twentieth session,
    # without the positivity check, which only a given g needs; call 3), ms a launch at
    # (8, 4096, 16) / (1, 32768, 32): 64-wide with 2 warps 0.116 / 0.230, 4 warps 0.118 / 0.231,
    # capped at 96 0.129 / 0.257; 128-wide with 4 warps 0.122 / 0.231, 8 warps 0.137 / 0.264;
    # 32-wide with 2 warps 0.140 / 0.283 (call 2: 64-wide with 8 warps 0.144 / 0.281, 32-wide
    # with 4 warps 0.147 / 0.293); FLA's gate cumsum, the same job, 0.119 / 0.233; the
    # g-pre-computed forward build 0.145 / 0.284 at its setting. ptxas (triton 3.6, bf16): the
    # forward build 96 registers at 2 warps uncapped, the recompute's 96 at its cap; no spills.
    'cumsum_raw': dict(BK=64, num_warps=2),
    'cumsum_raw_decayed': dict(BK=64, num_warps=4, maxnreg=96),
    'pair_fwd': dict(BK=32, num_warps=1, num_stages=3),
    # The inference build that normalizes raw q and k itself (L2NORM): its prologue reads block
    # I's rows for their norms, and the main loop reads them again, from cache. H200, inference
    # forward ms, 2 stages against 3 (twenty-eighth session, ab.py, 3 rounds, g pre-computed /
    # Kimi): (8, 4096, 16) -0.005 / -0.002, (1, 32768, 32) -0.010 / -0.007, (1, 8192, 96)
    # +0.001 / +0.009, (4, 8192, 32) -0.013 / -0.010, varlen -0.022 / -0.022. Against 3 stages
    # at three of those shapes (2 rounds): 4 stages +0.003 to +0.015, 16-wide +0.14 to +0.32,
    # 2 warps +0.14 to +0.29, 64-wide with 4 warps +0.30 to +0.60. Before L2NORM, with the norms
    # read in a pass of their own, 2 stages had read +0.004 / -0.002 at (1, 32768, 32)
    # (BENCHMARKS.md note 134).
    'pair_fwd_norms': dict(BK=32, num_warps=1, num_stages=2),
    'solve': dict(num_warps=1),
    'state_fwd': dict(BV=64, num_warps=4, num_stages=2),
    # H200 sweep at e525316, (8, 4096, 16) / (1, 8192, 96), ms a call: 0.418 / 0.791 with 1 stage
    # against 0.539 / 1.073 with 2 and 0.682 / 1.332 with 3; 32-wide 0.546 / 1.184, 8 warps
    # 0.692 / 1.351 (2 stages). The W/U kernel, carry and output kernel it replaces took 0.75.
    # Transposed (chunk_state.py), sweep in the ninth session: 0.387 / 0.728 (8 warps 0.695, 32-wide
    # 0.655, 2 stages 0.545).
    # Since 12f955c (c's last row loaded at the top of the step) this build spills 92 B a thread
    # with 16-bit inputs (ptxas, triton 3.6; it takes 16-bit V <= 64 and float32). Timed at
    # V = 64, bf16 (twenty-third session, ab.py, one round, forward ms): 5b824f3 -> 3037549
    # (12f955c and the float32 beta, 3dd9046) 1.082 -> 1.060 at (8, 4096, 16), 2.156 -> 2.101 at
    # (4, 8192, 32); Kimi 1.056 -> 1.037, 2.087 -> 2.042: the spills cost less than the load
    # gained. float32 inputs: not timed.
    'state_output': dict(BV=64, num_warps=4, num_stages=1),
    # H200 sweep at 2054ac8: 0.47 / 0.91 ms at (8, 4096, 16) / (1, 8192, 96) against 0.62 / 1.28
    # with 8 warps; with fewer programs than SMs see FEW_PROGRAMS.
    'state_bwd': dict(BV=64, num_warps=4, num_stages=2),
    # H200, (8, 4096, 16), ms a call. With dA formed on the value side (eleventh session,
    # BENCHMARKS.md note 67): 64-wide with 8 warps 1.710 (one program an SM), with 4 warps 1.834,
    # 2 stages 1.805, capped at 128 registers 2.070; 32-wide with 4 warps 1.905 (the earlier
    # setting), with 8 2.753. The kernel before that change took 2.531 at 64-wide with 8 warps.
    # Earlier history of the 32-wide kernel: 4 warps spilled 724 B a thread (8 warps: 152 B;
    # triton 3.6, ptxas -v) yet ran 2.27 ms against 3.49 at 8 warps (sweep at 15d04d2).
    'intra_bwd': dict(BK=64, BV=64, num_warps=8, num_stages=1),
    # H200 sweep at 3598f32, (8, 4096, 16): capped at 168 registers, 2.00 ms a call against 2.53
    # uncapped (3 programs an SM instead of 2); 1 stage 2.48 capped, 3.42 not; 32-wide >= 3.08.
    # With the diagonal blocks' products on the tensor cores (mm_fine, 9ae34fc) the cap moved:
    # 1.780 at 128 against 1.866 at 168 (3 stages 1.855, 144: 1.926; sweep at 9ae34fc).
    # With the diagonal blocks first (twelfth session): 1.655 at 128 (3 stages 1.653, 144: 1.896,
    # 168: 1.888, uncapped 1.894, 2 warps 2.007).
    'pair_bwd': dict(BK=64, num_warps=4, num_stages=2, maxnreg=128),
    # The same kernel compiled for the lower-bound gate (no diagonal fallback, chunk_intra_bwd.py):
    # H200 sweep at 44fc14e + BOUNDED_DECAY, Kimi configuration at (8, 4096, 16): 1.729 ms a call
    # capped at 128 against 1.878 at 168 (3 stages 1.850, 144: 1.926; the g-pre-computed build:
    # 1.994 at 168, 2.019 at 128). At 9ae34fc: 1.716 with 3 stages at 128 against 1.743 with 2
    # (168: 1.822, 3 stages 1.808; 112: 1.954). Diagonal blocks first: 1.576 with 3 stages at 128
    # (2 stages 1.585, 144: 1.768, 168: 1.821, uncapped 1.820, 2 warps 1.865).
    'pair_bwd_bounded': dict(BK=64, num_warps=4, num_stages=3, maxnreg=128),
    # H200 sweeps at 1c6c735, (8, 4096, 16), ms a call, g pre-computed / raw gate (lower bound):
    # 32-wide 4 warps 0.219 / 0.280 (the earlier setting), 2 warps 0.214-0.219 / 0.207, 1 warp
    # 0.216 / 0.242, 8 warps 0.237 / 0.470; 64-wide 4 warps 0.195-0.197 / 0.296-0.298, 2 warps
    # 0.196 / 0.239, 1 warp 0.196 / 0.536; 128-wide 4 warps 0.197 / 0.318; 16-wide >= 0.265. The
    # raw gate's build (its activation and gradient per entry, and the A_log and dt_bias sums)
    # takes its own entry; the softplus gate was not swept and shares it.
    'gate_bwd': dict(BK=64, num_warps=4),
    'gate_bwd_raw': dict(BK=32, num_warps=2),
    # The sums over chunks of the gate parameters' gradients, BN chunks a step. H200, alone
    # (do_bench, launch included), us a call at 512 chunks x 16 / 32 value heads and 256 x 96:
    # 32-wide, 256 chunks, 8 warps 10.2 / 10.9 / 10.9; 32-wide, 64 chunks, 4 warps 19.5 / 20.5 /
    # 13.7 (in the Kimi step at (8, 4096, 16): 0.016 ms; the chosen setting's time in the step
    # is not measured); 64-wide >= 14.6 / 15.0 / 12.7; 128-wide >= 22.6; PyTorch's two
    # reductions 39.4 / 41.2 / 26.9.
    'gate_params': dict(BK=32, BN=256, num_warps=8),
}


# The state sweeps run one program per (sequence, value head, value slice) through every chunk of
# the sequence. Where that is fewer programs than SMs, the slice is halved for twice as many and
# these settings apply on top (a BV here replaces the halved one). H200 sweeps at (1, 32768, 32),
# the only such shape benchmarked, ms a call: at 2054ac8, carry 1.16 32-wide against 1.21
# 64-wide, gradient sweep 1.92 32-wide with 8 warps against 2.13 64-wide and 2.44 with 4; at
# 44fc14e (fifth session), carry 1.172 16-wide (4 warps) against 1.223 32-wide (16-wide with 8
# warps 1.306, 2 warps 1.274), gradient sweep 1.618 with 3 stages against 1.711 with 2 (16-wide
# 1.719 at 4 warps, 3.064 at 8).
# The fused forward sweep with few programs, H200, (1, 32768, 32), ms a call: at 883db65 1.811
# 32-wide with 2 stages against 1.964 16-wide (3 stages 3.259, 8 warps 3.737); at e525316 one
# stage was slower (16-wide 2.382, 32-wide 2.294). With the state sweeps applying M themselves
# (f3e12c9) the carry takes 1.419 16-wide (32-wide 1.496) and the gradient sweep 1.961 with 3
# stages (2 stages 1.975, 16-wide 3.592): 0.22 and 0.29 ms more than the WY form's, whose W/U
# kernel (~0.48 ms) they no longer need.
# The transposed sweeps (ninth session, S^T kept so that every state-dependent operand is a
# register-resident left operand; the backward's carry beside its gradient sweep, see
# chunk_kda_bwd), fwd + bwd at (1, 32768, 32), ms a step: carry 32-wide and gradient sweep with 4
# warps and 3 stages 15.07, with 2 stages 15.20; with the earlier settings (carry 16-wide, 8 warps
# for the gradient sweep, which then fills an SM's registers alone and leaves the carry none)
# 16.02. Alone, the transposed fused forward sweep takes 1.551 32-wide (16-wide 1.559, 64-wide
# 2.098).
FEW_PROGRAMS = {'state_fwd': dict(BV=32), 'state_output': dict(BV=32, num_stages=2),
                'state_bwd': dict(num_warps=4, num_stages=3)}
# Where the fused forward sweep has at least as many programs as SMs at TUNING's 64-wide slices
# (so not FEW_PROGRAMS), 16-bit inputs and K <= 128: one 128-wide slice a program with 8 warps.
# Its 247 registers a thread (ptxas, triton 3.6, bf16, float32 beta) leave room for one program
# an SM where two 64-wide ones shared it, but the key-side tiles (qt, kg, kbar, Aqk, M), which every value slice
# of a head reads, are read once instead of twice. H200, Kimi inference forward (twenty-first
# session, call 4; the sweep alone in brackets), ms: (8, 4096, 16) 1.153 -> 1.131 (0.375 ->
# 0.353); (4, 8192, 32) 2.291 -> 2.250; (1, 8192, 96) 1.754 -> 1.711 (in its 3 segments);
# (8, 4096, 32) 2.371 -> 2.243 (0.836 -> 0.704); the benchmark's varlen batch 2.419 -> 2.277;
# (16, 4096, 32) 4.692 -> 4.420; (2, 4096, 64) 1.164 -> 1.155; (16, 2048, 16) 1.195 -> 1.128.
# With two 64-wide programs an SM, a sweep of more programs than two an SM ran ~11 % slower a
# chunk step than one of fewer ((8, 4096, 32) 0.836 ms against 0.750 at (4, 8192, 32), the same
# chunk steps; call 2). Call 3, the sweep at (8, 4096, 32), the varlen batch and (2, 8192, 96):
# 0.714 / 0.713 / 1.307 ms with 2 stages, 0.758 / 0.766 / 1.480 with one (20 KiB of shared
# memory against 120, 248 registers). The backward's sweeps lost so, forward + backward at
# (8, 4096, 16): carry 0.324 -> 0.559 ms, gradient sweep 0.453 -> 0.505. float32 keeps the
# 64-wide build: its 128-wide one asks 246,016 B of shared memory with 2 stages (triton 3.6 and
# 3.9), more than the H200's 232,448. Between 66 and 131 (sequence, head) pairs (132 SMs) the
# wide sweep leaves SMs idle (one program a pair); that range was not timed.
WIDE_SLICES = {'state_output': dict(BV=128, num_warps=8, num_stages=2)}


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (132 on the H200); 1 elsewhere (the interpreter)."""
    if device.type != 'cuda':
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def dependent_launch(device: torch.device) -> bool:
    """Whether ``device`` has programmatic dependent launch (CUDA, compute capability 9.0 and
    later; not the interpreter). Where it has, the cumsum always releases its dependents, and in
    the inference forward with l2norm in the kernel (``stage1_matrices``) the pair products and
    the solve are launched with ``launch_pdl`` and may start as the kernel before them drains,
    the pair products forming their rows' norms meanwhile (``kernels/chunk_common.py``,
    ``wait_for_previous``). H200, inference forward ms against the same kernels launched
    plainly (twenty-ninth session, ``ab.py``, 2 rounds, Kimi / g pre-computed; outputs and
    gradients bit for bit the same): (1, 8192, 96) -0.021 / -0.016, varlen batch -0.011 /
    -0.013, (8, 4096, 16) -0.001 / +0.002, (1, 32768, 32) -0.001 / +0.005, (4, 8192, 32)
    +0.004 / +0.008. Elsewhere (training, inference without l2norm) the pair products have
    nothing to do before their wait, and in training early launches cost at one shape (why is
    not known; perhaps their waiting programs hold SMs the other stream's sweep could use).
    H200, forward + backward ms against 2c22fcc's plain launches (``ab.py``, 3 rounds, Kimi / g
    pre-computed): (1, 32768, 32) +0.166 / -0.012 with PDL, -0.020 / -0.017 without;
    (1, 8192, 96) -0.006 / -0.018 with, +0.003 / -0.008 without. Inference without l2norm was
    not timed either way. The solve never has work before its wait; it is launched early with
    the pair products, as de318cc measured it. Not on ROCm, whose devices report a compute
    capability too (9.x on MI200 and MI300) but have no griddepcontrol."""
    return (device.type == 'cuda' and not INTERPRET and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_config(stage: str, K: int, V: int) -> dict:
    """Keyword arguments for launching ``stage``'s kernel at head dims K, V (see ``TUNING``)."""
    cfg = {name: value for name, value in TUNING[stage].items() if value is not None}
    # next_pow2 is at least 16, the smallest operand tl.dot takes.
    if 'BK' in cfg:
        cfg['BK'] = min(cfg['BK'], next_pow2(K))
    if 'BV' in cfg:
        cfg['BV'] = min(cfg['BV'], next_pow2(V))
    if stage == 'intra_bwd':
        # Square tiles only. With BK < BV (K = 16 and V >= 32; or forced 16 / 32 and 32 / 64 at
        # K = V = 128) the compiled kernel reads past its shared memory on the H200 (triton 3.6,
        # bf16; compute-sanitizer: invalid __shared__ reads of 512 bytes), an illegal-address
        # fault; the interpreter gives the right gradients there. Not understood, avoided.
        cfg['BK'] = cfg['BV'] = min(cfg['BK'], cfg['BV'])
    return cfg


def sweep_programs(stage: str, K: int, V: int, sequence_heads: int) -> int:
    """Programs of a state sweep over ``sequence_heads`` (sequence, value head) pairs at TUNING's
    value slices."""
    return sequence_heads * cdiv(V, launch_config(stage, K, V)['BV'])


def few_programs(stage: str, K: int, V: int, sequence_heads: int, device) -> bool:
    """Whether a state sweep over ``sequence_heads`` (sequence, value head) pairs, at TUNING's
    value slices, has fewer programs than the device has SMs (FEW_PROGRAMS)."""
    return sweep_programs(stage, K, V, sequence_heads) < sm_count(device)


def state_launch_config(stage: str, K: int, V: int, sequence_heads: int, device,
                        dtype: torch.dtype, varlen: bool = False) -> dict:
    """``launch_config`` of a state sweep over ``sequence_heads`` (sequence, value head) pairs of
    ``dtype`` inputs, with FEW_PROGRAMS applied when they would leave SMs idle (else WIDE_SLICES
    where it applies), and the order of its programs (``SLICES_INNERMOST``, see ``sweep_grid``;
    ``varlen``: sequences of their own lengths)."""
    cfg = launch_config(stage, K, V)
    few = few_programs(stage, K, V, sequence_heads, device)
    if few:
        cfg['BV'] = max(16, cfg['BV'] // 2)
        cfg.update({n: x for n, x in FEW_PROGRAMS[stage].items() if x is not None})
        cfg['BV'] = min(cfg['BV'], next_pow2(V))
    elif stage in WIDE_SLICES and dtype != torch.float32 and K <= 128 and V > cfg['BV']:
        cfg.update({n: x for n, x in WIDE_SLICES[stage].items() if x is not None})
    cfg['SLICES_INNERMOST'] = stage != 'state_output' and (varlen or not few)
    # Shape rules last, so that no table entry above overrides them. The whole key dimension is
    # one block; at K = 256 half the value slice keeps the [256, BV] float32 state within the
    # registers.
    cfg['BK'] = next_pow2(K)
    if cfg['BK'] > 128:
        cfg['BV'] = min(cfg['BV'], 32)
        # Past two stages the [256, 64] key-side tiles' pipeline buffers outgrow shared memory:
        # the gradient sweep with few programs asked 256 KiB with 3 (bf16, triton 3.6, found on the
        # H200 at the transposed sweeps; test_launch_shared_memory).
        cfg['num_stages'] = min(cfg.get('num_stages', 2), 2)
    if dtype == torch.float32:
        # float32 tiles double the pipeline buffers (the H200 has 227 KiB of shared memory): the
        # gradient sweep asks 256 KiB at K = 128 with 3 stages (136 KiB with 2; found by the GPU
        # suite at f056478, where FEW_PROGRAMS gave it 3 stages), and the sweeps 254-287 KiB at
        # K = 256 with 2 (triton 3.6; one stage fits). test_launch_shared_memory pins both.
        cfg['num_stages'] = min(cfg.get('num_stages', 2), 2 if K <= 128 else 1)
    elif stage != 'state_output':
        # 16-bit inputs: compiled with one stage, the carry and the gradient sweep fault on the
        # H200 (illegal memory access; triton 3.6, bf16: the carry 16- and 32-wide with 4 warps
        # at (1, 32768, 32), the gradient sweep 32-wide with 8 warps there and with 4 at K = 256,
        # where this rule used to give every sweep one stage; test_cuda_bf16_head_dim_256). Not
        # understood; the fused forward sweep (one stage with many programs, two with few) has not
        # faulted at any tested shape (bf16, K <= 256). Two stages fit at K = 256 in 16 bits
        # (61 KiB).
        cfg['num_stages'] = max(cfg.get('num_stages', 2), 2)
    return cfg


def transposed_sweeps(N: int, HV: int, K: int, V: int, device, dtype: torch.dtype) -> bool:
    """Whether the backward's carry and gradient sweep hold the state transposed
    (``kernels/chunk_state.py``) and run side by side (``chunk_kda_bwd``): where the carry's
    (sequence, value head, value slice) programs make at most 1.5 waves on the device's SMs (a
    looser bound than FEW_PROGRAMS'). With more programs both lose, the transposed gradient sweep
    most (H200, (8, 4096, 16), 256 programs a sweep: 0.473 -> 0.566 ms a call, the step
    7.12 -> 7.17 ms side by side; the varlen batch, 512: 14.47 -> 14.52; but (1, 8192, 96), 192
    programs, 11.39 -> 11.04, and (1, 32768, 32), 128, 16.82 -> 15.07 with both). The gradient
    sweep's slices are as wide as the carry's wherever this holds at the benchmark's shapes."""
    BV = state_launch_config('state_fwd', K, V, N * HV, device, dtype)['BV']
    return 2 * N * HV * cdiv(V, BV) <= 3 * sm_count(device)


def gate_launch_args(gate: KernelGate | None) -> dict:
    """The gate arguments of the kernels that read ``g`` (``kernels/gate.py``)."""
    if gate is None:
        return dict(A_log=None, dt_bias=None, lower_bound=0.0, GATE='none')
    A_log, dt_bias = (None if t is None else t.detach().contiguous() for t in (gate.A_log, gate.dt_bias))
    return dict(A_log=A_log, dt_bias=dt_bias, lower_bound=gate.lower_bound, GATE=gate.kind)


def sweep_grid(N: int, HV: int, V: int, cfg: dict) -> tuple[int, ...]:
    """The grid of a state sweep launched with ``cfg`` (``state_launch_config``), as
    ``sweep_program`` in ``kernels/chunk_common.py`` reads it: the value slices innermost on one
    axis (``SLICES_INNERMOST``: the backward's sweeps, carry and gradient sweep, but with few
    programs at fixed length) or on grid axis 1 (the fused forward sweep always). The same
    kernels, the same bits; only the order in which their programs are issued differs, and why it
    costs what it does is not established. H200, ms:

    - a varlen sweep lasts as long as its longest chain of chunks; where more programs than fit
      the GPU run one after another, a long sequence started last lengthens it, hence longest
      first (with the slices on axis 1, the first slice of every sequence starts before any
      second one). The benchmark's varlen batch (32768 tokens in 8 sequences) against the
      fixed-length order, a call: gradient sweep 1.418 -> 0.952, carry 0.816 -> 0.633 with the
      slices innermost (longest first, slices on axis 1: 1.238, 0.706);
    - the fused forward sweep, a call, axis 1 against innermost (eighteenth session):
      (8, 4096, 16) 0.384 / 0.460, (4, 8192, 32) 0.762 / 0.913, (1, 8192, 96) 0.742 / 0.892,
      varlen 4 x 8192 0.780 / 0.914, the varlen batch 0.858 / 0.915;
    - the backward's fixed-length sweeps innermost against axis 1, forward + backward a step,
      g pre-computed / Kimi gate: (8, 4096, 16) -0.072 / -0.031, (4, 8192, 32) -0.178 / -0.056,
      (1, 8192, 96) -0.076 / -0.099; with few programs, (1, 32768, 32): -0.066 / +0.091."""
    NV = cdiv(V, cfg['BV'])
    return (N * HV * NV,) if cfg['SLICES_INNERMOST'] else (N * HV, NV)


def head_dims(q, v, layout: ChunkLayout, cu_seqlens) -> dict:
    """The compile-time sizes most chunk kernels take (head counts and dims, chunk, dot dtype,
    varlen)."""
    return dict(H=q.shape[2], HV=v.shape[2], K=q.shape[3], V=v.shape[3], BT=layout.BT,
                DOT_DTYPE=DOT_DTYPES[q.dtype], IS_VARLEN=cu_seqlens is not None)


@dataclass
class Stage1:
    """Stage 1's per-token outputs: cumulative log-decay ``gc`` (float32), decayed queries ``qt``
    and keys ``kbar``, ``kg``, and the in-chunk matrices."""
    gc: torch.Tensor
    qt: torch.Tensor
    kbar: torch.Tensor
    kg: torch.Tensor
    Aqk: torch.Tensor
    Akk: torch.Tensor
    Minv: torch.Tensor

    def tokens(self, part: slice) -> Stage1:
        """Views of every tensor's tokens ``part`` (axis 1)."""
        return Stage1(*(getattr(self, f.name)[:, part] for f in fields(self)))


def stage1_buffers(B: int, T: int, HV: int, K: int, BT: int, device, dtype: torch.dtype,
                   matrices: bool = True) -> Stage1:
    """Uninitialized stage-1 tensors for ``[B, T]`` tokens of ``dtype`` inputs; without
    ``matrices``, None for Aqk, A' and M."""
    gc = torch.empty(B, T, HV, K, dtype=torch.float32, device=device)
    # Decayed keys and queries for the state sweeps and the outputs.
    kbar, qt, kg = (torch.empty(B, T, HV, K, dtype=dtype, device=device) for _ in range(3))
    if not matrices:
        return Stage1(gc, qt, kbar, kg, None, None, None)
    # Aqk and M are only ever matrix-product operands after the kernel that forms them, rounded
    # to the input dtype there anyway: kept in it, bit for bit the same results. A' is not: the
    # solve reads it in float32 (its products keep float32 operands, mm_fine) and the beta
    # gradient uses it element by element.
    Aqk = torch.empty(B, T, HV, BT, dtype=dtype, device=device)
    Akk = torch.empty(B, T, HV, BT, dtype=torch.float32, device=device)
    Minv = torch.empty(B, T, HV, BT, dtype=dtype, device=device)
    return Stage1(gc, qt, kbar, kg, Aqk, Akk, Minv)


def chunk_stage1(q, k, g, beta, scale, layout: ChunkLayout, gate: KernelGate | None,
                 HV: int, matrices=None, out: Stage1 | None = None) -> Stage1:
    """Cumulative decay and decayed keys / queries; with ``matrices`` (``(Aqk, Akk, Minv)`` of an
    earlier call on the same inputs) the pair products and the solve are not run again.
    ``gate``: ``g`` is the raw gate, activated in the first kernel. ``out``: tensors to write
    into (``stage1_buffers``' shapes), else new ones."""
    B, T, _, K = q.shape
    s1 = out if out is not None else stage1_buffers(B, T, HV, K, layout.BT, q.device, q.dtype,
                                                    matrices is None)
    stage1_cumsum(q, k, g, scale, layout, gate, HV, s1, decayed=matrices is not None)
    if matrices is not None:
        return Stage1(s1.gc, s1.qt, s1.kbar, s1.kg, *matrices)
    return stage1_matrices(q, k, beta, scale, layout, HV, s1)


def stage1_cumsum(q, k, g, scale, layout: ChunkLayout, gate: KernelGate | None, HV: int, s1: Stage1,
                  decayed: bool):
    """Stage 1's first kernel into ``s1``: the cumulative decay, and with ``decayed`` (the
    backward's recompute) the decayed keys and queries (``chunk_stage1``)."""
    _, T, H, K = q.shape
    cfg = launch_config(('cumsum' if gate is None else 'cumsum_raw') + ('_decayed' if decayed else ''),
                        K, K)
    # The decayed keys and queries come from the pair products when those run (the forward).
    chunk_cumsum_kernel[(layout.total, HV * cdiv(K, cfg['BK']))](
        g, q=q, k=k, gc=s1.gc, qt=s1.qt, kbar=s1.kbar, kg=s1.kg, scale=scale, H=H, HV=HV, K=K,
        BT=layout.BT, DECAYED=decayed, IS_VARLEN=layout.rows is not None, chunk_rows=layout.rows,
        T=T, NT=layout.NT, PDL=dependent_launch(q.device), **gate_launch_args(gate), **cfg)


def stage1_matrices(q, k, beta, scale, layout: ChunkLayout, HV: int, s1: Stage1,
                    l2norm: bool = False, all_near: bool = False) -> Stage1:
    """The rest of the forward's stage 1 into ``s1``, on its cumulative decay: the pair products
    (Aqk, A', the decayed keys and queries), then the solve (M) (``chunk_stage1``). ``l2norm``:
    q and k are raw, and the pair products normalize the rows they read (inference with
    ``use_qk_l2norm_in_kernel``, ``chunk_pair_fwd_kernel``). ``all_near``: no key entry of a
    diagonal block can leave the factored form's range (steps >= -5, keys of norm 1), so the
    build without the far-entry test and fallback runs (``ALL_NEAR``; float16 never factors).
    The same bits; H200, Kimi inference forward with l2norm in the kernel, ms (``ab.py``, 4
    rounds, thirty-fourth session): (8, 4096, 16) -0.027, (1, 32768, 32) -0.074, (1, 8192, 96)
    -0.043, (4, 8192, 32) -0.051, varlen batch -0.058 (ptxas, triton 3.6: 255 -> 242 registers,
    no spills either way)."""
    _, T, H, K = q.shape
    BT = layout.BT
    dt = q.dtype
    is_varlen = layout.rows is not None
    # Early only where the pair products have work before their wait (the rows' norms): see
    # dependent_launch for the cost in training.
    pdl = l2norm and dependent_launch(q.device)
    chunks = dict(chunk_rows=layout.rows, T=T, NT=layout.NT, PDL=pdl, launch_pdl=pdl)
    # float16's range ends at 65504: no factor >= 1 on its operands.
    factored = dt != torch.float16
    chunk_pair_fwd_kernel[(layout.total * (BT // BC), HV)](
        q, k, s1.gc, s1.Aqk, s1.Akk, s1.qt, s1.kbar, s1.kg, scale=scale, H=H, HV=HV, K=K, BT=BT,
        BC=BC, DOT_DTYPE=DOT_DTYPES[dt],
        FACTORED_DIAG=factored, ALL_NEAR=all_near and factored, L2NORM=l2norm, IS_VARLEN=is_varlen,
        **chunks,
        **launch_config('pair_fwd_norms' if l2norm else 'pair_fwd', K, K))
    chunk_solve_kernel[(layout.total, HV)](
        beta, s1.Akk, s1.Minv, HV=HV, BT=BT, BC=BC, DOT_DTYPE=DOT_DTYPES[dt], IS_VARLEN=is_varlen,
        **chunks, **launch_config('solve', K, K))
    return s1


# The forward in time segments (forward_segments): how many where the sweep has at most one
# program for every two SMs, and how many where it has more (but fewer than two an SM, see
# busy_sweep); see SEGMENT_BALANCE for their lengths.
FORWARD_SEGMENTS = 4
BUSY_SWEEP_SEGMENTS = 3
# Value heads at which a K = V = 128 sweep over the whole sequence takes as long as stage 1 for it
# (H200: a chunk step of the few-program sweep ~3 us, 1.58 ms at (1, 32768, 32); stage 1 ~2.2 ns a
# token-head, 2.34 ms there; so 3 us / 64 tokens / 2.2 ns ~ 21 heads, the first setting, 20).
# Stage 1 now takes ~1.34 ns a token-head (cumsum 0.143 + pair products 0.444 + solve 0.115 ms
# for 524,288 at (8, 4096, 16)), which puts the balance near 35. H200 sweep at 6b02cbb,
# (1, 32768, 32) forward ms, g pre-computed / Kimi gate: 4 segments at 20 2.871 / 2.841, at 30
# 2.790 / 2.733, at 40 (equal segments) 2.798 / 2.740; 6 segments at 20 2.846 / 2.828, at 30
# 2.758 / 2.725; 3 at 30 2.809 / 2.767. Outputs the same bits in every setting.
SEGMENT_BALANCE = 30
# Token-heads below which the forward is not segmented: each segment adds ~5 launches and a
# dozen views on the host (an estimate: ~0.1 ms a segment), and a call already spends ~1 ms there,
# so a forward that takes the GPU ~2 ms or less (H200, K = V = 128: (1, 16384, 32), 1.97 ms whole)
# would wait on the host instead. Measured there: 1.71-1.94 ms segmented in two calls.
SEGMENT_MIN_TOKEN_HEADS = 1 << 19


def busy_sweep(HV: int, K: int, V: int, device) -> bool:
    """Whether the fused sweep over one sequence's ``HV`` heads has more than one program for
    every two SMs (at TUNING's value slices). Segmented, such a forward runs stage 1's cumsum for
    the whole sequence first, alone, and fewer segments (``forward_segments``)."""
    return 2 * sweep_programs('state_output', K, V, HV) > sm_count(device)


def forward_segments(B: int, T: int, HV: int, K: int, V: int, layout: ChunkLayout, cu_seqlens,
                     store_states: bool, device) -> list[tuple[int, int]] | None:
    """Token ranges ``[t0, t1)`` (whole chunks) in which ``chunk_kda_fwd`` runs stage 1 and the
    fused sweep one after the other, so that each segment's sweep runs beside the next
    segment's stage 1; None for one pass over the whole sequence. Segmented only where the sweep
    leaves SMs room (fewer programs, counted at TUNING's 64-wide value slices, than two an SM:
    two such 4-warp programs, or one of WIDE_SLICES' 128-wide 8-warp ones, fill an SM's
    registers) and a segment is a contiguous view of every tensor: one sequence of fixed length
    (B = 1), without ``store_states``, long enough (``SEGMENT_MIN_TOKEN_HEADS``) that the GPU,
    not the host, sets the time. FORWARD_SEGMENTS segments where the sweep has at most one
    program for every two SMs, else BUSY_SWEEP_SEGMENTS (``busy_sweep``).

    The first segment's stage 1 runs alone, at full speed; each later one beside the previous
    segment's sweep, which slows both; the last segment's sweep runs alone at the end. Where the
    sweep is the shorter part (many heads) the segments shrink geometrically, by
    ``SEGMENT_BALANCE / HV`` (at least 0.6), so that more of stage 1 runs alone and the last sweep
    is short, while each sweep still ends before the next segment's stage 1 does. H200, forward ms,
    4 segments, at 04208c2 (stage 1 then ~2.2 ns a token-head, SEGMENT_BALANCE 20, which gave
    (1, 32768, 32) the ratio 0.6; now 30 heads give it 0.94, see SEGMENT_BALANCE for the sweep):
    (1, 32768, 32) 3.904 whole, 3.452 equal, 3.348 shrinking by 0.6 (0.5: 3.449);
    (1, 16384, 32) 1.968, 1.766, 1.709; (1, 65536, 16), where the sweep is the longer part,
    5.154, 4.407 equal, 4.561 by 0.7, 4.700 by 0.6; (1, 16384, 64), whose halved slices give
    two sweep programs an SM, 3.372 whole, 3.327 by 0.6. A lighter sweep beside stage 1 loses:
    at (1, 32768, 32), 3.331 against 4.045 capped at 168 registers, 4.526 at 128, 4.186 with
    2 warps (stage 1's pair products 1.58 -> 1.29-1.36 ms, the sweeps 1.87 -> 2.60-3.15).
    Nineteenth session (forced, one run each; whole / 2 / 3 / 4 segments by 0.6, g pre-computed
    and Kimi gate): (1, 8192, 96), 192 programs, 1.925 / 1.813 / 1.799 / 1.804 and 1.952 / 1.923 /
    1.940 / 1.972 (it was left whole before); (1, 16384, 64), 128 programs with 64-wide slices,
    2.638 / 2.583 / 2.617 / 2.647 and 2.661 / 2.555 / 2.574 / 2.594 (it had 4 segments). With the
    cumsum of the whole sequence first (``chunk_kda_fwd``): (1, 8192, 96) 1.927 / 1.857 / 1.791
    and 1.955 / 1.871 / 1.816 (3 by 0.8: 1.798, 1.821), but (1, 32768, 32), 64 programs, 4
    segments: 2.697 -> 2.862 and 2.652 -> 2.802, the sweeps starting later (A/B, 2 rounds)."""
    if (cu_seqlens is not None or B != 1 or store_states or layout.NT < 2
            or T * HV < SEGMENT_MIN_TOKEN_HEADS):
        return None
    programs, sms = sweep_programs('state_output', K, V, HV), sm_count(device)
    if programs >= 2 * sms:
        return None
    S = BUSY_SWEEP_SEGMENTS if busy_sweep(HV, K, V, device) else FORWARD_SEGMENTS
    return segment_bounds(T, layout.BT, S, min(1.0, max(0.6, SEGMENT_BALANCE / HV)))


def segment_bounds(T: int, BT: int, segments: int, ratio: float) -> list[tuple[int, int]]:
    """``[t0, t1)`` of ``segments`` segments (at most one a chunk) of a ``T``-token sequence in
    whole ``BT``-token chunks, each ``ratio`` times as long as the one before it: one chunk each,
    the others shared by weight ``ratio ** i``, rounded down, what rounding left one each to the
    first segments (``forward_segments``; ``benchmarks/sweep_segments.py`` times others)."""
    NT = cdiv(T, BT)
    S = min(segments, NT)
    weights = [ratio ** i for i in range(S)]
    counts = [1 + int((NT - S) * w / sum(weights)) for w in weights]
    for i in range(NT - sum(counts)):
        counts[i] += 1
    ends = list(itertools.accumulate(counts))
    bounds = [0, *(BT * e for e in ends[:-1]), T]
    return list(zip(bounds, bounds[1:]))


def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
                  cu_seqlens, layout: ChunkLayout, gate: KernelGate | None = None,
                  store_states: bool = False, l2norm: bool = False, unit_keys: bool = False,
                  prepare_beta=None):
    """The forward: stage 1, then the fused state sweep and outputs
    (``kernels/chunk_state_output.py``). Returns ``(o, final_state, stage1, h)``: ``h`` the
    float32 state entering every chunk with ``store_states``, else None. ``l2norm`` (inference
    with ``use_qk_l2norm_in_kernel``): q and k are raw, and the pair products normalize the rows
    they read (``chunk_pair_fwd_kernel``). ``unit_keys``: k's rows are l2norm's output (training
    with ``use_qk_l2norm_in_kernel``). Keys of norm 1 (either way) under the lower-bound gate
    take the pair products' build without the far-entry fallback (``ALL_NEAR``, ``diag_slice``).
    ``prepare_beta`` (inference): ``beta`` is the caller's, and ``prepare_beta(out, beta)``
    writes the float32 copy the kernels read (``kernel_beta``); it runs on the side stream
    beside the first cumsum, which does not read it, and not at the head of the current stream's
    chain (at SEGMENT_MIN_TOKEN_HEADS and above). H200, Kimi inference forward ms at
    (8, 4096, 16) / (1, 32768, 32) / (1, 8192, 96) (twenty-eighth session, BENCHMARKS.md note 137): -0.003 / -0.004 / -0.001 against beta's two
    PyTorch kernels (float copy, sigmoid) at the chain's head; beta given activated in float32,
    the bound, read -0.008 / -0.007 / -0.010 against that head.

    Where ``forward_segments`` cuts the sequence, each segment's sweep runs on a side stream,
    starting from the state the previous segment's sweep left in a float32 buffer, while the
    current stream forms the next segment's stage 1: the few-program sweep leaves most of every
    SM to stage 1's kernels. Where the sweep is busier (``busy_sweep``) the cumsum runs for the
    whole sequence first and each segment forms only its pair products and M. The same steps
    on the same chunks, so the same bits. H200, at
    04208c2, (1, 32768, 32), 4 segments shrinking by 0.6: forward 3.904 -> 3.348 ms (stage 1's pair
    products 1.05 -> 1.58 ms beside the sweeps, which take 1.86 against 1.58), forward + backward
    15.06 -> 14.56 ms. Not segmented: several sequences (their segments would not be contiguous
    views; the kernels would need a row stride per sequence) and the backward (its carry and
    gradient sweep would need stage 1's segments in opposite orders)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dev, dt = q.device, q.dtype
    blocks = state_launch_config('state_output', K, V, N * HV, dev, dt, cu_seqlens is not None)
    o = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    h = torch.empty(layout.total, HV, K, V, dtype=torch.float32, device=dev) if store_states else None
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    final_state = torch.empty(shape, dtype=torch.float32, device=dev) if output_final_state else None

    def sweep(s1, part, part_layout, h0, ht):
        Tp = part.stop - part.start
        chunk_state_output_fwd_kernel[sweep_grid(N, HV, V, blocks)](
            s1.qt, s1.kg, s1.kbar, v[:, part], beta[:, part], s1.gc, s1.Aqk, s1.Minv, o[:, part], h,
            h0, ht, cu_seqlens, part_layout.offsets, part_layout.order, Tp, part_layout.NT,
            *state_strides(K, V, state_v_first), USE_INITIAL_STATE=h0 is not None,
            STORE_FINAL_STATE=ht is not None, STORE_STATES=store_states, **blocks,
            **head_dims(q, v, part_layout, cu_seqlens))

    all_near = (l2norm or unit_keys) and bounded_decay(gate)
    segments = forward_segments(B, T, HV, K, V, layout, cu_seqlens, store_states, dev)
    s1 = stage1_buffers(B, T, HV, K, layout.BT, dev, dt)
    side = None
    try:
        if prepare_beta is not None:
            # Allocated on the current stream, which frees it; the join below orders the side
            # stream's write before every kernel that reads it. On the current stream where the
            # host may set the time (SEGMENT_MIN_TOKEN_HEADS): the fork and the join are two more
            # events for it to record.
            beta, raw_beta = torch.empty(beta.shape, dtype=torch.float32, device=dev), beta
            side = fork(dev) if B * T * HV >= SEGMENT_MIN_TOKEN_HEADS else None
            with torch.cuda.stream(side):
                prepare_beta(beta, raw_beta)
        if segments is None:
            stage1_cumsum(q, k, g, scale, layout, gate, HV, s1, decayed=False)
            join(side)
            stage1_matrices(q, k, beta, scale, layout, HV, s1, l2norm, all_near=all_near)
            sweep(s1, slice(0, T), layout, initial_state, final_state)
            return o, final_state, s1, h
        cumsum_first = busy_sweep(HV, K, V, dev)
        if cumsum_first:
            # The cumulative decay of every segment first, alone: beside a sweep the raw gate's
            # build slowed most (H200, (1, 8192, 96), 2 segments: Kimi forward 1.923 ms against
            # 1.813 with g pre-computed; whole 1.952 / 1.925). With few sweep programs the sweeps
            # set the time and must start early: there it costs ~0.15 ms (forward_segments).
            stage1_cumsum(q, k, g, scale, layout, gate, HV, s1, decayed=False)
        carried = torch.empty(shape, dtype=torch.float32, device=dev)
        for i, (t0, t1) in enumerate(segments):
            part = slice(t0, t1)
            part_layout = chunk_layout(B, t1 - t0, layout.BT, None, None)
            s1_part = s1.tokens(part)
            if not cumsum_first:
                stage1_cumsum(q[:, part], k[:, part], g[:, part], scale, part_layout, gate, HV, s1_part,
                              decayed=False)
            if i == 0:
                join(side)
            stage1_matrices(q[:, part], k[:, part], beta[:, part], scale, part_layout, HV, s1_part,
                            l2norm, all_near=all_near)
            side = fork(dev)
            with torch.cuda.stream(side):
                sweep(s1_part, part, part_layout, initial_state if i == 0 else carried,
                      final_state if i == len(segments) - 1 else carried)
    finally:
        # Also on an error: the sweeps read and write tensors the current stream would otherwise
        # free.
        join(side)
    return o, final_state, s1, h


def chunk_kda_recompute(q, k, v, beta, initial_state, state_v_first, cu_seqlens, layout: ChunkLayout,
                        s1: Stage1, side: torch.cuda.Stream | None = None):
    """What the backward reads of the forward: stage 1's tensors and the state carry's, every
    chunk's incoming state ``h`` and corrections ``v_new`` (``kernels/chunk_state.py``):
    ``(gc, Aqk, Akk, Minv, kg, h, v_new, kbar, qt)``, on stage 1's tensors ``s1``. The carry is
    launched on ``side`` when given (``chunk_kda_bwd``); its outputs are allocated on the current
    stream, which frees them, so their memory stays in the current stream's pool."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dev, dt = q.device, q.dtype
    blocks = state_launch_config('state_fwd', K, V, N * HV, dev, dt, cu_seqlens is not None)
    # In the input dtype: every later product rounds them to it anyway.
    h = torch.empty(layout.total, HV, K, V, dtype=dt, device=dev)
    v_new = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    with torch.cuda.stream(side):
        chunk_state_fwd_kernel[sweep_grid(N, HV, V, blocks)](
            s1.kg, s1.kbar, v, beta, s1.gc, s1.Minv, h, v_new, initial_state, cu_seqlens,
            layout.offsets, layout.order, T, layout.NT, *state_strides(K, V, state_v_first),
            USE_INITIAL_STATE=initial_state is not None,
            TRANSPOSED=transposed_sweeps(N, HV, K, V, dev, dt), **blocks,
            **head_dims(q, v, layout, cu_seqlens))
    return s1.gc, s1.Aqk, s1.Akk, s1.Minv, s1.kg, h, v_new, s1.kbar, s1.qt


def chunk_kda_bwd(q, k, v, g, beta, scale, initial_state, state_v_first, cu_seqlens,
                  layout: ChunkLayout, do, dht, saved=None, gate: KernelGate | None = None,
                  matrices=None):
    """Gradients of ``chunk_kda_fwd``: recomputes stages 1-2 (unless ``saved`` holds them; from
    the forward's ``matrices`` = ``(Aqk, Akk, Minv)`` when given), sweeps
    the state gradient backwards, then forms every per-token gradient chunk by chunk.
    Returns ``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``, in float32 but ``dv`` (v's dtype)
    and ``dg`` (g's dtype); dq, dk summed over GVA groups; ``dg`` of the raw gate with ``gate``;
    the last two None without the option. At the peak, held in float32 only what later passes
    still add to."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BT = layout.BT
    dev = q.device
    common = head_dims(q, v, layout, cu_seqlens)
    transposed = transposed_sweeps(N, HV, K, V, dev, q.dtype)
    side = None
    try:
        if saved is None:
            s1 = chunk_stage1(q, k, g, beta, scale, layout, gate, HV, matrices)
            # The carry and the gradient sweep below read only stage 1's tensors. With few
            # programs each leaves SMs idle for much of its time: the carry runs on a side stream
            # beside the gradient sweep (H200, (1, 32768, 32): 15.78 -> 15.07 ms a step with
            # FEW_PROGRAMS' settings; see transposed_sweeps).
            side = fork(dev) if transposed else None
            saved = chunk_kda_recompute(q, k, v, beta, initial_state, state_v_first, cu_seqlens,
                                        layout, s1, side)
            s1 = None
        gc, Aqk, Akk, Minv, kg, h, v_new, kbar, qt = saved
        saved = None
        blocks = state_launch_config('state_bwd', K, V, N * HV, dev, q.dtype, cu_seqlens is not None)
        dh = torch.empty_like(h)
        # Read only as a matrix-product operand (rounded to the input dtype there): kept in that dtype.
        dv_new = torch.empty(B, T, HV, V, dtype=q.dtype, device=dev)
        dh0 = torch.empty_like(initial_state) if initial_state is not None else None
        chunk_state_bwd_kernel[sweep_grid(N, HV, V, blocks)](
            qt, kbar, kg, beta, gc, Aqk, Minv, do, dh, dv_new, dht, dh0, cu_seqlens, layout.offsets,
            layout.order, T, layout.NT,
            *state_strides(K, V, state_v_first),
            USE_FINAL_STATE_GRADIENT=dht is not None, STORE_INITIAL_STATE_GRADIENT=dh0 is not None,
            TRANSPOSED=transposed, **blocks, **common)
    finally:
        # Also when the above raises: the carry still reads stage 1's tensors, which the current
        # stream must not free (and a graph capture must not stay forked) before it has waited.
        join(side)
    # Read by no later kernel: freed before the per-token gradients are allocated (the peak).
    del kbar, qt, kg

    dq = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dk = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dg = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dv = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)          # final: no later pass adds to it
    dbeta = torch.empty(B, T, HV, dtype=torch.float32, device=dev)
    # Scratch for the pair-matrix gradients, float32: the diagonal sub-blocks use them in float32.
    dAqk = torch.empty(Aqk.shape, dtype=torch.float32, device=dev)
    dAkk = torch.empty_like(Akk)
    chunk_intra_bwd_kernel[(layout.total, HV)](
        q, k, v, beta, gc, Akk, Minv, h, v_new, do, dh, dv_new,
        dq, dk, dv, dbeta, dg, dAqk, dAkk, layout.rows, scale, T, layout.NT,
        **launch_config('intra_bwd', K, V), **common)
    bounded = bounded_decay(gate)
    cfg = launch_config('pair_bwd_bounded' if bounded else 'pair_bwd', K, V)
    chunk_pair_bwd_kernel[(layout.total * (BT // BC), HV * cdiv(K, cfg['BK']))](
        q, k, gc, dAqk, dAkk, dq, dk, dg, layout.rows, T, layout.NT,
        H=H, HV=HV, K=K, BT=BT, BC=BC, DOT_DTYPE=common['DOT_DTYPE'], IS_VARLEN=common['IS_VARLEN'],
        BOUNDED_DECAY=bounded, **cfg)
    # Read by no later kernel: freed before the gate kernel allocates (a bf16 raw gate's dg is a
    # new tensor beside dc; with these alive, it raised the Kimi configuration's peak by 0.06 GiB
    # at (8, 4096, 16) on the H200, f056478).
    del dAqk, dAkk, gc, h, dh, v_new, dv_new
    cfg = launch_config('gate_bwd' if gate is None else 'gate_bwd_raw', K, V)
    NK = cdiv(K, cfg['BK'])
    # Per-chunk sums of the dt_bias gradient (tokens of a chunk summed in the kernel) and of the
    # A_log gradient (tokens and a key slice).
    da = dbias = None
    if gate is not None:
        dbias = torch.empty(layout.total, HV, K, dtype=torch.float32, device=dev)
        da = torch.empty(layout.total, HV, NK, dtype=torch.float32, device=dev)
    # dg in g's dtype straight from the kernel (a bf16 raw gate: no float32 -> bf16 pass after it,
    # 0.4 GB of traffic at (8, 4096, 16)); in place when g is float32.
    dc, dg = dg, (dg if g.dtype == torch.float32 else torch.empty_like(g))
    chunk_gate_bwd_kernel[(layout.total, HV * NK)](
        g, dc=dc, dg=dg, da=da, dbias=dbias, chunk_rows=layout.rows,
        T=T, NT=layout.NT, HV=HV, K=K, BT=BT, IS_VARLEN=common['IS_VARLEN'],
        **gate_launch_args(gate), **cfg)
    dA_log = ddt_bias = None
    if gate is not None and (gate.A_log is not None or gate.dt_bias is not None):
        if gate.A_log is not None:
            dA_log = torch.empty(HV, dtype=torch.float32, device=dev)
        if gate.dt_bias is not None:
            ddt_bias = torch.empty(HV * K, dtype=torch.float32, device=dev)
        cfg = launch_config('gate_params', K, V)
        gate_param_grad_kernel[(HV, cdiv(K, cfg['BK']))](da, dbias, dA_log, ddt_bias, layout.total, HV=HV,
                                                         K=K, NK=NK, **cfg)
    if HV != H:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias


class ChunkKDAFunction(torch.autograd.Function):
    """Differentiable in q, k, v, g, beta and the initial state (and, with the in-kernel gate,
    ``gate_kind`` not None, in the raw g, A_log and dt_bias); the final state's gradient flows
    back through every chunk. With ``qk_l2norm`` q and k are normalized here, and the normalized
    q and k are kept with their inverse norms in place of q and k (as many bytes; where the
    caller also keeps q and k alive, two more [B, T, H, K] tensors until the backward): the
    backward reads them as they are and forms the raw inputs' gradients from them
    (``l2norm_bwd``), where keeping the raw q and k cost it two more normalization passes
    (0.064 ms a tensor at (8, 4096, 16) on the H200). The gate is activated inside the first
    kernel, forward and recompute, so nothing of it is kept."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                state_v_first, cu_seqlens, layout, qk_l2norm, gate_kind, lower_bound,
                disable_recompute):
        rq = rk = None
        qn, kn = q, k
        if qk_l2norm:
            (qn, rq), (kn, rk) = l2norm_fwd(q, k)
        gate = None if gate_kind is None else KernelGate(gate_kind, A_log, dt_bias, lower_bound)
        o, final_state, s1, _ = chunk_kda_fwd(qn, kn, v, g, beta, scale, initial_state,
                                              output_final_state, state_v_first, cu_seqlens, layout,
                                              gate, unit_keys=qk_l2norm)
        # Kept either way: the in-chunk matrices, [B, T, HV, BT] each (at BT = 64, K = V = 128,
        # bf16 with g in float32: half the bytes of q, k, v and g), which spare the backward's
        # recompute the pair products and the solve (H200, (8, 4096, 16), at 3598f32: 0.60 and
        # 0.69 ms of its 1.9 ms).
        Aqk, Akk, Minv = s1.Aqk, s1.Akk, s1.Minv
        ctx.save_for_backward(qn, kn, rq, rk, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                              Aqk, Akk, Minv)
        # disable_recompute: the backward's stage-1 recompute and state carry run here instead (the
        # forward's own sweep keeps neither states nor corrections). Stage 1's per-token tensors are
        # formed again as the backward forms them: the forward's c comes from the cumsum kernel's
        # other build (DECAYED=False), whose scan runs in another thread layout and may round
        # differently, so only this keeps the gradients the same bits either way.
        ctx.saved_intermediates = None
        if disable_recompute:
            s1 = chunk_stage1(qn, kn, g, beta, scale, layout, gate, v.shape[2],
                              (Aqk, Akk, Minv), out=s1)
            ctx.saved_intermediates = chunk_kda_recompute(
                qn, kn, v, beta, initial_state, state_v_first, cu_seqlens, layout, s1)
        s1 = None
        ctx.scale, ctx.state_v_first, ctx.layout = scale, state_v_first, layout
        ctx.qk_l2norm, ctx.gate_kind, ctx.lower_bound = qk_l2norm, gate_kind, lower_bound
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        qn, kn, rq, rk, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *matrices = ctx.saved_tensors
        gate = None if ctx.gate_kind is None else KernelGate(ctx.gate_kind, A_log, dt_bias, ctx.lower_bound)
        # Handed over, not kept: chunk_kda_bwd frees what its later stages do not read.
        saved, ctx.saved_intermediates = ctx.saved_intermediates, None
        dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = chunk_kda_bwd(
            qn, kn, v, g, beta, ctx.scale, initial_state, ctx.state_v_first, cu_seqlens, ctx.layout,
            do.contiguous(), None if dht is None else dht.contiguous(), saved, gate, matrices)
        if ctx.qk_l2norm:
            dq, dk = l2norm_bwd(qn, rq, dq, kn, rk, dk)
        # dbeta is float32 like the beta chunk_kda hands this Function; autograd casts it back to
        # the caller's dtype through that copy.
        return (dq.to(qn.dtype), dk.to(kn.dtype), dv, dg, dbeta,
                dA_log, ddt_bias, None, dh0, None, None, None, None, None, None, None, None)


@on_q_device
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = 64,
    state_v_first: bool = False,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    intermediate_states_dtype: torch.dtype | None = None,
    transpose_state_layout: bool | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
):
    """KDA by the chunkwise-parallel WY/UT algorithm: training and prefill.

    Same contract as ``fused_recurrent_kda`` (API.md): q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``,
    g ``[B, T, HV, K]`` (log-decay, <= 0), beta ``[B, T, HV]``, float32 states ``[N, HV, K, V]``
    (``[N, HV, V, K]`` with ``state_v_first``). Differentiable in q, k, v, g, beta, the initial
    state (and A_log, dt_bias with the in-kernel gate), including gradients arriving through the
    final state. A log-decay above 0 (outside the contract) or NaN makes the outputs of its chunk
    and of everything after it NaN for that head; it is never clamped into a plausible answer.
    ``cu_seqlens_cpu``, when given, must hold ``cu_seqlens``' values: the chunk map is sized from it
    without reading a device ``cu_seqlens`` back (that would cost a sync), so there a mismatch is
    not detected; a ``cu_seqlens`` on the CPU is read and must agree.

    ``A_log`` may have any shape of HV elements (e.g. ``[1, 1, HV, 1]``) and ``dt_bias`` any of
    ``HV * K``. Without ``use_gate_in_kernel`` they and ``lower_bound`` are ignored with a warning
    (``lower_bound`` silently beside ``safe_gate=True``: the bound g is promised to keep). A q with
    fewer tokens than heads warns (a head-first ``[B, H, T, K]`` passed by mistake?).

    Returns ``(o, final_state)``, or ``(o, final_state, h)`` with ``return_intermediate_states``
    (inference only): ``h`` holds the state entering every chunk, ``[B, NT, HV, K, V]``
    (``[1, total chunks, HV, K, V]`` with ``cu_seqlens``), in q's dtype as FLA returns it, or in
    ``intermediate_states_dtype`` where given (``torch.float32``: the states as computed).

    FLA's other arguments: ``transpose_state_layout``, its deprecated name of ``state_v_first``
    (taken with a ``DeprecationWarning``); ``cp_context``, ``use_graph`` and ``max_num_seqs``
    (context parallelism, CUDA-graph varlen) are not supported yet and must keep their defaults.
    """
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    refuse_unsupported(cp_context, use_graph, max_num_seqs)
    validate_states_dtype(intermediate_states_dtype)
    problem, offsets = validate_inputs(q, k, v, g, beta, scale, initial_state, output_final_state,
                                       cu_seqlens, state_v_first, use_qk_l2norm_in_kernel, cu_seqlens_cpu)
    params = validate_activations(problem.HV, problem.K, q.device, use_gate_in_kernel, A_log, dt_bias,
                                  safe_gate, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    A_log, dt_bias, lower_bound = params.A_log, params.dt_bias, params.lower_bound
    validate_chunk_size(chunk_size)
    warn_if_head_first(problem)
    _expect_bool('disable_recompute', disable_recompute)
    _expect_bool('return_intermediate_states', return_intermediate_states)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    if return_intermediate_states and needs_grad:
        raise ValueError("return_intermediate_states=True is for inference only; call it under "
                         "torch.no_grad() or with inputs that do not require grad")

    # Not bf16 in Triton's interpreter: its tl.dot multiplies bf16 operands' raw bit patterns
    # (triton-lang/triton#11584), and the kernels' answer is finite garbage there (relative error
    # ~3e11 against the reference at (1, 64, 1, 1, 16, 16)); the PyTorch path serves those calls.
    if not use_kernels(q) or (INTERPRET and q.dtype == torch.bfloat16):
        if use_beta_sigmoid_in_kernel:
            beta = activate_beta(beta, allow_neg_eigval)
        if use_gate_in_kernel:
            g = activate_gate(g, A_log, dt_bias, lower_bound)
        return cast_intermediate_states(chunk_kda_reference(
            q, k, v, g, beta, problem.scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, state_v_first, chunk_size, return_intermediate_states), intermediate_states_dtype)
    # The kernels read beta in float32 (a [B, T, HV] copy, which training keeps for the backward:
    # 4 bytes a token-head, 1 / K of q's float32 size; test_saved_for_backward): the state
    # sweeps load it a row at a time in their chunk loop, and Triton (3.6) prefetches a load
    # (asynchronous copy) only from 4 bytes a thread, so a 16-bit beta stalled every chunk step on
    # its load. H200, bf16 forward with g pre-computed: -0.03 to -0.07 ms at (1, 32768, 32),
    # (1, 8192, 96), (4, 8192, 32) and the varlen batch, 0 at (8, 4096, 16) (one 128-wide sweep
    # program an SM there too: why it lost nothing is not known). The Kimi configuration's
    # activated beta was float32 already. One copy, contiguous, whatever beta's strides: in
    # training here, through autograd; in inference inside chunk_kda_fwd, off the head of its
    # chain (``prepare_beta``).
    inference = return_intermediate_states or not needs_grad
    if not inference:
        if use_beta_sigmoid_in_kernel:
            beta = activate_beta(beta, allow_neg_eigval)
        beta = beta.to(torch.float32, memory_format=torch.contiguous_format).contiguous()
    q, k, v, g, initial_state, cu_seqlens = contiguous(q, k, v, g, initial_state, cu_seqlens)
    layout = chunk_layout(problem.B, problem.T, chunk_size, offsets, cu_seqlens)
    # The gate's activation runs in the first kernel, forward and backward recompute: as PyTorch
    # ops it took five float32 passes over [B, T, HV, K] each way (H200, (8, 4096, 16), Kimi
    # configuration at 401e283: forward 3.31 ms against 2.90 ms with g pre-computed).
    gate = KernelGate.of(A_log, dt_bias, lower_bound) if use_gate_in_kernel else None
    if inference:
        # A float32, contiguous beta that is not logits is what the kernels read, as it is.
        ready = (not use_beta_sigmoid_in_kernel and beta.dtype == torch.float32
                 and beta.is_contiguous())
        # Inference: nothing is kept for a backward, so q and k are not normalized in a pass of
        # their own: the pair products normalize the rows they read, in float32 (outputs
        # differ from the training forward's in the last bits: it rounds the normalized rows
        # to the input dtype, and sums each row's squares in another order).
        o, final_state, _, h = chunk_kda_fwd(
            q, k, v, g, beta, problem.scale, initial_state, output_final_state, state_v_first,
            cu_seqlens, layout, gate, store_states=return_intermediate_states,
            l2norm=use_qk_l2norm_in_kernel,
            prepare_beta=None if ready else functools.partial(
                kernel_beta, sigmoid=use_beta_sigmoid_in_kernel, neg_eigval=allow_neg_eigval))
        if not return_intermediate_states:
            return o, final_state
        h = h.view(problem.B, layout.NT, *h.shape[1:]) if cu_seqlens is None else h.unsqueeze(0)
        return cast_intermediate_states((o, final_state, h.transpose(-1, -2) if state_v_first else h),
                                        intermediate_states_dtype)
    return ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, problem.scale, initial_state,
                                  output_final_state, state_v_first, cu_seqlens, layout,
                                  use_qk_l2norm_in_kernel, gate and gate.kind,
                                  gate and gate.lower_bound, disable_recompute)
