"""Command-line tools: the environment report and the memory estimator."""
