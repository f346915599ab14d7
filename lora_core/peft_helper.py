"""PEFTHelper: an adapter's adapter_config.json, parsed, checked and queried.

Matching follows PEFT itself (peft.tuners.tuners_utils.check_target_module_exists
and peft.utils.other.get_pattern_key), so a module gets the same rank, alpha and
scaling here as it had when the adapter was trained. Anything PEFT can express
that we cannot serve faithfully is refused by name rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_core.config import LoRAConfig
from lora_core.errors import (
    AdapterFileMissingError,
    CorruptAdapterError,
    InvalidAdapterError,
    MultipleAdapterProblems,
    RankTooLargeError,
    UnsupportedAdapterError,
)

CONFIG_NAME = "adapter_config.json"
_BIAS_VALUES = ("none", "all", "lora_only")


def raise_problems(path: object, problems: list[InvalidAdapterError]) -> None:
    """Raise the one problem found, or all of them together; do nothing if none.

    Operators fix adapters offline, so reporting every problem in one pass saves
    them a load-fix-reload loop per problem.
    """
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise MultipleAdapterProblems(path, problems)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _pattern_key(patterns: Iterable[str], module_name: str) -> str | None:
    """PEFT's rule: the first key k with re.match(rf"(.*\\.)?({k})$", name)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


