"""Typed errors raised by lora_core.

Lower layers raise these; only the HTTP/gRPC ingress (cluster/) maps them to
status codes. Every adapter error names the file and the field at fault so an
operator can fix the adapter without reading our source.
"""

from __future__ import annotations


class LoRAError(Exception):
    """Base class of every error lora_core raises on purpose."""


class LoRAConfigError(LoRAError, ValueError):
    """A LoRAConfig (engine-side limits) is not usable."""


class InvalidAdapterError(LoRAError, ValueError):
    """An adapter on disk cannot be served.

    ``path`` is the file (or directory) at fault and ``field`` the key, tensor
    or setting inside it; both are part of the message.
    """

    def __init__(self, path: object, field: str | None, reason: str) -> None:
        self.path = str(path)
        self.field = field
        self.reason = reason
        where = self.path if field is None else f"{self.path}: {field}"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self):
        # Rebuilt from the constructor's arguments, so the typed error survives pickling (e.g. across Ray).
        return (type(self), (self.path, self.field, self.reason))

    def relocated(self, local: str, shown: str) -> "InvalidAdapterError":
        """The same error naming ``shown`` where it named the directory ``local``: a server checks its own copy
        of an adapter, and its caller should read the lora_path it sent, not a server-side temporary path."""
        def swap(value: object) -> object:
            if isinstance(value, InvalidAdapterError):
                return value.relocated(local, shown)
            if isinstance(value, list):
                return [swap(v) for v in value]
            return value.replace(local, shown) if isinstance(value, str) else value

        cls, args = self.__reduce__()
        return cls(*(swap(a) for a in args))


class AdapterFileMissingError(InvalidAdapterError):
    """adapter_config.json or the weights file is absent."""


class UnsafeAdapterFormatError(InvalidAdapterError):
    """Weights are only in a pickle-based format (e.g. adapter_model.bin)."""


class CorruptAdapterError(InvalidAdapterError):
    """A file exists but cannot be parsed (bad JSON, truncated safetensors)."""


class AdapterShapeError(InvalidAdapterError):
    """A tensor's shape does not fit its module or its declared rank."""


class UnknownTargetModuleError(InvalidAdapterError):
    """The adapter targets a module the served model does not have."""


class RankTooLargeError(InvalidAdapterError):
    """The adapter's rank exceeds LoRAConfig.max_lora_rank."""


class UnsupportedAdapterError(InvalidAdapterError):
    """The adapter uses a PEFT feature we refuse by name (DoRA, modules_to_save...)."""


class NonFiniteWeightError(InvalidAdapterError):
    """A weight holds NaN or Inf."""


SHOWN_PROBLEMS = 8


class MultipleAdapterProblems(InvalidAdapterError):
    """Several problems at once; ``problems`` lists each as its own error."""

    def __init__(self, path: object, problems: list[InvalidAdapterError]) -> None:
        self.problems = problems
        # An adapter of another model fails every layer alike: the first few tell the story, all stay in problems
        lines = "; ".join(str(p) for p in problems[:SHOWN_PROBLEMS])
        more = f"; and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        super().__init__(path, None, f"{len(problems)} problems: {lines}{more}")

    def __reduce__(self):
        return (type(self), (self.path, self.problems))


class UnknownLoRAError(LoRAError, KeyError):
    """An adapter id or name that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want prose
        return str(self.args[0]) if self.args else "unknown LoRA adapter"


class LoRACapacityError(LoRAError, RuntimeError):
    """No GPU slot can be freed: every slot is pinned or used by the running batch."""
