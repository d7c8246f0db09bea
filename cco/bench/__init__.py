"""Measurement tooling, apart from the runtime: ``timing`` (the one timing module every benchmark
uses: events or graph replay, rotating inputs, medians, max over ranks; the cuBLAS baselines) and
``perf_model`` (the cost model behind ``scripts.predict_scaling``). The runtime (``cco.op`` and what
it imports) never imports this package; the scripts and ``cco.demo`` do.
"""
