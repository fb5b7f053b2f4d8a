"""Clarifier's Ray Serve entry points (a thin re-export of ``clarifier.serving.app``).

Run one application in the foreground (args are ``ServeConfig`` fields, plus ``tracking_uri``)::

    serve run clarifier.serving.app:app_builder model_uri=models:/clarifier@champion \
        tracking_uri=http://mlflow:5000 num_replicas=2

or, from this folder, ``serve run app:app_builder model_uri=/path/to/model_folder``.

Deploy declaratively to a running cluster (edit ``serve_config.yaml`` first)::

    ray start --head            # or point RAY_ADDRESS / --address at an existing cluster
    serve deploy serve/serve_config.yaml
    serve status
    curl -s localhost:8000/readyz
    curl -s localhost:8000/v1/clarify -H 'content-type: application/json' -H "Authorization: Bearer $KEY" \
        -d '{"history": [{"role": "user", "text": "I have a checking and a savings account"}], "query": "close it"}'

API keys come from ``$CLARIFIER_API_KEYS`` (comma separated) / ``api_keys_file`` where the app is
built; without any, authentication is off (the ingress logs a warning). Prometheus metrics: Ray's
metrics port on every node (``ray_clarifier_*``), or ``GET /metrics`` on the API.

Interactive API docs are served at ``/docs``. From Python, ``clarifier.serving.app.run_local``
starts Serve locally and returns the base URL once ``/readyz`` is 200.
"""

from clarifier.serving.app import app_builder, build_app

__all__ = ["app_builder", "build_app"]
