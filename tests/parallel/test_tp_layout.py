"""TPLayout: the refusal of a tp_size that does not divide the model, and ranges that tile each weight."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from appliance.config.schema import ConfigError
from appliance.models.llama import ModelArgs
from appliance.parallel.layout import SPLIT, TPLayout
from appliance.parallel.lora import shard_adapter

# SmolLM2-135M's numbers (configs/model/smollm2-135m-instruct.yaml's model).
SMOLLM2 = ModelArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
                    tie_word_embeddings=True, attention_bias=False)


@pytest.mark.parametrize("size, words", [
    (2, ["parallel.tp_size: 2", "query heads (num_attention_heads) 9", "KV heads (num_key_value_heads) 3"]),
    (4, ["parallel.tp_size: 4", "query heads (num_attention_heads) 9", "must be a multiple of them"]),
    (5, ["intermediate_size 1536", "vocab_size 49152"]),
])
def test_tp_size_that_does_not_divide_is_refused_with_the_models_numbers(size: int, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        TPLayout.check(SMOLLM2, size)
    for w in words:
        assert w in str(e.value)
    assert "9 query heads, 3 KV heads" in str(e.value)


@pytest.mark.parametrize("args, size", [(SMOLLM2, 3), (SMOLLM2, 1),
                                        (replace(SMOLLM2, num_heads=8, num_kv_heads=2), 8)])
def test_ranges_tile_every_split_dimension(args: ModelArgs, size: int) -> None:
    TPLayout.check(args, size)
    ranks = [TPLayout(args, r, size) for r in range(size)]
    for proj in SPLIT:
        got = [lay.proj_range(proj) for lay in ranks]
        full = {"q_proj": args.q_size, "o_proj": args.q_size, "k_proj": args.kv_size,
                "v_proj": args.kv_size}.get(proj, args.intermediate_size)
        if proj in ("k_proj", "v_proj") and size > args.num_kv_heads:
            # Replicated KV heads: each rank reads the head of its query heads' group.
            per = size // args.num_kv_heads
            assert got == [(r // per * args.head_dim, (r // per + 1) * args.head_dim) for r in range(size)]
        else:
            assert got[0][0] == 0 and got[-1][1] == full
            assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    vocab = [lay.vocab_range() for lay in ranks]
    assert vocab[0][0] == 0 and vocab[-1][1] == args.vocab_size


def test_lora_shards_reassemble_the_full_delta() -> None:
    """Column-parallel: the ranks' output rows concatenate to x·Aᵀ·Bᵀ; row-parallel: their partial
    deltas from input slices sum to it (what the block's one all-reduce does)."""
    args = replace(SMOLLM2, num_layers=1)
    size, r = 3, 4
    g = torch.Generator().manual_seed(0)
    weights = {}
    for proj in SPLIT:
        inp, out = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
                    "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}[proj]
        weights[f"layers.0.{proj}"] = (torch.randn(r, inp, generator=g, dtype=torch.float64),
                                       torch.randn(out, r, generator=g, dtype=torch.float64))
    shards = [shard_adapter(weights, TPLayout(args, k, size)) for k in range(size)]
    for name, (a, b) in weights.items():
        proj = name.rsplit(".", 1)[1]
        x = torch.randn(5, a.shape[1], generator=g, dtype=torch.float64)
        want = x @ a.T @ b.T
        if SPLIT[proj] == "out":
            got = torch.cat([x @ s[name][0].T @ s[name][1].T for s in shards], dim=-1)
        else:
            parts = [TPLayout(args, k, size).proj_range(proj) for k in range(size)]
            got = sum(x[:, lo:hi] @ s[name][0].T @ s[name][1].T for (lo, hi), s in zip(parts, shards))
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("group, size", [("tp1", 1), ("tp2", 2), ("tp4", 4), ("tp8", 8)])
def test_tp_layout_groups_compose_and_a_change_requires_restart(group: str, size: int) -> None:
    from appliance.config.restart import restart_diff, restart_settings
    from tests.conftest import default_config

    live, wanted = default_config(), default_config(f"parallel={group}")
    assert wanted.parallel.tp_size == size and wanted.parallel.backend == "auto"
    changes = restart_diff(restart_settings(live), restart_settings(wanted))
    assert [c.key for c in changes] == ([] if size == 1 else ["parallel.tp_size"])
    assert all("requires restart" in c.render() for c in changes)


def test_validate_refuses_a_tp_size_that_does_not_divide_the_model(default_model_dir) -> None:
    from appliance.config.validate import validate
    from tests.conftest import REPO

    _, problems = validate(REPO / "configs", [f"model.path={default_model_dir}", "parallel.tp_size=2"])
    assert any(p.startswith("parallel.tp_size: 2 does not divide the model's query heads") for p in problems), problems
    _, ok = validate(REPO / "configs", [f"model.path={default_model_dir}", "parallel.tp_size=3"])
    assert not any("parallel.tp_size" in p for p in ok), ok


def test_overlap_loading_is_refused_under_tp_and_the_config_round_trips_as_json() -> None:
    """Overlap's side-stream copies fill unsharded slots: refused with tp_size > 1, not ignored. The
    workers get their config as JSON (never pickle): the round trip gives the same typed config."""
    from appliance.config.compose import config_from_dict, config_to_dict
    from tests.conftest import default_config

    with pytest.raises(ConfigError, match="lora.overlap_loading: not available with parallel.tp_size > 1"):
        default_config("parallel=tp2", "lora.enabled=true", "lora.overlap_loading=true")
    # The same for the other single-rank options: async scheduling, the decode side stream.
    with pytest.raises(ConfigError, match="engine.async_scheduling: not available with parallel.tp_size > 1"):
        default_config("parallel=tp2", "engine.async_scheduling=true")
    with pytest.raises(ConfigError, match="lora.decode_side_stream: not available with parallel.tp_size > 1"):
        default_config("parallel=tp2", "lora.enabled=true", "lora.decode_side_stream=true")
    cfg = default_config("parallel=tp2", "lora.enabled=true", "lora.max_loras_per_batch=3")
    assert config_from_dict(config_to_dict(cfg)) == cfg
