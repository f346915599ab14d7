"""A request's inputs checked against the served model before anything is queued.

The prompt (text, or token ids inside the vocabulary), the settings' types, and the token ids that the
sampling settings name (logit_bias). SamplingParams checks its own values without knowing the model;
what needs the model is here. Each problem is an InvalidRequestError naming its field, raised before the
engine changes anything.
"""

from __future__ import annotations

from lora_core.request import LoRARequest
from replicas.errors import InvalidRequestError
from replicas.sampling_params import SamplingParams
from replicas.tokenizer import Tokenizer


def checked_settings(params: SamplingParams | None, lora_request: LoRARequest | None) -> SamplingParams:
    """params (default SamplingParams()) after checking both arguments' types."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError([("sampling_params", f"must be SamplingParams, got {type(params).__name__}")])
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise InvalidRequestError([("lora_request", f"must be a LoRARequest, got {type(lora_request).__name__}")])
    return params


def prompt_ids(tokenizer: Tokenizer, vocab: int, prompt: str | dict) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as a string or as {"prompt_token_ids": [...]}."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError([("prompt", "the prompt is empty")])
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise InvalidRequestError([("prompt_token_ids", f"prompt_token_ids must be a list of token ids in "
                                                            f"[0, {vocab})")])
        return None, list(ids)
    raise InvalidRequestError([("prompt", "the prompt must be a string or {'prompt_token_ids': [...]}")])


def check_token_ids(params: SamplingParams, vocab: int) -> None:
    """The tokens logit_bias and allowed_token_ids name are in the vocabulary (a stop token id past it can never
    be sampled: harmless)."""
    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
        if ids and max(ids) >= vocab:
            raise InvalidRequestError([(name, f"SamplingParams.{name} names token id {max(ids)}, outside the "
                                              f"vocabulary [0, {vocab})")])


def bad_words_ids(tokenizer: Tokenizer, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
    """The token sequences SamplingParams.bad_words forbids: each word as its tokens at the start of a text and
    after a space (a word usually tokenizes differently there), without repeats."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in params.bad_words or ():
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs[ids] = None
    return tuple(seqs)


def checked_priority(priority: object, policy: str) -> int:
    """A request's priority (lower is served first), which only the "priority" scheduling policy reads: under
    "fcfs" anything but 0 is refused rather than ignored, as in vLLM."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError([("priority", f"priority must be an integer, got {priority!r}")])
    if priority and policy != "priority":
        raise InvalidRequestError([("priority", f"priority {priority} needs the engine's scheduling_policy "
                                                f"'priority' (this one's is {policy!r})")])
    return priority


def checked_tenant(tenant: object) -> str | None:
    """A request's tenant key (scheduling_policy "fair"). Accepted under any policy, unlike a priority: a server
    passes its callers' keys whatever its engines' policy, and sharing is not a request's own choice."""
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidRequestError([("tenant", f"tenant must be a string or None, got {type(tenant).__name__}")])
    return tenant


def truncated(ids: list[int], params: SamplingParams) -> list[int]:
    """The prompt's last truncate_prompt_tokens ids (vLLM's: keep the end, where the question usually is)."""
    k = params.truncate_prompt_tokens
    return ids[-k:] if k is not None and len(ids) > k else ids
