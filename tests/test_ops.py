"""The canonical ops against transformers' own reference functions, and their fake kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from deltaship.models import ops

OPS = torch.ops.deltaship


def _inputs(t: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = hf.l2norm(torch.randn(1, t, hk, dk, generator=g))
    k = hf.l2norm(torch.randn(1, t, hk, dk, generator=g))
    v = torch.randn(1, t, hv, dv, generator=g)
    decay = -torch.rand(1, t, hv, generator=g) * 2
    beta = torch.rand(1, t, hv, generator=g)
    state = torch.randn(1, hv, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t", [1, 2, 63, 64, 65, 130])
@pytest.mark.parametrize("heads", [(2, 2), (2, 6)])
def test_gated_delta_rule_matches_transformers(t, heads):
    hk, hv = heads
    q, k, v, decay, beta, state = _inputs(t, hk, hv, 8, 12)
    out, new_state = OPS.gated_delta_rule(q, k, v, decay, beta, state)
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True
    )
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(new_state, ref_state, atol=2e-5, rtol=1e-4)


def test_gated_delta_rule_split_equals_whole():
    q, k, v, decay, beta, state = _inputs(100, 2, 4, 8, 8, seed=1)
    whole, s_whole = OPS.gated_delta_rule(q, k, v, decay, beta, state)
    a, s_a = OPS.gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], decay[:, :37], beta[:, :37], state)
    b, s_b = OPS.gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], decay[:, 37:], beta[:, 37:], s_a)
    torch.testing.assert_close(torch.cat([a, b], 1), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_b, s_whole, atol=2e-5, rtol=1e-4)


def test_nilpotent_inverse_is_exact():
    g = torch.Generator().manual_seed(0)
    strict = torch.randn(3, 64, 64, generator=g).tril(-1) * 0.3
    inv = ops._unit_lower_inverse(strict)
    eye = torch.eye(64).expand(3, 64, 64)
    torch.testing.assert_close(inv @ (eye + strict), eye, atol=1e-4, rtol=0)


@pytest.mark.parametrize("t", [1, 3, 9])
def test_causal_conv_with_state_matches_transformers(t):
    g = torch.Generator().manual_seed(t)
    c, kk = 10, 4
    weight = torch.randn(c, kk, generator=g)
    history = torch.randn(1, 7, c, generator=g)
    x = torch.randn(1, t, c, generator=g)
    state = history[:, -(kk - 1) :]
    y, new_state = OPS.causal_conv_with_state(x, state, weight)
    # transformers' full-sequence conv over history + x, channels first
    full = hf.causal_conv1d_fn(torch.cat([history, x], 1).transpose(1, 2), weight, None, activation="silu")
    torch.testing.assert_close(y, full.transpose(1, 2)[:, -t:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, torch.cat([history, x], 1)[:, -(kk - 1) :])


def test_norm_ops_match_transformers():
    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    norm = hf.Qwen3_5RMSNorm(16, eps=1e-6)
    gated = hf.Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g) * 0.2)
        gated.weight.copy_(1 + torch.randn(16, generator=g) * 0.2)
    torch.testing.assert_close(OPS.rms_norm(x, 1 + norm.weight.detach(), 1e-6), norm(x).detach())
    torch.testing.assert_close(OPS.gated_rms_norm(x, z, gated.weight.detach(), 1e-6), gated(x, z).detach())


def test_attention_with_kv_cache_matches_naive_attention():
    g = torch.Generator().manual_seed(0)
    h, hkv, d, s = 4, 2, 8, 16
    keys, vals = torch.randn(1, 11, hkv, d, generator=g), torch.randn(1, 11, hkv, d, generator=g)
    q = torch.randn(1, 11, h, d, generator=g)
    kc, vc = torch.zeros(1, hkv, s, d), torch.zeros(1, hkv, s, d)
    _, kc, vc = OPS.attention_with_kv_cache(q[:, :6], keys[:, :6], vals[:, :6], kc, vc, torch.tensor([0]))
    out, kc, vc = OPS.attention_with_kv_cache(q[:, 6:], keys[:, 6:], vals[:, 6:], kc, vc, torch.tensor([6]))
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2).repeat_interleave(2, 1),
        vals.transpose(1, 2).repeat_interleave(2, 1),
        is_causal=True,
    )
    torch.testing.assert_close(out, ref.transpose(1, 2)[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc[:, :, :11], keys.transpose(1, 2))
    assert not kc[:, :, 11:].any()


def test_fake_kernels_give_the_reference_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _inputs(5, 2, 4, 8, 8)
    real = OPS.gated_delta_rule(*args)
    with FakeTensorMode() as mode:
        fake = OPS.gated_delta_rule(*[mode.from_tensor(a) for a in args])
    assert [f.shape for f in fake] == [r.shape for r in real]
    assert [f.dtype for f in fake] == [r.dtype for r in real]


def test_ops_do_not_mutate_their_inputs():
    q, k, v, decay, beta, state = _inputs(5, 2, 2, 8, 8)
    before = state.clone()
    OPS.gated_delta_rule(q, k, v, decay, beta, state)
    assert torch.equal(state, before)
