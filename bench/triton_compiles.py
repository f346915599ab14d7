"""Which Triton kernel variants compile while a benchmark scenario runs (after the engine's warm-up).

Why: a variant that warm-up did not compile costs its compile time in the middle of serving. On a fresh
machine the first scenario of bench/engine.py ran its prompt steps 0.5-1 s slower than the same engine's
later rows (RESULTS.md, tenth and eleventh sessions), and the machines kept Triton's disk cache between
calls, which hides it. CompileLog names each variant built in its scope (Triton's in-memory cache missed:
a fresh process compiles it, or loads it from the disk cache when an earlier run compiled it).

    with CompileLog() as log:
        ...                     # serve
    log.variants                # ["_paged_attention_kernel BLOCK_Q=64 ...", ...]
"""

from __future__ import annotations


def _knobs():
    try:
        from triton import knobs  # Triton >= 3.4
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if hasattr(runtime, "jit_post_compile_hook") else None


def describe(name: str, constants: dict, arg_names: list[str] | None = None) -> str:
    """A variant as name plus its scalar constexprs and specialized ints (Triton keys them by argument
    position: (i,) -> arg_names[i] where known)."""
    def label(key) -> str:
        if isinstance(key, tuple) and len(key) == 1 and arg_names and key[0] < len(arg_names):
            return arg_names[key[0]]
        return str(key)
    scalars = [f"{label(key)}={value}" for key, value in constants.items() if isinstance(value, (int, float, bool))]
    return " ".join([name] + scalars)


class CompileLog:
    """Records Triton variants compiled while inside `with`; the previous hook keeps being called."""

    def __init__(self) -> None:
        self.variants: list[str] = []
        self._previous = None
        self._runtime = _knobs()

    def hook(self, *, fn, compile, **kwargs):
        arg_names = getattr(getattr(fn, "jit_function", None), "arg_names", None)
        self.variants.append(describe(getattr(fn, "name", str(fn)), compile.get("constants") or {}, arg_names))
        if self._previous is not None:
            return self._previous(fn=fn, compile=compile, **kwargs)
        return None

    def __enter__(self) -> "CompileLog":
        if self._runtime is not None:
            self._previous = self._runtime.jit_post_compile_hook
            self._runtime.jit_post_compile_hook = self.hook
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous
