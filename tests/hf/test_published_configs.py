"""The config.json files the Hub publishes (``published_configs/``, sources in its SOURCES.md) as a user meets them.

Each file is read at full size (plain JSON, no transformers), then shrunk to a tiny random model with every key kept
(only sizes, token ids and window lengths change): transformers builds its model from the shrunk file, tritonlm loads
the same directory and must give the same logits, and its save keeps every key the family accepted without reading
it, and transformers reads the saved directory back to the same logits (a vision-language release as the same
vision-language model, its vision tower unchanged). Files that hold what tritonlm cannot represent (a quantisation,
LongRoPE) are refused by that key's name and no other; a quantised release loads once the key is gone, as after
dequantising.

Needs the optional extra for the model comparisons (``pip install 'tritonlm[hf]'``); the full-size reads run without.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

from tritonlm.hf import model_config_from_hf
from tritonlm.hf.family import COMMON_KEYS, IDENTITY_KEYS, family

from helpers import DEVICE, transformers_or_skip

CORPUS = Path(__file__).parent / "published_configs"
FILES = sorted(p.stem for p in CORPUS.glob("*.json"))
#: files refused at full size, by the key named: the key removed first (a dequantised copy) loads
REFUSED = {
    "deepseek-ai--DeepSeek-V3": ("quantization_config (quant_method='fp8')", "quantization_config"),
    "openai--gpt-oss-120b": ("quantization_config (quant_method='mxfp4')", "quantization_config"),
    "microsoft--Phi-4-mini-instruct": ("rope_scaling type 'longrope'", None),
}


def _published(name: str) -> dict:
    return json.loads((CORPUS / f"{name}.json").read_text())


def _text(cfg: dict) -> dict:
    return cfg["text_config"] if "text_config" in cfg else cfg


@pytest.mark.parametrize("name", FILES)
def test_full_size_file_loads_or_is_refused_by_name(name):
    cfg = _published(name)
    if name in REFUSED:
        message, _ = REFUSED[name]
        with pytest.raises(ValueError) as e:
            model_config_from_hf(cfg)
        assert message in str(e.value) and "\n" not in str(e.value)
        harmless = set(family(_text(cfg)["model_type"]).harmless)
        assert not any(key in str(e.value) for key in harmless), "refused a key that changes nothing"
        return
    ours = model_config_from_hf(cfg)
    text = _text(cfg)
    assert ours.vocab_size == text["vocab_size"] and ours.num_layers == text["num_hidden_layers"]
    assert ours.d_model == text["hidden_size"]


def test_every_harmless_key_is_one_transformers_never_reads():
    """The oracle for ``Family.harmless``: the family's transformers modeling module never names the key."""
    transformers_or_skip()
    import importlib
    import inspect

    from tritonlm.hf.family import families

    checked = 0
    for record in families().values():
        if not record.harmless:
            continue
        module = importlib.import_module(
            f"transformers.models.{record.model_type.removesuffix('_text')}.modeling_"
            f"{record.model_type.removesuffix('_text')}")
        source = inspect.getsource(module)
        for key, why in record.harmless.items():
            assert why and key not in source, f"{record.model_type}: transformers' modeling reads {key}"
            checked += 1
    assert checked >= 15


# ----------------------------------------------------------------------------------------------------
# tiny models with every key kept
# ----------------------------------------------------------------------------------------------------
#: sizes of the tiny model (each replaces the key's value where the file has the key)
TINY = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
        "num_attention_heads": 4, "vocab_size": 128, "max_position_embeddings": 64, "num_experts_per_tok": 2,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1}
LAYERS = 4


def _shrink_text(text: dict) -> dict:
    """A text config with the same keys at tiny sizes."""
    out = copy.deepcopy(text)
    heads, kv = text["num_attention_heads"], text.get("num_key_value_heads")
    out.update({k: v for k, v in TINY.items() if k in text})
    if kv is not None:  # (GQA stays GQA, MHA stays MHA)
        out["num_key_value_heads"] = 4 if kv == heads else 2
    if "head_dim" in text and text["head_dim"] is not None:
        out["head_dim"] = 16
    sections = (text.get("rope_parameters") or {}).get("mrope_section")
    if sections:  # (multimodal RoPE: its sections split the rotated pairs, 2 + 1 + 1 of a 32-wide head's 8 dims)
        out["head_dim"] = 32
        out["rope_parameters"]["mrope_section"] = [2, 1, 1]
    groups = text.get("n_group") or 1
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if key in text:  # (group-limited routing scores each group by its best two)
            out[key] = max(8, 2 * groups)
    if text.get("q_lora_rank"):
        out["q_lora_rank"] = 16
    if "linear_num_key_heads" in text:
        ratio = text["linear_num_value_heads"] // text["linear_num_key_heads"]
        out.update(linear_num_key_heads=2, linear_num_value_heads=2 * ratio)
    if text.get("sliding_window") and text.get("layer_types"):
        out["sliding_window"] = 6  # (shorter than the test's sequences, so the window bites)
    out["num_hidden_layers"] = LAYERS
    if "layer_types" in text:
        kinds = text["layer_types"]
        out["layer_types"] = kinds[len(kinds) - LAYERS:] if kinds[-1] != kinds[0] else kinds[:LAYERS]
    if "no_rope_layers" in text:
        out["no_rope_layers"] = text["no_rope_layers"][:LAYERS]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # (ids inside the tiny vocabulary)
        value = text.get(key)
        if isinstance(value, list):
            out[key] = [2 + i for i in range(len(value))]
        elif value is not None:
            out[key] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}[key]
    return out


