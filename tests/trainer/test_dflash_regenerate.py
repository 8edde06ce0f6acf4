"""python -m examples.dflash_trainer.regenerate: the target's own responses from request threads,
resumable after a kill with no record lost or written twice, one line for a prompt file it cannot use."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.dflash_trainer.regenerate import __main__ as regen
from examples.dflash_trainer.errors import EXIT_BAD_INPUT
from examples.dflash_trainer.regenerate.io import Prompt, read_prompts

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
            "--max-new-tokens", "12", "--devices", "cpu"]
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
                              progress=False, max_new_tokens=12)
    assert counts["before"] == before.count(b"\n") and counts["records"] == PROMPTS
    assert counts["generated"] == PROMPTS - counts["before"]
    assert out.read_bytes().startswith(before)  # what was written before the kill is kept as it was
    records = _records(out)
    assert sorted(r["index"] for r in records) == list(range(PROMPTS))  # each once
    # greedy: the resumed run wrote what one uninterrupted run writes
    whole = tmp_path / "whole.jsonl"
    regen.regenerate(str(tiny_assets.target_dir), str(prompts), str(whole), threads=2, devices=["cpu"], progress=False,
                     max_new_tokens=12)
    assert sorted(records, key=lambda r: r["index"]) == sorted(_records(whole), key=lambda r: r["index"])
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
])
def test_a_prompt_file_it_cannot_use_is_one_line_and_exit_2(tiny_assets, tmp_path, capsys, content, said):
    path = tmp_path / ("nowhere.jsonl" if content is None else "p.jsonl")
    if content is not None:
        path.write_bytes(content)
    code = regen.main(["--target", str(tiny_assets.target_dir), "--data", str(path), "--out",
                       str(tmp_path / "out.jsonl"), "--devices", "cpu", "--no-progress"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == EXIT_BAD_INPUT and last.startswith("error: ") and re.search(said, last), last


def test_an_output_of_other_prompts_is_refused(tiny_assets, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"index": 0, "prompt": "something else", "response": "x"}) + "\n")
    code = regen.main(["--target", str(tiny_assets.target_dir), "--data", str(_prompts(tmp_path / "p.jsonl", 2)),
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


def test_the_static_cache_of_a_compiled_run_generates_what_the_eager_path_does(tiny_assets, tmp_path):
    """The GPU path's generate() arguments (the thread's own StaticCache, reset and reused by every
    request, the reduce-overhead compile config), run here on the CPU, where transformers does not
    compile: the same greedy records."""
    import queue

    from examples.dflash_trainer.regenerate.io import Output
    from examples.dflash_trainer.target import TargetModel

    prompts_file = _prompts(tmp_path / "p.jsonl", 4)
    eager = tmp_path / "eager.jsonl"
    regen.regenerate(str(tiny_assets.target_dir), str(prompts_file), str(eager), threads=1, devices=["cpu"],
                     progress=False, max_new_tokens=10)
    target = TargetModel.from_pretrained(tiny_assets.target_dir, num_feature_layers=1, device="cpu")
    prompts = read_prompts(prompts_file)
    longest = max(len(regen.render(target.tokenizer, p, "keep")) for p in prompts)
    work = queue.Queue()
    for p in prompts:
        work.put(p.index)
    static = tmp_path / "static.jsonl"
    output = Output(static, prompts)
    worker = regen.RequestWorker(0, "cpu", model=target.model, tokenizer=target.tokenizer, prompts=prompts, work=work,
                                 output=output, settings=regen.Settings(max_new_tokens=10, compiled=True,
                                                                        max_cache_len=longest + 10), progress=None)
    worker.setup()
    while not worker.stopping:  # the worker's own steps, in this thread
        worker.step()
    output.close()
    assert _records(static) == _records(eager)


@pytest.mark.gpu
def test_request_threads_regenerate_with_reduce_overhead_decoding_on_a_gpu(tiny_assets, tmp_path):
    prompts, out = _prompts(tmp_path / "p.jsonl", 12), tmp_path / "out.jsonl"
    counts = regen.regenerate(str(tiny_assets.target_dir), str(prompts), str(out), threads=3, devices=["cuda:0"],
                              compile="reduce-overhead", progress=False, max_new_tokens=16)
    assert counts["generated"] == 12 and counts["tokens"] > 0
    assert sorted(r["index"] for r in _records(out)) == list(range(12))
    again = regen.regenerate(str(tiny_assets.target_dir), str(prompts), str(out), threads=3, devices=["cuda:0"],
                             compile="reduce-overhead", progress=False, max_new_tokens=16)
    assert again["generated"] == 0 and again["before"] == 12


def test_the_cache_goes_to_generate_under_the_keyword_the_model_takes():
    class Recent:
        def forward(self, input_ids, attention_mask=None, cache=None, **kwargs):
            pass

    class Earlier:  # transformers releases whose models take the cache as past_key_values (5.17, say)
        def forward(self, input_ids, attention_mask=None, past_key_values=None, **kwargs):
            pass

    assert regen.cache_keyword(Recent()) == "cache"
    assert regen.cache_keyword(Earlier()) == "past_key_values"
