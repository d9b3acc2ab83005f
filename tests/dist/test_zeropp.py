"""ZeRO++ (issue #22): quantized all-gather (qwZ), quantized gradient reduction (qgZ), hpZ.

Bytes are checked twice: on the ledger (what shardwrap recorded) and on the wire (what
this rank handed to ``ProcessGroup.send``, counted by the benchmark's CollectiveCounter;
gloo's CPU all-gathers, reduce-scatters and all-to-alls run as pairwise sends). Training
is checked bit for bit against a one-process reference that applies the same quantize ->
dequantize -> sum ([Note: the ZeRO++ reference] in zeropp_reference.py), with negative
controls (a qgZ that double-counts, forgets the 1/N, zeroes, or skips quantizing) that
must fail it.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import shardwrap
from benchmarks import gpt
from benchmarks.comm_count import CollectiveCounter
from shardwrap import CommQuantization, MixedPrecision, profile
from shardwrap.base.quantize import BlockCodec, dequantize, quantize
from shardwrap.comm import quantized
from shardwrap.comm.collectives import CommLedger, Communicator
from shardwrap.features import grad_clip
from shardwrap.policies import ModuleWrapPolicy
from tests.dist.harness import run_ranks
from tests.dist.parity import check_shards
from tests.dist.zeropp_reference import SGD_LR, Fault, Reference, faulty, geometry, mismatches

CONFIG = gpt.GPTConfig(vocab=128, dim=64, depth=2, num_heads=4, seq=32)
BATCH = 4
QWZ = {"weights": True}
QGZ8 = {"gradients": True}
QGZ4 = {"gradients": True, "gradient_bits": 4}
ALL_THREE = {"weights": True, "gradients": True, "hpz_partition_size": 2}
# The bars: bytes against fp32.
QWZ_MAX_RATIO = 0.27
QGZ8_MAX_RATIO = 0.27
QGZ4_MAX_RATIO = 0.15


# ------------------------------------------------------------------ collectives
def _collectives_worker(rank: int, world_size: int, bits: int) -> int:
    codec = BlockCodec(bits, 16)
    comm = Communicator(dist.group.WORLD, CommLedger())
    numel = 37  # three blocks, the last one partial
    gen = [torch.Generator().manual_seed(r) for r in range(world_size)]
    shards = [torch.randn(numel, generator=g) * (r + 1) for r, g in enumerate(gen)]
    out = torch.empty(world_size * numel)
    quantized.all_gather(comm, out, shards[rank], purpose="t", unit="u", codec=codec).wait()
    expected = torch.cat([dequantize(quantize(s, codec), numel, codec) for s in shards])
    assert torch.equal(out, expected)

    fulls = [torch.randn(world_size * numel, generator=g) for g in gen]
    mine = [f.view(world_size, -1)[rank] for f in fulls]
    reduced = torch.empty(numel)
    quantized.reduce_scatter(comm, reduced, fulls[rank], purpose="g", unit="u", codec=codec).wait()
    parts = [
        p if r == rank else dequantize(quantize(p, codec), numel, codec) for r, p in enumerate(mine)
    ]
    assert torch.equal(reduced, torch.stack(parts).sum(dim=0))

    # the all-reduce across replica groups: tests/dist/test_zeropp_hierarchical.py
    gather, exchange = comm.ledger.records
    wire_rows = world_size * codec.row_bytes(numel)
    assert (gather.kind, gather.num_bytes) == ("all_gather", wire_rows)
    assert gather.unquantized_bytes == world_size * numel * 4
    assert (exchange.kind, exchange.num_bytes) == ("all_to_all", wire_rows)
    assert exchange.unquantized_bytes == world_size * numel * 4
    return len(comm.ledger.records)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize(("bits", "world_size"), [(8, 2), (4, 2), (8, 3)])
def test_quantized_collectives_match_quantize_then_sum(bits: int, world_size: int) -> None:
    # three ranks: a rank's own unquantized part is added first, in the middle, or last
    assert run_ranks(_collectives_worker, world_size, bits) == [2] * world_size


# ------------------------------------------------------------------ training
def _wrap(quant: dict | None, strategy: str = "FULL_SHARD", **kwargs) -> shardwrap.ShardedModule:
    torch.manual_seed(1234)
    return shardwrap.ShardedModule(
        gpt.build(CONFIG),
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
        comm_quantization=CommQuantization(**quant) if quant is not None else None,
        **kwargs,
    )


def _loss(model, step: int, rank: int) -> torch.Tensor:
    inputs, targets = gpt.batch(CONFIG, step=step, rank=rank, batch_size=BATCH)
    return gpt.loss_fn(model(inputs).float(), targets)  # fp32 loss under bf16 too


def _mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


# -------------------------------------------------------------------- bytes
def _traffic_worker(rank: int, world_size: int, quant: dict | None, strategy: str) -> dict:
    """Second step's forward and backward: ledger bytes by kind, and bytes sent."""
    counter = CollectiveCounter()
    counter.install()
    model = _wrap(quant, strategy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ledger = model.comm_ledger
    out = {}
    for step in range(2):
        ledger.reset()
        counter.reset()
        counter.counting = True
        with profile.profile_step(model) as measured:
            loss = _loss(model, step, rank)
            forward = list(ledger.records)
            sent_forward = counter.reset().get("send", (0, 0))[1]
            loss.backward()
            counter.counting = False
            backward = ledger.records[len(forward) :]
            sent_backward = counter.reset().get("send", (0, 0))[1]
        optim.step()
        optim.zero_grad()
    out["saved"] = measured.saved_bytes()
    out["forward_gather"] = sum(r.num_bytes for r in forward if r.purpose == "params")
    out["forward_sent"] = sent_forward
    out["backward_gather"] = sum(r.num_bytes for r in backward if r.purpose == "params")
    out["grads"] = sum(r.num_bytes for r in backward if r.purpose == "grads")
    out["backward_sent"] = sent_backward
    out["unquantized"] = sum(r.unquantized_bytes for r in forward + backward)
    out["kinds"] = sorted({(r.kind, r.purpose) for r in forward + backward})
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_qwz_forward_gather_moves_a_quarter_of_fp32(world_size: int) -> None:
    plain = run_ranks(_traffic_worker, world_size, None, "FULL_SHARD")
    quant = run_ranks(_traffic_worker, world_size, QWZ, "FULL_SHARD")
    for p, q in zip(plain, quant, strict=True):
        assert 0 < q["forward_gather"] <= QWZ_MAX_RATIO * p["forward_gather"]
        assert 0 < q["forward_sent"] <= QWZ_MAX_RATIO * p["forward_sent"]
        # backward's gathers are quantized too ([Note: every gather under qwZ is quantized]
        # in core/comm_quant.py); its reduce-scatters are untouched
        assert 0 < q["backward_gather"] <= QWZ_MAX_RATIO * p["backward_gather"]
        assert q["backward_sent"] < p["backward_sent"] and q["grads"] == p["grads"]
        # the ledger says what the plain gathers would have moved, the profile what was saved
        plain_gathers = p["forward_gather"] + p["backward_gather"]
        assert q["unquantized"] == plain_gathers
        quantized_gathers = q["forward_gather"] + q["backward_gather"]
        assert q["saved"] == plain_gathers - quantized_gathers and p["saved"] == 0


@pytest.mark.parametrize(
    ("quant", "ratio", "world_size"),
    [(QGZ8, QGZ8_MAX_RATIO, 2), (QGZ4, QGZ4_MAX_RATIO, 2), (QGZ8, QGZ8_MAX_RATIO, 4)],
)
def test_qgz_reduction_moves_a_fraction_of_fp32(quant: dict, ratio: float, world_size: int):
    # ZeRO-2: backward gathers nothing, so what backward sends is the reduction alone
    plain = run_ranks(_traffic_worker, world_size, None, "SHARD_GRAD_OP")
    quant_runs = run_ranks(_traffic_worker, world_size, quant, "SHARD_GRAD_OP")
    for p, q in zip(plain, quant_runs, strict=True):
        assert ("all_to_all", "grads") in q["kinds"]
        assert ("reduce_scatter", "grads") not in q["kinds"]
        assert 0 < q["grads"] <= ratio * p["grads"]
        assert 0 < q["backward_sent"] <= ratio * p["backward_sent"]
        assert q["forward_sent"] == p["forward_sent"]
        assert q["saved"] == p["grads"] - q["grads"]


# ----------------------------------------------------------------- accuracy
# Each case: the options, the strategy, the world size, and the faults its check must
# catch ([Note: the ZeRO++ reference]); three ranks put a rank's own unquantized part
# first, in the middle and last, and force padding.
QGZ_FAULTS = (Fault.DOUBLE_COUNT, Fault.NO_MEAN, Fault.ZERO_GRADS, Fault.QGZ_UNQUANTIZED)
EXACT_CASES = {
    "qwz": (QWZ, "SHARD_GRAD_OP", 2, (Fault.QWZ_UNQUANTIZED,), {}),
    "qgz_int8": (QGZ8, "FULL_SHARD", 3, QGZ_FAULTS, {}),
    "qgz_int4": (QGZ4, "FULL_SHARD", 2, (Fault.NO_MEAN, Fault.QGZ_UNQUANTIZED), {}),
    "qwz_qgz": ({"weights": True, "gradients": True}, "SHARD_GRAD_OP", 2, (), {}),
    "all_three": (ALL_THREE, "FULL_SHARD", 4, (Fault.QWZ_UNQUANTIZED, Fault.NO_MEAN), {}),
    "cpu_offload": (
        {"weights": True, "gradients": True},
        "SHARD_GRAD_OP",
        2,
        (Fault.ZERO_GRADS,),
        {"cpu_offload": shardwrap.CPUOffload(offload_params=True)},
    ),
    # one micro-batch under no_sync, then one that reduces both
    "no_sync": (QGZ8, "FULL_SHARD", 2, (Fault.NO_MEAN,), {"num_micro": 2}),
    # the same with qwZ too, and the gradients clipped before the step
    "no_sync_clipped": (
        {"weights": True, "gradients": True},
        "FULL_SHARD",
        2,
        (Fault.NO_MEAN, Fault.LOCAL_NORM),
        {"num_micro": 2, "clip": 0.5},
    ),
}
EXACT_STEPS = 3
CONTROL_STEPS = 1  # a fault shows in the first step's gradients


def _against_reference(
    rank: int, world_size: int, quant: dict, strategy: str, num_steps: int, kwargs: dict
) -> tuple[list[str], list[float]]:
    """SGD steps of the sharded model and of [Note: the ZeRO++ reference]; what differs,
    and the factors the gradients were clipped by.

    ``kwargs["num_micro"]``: micro-batches per step, all but the last under ``no_sync``;
    ``kwargs["clip"]``: the gradients' total norm is clipped to it before each step
    ([Note: clipping against the reference])."""
    kwargs = dict(kwargs)
    num_micro = kwargs.pop("num_micro", 1)
    clip = kwargs.pop("clip", None)
    sharded = _wrap(quant, strategy, **kwargs)
    config = CommQuantization(**quant)
    reference = Reference(
        gpt.build(CONFIG),
        geometry(sharded),
        weight_codec=config.weight_codec,
        grad_codec=config.gradient_codec,
    )
    optim = torch.optim.SGD(sharded.parameters(), lr=SGD_LR)
    found, factors = [], []
    for step in range(num_steps):
        for micro in range(num_micro):
            last = micro == num_micro - 1
            with contextlib.nullcontext() if last else sharded.no_sync():
                _loss(sharded, num_micro * step + micro, rank).backward()
        norm = factor = None
        if clip is not None:
            norm = grad_clip.sharded_grad_norm(sharded._root.runtime, sharded.parameters(), 2.0)[0]
            factor = (clip / (norm + 1e-6)).clamp(max=1.0).to(torch.float32)  # torch's
            factors.append(float(factor))
        grads = reference.step(
            lambda model, r, m, s=step: _loss(model, num_micro * s + m, r),
            world_size,
            num_micro,
            clip_factor=factor,
        )
        found += [f"step {step}: {m}" for m in mismatches(sharded, grads, grads=True)]
        if clip is not None:
            found += [f"step {step}: {m}" for m in _norm_mismatch(float(norm), grads)]
            sharded.clip_grad_norm_(clip)
        optim.step()
        optim.zero_grad()
        found += [f"step {step}: {m}" for m in mismatches(sharded, reference.params(), grads=False)]
    return found, factors


# [Note: clipping against the reference]
# The sharded norm is a float64 sum of squares over each rank's shards, then across the
# ranks; the reference's, a float64 sum over whole gradients in another order. Each is
# within n * 2**-53 (relative, first order) of the exact sum of the n squares, each rounded
# once, in any order; so the two norms (sqrt halving that, plus a rounding each) are within
# (n + 2) * 2**-53 of each other: norm_rtol. Far above it: a norm that misses a rank's
# shards (a factor ~sqrt(2) here) or a mean that is not taken. Both sides then clip by the
# factor torch's clip_grad_norm_ defines, from the sharded norm: max / (norm + 1e-6), at
# most 1, in float32, so the clipped gradients and the parameters compare bit for bit.
def norm_rtol(numel: int) -> float:
    return (numel + 2) * 2.0**-53


def _norm_mismatch(norm: float, grads: dict[str, torch.Tensor]) -> list[str]:
    """The sharded ``norm`` against the reference gradients' (a list: empty if within)."""
    want = sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5
    numel = sum(g.numel() for g in grads.values())
    return [] if abs(norm - want) <= norm_rtol(numel) * want else [f"norm {norm!r}, not {want!r}"]


def _exact_worker(rank: int, world_size: int, case: str) -> dict:
    """The case as it is, then with each of its faults put in: the mismatches of each, and
    the clip factors of the case as it is."""
    quant, strategy, _, faults, kwargs = EXACT_CASES[case]
    runs, clip_factors = {}, []
    for fault in (None, *faults):
        steps = EXACT_STEPS if fault is None else CONTROL_STEPS
        with faulty(fault):
            found, factors = _against_reference(rank, world_size, quant, strategy, steps, kwargs)
        runs["as it is" if fault is None else fault.value] = found
        if fault is None:
            clip_factors = factors
    return {"runs": runs, "clip_factors": clip_factors}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_training_matches_the_one_process_reference_bit_for_bit(case: str) -> None:
    world_size, faults = EXACT_CASES[case][2], EXACT_CASES[case][3]
    for rank, result in enumerate(run_ranks(_exact_worker, world_size, case)):
        runs = result["runs"]
        assert runs.pop("as it is") == [], f"rank {rank}"
        if "clip" in EXACT_CASES[case][4]:  # clipping scaled the gradients at least once
            assert min(result["clip_factors"]) < 1.0, result["clip_factors"]
        # negative controls: with the bug put in, the same comparison fails on every rank
        assert set(runs) == {f.value for f in faults}
        for fault, found in runs.items():
            assert found, f"rank {rank}: {fault} went unnoticed"


# Memorising one fixed batch, the loss must fall: a check that a quantized run trains at
# all, in bf16 where the bit-exact reference does not reach. Full precision brings the
# loss down by a few nats in LEARN_STEPS; gradients set to zero or scaled away leave it
# flat. MIN_DROP_FRACTION splits the two: the quantization error of a value is at most
# half a step of its block's scale (1/254 of the block's largest value for int8), far
# below what separates training from not training.
LEARN_STEPS = 8
MIN_DROP_FRACTION = 0.5


def _memorise(rank: int, quant: dict | None, kwargs: dict) -> float:
    """The loss drop over LEARN_STEPS AdamW steps on one fixed batch (mean of the ranks)."""
    model = _wrap(quant, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(LEARN_STEPS + 1):
        loss = _loss(model, 0, rank)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(_mean(loss))
    return losses[0] - losses[-1]


def _learn_worker(rank: int, world_size: int, kwargs: dict) -> dict[str, float]:
    both = {"weights": True, "gradients": True}
    drops = {"plain": _memorise(rank, None, kwargs), "quantized": _memorise(rank, both, kwargs)}
    with faulty(Fault.ZERO_GRADS):  # the negative control
        drops["zero_grads"] = _memorise(rank, both, kwargs)
    return drops


def test_mixed_precision_quantized_run_memorises_a_batch() -> None:
    bf16 = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}
    for drops in run_ranks(_learn_worker, 2, bf16):
        assert drops["plain"] > 1.0, drops  # the task is learnable
        assert drops["quantized"] >= MIN_DROP_FRACTION * drops["plain"], drops
        assert drops["zero_grads"] < MIN_DROP_FRACTION * drops["plain"], drops


# ---------------------------------------------------------------------- hpZ
def _hpz_worker(rank: int, world_size: int) -> dict:
    """hpZ alone against plain FULL_SHARD: bit for bit, backward gathers inside pairs."""
    plain, hpz = _wrap(None), _wrap({"hpz_partition_size": 2})
    optims = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (plain, hpz)]
    secondary = []
    for step in range(3):
        hpz.comm_ledger.reset()
        for model, optim in zip((plain, hpz), optims, strict=True):
            loss = _loss(model, step, rank)
            if model is hpz:
                forward_sizes = {r.group_size for r in hpz.comm_ledger.records}
                secondary.append([u.handle.comm_quant.secondary_bytes for u in hpz.units])
                held = profile.memory_by_category(hpz)["full_params"]
                assert held >= sum(secondary[-1]) > 0
                hpz.comm_ledger.reset()
            loss.backward()
            optim.step()
            optim.zero_grad()
        backward = [r for r in hpz.comm_ledger.records if r.kind == "all_gather"]
        assert backward and {r.group_size for r in backward} == {2}, backward
        assert forward_sizes == {world_size}
    for p, q in zip(plain.parameters(), hpz.parameters(), strict=True):
        assert torch.equal(p, q)
    expected = [0 if u is hpz.units[-1] else u.handle.flat_full.numel() * 4 // 2 for u in hpz.units]
    last_half = hpz.units[-1].handle.flat_full.numel() * 4 // 2
    return {"secondary": secondary[-1], "expected": expected, "expected_last": last_half}


def test_hpz_backward_gathers_stay_inside_the_group() -> None:
    planned = shardwrap.estimate_memory(
        gpt.build(CONFIG), world_size=4, stage=3, hpz_partition_size=2,
        auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
    ).bytes("hpz_secondary")  # fmt: skip
    for result in run_ranks(_hpz_worker, 4):
        # the root (first unit) is gathered in forward, released, and kept as a secondary
        # shard of half its size; so is every block but the last, which stays gathered
        assert sum(result["secondary"]) > 0
        assert all(s in (0, e) for s, e in zip(result["secondary"], result["expected"]))
        # the planner counts every unit's half: the measured secondary shards, plus the
        # half of the last unit, which stays gathered instead ([Note] in planner/secondary)
        last_half = result["expected_last"]
        assert planned == sum(result["secondary"]) + last_half, (planned, result)


def _bad_hpz_worker(rank: int, world_size: int) -> str:
    try:
        _wrap({"hpz_partition_size": 3})
    except ValueError as error:
        return str(error)
    return "accepted"


def test_hpz_size_must_divide_the_shard_group() -> None:
    for message in run_ranks(_bad_hpz_worker, 2):
        assert "hpz_partition_size: 3 does not divide" in message


# ------------------------------------------------------ checkpoints, no_sync
def _checkpoint_worker(rank: int, world_size: int) -> int:
    """A state dict holds the fp32 masters, never quantized values, and resumes exactly."""
    quant = {"weights": True, "gradients": True}
    model = _wrap(quant)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(2):
        _loss(model, step, rank).backward()
        optim.step()
        optim.zero_grad()
    state = model.state_dict()
    reference = gpt.build(CONFIG)
    reference.load_state_dict(state)
    check_shards(model, reference, exact=True)
    resumed = _wrap(quant)
    resumed.load_state_dict(copy.deepcopy(state))
    check_shards(resumed, reference, exact=True)
    with torch.no_grad():
        assert torch.equal(_loss(model, 5, rank), _loss(resumed, 5, rank))
    return len(state)


def test_checkpoints_hold_full_precision_and_resume() -> None:
    counts = run_ranks(_checkpoint_worker, 2)
    assert counts[0] == counts[1] > 0


def _hybrid_step(rank: int, world_size: int, fault: Fault | None) -> dict:
    """One qwZ + qgZ step of HYBRID_SHARD in pairs: the gradient collectives, and every
    rank's shard after SGD. (The gradients' values against a reference, with qgZ alone:
    tests/dist/test_zeropp_hierarchical.py.)"""
    groups = shardwrap.hybrid_process_groups(2)
    model = _wrap({"weights": True, "gradients": True}, "HYBRID_SHARD", process_group=groups)
    with faulty(fault):
        _loss(model, 0, rank).backward()
    kinds = {(r.kind, r.purpose, r.group_size) for r in model.comm_ledger.records}
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    shards = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(shards) for _ in range(world_size)]
    dist.all_gather(every, shards)
    return {"kinds": kinds, "shards": every, "moved": not torch.equal(before, shards)}


