"""The application on top of the library: the AR-vs-speculative RL jobs (config, base policy,
offline draft initialisation, the two runs), supervised LM (pre)training, and the report."""

from specjax.jobs.console import exit_on_stop, setup_logging

__all__ = ["exit_on_stop", "setup_logging"]
