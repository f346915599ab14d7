"""replicas: one model replica (Llama-family model, paged KV cache, scheduler, engine).

Runs with no Ray: `replicas.llm.LLM` offline, `replicas.async_engine.AsyncLLMEngine`
for servers (docs/engine.md). It may import lora_core, never ray or cluster
(tests/test_package_rule.py).
"""
