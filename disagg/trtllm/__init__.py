"""The TensorRT-LLM (GPU) engine path: build commands, incremental builds, Triton `tensorrtllm` configs.

TensorRT-LLM cannot be installed on the development machines, so everything here is a pure function of
the deployment spec (commands, configs, launch scripts) that the tests check as data; only
`build.build_roles` runs anything, and it refuses to start outside a supported release.
"""
