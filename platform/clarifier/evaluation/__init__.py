"""Stage: evaluation (in process or Ray Data actors): ``evaluate.evaluate`` and its report."""