def _shrink(cfg: dict) -> dict:
    out = copy.deepcopy(cfg)
    if "text_config" not in cfg:
        return _shrink_text(cfg)
    out["text_config"] = _shrink_text(cfg["text_config"])
    vision = out["vision_config"]
    vision.update(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                  out_hidden_size=out["text_config"]["hidden_size"])
    if "deepstack_visual_indexes" in vision:
        vision["deepstack_visual_indexes"] = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) is not None:
            out[key] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}[key]
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (directory holding the shrunk published config.json and transformers' random weights, its model)."""
    transformers = transformers_or_skip()
    cache = {}

    def build(name):
        if name in cache:
            return cache[name]
        cfg = _shrink(_published(name))
        if name in REFUSED:
            cfg.pop(REFUSED[name][1])
        path = tmp_path_factory.mktemp(name.replace(".", "_"))
        (path / "config.json").write_text(json.dumps(cfg))
        hf_cfg = transformers.AutoConfig.from_pretrained(path)
        torch.manual_seed(0)
        model = getattr(transformers, cfg["architectures"][0])(hf_cfg)
        with torch.no_grad():  # norms off their neutral starts, routers with margins
            for param_name, p in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    p.add_(torch.empty_like(p).uniform_(-0.3, 0.3))
                elif param_name.endswith(("gate.weight", "router.weight")) or ".experts." in param_name:
                    p.normal_(0, 0.3)
                elif param_name.endswith((".bias", "sinks")):
                    p.normal_(0, 0.2)
        model = model.float().eval()
        model.save_pretrained(path)
        (path / "config.json").write_text(json.dumps(cfg))  # the published keys, not transformers' rewrite
        cache[name] = (path, model.to(DEVICE), cfg)
        return cache[name]

    return build


LOADABLE = [n for n in FILES if REFUSED.get(n, (None, "x"))[1] is not None]


def _logits(model, ids):
    out = model(input_ids=ids)
    return out.logits


def _accepted_unread(cfg: dict) -> dict:
    """The keys of a (text) config the family accepts without reading them: what a save must keep."""
    record = family(cfg["model_type"])
    keep = COMMON_KEYS | set(record.harmless) | set(record.ignored)
    return {k: v for k, v in cfg.items() if k in keep and k not in IDENTITY_KEYS}


@pytest.mark.parametrize("name", LOADABLE)
def test_tiny_model_of_the_published_file_matches_transformers_and_keeps_its_keys(name, built, tmp_path):
    transformers = transformers_or_skip()
    from tritonlm import hf

    path, theirs, cfg = built(name)
    ours = hf.from_pretrained(path, backend="reference", device=DEVICE, dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        expected = _logits(theirs, ids)
        torch.testing.assert_close(ours(ids), expected, atol=3e-5, rtol=1e-4)

    saved = hf.save_pretrained(ours, tmp_path / "saved")
    written = json.loads((saved / "config.json").read_text())
    assert written["architectures"] == cfg["architectures"] and written["model_type"] == cfg["model_type"]
    for key, value in _accepted_unread(_text(cfg)).items():
        assert _text(written).get(key) == value, f"{key} was not kept"
    if "text_config" in cfg:  # the vision-language release: its own keys and its vision tower
        for key in ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                    "vision_end_token_id", "tie_word_embeddings"):
            assert written.get(key) == cfg.get(key), key
    back = getattr(transformers, cfg["architectures"][0]).from_pretrained(saved).float().to(DEVICE).eval()
    with torch.no_grad():
        torch.testing.assert_close(_logits(back, ids), expected, atol=3e-5, rtol=1e-4)
    original = theirs.state_dict()
    for tensor_name, t in back.state_dict().items():
        if "visual" in tensor_name:
            assert torch.equal(t, original[tensor_name]), tensor_name
