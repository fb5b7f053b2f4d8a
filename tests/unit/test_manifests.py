"""Offline checks of the KubeRay manifests under infra/k8s/ (no Ray cluster, no Kubernetes, no models).

* Every YAML document is a ray.io/v1 RayCluster/RayJob/RayService and validates *strictly*
  against the v1 openAPIV3Schema of the KubeRay CRDs in ../shared/k8s/kuberay-crds/: as a
  structural schema, an object with ``properties`` admits no other keys unless it says
  ``x-kubernetes-preserve-unknown-fields: true`` (the API server would prune or reject them; here
  they are errors). ``x-kubernetes-int-or-string`` accepts an int or a string. CEL rules
  (``x-kubernetes-validations``) are not evaluated.
* A deliberately broken manifest (an unknown ``spec.entrypointz``, a wrong type) fails.
* The RayService's serveConfigV2 validates as a ``ray.serve.schema.ServeDeploySchema``, its
  import_path resolves, and its Clarifier args are accepted by ``parse_app_args``.
* Every RayJob entrypoint is ``python jobs/<existing>.py`` with arguments the job's CLI accepts
  (parsed by click, not run), and its ``-c`` config loads with ``clarifier.core.config.load_config``.
* No manifest carries a literal credential value.
"""

from __future__ import annotations

import copy
import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
CRDS = ROOT.parent / "shared" / "k8s" / "kuberay-crds"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
JOB_COMMANDS = {  # jobs/<file> -> the `clarifier` CLI sub-command it runs
    "prepare_data.py": ["data", "prepare"],
    "train.py": ["train"],
    "evaluate.py": ["eval"],
    "register.py": ["models", "register"],
    "audit.py": ["audit"],
}
EXPECTED_FILES = {"raycluster.yaml", "rayjob-prepare.yaml", "rayjob-train.yaml",
                  "rayjob-evaluate.yaml", "rayjob-register.yaml", "rayservice.yaml",
                  "rayjob-audit.yaml"}

needs_crds = pytest.mark.skipif(
    not CRDS.is_dir(),
    reason=f"KubeRay CRDs not found at {CRDS} (the shared/k8s/kuberay-crds folder next to the repo)",
)


# ---- CRD openAPIV3Schema -> strict JSON Schema ---------------------------------------------------


def strict_schema(node):
    """A copy of a Kubernetes structural schema as a JSON Schema with unknown fields forbidden."""
    if isinstance(node, list):
        return [strict_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = strict_schema(value)
        elif key == "nullable":
            continue  # handled below
        elif key.startswith("x-kubernetes-"):
            continue  # annotations for the API server (list types, CEL rules, ...)
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.pop("anyOf", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


# The root `metadata` of a CRD schema is `type: object` (the API server validates it as ObjectMeta);
# checked here against the ObjectMeta fields a manifest may set.
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

_validators: dict = {}


def validator_for(kind: str):
    if kind not in _validators:
        crd = yaml.safe_load((CRDS / CRD_FILES[kind]).read_text())
        assert crd["spec"]["names"]["kind"] == kind
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        schema = strict_schema(version["schema"]["openAPIV3Schema"])
        schema["properties"]["metadata"] = OBJECT_META
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        _validators[kind] = cls(schema)
    return _validators[kind]


def schema_errors(doc: dict) -> list[str]:
    kind = doc.get("kind")
    if kind not in CRD_FILES:
        return [f"kind {kind!r} is not one of {sorted(CRD_FILES)}"]
    if doc.get("apiVersion") != "ray.io/v1":
        return [f"apiVersion {doc.get('apiVersion')!r} is not ray.io/v1"]
    errs = validator_for(kind).iter_errors(doc)
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errs]


# ---- manifests ---------------------------------------------------------------------------------


def manifest_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.y*ml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.name}#{i}", doc))
    return docs


def docs_of(kind: str) -> list[tuple[str, dict]]:
    return [(name, d) for name, d in manifest_docs() if d.get("kind") == kind]


