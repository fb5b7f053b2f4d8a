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
