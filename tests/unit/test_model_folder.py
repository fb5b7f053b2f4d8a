"""Where a training run's model lands: a deliberate home, not a temporary folder nobody removes."""

from clarifier.core.config import build_config
from clarifier.train.trainer import model_folder, run_folder


def test_local_storage_keeps_the_model_beside_the_run_and_a_rerun_replaces_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = build_config({}, ["storage.root=store"])
    out = model_folder(cfg, "run123")
    assert out == tmp_path / "store" / "models" / "run123" and out.is_dir()
    (out / "stale.safetensors").write_bytes(b"old")  # a resumed run writes the folder again
    again = model_folder(cfg, "run123")
    assert again == out and not any(again.iterdir())


def test_s3_storage_puts_the_local_copy_in_the_machine_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CLARIFIER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    cfg = build_config({}, ["storage.root=s3://bucket/prefix"])
    out = model_folder(cfg, "run9")
    assert out == tmp_path / "cache" / "trained" / "run9" and out.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no local folder named after the s3 root


def test_a_runs_evaluation_copy_goes_beside_its_model_and_is_left_to_its_writer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = build_config({}, ["storage.root=store"])
    stale = tmp_path / "store" / "eval" / "run123"
    stale.mkdir(parents=True)
    (stale / "report.md").write_text("an earlier attempt's report")
    out = run_folder(cfg, "run123", "eval")
    assert out == stale and not out.exists()  # the report writer creates it; a skipped evaluation leaves nothing
    monkeypatch.setenv("CLARIFIER_CACHE", str(tmp_path / "cache"))
    s3 = build_config({}, ["storage.root=s3://bucket/prefix"])
    assert run_folder(s3, "run9", "eval") == tmp_path / "cache" / "eval" / "run9"
