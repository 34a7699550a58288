"""Hugging Face <-> Megatron weights: lossless both ways, in the layouts Megatron expects,
and a GPTModel built from them (TP = 2, spawned gloo ranks) gives the HF logits.

Llama (untied and tied embeddings) and Qwen2 (QKV bias) tiny models.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from miles.backends.megatron.model import ModelShape, hf_to_megatron, megatron_to_hf, read_hf_state_dict

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tied_llama_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = tmp_path_factory.mktemp("tiny_tied_llama")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "tied"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir, tied_llama_dir) -> Path:
    return {"llama": tiny_model_dir, "qwen2": tiny_qwen2_dir, "tied": tied_llama_dir}[request.param]


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_round_trip_is_lossless(model_dir, tp):
    shape = ModelShape.from_hf_dir(model_dir)
    hf = read_hf_state_dict(model_dir)
    shards = [hf_to_megatron(hf, shape, rank, tp) for rank in range(tp)]
    back = megatron_to_hf(shards, shape)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    assert ("output_layer.weight" in shards[0]) is (not shape.tie_word_embeddings)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in shards[0]) is (shape.arch == "qwen2")


def test_shape_reads_the_architecture(tiny_model_dir, tiny_qwen2_dir, tied_llama_dir):
    llama, qwen2, tied = (ModelShape.from_hf_dir(d) for d in (tiny_model_dir, tiny_qwen2_dir, tied_llama_dir))
    assert (llama.arch, llama.qkv_bias, llama.tie_word_embeddings) == ("llama", False, False)
    assert (qwen2.arch, qwen2.qkv_bias) == ("qwen2", True)
    assert tied.tie_word_embeddings
    assert (llama.num_heads, llama.num_query_groups, llama.head_dim) == (4, 2, 16)
    with pytest.raises(ValueError, match="does not divide the model's num_key_value_heads"):
        llama.check_tp(4)


def test_fused_layouts_at_tp2(tiny_qwen2_dir):
    """linear_qkv rows per query group (its q heads, its k head, its v head), each rank a
    run of whole groups; linear_fc1 each rank's gate rows then its up rows."""
    shape = ModelShape.from_hf_dir(tiny_qwen2_dir)
    hf = read_hf_state_dict(tiny_qwen2_dir)
    d, attn = shape.head_dim, "model.layers.1.self_attn."
    for rank in range(2):
        local = hf_to_megatron(hf, shape, rank, 2)
        for suffix in ("weight", "bias"):
            q, k, v = (hf[attn + f"{p}_proj.{suffix}"] for p in "qkv")
            # 4 heads in 2 groups: rank r holds group r = q heads 2r, 2r + 1, k head r, v head r.
            expected = torch.cat([q[2 * rank * d : (2 * rank + 2) * d], k[rank * d : (rank + 1) * d],
                                  v[rank * d : (rank + 1) * d]])
            assert torch.equal(local[f"decoder.layers.1.self_attention.linear_qkv.{suffix}"], expected)
        half = shape.ffn_hidden_size // 2
        gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
        expected = torch.cat([gate[rank * half : (rank + 1) * half], up[rank * half : (rank + 1) * half]])
        assert torch.equal(local["decoder.layers.1.mlp.linear_fc1.weight"], expected)
        o = hf[attn + "o_proj.weight"]
        assert torch.equal(local["decoder.layers.1.self_attention.linear_proj.weight"],
                           o[:, rank * 32 : (rank + 1) * 32])


def _rank_logits(rank: int, world: int, rendezvous: str, dirs: list[str], out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from miles.backends.megatron.model import build_gpt_model, forward_logits, load_hf_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    ids = torch.randint(4, 100, (3, 10), generator=torch.Generator().manual_seed(0))
    logits = {}
    for d in dirs:
        shape = ModelShape.from_hf_dir(d)
        model = build_gpt_model(shape)
        load_hf_weights(model, shape, read_hf_state_dict(d))
        with torch.no_grad():
            logits[d] = forward_logits(model.eval(), shape, ids)
    if rank == 0:
        torch.save({"ids": ids, "logits": logits}, out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_gpt_model_at_tp2_gives_the_hf_logits(tiny_qwen2_dir, tied_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    dirs = [str(tiny_qwen2_dir), str(tied_llama_dir)]
    rendezvous = f"file://{tmp_path / 'rendezvous'}"  # the ranks meet in a file: no port to pick
    mp.start_processes(_rank_logits, args=(2, rendezvous, dirs, str(tmp_path / "out.pt")), nprocs=2, join=True,
                       start_method="spawn")
    seen = torch.load(tmp_path / "out.pt")
    for d in dirs:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf(input_ids=seen["ids"]).logits
        assert seen["logits"][d].shape == expected.shape
        assert float((seen["logits"][d] - expected).abs().max()) <= 1e-4
