"""The speed/quality study's modules, imported as `studylib` by the scripts beside this package
(experiments/study.py, bench_decode.py, serve_bench.py, scaling.py, bench_data_parallel.py).
Not part of the dllm_jax library, which imports nothing from here."""
