"""Stage: the data job (Ray Data). ``pipeline.prepare`` writes what ``outputs`` reads back."""
