"""``--dualpipev-dw-detach``: a linear's weight gradient, deferred to a later W step, equals
plain autograd's, and nothing of it reaches the weight before that step."""

from __future__ import annotations

import pytest
import torch

from anyspeed.distributed.dualpipev import weight_grads


def _linear(x, w, b):
    return weight_grads._Linear.apply(x, w, b, False, False, None)


def test_deferred_weight_gradient_equals_autograd():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 8, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(5, 8, generator=g))
    b = torch.nn.Parameter(torch.randn(5, generator=g))
    dy = torch.randn(6, 2, 5, generator=g)
    torch.nn.functional.linear(x, w, b).backward(dy)
    want = (x.grad.clone(), w.grad.clone(), b.grad.clone())
    x.grad = w.grad = b.grad = None
    with weight_grads.split_step():
        with weight_grads.deferred():
            _linear(x, w, b).backward(dy)
        # B is done: the input and bias gradients are there, the weight's is not
        assert w.grad is None
        torch.testing.assert_close(x.grad, want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(b.grad, want[2], rtol=0, atol=1e-6)
        weight_grads.run_weight_unit()
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=1e-6)


def test_main_grad_takes_the_deferred_gradient():
    """Under Megatron's DDP the weight gradient goes to ``main_grad`` (what its hook does)."""
    w = torch.nn.Parameter(torch.randn(3, 4))
    w.main_grad = torch.ones(3, 4)
    x, dy = torch.randn(7, 4), torch.randn(7, 3)
    with weight_grads.split_step():
        with weight_grads.deferred():
            _linear(x, w, None).backward(dy)
        weight_grads.run_weight_unit()
    torch.testing.assert_close(w.main_grad, 1 + dy.t() @ x)
    assert w.grad is None


def test_a_unit_never_run_is_an_error():
    w = torch.nn.Parameter(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="unapplied"):
        with weight_grads.split_step():
            with weight_grads.deferred():
                _linear(torch.randn(2, 4), w, None).sum().backward()


def test_main_grad_is_found_under_saved_tensor_hooks():
    """The bytes meter's saved-tensor hooks hand ``saved_tensors`` back without Megatron's
    attributes: the deferred gradient must still reach the parameter's ``main_grad`` (it went
    to a ``.grad`` nothing read, and the first step lost it, before the fix)."""
    w = torch.nn.Parameter(torch.randn(3, 4))
    w.main_grad = torch.zeros(3, 4)
    x, dy = torch.randn(7, 4), torch.randn(7, 3)
    with weight_grads.split_step():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = _linear(x, w, None)
        with weight_grads.deferred():
            y.backward(dy)
        weight_grads.run_weight_unit()
    torch.testing.assert_close(w.main_grad, dy.t() @ x)
