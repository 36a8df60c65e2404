"""Loading: ``ucmagic.DataLoader`` and its stats (records, analysis, saved form) and MLflow logging.

Built on ``ucmagic.files`` (the datasets it drives) and ``ucmagic.telemetry`` (the counters both write).
"""
