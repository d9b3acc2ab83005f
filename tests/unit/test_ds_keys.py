"""DeepSpeed 0.19.8's keys: logging keys warn once, other valid keys are never "unknown"."""

from __future__ import annotations

import warnings

import pytest
from deepspeed.runtime import config as deepspeed_config

from shardwrap.deepspeed import keys as ds_keys
from shardwrap.deepspeed.config import DeepSpeedConfig


def load(**top) -> DeepSpeedConfig:
    return DeepSpeedConfig.load({"train_batch_size": 8, **top})


def test_logging_keys_are_accepted_with_one_warning_naming_them():
    logging = {
        "steps_per_print": 10,
        "wall_clock_breakdown": True,
        "tensorboard": {"enabled": True, "output_path": "tb"},
        "wandb": {"enabled": True},
        "csv_monitor": {"enabled": False},  # off: not named
        "comms_logger": {"enabled": True},
        "flops_profiler": {"enabled": True, "profile_step": 1},
        "dump_state": True,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load(**logging, zero_optimization={"stage": 2})
    assert config.zero_optimization.stage == 2
    assert len(caught) == 1
    message = str(caught[0].message)
    for key in logging:
        assert (key in message) == (key != "csv_monitor"), key


def test_logging_keys_left_off_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(wall_clock_breakdown=False, tensorboard={"enabled": False}, dump_state=False)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "offload_optimizer"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "fp32 optimizer state"),
        ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, "ZenFlow"),
        ({"zero_optimization": {"stage": 1, "legacy_stage1": True}}, "one ZeRO-1"),
        ({"compile": {"deepcompile": True}}, "compile feature is DeepSpeed-only"),
        ({"gradient_allreduce_op": "sum"}, "DeepSpeed-only"),
        ({"tensor_parallel": {"autotp_size": 2}}, "DeepSpeed-only"),
        (
            {"optimizer": {"type": "Adam", "params": {"fp32_optimizer_states": False}}},
            "always fp32",
        ),
    ],
)
def test_valid_deepspeed_keys_are_refused_as_such(config, message):
    with pytest.raises(ValueError, match="valid DeepSpeed 0.19.8 key that shardwrap does not"):
        load(**config)
    with pytest.raises(ValueError, match=message):
        load(**config)


def test_valid_deepspeed_keys_at_their_defaults_are_accepted():
    config = load(
        fp16={"enabled": True, "fp16_master_weights_and_grads": False},
        zero_optimization={
            "stage": 3,
            "prefetch_bucket_size": 1000,  # DeepSpeed's field name for stage3_prefetch_...
            "legacy_stage1": False,
            "offload_optimizer": {"device": "cpu", "pipeline_read": False},
        },
        compile={},
        torch_autocast={"enabled": False},
    )
    assert config.zero_optimization.all_gather_bucket_size == 1000  # the stage-3 key's budget
    adam = load(optimizer={"type": "AdamW", "params": {"foreach": False}}).optimizer
    assert adam.kwargs["foreach"] is False  # passed to torch's AdamW, as DeepSpeed does


def test_no_deepspeed_top_level_key_is_unknown():
    for key in sorted(ds_keys.TOP_LEVEL_KEYS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load(**{key: {"enabled": True}})
        except (ValueError, TypeError) as error:
            assert f"unknown key {key!r}" not in str(error), (key, error)


def test_unknown_keys_still_error():
    with pytest.raises(ValueError, match="unknown key 'steps_per_prnt'"):
        load(steps_per_prnt=1)
    with pytest.raises(ValueError, match="unknown key"):
        load(fp16={"fp16_master_weights": True})


def test_top_level_keys_match_installed_deepspeed():
    """The list is DeepSpeed's: every key its DeepSpeedConfig looks up (when installed)."""
    seen: set[str] = set()

    class Recording(dict):
        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

    deepspeed_config.DeepSpeedConfig(Recording({"train_batch_size": 2}))
    assert {k for k in seen if isinstance(k, str)} <= ds_keys.TOP_LEVEL_KEYS
