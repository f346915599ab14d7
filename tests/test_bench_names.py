"""A bench script's file name must not be the name of a module installed beside it.

`python bench/x.py` puts bench/ first on sys.path (the scripts then put the repository root before it), so a
bench module named like an installed top-level module hides that module from everything the script imports:
bench/kernels.py hid Hugging Face's `kernels` package, and transformers (imported by peft in bench/engine.py)
failed on `from kernels import ...` wherever that package was installed."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
OUR_PACKAGES = {"lora_core", "replicas", "cluster", "tests", "bench"}  # found at the root, before bench/


def _outside_bench(name: str) -> str | None:
    """Where `import name` resolves with bench/ off sys.path (None: nowhere)."""
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    try:
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
    finally:
        sys.path[:] = saved
    return None if spec is None else str(spec.origin)


def test_no_bench_script_hides_an_installed_module():
    stems = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")
    assert stems, "no bench scripts found"
    hidden = {s: origin for s in stems if s not in OUR_PACKAGES and (origin := _outside_bench(s)) is not None}
    assert not hidden, f"bench scripts named like installed modules (rename them): {hidden}"


def test_the_check_sees_an_installed_module():
    assert _outside_bench("json") is not None  # what a clash looks like to the test above
    assert _outside_bench("no_such_module_lorafleet") is None
