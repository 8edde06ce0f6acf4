"""--config FILE (TOML or YAML, keys = the flags) and the settings a run saves in its directory,
which --resume reads again."""

import json
import re

import pytest

from examples.dflash_trainer import __main__ as cli
from examples.dflash_trainer.errors import EXIT_BAD_INPUT
from examples.dflash_trainer.run import config_file

from tests.helpers.tiny_run import TINY

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def quiet_cli(monkeypatch):
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr


def _toml(path, values):
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return path


def test_toml_and_yaml_files_give_the_flags_and_the_command_line_wins(tmp_path):
    toml = _toml(tmp_path / "run.toml", {"seq-len": 48, "reasoning": "keep", "no_data_cache": True})
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("seq-len: 48\nreasoning: keep\nno_data_cache: true\n")
    for path in (toml, yaml_file):
        args, explicit = cli.parse_flags(["--config", str(path), "--reasoning", "drop"])
        assert (args["seq_len"], args["reasoning"], args["no_data_cache"]) == (48, "drop", True)
        assert {"seq_len", "reasoning", "no_data_cache"} <= explicit  # a --preset leaves them as given


@pytest.mark.parametrize("text, suffix, said", [
    ("seq_len = 48\nwarp = 9\n", ".toml", r"'warp' is not a flag of the trainer; valid keys: "),
    ("seq_len = = 48\n", ".toml", r"is not valid TOML \(TOMLDecodeError"),
    ("- a\n- b\n", ".yaml", r"must hold a table of flags \(key = value\), not list"),
    ("seq_len: 48\n", ".json", r"unknown format .json; name it .toml, .yaml or .yml"),
])
def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path, capsys, text, suffix, said):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    assert cli.main(["--config", str(path)]) == EXIT_BAD_INPUT
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --config ") and re.search(said, last), last


def test_a_run_saves_its_settings_and_resume_reads_them_again(tiny_assets, tmp_path, quiet_cli, capfd):
    out = tmp_path / "run"
    # seq_len and lr differ from the defaults: a resume that did not read them would be refused
    settings = dict(TINY, target=str(tiny_assets.target_dir), data=str(tiny_assets.train_jsonl), out_dir=str(out),
                    max_steps=4, checkpoint_every=2, lr=2e-3, data_cache=str(tmp_path / "cache"))
    path = _toml(tmp_path / "run.toml", {k.replace("_", "-"): v for k, v in settings.items()})
    assert cli.main(["--config", str(path), "--eval-every", "0"]) == 0  # a flag beside the file is saved too
    saved = config_file.load(out / config_file.SAVED)
    assert saved["lr"] == 2e-3 and saved["max_steps"] == 4 and saved["eval_every"] == 0 and "resume" not in saved
    (out / "checkpoints" / "latest").write_text("step_00000002\n")  # as if stopped after its step-2 checkpoint
    capfd.readouterr()
    assert cli.main(["--out-dir", str(out), "--resume", "--json"]) == 0
    captured = capfd.readouterr()
    assert f"using the settings saved in {out / config_file.SAVED}" in captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["start_step"] == 2 and result["total_steps"] == 4
