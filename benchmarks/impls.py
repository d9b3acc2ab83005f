"""The implementations the benchmark compares, each behind one small trainer class.

Every trainer takes the same freshly seeded GPT, uses AdamW with the same settings and
exposes ``step(inputs, targets) -> loss`` and ``model_state() -> {category: bytes}``.
Model-state bytes are measured from the tensors each implementation actually holds
(each storage counted once); see ``model_state`` of each class for what is visible.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks import gpt

LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)


class StorageCounter:
    """Sums storage bytes, counting each storage once across all categories."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()

    def bytes(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            if hasattr(tensor, "to_local"):  # a DTensor (FSDP2): what this rank holds
                tensor = tensor.to_local()
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.size())
            if storage.size() and key not in self._seen:
                self._seen.add(key)
                total += storage.size()
        return total


def _state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class TorchTrainer:
    """A model wrapped by DDP, FSDP1 or FSDP2 and a plain AdamW over its parameters."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = make_optimizer(model.parameters())
        self.last_profile: dict | None = None

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = gpt.loss_fn(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def model_state(self) -> dict[str, int]:
        """Parameters, ``.grad`` and AdamW state as this rank holds them after a step.

        Internal buffers (DDP's gradient buckets, FSDP's gathered buffers) are not seen.
        """
        counter = StorageCounter()
        params = list(self.model.parameters())
        return {
            "params": counter.bytes(params),
            "grads": counter.bytes(p.grad for p in params),
            "optimizer_state": counter.bytes(_state_tensors(self.optimizer)),
        }


class ShardwrapTrainer(TorchTrainer):
    """shardwrap under one strategy; per-step collectives come from ``shardwrap.profile``."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        from shardwrap import profile

        with profile.profile_step(self.model) as measured:
            loss = super().step(inputs, targets)
        self.last_profile = {
            kind: {"count": c, "bytes": b, "seconds": s}
            for kind, (c, b, s) in measured.by_kind().items()
        }
        self.last_profile_table = measured.table()
        return loss

    def model_state(self) -> dict[str, int]:
        from shardwrap import profile

        memory = profile.memory_by_category(self.model, self.optimizer)
        return {
            "params": memory["param_shards"] + memory["full_params"],
            "grads": memory["grads"],
            "optimizer_state": memory["optimizer_state"],
            **{f"shardwrap.{k}": v for k, v in memory.items()},
        }


class DeepSpeedTrainer:
    """A DeepSpeed engine (ZeRO stage 1/2/3, fp32) around the same torch AdamW."""

    def __init__(
        self,
        model: nn.Module,
        *,
        stage: int,
        micro_batch: int,
        world_size: int,
        zero_keys: dict | None = None,
    ):
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "train_batch_size": micro_batch * world_size,
            "zero_optimization": {"stage": stage, **(zero_keys or {})},
            "zero_allow_untested_optimizer": True,
            # DeepSpeed clips to norm 1.0 unless told otherwise; no other implementation clips.
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
        }
        if torch.get_default_dtype() == torch.bfloat16:
            config["bf16"] = {"enabled": True}
        optimizer = make_optimizer(model.parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config
        )
        self.last_profile: dict | None = None

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = gpt.loss_fn(self.engine(inputs), targets)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def model_state(self) -> dict[str, int]:
        """Model parameters (their ZeRO-3 partitions), ``.grad``s, and the inner AdamW's
        flat fp32 partitions (a master copy DeepSpeed keeps even in fp32) plus its state.

        Gradient buffers inside DeepSpeed's optimizer wrapper are not seen.
        """
        counter = StorageCounter()
        params = list(self.engine.module.parameters())
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        masters = [p for g in inner.param_groups for p in g["params"]]
        return {
            "params": counter.bytes(getattr(p, "ds_tensor", p) for p in params),
            "grads": counter.bytes([p.grad for p in params] + [p.grad for p in masters]),
            "optimizer_state": counter.bytes(list(_state_tensors(inner)) + masters),
        }


