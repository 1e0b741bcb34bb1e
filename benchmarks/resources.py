"""Registers, spills and shared memory of the chunk kernels on sm_90a, without a GPU.

    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/resources.py [kernel names, default all]

Compiles each kernel with Triton for an H100/H200 target at the benchmark's shape (bf16,
K = V = 128, chunk 64, the launchers' block sizes) and runs the ptxas bundled with Triton
(`ptxas-blackwell`, which accepts the PTX version the newest Triton emits) with -v. Costs no device
time. Run it with the GPU's Triton version (3.6 on the lent H200) for the figures that matter:
3.6 and 3.9 allocate differently.
"""
import subprocess, sys, re, os, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kda.kernels.chunk_intra import chunk_cumsum_kernel, chunk_pair_fwd_kernel, chunk_solve_kernel
from kda.kernels.chunk_intra_bwd import chunk_gate_bwd_kernel, chunk_intra_bwd_kernel, chunk_pair_bwd_kernel
from kda.kernels.chunk_state import chunk_state_fwd_kernel
from kda.kernels.chunk_state_bwd import chunk_state_bwd_kernel
from kda.kernels.chunk_state_output import chunk_state_output_fwd_kernel

def sig_for(fn, ptr_types, constexprs, ints=(), floats=(), nones=()):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs or name in nones: sig[name] = 'constexpr'
        elif name in ints: sig[name] = 'i32'
        elif name in floats: sig[name] = 'fp32'
        else: sig[name] = ptr_types.get(name, '*fp32')
    cx = dict(constexprs); cx.update({n: None for n in nones})
    return sig, cx

def report(fn, sig, cx, num_warps=4, num_stages=3, label='', maxnreg=None):
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()})
    k = triton.compile(src, target=GPUTarget('cuda', 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages, **({'maxnreg': maxnreg} if maxnreg else {})))
    ptx = k.asm['ptx']
    ptxas = os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/ptxas-blackwell')
    with tempfile.NamedTemporaryFile('w', suffix='.ptx', delete=False) as f:
        f.write(ptx)
    r = subprocess.run([ptxas, '-v', '--gpu-name', 'sm_90a', f.name, '-o', '/dev/null'], capture_output=True, text=True)
    out = r.stderr + r.stdout
    lines = [l for l in out.splitlines() if 'registers' in l or 'spill' in l or 'stack' in l] or [out[-300:]]
    print(label, 'shared', k.metadata.shared, '|', ' | '.join(l.split('ptxas info    :')[-1].strip() for l in lines))

