"""Stage: the MLflow model registry -- registration, ``models:/`` and ``runs:/`` resolution,
promotion gates, rollback and the audit log."""
