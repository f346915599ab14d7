"""Every Triton kernel reads only module globals that compiled Triton accepts.

CI runs the kernels under TRITON_INTERPRET=1, which reads any Python global; compiled Triton (the GPU) refuses a
global that is a plain number or string and not a tl.constexpr ("Cannot access global variable ... from within
@jit'ed function"). A kernel that read one passed here and failed only on the GPU (thirty-third session: the
token logprobs kernels' NO_ID). This walks every @triton.jit function of the packages and fails on such reads.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import triton
import triton.language as tl

PACKAGES = ("lora_core", "replicas")


def _jit_functions():
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # a module for another platform's extras
                continue
            for name, value in vars(module).items():
                # JITFunction, or under the interpreter InterpretedFunction; an autotuner wraps either
                if not isinstance(value, triton.runtime.jit.KernelInterface):
                    continue
                fn = value
                while hasattr(fn, "fn"):
                    fn = fn.fn
                if fn.__module__ == module.__name__:
                    yield f"{info.name}.{name}", fn


def test_the_packages_have_triton_kernels():
    names = [name for name, _ in _jit_functions()]
    assert len(names) > 20 and "replicas.kernels.token_logprobs._partials_kernel" in names


@pytest.mark.parametrize("name,fn", list(_jit_functions()), ids=lambda v: v if isinstance(v, str) else "")
def test_a_kernel_reads_no_plain_number_or_string_global(name, fn):
    plain = sorted(ref for ref in fn.__code__.co_names
                   if isinstance(fn.__globals__.get(ref), (bool, int, float, str))
                   and not isinstance(fn.__globals__.get(ref), tl.constexpr))
    assert not plain, f"{name} reads {plain}: pass them as tl.constexpr arguments or define them as tl.constexpr"