# ------------------------------------------------------------------ builders
def _block_policy():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({gpt.Block})


def _shardwrap(
    strategy: str,
    *,
    check_collectives: bool = False,
    all_gather_bucket_bytes: int = 0,
    reduce_bucket_bytes: int | None = None,
    persistence_threshold: int = 0,
    forward_prefetch: bool = True,
    posts_on_helper: bool = True,
    comm_quantization: dict | None = None,
):
    def build(model: nn.Module, **_) -> ShardwrapTrainer:
        import shardwrap
        from shardwrap.comm import posting
        from shardwrap.policies import ModuleWrapPolicy

        posting.USE_HELPER_THREAD = posts_on_helper  # this process runs one implementation

        wrapped = shardwrap.ShardedModule(
            model,
            sharding_strategy=strategy,
            auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
            # the next block's all-gather overlaps this one's forward
            forward_prefetch=forward_prefetch,
            param_persistence_threshold=persistence_threshold,
            comm_quantization=(  # ZeRO++ rows; None: off
                shardwrap.CommQuantization(**comm_quantization) if comm_quantization else None
            ),
        )
        # As FSDP1 and FSDP2 do: the root stays gathered from forward into backward.
        wrapped.set_reshard_after_forward(False)
        # The hang-diagnosis debug mode, to measure what it costs (off by default).
        wrapped.set_collective_checks(check_collectives)
        wrapped.set_all_gather_bucket_size(all_gather_bucket_bytes)  # experiments; 0 = off
        if reduce_bucket_bytes is not None:  # experiments; None = the library's default
            wrapped.set_reduce_bucket_size(reduce_bucket_bytes)
        return ShardwrapTrainer(wrapped)

    return build


def _fsdp1(strategy: str):
    def build(model: nn.Module, **_) -> TorchTrainer:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=_block_policy(),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        return TorchTrainer(wrapped)

    return build


def _fsdp2(model: nn.Module, **_) -> TorchTrainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return TorchTrainer(model)


def _sw_fully_shard(model: nn.Module, **_) -> TorchTrainer:
    """shardwrap's FSDP2 door, applied as ``_fsdp2`` applies torch's: the same script."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardwrap

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        shardwrap.fully_shard(block, mesh=mesh)
    shardwrap.fully_shard(model, mesh=mesh)
    return TorchTrainer(model)


def _landing_gathers(trainer: TorchTrainer) -> TorchTrainer:
    """The door with its chunk gathers landing in rank order and copied out, as before
    [Note: placed all-gathers] (core/chunk_copy.py): the experiment's before-row."""
    from shardwrap.fsdp2.state import state_of

    for module in trainer.model.modules():
        state = state_of(module)
        if state is not None and state.unit.handle is not None:
            state.unit.handle.shard_comm.gathers_placed = False
    return trainer


def _example_prefetch(model: nn.Module) -> None:
    """torch's FSDP2 example's explicit prefetch: the root gathers block 0 in forward,
    each block the next in forward and the previous in backward."""
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch(blocks[:1])
    for index, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[index + 1 : index + 2])
        block.set_modules_to_backward_prefetch(blocks[max(index - 1, 0) : index])


def _last_block_kept(build: Callable[..., TorchTrainer]) -> Callable[..., TorchTrainer]:
    """torchtitan's setting on top of ``build``: the last block not resharded after forward
    (its backward, next, would gather it again at once)."""

    def kept(model: nn.Module, **kwargs) -> TorchTrainer:
        trainer = build(model, **kwargs)
        trainer.model.blocks[-1].set_reshard_after_forward(False)
        return trainer

    return kept


def _prefetching(build: Callable[..., TorchTrainer]) -> Callable[..., TorchTrainer]:
    def prefetching(model: nn.Module, **kwargs) -> TorchTrainer:
        trainer = build(model, **kwargs)
        _example_prefetch(trainer.model)
        return trainer

    return prefetching


