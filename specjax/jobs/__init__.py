"""The application on top of the library: the AR-vs-speculative RL jobs (config, base policy,
offline draft initialisation, the two runs), supervised LM (pre)training, and the report."""

from specjax.jobs.console import run_main, setup_logging

__all__ = ["run_main", "setup_logging"]
