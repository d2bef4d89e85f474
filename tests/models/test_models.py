"""One model description for the package (``meshgroups.models``): the cost model, the transfer
presets and the transfer families read the same ``Model``, the same presets by the same names
(older spellings still accepted), and Hugging Face configs through one reader — dicts and
config objects alike; numpy only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshgroups import Layout, LayoutError
from meshgroups.models import ALIASES, PRESETS, Model, from_hf_config, hf_value, preset, preset_names


def test_cost_and_transfer_read_the_same_model():
    import meshgroups.cost as cost
    from meshgroups.transfer._names import presets

    assert cost.Model is Model and cost.preset is preset and cost.PRESETS is PRESETS
    assert list(presets.MODELS) == list(PRESETS)  # one set of names
    for name, m in PRESETS.items():
        hidden, _, kv, vocab, layers, experts, dtype = presets.MODELS[name]
        assert (hidden, kv, vocab, layers, experts, dtype) == (
            m.hidden, m.kv_heads * m.head_dim, m.vocab, m.layers, m.experts, m.dtype,
        )  # fmt: skip
    # a preset's transfer weights are the model's parameters, one for one
    for name in ("tiny", "small", "llama3-8b"):
        weights = presets.model_weights(name, Layout(tp=1))
        assert sum(w.nbytes for w in weights) // (4 if PRESETS[name].dtype == "float32" else 2) == (
            PRESETS[name].parameters()
        )
    cfg = presets.model_config("llama3-8b")
    m = preset("llama3-8b")
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab) == (
        m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab,
    )  # fmt: skip


def test_older_names_are_aliases():
    for old, new in ALIASES.items():
        assert preset(old) is preset(new)
    from meshgroups.transfer._names.presets import model_config, model_weights

    assert model_config("llama-70b") == model_config("llama3-70b")
    assert [w.shape for w in model_weights("llama-8b", Layout(tp=2))][:3] == [
        w.shape for w in model_weights("llama3-8b", Layout(tp=2))
    ][:3]
    assert preset_names()[:2] == ["tiny", "tiny-moe"] and "llama-8b" in preset_names(aliases=True)
    with pytest.raises(LayoutError, match="unknown model preset 'gpt-5'; presets are tiny"):
        preset("gpt-5")
    with pytest.raises(TypeError, match="a preset name is a str"):
        preset(8)  # type: ignore[arg-type]


def test_one_hugging_face_reader_for_dicts_and_objects():
    config = {
        "num_hidden_layers": 126, "hidden_size": 16384, "num_attention_heads": 128, "num_key_value_heads": 8,
        "intermediate_size": 53248, "vocab_size": 128256, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "_name_or_path": "meta-llama/Llama-3.1-405B",
    }  # fmt: skip

    class Config:  # a transformers config: attributes, None for unset ones
        def __init__(self, **kw):
            self.__dict__.update(kw)
            self.head_dim = None

    a, b = from_hf_config(config), Model.from_hf_config(Config(**config))
    assert a == b == preset("llama3.1-405b").with_(seq_len=2048)
    assert a.name == "meta-llama/Llama-3.1-405B" and round(a.parameters() / 1e9) == 406
    assert hf_value({"n_routed_experts": 64}, "num_local_experts", "num_experts", "n_routed_experts") == 64
    assert hf_value(Config(num_key_value_heads=None), "num_key_value_heads", default=4) == 4
    with pytest.raises(LayoutError, match="the config has no 'hidden_size'"):
        from_hf_config({"num_hidden_layers": 2})
    with pytest.raises(LayoutError, match="unknown Model field 'seqlen'"):
        from_hf_config(config, seqlen=8)
    with pytest.raises(TypeError, match="a Hugging Face config is a dict or a config object"):
        from_hf_config("config.json")
    # the transfer families read configs through the same reader
    from meshgroups.transfer._names.families import hf_to_vllm

    qwen = Config(model_type="qwen3_moe", num_hidden_layers=1, num_experts=4, moe_intermediate_size=8)
    assert hf_to_vllm(qwen)["model.layers.0.mlp.experts.w13_weight"] is not None


def test_separate_projections_and_dtype():
    fused, separate = preset("tiny"), preset("tiny").with_(fused_projections=False)
    assert fused.parameters() == separate.parameters()
    assert [t.name for t in separate.tensors()][:6] == ["attn_norm", "q", "k", "v", "o", "mlp_norm"]
    assert [t.name for t in separate.tensors() if t.where == "layer"][-3:] == ["gate", "up", "fc2"]
    with pytest.raises(LayoutError, match="dtype='int8' must be one of"):
        preset("tiny").with_(dtype="int8")


@pytest.mark.processes
def test_models_import_no_torch():
    code = "import sys, meshgroups.models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