def _hybrid_worker(rank: int, world_size: int) -> dict:
    return {
        "as it is": _hybrid_step(rank, world_size, None),
        "control": _hybrid_step(rank, world_size, Fault.NO_REPLICA_SUM),
    }


def _replicas_equal(shards: list[torch.Tensor]) -> bool:
    """Ranks 0 and 2, 1 and 3 (the two replicas of each shard) hold the same bits."""
    return torch.equal(shards[0], shards[2]) and torch.equal(shards[1], shards[3])


def test_hybrid_shard_quantized_reduction_is_hierarchical_and_keeps_replicas_equal() -> None:
    for result in run_ranks(_hybrid_worker, 4):
        kinds, shards = result["as it is"]["kinds"], result["as it is"]["shards"]
        # within each pair an all-to-all, across the pairs a quantized all-gather
        assert ("all_to_all", "grads", 2) in kinds
        assert ("all_gather", "grads", 2) in kinds
        assert not any(
            k[:2] in {("all_reduce", "grads"), ("reduce_scatter", "grads")} for k in kinds
        )
        assert _replicas_equal(shards) and not torch.equal(shards[0], shards[1])
        assert result["as it is"]["moved"]  # the step applied gradients (zeros would not move)
        # negative control: without the sum across the pairs the replicas part
        assert not _replicas_equal(result["control"]["shards"])


