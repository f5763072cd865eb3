"""Triton Python-backend models and the Triton-free pieces they share.

Model modules (`preprocessing`, `postprocessing`, `engine_model`, `orchestrator`) are imported by the
repository's `<model>/1/model.py` shims inside the backend stub, where `triton_python_backend_utils`
exists; `contract`, `tensors`, `paths` and `load_board` import without it and are unit-tested directly."""
