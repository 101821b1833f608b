"""The built-in corpus: tens of KB of English that minipar writes itself.

No download, no licence question, and the same bytes on every machine: a small
grammar, driven by a fixed seed, writes sentences about a cluster that trains a model
(ranks, shards, rings, stages). The text has real structure (words, agreement,
punctuation, numbers that follow patterns), so a character-level model's loss falls
well below ln(vocab) in a few dozen steps, which is all a demo needs.

`corpus.txt` beside this file is the output of `write_corpus()`; a test checks that the
two stay in sync. Regenerate with `python -m minipar.train.corpus`.
"""

from __future__ import annotations

import random
from pathlib import Path

from minipar.files import atomic_write

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

_SUBJECTS = [
    "the first rank", "the last stage", "every replica", "the tensor group", "the data group",
    "the pipeline", "each worker", "the optimizer", "the ring", "the scheduler",
    "the second node", "a new shard", "the embedding", "the attention block", "the loss",
]
_VERBS = [
    "sends", "receives", "gathers", "scatters", "reduces", "holds", "frees", "splits",
    "waits for", "computes", "stores", "averages", "checks", "loads", "writes",
]
_OBJECTS = [
    "the gradients", "a slice of the weights", "the activations", "the moments",
    "one micro-batch", "the master weights", "half of the heads", "the hidden states",
    "a chunk of the buffer", "the logits", "the learning rate", "the full parameters",
    "the partial sums", "the token ids", "the final norm",
]
_WHEN = [
    "before the backward pass", "after the forward pass", "during the warm-up",
    "at the end of the step", "while the others wait", "in the steady phase",
    "when the bucket is full", "once per step", "inside the node", "across the nodes",
]
_ADJECTIVES = ["quick", "slow", "busy", "idle", "careful", "patient", "steady", "eager"]
_COUNTS = ["two", "three", "four", "eight", "sixteen"]

_PROSE = """\
A cluster is a team of devices that agree to pretend they are one.
Data parallel ranks each see a different part of the batch, then average what they learned.
Tensor parallel ranks share a single layer: each keeps some columns, or some rows, of every weight.
Pipeline stages pass the hidden states forward and the gradients back, one micro-batch at a time.
ZeRO keeps one copy of each optimizer state in the whole data group, cut into shards.
A bubble is time a stage spends waiting, with nothing to compute.
Nothing is free: every byte of memory saved is paid for on the wire, or in compute.
"""


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(6)
    subject = rng.choice(_SUBJECTS)
    verb = rng.choice(_VERBS)
    obj = rng.choice(_OBJECTS)
    if kind == 0:
        text = f"{subject} {verb} {obj} {rng.choice(_WHEN)}."
    elif kind == 1:
        rank = rng.randrange(8)
        text = f"rank {rank} {verb} {obj} from rank {(rank + 1) % 8}."
    elif kind == 2:
        n = rng.choice(_COUNTS)
        adjective = rng.choice(_ADJECTIVES)
        text = f"with {n} ranks, {subject} {verb} {obj}, and the {adjective} ones wait."
    elif kind == 3:
        step = rng.randrange(1, 100)
        loss = 4.2 - step * 0.03 + rng.randrange(10) * 0.01
        text = f"at step {step} the loss is {loss:.2f}, so {subject} {verb} {obj}."
    elif kind == 4:
        then = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        text = f"if {subject} {verb} {obj}, then {then}."
    else:
        text = f"{subject} is {rng.choice(_ADJECTIVES)} {rng.choice(_WHEN)}."
    return text[0].upper() + text[1:]


def generate_corpus(n_paragraphs: int = 150, seed: int = 1234) -> str:
    """Return the corpus text: `n_paragraphs` paragraphs of 3-6 generated sentences,
    with the hand-written prose above interleaved every 25 paragraphs."""
    rng = random.Random(seed)
    paragraphs = []
    for i in range(n_paragraphs):
        if i % 25 == 0:
            paragraphs.append(_PROSE.strip())
        sentences = [_sentence(rng) for _ in range(rng.randint(3, 6))]
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs) + "\n"


def write_corpus(path: Path = CORPUS_PATH) -> None:
    with atomic_write(path, "w") as f:
        f.write(generate_corpus())


def load_corpus() -> str:
    """The built-in corpus text (read from the package, generated once at build time)."""
    return CORPUS_PATH.read_text(encoding="utf-8")


if __name__ == "__main__":
    write_corpus()
    text = load_corpus()
    print(f"wrote {CORPUS_PATH} ({len(text.encode())} bytes, {len(set(text))} distinct chars)")
