"""The embedded default assets: a real build with BuildSpec.tiny() (the session's tiny_assets), and
the cache's handling of builds (leftovers, kills, failures, concurrent callers) with a stand-in build."""

import dataclasses
import json
import threading

import pytest

from examples.dflash_trainer.assets import assets as A
from examples.dflash_trainer.assets import assets_build as B

SPEC = A.BuildSpec.tiny()


class _Killed(BaseException):
    """Stands in for a kill mid-build (a BaseException, like KeyboardInterrupt)."""


@pytest.fixture
def built(tiny_assets):
    """(cache root, assets) of the real tiny build; tests read it and never rebuild it."""
    return tiny_assets.root.parent, tiny_assets


def _entries(root):
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


def test_layout_and_stale_leftovers_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "build", _fake_build([]))
    a = A.default_assets(tmp_path, spec=SPEC)
    assert a.root.parent == tmp_path and a.root.name.endswith(A.ASSETS_VERSION)
    # What a SIGKILLed earlier build leaves behind; the next build must remove it.
    (tmp_path / f".{a.root.name}.tmp-1-deadbeef" / "target").mkdir(parents=True)
    assert A.default_assets(tmp_path, force=True, spec=SPEC) == a
    assert _entries(tmp_path) == [a.root.name]


def test_tokenizer_and_target_reload_offline(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, a = built
    tok = AutoTokenizer.from_pretrained(a.target_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(a.target_dir, local_files_only=True)
    report = a.load_report()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert len(tok) == report["tokenizer_vocab"]
    assert tok.eos_token == B.EOS_TOKEN and tok.pad_token == B.PAD_TOKEN
    assert model.config.eos_token_id == tok.eos_token_id
    # The mask token is an existing embedding row that no token uses.
    assert model.config.vocab_size % 64 == 0
    assert len(tok) <= report["mask_token_id"] < model.config.vocab_size
    assert model.config.hidden_size == SPEC.hidden_size
    ids = tok("def f(x):\n    return x\n")["input_ids"]
    assert tok.decode(ids) == "def f(x):\n    return x\n"


def test_target_learned(built):
    report = built[1].load_report()
    assert report["heldout_loss_after"] < report["heldout_loss_before"] - SPEC.min_loss_drop
    assert report["spec"] == dataclasses.asdict(SPEC)
    assert set(report["timings"]) >= {"corpus_s", "tokenizer_s", "target_train_s",
                                      "generate_s", "total_s"}


def test_jsonl_files_valid(built):
    _, a = built
    vocab = a.load_report()["tokenizer_vocab"]
    rows = [json.loads(line) for line in a.train_jsonl.read_text().splitlines()]
    assert len(rows) == SPEC.num_samples
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(ids) == len(mask)
        assert mask[: SPEC.prompt_len] == [0] * SPEC.prompt_len
        assert 1 <= sum(mask) <= SPEC.new_tokens
        assert mask[SPEC.prompt_len:] == [1] * (len(mask) - SPEC.prompt_len)
        assert all(0 <= i < vocab for i in ids)
    prompts = [json.loads(line) for line in a.eval_jsonl.read_text().splitlines()]
    assert len(prompts) == SPEC.num_eval_prompts
    assert all(len(p["input_ids"]) == SPEC.prompt_len for p in prompts)


def test_second_call_is_cache_hit(built, monkeypatch):
    root, a = built

    def no_build(*args, **kwargs):
        raise AssertionError("a complete cache must not be rebuilt")

    monkeypatch.setattr(B, "build", no_build)
    assert A.default_assets(root, spec=SPEC) == a


def _half_build(error):
    def build(out, spec):
        (out / B.TRAIN_FILE).write_text('{"input_ids": [1, 2')  # half a file, then the failure
        raise error
    return build


def test_killed_build_leaves_no_partial_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "build", _half_build(_Killed("simulated kill while generating data")))
    with pytest.raises(_Killed):
        A.default_assets(tmp_path, spec=SPEC)
    assert _entries(tmp_path) == []


def test_failed_forced_rebuild_keeps_old_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "build", _fake_build([]))
    a = A.default_assets(tmp_path, spec=SPEC)
    before = a.report.read_bytes()
    monkeypatch.setattr(B, "build", _half_build(RuntimeError("training broke")))
    with pytest.raises(RuntimeError, match="training broke"):
        A.default_assets(tmp_path, force=True, spec=SPEC)
    assert a.report.read_bytes() == before
    assert _entries(tmp_path) == [a.root.name]

    def no_build(*args, **kwargs):
        raise AssertionError("the old cache must still count as complete")

    monkeypatch.setattr(B, "build", no_build)
    assert A.default_assets(tmp_path, spec=SPEC) == a


def _fake_build(calls, gate=None):
    def build(out, spec):
        calls.append(out)
        if gate is not None:
            assert gate.wait(timeout=10), "second caller never arrived"
        target = out / B.TARGET_DIR
        target.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (target / name).write_text("{}")
        for name in (B.TRAIN_FILE, B.EVAL_FILE):
            (out / name).write_text("")
        (out / B.REPORT_FILE).write_text(json.dumps({"spec": dataclasses.asdict(spec)}))
    return build


@pytest.mark.timeout(30)
def test_default_location_and_concurrent_callers_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv(A.CACHE_ENV, str(tmp_path / "tg"))
    assert A.default_cache_root() == tmp_path / "tg"
    calls = []
    started = threading.Barrier(2, timeout=10)
    monkeypatch.setattr(B, "build", _fake_build(calls))
    results, errors = [], []

    def call():
        try:
            started.wait()
            results.append(A.default_assets())
        except BaseException as e:  # surfaced below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=call, name=f"caller-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
        assert not t.is_alive(), "default_assets deadlocked"
    assert not errors, errors
    assert len(calls) == 1
    assert results[0] == results[1]
    assert results[0].root == tmp_path / "tg" / f"dflash-default-{A.ASSETS_VERSION}"


def test_cache_root_from_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(A.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert A.default_cache_root() == tmp_path / "threadgraph"


def test_spec_mismatch_rebuilds(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(B, "build", _fake_build(calls))
    a = A.default_assets(tmp_path, spec=SPEC)
    a.report.write_text(json.dumps({"spec": {"stale": True}}))
    A.default_assets(tmp_path, spec=SPEC)
    assert len(calls) == 2


def test_spec_validation_says_what_is_wrong():
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(SPEC, num_heads=3, num_kv_heads=2).validate()
    with pytest.raises(ValueError, match="vocab_size"):
        A.default_assets("/nonexistent", spec=dataclasses.replace(SPEC, vocab_size=100))
