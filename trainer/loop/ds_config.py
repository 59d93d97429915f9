"""The DeepSpeed JSON of a run, derived from the RunConfig by one function (written to RUN_DIR/ds_config.json)."""

from __future__ import annotations


def trainer_clips(cfg) -> bool:
    """Whether memlm clips the gradients itself rather than DeepSpeed: at ZeRO-0 in fp32, where the trainer has
    the global gradient norm already (its non-finite check, train.py) and DeepSpeed would compute it again, one
    parameter at a time, and build its clip factors from Python floats: two blocking host-to-device copies per
    step on a GPU. ZeRO 1-3 and DeepSpeed's bf16/fp16 optimizers clip inside their own step (fp16 after unscaling)."""
    return cfg.deepspeed.zero_stage == 0 and cfg.deepspeed.precision == "fp32" and cfg.train.clip > 0


def deepspeed_config(cfg, world_size: int) -> dict:
    """DeepSpeed config dict for `cfg` (RunConfig) on `world_size` ranks.

    The micro batch is data.batch_size lanes per rank; DeepSpeed counts micro-batches and steps the optimizer
    every train.grad_accum of them. No DeepSpeed scheduler: the trainer passes a client LambdaLR (schedule.py).
    """
    t, ds = cfg.train, cfg.deepspeed
    opt_type = "AdamW" if t.optimizer == "adamw" else "Adam"
    params = {"lr": t.lr, "betas": list(t.adam_betas), "eps": t.adam_eps, "weight_decay": t.weight_decay,
              # torch's Adam instead of fused_adam / cpu_adam: same maths, no minutes-long JIT build (docs/design.md §9)
              "torch_adam": bool(ds.torch_adam)}
    if opt_type == "Adam":
        params["adam_w_mode"] = False  # "Adam" means L2 weight decay, as TrainConfig documents
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    if ds.reduce_bucket_size > 0:
        zero["reduce_bucket_size"] = ds.reduce_bucket_size
    if ds.param_persistence_threshold >= 0:
        zero["stage3_param_persistence_threshold"] = ds.param_persistence_threshold
    conf = {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": cfg.data.batch_size * t.grad_accum * world_size,
        "gradient_clipping": 0.0 if trainer_clips(cfg) else t.clip,  # train.clip is applied either way
        "optimizer": {"type": opt_type, "params": params},
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # the trainer logs; DeepSpeed's own lines would duplicate them
        "wall_clock_breakdown": False,
    }
    if ds.offload_optimizer and ds.torch_adam:
        conf["zero_force_ds_cpu_optimizer"] = False  # else offload insists on cpu_adam (a JIT build)
    if ds.precision == "bf16":
        conf["bf16"] = {"enabled": True}
    elif ds.precision == "fp16":
        conf["fp16"] = {"enabled": True, "loss_scale": ds.loss_scale, "initial_scale_power": 16}
    return conf
