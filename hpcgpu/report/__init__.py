"""Reports of a run: a PNG of loss, tokens/s and GPU use, and a text summary. matplotlib, no torch."""
from hpcgpu.report.run import RunData, Summary, load_run, summarize, write_report

__all__ = ["RunData", "Summary", "load_run", "summarize", "write_report"]
