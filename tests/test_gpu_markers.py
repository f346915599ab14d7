"""Every test that needs CUDA carries the gpu marker (tests/conftest.py skips those on CPU), so `-m gpu` selects
every GPU path: none may skip itself, or return early, for want of CUDA without it. Read statically from the
test files: a skip condition is evaluated on a CPU machine and on an 8-GPU one, and one that holds on the CPU
only is a want of CUDA (one that cannot be evaluated counts as such where it mentions CUDA). A skip for more
GPUs inside a gpu-marked test is fine."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


class _Cuda:
    def __init__(self, gpus: int) -> None:
        self.gpus = gpus

    def is_available(self) -> bool:
        return self.gpus > 0

    def device_count(self) -> int:
        return self.gpus


class _Torch:
    def __init__(self, gpus: int) -> None:
        self.cuda = _Cuda(gpus)


def _is_gpu_mark(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "gpu"


def _marks(node: ast.AST) -> list[ast.AST]:
    """The marks a decorator or a marks= value stands for."""
    return list(node.elts) if isinstance(node, (ast.List, ast.Tuple)) else [node]


class _Module:
    def __init__(self, source: str) -> None:
        self.tree = ast.parse(source)
        self.source = source
        # module-level names set from CUDA (ON_GPU = torch.cuda.is_available(), DEVICE = ...)
        self.assigns = [n for n in self.tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                        and isinstance(n.targets[0], ast.Name)]
        self.cuda_names = {n.targets[0].id for n in self.assigns if "cuda" in ast.unparse(n.value)}
        self.gpu_module = any(_is_gpu_mark(m) for n in self.assigns if n.targets[0].id == "pytestmark"
                              for m in _marks(n.value))

    def _evaluate(self, condition: ast.AST, gpus: int):
        names = {"torch": _Torch(gpus)}
        for node in self.assigns:
            try:
                names[node.targets[0].id] = eval(compile(ast.Expression(node.value), "<test>", "eval"), names)
            except Exception:  # noqa: BLE001 - what cannot be evaluated stays unknown
                pass
        return eval(compile(ast.Expression(condition), "<test>", "eval"), names)

    def wants_cuda(self, condition: ast.AST) -> bool:
        """Whether a skip on this condition is a skip for want of CUDA."""
        try:
            return bool(self._evaluate(condition, 0)) and not self._evaluate(condition, 8)
        except Exception:  # noqa: BLE001
            text = ast.unparse(condition)
            return "cuda" in text or any(isinstance(n, ast.Name) and n.id in self.cuda_names
                                         for n in ast.walk(condition))


def _call_name(node: ast.AST) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


def _skipif_conditions(mark: ast.AST) -> list[ast.AST]:
    if _call_name(mark).endswith("mark.skipif") and mark.args:
        return [mark.args[0]]
    return []


def _skips(body: list[ast.stmt], top_level: bool) -> bool:
    """Whether these statements skip the test: a pytest.skip call, or (top_level) a return."""
    if top_level and any(isinstance(s, ast.Return) for s in body):
        return True
    return any(_call_name(n).endswith("pytest.skip") for s in body for n in ast.walk(s))


def _guarded_skips(module: _Module, body: list[ast.stmt], nested: bool = True, returns: bool = True) -> list[int]:
    """Lines of `if` statements in a body (nested: at any depth) that skip for want of CUDA (returns: a return
    at the body's top level skips too)."""
    lines = []
    for node in body:
        for if_node in (n for n in (ast.walk(node) if nested else [node]) if isinstance(n, ast.If)):
            top = returns and node is if_node
            if ((_skips(if_node.body, top) and module.wants_cuda(if_node.test))
                    or (_skips(if_node.orelse, top) and module.wants_cuda(ast.UnaryOp(ast.Not(), if_node.test)))):
                lines.append(if_node.lineno)
    return lines


def unmarked_cuda_skips(source: str, name: str = "<test>") -> list[str]:
    """'file:line function' for each skip for want of CUDA outside a gpu-marked test."""
    module = _Module(source)
    found = [f"{name}:{line} (module)" for line in _guarded_skips(module, module.tree.body, nested=False)
             if not module.gpu_module]
    for fn in (n for n in ast.walk(module.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if any("fixture" in ast.unparse(d) for d in fn.decorator_list):  # no marker to carry: the tests must
            if not module.gpu_module:
                found += [f"{name}:{line} {fn.name}" for line in _guarded_skips(module, fn.body, returns=False)]
            continue
        if not fn.name.startswith("test"):
            continue
        marks = [m for d in fn.decorator_list for m in _marks(d)]
        gpu = module.gpu_module or any(_is_gpu_mark(m) for m in marks)
        lines = [] if gpu else [fn.lineno for m in marks for c in _skipif_conditions(m) if module.wants_cuda(c)]
        # pytest.param(..., marks=...) of a parametrize: its own marks count too
        for param in (n for d in fn.decorator_list for n in ast.walk(d) if _call_name(n).endswith("pytest.param")):
            param_marks = [m for k in param.keywords if k.arg == "marks" for m in _marks(k.value)]
            if not (gpu or any(_is_gpu_mark(m) for m in param_marks)):
                lines += [param.lineno for m in param_marks for c in _skipif_conditions(m) if module.wants_cuda(c)]
        if not gpu:
            lines += _guarded_skips(module, fn.body)
        found += [f"{name}:{line} {fn.name}" for line in lines]
    return found


def test_every_test_skipped_for_want_of_cuda_is_marked_gpu():
    found = [hit for path in sorted(TESTS.rglob("*.py"))
             for hit in unmarked_cuda_skips(path.read_text(), str(path.relative_to(TESTS)))]
    assert not found, "skip without CUDA but carry no @pytest.mark.gpu (tests/conftest.py skips those):\n" + \
        "\n".join(found)


def test_the_check_finds_each_form_of_skip():
    head = "import pytest\nimport torch\nON_GPU = torch.cuda.is_available()\n"
    unmarked = [
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\ndef test_a(): pass",
        "@pytest.mark.skipif(not ON_GPU, reason='x')\ndef test_a(): pass",
        "@pytest.mark.parametrize('n', [pytest.param(1, marks=pytest.mark.skipif(torch.cuda.device_count() < 1, "
        "reason='x'))])\ndef test_a(n): pass",
        "def test_a():\n    if not torch.cuda.is_available():\n        pytest.skip('no GPU')",
        "def test_a():\n    x = 1\n    if not ON_GPU:\n        return\n    x.cuda()",
        "def test_a():\n    if ON_GPU:\n        pass\n    else:\n        pytest.skip('no GPU')",
        "if not torch.cuda.is_available():\n    pytest.skip('no GPU', allow_module_level=True)",
        "@pytest.fixture\ndef gpu():\n    if not ON_GPU:\n        pytest.skip('no GPU')",
    ]
    for case in unmarked:
        assert unmarked_cuda_skips(head + case), case
        assert not unmarked_cuda_skips(head + "pytestmark = pytest.mark.gpu\n" + case), case
    fine = [
        "@pytest.mark.gpu\n@pytest.mark.skipif(not ON_GPU, reason='x')\ndef test_a(): pass",
        "@pytest.mark.gpu\n@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='2 GPUs')\ndef test_a(): pass",
        "@pytest.mark.parametrize('n', [pytest.param(1, marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, "
        "reason='x')])])\ndef test_a(n): pass",
        "@pytest.mark.skipif(torch.cuda.is_available(), reason='the CPU path')\ndef test_a(): pass",
        "def test_a():\n    if ON_GPU:\n        return",
        "def pytest_runtest_setup(item):\n    if not ON_GPU:\n        return",
        "def test_a():\n    def f(x):\n        if not ON_GPU:\n            return x\n    f(1)",
    ]
    for case in fine:
        assert not unmarked_cuda_skips(head + case), case
