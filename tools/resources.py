"""Registers, spills and shared memory of the chunk kernels on sm_90a, without a GPU.

    TRITON_DEFAULT_FP_FUSION=1 python -m tools.resources [kernel names, default all]
    (or python tools/resources.py from the repository root)

Compiles each kernel with Triton for an H100/H200 target at the benchmark's shape (bf16,
K = V = 128, chunk 64, the launchers' block sizes; argument types from ``kda/ops/offline.py``, with
the 16-byte divisibility a launch gives aligned pointers and strides: without it the loads do not
vectorize, and ptxas reports several times the spills, e.g. 828 against 0 B a thread for the
per-chunk gradients, 552 against 4 B for the pair products at 2 warps) and runs the ptxas bundled
with Triton (`ptxas-blackwell`, which accepts the PTX version the newest Triton emits) with -v.
Run it with the Triton version the GPU runs (3.6) for the figures that matter: 3.6 and 3.9
allocate registers differently.
"""
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

from kda.kernels.chunk_intra import (
    chunk_cumsum_kernel,
    chunk_pair_fwd_kernel,
    chunk_solve_kernel,
)
from kda.kernels.chunk_intra_bwd import (
    chunk_gate_bwd_kernel,
    chunk_intra_bwd_kernel,
    chunk_pair_bwd_kernel,
    gate_param_grad_kernel,
)
from kda.kernels.chunk_prep import chunk_prep_fwd_kernel
from kda.kernels.chunk_state import chunk_state_fwd_kernel
from kda.kernels.chunk_state_bwd import chunk_state_bwd_kernel
from kda.kernels.chunk_state_output import chunk_state_output_fwd_kernel
from kda.ops.offline import OPTIONAL, compile_sm90


def report(name, fn, values, dtype, launches, **signature_options):
    ptxas = os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/ptxas-blackwell')
    for num_warps, num_stages, maxnreg in launches:
        options = dict(num_warps=num_warps, num_stages=num_stages, **({'maxnreg': maxnreg} if maxnreg else {}))
        k = compile_sm90(fn, values, dtype, options, **({'specialize': True} | signature_options))
        with tempfile.NamedTemporaryFile('w', suffix='.ptx', delete=False) as f:
            f.write(k.asm['ptx'])
        r = subprocess.run([ptxas, '-v', '--gpu-name', 'sm_90a', f.name, '-o', '/dev/null'],
                           capture_output=True, text=True, check=False)
        os.unlink(f.name)
        out = r.stderr + r.stdout
        lines = [l for l in out.splitlines() if 'registers' in l or 'spill' in l or 'stack' in l] or [out[-300:]]
        label = f'{name} w{num_warps} s{num_stages}' + (f' r{maxnreg}' if maxnreg else '')
        print(label, 'shared', k.metadata.shared, '|', ' | '.join(l.split('info    :')[-1].strip() for l in lines))


bf = '*bf16'
common = dict(H=16, HV=16, K=128, V=128, BT=64, BC=16, DOT_DTYPE=tl.bfloat16, IS_VARLEN=False,
              SLICES_INNERMOST=False, PDL=True)
