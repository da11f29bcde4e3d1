"""The benchmark suite behind ``scripts/benchmark.py``: packing quality, data pipeline, training throughput and
resume cost. It lives in the checkout, outside the installed ``nanovlm`` package; each section module measures
and returns its figures, ``report.py`` renders them."""
