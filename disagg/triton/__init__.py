"""Triton Python-backend models. Each module holds plain, unit-testable logic plus a `TritonPythonModel`
that the repository's `<model>/1/model.py` shim imports; `triton_python_backend_utils` is imported inside
its methods because it exists only in the backend stub."""
