"""The mapping tables and tensor-parallel layouts, without any process group."""

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from agentgym_mega.models import gpt, mapping, weights
from agentgym_mega.models.mapping import MappingError

GEO = mapping.Geometry(hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=6, vocab=10, padded_vocab=12, layers=1)


def _hf_tensors(rule):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(GEO.hf_shape(name), generator=g) for name in rule.hf]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_every_rule_round_trips_bitwise_through_tp_shards(arch, tp):
    for rule in mapping.ARCHITECTURES[arch].rules:
        rule = rule.at(0)
        full = _hf_tensors(rule)
        shards = [mapping.to_megatron(rule, full, GEO, r, tp) for r in range(tp)]
        assert all(s.shape == shards[0].shape for s in shards)
        back = mapping.to_hf(rule, shards, GEO)
        assert len(back) == len(full)
        assert all(torch.equal(a, b) for a, b in zip(full, back)), rule.megatron


def test_export_at_tp1_views_the_parameter_except_qkv():
    """At TP=1 the weight sync streams straight from the parameters: only Q/K/V are copied."""
    for rule in mapping.ARCHITECTURES["Qwen2ForCausalLM"].rules:
        rule = rule.at(0)
        shard = mapping.to_megatron(rule, _hf_tensors(rule), GEO, 0, 1)
        for hf in mapping.to_hf(rule, [shard], GEO):
            assert (hf.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()) == (rule.layout != "qkv")


def test_qkv_is_interleaved_per_query_group_and_split_by_group():
    rule = mapping.ARCHITECTURES["Qwen2ForCausalLM"].rules[-3].at(0)
    assert rule.megatron.endswith("linear_qkv.bias")
    # Bias rows labelled by head: q heads 0-3 (two per group), k/v heads 0-1 (one per group).
    q = torch.tensor([10, 10, 11, 11, 12, 12, 13, 13.0])
    k = torch.tensor([20, 20, 21, 21.0])
    v = torch.tensor([30, 30, 31, 31.0])
    rank0, rank1 = (mapping.to_megatron(rule, [q, k, v], GEO, r, 2) for r in range(2))
    assert rank0.tolist() == [10, 10, 11, 11, 20, 20, 30, 30]  # group 0: q0 q1 k0 v0
    assert rank1.tolist() == [12, 12, 13, 13, 21, 21, 31, 31]  # group 1: q2 q3 k1 v1


def test_vocab_rows_are_padded_then_split_and_unpadded_on_export():
    rule = mapping.ARCHITECTURES["LlamaForCausalLM"].rules[0]
    emb = torch.randn(GEO.vocab, GEO.hidden)
    shards = [mapping.to_megatron(rule, [emb], GEO, r, 2) for r in range(2)]
    assert [s.shape[0] for s in shards] == [6, 6]
    assert torch.all(shards[1][4:] == 0)  # the two padded rows
    assert torch.equal(mapping.to_hf(rule, shards, GEO)[0], emb)


def test_tied_head_reads_the_embedding_and_is_not_exported():
    tied = Qwen2Config(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True)
    head = [r for r in mapping.rules(tied) if r.megatron == "output_layer.weight"][0]
    assert head.hf == ("model.embed_tokens.weight",) and not head.exported
    untied = LlamaConfig(architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    head = [r for r in mapping.rules(untied) if r.megatron == "output_layer.weight"][0]
    assert head.hf == ("lm_head.weight",) and head.exported


def test_te_spec_names_the_fused_norms():
    config = LlamaConfig(architectures=["LlamaForCausalLM"])
    names = {r.megatron for r in mapping.rules(config, te_spec=True)}
    assert "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight" in names


def test_unsupported_architecture_and_rope_are_refused_by_name():
    with pytest.raises(MappingError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        mapping.architecture(LlamaConfig(architectures=["GPT2LMHeadModel"]))
    odd = LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                       "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    with pytest.raises(MappingError, match="low_freq_factor"):
        gpt.rope_settings(odd)
    assert gpt.rope_settings(LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192})) == {
        "rotary_base": 5e5, "rope_scaling": True, "rope_scaling_factor": 32.0}


def test_padded_vocab_is_a_fixed_multiple_shared_by_tp_sizes():
    assert gpt.padded_vocab_size(509, 1) == gpt.padded_vocab_size(509, 2) == 512
    assert gpt.padded_vocab_size(152064, 8) == 152064  # Qwen2.5: no padding
    assert gpt.padded_vocab_size(130, 3) == 384  # a multiple of both 128 and 3


