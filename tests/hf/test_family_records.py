"""The family registry (tritonlm.hf.family, tritonlm/hf/families/): one record per model_type, generic code that names
no family, every config key accounted for — class defaults for missing keys, a one-line error for what a model
cannot represent — checked against transformers' own config classes.

The structural checks need no optional extra; the class comparisons skip without transformers.
"""

import ast
import copy
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM
from tritonlm.hf import family as registry
from tritonlm.hf import model_config_from_hf

from helpers import transformers_or_skip

REPO = Path(__file__).resolve().parents[2]
GENERIC = [REPO / "tritonlm" / "hf" / name for name in ("__init__.py", "checkpoint.py", "patch.py", "family.py")]
SMALL = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=120, max_position_embeddings=64)


def _code_strings_and_names(path: Path) -> set[str]:
    """Every string constant (docstrings left out) and identifier of a module's code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.add(node.value)
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
    return out


def test_generic_modules_name_no_family():
    """checkpoint.py, patch.py, family.py and the package's __init__ hold no model_type, architecture, config class or
    kernel-target class name in their code: everything family-specific is in a record."""
    names = set()
    for f in registry.families().values():
        names |= {f.model_type, f.architecture, f.config_class}
        if f.kernels is not None:
            names |= {*f.kernels.norms, *f.kernels.mlps, *f.kernels.attention, *f.kernels.experts}
    for path in GENERIC:
        found = {s for s in _code_strings_and_names(path) for name in names
                 if s == name or re.search(rf"\b{re.escape(name)}\b", s)}
        assert not found, f"{path.name} names {sorted(found)}"


def test_each_model_type_has_exactly_one_registration():
    """One ``register(Family(...))`` per model_type across tritonlm/hf/families/*.py, and the registry holds exactly
    those (a second registration of a model_type is an error)."""
    declared = []
    for path in sorted((REPO / "tritonlm" / "hf" / "families").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Family":
                kind = next(k.value.value for k in node.keywords if k.arg == "model_type")
                declared.append(kind)
    assert sorted(declared) == sorted(registry.families()) and len(set(declared)) == len(declared)
    first = registry.families()["llama"]
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(copy.copy(first))
    assert sum(f.default for f in registry.families().values()) == 1


def test_a_new_family_file_is_all_it_takes(tmp_path, monkeypatch):
    """A module dropped into the families package is found with no other edit: it loads, saves, and appears in
    SUPPORTED_MODELS' source, the README table and the CLI help."""
    package = importlib.import_module("tritonlm.hf.families")
    (tmp_path / "toy.py").write_text(
        "from tritonlm.hf.family import Family, Kernels, read_decoder, register, write_decoder\n"
        "register(Family(model_type='toyllama', architecture='ToyForCausalLM', config_class='ToyConfig',\n"
        "    defaults={'rms_norm_eps': 1e-5, 'rope_theta': 10000.0, 'tie_word_embeddings': False,\n"
        "              'hidden_act': 'silu', 'head_dim': None, 'num_key_value_heads': None},\n"
        "    to_config=read_decoder, to_hf=write_decoder,\n"
        "    kernels=Kernels(norms={}, mlps={}, attention=()), notes='a test family'))\n", encoding="utf-8")
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.delitem(sys.modules, "tritonlm.hf.families.toy", raising=False)
    from tritonlm.cli import build_parser
    from tritonlm.hf.checkpoint import hf_config_from_model, readme_table, supported_models

    assert "toyllama" in supported_models() and "| toyllama | ToyForCausalLM |" in readme_table()
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "toyllama" in re.sub(r"\s+", " ", help_text)
    cfg = model_config_from_hf({"model_type": "toyllama", **SMALL})
    assert cfg.model_type == "toyllama" and cfg.d_ff == 48
    assert hf_config_from_model(cfg, torch.float32)["architectures"] == ["ToyForCausalLM"]
    sys.modules.pop("tritonlm.hf.families.toy", None)


def test_unknown_keys_quantisation_and_unknown_families_are_one_line_errors():
    base = {"model_type": "llama", **SMALL}
    with pytest.raises(ValueError, match="rope_wiggle=3"):
        model_config_from_hf({**base, "rope_wiggle": 3})
    with pytest.raises(ValueError, match="quant_method='mxfp4'"):
        model_config_from_hf({**base, "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ValueError, match="model_type 'gpt_bigcode' is not supported"):
        model_config_from_hf({**base, "model_type": "gpt_bigcode"})
    with pytest.raises(ValueError, match="pruned_heads"):
        model_config_from_hf({**base, "pruned_heads": {"0": [1]}})
    # keys that change nothing are accepted (4.x generation defaults, bookkeeping)
    assert model_config_from_hf({**base, "temperature": 0.7, "_name_or_path": "x", "pruned_heads": {}}).d_ff == 48


def test_a_model_built_here_names_its_family_or_is_saved_as_llama(tmp_path):
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=4, d_ff=48)
    from tritonlm.hf.checkpoint import hf_config_from_model

    assert hf_config_from_model(cfg, torch.float32)["model_type"] == "llama"
    qwen3 = cfg.replace(qk_norm="head", model_type="qwen3")
    assert hf_config_from_model(qwen3, torch.float32)["model_type"] == "qwen3"
    with pytest.raises(ValueError, match="'llama' cannot hold this model's qk_norm='head'"):
        hf_config_from_model(qwen3.replace(model_type=None), torch.float32)
    with pytest.raises(ValueError, match="model_type 'nope' is not supported"):
        hf_config_from_model(cfg.replace(model_type="nope"), torch.float32)


# ----------------------------------------------------------------------------------------------------
# against transformers' config classes
# ----------------------------------------------------------------------------------------------------
def _flat(d: dict) -> dict:
    """A transformers 5 config dict in 4.x's flat RoPE keys (so each RoPE key can be dropped on its own)."""
    d = copy.deepcopy(d)
    params = d.pop("rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        full, local = params["full_attention"], params["sliding_attention"]
        d["rope_theta"] = full.pop("rope_theta")
        if d["model_type"] == "gemma3_text":
            d["rope_local_base_freq"] = local["rope_theta"]
        if full.get("rope_type", "default") != "default":
            d["rope_scaling"] = full
    elif isinstance(params, dict):
        d["rope_theta"] = params.pop("rope_theta")
        if "partial_rotary_factor" in params:
            d["partial_rotary_factor"] = params.pop("partial_rotary_factor")
        if params.get("rope_type", "default") != "default":
            d["rope_scaling"] = params
    return d


#: Glm4MoeConfig's own defaults derive head_dim 4096 / 96 = 42, whose half (the rotary width) is odd: no published
#: GLM-4.5 has that (they set head_dim 128, as here), and tritonlm refuses an odd rotary width in one line -- so
#: dropping a key that brings the derived 42 back must be that refusal
CLASS_DEFAULT_OVERRIDES = {"glm4_moe": {"head_dim": 128}}
ODD_ROTARY_KEYS = {"glm4_moe": {"head_dim"}}


@pytest.mark.parametrize("kind", sorted(registry.families()))
def test_missing_keys_take_the_config_class_defaults(kind):
    """Every key the family reads, dropped on its own from transformers' default config, gives the ModelConfig of
    the full default config: the family's defaults are its config class's (issue 31: no tritonlm fallbacks)."""
    transformers = transformers_or_skip()
    record = registry.families()[kind]
    if record.text_of is not None:  # a vision-language directory: its default config is the text family's default
        text_class = getattr(transformers, registry.families()[record.text_of].config_class)
        wrapped = getattr(transformers, record.config_class)().to_dict()
        assert model_config_from_hf(wrapped) == model_config_from_hf(_flat(text_class().to_dict()))
        return
    full = _flat(getattr(transformers, record.config_class)(**CLASS_DEFAULT_OVERRIDES.get(kind, {})).to_dict())
    expected = model_config_from_hf(full)
    checked = 0
    for key in record.defaults:
        if key not in full:
            continue
        dropped = {k: v for k, v in full.items() if k != key}
        if key in ODD_ROTARY_KEYS.get(kind, ()):
            with pytest.raises(ValueError, match="rotated features: it must be a positive even number"):
                model_config_from_hf(dropped)
        else:
            assert model_config_from_hf(dropped) == expected, key
        checked += 1
    assert checked >= 8


#: per family, options of its transformers config class that the model cannot represent, and the key the error names
REFUSED = {
    "llama": [({"attention_bias": True}, "attention_bias"), ({"mlp_bias": True}, "mlp_bias"),
              ({"hidden_act": "gelu"}, "hidden_act"),
              ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}, "dynamic")],
    "mistral": [({"hidden_act": "relu"}, "hidden_act")],
    "mixtral": [({"router_jitter_noise": 0.1}, "router_jitter_noise")],
    "gemma": [({"attention_bias": True}, "attention_bias"), ({"use_bidirectional_attention": True},
                                                              "use_bidirectional_attention")],
    "gemma2": [({"hidden_activation": "relu"}, "hidden_activation"), ({"attention_bias": True}, "attention_bias")],
    "gemma3_text": [({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 1e4}}}, "sliding_attention")],
    "olmo2": [({"attention_bias": True}, "attention_bias")],
    "olmo3": [({"attention_bias": True}, "attention_bias"),
              ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}},
               "sliding_attention")],
    "phi3": [({"resid_pdrop": 0.1}, "resid_pdrop"),
             ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                   "long_factor": [1.0] * 4, "original_max_position_embeddings": 32,
                                   "partial_rotary_factor": 1.0}}, "longrope")],
    "qwen2": [({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "use_sliding_window")],
    "qwen3": [({"attention_bias": True}, "attention_bias"),
              ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "use_sliding_window")],
    "qwen2_moe": [({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "use_sliding_window")],
    "qwen3_moe": [({"attention_bias": True}, "attention_bias")],
    "smollm3": [({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "layer_types"),
                ({"hidden_act": "gelu"}, "hidden_act")],
    "glm4": [({"hidden_act": "gelu"}, "hidden_act"),
             ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.5}}, "dynamic")],
    "granite": [({"hidden_act": "gelu"}, "hidden_act")],
    "ernie4_5": [({"hidden_act": "gelu"}, "hidden_act")],
    "gpt_oss": [({"attention_bias": False}, "attention_bias"),
                ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                      "long_factor": [1.0] * 4, "original_max_position_embeddings": 32}},
                 "longrope")],
    "deepseek_v3": [({"rope_interleave": False}, "rope_interleave"), ({"hidden_act": "gelu"}, "hidden_act"),
                    ({"n_shared_experts": 0}, "n_shared_experts")],
    "glm4_moe": [({"hidden_act": "gelu"}, "hidden_act"), ({"n_shared_experts": 0}, "n_shared_experts"),
                 ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4,
                                       "partial_rotary_factor": 0.5}}, "dynamic")],
    "seed_oss": [({"attention_dropout": 0.1, "residual_dropout": 0.0}, "residual_dropout"),
                 ({"hidden_act": "relu"}, "hidden_act")],
    "qwen3_next": [({"attention_bias": True}, "attention_bias"),
                   ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size")],
    "qwen3_5_text": [({"attention_bias": True}, "attention_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
                     ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types")],
    "qwen3_5_moe_text": [({"attention_bias": True}, "attention_bias"), ({"hidden_act": "gelu"}, "hidden_act")],
    # (vision-language directories: the options of their text_config)
    "qwen3_5": [({"attention_bias": True}, "attention_bias")],
    "qwen3_5_moe": [({"hidden_act": "gelu"}, "hidden_act")],
}


def test_every_family_has_a_refusal_table():
    assert set(REFUSED) == set(registry.families())


@pytest.mark.parametrize("kind, option, named", [(k, o, n) for k, rows in REFUSED.items() for o, n in rows])
def test_options_the_model_cannot_represent_are_refused(kind, option, named):
    """Each option is a real one of the family's config class (transformers builds the config and keeps the value);
    its config.json, as transformers writes it, is a one-line error naming the key before any weight is read."""
    transformers = transformers_or_skip()
    record = registry.families()[kind]

    def build(**options):
        cls = getattr(transformers, record.config_class)
        return cls(text_config={**SMALL, **options}) if record.text_of else cls(**SMALL, **options)

    config = build(**copy.deepcopy(option))
    written = config.to_dict()
    for key, value in option.items():
        if key != "rope_parameters":
            assert (written["text_config"] if record.text_of else written)[key] == value, key
    assert model_config_from_hf(build().to_dict()) is not None
    with pytest.raises(ValueError, match=re.escape(named)) as info:
        model_config_from_hf(written)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", sorted(registry.families()))
def test_kernel_targets_name_classes_of_the_modeling_module(kind):
    """Every class a family's apply_kernels targets exists in transformers' modeling module of its architecture (a
    renamed class would leave a module silently unpatched)."""
    transformers = transformers_or_skip()
    record = registry.families()[kind]
    modeling = importlib.import_module(getattr(transformers, record.architecture).__module__)
    targets = record.kernels
    for name in (*targets.norms, *targets.mlps, *targets.attention, *targets.experts, *targets.linear_attention):
        assert isinstance(getattr(modeling, name, None), type), f"{modeling.__name__} has no {name}"
    assert hasattr(modeling, "apply_rotary_pos_emb")


def test_tied_flag_with_a_head_of_its_own_loads_untied_as_transformers_does(tmp_path):
    """Issue 31: tie_word_embeddings true beside a distinct lm_head.weight: transformers keeps both; so do we."""
    transformers = transformers_or_skip()
    from safetensors.torch import load_file, save_file

    from tritonlm import hf

    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()
    theirs.save_pretrained(tmp_path)
    config = hf.read_hf_config(tmp_path)
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(__import__("json").dumps(config), encoding="utf-8")
    state = load_file(str(tmp_path / "model.safetensors"))
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = hf.from_pretrained(tmp_path, backend="reference", dtype=torch.float32)
    assert not ours.config.tie_embeddings
    ids = torch.randint(0, 120, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids), reloaded(ids).logits, atol=2e-5, rtol=1e-4)
    save_file(state, str(tmp_path / "model.safetensors"))  # (unchanged file: the same answer on a second read)
    assert torch.equal(hf.from_pretrained(tmp_path, backend="reference").lm_head.weight, state["lm_head.weight"])


def test_dropout_checkpoints_evaluate_and_refuse_to_train():
    """Seed-OSS's published dropout (0.1): eval forward works, a training-mode forward is a one-line error."""
    cfg = model_config_from_hf({"model_type": "seed_oss", **SMALL, "head_dim": 8})
    assert cfg.dropout == 0.1
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, 120, (1, 5))
    assert model(ids).shape == (1, 5, 120)
    with pytest.raises(ValueError, match="dropout=0.1"):
        model.train()(ids)
