"""Optional native kernels, compiled on first use with the C++ compiler torch was built for.

Everything here has a portable PyTorch fallback; a machine without a compiler only runs slower.
The build is cached (torch's extension cache), so only the first engine start pays for it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent


def cpu_tag() -> str:
    """Builds use -march=native: key the cache by the CPU's features, so a cached build is
    never loaded on a machine it would crash on."""
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _put_ninja_on_path() -> None:
    """torch builds extensions with ninja from PATH; the `ninja` wheel's binary sits in the venv,
    which is not on PATH when the venv's python is run directly."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


STALE_LOCK_S = 600.0  # a build takes about a minute; a lock this old belongs to a process that was killed


def _drop_stale_build_lock(name: str) -> None:
    """torch's extension build holds a lock file while it compiles and waits forever for it; a
    process killed mid-build leaves it behind, and every later engine start would hang on it."""
    from torch.utils import cpp_extension

    try:
        lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
        age = time.time() - lock.stat().st_mtime
    except (OSError, AttributeError):  # no lock (the normal case), or a torch without the helper
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a build lock left %.0f s ago by a process that did not finish: %s", age, lock)
        lock.unlink(missing_ok=True)


def _sources_digest() -> str:
    """torch rebuilds an extension when a source file changes but not when a header does: the
    headers' digest goes into the compiler flags, so editing one rebuilds too."""
    digest = hashlib.sha1()
    for header in sorted(_HERE.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:12]


def build_digest() -> str:
    """A digest of every kernel source: what a measurement of the kernels (the precision probes)
    is keyed by, so a changed kernel is measured again instead of read from a cache."""
    digest = hashlib.sha1()
    for source in sorted([*_HERE.glob("*.cpp"), *_HERE.glob("*.h")]):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


def _load(stem: str, what: str):
    """Compile (or load the cached build of) the extension bound in kernels/<stem>.cpp with every
    other .cpp beside it; None, with a logged reason, if it cannot be built."""
    _put_ninja_on_path()
    name = f"sloserve_{stem}_{cpu_tag()}"
    try:
        from torch.utils import cpp_extension

        _drop_stale_build_lock(name)
        return cpp_extension.load(
            name=name,
            sources=[str(_HERE / f"{stem}.cpp")] + sorted(str(p) for p in _HERE.glob("*.cpp") if p.stem != stem),
            # -fno-trapping-math: without it GCC keeps a clamp (two compares) as branches and leaves
            # every loop holding one scalar: SiLU-and-mul, through fast_exp's clamp, ran ~4 ns an
            # element. Nothing here reads floating-point exception flags.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math",
                          f"-DSLOSERVE_HEADERS={_sources_digest()}"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, unsupported platform...
        logger.warning("native %s unavailable (%s); using the portable PyTorch path", what,
                       str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


def load_paged_decode_attention() -> Optional[Callable]:
    """The compiled CPU decode-attention kernel, or None if it cannot be built (gather + SDPA then)."""
    module = _load("cpu_kernels", "decode attention")
    return None if module is None else module.paged_decode_attention


def attention_kernels() -> list[str]:
    """The bf16 attention paths of the native build on this machine, fastest first: "amx" (AMX
    tiles, where the CPU has them and the OS grants the tile state), "avx512_bf16" (bf16 dot
    products, e.g. AMD Zen4), "portable" (float32 vector loops); [] without a build. "auto" in the
    kernels' `kernel` argument picks the first that serves the tensors."""
    module = _load("cpu_kernels", "decode attention")
    return [] if module is None else list(module.attention_kernels())


def load_fused_ops():
    """The compiled CPU elementwise kernels (rms_norm, add_rms_norm, silu_and_mul, rope_), or None
    (the portable ATen ops then)."""
    return _load("cpu_kernels", "fused elementwise ops")


__all__ = ["attention_kernels", "build_digest", "cpu_tag", "load_fused_ops", "load_paged_decode_attention"]
