"""Hugging Face causal LMs (GPT-2, Llama tied and untied) trained, saved and reloaded.

One spawn of 2 ranks runs every case: training parity against the unwrapped model with the
model's own activation checkpointing, save -> consolidate -> ``from_pretrained`` giving the
trained weights, and ``load_pretrained`` of a ``save_pretrained`` folder into a fresh
sharded model. Models are built from tiny configs; nothing is downloaded.
"""

from __future__ import annotations

import copy
import functools
import os

import torch
import torch.distributed as dist
import transformers

import shardwrap
from shardwrap.checkpoint import save_checkpoint
from shardwrap.ckpt.consolidate import consolidate
from shardwrap.ckpt.pretrained import load_pretrained
from shardwrap.policies import transformer_auto_wrap_policy
from tests.dist.harness import run_ranks
from tests.dist.parity import (
    check_shards,
    gradient_l1,
    param_drift,
    reordered_relative,
    reordered_tol,
)
from tests.tolerances import (
    low_precision_relative,
    reordered_loss_atol,
    reordered_sgd_param_atol,
    step_rounding_rtol,
)

CASES = (("gpt2", True), ("llama", True), ("llama", False))  # (architecture, tied head)
NUM_STEPS = 3
LR = 0.1  # SGD, momentum 0.9, no weight decay (parity's SGD bound, with it, holds a fortiori)
BATCH_PER_RANK, SEQ, VOCAB = 2, 16, 64
# All-gathers of one FULL_SHARD step with 3 units (root + 2 decoder layers): forward and
# backward once each; from the second step on the last layer stays gathered from forward
# into backward. Checkpointing runs inside the units' hooks, so it adds none.
GATHERS_BY_STEP = [6, 5, 5]
# bf16 compute: each rank's bf16 gradient of half the batch, averaged in fp32, against the
# reference's bf16 gradient of the whole batch: the same chains of bf16-rounded ops in other
# orders (tolerances.low_precision_relative). Per decoder layer at most 24 rounded outputs forward
# (Llama: 2 per RMSNorm, q projection, 3 for the rotary embedding, attention, o_proj, the
# residual add, gate, SiLU, the product with up, down, the residual add; GPT-2 fewer but
# for gelu_new's 8 pointwise ops) and as many backward; the embeddings, the final norm and
# the head each way and the parameters' cast add 9: under 128 for two layers.
BF16_ROUNDINGS = 128


def bf16_param_tol(largest_grad: float) -> dict[str, float]:
    """The fp32 master parameters after ``NUM_STEPS`` SGD steps on bf16 gradients against
    the reference's: ``reordered_sgd_param_atol`` at ``low_precision_relative(BF16_ROUNDINGS)``,
    the terms' scale twice the largest gradient element the reference saw (as
    tolerances.GRAD_SCALE sits above its models'), and each step's fp32 rounding.
    Measured worst difference: 2.1e-4 (GPT-2), 2.0e-4 (Llama tied), 1.4e-4 (Llama
    untied), against bounds of 2.6e-2, 1.1e-2 and 1.2e-2; control: every sharded gradient
    doubled put them 6.4e-2, 3.1e-2 and 2.9e-2 apart (2.5 to 2.8 bounds)."""
    atol = reordered_sgd_param_atol(
        NUM_STEPS, lr=LR, momentum=0.9, relative=low_precision_relative(BF16_ROUNDINGS),
        grad_scale=2.0 * largest_grad,
    )  # fmt: skip
    return {"rtol": step_rounding_rtol(NUM_STEPS), "atol": atol}


def tiny_model(arch: str, tie: bool, seed: int) -> torch.nn.Module:
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
            tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
    torch.manual_seed(seed)
    # from_config returns the model in eval mode, where checkpointing is skipped.
    return transformers.AutoModelForCausalLM.from_config(config).train()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.transformer.h if hasattr(model, "transformer") else model.model.layers)


def wrap(model: torch.nn.Module, **kwargs) -> shardwrap.ShardedModule:
    layer_cls = {type(decoder_layers(model)[0])}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
    return shardwrap.ShardedModule(
        model, sharding_strategy="FULL_SHARD", auto_wrap_policy=policy, **kwargs
    )


def tokens(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (BATCH_PER_RANK, SEQ), generator=generator)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD, not Adam: GPT-2's key bias has a mathematically zero gradient (softmax ignores a
    # shift shared by all keys), and Adam scales its rounding noise, whose sign depends on
    # summation order, up to full-size steps. SGD keeps the comparison about the gradients.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def bf16_reference_step(master: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Forward/backward with a bf16 copy of ``master``; fp32 gradients land on ``master``."""
    compute = copy.deepcopy(master)
    for param in compute.parameters():
        param.data = param.data.to(torch.bfloat16)
    loss = compute(input_ids=batch, labels=batch).loss
    loss.backward()
    for master_param, param in zip(master.parameters(), compute.parameters(), strict=True):
        master_param.grad = param.grad.float()
    return loss.detach().float()