def load(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return doc


def test_expected_manifests_exist():
    present = {p.name for p in K8S.glob("*.yaml")}
    assert EXPECTED_FILES <= present, f"missing: {sorted(EXPECTED_FILES - present)}"
    kinds = sorted(d["kind"] for _, d in manifest_docs())
    assert kinds.count("RayCluster") >= 1 and kinds.count("RayService") >= 1 and kinds.count("RayJob") >= 4


@needs_crds
@pytest.mark.parametrize("name,doc", manifest_docs(), ids=[n for n, _ in manifest_docs()])
def test_manifest_validates_strictly_against_kuberay_crd(name, doc):
    errors = schema_errors(doc)
    assert not errors, f"{name} does not match the KubeRay {doc.get('kind')} CRD:\n" + "\n".join(errors)


@needs_crds
@pytest.mark.parametrize("mutate,expected", [
    (lambda d: d["spec"].__setitem__("entrypointz", "python jobs/train.py"), "entrypointz"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     .__setitem__("imagePullPolicyy", "Always"), "imagePullPolicyy"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__("replicas", "eight"), "eight"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0), "num-cpus"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
    (lambda d: d["metadata"].__setitem__("lables", {"a": "b"}), "lables"),
])
def test_broken_manifest_is_rejected(mutate, expected):
    doc = load("rayjob-train.yaml")
    assert not schema_errors(doc)
    broken = copy.deepcopy(doc)
    mutate(broken)
    errors = schema_errors(broken)
    assert errors, "a broken manifest passed validation"
    assert any(expected in e for e in errors), errors


@needs_crds
def test_int_or_string_quantities_accept_both():
    doc = load("rayjob-train.yaml")
    res = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    res["limits"]["cpu"] = 8
    res["requests"]["cpu"] = "8000m"
    assert not schema_errors(doc)
    res["limits"]["cpu"] = [8]
    assert schema_errors(doc)


# ---- RayService: the embedded Serve config -----------------------------------------------------


def serve_config(doc: dict) -> dict:
    raw = doc["spec"]["serveConfigV2"]
    assert isinstance(raw, str), "serveConfigV2 must be a YAML string"
    return yaml.safe_load(raw)


@pytest.mark.parametrize("name,doc", docs_of("RayService"), ids=[n for n, _ in docs_of("RayService")])
def test_rayservice_serve_config(name, doc):
    from ray.serve.schema import ServeDeploySchema

    cfg = serve_config(doc)
    schema = ServeDeploySchema.model_validate(cfg)
    (app,) = [a for a in schema.applications if a.import_path == "clarifier.serving.app:app_builder"]
    module_name, attr = app.import_path.split(":")
    builder = getattr(importlib.import_module(module_name), attr)
    assert callable(builder)

    from clarifier.serving.app import parse_app_args

    serve_cfg, _ = parse_app_args(app.args)  # every arg is a ServeConfig field (or tracking_uri)
    assert serve_cfg.model_uri.startswith("models:/")

    model = [d for d in (app.deployments or []) if d.name == "ClarifierModel"]
    assert model, "no deployment override for ClarifierModel"
    auto = model[0].autoscaling_config
    assert auto, "ClarifierModel has no autoscaling_config"
    auto = auto if isinstance(auto, dict) else auto.model_dump()
    assert auto["min_replicas"] >= 1 and auto["max_replicas"] >= auto["min_replicas"]
    assert cfg["http_options"]["port"] == 8000


# ---- RayJobs: entrypoints, CLIs and configs ----------------------------------------------------


def parse_entrypoint(entrypoint: str) -> tuple[str, list[str]]:
    argv = shlex.split(entrypoint)
    assert len(argv) >= 2 and argv[0] in ("python", "python3"), f"entrypoint must run python: {entrypoint!r}"
    m = re.fullmatch(r"jobs/([A-Za-z0-9_]+\.py)", argv[1])
    assert m, f"entrypoint must run jobs/<stage>.py: {entrypoint!r}"
    return m.group(1), argv[2:]


def cli_args(command: list[str], args: list[str]):
    """Parse ``clarifier <command> <args>`` with click (no callback runs); a bad option raises."""
    import typer.main

    from clarifier.cli import app

    cmd = typer.main.get_command(app)  # typer may vendor its own click: duck-type groups
    ctx = cmd.make_context("clarifier", [*command, *args])
    while hasattr(cmd, "resolve_command"):
        rest = [*(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])), *ctx.args]
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        ctx = cmd.make_context(name, rest, parent=ctx)
    return ctx


def test_cli_parsing_rejects_unknown_options():
    ctx = cli_args(["models", "register"], ["--run-id", "abc", "--alias", "champion"])
    assert ctx.params["run_id"] == "abc" and ctx.params["alias"] == "champion"
    assert cli_args(["eval"], ["--model", "m", "-c", "c.yaml"]).params["model"] == "m"
    for command, args in [(["models", "register"], ["--run-id", "abc", "-c", "jobs/configs/cluster-gpu.yaml"]),
                          (["train"], ["-c", "jobs/configs/cluster-gpu.yaml", "--gpus", "8"]),
                          (["eval"], ["-c", "jobs/configs/cluster-gpu.yaml"])]:  # --model is required
        with pytest.raises(Exception) as err:
            cli_args(command, args)
        assert "UsageError" in [c.__name__ for c in type(err.value).__mro__], repr(err.value)


