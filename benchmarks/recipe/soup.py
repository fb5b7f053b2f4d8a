"""A uniform soup of LoRA adapters of one base model, as one LoRA adapter (exact). Model folder out.

    .venv/bin/python benchmarks/recipe/soup.py builtin:clarifier-smollm2-135m ./model-retrained --out ./model-soup
    .venv/bin/python benchmarks/recipe/head_refit.py --data <recipe data> --model ./model-soup \
        --head soup=last+mean:all --dev-only --features ./soup.npz

Averaging the weights of models fine-tuned from one pretrained model ("model soups", Wortsman et al., 2022) often
ranks better than any one of them at the cost of one model. For LoRA the average of the updates
``mean_i(s * B_i A_i)`` is itself a LoRA of rank ``n * r``: the A matrices stacked, the B matrices side by side,
each divided by n, with alpha scaled by n so that ``alpha / r`` stays ``s``. The folder is a copy of the first
model's (tokenizer, prompt settings) with that adapter and **without** a decision head, threshold or model card: refit the
head on the soup's states (``head_refit.py``) before comparing.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="model URIs (folders, builtin:<name>, models:/, runs:/, s3://) holding "
                    "LoRA adapters of one base")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if len(args.models) < 2:
        raise SystemExit("a soup needs at least two models")

    import torch
    from safetensors.torch import load_file, save_file

    from clarifier.engine.loading import resolve_model
    from clarifier.engine.models import ModelResolutionError

    try:
        folders = [resolve_model(m).folder for m in args.models]
    except ModelResolutionError as exc:
        raise SystemExit(f"soup: {exc}") from None
    configs = [json.loads((f / "adapter_config.json").read_text()) for f in folders]
    for f, c in zip(folders[1:], configs[1:]):
        for key in ("r", "lora_alpha", "use_rslora", "use_dora"):
            if c.get(key) != configs[0].get(key):
                raise SystemExit(f"{f}: adapter_config {key}={c.get(key)!r}, {folders[0]} has {configs[0].get(key)!r}")
        if set(c["target_modules"]) != set(configs[0]["target_modules"]):
            raise SystemExit(f"{f}: other target_modules than {folders[0]}")
    weights = [load_file(str(f / "adapter_model.safetensors")) for f in folders]
    keys = set(weights[0])
    for f, w in zip(folders[1:], weights[1:]):
        if set(w) != keys:
            raise SystemExit(f"{f}: other adapter tensors than {folders[0]}: {sorted(set(w) ^ keys)[:3]}")
    n, out = len(folders), Path(args.out)
    merged = {}
    for k in sorted(keys):
        if ".lora_A." in k:
            merged[k] = torch.cat([w[k].float() for w in weights], 0)
        elif ".lora_B." in k:
            merged[k] = torch.cat([w[k].float() / n for w in weights], 1)
        else:
            raise SystemExit(f"{folders[0]}: tensor {k} is neither lora_A nor lora_B (modules_to_save is not supported)")
        merged[k] = merged[k].to(torch.bfloat16).contiguous()
    shutil.copytree(folders[0], out, dirs_exist_ok=True)
    save_file(merged, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {**configs[0], "r": n * configs[0]["r"], "lora_alpha": n * configs[0]["lora_alpha"]}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    for stale in ("decision_head.safetensors", "MODEL_CARD.md", "card.json", "train_state.json"):  # the first model's
        (out / stale).unlink(missing_ok=True)
    settings = json.loads((out / "clarifier.json").read_text())
    for key in ("decision_head", "threshold", "calibration"):
        settings.pop(key, None)
    settings["soup"] = {"models": args.models, "rank": config["r"]}
    (out / "clarifier.json").write_text(json.dumps(settings, indent=2))
    print(f"[soup] {n} adapters -> {out} (rank {config['r']}, {sum(v.numel() for v in merged.values()):,} parameters, "
          "no decision head: refit it with head_refit.py)")


if __name__ == "__main__":
    main()
