"""`minipar.train(config) -> Report`: the training loop, run once per virtual rank.

Every run, even a single-device one, goes through `minipar.dist.launch`, so the same
ledger and clock measure a 1-rank and an 8-rank run and their reports compare directly.

One optimizer step, from one rank's point of view (the shape of nanoGPT's train.py):

    for each of grad_accum_steps micro-batches:
        loss = model(inputs, targets)                    # forward
        backward(loss / grad_accum_steps)                # grads accumulate in p.grad
    clip gradients by their global norm                  # optional
    AdamW step with the scheduled learning rate, zero the gradients
"""

from __future__ import annotations

import numpy as np

from minipar import dist
from minipar.nn import GPT, AdamW, GPTConfig, clip_grad_norm_, grad_norm_squared, lr_schedule
from minipar.train.config import TrainConfig
from minipar.train.data import TokenStream, make_stream, micro_batch
from minipar.train.report import Report


def gpt_config(config: TrainConfig, vocab_size: int) -> GPTConfig:
    """The model part of a TrainConfig."""
    return GPTConfig(vocab_size=vocab_size, seq_len=config.seq_len, n_layer=config.n_layer,
                     n_head=config.n_head, d_model=config.d_model, dropout=config.dropout,
                     tie_embeddings=config.tie_embeddings)


def learning_rate(config: TrainConfig, step: int) -> float:
    # A run shorter than the warm-up warms up for its whole length.
    return lr_schedule(step, lr=config.lr, warmup_steps=min(config.warmup_steps, config.steps),
                       total_steps=config.steps, min_lr=config.min_lr)


def _check_supported(config: TrainConfig) -> None:
    if config.world_size > 1 or config.zero:
        raise NotImplementedError(
            "this build of minipar trains on a single device only (dp = tp = pp = 1, zero 0); "
            "data, tensor and pipeline parallelism land in the next releases")


def _single_device_rank(config: TrainConfig, stream: TokenStream, progress=None) -> dict:
    """The per-rank program of a single-device run."""
    device = dist.get_device()
    model = GPT(gpt_config(config, stream.vocab_size), seed=config.seed,
                precision=config.precision,
                activation_checkpointing=config.activation_checkpointing)
    for p in model.parameters():
        device.memory.hold(p.data, "params")
    optimizer = AdamW(model.parameters(), lr=config.lr, betas=(config.beta1, config.beta2),
                      weight_decay=config.weight_decay)
    params = list(model.parameters())
    history = []
    for step in range(config.steps):
        lr = learning_rate(config, step)
        inputs, targets = stream.global_batch(step, config.global_batch_size, config.seq_len,
                                              config.seed)
        micro_losses = []
        for k in range(config.grad_accum_steps):
            x, y = micro_batch(inputs, targets, dp_rank=0, micro_step=k,
                               micro_batch_size=config.micro_batch_size,
                               grad_accum_steps=config.grad_accum_steps)
            with dist.phase("forward"):
                loss = model(x, y)
            with dist.phase("backward"):
                # d(mean over the global batch)/d(loss_k) = 1 / grad_accum_steps
                loss.backward(np.asarray(1.0 / config.grad_accum_steps, dtype=loss.data.dtype))
            micro_losses.append(float(loss.data))
        with dist.phase("optimizer"):
            if config.grad_clip > 0:
                grad_norm = float(clip_grad_norm_(params, config.grad_clip))
            else:
                grad_norm = float(np.sqrt(grad_norm_squared([p.grad for p in params])))
            optimizer.lr = lr
            optimizer.step()
            optimizer.zero_grad()
        history.append({"step": step, "loss": float(np.mean(micro_losses)), "lr": lr,
                        "grad_norm": grad_norm})
        if progress is not None:
            progress(step, history[-1])
    return {"steps": history, "state_dict": model.state_dict(),
            "n_params": sum(p.data.size for p in params)}


def train(config: TrainConfig | None = None, *, progress=None, **overrides) -> Report:
    """Train the model described by `config` and return its measured Report.

    `progress(step, record)` is called after every optimizer step (the CLI passes a
    progress bar). Keyword overrides build or modify the config:
    `train(steps=5, precision="fp64")`."""
    if config is None:
        config = TrainConfig(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    _check_supported(config)
    stream = make_stream(config.data, config.vocab_size)
    config = config.replace(vocab_size=stream.vocab_size)
    results, devices = dist.launch(_single_device_rank, 1, config, stream, progress,
                                   gpus_per_node=config.gpus_per_node, return_devices=True)
    result = results[0]
    ranks = []
    for device in devices:
        summary = device.summary()
        summary["coords"] = {"dp": 0, "pp": 0, "tp": 0}
        ranks.append(summary)
    report = Report(config=config.to_dict(), world_size=config.world_size,
                    n_params=int(result["n_params"]), steps=result["steps"], ranks=ranks,
                    timelines=[device.clock.events for device in devices],
                    state_dict=result["state_dict"])
    return report