def test_hf_checkpoint_names_missing_and_misshapen_tensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(GEO.hidden), "model.embed_tokens.weight": torch.ones(3, 3)},
              str(tmp_path / "model.safetensors"))
    source = weights.HFCheckpoint(str(tmp_path), GEO)
    assert torch.equal(source.get("model.norm.weight"), torch.ones(GEO.hidden))
    with pytest.raises(MappingError, match=r"model.embed_tokens.weight: shape \(3, 3\).*implies \(10, 8\)"):
        source.get("model.embed_tokens.weight")
    with pytest.raises(MappingError, match="lm_head.weight: missing"):
        source.get("lm_head.weight")
    with pytest.raises(MappingError, match="no model.safetensors"):
        weights.HFCheckpoint(str(tmp_path / "nowhere"), GEO)


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_reads_cover_each_hf_tensor_once_across_ranks(tp):
    """A rank reads its share of every split tensor, never the whole; together the ranks read each
    element once (the vocabulary's padding rows are read by nobody)."""
    geo = mapping.Geometry(hidden=8, heads=8, kv_heads=4, head_dim=2, ffn=8, vocab=10, padded_vocab=16, layers=1)
    for rule in mapping.ARCHITECTURES["Qwen2ForCausalLM"].rules:
        rule = rule.at(0)
        for i, hf in enumerate(rule.hf):
            shape = geo.hf_shape(hf)
            seen = torch.zeros(shape, dtype=torch.int32)
            for rank in range(tp):
                part = mapping.shard_reads(rule, geo, rank, tp)[i]
                mapping.read(seen, part).add_(1)
            expected = tp if rule.layout == "replicated" else 1
            assert bool((seen == expected).all()), (rule.megatron, hf)


def test_hf_checkpoint_reads_a_slice_from_the_file(tmp_path):
    from safetensors.torch import save_file

    full = torch.arange(10 * 8, dtype=torch.float32).reshape(10, 8)
    save_file({"model.embed_tokens.weight": full, "model.layers.0.self_attn.o_proj.weight": full[:8].clone()},
              str(tmp_path / "model.safetensors"))
    source = weights.HFCheckpoint(str(tmp_path), GEO)
    assert torch.equal(source.get("model.embed_tokens.weight", (0, 3, 7)), full[3:7])
    assert torch.equal(source.get("model.layers.0.self_attn.o_proj.weight", (1, 4, 8)), full[:8, 4:8])
    assert torch.equal(source.get("model.embed_tokens.weight"), full)


def test_te_names_are_megatron_local_spec_checkpoint_names():
    """megatron's local layer spec saves (and loads) its norms under the TE spec's fused names, the
    translation TE_NAMES states: a checkpoint written on either spec loads on the other."""
    from megatron.core.models.gpt import gpt_layer_specs

    keys_map = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    for local, te in mapping.TE_NAMES.items():
        prefix = local.removesuffix("weight")
        assert keys_map[prefix] + "weight" == te
    assert len(keys_map) == len(mapping.TE_NAMES)


def test_a_split_of_smollm2s_9_heads_and_3_kv_heads_names_both_counts():
    smollm2 = dict(layers=30, heads=9, kv_heads=3, ffn=1536)
    for tp in (1, 3):
        gpt.check_split(**smollm2, tp=tp, pp=1)
    with pytest.raises(MappingError) as refused:
        gpt.check_split(**smollm2, tp=2, pp=1)
    assert str(refused.value).startswith("num_attention_heads=9 and num_key_value_heads=3 do not split over tp=2: "
                                         "neither is divisible by tp=2")
    with pytest.raises(MappingError, match="num_key_value_heads=2 is not divisible by tp=4"):
        gpt.check_split(layers=2, heads=8, kv_heads=2, ffn=16, tp=4, pp=1)


def test_plan_refuses_smollm2_at_tp2_in_the_same_words(tmp_path):
    from tests.conftest import run_cli

    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
               "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
               "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True},
              open(tmp_path / "config.json", "w"))
    proc = run_cli("plan", "--config", "configs/base.yaml", f"model.path={tmp_path}", "parallel.tp=2")
    assert proc.returncode == 2
    assert "num_attention_heads=9 and num_key_value_heads=3 do not split over tp=2" in proc.stderr, proc.stderr