def _ddp(model: nn.Module, **_) -> TorchTrainer:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model)
    # The stock hook issues the same bucketed all-reduce from Python, where it is counted.
    wrapped.register_comm_hook(None, allreduce_hook)
    return TorchTrainer(wrapped)


def _deepspeed(stage: int, zero_keys: dict | None = None):
    def build(model: nn.Module, *, micro_batch: int, world_size: int) -> DeepSpeedTrainer:
        return DeepSpeedTrainer(
            model, stage=stage, micro_batch=micro_batch, world_size=world_size, zero_keys=zero_keys
        )

    return build


def _compiled_blocks(build: Callable[..., object]) -> Callable[..., object]:
    """``build`` on the model after ``block.compile(fullgraph=True)`` on each block, as
    torchtitan compiles: the sharding stays eager around compiled blocks."""

    def compiled(model: nn.Module, **kwargs) -> object:
        torch._inductor.config.compile_threads = 1  # no pool of compile workers per rank
        for block in model.blocks:
            block.compile(fullgraph=True)
        return build(model, **kwargs)

    return compiled


ZERO_PLUS_PLUS_ROWS = {
    "qwz": {"weights": True},
    "qgz": {"gradients": True},
    "qgz4": {"gradients": True, "gradient_bits": 4},
    "qwz_qgz": {"weights": True, "gradients": True},
}


@dataclass(frozen=True, slots=True)
class ImplSpec:
    """One implementation: who makes it, which ZeRO stage it is (0: plain data parallel)."""

    name: str
    family: str
    stage: int
    build: Callable[..., object]


