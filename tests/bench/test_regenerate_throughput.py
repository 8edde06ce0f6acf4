"""benchmarks regenerate-throughput: its CPU reduced form end to end (numbers are not checked, only
that each cell measured and stands beside its bound), and the bound's arithmetic."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import regenerate_throughput as bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_reduced_form_measures_every_cell_beside_its_bound(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "regenerate-throughput", "--reduced", "--prompts", "6",
                           "--cells", "generate_batch:1:2,generate:1:2,step:2:1,continuous:1:2", "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = tmp_path.glob("regenerate-throughput_cpu_torch*.json")
    data = json.loads(path.read_text())
    assert data["shape"] == "tiny" and [r["decode"] for r in data["rows"]] == ["generate_batch", "generate", "step",
                                                                               "continuous"]
    for row in data["rows"]:
        assert "error" not in row, row
        assert row["generated"] == 6 and row["tokens"] > 0 and row["startup_s"] > 0
        assert row["bound_tokens_per_s"] > 0 and row["rows_in_flight"] == row["threads"] * row["batch"]
    assert "regeneration, tiny shape" in proc.stdout


def test_the_bound_counts_weights_once_and_each_rows_kv_cache():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    bound = bench.decode_bound(model, rows=4, mean_context=10.0, bandwidth=1e9)
    kv = 2 * 2 * 1 * 8 * 4  # K and V, layers, kv heads, head dim, float32 bytes
    assert bound["kv_bytes_per_token"] == kv and bound["weight_bytes"] == params * 4
    assert bound["bound_tokens_per_s"] == pytest.approx(4 * 1e9 / (params * 4 + 4 * 10.0 * kv))


@pytest.mark.parametrize("cells", ["step:1", "bogus:1:2", "step:0:2"])
def test_a_bad_cell_is_refused_before_any_work(cells, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--cells", cells])
    assert stop.value.code == 2 and "is not decode:threads:batch" in capsys.readouterr().err
