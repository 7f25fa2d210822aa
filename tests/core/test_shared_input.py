"""SharedInput: sibling Linears that read one tensor quantise it once, and the explore copy's output is unchanged."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch
from conftest import tiny_flux_transformer, tiny_sd3_transformer_inputs

from flowrl.policy.precision import QuantRule, build_explore
from flowrl.policy.shared_input import SharedInput


class Counted:
    """``x * 2``, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2


def test_the_same_unmodified_tensor_under_the_same_key_is_computed_once():
    memo, compute, x = SharedInput(), Counted(), torch.randn(4, 8)
    first = memo.get(x, "k", compute)
    assert memo.get(x, "k", compute) is first and memo.get(x, "k", compute) is first
    assert compute.calls == 1 and (memo.hits, memo.misses) == (2, 1)


def test_an_in_place_write_a_write_through_a_view_another_key_or_another_tensor_recomputes():
    memo, compute, x = SharedInput(), Counted(), torch.randn(4, 8)
    memo.get(x, "k", compute)
    x.add_(1.0)  # bumps x's version counter
    assert torch.equal(memo.get(x, "k", compute), x * 2) and compute.calls == 2
    x[0].zero_()  # a view shares its base's version counter
    assert torch.equal(memo.get(x, "k", compute), x * 2) and compute.calls == 3
    memo.get(x, "other", compute)
    assert compute.calls == 4
    memo.get(x.clone(), "other", compute)  # equal values, another tensor
    assert compute.calls == 5 and memo.hits == 0


def test_a_freed_tensor_never_matches_a_new_one():
    memo, compute = SharedInput(), Counted()
    memo.get(torch.randn(4, 8), "k", compute)  # freed right after the call: only a weak reference is held
    gc.collect()
    y = torch.randn(4, 8)
    assert torch.equal(memo.get(y, "k", compute), y * 2) and compute.calls == 2


def test_inference_tensors_and_compiled_code_are_never_shared():
    memo, compute = SharedInput(), Counted()
    with torch.inference_mode():
        x = torch.randn(4, 8)
        memo.get(x, "k", compute)
        memo.get(x, "k", compute)
    assert compute.calls == 2 and memo.hits == 0

    def f(t: torch.Tensor) -> torch.Tensor:
        return memo.get(t, "k", torch.sin) + memo.get(t, "k", torch.sin)

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(torch.randn(3))
    assert explain.graph_count == 1 and explain.graph_break_count == 0
    nodes = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("sin" in n for n in nodes) == 2  # traced as two computations; no memo inside the graph
    assert memo.hits == 0
    torch._dynamo.reset()


def test_it_pickles_without_its_memo_and_clear_drops_it():
    memo, compute, x = SharedInput(), Counted(), torch.randn(2, 3)
    memo.get(x, "k", compute)
    memo.get(x, "k", compute)
    restored = pickle.loads(pickle.dumps(memo))
    assert (restored.hits, restored.misses) == (1, 1)
    restored.get(x, "k", compute)
    assert compute.calls == 2
    memo.clear()
    memo.get(x, "k", compute)
    assert compute.calls == 3


def sd35_like_transformer():
    """A real SD3Transformer2DModel with SD3.5's q/k RMS norms and a dual-attention first block (2 blocks)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=32,
        pos_embed_max_size=4,
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
    )


def flux_inputs() -> dict:
    g = torch.Generator().manual_seed(2)
    return {
        "hidden_states": torch.randn(2, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 4, 16, generator=g),
        "pooled_projections": torch.randn(2, 16, generator=g),
        "timestep": torch.tensor([0.9, 0.4]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(4, 3),
        "guidance": torch.tensor([3.5, 3.5]),
        "return_dict": False,
    }


@pytest.mark.parametrize(
    ("build", "inputs", "hits_per_call"),
    [
        # block 0: to_k, to_v, add_k_proj, add_v_proj, attn2.to_k, attn2.to_v; block 1: the first four
        pytest.param(sd35_like_transformer, lambda: tiny_sd3_transformer_inputs(1), 10, id="sd3.5"),
        # double block: to_k, to_v, add_k_proj, add_v_proj; each single block: to_q, to_k, to_v after proj_mlp
        pytest.param(lambda: tiny_flux_transformer(), flux_inputs, 10, id="flux"),
    ],
)
@pytest.mark.parametrize("precision", ["nvfp4", "fp8_e4m3"])
def test_a_w4a4_explore_copy_quantises_each_shared_input_once_with_the_same_output(
    build, inputs, hits_per_call, precision
):
    torch.manual_seed(3)
    transformer = build()
    rule = QuantRule(min_features=0)
    shared = build_explore(transformer, precision, activations=True, rule=rule)
    plain = build_explore(transformer, precision, activations=True, rule=rule, share_inputs=False)
    assert plain.shared_input is None and shared.shared_input is not None
    x = inputs()
    with torch.no_grad():
        out_shared, out_plain = shared.module(**x)[0], plain.module(**x)[0]
        out_full = transformer(**x)[0]
    assert torch.equal(out_shared, out_plain)
    assert not torch.equal(out_shared, out_full)  # the activations really are quantised
    memo = shared.shared_input
    assert memo.hits == hits_per_call and memo.misses == sum(1 for _ in shared.quantised) - hits_per_call
    assert memo.held is None  # dropped when the forward returns: no activation outlives the call


def test_only_copies_that_quantise_activations_get_a_memo(tiny_sd3):
    for precision, options in [("fp32", {}), ("bf16", {}), ("nvfp4", {}), ("int8_dynamic", {})]:
        assert build_explore(tiny_sd3, precision, **options).shared_input is None
    assert build_explore(tiny_sd3, "fp8_e4m3", activations=True).shared_input is not None
