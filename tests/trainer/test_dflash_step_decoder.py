"""regenerate/step.py: the step decoder, whose rows each write at their own cache slot, so a row
that ended takes the next prompt while the others go on; each prompt's response must not depend on
which row, beside which others, or after which earlier prompt it was decoded."""

import pytest
import torch

from examples.dflash_trainer.regenerate.decode import Batch, GenerateDecoder
from examples.dflash_trainer.regenerate.sampling import Sampler
from examples.dflash_trainer.regenerate.step import StepDecoder

CPU = torch.device("cpu")
STOPS = frozenset({3, 11, 17, 29, 41})  # tokens this random target picks now and then: rows end apart


@pytest.fixture
def model():  # a fresh one per test: the step decoder sets its attention to its own
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def _prompts(count):
    generator = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(1, 50, (int(torch.randint(2, 9, (1,), generator=generator)),),
                                generator=generator).tolist()) for _ in range(count)]


def _decoder(model, cls=StepDecoder, batch_size=1, sampler=None, max_cache_len=40):
    decoder = cls(model, stops=STOPS, pad_id=0, sampler=sampler or Sampler(), batch_size=batch_size,
                  max_cache_len=max_cache_len, device=CPU, accelerated=False)
    decoder.setup()
    return decoder


def _decode_all(decoder, batches):
    pending = list(batches)
    out, tokens = {}, 0
    while (advanced := decoder.advance(lambda: pending.pop(0) if pending else None)) is not None:
        assert not set(out) & {index for index, _ in advanced.finished}  # each prompt answered once
        out.update(advanced.finished)
        tokens += advanced.tokens
    assert tokens == sum(len(r.tokens) for r in out.values())  # the tokens reported are the records'
    return out


def _batches(prompts, size, limit=24):
    return [Batch(tuple(range(i, min(i + size, len(prompts)))), tuple(prompts[i:i + size]), limit)
            for i in range(0, len(prompts), size)]


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=0.9, seed=5)], ids=["greedy", "sampled"])
def test_rows_refilled_mid_batch_give_each_prompt_its_batch_1_response(model, sampler):
    prompts = _prompts(24)
    alone = _decode_all(_decoder(model, sampler=sampler, max_cache_len=48), _batches(prompts, 1, limit=40))
    lengths = {len(r.tokens) for r in alone.values()}
    assert len(lengths) >= 4 and any(r.stopped for r in alone.values())  # rows end at different tokens
    batched = _decoder(model, batch_size=4, sampler=sampler, max_cache_len=48)
    assert _decode_all(batched, _batches(prompts, 4, limit=40)) == alone
    assert batched.refilled > 0  # some rows took a prompt while others were mid-response


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_step_decoder_answers_as_transformers_generate_does(model, family):
    """Its masks reach the attention of model families whose forward builds masks its own way."""
    model = _llama() if family == "llama" else model
    prompts = _prompts(8)
    reference = _decode_all(_decoder(model, cls=GenerateDecoder), _batches(prompts, 1))
    assert _decode_all(_decoder(model, batch_size=3), _batches(prompts, 3)) == reference


def test_limits_of_one_token_and_of_the_whole_cache_are_kept(model):
    prompts = _prompts(5)
    short = _decode_all(_decoder(model, batch_size=2), _batches(prompts, 2, limit=1))
    assert all(len(r.tokens) == 1 for r in short.values()) and len(short) == 5
    longest = max(len(p) for p in prompts)
    full = _decode_all(_decoder(model, batch_size=2, max_cache_len=longest + 30), _batches(prompts, 2, limit=30))
    assert all(len(r.tokens) <= 30 and (r.stopped or len(r.tokens) == 30) for r in full.values())
    with pytest.raises(RuntimeError, match="do not fit the cache's 20 slots"):
        _decode_all(_decoder(model, batch_size=2, max_cache_len=20), _batches(prompts, 2, limit=30))


def test_a_target_with_sliding_window_layers_is_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1)
    assert "sliding_attention" in config.layer_types
    with pytest.raises(ValueError, match="has sliding-window layers: use --decode generate"):
        _decoder(Qwen3ForCausalLM(config).eval())


def test_a_padded_prefill_leaves_no_nan_in_the_cache(model):
    """A left-padding token sees only itself: were its row of scores all masked, its output (and the
    next layer's keys and values there) would be NaN, and every later token of the row with it."""
    decoder = _decoder(model, batch_size=2)
    out = _decode_all(decoder, [Batch((0, 1), ((5, 6), (7, 8, 9, 10, 11)), 4)])
    assert all(bool(torch.isfinite(t).all()) for t in [*decoder.cache.keys.values(), *decoder.cache.values.values()])
    assert _decode_all(_decoder(model), [Batch((0,), ((5, 6),), 4)])[0] == out[0]  # padding changed nothing


@pytest.mark.gpu
def test_on_a_gpu_the_captured_step_refills_rows_as_the_uncaptured_one_does(model):
    """The captured step (one graph replay per token, with each row's write slot an input of the graph)
    against the same decoder run eagerly on the same GPU, rows refilled mid-batch in both."""
    model = model.to("cuda")
    prompts = _prompts(24)
    results = []
    for accelerated in (False, True):
        decoder = StepDecoder(model, stops=STOPS, pad_id=0, sampler=Sampler(), batch_size=4, max_cache_len=48,
                              device=torch.device("cuda"), accelerated=accelerated)
        decoder.setup()
        results.append(_decode_all(decoder, _batches(prompts, 4, limit=40)))
        assert decoder.refilled > 0
    assert results[0] == results[1]