IMPLS: dict[str, ImplSpec] = {
    spec.name: spec
    for spec in (
        ImplSpec("sw_full_shard", "shardwrap", 3, _shardwrap("FULL_SHARD")),
        ImplSpec("sw_shard_grad_op", "shardwrap", 2, _shardwrap("SHARD_GRAD_OP")),
        ImplSpec("sw_shard_optim", "shardwrap", 1, _shardwrap("SHARD_OPTIM")),
        ImplSpec("sw_no_shard", "shardwrap", 0, _shardwrap("NO_SHARD")),
        ImplSpec(
            "sw_full_shard_checked",
            "shardwrap",
            3,
            _shardwrap("FULL_SHARD", check_collectives=True),
        ),
        # Experiments, not in the default run (see RESULTS.md): all-gather buckets of 16 MB
        # (five 5m blocks), with and without forward prefetch; the 5m root (279,040
        # elements) persistent.
        ImplSpec(
            "sw_full_shard_agb",
            "shardwrap",
            3,
            _shardwrap("FULL_SHARD", all_gather_bucket_bytes=16 << 20),
        ),
        ImplSpec(
            "sw_full_shard_noprefetch",
            "shardwrap",
            3,
            _shardwrap("FULL_SHARD", forward_prefetch=False),
        ),
        ImplSpec(
            "sw_full_shard_noprefetch_agb",
            "shardwrap",
            3,
            _shardwrap("FULL_SHARD", forward_prefetch=False, all_gather_bucket_bytes=16 << 20),
        ),
        # Pairwise sends and receives posted on the training thread, as before
        # [Note: posting off the compute thread].
        *(
            ImplSpec(
                f"sw_{strategy.lower()}_inline_posts",
                "shardwrap",
                stage,
                _shardwrap(strategy, posts_on_helper=False),
            )
            for strategy, stage in (("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2), ("SHARD_OPTIM", 1))
        ),
        # One all-reduce per unit, overlapping backward (the default before 25 MiB buckets).
        ImplSpec(
            "sw_no_shard_per_unit",
            "shardwrap",
            0,
            _shardwrap("NO_SHARD", reduce_bucket_bytes=0),
        ),
        # Half of the 5m model per bucket: two all-reduces, the first overlapping backward.
        ImplSpec(
            "sw_no_shard_b12",
            "shardwrap",
            0,
            _shardwrap("NO_SHARD", reduce_bucket_bytes=12 << 20),
        ),
        ImplSpec(
            "sw_full_shard_persist",
            "shardwrap",
            3,
            _shardwrap("FULL_SHARD", persistence_threshold=300_000),
        ),
        # ZeRO++ (docs/zeropp.md): quantized weight all-gather, quantized gradient
        # reduction (int8, int4), both; hpZ needs more ranks than one group (4+).
        *(
            ImplSpec(
                f"sw_full_shard_{name}",
                "shardwrap",
                3,
                _shardwrap("FULL_SHARD", comm_quantization=quant),
            )
            for name, quant in ZERO_PLUS_PLUS_ROWS.items()
        ),
        ImplSpec("fsdp1_full_shard", "fsdp1", 3, _fsdp1("FULL_SHARD")),
        ImplSpec("fsdp1_shard_grad_op", "fsdp1", 2, _fsdp1("SHARD_GRAD_OP")),
        ImplSpec("fsdp2", "fsdp2", 3, _fsdp2),
        # shardwrap's FSDP2 door (issue 29): torch's FSDP2 script with shardwrap.fully_shard
        ImplSpec("sw_fully_shard", "shardwrap", 3, _sw_fully_shard),
        # Experiments (RESULTS.md): the door's gathers landing in rank order, as before
        # [Note: placed all-gathers]; both FSDP2s with torch's example's explicit prefetch.
        ImplSpec(
            "sw_fully_shard_landing",
            "shardwrap",
            3,
            lambda model, **kw: _landing_gathers(_sw_fully_shard(model, **kw)),
        ),
        ImplSpec("sw_fully_shard_prefetch", "shardwrap", 3, _prefetching(_sw_fully_shard)),
        ImplSpec("fsdp2_prefetch", "fsdp2", 3, _prefetching(_fsdp2)),
        ImplSpec("sw_fully_shard_tt", "shardwrap", 3, _last_block_kept(_sw_fully_shard)),
        ImplSpec("fsdp2_tt", "fsdp2", 3, _last_block_kept(_fsdp2)),
        ImplSpec("ds_zero1", "deepspeed", 1, _deepspeed(1)),
        ImplSpec("ds_zero2", "deepspeed", 2, _deepspeed(2)),
        ImplSpec("ds_zero3", "deepspeed", 3, _deepspeed(3)),
        ImplSpec(
            "ds_zero3_qwz_qgz",
            "deepspeed",
            3,
            _deepspeed(3, {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
        ),
        ImplSpec("ddp", "ddp", 0, _ddp),
        # torch.compile'd blocks (inductor), issue #31
        ImplSpec(
            "sw_full_shard_compiled", "shardwrap", 3, _compiled_blocks(_shardwrap("FULL_SHARD"))
        ),
        ImplSpec("fsdp2_compiled", "fsdp2", 3, _compiled_blocks(_fsdp2)),
        ImplSpec("ddp_compiled", "ddp", 0, _compiled_blocks(_ddp)),
    )
}


def deepspeed_available() -> tuple[bool, str]:
    """Whether ``import deepspeed`` works here (it is an optional ``bench`` extra)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip it"
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


# Variants measured for RESULTS.md, left out of the default run.
EXPERIMENTS = (
    "sw_full_shard_agb",
    "sw_full_shard_noprefetch",
    "sw_full_shard_noprefetch_agb",
    "sw_full_shard_persist",
    "sw_full_shard_inline_posts",
    "sw_shard_grad_op_inline_posts",
    "sw_shard_optim_inline_posts",
    "sw_no_shard_per_unit",
    "sw_no_shard_b12",
    *(f"sw_full_shard_{name}" for name in ZERO_PLUS_PLUS_ROWS),
    "ds_zero3_qwz_qgz",
    "sw_full_shard_compiled",
    "fsdp2_compiled",
    "ddp_compiled",
)
