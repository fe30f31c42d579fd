"""The application on top of the library: the AR-vs-speculative experiment driver (base policy,
offline draft initialisation, the two RL runs), supervised LM (pre)training, and the report."""
