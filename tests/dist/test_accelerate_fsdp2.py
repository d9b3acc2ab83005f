"""accelerate's own FSDP2 path (``fsdp_version=2``) runs shardwrap after ``install()``, at
2 ranks, bit for bit with torch's FSDP2 (tests/dist/accelerate_fsdp2_cases.py).

The script is accelerate's: a ``FullyShardedDataParallelPlugin(fsdp_version=2,
transformer_based_wrap)``, ``prepare(model, optimizer)`` (``fsdp2_prepare_model``:
``fully_shard`` on each decoder layer, the input embedding, the ``[final norm, lm_head]``
tail as one list unit, the root; then the optimizer switched onto the DTensor
parameters), ``backward``, ``clip_grad_norm_``, AdamW, ``save_state`` and ``load_state``.
It runs on torch's ``fully_shard`` and, in the same processes, after
``shardwrap.install()``. In fp32 at 2 ranks every gradient sum has two terms, so the runs
must agree bit for bit: every loss and gradient norm, and every rank's full parameters
at the end, for

* an uninterrupted run, shardwrap's against torch's;
* torch's first steps saved with ``save_state`` and resumed on shardwrap with
  ``load_state``, against torch's uninterrupted run (the checkpoint is accelerate's, not
  ours: DCP or a full state dict, through torch's ``torch.distributed.checkpoint.state_dict``);
* shardwrap's first steps saved and resumed on shardwrap, and on torch's FSDP2, the same;
* at the end of each run, ``accelerator.get_state_dict(model)`` (the full state dict
  on rank 0, empty on the others).

Cases: a tiny Llama (untied embeddings: the embedding its own unit) with accelerate's
``SHARDED_STATE_DICT`` checkpoints; a tiny GPT-2 (tied embeddings: ``wte`` joins the
tail's list unit) with ``cpu_ram_efficient_loading`` (accelerate moves the model to meta,
shards it there and loads the weights with ``load_state_dict(assign=True)``) and
``FULL_STATE_DICT`` checkpoints (rank 0 writes, ``broadcast_from_rank0`` loads).
Uninterrupted runs, the same comparison, with more of accelerate's settings: gradient
accumulation (``accelerator.accumulate``, which calls ``set_requires_gradient_sync``),
bf16 through the plugin (``MixedPrecisionPolicy(bf16, bf16, bf16)``: both sides compute
the same bf16 ops, and a two-term bf16 sum halved rounds alike), activation
checkpointing (``checkpoint_wrapper`` around each layer before ``fully_shard``),
``ignored_modules`` (``ignored_params``: each rank's own values, equal to torch's on that
rank), ``reshard_after_forward=False`` and
``cpu_offload=CPUOffloadPolicy(pin_memory=False)``.
The Hugging Face ``Trainer``'s FSDP2 (``fsdp_config={"version": 2}``, through the same
``fsdp2_prepare_model``; a tiny GPT-2, a checkpoint at step 3 of 6): shardwrap's logged
losses and final parameters equal torch's FSDP2 bit for bit, and so do those of
shardwrap's run resumed from its own checkpoint and from torch's.
``mixed_precision="fp16"`` (float16 reductions, divided around the sum as FSDP2 divides
them) is compared the same way. What the door cannot honour is refused at ``prepare``
naming the option: accelerate's ``cpu_offload=True`` (pinned host memory, CUDA only;
torch's FSDP2 fails here too).

Negative controls. In the suite: shardwrap's door with gradients not divided by the
world size (``fsdp2_cases.undivided_fully_shard`` bound in torch's place) must fail the
same comparison (it does on the gradient norms, 2.3085392 against torch's 1.1542696 at
step 0, the losses from step 5 and every parameter). Run once: the same bug under the
``Trainer`` fails its test on shardwrap's run (step 2's loss 4.2844944 against torch's
4.2844939: AdamW after the Trainer's clipping to norm 1 hides most of a gradient's
scale). Run once: without the door's ``load_state_dict(assign=True)`` hooks
(shardwrap/fsdp2/assign_load.py) the GPT-2 case trained the zeroed shards (every loss
4.5643473, log 96, against torch's 4.5742321 at step 0; the optimizer stepped the
assigned parameters, which the module stopped showing at the first forward) and failed
at ``save_state``: ``KeyError: 0`` in torch's ``get_optimizer_state_dict``, the
optimizer's parameters no longer the model's.
"""

