"""The DeepSpeed JSON of a run, derived from the RunConfig by one function (written to RUN_DIR/ds_config.json)."""

from __future__ import annotations


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
        "gradient_clipping": t.clip,
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
