"""The CPU reference engine: a numpy Llama with a paged KV cache, split by role like a TensorRT-LLM engine."""
