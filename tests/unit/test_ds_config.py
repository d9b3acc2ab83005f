"""The DeepSpeed config parse: DeepSpeed's defaults, derived batch sizes, clear errors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from shardwrap.base.warn_once import forget_warned
from shardwrap.deepspeed.config import DeepSpeedConfig, derive_batch_sizes
from shardwrap.deepspeed.engine_parts import comm_quantization_of, disk_offload_of
from shardwrap.deepspeed.optimizer import OptimizerType, SchedulerType
from shardwrap.deepspeed.zero import OffloadDevice
from shardwrap.options import CommQuantization, DiskOffload


def load(**top) -> DeepSpeedConfig:
    return DeepSpeedConfig.load({"train_batch_size": 8, **top})


def test_gradient_clipping_defaults_to_deepspeeds_one():
    assert load().gradient_clipping == 1.0
    assert load(gradient_clipping=0).gradient_clipping == 0.0


def test_zero_defaults_are_deepspeeds():
    # Values from DeepSpeed's config code (/work/shared/reference/deepspeed-config.md).
    zero = load().zero_optimization
    assert zero.stage == 0
    assert zero.sub_group_size == 1_000_000_000
    assert zero.offload_param.device is OffloadDevice.NONE
    # bucket sizes act only when given ([Note: bucket sizes]); the threshold at stage 3 only
    assert zero.reduce_bucket_size is None and zero.all_gather_bucket_size is None
    assert zero.unit_persistence_threshold == 0


# Keys shardwrap does not act on, given at DeepSpeed's default where that default asks for
# what shardwrap does (unused.UNUSED's ``matches``): a config may spell them out silently.
DEFAULTS_SHARDWRAP_DOES = {
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "allgather_partitions": True,
    "round_robin_gradients": False,
    "ignore_unused_parameters": True,
    "stage3_gather_16bit_weights_on_model_save": False,
    "offload_param": {"device": "none", "nvme_path": None},
    "offload_optimizer": {"device": "none", "nvme_path": None},
}
# ... and where it asks for something shardwrap does not do: given, each warns.
DEFAULTS_ASKING_OTHERWISE = {
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "sub_group_size": 1e9,
    "offload_param": {"pin_memory": False, "buffer_count": 5, "buffer_size": 1e8},
    "offload_optimizer": {"pin_memory": False, "buffer_count": 4, "fast_init": False},
}


def _warned_keys(**top) -> list[str]:
    forget_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(**top)
    return [str(w.message).split(":")[0] for w in caught]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_keys_given_at_what_shardwrap_does_do_not_warn(stage):
    forget_warned()
    zero = {"stage": stage, "overlap_comm": True, **DEFAULTS_SHARDWRAP_DOES}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(
            zero_optimization=zero,
            fp16={"enabled": stage == 3, "auto_cast": True, "loss_scale": 0, "hysteresis": 2},
            optimizer={"type": "AdamW", "params": {"torch_adam": True}},
        )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_defaults_given_that_ask_for_something_else_warn(stage):
    # a default written out is still asked for ([Note: DeepSpeed keys not acted on])
    zero = {"stage": stage, **DEFAULTS_ASKING_OTHERWISE}
    zero["allgather_bucket_size" if stage in (0, 3) else "stage3_prefetch_bucket_size"] = (
        5e8 if stage in (0, 3) else 5e7
    )
    warned = _warned_keys(zero_optimization=zero)
    for key, value in zero.items():
        if key == "stage":
            continue
        for name in value if isinstance(value, dict) else [""]:
            full = f"config zero_optimization.{key}" + (f".{name}" if name else "")
            assert full in warned, (full, warned)


@pytest.mark.parametrize(
    "stage,value,warns",
    [
        (0, True, False),
        (3, False, True),
        # false is DeepSpeed's default at stages 0-2; given, it still asks for no overlap
        (0, False, True),
        (1, False, True),
        (2, False, True),
        # absent, it asks for nothing
        (1, None, False),
        (2, None, False),
    ],
)
def test_overlap_comm_warns_only_when_it_asks_for_no_overlap(stage, value, warns):
    # true (DeepSpeed's default at stage 3) is what shardwrap always does
    zero = {"stage": stage} if value is None else {"stage": stage, "overlap_comm": value}
    warned = _warned_keys(zero_optimization=zero)
    assert warned.count("config zero_optimization.overlap_comm") == int(warns)


@pytest.mark.parametrize("fp16", [{"enabled": True}, {"enabled": False}])
def test_auto_cast_given_false_warns_that_inputs_are_cast(fp16):
    # false is DeepSpeed's default: given, it asks for uncast inputs, and the engine's
    # MixedPrecision casts the root's floating inputs (engine_parts.mixed_precision_of)
    forget_warned()
    with pytest.warns(UserWarning, match=r"fp16.auto_cast: False is not acted on.*always cast"):
        load(fp16={**fp16, "auto_cast": False})
    assert _warned_keys(fp16=fp16) == []
    assert _warned_keys(fp16={**fp16, "auto_cast": True}) == []


def test_sizes_written_as_floats_are_integers():
    zero = load(zero_optimization={"stage": 2, "reduce_bucket_size": 2e8}).zero_optimization
    assert zero.reduce_bucket_size == 200_000_000 and isinstance(zero.reduce_bucket_size, int)
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size: expected an int"):
        load(zero_optimization={"reduce_bucket_size": 2.5})


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"zero_optimisation": {}},
            "config: unknown key 'zero_optimisation'; did you mean 'zero_optimization'",
        ),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_sz": 1}},
            "zero_optimization: unknown key 'stage3_prefetch_bucket_sz'; "
            "did you mean 'stage3_prefetch_bucket_size'",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, "'weight_decay'"),
        ({"optimizer": {"type": "AdamWW"}}, "unknown optimizer 'AdamWW'; did you mean 'AdamW'"),
        (
            {"scheduler": {"type": "WarmupLr"}},
            "unknown scheduler 'WarmupLr'; did you mean 'WarmupLR'",
        ),
        ({"fp16": {"loss_scale_windo": 10}}, "did you mean 'loss_scale_window'"),
    ],
)
def test_unknown_keys_suggest_the_nearest(config, message):
    with pytest.raises(ValueError, match=message):
        load(**config)


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"zero_optimization": {"zero_hpz_partition_size": 8}},
            "zero_hpz_partition_size: ZeRO.. .hpZ. needs stage 3, got stage 0",
        ),
        ({"zero_optimization": {"zero_quantized_weights": True}}, "qwZ"),
        ({"zero_optimization": {"zero_quantized_gradients": True}}, "qgZ"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "'OneCycle' is not supported"),
        ({"optimizer": {"type": "Lamb"}}, "'Lamb' is not supported"),
        ({"activation_checkpointing": {}}, "activation_checkpointing: not supported"),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                }
            },
            "ratio: not supported",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
            "load_checkpoint",
        ),
    ],
)
def test_known_but_unsupported_keys_say_so(config, message):
    with pytest.raises(ValueError, match=message):
        load(**config)


def test_unsupported_keys_set_to_their_off_value_are_accepted():
    zero = {"stage": 2, "zero_hpz_partition_size": 1, "zero_quantized_weights": False}
    assert load(zero_optimization=zero, wall_clock_breakdown=False).zero_optimization.stage == 2


def test_auto_values_are_rejected():
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu: 'auto'"):
        load(train_micro_batch_size_per_gpu="auto")


@pytest.mark.parametrize(
    "given,world,expected",
    [
        ((32, 4, None), 2, (32, 4, 4)),
        ((32, None, 2), 4, (32, 4, 2)),
        ((None, 4, 2), 3, (24, 4, 2)),
        ((12, None, None), 3, (12, 4, 1)),
        ((None, 5, None), 2, (10, 5, 1)),
        ((16, 2, 4), 2, (16, 2, 4)),
    ],
)
def test_batch_sizes_are_derived(given, world, expected):
    train, micro, steps = given
    sizes = derive_batch_sizes(
        train_batch_size=train,
        micro_batch_size=micro,
        gradient_accumulation_steps=steps,
        data_parallel_size=world,
    )
    got = (
        sizes.train_batch_size,
        sizes.train_micro_batch_size_per_gpu,
        sizes.gradient_accumulation_steps,
    )
    assert got == expected
    assert sizes.train_batch_size == got[1] * got[2] * world


@pytest.mark.parametrize(
    "given,world,shown",
    [
        ((32, 4, 3), 2, r"\(32\).*\(4\).*\(3\).*\(2\)"),
        ((30, 4, None), 2, r"\(30\).*\(4\).*\(not given\).*\(2\)"),
        ((10, None, None), 3, r"\(10\).*\(not given\).*\(not given\).*\(3\)"),
        ((None, None, 4), 1, "give at least one"),
    ],
)
def test_inconsistent_batch_sizes_name_all_numbers(given, world, shown):
    train, micro, steps = given
    config = DeepSpeedConfig(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=steps,
    )
    with pytest.raises(ValueError, match=shown):
        config.batch_sizes(world)


def test_precision_blocks():
    fp16 = load(fp16={"enabled": True, "initial_scale_power": 12}).fp16
    assert fp16.enabled and fp16.dynamic_loss_scale and fp16.initial_loss_scale == 4096.0
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (1000, 2, 1.0)
    static = load(fp16={"enabled": True, "loss_scale": 128}).fp16
    assert not static.dynamic_loss_scale and static.initial_loss_scale == 128.0
    assert load(bfloat16={"enabled": True}).bf16.enabled
    with pytest.raises(ValueError, match="both true"):
        load(fp16={"enabled": True}, bf16={"enabled": True})


def test_offload_blocks():
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}
    parsed = load(zero_optimization=zero).zero_optimization
    assert parsed.offload_optimizer.device is OffloadDevice.NVME
    assert parsed.offload_optimizer.nvme_path == "/tmp/x"
    with pytest.raises(ValueError, match="offload_optimizer.nvme_path: required"):
        load(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}})
    with pytest.raises(ValueError, match="offload_param: parameter offload needs stage 3"):
        load(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}})
    with pytest.raises(ValueError, match="offload_optimizer.device: expected one of"):
        load(zero_optimization={"stage": 2, "offload_optimizer": {"device": "gpu"}})


def test_sub_group_size_and_param_offload_to_nvme():
    zero = {
        "stage": 3,
        "sub_group_size": 1e6,
        "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"},
    }
    parsed = load(zero_optimization=zero).zero_optimization
    assert parsed.sub_group_size == 1_000_000
    assert disk_offload_of(parsed, on_accelerator=False) == DiskOffload("/tmp/x", 1_000_000)
    both = {**zero, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}
    parsed = load(zero_optimization=both).zero_optimization
    assert disk_offload_of(parsed, on_accelerator=False) == DiskOffload("/tmp/x", 1_000_000)
    with pytest.raises(ValueError, match="offload_param: 'nvme' offload of an accelerator"):
        disk_offload_of(parsed, on_accelerator=True)
    assert disk_offload_of(load().zero_optimization, on_accelerator=False) is None
    with pytest.raises(ValueError, match="zero_optimization.sub_group_size: must be >= 1, got 0"):
        load(zero_optimization={"stage": 3, "sub_group_size": 0})
    with pytest.raises(ValueError, match="offload_param: parameter offload needs stage 3"):
        load(zero_optimization={**zero, "stage": 2})


def test_optimizer_block_builds_deepspeed_semantics():
    weight = torch.nn.Parameter(torch.ones(3))
    adam = load(optimizer={"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.2}}).optimizer
    assert adam.type is OptimizerType.ADAM
    built = adam.build([weight])
    assert type(built) is torch.optim.AdamW  # DeepSpeed's adam_w_mode defaults to true
    assert built.defaults["weight_decay"] == 0.2 and built.defaults["eps"] == 1e-8
    coupled = load(optimizer={"type": "adam", "params": {"adam_w_mode": False}}).optimizer
    assert type(coupled.build([weight])) is torch.optim.Adam
    adamw = load(optimizer={"type": "AdamW"}).optimizer.build([weight])
    assert adamw.defaults["weight_decay"] == 0.0  # DeepSpeed's default, not torch's 0.01
    sgd = load(optimizer={"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}).optimizer
    assert sgd.build([weight]).defaults["momentum"] == 0.9


def test_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}))
    config = DeepSpeedConfig.load(str(path))
    assert config.gradient_clipping == 1.0 and config.batch_sizes(2).train_batch_size == 4
    with pytest.raises(ValueError, match="does not exist"):
        DeepSpeedConfig.load(str(tmp_path / "missing.json"))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DeepSpeedConfig.load(path)


def test_scheduler_block():
    params = {"total_num_steps": 100, "warmup_num_steps": 10}
    scheduler = load(scheduler={"type": "WarmupCosineLR", "params": params}).scheduler
    assert scheduler.type is SchedulerType.WARMUP_COSINE_LR
    with pytest.raises(ValueError, match="total_num_steps: required by WarmupDecayLR"):
        load(scheduler={"type": "WarmupDecayLR", "params": {}})
    with pytest.raises(ValueError, match="warmup_type"):
        load(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cubic"}})


def test_out_of_range_scale_power_names_the_key_the_range_and_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"fp16.initial_scale_power: must be in 0..63, got 5000"):
        load(fp16={"enabled": True, "initial_scale_power": 5000})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp16": {"initial_scale_power": 64}}))
    with pytest.raises(ValueError, match=r"ds\.json.*fp16.initial_scale_power.*0..63"):
        DeepSpeedConfig.load(path)
    assert (
        load(fp16={"enabled": True, "initial_scale_power": 63}).fp16.initial_loss_scale == 2.0**63
    )


def test_a_key_given_twice_in_a_json_file_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}}')
    with pytest.raises(ValueError, match=r"ds\.json.*key .enabled. is given twice"):
        DeepSpeedConfig.load(path)
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match=r"ds\.json.*key .train_batch_size. is given twice"):
        DeepSpeedConfig.load(str(path))


def test_zero_plus_plus_keys_become_comm_quantization():
    zero = {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 4,
    }
    parsed = load(zero_optimization=zero).zero_optimization
    # DeepSpeed 0.19.8's widths: int8 weights, int4 gradients (all_to_all_quant_reduce)
    assert comm_quantization_of(parsed) == CommQuantization(
        weights=True, gradients=True, gradient_bits=4, hpz_partition_size=4
    )
    assert comm_quantization_of(load(zero_optimization={"stage": 3}).zero_optimization) is None


@pytest.mark.parametrize(
    "zero,error,message",
    [
        ({"stage": 3, "zero_hpz_partition_size": 0}, ValueError, "zero_hpz_partition_size"),
        ({"stage": 3, "zero_quantized_weights": 1}, TypeError, "zero_quantized_weights"),
        ({"stage": 2, "zero_quantized_gradients": True}, ValueError, "needs stage 3, got stage 2"),
    ],
)
def test_zero_plus_plus_keys_are_checked(zero, error, message):
    with pytest.raises(error, match=message):
        load(zero_optimization=zero)
