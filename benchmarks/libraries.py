"""The implementations timed side by side: ours (``kda``), FLA's ``fla.ops.kda`` and FlashKDA.

FLA 0.6.0 hands its inference ``chunk_kda`` to FlashKDA when ``flash_kda`` is installed and the
call fits FlashKDA's configuration, and may hand a backward sub-kernel to TileLang when
``tilelang`` is installed. ``FLA_FLASH_KDA=0`` and ``FLA_TILELANG=0`` are set before FLA is
imported, so that FLA's column times FLA's own Triton kernels; FlashKDA has a column of its own.

FLA comes from ``import fla.ops.kda``, or else from a ``fla_core-*.whl`` under ``.whl/`` at the
repository root, unpacked into a temporary folder.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .cases import HEAD_DIM

ROOT = Path(__file__).resolve().parent.parent
FLA_OWN_KERNELS = {'FLA_FLASH_KDA': '0', 'FLA_TILELANG': '0'}


@dataclass
class Library:
    """An implementation's entry points (None where missing) and a one-line description."""
    name: str
    description: str
    chunk: object = None
    recurrent: object = None
    extras: dict = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return self.chunk is not None or self.recurrent is not None


def load_ours() -> Library:
    """``kda`` as the interpreter finds it (the repository root when run from there)."""
    try:
        import kda
    except Exception as e:  # noqa: BLE001
        return Library('ours', f"kda unavailable: {type(e).__name__}: {e}")
    return Library('ours', f"kda ({Path(kda.__file__).parent})", kda.chunk_kda, kda.fused_recurrent_kda)


def _fla_from_wheel() -> None:
    wheels = sorted((ROOT / '.whl').glob('fla_core-*.whl'))
    if not wheels:
        raise ImportError("no fla_core-*.whl under .whl/")
    for name in [m for m in sys.modules if m == 'fla' or m.startswith('fla.')]:
        del sys.modules[name]
    dest = Path(tempfile.mkdtemp(prefix='fla_wheel_'))
    atexit.register(shutil.rmtree, dest, True)
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(dest)
    sys.path.insert(0, str(dest))


def load_fla() -> Library:
    """FLA's ``chunk_kda`` and ``fused_recurrent_kda`` (its own kernels); ``extras['serving_step']``
    is ``fused_recurrent_kda_fwd``, the in-place decode entry point."""
    os.environ.update(FLA_OWN_KERNELS)
    try:
        import fla.ops.kda
    except Exception as first:  # noqa: BLE001
        try:
            _fla_from_wheel()
            import fla.ops.kda
        except Exception as e:  # noqa: BLE001
            return Library('FLA', f"FLA unavailable ({type(first).__name__}: {first}; wheel: {e})")
    import fla
    import fla.ops.kda as fk
    extras = {}
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        extras['serving_step'] = fused_recurrent_kda_fwd
    except ImportError:
        pass
    return Library('FLA', f"FLA {getattr(fla, '__version__', '?')} ({Path(fla.__file__).parent})",
                   fk.chunk_kda, fk.fused_recurrent_kda, extras)


def flashkda_chunk(fwd):
    """A ``chunk_kda``-like forward on FlashKDA's ``flash_kda.fwd`` for the Kimi configuration
    (``cases.chunk_inputs(..., 'kimi')``): no initial or final state, so the state layouts
    ([N, H, V, K] there, [N, H, K, V] here) do not meet. Raises ValueError for what FlashKDA
    does not run."""
    import torch

    def chunk(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, use_gate_in_kernel=False,
              use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, safe_gate=False,
              cu_seqlens=None, cu_seqlens_cpu=None, scale=None):
        if not (use_gate_in_kernel and use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel and safe_gate):
            raise ValueError("FlashKDA runs the Kimi configuration only (gate, l2norm and beta "
                             "sigmoid in the kernel, safe_gate)")
        H, K = q.shape[2], q.shape[3]
        if K != HEAD_DIM or v.shape[3] != HEAD_DIM or v.shape[2] != H or q.dtype != torch.bfloat16:
            raise ValueError(f"FlashKDA needs bf16 and K = V = {HEAD_DIM} without GVA")
        out = torch.empty_like(v)
        fwd(q, k, v, g, beta, K ** -0.5 if scale is None else scale, out, A_log.float(),
            dt_bias.float().reshape(H, K), lower_bound, cu_seqlens=cu_seqlens)
        return out, None
    return chunk


def load_flashkda() -> Library:
    """FlashKDA's forward when ``flash_kda`` imports."""
    try:
        import flash_kda
    except Exception as e:  # noqa: BLE001
        return Library('FlashKDA', f"FlashKDA unavailable ({type(e).__name__}: {e})")
    return Library('FlashKDA', f"FlashKDA ({Path(flash_kda.__file__).parent})", flashkda_chunk(flash_kda.fwd))


def package_version(module: str) -> str | None:
    """``module.__version__``, else the installed distribution's version, else None."""
    try:
        mod = sys.modules.get(module) or __import__(module)
        version = getattr(mod, '__version__', None)
        if version:
            return str(version)
    except Exception:  # noqa: BLE001
        pass
    from importlib import metadata
    for dist in {'fla': ('fla-core', 'flash-linear-attention'), 'flash_kda': ('flash-kda', 'flash_kda')}.get(
            module, (module,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
