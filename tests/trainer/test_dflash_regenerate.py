"""python -m examples.dflash_trainer.regenerate: the target's own responses, decoded in batches by
request threads; records in prompt-index order whatever the decoder, thread count or batch size,
resumable after a kill with no record lost or written twice, one writer per --out, one line for a
prompt file it cannot use."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from examples.dflash_trainer.errors import EXIT_BAD_INPUT
from examples.dflash_trainer.regenerate import __main__ as cli
from examples.dflash_trainer.regenerate import run as regen
from examples.dflash_trainer.regenerate.decode import cache_keyword
from examples.dflash_trainer.regenerate.io import Output, Prompt, read_prompts

from tests.helpers.chat_tokenizer import qwen3_style_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = 40
pytestmark = pytest.mark.timeout(400)


def _prompts(path, n=PROMPTS):
    lines = []
    for i in range(n):
        if i % 4 == 0:  # a conversation whose last assistant turn is generated again
            lines.append({"messages": [{"role": "user", "content": f"def f{i}(x):"},
                                       {"role": "assistant", "content": "stale"}]})
        else:
            lines.append({"prompt": f"import os\nclass A{i}:", "response": "stale"})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _complete_lines(path):
    data = path.read_bytes() if path.exists() else b""
    return data[:data.rfind(b"\n") + 1]


def test_a_killed_run_continues_with_no_record_lost_or_repeated(tiny_assets, tmp_path):
    prompts = _prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "out.jsonl"
    argv = ["--target", str(tiny_assets.target_dir), "--data", str(prompts), "--out", str(out), "--threads", "3",
            "--batch-size", "2", "--max-new-tokens", "12", "--devices", "cpu"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    proc = subprocess.Popen([sys.executable, "-m", "examples.dflash_trainer.regenerate", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while _complete_lines(out).count(b"\n") < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a file another process writes
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    before = _complete_lines(out)
    assert 5 <= before.count(b"\n") < PROMPTS, stderr[-2000:]
    with open(out, "ab") as f:
        f.write(b'{"index": 39, "prompt": "import os\\nclass A3')  # what a kill mid-write leaves
    counts = regen.regenerate(str(tiny_assets.target_dir), str(prompts), str(out), threads=3, devices=["cpu"],
                              progress=False, max_new_tokens=12, batch_size=2)
    assert counts["before"] == before.count(b"\n") and counts["records"] == PROMPTS
    assert counts["generated"] == PROMPTS - counts["before"]
    assert out.read_bytes().startswith(before)  # what was written before the kill is kept as it was
    records = _records(out)
    assert [r["index"] for r in records] == list(range(PROMPTS))  # each once, in index order
    # greedy: the resumed run wrote what one uninterrupted run writes, byte for byte
    whole = tmp_path / "whole.jsonl"
    regen.regenerate(str(tiny_assets.target_dir), str(prompts), str(whole), threads=2, devices=["cpu"], progress=False,
                     max_new_tokens=12, batch_size=4)
    assert out.read_bytes() == whole.read_bytes()
    assert all(r["tokens"] > 0 and "stale" not in json.dumps(r) for r in records)
    source = read_prompts(prompts)
    assert all(source[r["index"]].matches(r) for r in records)


@pytest.mark.parametrize("content, said", [
    (None, r"prompt file .*nowhere.jsonl does not exist"),
    (b"", r"holds no prompts \(it is empty or blank\)"),
    (b'{"prompt": "a"}\n{"prompt": \n', r"p.jsonl:2: invalid JSON"),
    (b'{"prompt": "a"}\n{"text": "b"}\n', r"p.jsonl:2: no 'prompt' string or 'messages' list \(keys \['text'\]\)"),
    (b'{"messages": [{"role": "assistant", "content": "x"}]}\n', r"holds no turn before the one to generate"),
    (b'{"prompt": "a"}\n{"prompt": "\xff"}\n', r"is not UTF-8 text \(line 2, byte 28 of the file\)"),
    (b'{"prompt": "a"}\n{"prompt": "x\\ud800y"}\n', r"p.jsonl:2: holds a lone surrogate escape"),
])
def test_a_prompt_file_it_cannot_use_is_one_line_and_exit_2(tiny_assets, tmp_path, capsys, content, said):
    path = tmp_path / ("nowhere.jsonl" if content is None else "p.jsonl")
    if content is not None:
        path.write_bytes(content)
    code = cli.main(["--target", str(tiny_assets.target_dir), "--data", str(path), "--out",
                       str(tmp_path / "out.jsonl"), "--devices", "cpu", "--no-progress"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == EXIT_BAD_INPUT and last.startswith("error: ") and re.search(said, last), last


def test_an_output_of_other_prompts_is_refused(tiny_assets, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"index": 0, "prompt": "something else", "response": "x"}) + "\n")
    code = cli.main(["--target", str(tiny_assets.target_dir), "--data", str(_prompts(tmp_path / "p.jsonl", 2)),
                       "--out", str(out), "--devices", "cpu", "--no-progress"])
    assert code == EXIT_BAD_INPUT
    assert "holds record 0 of another prompt file" in capsys.readouterr().err.strip().splitlines()[-1]


def test_reasoning_drop_turns_thinking_off_and_cuts_a_think_block():
    tokenizer = qwen3_style_tokenizer()
    prompt = Prompt(0, ({"role": "user", "content": "What is two plus two?"},), as_prompt=True)
    kept = tokenizer.decode(regen.render(tokenizer, prompt, "keep"))
    dropped = tokenizer.decode(regen.render(tokenizer, prompt, "drop"))
    assert kept.endswith("<|im_start|>assistant\n")
    assert dropped.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.encode("<think>\nsum\n</think>\n\nfour<|im_end|>more", add_special_tokens=False)
    assert regen.response_text(tokenizer, ids, "keep") == "<think>\nsum\n</think>\n\nfour"
    assert regen.response_text(tokenizer, ids, "drop") == "four"


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["step", "generate", "continuous"])
def test_request_threads_regenerate_in_batches_on_a_gpu(tiny_assets, tmp_path, decode):
    prompts, out = _prompts(tmp_path / "p.jsonl", 12), tmp_path / "out.jsonl"
    counts = regen.regenerate(str(tiny_assets.target_dir), str(prompts), str(out), threads=3, devices=["cuda:0"],
                              decode=decode, batch_size=4, progress=False, max_new_tokens=16)
    assert counts["generated"] == 12 and counts["tokens"] > 0
    assert [r["index"] for r in _records(out)] == list(range(12))
    again = regen.regenerate(str(tiny_assets.target_dir), str(prompts), str(out), threads=3, devices=["cuda:0"],
                             decode=decode, batch_size=4, progress=False, max_new_tokens=16)
    assert again["generated"] == 0 and again["before"] == 12


def test_the_cache_goes_to_generate_under_the_keyword_the_model_takes():
    class Recent:
        def forward(self, input_ids, attention_mask=None, cache=None, **kwargs):
            pass

    class Earlier:  # transformers releases whose models take the cache as past_key_values (5.17, say)
        def forward(self, input_ids, attention_mask=None, past_key_values=None, **kwargs):
            pass

    assert cache_keyword(Recent()) == "cache"
    assert cache_keyword(Earlier()) == "past_key_values"


def _run(tiny_assets, prompts, out, **kwargs):
    kwargs = {"threads": 1, "devices": ["cpu"], "progress": False, "max_new_tokens": 10, **kwargs}
    return regen.regenerate(str(tiny_assets.target_dir), str(prompts), str(out), **kwargs)


@pytest.mark.parametrize("decode, threads, batch_size", [
    ("generate", 1, 4), ("generate", 3, 2), ("step", 1, 5), ("step", 2, 3), ("continuous", 1, 4), ("continuous", 2, 3)])
def test_batched_greedy_records_equal_the_batch_1_ones_in_index_order(tiny_assets, tmp_path, decode, threads, batch_size):
    prompts = _prompts(tmp_path / "p.jsonl", 10)
    one = tmp_path / "one.jsonl"
    _run(tiny_assets, prompts, one, batch_size=1, decode="generate")
    batched = tmp_path / "batched.jsonl"
    counts = _run(tiny_assets, prompts, batched, threads=threads, batch_size=batch_size, decode=decode)
    assert counts["generated"] == 10 and counts["decode"] == decode
    assert [r["index"] for r in _records(batched)] == list(range(10))
    assert batched.read_bytes() == one.read_bytes()


def test_sampled_records_depend_on_the_seed_alone_not_on_thread_or_batch(tiny_assets, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 8)
    runs = {}
    for name, kwargs in {"a": {"batch_size": 1, "decode": "generate"}, "b": {"batch_size": 3, "threads": 2,
                                                                            "decode": "generate"},
                         "c": {"batch_size": 4, "decode": "step"}, "d": {"batch_size": 4, "decode": "step", "seed": 1}}.items():
        out = tmp_path / f"{name}.jsonl"
        _run(tiny_assets, prompts, out, temperature=1.5, top_p=0.95, seed=kwargs.pop("seed", 7), **kwargs)
        runs[name] = out.read_bytes()
    greedy = tmp_path / "greedy.jsonl"
    _run(tiny_assets, prompts, greedy, batch_size=4)
    assert runs["a"] == runs["b"] == runs["c"]
    assert runs["d"] != runs["a"] and runs["a"] != greedy.read_bytes()


def test_a_response_cut_by_the_token_limit_says_so(tiny_assets, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 6)
    out = tmp_path / "out.jsonl"
    counts = _run(tiny_assets, prompts, out, batch_size=3, max_new_tokens=3)
    records = _records(out)
    assert all(r["tokens"] == 3 for r in records)
    assert counts["truncated"] == sum(r.get("truncated", False) for r in records) > 0
    # a response that ended by itself within the limit carries no mark: a stop token at its end
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_assets.target_dir))
    longer = tmp_path / "longer.jsonl"
    _run(tiny_assets, prompts, longer, batch_size=3, max_new_tokens=40)
    for record in _records(longer):
        assert record.get("truncated", False) == (record["tokens"] == 40)
    assert tokenizer is not None


def test_a_prompt_longer_than_the_targets_positions_is_skipped_and_counted(tiny_assets, tmp_path, caplog):
    from transformers import AutoConfig

    positions = AutoConfig.from_pretrained(str(tiny_assets.target_dir)).max_position_embeddings
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "import os"}, {"prompt": "x " * (positions + 10)}, {"prompt": "class A:"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out.jsonl"
    with caplog.at_level("WARNING", logger="dflash"):
        counts = _run(tiny_assets, path, out, batch_size=2)
    assert counts["skipped"] == 1 and counts["generated"] == 2
    assert [r["index"] for r in _records(out)] == [0, 2]
    assert "1 prompt(s) skipped, longer than the target's" in caplog.text
    again = _run(tiny_assets, path, out, batch_size=2)  # resumed: the skipped one is skipped again, nothing repeats
    assert again["generated"] == 0 and again["skipped"] == 1 and len(_records(out)) == 2


def test_records_wait_for_the_ones_before_them():
    prompts = [Prompt(i, ({"role": "user", "content": f"p{i}"},), as_prompt=True) for i in range(4)]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "o.jsonl")
        output = Output(out, prompts)
        output.put(prompts[2].record("c", 1))
        output.put(prompts[1].record("b", 1))
        assert out.read_bytes() == b"" and output.waiting == 2
        output.skip(0)
        assert [r["index"] for r in _records(out)] == [1, 2] and output.waiting == 0
        output.put(prompts[3].record("d", 1, truncated=True))
        output.close()
        assert _records(out)[-1] == {"index": 3, "prompt": "p3", "response": "d", "tokens": 1, "truncated": True}


def test_a_second_run_on_the_same_out_is_refused(tiny_assets, tmp_path):
    prompts_file = _prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "out.jsonl"
    holder = Output(out, read_prompts(prompts_file))  # this process is the first run, writing
    try:
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
        proc = subprocess.run([sys.executable, "-m", "examples.dflash_trainer.regenerate", "--target",
                               str(tiny_assets.target_dir), "--data", str(prompts_file), "--out", str(out),
                               "--devices", "cpu", "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    finally:
        holder.close()
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == EXIT_BAD_INPUT
    assert re.fullmatch(r"error: --out .*out\.jsonl is being written by another regeneration run; wait for it to end "
                        r"or pass another --out", last), last
    assert out.read_bytes() == b""


def test_an_unwritable_out_is_exit_2_naming_out(tiny_assets, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = cli.main(["--target", str(tiny_assets.target_dir), "--data", str(_prompts(tmp_path / "p.jsonl", 2)),
                     "--out", str(blocker / "out.jsonl"), "--devices", "cpu", "--no-progress"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == EXIT_BAD_INPUT and last.startswith("error: --out ") and "cannot be written" in last, last


@pytest.mark.parametrize("argv, said", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--decode", "continuous", "--temperature", "0.7"], "--decode continuous is greedy only"),
    (["--temperature", "inf"], "--temperature must be 0 (greedy) or a finite number above, got inf"),
    (["--devices", "gpu"], "--devices 'gpu': 'gpu' is not a cpu or cuda device; pass e.g. cuda:0,cuda:1 or cpu"),
    (["--devices", "cpu,"], "--devices 'cpu,': '' is not a cpu or cuda device"),
    (["--devices", "cuda:99"], "--devices 'cuda:99': cuda:99 is not here"),
])
def test_bad_flags_are_one_line_and_exit_2(tiny_assets, tmp_path, capsys, argv, said):
    code = cli.main(["--target", str(tiny_assets.target_dir), "--data", str(_prompts(tmp_path / "p.jsonl", 2)),
                     "--out", str(tmp_path / "o.jsonl"), "--devices", "cpu", "--no-progress", *argv])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == EXIT_BAD_INPUT and said in last, last


def test_a_byte_order_mark_before_the_first_prompt_is_not_part_of_it(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [p.messages[0]["content"] for p in read_prompts(path)] == ["a", "b"]


def test_an_out_that_is_the_prompt_file_is_refused_and_left_as_it_was(tiny_assets, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "the only prompt"}')  # one line, no newline: it once was cut away as a torn record
    code = cli.main(["--target", str(tiny_assets.target_dir), "--data", str(path), "--out", str(path),
                     "--devices", "cpu", "--no-progress"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == EXIT_BAD_INPUT and re.fullmatch(r"error: --out .*p\.jsonl is the --data prompt file; pass another "
                                                   r"--out", last), last
    assert path.read_bytes() == b'{"prompt": "the only prompt"}'


def test_an_out_ending_in_a_line_no_run_wrote_is_refused_not_cut(tiny_assets, tmp_path, capsys):
    out = tmp_path / "settings.json"
    out.write_bytes(b'{"a": 1}')  # a file of something else, one line with no newline
    code = cli.main(["--target", str(tiny_assets.target_dir), "--data", str(_prompts(tmp_path / "p.jsonl", 2)),
                     "--out", str(out), "--devices", "cpu", "--no-progress"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == EXIT_BAD_INPUT and "ends in a line that is not a record this command writes" in last, last
    assert out.read_bytes() == b'{"a": 1}'


def test_the_summary_counts_the_records_in_the_file_and_the_prompts(tiny_assets, tmp_path, capsys):
    from transformers import AutoConfig

    positions = AutoConfig.from_pretrained(str(tiny_assets.target_dir)).max_position_embeddings
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "import os"}, {"prompt": "x " * (positions + 10)}]))
    out = tmp_path / "out.jsonl"
    code = cli.main(["--target", str(tiny_assets.target_dir), "--data", str(path), "--out", str(out), "--devices",
                     "cpu", "--no-progress", "--max-new-tokens", "4"])
    said = capsys.readouterr().out
    assert code == 0 and len(_records(out)) == 1
    assert said.startswith(f"regenerate: 1 records in {out} for 2 prompts (0 there before, 1 generated now, "), said


def test_a_prompt_near_the_targets_positions_cuts_no_other_rows_response():
    # 512 positions, 8 new tokens: prompts of 5 and 6 tokens may take 8, ones of 508 and 510 only 4 and 2
    lengths = {0: 5, 1: 510, 2: 6, 3: 508}
    got = list(regen.batches([0, 1, 2, 3], lengths, batch_size=4, window=16, positions=512, max_new_tokens=8))
    assert sorted(i for b in got for i in b.rows) == [0, 1, 2, 3]
    assert all(b.max_new == min(8, 512 - lengths[i]) for b in got for i in b.rows)
    assert [b.rows for b in got] == [(0, 2), (3,), (1,)]


def test_a_second_ctrl_c_ends_the_run_at_once_with_exit_130(tiny_assets, tmp_path):
    prompts, out = _prompts(tmp_path / "p.jsonl"), tmp_path / "out.jsonl"
    argv = ["--target", str(tiny_assets.target_dir), "--data", str(prompts), "--out", str(out), "--threads", "2",
            "--batch-size", "2", "--max-new-tokens", "400", "--devices", "cpu", "--no-progress"]  # batches of seconds
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    proc = subprocess.Popen([sys.executable, "-m", "examples.dflash_trainer.regenerate", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not one inherited ignored
    lines: "queue.Queue[str]" = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not _complete_lines(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a file another process writes
    proc.send_signal(signal.SIGINT)  # mid-run: the threads are asked to stop and finish their batches...
    said = []
    while not any("press Ctrl-C again" in line for line in said):  # ...and the run says it waits for them
        try:
            said.append(lines.get(timeout=60))
        except queue.Empty:
            pytest.fail(f"no word of waiting for the request threads in 60 s after a Ctrl-C (exit {proc.poll()}): "
                        + "".join(said)[-2000:])
    proc.send_signal(signal.SIGINT)  # a second Ctrl-C stops that wait: the run ends at once
    assert proc.wait(timeout=120) == 130, "".join(said)
    reader.join(timeout=60)
    stderr = "".join(said) + "".join(lines.queue)
    assert "stopped waiting; request" in stderr, stderr[-2000:]  # the second Ctrl-C ended the wait, not the batches
    assert "terminate called" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (f"stopped: the records generated so far are in {out}; run the same "
                                               f"command again to continue")