def config_arg(args: list[str]) -> str | None:
    for i, a in enumerate(args):
        if a in ("-c", "--config"):
            return args[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


@pytest.mark.parametrize("name,doc", docs_of("RayJob"), ids=[n for n, _ in docs_of("RayJob")])
def test_rayjob_entrypoint(name, doc):
    from clarifier.core.config import load_config

    script, args = parse_entrypoint(doc["spec"]["entrypoint"])
    assert (ROOT / "jobs" / script).is_file(), f"{name}: jobs/{script} does not exist"
    assert script in JOB_COMMANDS, f"{name}: jobs/{script} has no known CLI command"

    # The arguments must be accepted by the job's command: parse them with click, without running it.
    cli_args(JOB_COMMANDS[script], args)

    config = config_arg(args)
    overrides = [a for a in args if "=" in a and not a.startswith("-") and re.match(r"^[a-z_]+\.", a)]
    if config is not None:
        assert (ROOT / config).is_file(), f"{name}: config {config} does not exist"
        load_config(ROOT / config, overrides)
    else:
        assert script == "register.py", f"{name}: jobs/{script} should get -c CONFIG"


def test_cluster_gpu_config():
    from clarifier.core.config import load_config

    cfg = load_config(ROOT / "jobs" / "configs" / "cluster-gpu.yaml")
    assert cfg.train.use_gpu and cfg.train.num_workers == 8 and cfg.train.zero_stage == 3
    assert cfg.storage.root.startswith("s3://")
    assert cfg.data.input.startswith("s3://") and cfg.data.output.startswith("s3://")


def test_train_job_has_a_gpu_per_train_worker():
    from clarifier.core.config import load_config

    doc = load("rayjob-train.yaml")
    _, args = parse_entrypoint(doc["spec"]["entrypoint"])
    cfg = load_config(ROOT / config_arg(args))
    gpus = cpus = 0
    for group in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        gpus += int(limits.get("nvidia.com/gpu", 0)) * group["minReplicas"]
        cpus += int(limits.get("cpu", 0)) * group["minReplicas"]
    assert gpus >= cfg.train.num_workers
    assert cpus >= cfg.train.num_workers * cfg.train.cpus_per_worker


# ---- credentials -------------------------------------------------------------------------------

SECRET_NAME = re.compile(r"(^|_)(SECRET|PASSWORD|PASSWD|TOKEN|KEY|CREDENTIALS?)(_|$)", re.I)  # not max_new_tokens
AWS_KEY_LITERAL = re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b")


def _env_lists(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "env" and isinstance(v, list):
                yield f"{path}/env", v
            yield from _env_lists(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _env_lists(v, f"{path}/{i}")


def _secret_literals(node, path=""):
    """Paths where a secret-looking name is given a literal value (env lists, env_vars maps)."""
    if isinstance(node, dict):
        if isinstance(node.get("name"), str) and SECRET_NAME.search(node["name"]) and "value" in node:
            yield f"{path}/{node['name']}"
        for k, v in node.items():
            if isinstance(k, str) and SECRET_NAME.search(k) and isinstance(v, (str, int)) and k != "key":
                yield f"{path}/{k}"
            if k in ("serveConfigV2", "runtimeEnvYAML") and isinstance(v, str):
                yield from _secret_literals(yaml.safe_load(v), f"{path}/{k}")
            else:
                yield from _secret_literals(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _secret_literals(v, f"{path}/{i}")


def test_secret_literal_detector():
    assert list(_secret_literals({"env": [{"name": "AWS_SECRET_ACCESS_KEY", "value": "x"}]}))
    assert list(_secret_literals({"runtimeEnvYAML": "env_vars: {AWS_SECRET_ACCESS_KEY: x}"}))
    assert not list(_secret_literals({"args": {"max_new_tokens": 48}}))
    assert not list(_secret_literals({"env": [{"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "AWS_SECRET_ACCESS_KEY"}}}]}))


def test_no_literal_credentials():
    for path in sorted(K8S.glob("*.y*ml")):
        assert not AWS_KEY_LITERAL.search(path.read_text()), f"{path.name}: looks like an AWS access key id"
    for name, doc in manifest_docs():
        found = list(_secret_literals(doc))
        assert not found, f"{name}: literal credential value(s) at {found}"
        for where, env in _env_lists(doc):
            for var in env:
                if SECRET_NAME.search(var.get("name", "")):
                    assert "secretKeyRef" in var.get("valueFrom", {}), f"{name}{where}: {var['name']} not from a Secret"