from __future__ import annotations

import accelerate  # noqa: F401 (a declared test dependency: a broken install fails, never skips)
import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from tests.dist import accelerate_fsdp2_cases as ac
from tests.dist import fsdp2_cases as fc
from tests.dist import hf_frameworks as hf
from tests.dist.harness import run_ranks

CASES = {
    "llama_sharded_state_dict": ("llama", {"state_dict_type": "SHARDED_STATE_DICT"}),
    "gpt2_meta_loading_full_state_dict": (
        "gpt2",
        {"state_dict_type": "FULL_STATE_DICT", "cpu_ram_efficient_loading": True},
    ),
}

# More of accelerate's settings, uninterrupted runs only (no checkpoint).
VARIANTS = {
    # accelerator.accumulate: set_requires_gradient_sync(False) on all but the last microbatch
    "llama_gradient_accumulation": ("llama", {"accumulation": 2}),
    # the plugin's MixedPrecisionPolicy(bf16 params, reductions and outputs)
    "llama_bf16": ("llama", {"mixed_precision": "bf16"}),
    # fsdp2_apply_ac: checkpoint_wrapper around each layer before fully_shard
    "llama_activation_checkpointing": ("llama", {"activation_checkpointing": True}),
    # ignored_params: one MLP projection left plain and unreduced (each rank's own values)
    "llama_ignored_modules": ("llama", {"ignored_modules": r"model\.layers\.0\.mlp\.up_proj"}),
    "gpt2_no_reshard_after_forward": ("gpt2", {"reshard_after_forward": False}),
    # the plugin's offload policy as given (accelerate's cpu_offload=True is pinned: CUDA only)
    "llama_cpu_offload": ("llama", {"cpu_offload": CPUOffloadPolicy(pin_memory=False)}),
    # the plugin's MixedPrecisionPolicy(fp16 ...): float16 reductions, divided as FSDP2 does
    "llama_fp16": ("llama", {"mixed_precision": "fp16"}),
}


def differences(reference: dict, ours: dict) -> list[str]:
    """What two runs' records show differently, one line each (bit for bit)."""
    found = [
        f"{key}: {reference[key]} != {ours[key]}"
        for key in ("losses", "grad_norms", "num_fsdp", "wrapper")
        if reference[key] != ours[key]
    ]
    if reference["params"].keys() != ours["params"].keys():
        return [
            *found,
            f"parameter names {sorted(reference['params'])} != {sorted(ours['params'])}",
        ]
    for name, want in reference["params"].items():
        if not torch.equal(want, ours["params"][name]):
            found.append(f"parameter {name} differs")
    want, got = reference["full_state_dict"], ours["full_state_dict"]
    if want.keys() != got.keys():
        return [*found, f"get_state_dict keys {sorted(want)} != {sorted(got)}"]
    return found + [
        f"get_state_dict[{k!r}] differs" for k in want if not torch.equal(want[k], got[k])
    ]


def joined(first: dict, resumed: dict) -> dict:
    """A first run and its resumed run, as one record (the resumed run's parameters)."""
    return {
        **resumed,
        "losses": first["losses"] + resumed["losses"],
        "grad_norms": first["grad_norms"] + resumed["grad_norms"],
    }


def all_differences(out: dict) -> list[str]:
    found = [f"{run}: {line}" for run in ("torch", "shardwrap") for line in checks(run, out[run])]
    comparisons = {
        "shardwrap": out["shardwrap"],
        "torch saved, shardwrap resumed": joined(out["torch_first"], out["resumed_from_torch"]),
        "shardwrap saved and resumed": joined(out["shardwrap_first"], out["resumed"]),
        "shardwrap saved, torch resumed": joined(
            out["shardwrap_first"], out["torch_resumed_from_shardwrap"]
        ),
    }
    for label, record in comparisons.items():
        found += [f"{label}: {line}" for line in differences(out["torch"], record)]
    return found