# ------------------------------------------------------------- DeepSpeed keys
DS_CONFIG = {
    "train_batch_size": 2 * BATCH,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
    },
}


def _deepspeed_worker(rank: int, world_size: int) -> dict:
    """The config's ZeRO++ keys reach the model: quantized gathers and reductions."""
    torch.manual_seed(1234)
    engine, *_ = shardwrap.initialize(model=gpt.build(CONFIG), config=DS_CONFIG)
    model = engine.module
    model.comm_ledger.reset()
    inputs, targets = gpt.batch(CONFIG, step=0, rank=rank, batch_size=BATCH)
    engine.backward(gpt.loss_fn(engine(inputs), targets))
    engine.step()
    kinds = {(r.kind, r.purpose) for r in model.comm_ledger.records if r.unquantized_bytes}
    try:  # a prewrapped model must carry the same setting
        shardwrap.initialize(model=_wrap(None), config=DS_CONFIG)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {"config": model.comm_quantization, "kinds": kinds, "refused": refused}


def test_deepspeed_keys_turn_on_quantization() -> None:
    for result in run_ranks(_deepspeed_worker, 2):
        # DeepSpeed 0.19.8's widths: int8 weights, int4 gradients
        assert result["config"] == CommQuantization(weights=True, gradients=True, gradient_bits=4)
        assert result["kinds"] == {("all_gather", "params"), ("all_to_all", "grads")}
        assert "comm_quantization" in result["refused"]