def _train(rank: int, world_size: int, arch: str, tie: bool, bf16: bool):
    model = tiny_model(arch, tie, seed=0)
    reference = copy.deepcopy(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # Calls of layer 0's MLP: twice per step when checkpointing recomputes. A pre-hook, as
    # the recomputation stops once it has every saved tensor, before the MLP returns.
    recomputes = []
    decoder_layers(model)[0].mlp.register_forward_pre_hook(lambda *_: recomputes.append(1))
    precision = shardwrap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sharded = wrap(model, mixed_precision=precision if bf16 else None)
    optim, ref_optim = sgd(sharded), sgd(reference)
    gathers, largest_grad = [], 0.0
    for step in range(NUM_STEPS):
        batches = [tokens(step, r) for r in range(world_size)]
        whole = torch.cat(batches)
        if bf16:
            ref_loss = bf16_reference_step(reference, whole)
        else:
            ref_loss = reference(input_ids=whole, labels=whole).loss
            ref_loss.backward()
        grad_l1 = gradient_l1(reference)
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        largest_grad = max(largest_grad, max(float(g.abs().max()) for g in grads))
        ref_optim.step()
        ref_optim.zero_grad()
        sharded.comm_ledger.reset()
        loss = sharded(input_ids=batches[rank], labels=batches[rank]).loss
        loss.backward()
        gathers.append(sharded.comm_ledger.count("all_gather", "params"))
        optim.step()
        optim.zero_grad()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        if not bf16:  # within the SGD bounds of tests/tolerances.py (via tests/dist/parity.py)
            drift = param_drift(reference, reordered_tol("sgd", step, lr=LR)) if step else 0.0
            atol = reordered_loss_atol(
                float(ref_loss.detach()), grad_l1, drift, reordered_relative()
            )
            torch.testing.assert_close(mean_loss / world_size, ref_loss, rtol=0.0, atol=atol)
            check_shards(sharded, reference, exact=False, tol=reordered_tol("sgd", step + 1, lr=LR))
    stats = {"gathers": gathers, "recomputes": len(recomputes), "largest_grad": largest_grad}
    return sharded, reference, optim, stats


def _max_param_diff(sharded, reference) -> float:
    full = sharded.state_dict()
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


def _save_consolidate_reload(rank: int, sharded, optim, folder: str) -> dict:
    """Save sharded, consolidate, ``from_pretrained``; the result must be the trained model."""
    save_checkpoint(os.path.join(folder, "ckpt"), sharded, optim)
    trained = sharded.state_dict()  # collective: every rank gathers
    if rank != 0:
        return {}
    export = os.path.join(folder, "hf")
    consolidate(os.path.join(folder, "ckpt"), export)
    sharded.module.config.save_pretrained(export)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        export, output_loading_info=True
    )
    problems = {kind: names for kind, names in info.items() if names}  # missing, unexpected...
    assert not problems, problems
    loaded = reloaded.state_dict()
    assert sorted(loaded) == sorted(trained), (sorted(loaded), sorted(trained))
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    head, embedding = reloaded.get_output_embeddings(), reloaded.get_input_embeddings()
    return {"reloaded_tied": head.weight is embedding.weight, "keys": len(loaded)}


def _load_pretrained(rank: int, arch: str, tie: bool, folder: str) -> dict:
    """``save_pretrained`` of one model loads into a sharded, differently seeded one."""
    source = tiny_model(arch, tie, seed=1)
    hf_folder = os.path.join(folder, "pretrained")
    split = arch == "llama" and not tie  # also read the sharded layout with an index
    if rank == 0:
        source.save_pretrained(hf_folder, max_shard_size="20KB" if split else "50GB")
    dist.barrier()
    sharded = wrap(tiny_model(arch, tie, seed=2))
    load_pretrained(sharded, hf_folder)
    full = sharded.state_dict()
    assert sorted(full) == sorted(source.state_dict())
    for name, value in source.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
    batch = tokens(99, 0)
    with torch.no_grad():
        expected = source(input_ids=batch).logits
        torch.testing.assert_close(sharded(input_ids=batch).logits, expected, rtol=0, atol=0)
    # generate() reads parameters outside forward (device, dtype, tied head) and loops over
    # forward with a KV cache; registered, it runs on gathered parameters.
    shardwrap.register_forward_method(sharded, "generate")
    prompt = batch[:, :4]
    options = {"max_new_tokens": 6, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    generated = sharded.generate(prompt, **options)
    assert torch.equal(generated, source.generate(prompt, **options)), generated
    return {"files": sorted(os.listdir(hf_folder)), "generated": tuple(generated.shape)}


def hf_worker(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for arch, tie in CASES:
        folder = os.path.join(root, f"{arch}-{'tied' if tie else 'untied'}")
        sharded, reference, optim, stats = _train(rank, world_size, arch, tie, bf16=False)
        stats.update(_save_consolidate_reload(rank, sharded, optim, folder))
        stats.update(_load_pretrained(rank, arch, tie, folder))
        sharded, reference, _, bf16_stats = _train(rank, world_size, arch, tie, bf16=True)
        stats["bf16_gathers"] = bf16_stats["gathers"]
        stats["bf16_max_diff"] = _max_param_diff(sharded, reference)
        tol = bf16_param_tol(bf16_stats["largest_grad"])
        stats["bf16_tol"] = tol["atol"]
        torch.testing.assert_close(sharded.state_dict(), dict(reference.state_dict()), **tol)
        results[(arch, tie)] = stats
    return results


def test_hf_models_train_save_reload(tmp_path):
    results = run_ranks(hf_worker, 2, str(tmp_path))
    for (arch, tie), stats in results[0].items():
        case = (arch, tie, stats)
        assert stats["gathers"] == GATHERS_BY_STEP[:NUM_STEPS], case
        assert stats["bf16_gathers"] == GATHERS_BY_STEP[:NUM_STEPS], case
        assert stats["recomputes"] == 2 * NUM_STEPS, case  # checkpointing really recomputed
        assert stats["reloaded_tied"] is tie, case
        files = stats["files"]
        assert "config.json" in files, case
        assert stats["generated"] == (BATCH_PER_RANK, 4 + 6), case
        if arch == "llama" and not tie:
            assert "model.safetensors.index.json" in files and len(files) > 3, case
        else:
            assert "model.safetensors" in files, case
        print(
            f"{arch} tied={tie}: bf16 worst parameter difference {stats['bf16_max_diff']:.2e}"
            f" (bound {stats['bf16_tol']:.2e})"
        )
