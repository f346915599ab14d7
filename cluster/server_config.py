"""ServerConfig: the `server` section of the app's arguments, checked when a deployment starts.

Shared by the ingress (API bounds, quotas, parsers, the model an adapter must fit) and the replicas (the model,
its engine, the adapters to register, dynamic loading); an unknown parser name or a bad bound fails the start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.adapter_names import adapter_name_problem
from cluster.quotas import QuotaConfig
from cluster.reasoning import reasoning_parser
from cluster.request_limits import MAX_PROMPT_CHARS, MAX_REQUEST_BODY_BYTES
from cluster.tool_parsers import tool_parser
from replicas.engine import EngineArgs


@dataclass
class ServerConfig:
    model: str = "demo"  # an HF-format directory, or "demo" for the embedded demo model and adapters
    served_model_name: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # EngineArgs fields
    default_max_tokens: int = 256
    preload_adapters: dict[str, str] = field(default_factory=dict)  # name -> uri, registered at start
    # The model family's tool-call syntax, for chat's tool_choice "auto": "hermes", "llama3_json", "mistral" or
    # "pythonic" (cluster/tool_parsers.py); None refuses "auto".
    tool_call_parser: str | None = None
    # The model family's thinking syntax, returned apart as reasoning_content: "deepseek_r1" or "qwen3"
    # (cluster/reasoning.py); None: the whole output is content.
    reasoning_parser: str | None = None
    # Ray Serve LLM's and vLLM's lazy adapters: a request naming an adapter nobody registered loads the one
    # at "<this>/<name>" (s3://, hf:// or a local root), registered cluster-wide as it is fetched. None: a
    # name must be registered first (preload_adapters, /v1/load_lora_adapter).
    dynamic_lora_loading_path: str | None = None
    # A streaming request's outputs cross the Serve handle at most once per this many ms (the first and the
    # last at once; cluster/output_stream.coalesced); 0: every engine step's. Ray Serve LLM batches likewise.
    stream_interval_ms: float = 50.0
    # The ingress's bounds on one HTTP request (cluster/request_limits.py has the defaults' reasons): a body over
    # max_request_body_bytes is a 413 before it is read or parsed, prompt text over max_prompt_chars characters a
    # 400 before it is tokenized.
    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES
    max_prompt_chars: int = MAX_PROMPT_CHARS
    # With api_keys on, /metrics still answers without a key (as vLLM's), so scrapers need none; false: it needs
    # one too (its labels name every adapter and the paths requested).
    metrics_public: bool = True
    # Per-tenant token rates (cluster/quotas.py): {by: api_key | adapter, default: {tokens_per_s, burst},
    # tenants: {<key or adapter>: {...}}}; a tenant over its rate gets 429 with Retry-After. Empty: no quotas.
    quotas: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # an unknown name fails the deployment's start
        self.tool_parser = tool_parser(self.tool_call_parser)
        self.reasoning = reasoning_parser(self.reasoning_parser)
        if not isinstance(self.stream_interval_ms, (int, float)) or not 0 <= self.stream_interval_ms <= 10_000:
            raise ValueError(f"stream_interval_ms must be a number of milliseconds in [0, 10000], got "
                             f"{self.stream_interval_ms!r}")
        for name in ("max_request_body_bytes", "max_prompt_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.metrics_public, bool):
            raise ValueError(f"metrics_public must be true or false, got {self.metrics_public!r}")
        self.quota_config = QuotaConfig.from_dict(self.quotas)  # a bad one fails the start
        if self.dynamic_lora_loading_path is not None:
            if not isinstance(self.dynamic_lora_loading_path, str) or not self.dynamic_lora_loading_path.strip("/"):
                raise ValueError(f"dynamic_lora_loading_path must be a non-empty uri prefix, got "
                                 f"{self.dynamic_lora_loading_path!r}")
            self.dynamic_lora_loading_path = self.dynamic_lora_loading_path.rstrip("/")
        bad = [p for p in map(adapter_name_problem, self.preload_adapters) if p]
        if bad:
            raise ValueError(f"preload_adapters: {'; '.join(bad)}")

    def api_limits(self) -> dict[str, Any]:
        """build_api's keyword arguments of the same names."""
        return dict(max_request_body_bytes=self.max_request_body_bytes, max_prompt_chars=self.max_prompt_chars,
                    metrics_public=self.metrics_public, quotas=self.quota_config)

    def engine_args(self, model_dir: str) -> EngineArgs:
        args = dict(enable_lora=True, max_loras=4, max_lora_rank=64)
        args.update(self.engine)
        return EngineArgs(model=model_dir, **args)
