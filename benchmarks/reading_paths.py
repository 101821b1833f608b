"""The files a student opens to learn one idea, and their lines, beside picotron's.

    python benchmarks/reading_paths.py            # the table docs/architecture.md shows
    python benchmarks/reading_paths.py --markdown

Each path starts with the idea's algorithm file (the one a student opens first) and adds
only what that file needs to be understood: the pieces it calls that are part of the
same idea. The bookkeeping every strategy shares (the memory and byte ledgers, the
simulated clock, `minipar.parallel.state`'s views, `booking`'s roles) is not on any path:
picotron has none of it, and a student can read an algorithm without it.

Two counts per file: its lines (`wc -l`), and its lines of code (`code_lines`: lines
holding a token other than a comment or a docstring). minipar explains in docstrings
what picotron leaves to the reader, so the second count compares the algorithms.

picotron's counts (huggingface/picotron at its main branch, counted with the same two
functions from its files): data parallel `data_parallel.py` + `bucket.py`; tensor
parallel `tensor_parallel.py` + `tp_communications.py`; pipeline parallel
`pipeline_parallel.py` + `pp_communications.py`; context parallel `context_parallel.py`
+ `cp_communications.py`.
"""

from __future__ import annotations

import argparse
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARALLEL = ROOT / "minipar" / "parallel"

# idea -> (lines, lines of code) of picotron's files for it
PICOTRON = {"DP": (328, 159), "TP": (378, 259), "PP": (266, 157), "CP": (248, 188)}

# idea -> (files in reading order, algorithm file first; what the rest are)
PATHS: dict[str, tuple[list[str], str]] = {
    "DP": (["data/ddp.py", "data/buckets.py"],
           "DDP's hooks and no_sync; gradient buckets"),
    "ZeRO-1/2": (["zero/stage_1_and_2.py", "zero/sharded.py", "zero/partition.py",
                  "data/buckets.py"],
                 "stages 1 and 2; the sharded step they share; a bucket's partition; buckets"),
    "ZeRO-3": (["zero/stage3.py", "zero/sharded.py", "zero/partition.py", "data/buckets.py"],
               "gather/free hooks and prefetch; the sharded step; partition; buckets"),
    "ZeRO offload": (["zero/offload.py"], "ZeroOffload in front of the ZeRO engine"),
    "TP": (["tensor/mappings.py", "tensor/layers.py", "tensor/model.py", "tensor/vocab.py"],
           "f and g; column/row-parallel Linear; the block's swap; "
           "vocab-parallel embedding and loss"),
    "TP+SP": (["tensor/mappings.py", "tensor/layers.py", "tensor/model.py", "tensor/vocab.py",
               "tensor/sequence.py"], "TP's path and SP's g / g-bar"),
    "PP (1F1B)": (["pipeline/executor.py", "pipeline/stage.py",
                   "pipeline/schedules/one_f_one_b.py", "pipeline/schedules/orders.py",
                   "pipeline/actions.py"],
                  "the step: forward_backward and the runtime of F, B and messages; a stage "
                  "is a GPT over its layers; 1F1B's order; where its messages go; F, B, "
                  "the messages and the Schedule"),
    "CP": (["context/ring_attention.py", "context/layout.py"],
           "ring attention's forward and backward; the load-balanced chunk order"),
    "EP": (["expert/dispatch.py", "expert/engine.py"],
           "the all-to-all dispatch and combine; the experts' gradient engine"),
}


def code_lines(source: str) -> int:
    """Lines holding a token that is not a comment or a docstring (a string standing
    alone as a statement)."""
    held, previous = set(), tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        alone = previous in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                              tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER) \
                and not (token.type == tokenize.STRING and alone):
            held.update(range(token.start[0], token.end[0] + 1))
        if token.type != tokenize.COMMENT:
            previous = token.type
    return len(held)


def counts(relative: str) -> tuple[int, int]:
    """(lines, lines of code) of minipar/parallel/<relative>."""
    source = (PARALLEL / relative).read_text()
    return source.count("\n"), code_lines(source)


def rows():
    """(idea, [(file, lines)], lines, code lines, picotron's (lines, code) or None)."""
    for idea, (files, _) in PATHS.items():
        counted = [(name, *counts(name)) for name in files]
        total, code = sum(c[1] for c in counted), sum(c[2] for c in counted)
        yield idea, [(n, c) for n, c, _ in counted], total, code, PICOTRON.get(idea.split(" ")[0])


def markdown() -> str:
    out = ["| idea | files, algorithm first (`minipar/parallel/`), lines | lines | "
           "picotron | code lines | picotron |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for idea, counted, total, code, base in rows():
        files = " + ".join(f"`{name}` {n}" for name, n in counted)
        lines_vs = f"{base[0]} ({total / base[0]:.2f}x)" if base else "-"
        code_vs = f"{base[1]} ({code / base[1]:.2f}x)" if base else "-"
        out.append(f"| {idea} | {files} | {total} | {lines_vs} | {code} | {code_vs} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="the table for the docs")
    args = parser.parse_args()
    if args.markdown:
        print(markdown())
        return
    for idea, counted, total, code, base in rows():
        longest = max(n for _, n in counted)
        print(f"{idea:13} {total:5d} lines, {code:4d} of code, in {len(counted)} files "
              f"(longest {longest})" + (f"; picotron {base[0]} and {base[1]}: "
                                        f"{total / base[0]:.2f}x and {code / base[1]:.2f}x"
                                        if base else ""))
        print(f"{'':13} {PATHS[idea][1]}")


if __name__ == "__main__":
    main()
