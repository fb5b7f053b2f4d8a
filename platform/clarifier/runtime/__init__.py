"""Layer 2, where the code runs: storage (folder / ``s3://``), local services (MLflow server), Ray
start-up and job submission, the MLflow tracking URI, the retry policy. Imports only ``core``."""
