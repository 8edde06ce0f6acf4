"""regenerate/sampling.py: the next token, greedy or sampled with counter-based noise, checked
against plain reference computations."""

import torch

from examples.dflash_trainer.regenerate.sampling import Sampler, uniform_noise


def test_noise_depends_on_seed_row_step_and_token_alone():
    rows, steps = torch.tensor([5, 9, 5]), torch.tensor([0, 0, 3])
    noise = uniform_noise(11, rows, steps, 50)
    assert noise.shape == (3, 50) and bool(((noise > 0) & (noise < 1)).all())
    alone = uniform_noise(11, torch.tensor([9]), torch.tensor([0]), 50)
    assert torch.equal(noise[1], alone[0])  # the batch around a row changes nothing
    assert not torch.equal(noise[0], noise[2])  # another step, other draws
    assert not torch.equal(noise, uniform_noise(12, rows, steps, 50))


def test_noise_is_uniform_enough():
    noise = uniform_noise(0, torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert abs(noise.mean().item() - 0.5) < 0.01 and abs(noise.var().item() - 1 / 12) < 0.005


def test_greedy_is_the_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler()(logits, torch.arange(4), torch.zeros(4, dtype=torch.long)), logits.argmax(-1))


def test_sampled_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = Sampler(temperature=0.8, seed=3)
    draws = torch.cat([sampler(logits, torch.tensor([r]), torch.tensor([0])) for r in range(6000)])
    frequency = torch.bincount(draws, minlength=4).float() / len(draws)
    assert torch.allclose(frequency, (logits[0] / 0.8).softmax(-1), atol=0.02), frequency


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(temperature=1.0, top_p=0.75, seed=1)
    draws = {int(sampler(logits, torch.tensor([r]), torch.tensor([0]))) for r in range(500)}
    assert draws == {0, 1}  # 0.5 alone is below 0.75; with 0.3 the set reaches it


def test_grouped_attention_is_sdpas_and_a_padding_row_stays_finite():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from examples.dflash_trainer.regenerate.attention import grouped_attention

    class Module:
        is_causal, num_key_value_groups, training = True, 2, False

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 5, 8, generator=g), torch.randn(3, 2, 7, 8, generator=g), torch.randn(3, 2, 7, 8, generator=g)
    mask = torch.rand(3, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True
    ours, _ = grouped_attention(Module(), q, k, v, mask, scaling=0.3)
    reference, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.3)
    assert torch.allclose(ours, reference, atol=1e-5)