def checks(run: str, record: dict) -> list[str]:
    """That the run was on the door it names, with the optimizer on the model's parameters."""
    found = []
    if len(record["grad_norms"]) != 2 * hf.STEPS or len(record["params"]) == 0:
        found.append(f"{len(record['grad_norms'])} steps, {len(record['params'])} parameters")
    if record["door"] != (run == "shardwrap"):
        found.append(f"shardwrap's FSDPModule: {record['door']}")
    if not record["optimizer_holds_model_params"]:
        found.append("the optimizer does not hold the model's parameters")
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_accelerate_fsdp2_equals_torch_fsdp2_bit_for_bit(case, tmp_path):
    kind, options = CASES[case]
    for rank, out in enumerate(run_ranks(ac.runs, 2, kind, options, str(tmp_path))):
        assert bool(out["torch"]["full_state_dict"]) == (rank == 0)
        found = all_differences(out)
        assert found == [], f"rank {rank}: {found[:8]}"


def test_accelerate_fsdp2_on_three_ranks_equals_torch_fsdp2_bit_for_bit(tmp_path):
    """Three terms per gradient sum, in gloo's order ([Note: gloo's sum order]).
    Negative control (run once): the door's sums in rank order, 86 to 168 differences."""
    kind, options = CASES["llama_sharded_state_dict"]
    for rank, out in enumerate(run_ranks(ac.runs, 3, kind, options, str(tmp_path))):
        found = all_differences(out)
        assert found == [], f"rank {rank}: {found[:8]}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_accelerate_fsdp2_settings_equal_torch_fsdp2_bit_for_bit(variant):
    kind, options = VARIANTS[variant]
    for rank, out in enumerate(run_ranks(ac.straight_runs, 2, kind, options)):
        found = [f"{run}: {line}" for run in out for line in checks(run, out[run])]
        found += differences(out["torch"], out["shardwrap"])
        assert found == [], f"rank {rank}: {found[:8]}"


# What the door cannot honour, refused at prepare naming the option (the message's key).
REFUSED = {
    # accelerate's cpu_offload=True is CPUOffloadPolicy() (pinned): CUDA only; torch's
    # FSDP2 fails on this machine too ("Cannot access accelerator device")
    "pinned_cpu_offload": ({"cpu_offload": True}, "pin_memory"),
}


@pytest.mark.parametrize("refused", list(REFUSED))
def test_what_the_door_cannot_honour_is_refused_by_name(refused):
    options, name = REFUSED[refused]
    for rank, message in enumerate(run_ranks(ac.refusal, 2, "llama", options)):
        assert message.startswith("ValueError") and name in message, (rank, message)


@pytest.mark.parametrize("world_size", [2, 3])
def test_trainer_fsdp2_equals_torch_fsdp2_and_resumes_bit_for_bit(world_size, tmp_path):
    """At 3 ranks the sums follow gloo's order ([Note: gloo's sum order]); negative
    control (run once): the door's sums in rank order, 23 parameters apart per run."""
    for rank, out in enumerate(run_ranks(ac.trainer_runs, world_size, str(tmp_path))):
        torch_run = out["torch"]
        assert len(torch_run["losses"]) == 2 * hf.STEPS and torch_run["params"], rank
        assert [out[run]["door"] for run in out] == [False, True, True, True], rank
        for run in ("shardwrap", "resumed", "resumed_from_torch"):
            want = torch_run["losses"][-len(out[run]["losses"]) :]
            assert out[run]["losses"] == want, (rank, run)
            assert out[run]["params"].keys() == torch_run["params"].keys(), (rank, run)
            differing = [
                n
                for n, p in torch_run["params"].items()
                if not torch.equal(p, out[run]["params"][n])
            ]
            assert differing == [], (rank, run, differing[:4])
        assert len(out["resumed"]["losses"]) == hf.STEPS, rank


def test_negative_control_undivided_gradients_differ(tmp_path):
    kind, options = CASES["llama_sharded_state_dict"]
    out = run_ranks(ac.runs, 2, kind, options, str(tmp_path), fc.undivided_fully_shard)
    for rank, record in enumerate(out):
        found = all_differences(record)
        assert any(line.startswith("shardwrap: grad_norms") for line in found), (rank, found[:8])
