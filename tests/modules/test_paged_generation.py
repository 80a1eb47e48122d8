"""Batched generation of ragged prompts through a paged KV cache (``TransformerLM.generate`` with a list of
prompts): greedy output equals generating each prompt alone through the dense cache path, sequences stop on their
own and free their blocks, cache memory follows the tokens actually cached; reference and fused backends."""

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM
from tritonlm.modules.cache import PagedKVCache

from helpers import DEVICE

PROMPT_LENGTHS = (5, 17, 1, 33)


def _config(**overrides):
    base = dict(vocab_size=97, context_length=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64)
    return ModelConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    reference = TransformerLM.from_config(_config(), backend="reference").to(DEVICE)
    fused = TransformerLM.from_config(_config(), backend="triton").to(DEVICE)
    fused.load_state_dict(reference.state_dict())
    return {"reference": reference, "triton": fused}


def _prompts(lengths=PROMPT_LENGTHS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).to(DEVICE) for n in lengths]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ragged_greedy_equals_one_at_a_time(models, backend):
    model = models[backend]
    prompts = _prompts() if backend == "reference" else _prompts((5, 17, 1))
    new = 10 if backend == "reference" else 5
    outs = model.generate(prompts, new, temperature=0)
    assert isinstance(outs, list) and len(outs) == len(prompts)
    for p, out in zip(prompts, outs):
        alone = model.generate(p, new, temperature=0)  # the dense-cache path, batch 1
        assert out.tolist() == alone.tolist()
        assert len(out) == len(p) + new


def test_fused_and_reference_ragged_batches_agree(models):
    prompts = _prompts((9, 2, 20))
    got = models["triton"].generate(prompts, 4, temperature=0)
    want = models["reference"].generate(prompts, 4, temperature=0)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_sequences_stop_independently_on_eos(models):
    model = models["reference"]
    prompts = _prompts()
    free_run = [model.generate(p, 12, temperature=0) for p in prompts]
    eos = int(free_run[0][len(prompts[0]) + 2])  # the third token of the first prompt's continuation
    outs = model.generate(prompts, 12, temperature=0, eos_id=eos)
    for p, out, free in zip(prompts, outs, free_run):
        cont = free[len(p):].tolist()
        expected = cont[:cont.index(eos) + 1] if eos in cont else cont  # stops right after its own eos
        assert out[len(p):].tolist() == expected
    assert len(outs[0]) - len(prompts[0]) <= 3  # the first prompt stopped at (or before) its third token


def test_sampling_options_apply_to_the_batch(models):
    model = models["reference"]
    prompts = _prompts()
    a = model.generate(prompts, 6, temperature=0.8, top_k=5, top_p=0.9, generator=torch.Generator(DEVICE).manual_seed(3))
    b = model.generate(prompts, 6, temperature=0.8, top_k=5, top_p=0.9, generator=torch.Generator(DEVICE).manual_seed(3))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]  # reproducible under a seed
    allowed = torch.zeros(97, dtype=torch.bool)
    allowed[10:20] = True
    outs = model.generate(prompts, 6, temperature=1.0, allowed=allowed)
    for p, out in zip(prompts, outs):
        assert all(10 <= t < 20 for t in out[len(p):].tolist())


def test_cache_memory_follows_cached_tokens(models):
    """Four short prompts in a model whose context is 4096: the pool holds about the tokens cached (rounded up to
    blocks, doubling growth), never 4 x 4096 positions; blocks of finished sequences are reused."""
    torch.manual_seed(0)
    model = TransformerLM.from_config(_config(context_length=4096), backend="reference").to(DEVICE)
    model.generate(_prompts(), 8, temperature=0, page_size=16)
    stats = model.last_generation_cache
    final = sum(-(-(n + 7) // 16) for n in PROMPT_LENGTHS)  # blocks of the cached positions at the last step
    assert stats["peak_blocks_in_use"] == final
    assert stats["pool_blocks"] <= 2 * final
    per_block = 2 * 2 * 16 * 2 * 8 * 4  # (k, v) x layers x page x kv heads x d_k x fp32 bytes
    assert stats["pool_bytes"] == stats["pool_blocks"] * per_block
    assert stats["pool_bytes"] < 4 * 4096 * per_block / 16 / 20


def test_paged_cache_reuses_freed_blocks_and_grows_on_demand():
    cache = PagedKVCache(num_layers=1, max_len=1000, page_size=16, initial_blocks=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.prepare([0, 1], 40, torch.device("cpu"))  # 3 blocks each: the pool doubles from 4 to 8
    assert cache.reserved == 8 and cache.blocks_in_use == 6
    assert cache.block_table.shape == (2, 3) and cache.cache_seqlens.tolist() == [0, 0]
    cache.commit()
    cache.free(0)
    cache.add_sequence(2)
    cache.prepare([1, 2], 30, torch.device("cpu"))  # 1 grows to 70 positions (5 blocks); 2 takes 2 freed blocks
    assert cache.reserved == 8 and cache.blocks_in_use == 5 + 2  # (no growth: 0's blocks were reused)
    assert cache.cache_seqlens.tolist() == [40, 0]
    with pytest.raises(ValueError, match="max_len"):
        cache.prepare([1], 1000, torch.device("cpu"))
    with pytest.raises(ValueError, match="multiple of 16"):
        PagedKVCache(1, 100, page_size=10)


def test_ragged_generation_errors(models):
    model = models["reference"]
    with pytest.raises(ValueError, match="exceed context_length"):
        model.generate([torch.arange(90), torch.arange(3)], 10)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty"):
        model.generate([torch.arange(3), torch.tensor([], dtype=torch.long)], 2)
    assert [o.tolist() for o in model.generate([[1, 2], [3]], 0)] == [[1, 2], [3]]


def test_a_prompt_longer_than_the_context_is_refused():
    """Issue 31: the tensor path refuses a prompt the context cannot hold (as the list path does), rather than
    cropping it to its last context_length tokens."""
    model = TransformerLM(vocab_size=20, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    with pytest.raises(ValueError, match=r"9 tokens \+ max_new_tokens 2 exceed context_length 8"):
        model.generate(torch.arange(9) % 20, max_new_tokens=2)
    with pytest.raises(ValueError, match="context_length 8"):
        model.generate([torch.arange(9) % 20], max_new_tokens=2)
    assert model.generate(torch.arange(5) % 20, max_new_tokens=3, temperature=0).shape == (8,)
