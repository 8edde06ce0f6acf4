"""FlatGrads: gradients as views of one buffer, which every backward fills in place."""

import pytest
import torch

from examples.dflash_trainer.drafter.grads import FlatGrads, make_optimizer


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _loss(model, x):
    return model(x).square().sum()


def test_backward_fills_the_flat_buffer_like_fresh_gradients():
    x = torch.randn(5, 4)
    reference = _model()
    _loss(reference, x).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])

    model = _model()
    flat = FlatGrads(list(model.parameters()), extras=2)
    for _ in range(3):  # zeroed each time: no accumulation across steps
        flat.zero_()
        _loss(model, x).backward()
    assert torch.allclose(flat.grads, expected)
    assert torch.equal(flat.extras, torch.zeros(2))
    flat.grads.fill_(3.0)  # the parameters' gradients are views into the one flat buffer
    assert all(bool((p.grad == 3.0).all()) for p in model.parameters())


def test_clip_matches_clip_grad_norm():
    x = torch.randn(5, 4) * 10
    reference, model = _model(), _model()
    _loss(reference, x).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    flat = FlatGrads(list(model.parameters()), extras=0)
    flat.zero_()
    _loss(model, x).backward()
    norm = flat.clip_(0.5)
    assert norm.item() == pytest.approx(expected_norm.item(), rel=1e-6)
    assert torch.allclose(flat.grads, torch.cat([p.grad.reshape(-1) for p in reference.parameters()]), atol=1e-7)
    assert torch.linalg.vector_norm(flat.grads).item() == pytest.approx(0.5, rel=1e-4)


def test_a_replaced_gradient_is_a_clear_error():
    model = _model()
    params = list(model.parameters())
    flat = FlatGrads(params, extras=0)
    optimizer = make_optimizer(params, lr=1e-3, weight_decay=0.0)
    optimizer.zero_grad(set_to_none=True)
    _loss(model, torch.randn(2, 4)).backward()  # autograd now allocates fresh gradients
    with pytest.raises(RuntimeError, match="not its view of the flat buffer"):
        flat.zero_()


def test_parameters_of_mixed_dtypes_are_refused():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one dtype and device"):
        FlatGrads(params, extras=0)


def test_optimizer_steps_on_the_views():
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    flat = FlatGrads(params, extras=0)
    optimizer = make_optimizer(params, lr=1e-2, weight_decay=0.0)
    flat.zero_()
    _loss(model, torch.randn(3, 4)).backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params))
    flat.zero_()  # the optimizer left the views in place


def test_update_clips_steps_and_records_rows_like_the_eager_recipe():
    from examples.dflash_trainer.drafter.step import make_update

    x = torch.randn(5, 4) * 5
    reference, model = _model(), _model()
    ref_opt = make_optimizer(list(reference.parameters()), lr=1e-2, weight_decay=0.1)
    params = list(model.parameters())
    flat = FlatGrads(params, extras=2)
    opt = make_optimizer(params, lr=1e-2, weight_decay=0.1)
    history = torch.zeros(6, 3)
    update = make_update(flat, opt, history, max_norm=0.5, first_step=2)
    for step in range(2):
        ref_opt.zero_grad()
        _loss(reference, x).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        flat.zero_()
        _loss(model, x).backward()
        flat.extras.copy_(torch.tensor([step, 10.0 + step]))
        update()
        assert history[2 + step].tolist() == pytest.approx([step, 10.0 + step, ref_norm.item()], rel=1e-5)
    for p, q in zip(reference.parameters(), params):
        assert torch.allclose(p, q, atol=1e-6)
    assert torch.equal(history[:2], torch.zeros(2, 3)) and torch.equal(history[4:], torch.zeros(2, 3))


def test_a_captured_update_keeps_its_learning_rate_a_tensor():
    from examples.dflash_trainer.drafter.step import make_update

    params = list(_model().parameters())
    flat = FlatGrads(params, extras=0)
    opt = make_optimizer(params, lr=1e-2, weight_decay=0.0)
    opt.param_groups[0]["capturable"] = True  # as a checkpoint of an uncaptured run restores it: a float lr
    update = make_update(flat, opt, torch.zeros(3, 1), max_norm=1.0, first_step=0)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(1e-2)
    restored = torch.tensor(3e-3)  # torch.load(map_location="cpu") of a captured run's checkpoint
    opt.param_groups[0]["lr"] = restored
    make_update(flat, opt, torch.zeros(3, 1), max_norm=1.0, first_step=0)
    lr = opt.param_groups[0]["lr"]
    assert lr is not restored and lr.item() == pytest.approx(3e-3)  # a fresh tensor on the history's device
    opt.param_groups[0]["lr"] = 5e-3  # what an old scheduler does to a tensor lr
    with pytest.raises(RuntimeError, match="would ignore the schedule"):
        update()