# The raw gate (bf16) and its parameters present.
gated = dict(absent=OPTIONAL - {'A_log', 'dt_bias'}, pointers=dict(g=bf))
# name: (kernel, constexpr values beyond common, input dtype (default bf16) and launch_signature
# options, [(num_warps, num_stages, maxnreg)])
KERNELS = {
    # The forward's build (c only) and the backward's recompute (c and the decayed keys, queries).
    'cumsum': (chunk_cumsum_kernel, dict(BK=64, GATE='none', DECAYED=False), {}, [(4, 2, 96)]),
    'cumsum_decayed': (chunk_cumsum_kernel, dict(BK=64, GATE='none', DECAYED=True), {}, [(4, 2, 96)]),
    'cumsum_gate': (chunk_cumsum_kernel, dict(BK=64, GATE='sigmoid', DECAYED=True), gated, [(4, 2, 96)]),
    'cumsum_gate_fwd': (chunk_cumsum_kernel, dict(BK=64, GATE='sigmoid', DECAYED=False), gated,
                        [(2, 2, None), (4, 2, 96)]),
    'cumsum_gate_no_A_log': (chunk_cumsum_kernel, dict(BK=64, GATE='softplus', DECAYED=True),
                             dict(absent=OPTIONAL - {'dt_bias'}, pointers=dict(g=bf)), [(4, 2, None)]),
    # Training's builds, launched plainly (PDL only with L2NORM, kda/ops/chunk/launch.py).
    'pair_fwd': (chunk_pair_fwd_kernel, dict(BK=32, FACTORED_DIAG=True, ALL_NEAR=False, L2NORM=False, PDL=False), {},
                 [(1, 3, None), (2, 3, 128)]),
    # Inference with use_qk_l2norm_in_kernel: raw q, k rows, normalized in the kernel.
    'pair_fwd_norms': (chunk_pair_fwd_kernel, dict(BK=32, FACTORED_DIAG=True, ALL_NEAR=False, L2NORM=True), {},
                       [(1, 2, None)]),
    # The same with the lower-bound gate: no far key entries, no fallback compiled.
    'pair_fwd_norms_near': (chunk_pair_fwd_kernel, dict(BK=32, FACTORED_DIAG=True, ALL_NEAR=True, L2NORM=True), {},
                            [(1, 2, None)]),
    'pair_fwd_fp16': (chunk_pair_fwd_kernel, dict(BK=32, FACTORED_DIAG=False, ALL_NEAR=False, L2NORM=False, PDL=False,
                                                  DOT_DTYPE=tl.float16),
                      dict(dtype=torch.float16), [(1, 3, None)]),
    'solve': (chunk_solve_kernel, {}, {}, [(2, 2, None), (1, 2, None), (4, 2, None)]),
    # The in-chunk stage in one kernel (FUSED_PREP), the Kimi inference build: raw gate, l2norm
    # in the kernel, no far key entries.
    'prep_kimi': (chunk_prep_fwd_kernel, dict(BK=32, GATE='sigmoid', FACTORED_DIAG=True, ALL_NEAR=True,
                                              L2NORM=True), gated, [(1, 2, None), (1, 3, None), (2, 2, None)]),
    'prep': (chunk_prep_fwd_kernel, dict(BK=32, GATE='none', FACTORED_DIAG=True, ALL_NEAR=False, L2NORM=False),
             {}, [(1, 2, None)]),
    'intra_bwd': (chunk_intra_bwd_kernel, dict(BK=64, BV=64), {}, [(8, 1, None), (4, 1, None)]),
    'pair_bwd': (chunk_pair_bwd_kernel, dict(BK=64, BOUNDED_DECAY=False), {}, [(4, 2, 128), (4, 2, 168), (4, 2, None)]),
    'pair_bwd_bounded': (chunk_pair_bwd_kernel, dict(BK=64, BOUNDED_DECAY=True), {},
                         [(4, 3, 128), (4, 2, 168), (4, 2, None)]),
    'gate_bwd': (chunk_gate_bwd_kernel, dict(BK=64, GATE='none'), {}, [(4, 2, None)]),
    'gate_bwd_gate': (chunk_gate_bwd_kernel, dict(BK=32, GATE='sigmoid'),
                      dict(absent=OPTIONAL - {'A_log', 'dt_bias', 'da', 'dbias'}, pointers=dict(g=bf, dg=bf)),
                      [(2, 2, None)]),
    # The A_log and dt_bias gradients summed over chunks (both present).
    'gate_params': (gate_param_grad_kernel, dict(NK=4, BK=32, BN=256),
                    dict(absent=OPTIONAL - {'da', 'dbias'}), [(8, 2, None)]),
    'state_fwd': (chunk_state_fwd_kernel,
                  dict(BK=128, BV=64, USE_INITIAL_STATE=False, TRANSPOSED=False, SLICES_INNERMOST=True), {},
                  [(4, 2, None), (8, 2, None)]),
    'state_fwd_few': (chunk_state_fwd_kernel, dict(BK=128, BV=32, USE_INITIAL_STATE=False, TRANSPOSED=True), {},
                      [(4, 2, None)]),
    'state_bwd': (chunk_state_bwd_kernel,
                  dict(BK=128, BV=64, USE_FINAL_STATE_GRADIENT=False, STORE_INITIAL_STATE_GRADIENT=False,
                       TRANSPOSED=False, SLICES_INNERMOST=True), {}, [(4, 2, None), (8, 2, None)]),
    'state_bwd_few': (chunk_state_bwd_kernel,
                      dict(BK=128, BV=32, USE_FINAL_STATE_GRADIENT=False, STORE_INITIAL_STATE_GRADIENT=False,
                           TRANSPOSED=True), {}, [(4, 3, None)]),
    'state_output': (chunk_state_output_fwd_kernel,
                     dict(BK=128, BV=64, USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, STORE_STATES=False),
                     dict(absent=OPTIONAL | {'h'}), [(4, 1, None), (8, 1, None), (4, 2, None)]),
    # FEW_PROGRAMS (kda/ops/chunk/tuning.py): 32-wide slices, 2 stages; with the states a segment hands
    # over. Also capped at 192 registers (5 pair-product programs fit beside it), which times
    # slower end to end.
    'state_output_few': (chunk_state_output_fwd_kernel,
                         dict(BK=128, BV=32, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, STORE_STATES=False),
                         dict(absent=OPTIONAL - {'h0', 'ht'} | {'h'}), [(4, 2, None), (4, 2, 192)]),
    # WIDE_SLICES (kda/ops/chunk/tuning.py): one 128-wide slice a head.
    'state_output_wide': (chunk_state_output_fwd_kernel,
                          dict(BK=128, BV=128, USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, STORE_STATES=False),
                          dict(absent=OPTIONAL | {'h'}), [(8, 2, None), (8, 1, None)]),
    # The 128-wide build in float32, which WIDE_SLICES leaves out for its shared memory.
    'state_output_wide_fp32': (chunk_state_output_fwd_kernel,
                               dict(BK=128, BV=128, DOT_DTYPE=tl.float32, USE_INITIAL_STATE=False,
                                    STORE_FINAL_STATE=False, STORE_STATES=False),
                               dict(absent=OPTIONAL | {'h'}, dtype=torch.float32), [(8, 2, None)]),
}

def main(names):
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise SystemExit(f"unknown kernels {unknown}; expected some of {', '.join(KERNELS)}")
    for name in names or KERNELS:
        fn, values, options, launches = KERNELS[name]
        options = dict(options)
        report(name, fn, common | values, options.pop('dtype', torch.bfloat16), launches, **options)


if __name__ == '__main__':
    main(sys.argv[1:])