@dataclass
class PEFTHelper:
    """The LoRA settings of one adapter, as written by PEFT's save_pretrained.

    target_modules is a list of module-name suffixes, a regex matched against
    the full module name, or "all-linear". config_path is the file every error
    names.
    """

    r: int
    lora_alpha: float
    target_modules: list[str] | str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    bias: str = "none"
    lora_bias: bool = False
    modules_to_save: list[str] | None = None
    use_dora: bool = False
    base_model_name_or_path: str | None = None
    # PEFT's: a list target_modules then reaches only these layers' modules, the layer index being the number
    # after layers_pattern (by default after any name: "layers.3." in "model.layers.3.mlp.up_proj")
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    config_path: str = CONFIG_NAME

    # ---------------------------------------------------------------- parsing

    @classmethod
    def from_local_dir(cls, lora_dir: str | Path) -> "PEFTHelper":
        path = Path(lora_dir) / CONFIG_NAME
        if not path.is_file():
            raise AdapterFileMissingError(path, None, f"no {CONFIG_NAME} in adapter directory {lora_dir}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptAdapterError(path, None, f"not valid JSON ({exc})") from exc
        except OSError as exc:
            raise AdapterFileMissingError(path, None, f"cannot be read ({exc})") from exc
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, d: Any, source_path: str | Path = CONFIG_NAME) -> "PEFTHelper":
        """Build from a parsed adapter_config.json; wrong types raise CorruptAdapterError.

        Types are checked here, values against engine limits in validate_legal,
        so a helper can be inspected before an engine's LoRAConfig is known.
        """
        path = str(source_path)
        if not isinstance(d, dict):
            raise CorruptAdapterError(path, None, f"expected a JSON object, got {type(d).__name__}")
        problems: list[InvalidAdapterError] = []

        def bad(name: str, expected: str) -> None:
            problems.append(CorruptAdapterError(path, name, f"expected {expected}, got {d.get(name)!r}"))

        peft_type = d.get("peft_type", "LORA")
        if peft_type not in ("LORA", None):
            problems.append(UnsupportedAdapterError(
                path, "peft_type", f"{peft_type!r} adapters are not supported; only LORA is served"))
        for name in ("r", "lora_alpha"):
            if name not in d:
                problems.append(CorruptAdapterError(path, name, "required field is missing"))
        if "r" in d and not _is_int(d["r"]):
            bad("r", "an integer")
        if "lora_alpha" in d and not _is_number(d["lora_alpha"]):
            bad("lora_alpha", "a number")

        targets = d.get("target_modules")
        if isinstance(targets, (list, tuple)) and all(isinstance(t, str) for t in targets):
            targets = list(targets)
        elif not isinstance(targets, str):
            bad("target_modules", 'a list of module names, a regex string or "all-linear"')
        for name in ("use_rslora", "lora_bias", "use_dora"):
            if d.get(name) is not None and not isinstance(d[name], bool):
                bad(name, "true or false")
        for name, check, what in (("rank_pattern", _is_int, "integers"), ("alpha_pattern", _is_number, "numbers")):
            pattern = {} if d.get(name) is None else d[name]
            if not isinstance(pattern, dict) or not all(isinstance(k, str) and check(v) for k, v in pattern.items()):
                bad(name, f"an object mapping module patterns to {what}")
        if d.get("bias", "none") not in _BIAS_VALUES:
            bad("bias", " or ".join(repr(v) for v in _BIAS_VALUES))
        mts = d.get("modules_to_save")
        if mts is not None and not (isinstance(mts, list) and all(isinstance(m, str) for m in mts)):
            bad("modules_to_save", "a list of module names or null")
        base = d.get("base_model_name_or_path")
        if base is not None and not isinstance(base, str):
            bad("base_model_name_or_path", "a string or null")
        layers = d.get("layers_to_transform")
        if layers is not None and not (_is_int(layers) or (isinstance(layers, list) and all(map(_is_int, layers)))):
            bad("layers_to_transform", "an integer, a list of integers or null")
        pattern = d.get("layers_pattern")
        if pattern is not None and not (isinstance(pattern, str) or (isinstance(pattern, list)
                                                                     and all(isinstance(p, str) for p in pattern))):
            bad("layers_pattern", "a string, a list of strings or null")
        raise_problems(path, problems)

        return cls(
            r=d["r"],
            lora_alpha=d["lora_alpha"],
            target_modules=targets,
            use_rslora=bool(d.get("use_rslora") or False),
            rank_pattern=dict(d.get("rank_pattern") or {}),
            alpha_pattern=dict(d.get("alpha_pattern") or {}),
            bias=d.get("bias", "none"),
            lora_bias=bool(d.get("lora_bias") or False),
            modules_to_save=list(mts) if mts else None,
            use_dora=bool(d.get("use_dora") or False),
            base_model_name_or_path=base,
            layers_to_transform=layers,
            layers_pattern=pattern or None,
            config_path=path,
        )

    # --------------------------------------------------------------- queries

    def rank_for(self, module_name: str) -> int:
        key = _pattern_key(self.rank_pattern, module_name)
        return self.r if key is None else self.rank_pattern[key]

    def alpha_for(self, module_name: str) -> float:
        key = _pattern_key(self.alpha_pattern, module_name)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scaling_for(self, module_name: str) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA (rank-stabilized scaling)."""
        r = self.rank_for(module_name)
        alpha = self.alpha_for(module_name)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module_name: str, linear_modules: Iterable[str] = ()) -> bool:
        """Whether PEFT would put a LoRA on ``module_name`` (a full module name).

        linear_modules names the model's linear layers (full names or suffixes);
        only "all-linear" needs it. PEFT's "all-linear" skips the output layer.
        """
        if self.target_modules == "all-linear":
            suffix = module_name.rsplit(".", 1)[-1]
            linear = set(linear_modules)
            return suffix != "lm_head" and (module_name in linear or suffix in linear)
        if isinstance(self.target_modules, str):  # a regex names the layers itself (PEFT ignores the filter)
            return re.fullmatch(self.target_modules, module_name) is not None
        found = any(module_name == k or module_name.endswith("." + k) for k in self.target_modules)
        return found and self.in_layers(module_name)

    def in_layers(self, module_name: str) -> bool:
        """Whether module_name lies in one of layers_to_transform's layers (True without that setting)."""
        if self.layers_to_transform is None:
            return True
        wanted = {self.layers_to_transform} if isinstance(self.layers_to_transform, int) else \
            set(self.layers_to_transform)
        # PEFT's rule: the last "<pattern>.<number>." in the name (patterns are regexes); none -> not targeted
        patterns = self.layers_pattern or [r"[^.]*"]
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf".*\.{pattern}\.(\d+)\.", module_name)
            if match is not None:
                return int(match.group(1)) in wanted
        return False

    @property
    def max_rank(self) -> int:
        """The largest rank any module of this adapter may have."""
        return max([self.r, *self.rank_pattern.values()])

    # ------------------------------------------------------------ validation

    def legal_problems(self, lora_config: LoRAConfig | None = None) -> list[InvalidAdapterError]:
        """Every reason this adapter cannot be served, without raising.

        lora_config None checks only what no engine could serve; engine limits
        (max_lora_rank, bias_enabled) need the config.
        """
        p = self.config_path
        problems: list[InvalidAdapterError] = []
        ranks = [("r", self.r)] + [(f"rank_pattern[{k!r}]", v) for k, v in self.rank_pattern.items()]
        for name, r in ranks:
            if r <= 0:
                problems.append(CorruptAdapterError(p, name, f"rank must be > 0, got {r}"))
            elif lora_config is not None and r > lora_config.max_lora_rank:
                problems.append(RankTooLargeError(
                    p, name, f"rank {r} exceeds max_lora_rank={lora_config.max_lora_rank} of this deployment"))
        alphas = [("lora_alpha", self.lora_alpha)]
        alphas += [(f"alpha_pattern[{k!r}]", v) for k, v in self.alpha_pattern.items()]
        for name, alpha in alphas:
            if not math.isfinite(alpha) or alpha <= 0:
                problems.append(CorruptAdapterError(p, name, f"must be a finite number > 0, got {alpha}"))
        if self.use_dora:
            problems.append(UnsupportedAdapterError(
                p, "use_dora", "DoRA (weight-decomposed LoRA) adapters are not supported: their magnitude "
                "vector rescales the whole base weight, which batched LoRA kernels cannot apply"))
        if self.modules_to_save:
            problems.append(UnsupportedAdapterError(
                p, "modules_to_save", f"adapter replaces whole modules {self.modules_to_save}; only LoRA "
                "deltas can be served alongside other adapters on a shared base model"))
        if self.bias != "none":
            problems.append(UnsupportedAdapterError(
                p, "bias", f"bias={self.bias!r} trains the base model's own biases, which every other "
                "adapter on this replica shares; only bias='none' is supported (see lora_bias)"))
        if self.lora_bias and lora_config is not None and not lora_config.bias_enabled:
            problems.append(UnsupportedAdapterError(
                p, "lora_bias", "adapter carries a LoRA bias but this deployment has bias_enabled=False"))
        return problems

    def validate_legal(self, lora_config: LoRAConfig | None = None) -> None:
        """Raise one typed error (MultipleAdapterProblems if several) or nothing."""
        raise_problems(self.config_path, self.legal_problems(lora_config))
