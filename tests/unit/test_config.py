from pathlib import Path

import pytest

from clarifier.core.config import ConfigError, build_config, flatten, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    for f in [*(ROOT / "jobs" / "configs").glob("*.yaml"), ROOT / "platform" / "clarifier" / "quickstart.yaml"]:
        cfg = load_config(f)
        assert cfg.train.num_workers >= 1


def test_dotted_overrides_are_typed():
    cfg = build_config({}, ["train.max_steps=7", "model.lora.r=4", "train.use_gpu=true",
                            "model.lora.target_modules=[q_proj,v_proj]", "train.max_minutes=1.5"])
    assert cfg.train.max_steps == 7 and cfg.model.lora.r == 4 and cfg.train.use_gpu is True
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"] and cfg.train.max_minutes == 1.5


@pytest.mark.parametrize("override,fragment", [
    ("train.max_stpes=3", "'train.max_stpes'"),
    ("trian.max_steps=3", "'trian.max_steps'"),
    ("train.max_steps=lots", "train.max_steps"),
    ("train.zero_stage=5", "train.zero_stage"),
    ("train.placement_strategy=EVERYWHERE", "train.placement_strategy"),
    ("model.lora.r=0", "model.lora.r"),
    ("train.max_steps", "key.sub=value"),
    ("train.max_steps.x=1", "not a section"),
])
def test_wrong_key_or_type_names_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        build_config({}, [override])


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: 3\n  lr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "train.lr" in str(e.value) and str(p) in str(e.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "bad.yaml")


def test_flatten_gives_dotted_params():
    flat = flatten(build_config({}, ["train.max_steps=9"]))
    assert flat["train.max_steps"] == 9 and "model.lora.r" in flat


def test_strict_spread_needs_a_node_per_worker():
    from clarifier.train.trainer import check_placement

    node = {"Alive": True, "Resources": {"CPU": 2.0}}
    t = build_config({}, ["train.num_workers=2", "train.placement_strategy=STRICT_SPREAD"]).train
    check_placement(t, [node, dict(node)])
    with pytest.raises(ValueError, match="STRICT_SPREAD.*only 1 node"):
        check_placement(t, [node, {"Alive": False, "Resources": {"CPU": 2.0}}, {"Alive": True, "Resources": {"CPU": 0.5}}])
    check_placement(build_config({}, ["train.num_workers=2"]).train, [node])  # PACK: one node is fine


def test_full_finetune_is_a_choice_that_refuses_the_pipeline_variant():
    assert build_config({}, []).model.finetune == "lora"
    assert build_config({}, ["model.finetune=full"]).model.finetune == "full"
    with pytest.raises(ConfigError, match="model.finetune: Input should be 'lora' or 'full'"):
        build_config({}, ["model.finetune=qlora"])
    with pytest.raises(ConfigError) as exc:
        build_config({}, ["model.finetune=full", "train.variant=pipeline"])
    msg = str(exc.value)
    assert "model.finetune=full does not combine with train.variant=pipeline" in msg
    assert "'storage'" not in msg  # a cross-section check names its keys, not the whole config dict


def test_history_window_reaches_the_prompt_the_model_folder_and_the_data_check(tmp_path):
    import json

    from clarifier.recipes import data_is_current

    cfg = build_config({"data": {"output": str(tmp_path)}}, ["model.max_history_turns=6"])
    assert cfg.model.prompt_options().max_history_turns == 6
    assert cfg.model.prompt_meta() == {"max_prompt_tokens": cfg.model.max_prompt_tokens, "max_history_turns": 6,
                                       "passage_focus": False}
    with pytest.raises(ConfigError, match="model.max_history_turns"):
        build_config({}, ["model.max_history_turns=-1"])
    tokenizer = {"base_model": cfg.model.base_model, "max_prompt_tokens": cfg.model.max_prompt_tokens}
    # data tokenised without the window, or before targets named only the turns the prompt shows, is prepared again
    for window, grounding, current in ((None, "shown-turns", False), (6, None, False), (6, "shown-turns", True)):
        (tmp_path / "manifest.json").write_text(json.dumps({"config": {
            "data": cfg.data.model_dump(mode="json"),
            "tokenizer": {**tokenizer, "max_history_turns": window, "target_grounding": grounding}}}))
        assert data_is_current(cfg) is current
    # passage focus is part of the prompt: data rendered without it (a manifest from before the setting) is not current
    focused = build_config({"data": {"output": str(tmp_path)}}, ["model.max_history_turns=6", "model.passage_focus=true"])
    assert focused.model.prompt_options().passage_focus is True
    assert not data_is_current(focused)
    assert focused.model.prompt_differences({**tokenizer, "max_history_turns": 6}) == {
        "model.passage_focus": (False, True)}
