"""The Serve deployment as configured, without Ray: the deploy configs, app_builder's arguments and
the Serve options a ServeConfig builds (the live server is tests/integration/test_serving.py)."""

from __future__ import annotations

import pytest
import yaml

from clarifier.core.config import ConfigError, ServeConfig
from support.paths import ROOT


def test_serve_config_file_is_a_valid_serve_deploy_config():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((ROOT / "serve" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data)
    (app,) = [a for a in schema.applications if a.name == "clarifier"]
    assert app.import_path == "clarifier.serving.app:app_builder"
    assert app.route_prefix == "/"
    assert app.args["model_uri"] == "models:/clarifier@champion"
    from clarifier.serving.app import parse_app_args

    cfg, _ = parse_app_args(app.args)  # the file's args are valid ServeConfig overrides
    assert cfg.model_uri == "models:/clarifier@champion"


def test_app_builder_args_are_validated():
    from clarifier.serving.app import app_builder, parse_app_args

    cfg, tracking = parse_app_args({"model_uri": "/m", "num_replicas": "2", "max_batch_size": "4",
                                    "tracking_uri": "http://mlflow:5000"})
    assert (cfg.model_uri, cfg.num_replicas, cfg.max_batch_size, tracking) == ("/m", 2, 4, "http://mlflow:5000")
    with pytest.raises(ConfigError, match="num_replica"):
        app_builder({"model_uri": "/m", "num_replica": 2})
    with pytest.raises(ConfigError, match="max_batch_size"):
        app_builder({"max_batch_size": "zero"})
    app = app_builder({"model_uri": "/m"})  # builds (binds) without touching Ray
    assert app is not None


def test_serve_app_reexport():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_app_reexport", ROOT / "serve" / "app.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from clarifier.serving.app import app_builder, build_app

    assert mod.app_builder is app_builder and mod.build_app is build_app


def test_deployment_options_from_config():
    from clarifier.serving.app import deployment_options

    cfg = ServeConfig(max_ongoing_requests=2, max_batch_size=4, max_queued_requests=6, cpus_per_replica=2,
                      gpus_per_replica=1, num_replicas=3)
    model, ingress = deployment_options(cfg, {"AWS_REGION": "eu-west-1"})
    assert model["max_ongoing_requests"] == 4  # raised to max_batch_size
    assert model["max_queued_requests"] == 6 and model["num_replicas"] == 3
    assert model["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1,
                                          "runtime_env": {"env_vars": {"AWS_REGION": "eu-west-1"}}}
    assert "autoscaling_config" not in model and ingress["num_replicas"] == 1
    assert ingress["ray_actor_options"]["num_cpus"] == 0
    assert ingress["max_ongoing_requests"] >= 4 * 3 + 6  # the ingress can hold what the model side can

    auto = ServeConfig.model_validate({"autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 2,
                                                       "target_ongoing_requests": 3, "upscale_delay_s": 1,
                                                       "downscale_delay_s": 5}})
    model, ingress = deployment_options(auto)
    assert "num_replicas" not in model and "ray_actor_options" in model
    a = model["autoscaling_config"]
    assert (a["min_replicas"], a["max_replicas"], a["target_ongoing_requests"], a["upscale_delay_s"],
            a["downscale_delay_s"]) == (1, 2, 3, 1, 5)
    assert ingress["autoscaling_config"]["max_replicas"] == 2
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**a)  # Serve accepts it
    AutoscalingConfig(**ingress["autoscaling_config"])
    with pytest.raises(ConfigError, match="max_replicas"):
        from clarifier.serving.app import parse_app_args

        parse_app_args({"autoscaling.enabled": "true", "autoscaling.min_replicas": "3", "autoscaling.max_replicas": "2"})


@pytest.mark.parametrize("source", ["serve/serve_config.yaml", "infra/k8s/rayservice.yaml"])
def test_deploy_configs_autoscaling_matches_their_args(source):
    """The Serve-level ClarifierModel override (what Serve applies) equals what the app args build."""
    from clarifier.serving.app import autoscaling_config, deployment_options, parse_app_args

    doc = yaml.safe_load((ROOT / source).read_text())
    if doc.get("kind") == "RayService":
        doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = [a for a in doc["applications"] if a["import_path"] == "clarifier.serving.app:app_builder"]
    cfg, _ = parse_app_args(app["args"])
    assert cfg.autoscaling.enabled, f"{source}: args.autoscaling.enabled should be true"
    (model,) = [d for d in app["deployments"] if d["name"] == "ClarifierModel"]
    expected = autoscaling_config(cfg)
    assert model["autoscaling_config"] == expected, f"{source}: deployments autoscaling_config != args.autoscaling"
    opts, _ = deployment_options(cfg)
    for key in ("max_ongoing_requests", "max_queued_requests"):
        assert model[key] == opts[key], f"{source}: deployments.{key} != what the args build"
    # ray_actor_options stay in code (an override would replace the forwarded runtime_env)
    assert "ray_actor_options" not in model
