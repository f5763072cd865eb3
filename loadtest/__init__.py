"""Load tests of the served ensembles and the aggregated-vs-disaggregated comparison (docs/loadtest.md).

    locust -f loadtest/locustfile.py ...     # one deployment, raw samples to JSONL
    python -m loadtest report ...            # tables, goodput and plots from samples
    python -m loadtest compare [--quick]     # build, serve each deployment in turn, run, report
"""