bf = '*bf16'
common = dict(H=16, HV=16, K=128, V=128, BT=64, DOT_DTYPE=tl.bfloat16, IS_VARLEN=False)
chunks = dict(ints=('T', 'NT'), nones=('cu_seqlens', 'chunk_indices'))
# name: (kernel, pointer dtypes, constexprs, other argument kinds, [(num_warps, num_stages, maxnreg)])
KERNELS = {
    'cumsum': (chunk_cumsum_kernel, dict(q=bf, k=bf, qt=bf, kbar=bf, kg=bf), dict(H=16, HV=16, K=128, BT=64, BK=64, GATE='none', IS_VARLEN=False),
               dict(floats=('scale', 'lower_bound'), ints=('T', 'NT'), nones=('cu_seqlens', 'chunk_indices', 'A_log', 'dt_bias')),
               [(4, 2, None)]),
    'cumsum_gate': (chunk_cumsum_kernel, dict(g=bf, q=bf, k=bf, qt=bf, kbar=bf, kg=bf), dict(H=16, HV=16, K=128, BT=64, BK=64, GATE='sigmoid', IS_VARLEN=False),
                    dict(floats=('scale', 'lower_bound'), **chunks), [(4, 2, None)]),
    'cumsum_gate_no_A_log': (chunk_cumsum_kernel, dict(g=bf, q=bf, k=bf, qt=bf, kbar=bf, kg=bf), dict(H=16, HV=16, K=128, BT=64, BK=64, GATE='softplus', IS_VARLEN=False),
                             dict(floats=('scale', 'lower_bound'), ints=('T', 'NT'), nones=('cu_seqlens', 'chunk_indices', 'A_log')), [(4, 2, None)]),
    'pair_fwd': (chunk_pair_fwd_kernel, dict(q=bf, k=bf, Aqk=bf), dict(BC=16, BK=32, FACTORED_DIAG=True, **{k: v for k, v in common.items() if k != 'V'}),
                 dict(floats=('scale',), **chunks), [(2, 2, None), (4, 2, None)]),
    'pair_fwd_fp16': (chunk_pair_fwd_kernel, dict(q='*fp16', k='*fp16'), dict(BC=16, BK=32, FACTORED_DIAG=False, **{k: v for k, v in common.items() if k not in ('V', 'DOT_DTYPE')}, DOT_DTYPE=tl.float16),
                      dict(floats=('scale',), **chunks), [(2, 2, None)]),
    'solve': (chunk_solve_kernel, dict(beta=bf), dict(HV=16, BT=64, BC=16, DOT_DTYPE=tl.bfloat16, IS_VARLEN=False), chunks,
              [(2, 2, None), (1, 2, None), (4, 2, None)]),
    'intra_bwd': (chunk_intra_bwd_kernel, dict(q=bf, k=bf, v=bf, beta=bf, h=bf, v_new=bf, do=bf, dh=bf, dv_new=bf, dv=bf),
                  dict(BK=32, BV=32, **common), dict(floats=('scale',), **chunks), [(4, 1, None), (8, 1, None)]),
    'pair_bwd': (chunk_pair_bwd_kernel, dict(q=bf, k=bf), dict(BC=16, BK=64, BOUNDED_DECAY=False, **{k: v for k, v in common.items() if k != 'V'}),
                 chunks, [(4, 2, 128), (4, 2, 168), (4, 2, None)]),
    'pair_bwd_bounded': (chunk_pair_bwd_kernel, dict(q=bf, k=bf), dict(BC=16, BK=64, BOUNDED_DECAY=True, **{k: v for k, v in common.items() if k != 'V'}),
                         chunks, [(4, 3, 128), (4, 2, 168), (4, 2, None)]),
    'gate_bwd': (chunk_gate_bwd_kernel, {}, dict(HV=16, K=128, BT=64, BK=32, GATE='none', IS_VARLEN=False),
                 dict(floats=('lower_bound',), ints=('T', 'NT'), nones=('cu_seqlens', 'chunk_indices', 'A_log', 'dt_bias', 'da', 'dbias')),
                 [(4, 2, None)]),
    'gate_bwd_gate': (chunk_gate_bwd_kernel, dict(g=bf, dg=bf), dict(HV=16, K=128, BT=64, BK=32, GATE='sigmoid', IS_VARLEN=False),
                      dict(floats=('lower_bound',), **chunks), [(4, 2, None)]),
    'state_fwd': (chunk_state_fwd_kernel, dict(kg=bf, kbar=bf, v=bf, beta=bf, Minv=bf, h=bf, v_new=bf),
                  dict(BK=128, BV=32, USE_INITIAL_STATE=False, **common),
                  dict(ints=('T', 'NT', 'stride_sk', 'stride_sv'), nones=('cu_seqlens', 'chunk_offsets', 'seq_order', 'h0')),
                  [(4, 2, None), (8, 2, None)]),
    'state_bwd': (chunk_state_bwd_kernel, dict(qt=bf, kbar=bf, kg=bf, beta=bf, Minv=bf, do=bf, dh=bf, Aqk=bf, dv_new=bf),
                  dict(BK=128, BV=64, USE_FINAL_STATE_GRADIENT=False, STORE_INITIAL_STATE_GRADIENT=False, **common),
                  dict(ints=('T', 'NT', 'stride_sk', 'stride_sv'), nones=('cu_seqlens', 'chunk_offsets', 'seq_order', 'dht', 'dh0')),
                  [(4, 2, None), (8, 2, None)]),
    'state_output': (chunk_state_output_fwd_kernel, dict(qt=bf, kg=bf, kbar=bf, v=bf, beta=bf, Aqk=bf, Minv=bf, o=bf),
                     dict(BK=128, BV=64, USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, STORE_STATES=False, **common),
                     dict(ints=('T', 'NT', 'stride_sk', 'stride_sv'), nones=('cu_seqlens', 'chunk_offsets', 'seq_order', 'h', 'h0', 'ht')),
                     [(4, 2, None), (8, 2, None), (4, 3, None)]),
}
for name in sys.argv[1:] or KERNELS:
    fn, ptrs, cx, kinds, launches = KERNELS[name]
    sig, cx = sig_for(fn, ptrs, cx, **kinds)
    for w, st, r in launches:
        report(fn, sig, cx, num_warps=w, num_stages=st, maxnreg=r, label=f'{name} w{w} s{st}' + (f' r{r}' if r else ''))
