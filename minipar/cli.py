"""The `minipar` command line: `minipar train ...`.

Every TrainConfig field is a flag (`micro_batch_size` -> `--micro-batch-size`). Bad values
end the program with one line naming the flag and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing

from minipar.train.config import PRECISIONS, SCHEDULES, ConfigError, TrainConfig, flag

HELP = {
    "vocab_size": "vocabulary size (default: the data's tokenizer)",
    "seq_len": "tokens per sequence (T)",
    "n_layer": "transformer blocks",
    "n_head": "attention heads",
    "d_model": "hidden size (h)",
    "dropout": "dropout probability (0 = off)",
    "tie_embeddings": "share the LM head with the token embedding (GPT-2 does)",
    "dp": "data-parallel size",
    "tp": "tensor-parallel size",
    "pp": "pipeline-parallel size",
    "zero": "ZeRO stage over the data-parallel group (0-3)",
    "schedule": "pipeline schedule",
    "virtual_stages": "model chunks per pipeline rank (interleaved schedule)",
    "sequence_parallel": "shard LayerNorm/dropout regions along the sequence (with --tp)",
    "gpus_per_node": "virtual GPUs per node (ranks on one node share fast links)",
    "micro_batch_size": "sequences per micro-batch on one data-parallel rank",
    "grad_accum_steps": "micro-batches per optimizer step (or give --global-batch-size)",
    "global_batch_size": "sequences per optimizer step = micro x accum x dp",
    "steps": "optimizer steps",
    "lr": "peak learning rate",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW decoupled weight decay (matrices only)",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "clip the global gradient norm to this value (0 = off)",
    "precision": "numerics: fp64 (exact checks), fp32, bf16-mixed",
    "activation_checkpointing": "recompute each block's activations in backward",
    "data": "training data: the built-in corpus or a synthetic Markov task",
    "seed": "seed of weights and batches",
}
CHOICES = {"precision": PRECISIONS, "schedule": SCHEDULES, "data": ("corpus", "synthetic")}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _field_type(annotation):
    """The scalar type of a field annotation like `int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, defaulting to the field's default."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        kind = _field_type(hints[f.name])
        name = flag(f.name)
        if kind is bool:
            parser.add_argument(name, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=HELP.get(f.name))
        else:
            parser.add_argument(name, dest=f.name, type=kind, default=f.default,
                                choices=CHOICES.get(f.name), help=HELP.get(f.name),
                                metavar=None if f.name in CHOICES else f.name.upper())


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="minipar",
                           description="3D parallelism and ZeRO on N virtual GPUs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    train = commands.add_parser("train", help="train and print what each rank measured")
    add_config_flags(train)
    train.add_argument("--json", metavar="PATH", help="write the report (minipar.report/1)")
    train.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    return parser


def cmd_train(args) -> int:
    from minipar.train.loop import train
    from minipar.viz.tables import loss_table, memory_table

    config = config_from_args(args)
    bar = None
    if not args.quiet:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.steps, desc="train", unit="step", disable=None)

    def progress(step, record):
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}")

    report = train(config, progress=progress)
    if bar is not None:
        bar.close()
    if args.json:
        report.to_json(args.json)
    if not args.quiet:
        print(f"\nminipar: {report.world_size} rank(s), {report.n_params:,} parameters, "
              f"precision {config.precision}, global batch {config.global_batch_size} "
              f"= micro {config.micro_batch_size} x accum {config.grad_accum_steps} "
              f"x dp {config.dp}\n")
        print(loss_table(report))
        print("\nPeak memory per rank, by category (measured from the arrays each rank held):")
        print(memory_table(report))
        if args.json:
            print(f"\nreport written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"train": cmd_train}[args.command](args)
    except (ConfigError, NotImplementedError) as err:
        print(f"minipar {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
