"""replicas: one model replica (Llama-family model, paged KV cache, scheduler, engine).

Not built yet: this package lands with the issue "replicas: the
tensor-parallel multi-LoRA engine". It may import lora_core, never ray or
cluster (tests/test_package_rule.py).
"""
