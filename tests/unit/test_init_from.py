"""model.init_from: training starts from an existing Clarifier LoRA adapter (checked on the driver)."""

from __future__ import annotations

import shutil

import pytest

from clarifier.core.config import build_config
from clarifier.engine.models import resolve_base_model
from clarifier.train.trainer import check_init_from
from support.adapters import untrained_adapter


def _cfg(tiny_model_dir, *extra):
    return build_config({}, [f"model.base_model={tiny_model_dir}", *extra])


def test_a_lora_model_on_the_same_base_is_accepted_with_its_shape(tiny_model_dir, tmp_path):
    adapter = untrained_adapter(tiny_model_dir, tmp_path / "champion", threshold=0.5, r=2)
    cfg = _cfg(tiny_model_dir, f"model.init_from={adapter}")
    got = check_init_from(cfg, resolve_base_model(str(tiny_model_dir)), None)
    assert got["r"] == 2 and got["target_modules"] == ["q_proj", "v_proj"] and got["version"] == str(adapter)


def test_another_base_a_full_model_or_the_pipeline_variant_is_refused(tiny_model_dir, tmp_path):
    adapter = untrained_adapter(tiny_model_dir, tmp_path / "champion", threshold=0.5)
    other = tmp_path / "other-base"
    shutil.copytree(tiny_model_dir, other)
    base = resolve_base_model(str(other))
    with pytest.raises(ValueError, match="was trained on base model"):
        check_init_from(_cfg(other, f"model.init_from={adapter}"), base, None)
    here = resolve_base_model(str(tiny_model_dir))
    with pytest.raises(ValueError, match="model.finetune=full"):
        check_init_from(_cfg(tiny_model_dir, f"model.init_from={adapter}", "model.finetune=full"), here, None)
    with pytest.raises(ValueError, match="train.variant=pipeline"):
        check_init_from(_cfg(tiny_model_dir, f"model.init_from={adapter}", "train.variant=pipeline"), here, None)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="not a LoRA model"):
        check_init_from(_cfg(tiny_model_dir, f"model.init_from={adapter}"), here, None)
    with pytest.raises(ValueError, match="not a folder"):
        check_init_from(_cfg(tiny_model_dir, f"model.init_from={tmp_path / 'nope'}"), here, None)


def test_workers_get_absolute_local_paths_and_uris_unchanged(tmp_path, monkeypatch):
    """Ray Train runs each worker in its own directory: a relative data.output (the recipes' default) turned the
    learning curve off, since the workers could not find the dev split."""
    from clarifier.core.config import build_config
    from clarifier.train.trainer import worker_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prev-model").mkdir()
    cfg = build_config({"data": {"output": "runs/data"}}, ["model.init_from=prev-model", "model.cache_dir=cache"])
    d = worker_config(cfg)
    assert d["data"]["output"] == str(tmp_path / "runs" / "data") and d["model"]["cache_dir"] == str(tmp_path / "cache")
    assert d["model"]["init_from"] == str(tmp_path / "prev-model")
    for uri in ("builtin:clarifier-smollm2-135m", "models:/clarifier@champion", "s3://bucket/model"):
        assert worker_config(build_config({"data": {"output": "s3://b/data"}}, [f"model.init_from={uri}"])) \
            ["model"]["init_from"] == uri
    assert worker_config(build_config({"data": {"output": "s3://b/data"}}, []))["data"]["output"] == "s3://b/data"
    assert cfg.data.output == "runs/data"  # the driver's own config is unchanged


def test_training_refuses_data_tokenised_with_another_history_window(tmp_path):
    import json

    from clarifier.core.config import build_config
    from clarifier.train.trainer import train

    (tmp_path / "manifest.json").write_text(json.dumps({"config": {"tokenizer": {"max_history_turns": None}}}))
    cfg = build_config({"data": {"output": str(tmp_path)}}, ["model.max_history_turns=4"])
    with pytest.raises(ValueError, match=r"tokenised with model.max_history_turns=None but this run has "
                                         r"model.max_history_turns=4: run `clarifier data prepare`"):
        train(cfg)
    # every prompt setting counts: here the passage focus (a manifest without it was rendered without it)
    (tmp_path / "manifest.json").write_text(json.dumps({"config": {"tokenizer": {
        "max_history_turns": None, "max_prompt_tokens": 384}}}))
    cfg = build_config({"data": {"output": str(tmp_path)}}, ["model.passage_focus=true"])
    with pytest.raises(ValueError, match=r"tokenised with model.passage_focus=False but this run has "
                                         r"model.passage_focus=True: run `clarifier data prepare`"):
        train(cfg)
