"""Exporters of a run's figures to the tools users already watch: TensorBoard event files (``tensorboard``),
an MLflow run (``mlflow``) and a Prometheus scrape endpoint (``prometheus``); read by ``dtprobe export`` and
``dtprobe serve-metrics``.

Every value comes from the ``dtprobe.analysis.RunAnalysis`` facade (or the run's tables it reads), so an exported
figure is the number ``dtprobe analyze --format json`` prints. The libraries are optional extras, imported inside
the functions that use them; ``extras.require`` turns a missing one into a ConfigError naming the pip extra.
"""
