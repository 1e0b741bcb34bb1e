"""Registers, spills and shared memory of the chunk kernels on sm_90a, without a GPU.

    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/resources.py [fwd] [bwd] [state] [stateb] [out]

Compiles each kernel with Triton for an H100/H200 target at the benchmark's shape (bf16,
K = V = 128, chunk 64, the launchers' block sizes) and runs the ptxas bundled with Triton
(`ptxas-blackwell`, which accepts the PTX version the newest Triton emits) with -v. Costs no device
time. Run it with the GPU's Triton version (3.6 on the lent H200) for the figures that matter:
3.6 and 3.9 allocate differently.
"""
import inspect, subprocess, sys, re, os, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kda.kernels.chunk_intra import chunk_intra_fwd_kernel
from kda.kernels.chunk_intra_bwd import chunk_intra_bwd_kernel
from kda.kernels.chunk_state import chunk_state_fwd_kernel
from kda.kernels.chunk_state_bwd import chunk_state_bwd_kernel
from kda.kernels.chunk_output import chunk_output_fwd_kernel

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

common = dict(H=16, HV=16, K=128, V=128, BT=64, DOT_DTYPE=tl.bfloat16, IS_VARLEN=False)
bf = '*bf16'
which = sys.argv[1:] or ['fwd', 'bwd', 'state', 'stateb', 'out']
if 'fwd' in which:
    sig, cx = sig_for(chunk_intra_fwd_kernel, dict(q=bf, k=bf, v=bf, w=bf, u=bf, beta=bf), dict(BC=16, BK=64, BV=64, **common),
                      ints=('T', 'NT'), floats=('scale',), nones=('cu_seqlens', 'chunk_indices'))
    for w in (4, 8):
        for st in (1, 2, 3):
            report(chunk_intra_fwd_kernel, sig, cx, num_warps=w, num_stages=st, label=f'intra_fwd w{w} s{st}')
if 'bwd' in which:
    sig, cx = sig_for(chunk_intra_bwd_kernel, dict(q=bf, k=bf, v=bf, beta=bf, h=bf, v_new=bf, do=bf, dh=bf), dict(BC=16, BK=32, BV=32, **common),
                      ints=('T', 'NT'), floats=('scale',), nones=('cu_seqlens', 'chunk_indices'))
    for w in (4, 8):
        for st in (1, 3):
            report(chunk_intra_bwd_kernel, sig, cx, num_warps=w, num_stages=st, label=f'intra_bwd w{w} s{st}')
if 'state' in which:
    sig, cx = sig_for(chunk_state_fwd_kernel, dict(k=bf, w=bf, u=bf, h=bf, v_new=bf), dict(BK=128, BV=32, USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, **common),
                      ints=('T', 'NT', 'stride_sk', 'stride_sv'), nones=('cu_seqlens', 'chunk_offsets', 'h0', 'ht'))
    for w in (4, 8):
        report(chunk_state_fwd_kernel, sig, cx, num_warps=w, num_stages=2, label=f'state_fwd w{w}')
if 'stateb' in which:
    sig, cx = sig_for(chunk_state_bwd_kernel, dict(q=bf, k=bf, w=bf, do=bf, dh=bf), dict(BK=128, BV=32, USE_FINAL_STATE_GRADIENT=False, STORE_INITIAL_STATE_GRADIENT=False, **common),
                      ints=('T', 'NT', 'stride_sk', 'stride_sv'), floats=('scale',), nones=('cu_seqlens', 'chunk_offsets', 'dht', 'dh0'))
    report(chunk_state_bwd_kernel, sig, cx, num_stages=2, label='state_bwd')
if 'out' in which:
    sig, cx = sig_for(chunk_output_fwd_kernel, dict(q=bf, h=bf, v_new=bf, o=bf), dict(BK=64, BV=64, **common),
                      ints=('T', 'NT'), floats=('scale',), nones=('cu_seqlens', 'chunk_indices'))
    report(chunk_output_fwd_kernel, sig, cx, label='output')
