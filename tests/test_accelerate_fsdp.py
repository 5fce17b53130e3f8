"""accelerate's FSDP2 on a revified Hugging Face model (issue 15): 2 CPU processes, gloo.

accelerate turns FSDP on only on accelerators (a CPU run falls back to DDP), so the workers switch
its state to FSDP after building the Accelerator: ``prepare`` then runs the FSDP2 code users run
on GPUs (``transformer_based_wrap`` from the model's ``_no_split_modules``, ``fully_shard`` per
decoder layer and at the root, the full state dict loaded into the shards). Two training steps on
half a batch each must give the gradients and weights of one process on the whole batch.
"""
import os
import socket
import traceback

import pytest
import torch

from ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORLD, STEPS, LAYERS = 2, 2, 3
SPAWN_TIMEOUT = 240
CASES = {"float64-float": (torch.float64, False, 1e-9), "float32-exact": (torch.float32, True, 1e-5)}


def make_model(dtype, exact):
    import transformers

    from revtriton import revify

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    # The library's loss in both runs: accelerate makes lm_head an FSDP unit of its own, which keeps
    # the library's loss (revtriton.lm_loss); the fused one computes float64 logits in float64 where the
    # library's upcast is to float32.
    return revify(transformers.LlamaForCausalLM(config).to(dtype), exact=exact, fused_loss=False)


def batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2 * WORLD, 12), generator=generator) for _ in range(STEPS)]


def single_process(dtype, exact):
    """Gradients and weights of each step in one process: the mean loss of the ranks' halves of the
    batch (float64: the whole batch at once, the same up to summation order; float32 exact streams
    run the same halves, since GEMMs of another row count round differently and a stream value one
    grid step off moves a small gradient by ~1e-4 of its size)."""
    model = make_model(dtype, exact)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    grads, weights = [], []
    for ids in batches():
        if dtype == torch.float64:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            sum(model(input_ids=part, labels=part).loss for part in ids.chunk(WORLD)).div(WORLD).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return grads, weights


def accelerate_fsdp2(rank, dtype, exact):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP  # what a GPU run has (see the module doc)
    accelerator.state.fsdp_plugin = plugin
    model = make_model(dtype, exact)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    layer_classes = [type(layer).__name__ for layer in model.model.layers]
    from revtriton.lm_loss import fusable_head

    assert fusable_head(model) is None  # the sharded head: the fused loss would bypass its FSDP hooks
    grads, weights = [], []
    for ids in batches():
        local = ids.chunk(WORLD)[rank]
        accelerator.backward(model(input_ids=local, labels=local).loss)
        grads.append({name: p.grad.full_tensor() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights.append({name: p.detach().full_tensor() for name, p in model.named_parameters()})
    return {"layer_classes": layer_classes, "root_class": type(model).__name__, "grads": grads, "weights": weights}


def worker(rank, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks share the CPU cores
    results = {}
    for name, (dtype, exact, _) in CASES.items():
        try:
            results[name] = accelerate_fsdp2(rank, dtype, exact)
        except Exception:  # recorded: the test of that case fails with the traceback
            results[name] = {"exception": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("accelerate")
    port = free_port()
    run_ranks(worker, lambda rank: (rank, port, str(out_dir)), WORLD, SPAWN_TIMEOUT)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def max_rel_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)).item() for k in want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_accelerate_fsdp2_shards_each_layer_and_matches_one_process(results, case):
    dtype, exact, tolerance = CASES[case]
    grads, weights = single_process(dtype, exact)
    for rank_results in results:
        r = rank_results[case]
        assert "exception" not in r, r["exception"]
        # each decoder layer is its own FSDP unit (found by the library's layer name), the root too
        assert r["layer_classes"] == ["FSDPLlamaDecoderLayer"] * LAYERS and r["root_class"].startswith("FSDP")
        for step in range(STEPS):
            assert max_rel_error(r["grads"][step], grads[step]) <= tolerance, step
            assert max_rel_error(r["weights"][step], weights[step]) <= tolerance, step
