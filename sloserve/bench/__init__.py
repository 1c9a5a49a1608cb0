"""Benchmarking any OpenAI-compatible server: streaming load generator, metrics, reports.

`records`, `metrics`, `report`, `plots`, `result` and `compare` depend only on per-request
records (no HTTP, no torch), so the simulator summarizes and plots its runs with them too.
"""
from sloserve.bench.metrics import SLO, Summary, summarize
from sloserve.core.records import RequestRecord
from sloserve.bench.result import BenchResult, load_results, save_results

__all__ = ["SLO", "BenchResult", "RequestRecord", "Summary", "load_results", "save_results", "summarize"]
