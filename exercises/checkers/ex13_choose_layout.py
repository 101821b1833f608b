"""Checker of exercise 13: `choose_layout(task)`, a layout and its justification.

The planner judges the numbers (minipar.plan: `estimate` of the answer's layout, and
`advise`, the search of every layout, for the best step time); the emulator judges that
the layout runs (minipar.train on a tiny GPT-2 with the same tp, pp, ZeRO, sequence
parallelism and recomputation, dp at most 2, fp64, against one device). Of the prose
only what can be checked is: its length and that it names every parallelism used; the
claims beside it (memory_gib, bottleneck) are compared with the planner's estimate of
the same layout. The text itself is shown, not judged.
"""

from __future__ import annotations

import functools
import re

from minipar.errors import ConfigError
from minipar.plan import advise, estimate, presets
from minipar.plan.layout import ParallelConfig, check_model_fits_layout
from minipar.train import TrainConfig, train

from .harness import CheckFailed, expect, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "13", "choose a layout for a cluster, and justify it"
BUILDING_BLOCKS = "chooses by reasoning (not by running the planner or the emulator)"
FUNCTIONS = ("choose_layout",)
CLASSES = ()
FORBIDDEN = {"minipar.plan": "the planner would answer for you: it is the checker's",
             "minipar.train": "the emulator is the checker's",
             "advise": "the planner would answer for you: it is the checker's",
             "estimate": "the planner would answer for you: it is the checker's"}
TASKS = (("gpt2-xl", "a100-80gb", 8, 512), ("llama2-70b", "h100-80gb", 64, 1024))
BOTTLENECKS = ("compute", "pipeline bubble", "tp communication", "dp communication",
               "pp communication")
SLOWER = 1.3  # the step time may be this much slower than the planner's best
MEMORY_TOLERANCE = 0.15
OVERHEAD = 0.10  # an overhead below this share of the step: the step is compute-bound
CLOSE = 0.8  # a named overhead within this fraction of the largest one is accepted
GIB = 2 ** 30
KEYS = ("dp", "tp", "pp", "zero", "micro_batch_size", "sequence_parallel", "recompute",
        "memory_gib", "bottleneck", "why")
WORDS = {"dp": r"\bdp\b|data[- ]parallel", "tp": r"\btp\b|tensor[- ]parallel",
         "pp": r"\bpp\b|pipeline", "zero": r"zero"}


def task_of(model: str, cluster: str, gpus: int, batch: int) -> dict:
    shape, spec = presets.model(model), presets.cluster(cluster)
    return {"model": model, "n_layer": shape.n_layer, "d_model": shape.d_model,
            "n_head": shape.n_head, "vocab_size": shape.vocab_size,
            "seq_len": shape.seq_len, "parameters": shape.n_params,
            "gpus": gpus, "gpus_per_node": spec.gpus_per_node,
            "gpu_memory_gib": spec.usable_memory / GIB,
            "intra_node_gbps": spec.intra_node_bandwidth / 1e9,
            "inter_node_gbps": spec.inter_node_bandwidth / 1e9,
            "peak_tflops": spec.peak_flops / 1e12, "global_batch_size": batch,
            "precision": "bf16-mixed"}


class Answer:
    def __init__(self, model, cluster, gpus, batch, answer: dict, config: ParallelConfig):
        self.model, self.cluster, self.gpus, self.batch = model, cluster, gpus, batch
        self.answer, self.config = answer, config
        self.shape, self.spec = presets.model(model), presets.cluster(cluster)
        self.estimate = None

    def __str__(self) -> str:
        c = self.config
        layout = (f"dp={c.dp} tp={c.tp} pp={c.pp} zero={c.zero} micro={c.micro_batch_size}"
                  + (" sp" if c.sequence_parallel else "")
                  + (f" recompute={c.recompute_granularity}" if c.recompute_granularity
                     else ""))
        return f"{self.model} on {self.gpus} GPUs ({layout})"


# ------------------------------------------------------------------ the checks
def check_answers(impl) -> list[Answer]:
    answers = []
    for model, cluster, gpus, batch in TASKS:
        answer = impl.choose_layout(task_of(model, cluster, gpus, batch))
        where = f"{model} on {gpus} GPUs"
        expect(isinstance(answer, dict), f"{where}: choose_layout returned "
                                         f"{type(answer).__name__}; return a dict")
        missing = [k for k in KEYS if k not in answer]
        expect(not missing, f"{where}: the answer lacks {', '.join(missing)}")
        ranges = {"dp": (1, gpus), "tp": (1, gpus), "pp": (1, gpus), "zero": (0, 3),
                  "micro_batch_size": (1, batch)}
        wrong = [f"{k} from {lo} to {hi}" for k, (lo, hi) in ranges.items()
                 if not isinstance(answer[k], int) or isinstance(answer[k], bool)
                 or not lo <= answer[k] <= hi]
        expect(not wrong, f"{where}: give {', '.join(wrong)} (integers)")
        expect(answer["bottleneck"] in BOTTLENECKS,
               f"{where}: bottleneck {answer['bottleneck']!r} is not one of {BOTTLENECKS}")
        expect(answer["recompute"] in (None, "selective", "full"),
               f"{where}: recompute must be None, 'selective' or 'full'")
        used = answer["dp"] * answer["tp"] * answer["pp"]
        expect(used == gpus, f"{where}: dp x tp x pp = {used}; use all {gpus} GPUs")
        spec = presets.cluster(cluster)
        expect(spec.gpus_per_node % answer["tp"] == 0,
               f"{where}: tp={answer['tp']} crosses nodes of {spec.gpus_per_node} GPUs: every "
               f"layer's all-reduces would run at {spec.inter_node_bandwidth / 1e9:g} GB/s "
               f"instead of NVLink's {spec.intra_node_bandwidth / 1e9:g}; keep tp within a "
               "node and cut across nodes with pp (and dp)")
        try:
            config = ParallelConfig(
                dp=answer["dp"], tp=answer["tp"], pp=answer["pp"], zero=answer["zero"],
                micro_batch_size=answer["micro_batch_size"], global_batch_size=batch,
                sequence_parallel=bool(answer["sequence_parallel"]),
                recompute_granularity=answer["recompute"], precision="bf16-mixed",
                flash_attention=True)
            check_model_fits_layout(presets.model(model), config)
        except ConfigError as error:
            raise CheckFailed(f"{where}: the layout is not valid: {error}") from None
        answers.append(Answer(model, cluster, gpus, batch, answer, config))
    return answers


def check_fits(answers: list[Answer]) -> None:
    for a in answers:
        a.estimate = estimate(a.shape, a.config, a.spec)
        memory = a.estimate.memory
        if a.estimate.fits:
            continue
        usable = a.spec.usable_memory
        parts = ", ".join(f"{k} {memory[k] / GIB:.1f}" for k in
                          ("params", "grads", "optimizer", "activations", "buffers"))
        largest = max(("params", "grads", "optimizer", "activations"), key=memory.get)
        cure = {"optimizer": "shard it (ZeRO-1), or split the model (tp, pp)",
                "params": "split the model (tp, pp) or shard it (ZeRO-3)",
                "grads": "shard them (ZeRO-2) or split the model (tp, pp)",
                "activations": "a smaller micro-batch, tp with sequence parallelism, or "
                               "recomputation"}[largest]
        raise CheckFailed(f"{a}: the fullest GPU needs {memory['peak_total'] / GIB:.1f} GiB "
                          f"({parts}), more than the {usable / GIB:.0f} GiB usable: the "
                          f"largest part is {largest}: {cure}")


def check_memory_claim(answers: list[Answer]) -> None:
    for a in answers:
        peak = a.estimate.memory["peak_total"] / GIB
        claim = a.answer["memory_gib"]
        expect(isinstance(claim, (int, float)) and abs(claim - peak) <= MEMORY_TOLERANCE * peak,
               f"{a}: memory_gib = {claim}; the planner predicts {peak:.1f} GiB for the fullest "
               f"GPU (params {a.estimate.memory['params'] / GIB:.1f}, grads "
               f"{a.estimate.memory['grads'] / GIB:.1f}, optimizer "
               f"{a.estimate.memory['optimizer'] / GIB:.1f}, activations "
               f"{a.estimate.memory['activations'] / GIB:.1f}, buffers "
               f"{a.estimate.memory['buffers'] / GIB:.1f}); within 15% passes")


@functools.cache  # a task's best layout is the checker's own: searched once a process
def best_layout(model: str, cluster: str, gpus: int, batch: int
                ) -> tuple[float, ParallelConfig]:
    """(step seconds, layout) of the planner's best layout for one of TASKS (advise, the
    search of every layout: ~3 s for Llama-2 70B on 64 GPUs)."""
    best = advise(presets.model(model), gpus, presets.cluster(cluster),
                  global_batch_size=batch).best
    return best.step_time, best.config


def check_step_time(answers: list[Answer]) -> None:
    for a in answers:
        best_s, c = best_layout(a.model, a.cluster, a.gpus, a.batch)
        mine = a.estimate.step_time
        if mine <= SLOWER * best_s:
            continue
        raise CheckFailed(
            f"{a}: {mine:.1f} s per step, {mine / best_s:.2f}x the planner's best "
            f"({best_s:.1f} s with dp={c.dp} tp={c.tp} pp={c.pp} zero={c.zero} "
            f"micro={c.micro_batch_size}); within {SLOWER}x passes. Your step: "
            + _breakdown(a))


def overheads(a: Answer) -> dict[str, float]:
    """Seconds per step of each overhead of the layout, from the planner's estimate."""
    comm = a.estimate.comm_time_by_group()
    return {"pipeline bubble": a.estimate.time["bubble_fraction"] * a.estimate.step_time,
            "tp communication": comm.get("tp", 0.0),
            "dp communication": comm.get("dp", 0.0),
            "pp communication": comm.get("pp", 0.0)}


def _breakdown(a: Answer) -> str:
    step = a.estimate.step_time
    return ", ".join(f"{name} {seconds:.2f} s ({seconds / step:.0%})"
                     for name, seconds in overheads(a).items())


def check_bottleneck(answers: list[Answer]) -> None:
    for a in answers:
        costs, step = overheads(a), a.estimate.step_time
        largest = max(costs, key=costs.get)
        claim = a.answer["bottleneck"]
        if costs[largest] < OVERHEAD * step:
            accepted = {"compute", largest}
        else:
            accepted = {name for name, s in costs.items() if s >= CLOSE * costs[largest]}
        expect(claim in accepted,
               f"{a}: you name {claim!r} the bottleneck; the planner's step of "
               f"{step:.1f} s spends: {_breakdown(a)}, so it is "
               + (f"compute-bound (no overhead reaches {OVERHEAD:.0%})"
                  if "compute" in accepted else f"{' or '.join(sorted(accepted))}"))


def check_prose(answers: list[Answer]) -> str:
    shown = []
    for a in answers:
        why = a.answer["why"]
        expect(isinstance(why, str) and 40 <= len(why.strip()) <= 1000,
               f"{a}: 'why' must be a few sentences, 40 to 1000 characters (got "
               f"{len(why) if isinstance(why, str) else type(why).__name__})")
        used = [k for k in ("dp", "tp", "pp") if getattr(a.config, k) > 1]
        used += ["zero"] if a.config.zero else []
        silent = [k for k in used if not re.search(WORDS[k], why, re.IGNORECASE)]
        expect(not silent,
               f"{a}: 'why' does not say why you use {', '.join(silent)}: name every "
               "parallelism of the layout and its reason")
        shown.append(f"{a.model}: {why.strip()}")
    return "\n".join(shown)


def check_emulated(answers: list[Answer]) -> None:
    for a in answers:
        c = a.config
        try:
            passed, equivalence = trains_like_one_device(
                c.dp, c.tp, c.pp, c.zero, c.sequence_parallel, c.recompute_granularity)
        except ConfigError as error:
            raise CheckFailed(f"{a}: minipar refuses the layout: {error}") from None
        expect(passed, f"{a}: scaled down, the layout does not train like one device: "
                       f"{equivalence}")


@functools.cache  # a layout's verdict depends on the layout alone: trained once a process
def trains_like_one_device(dp: int, tp: int, pp: int, zero: int, sequence_parallel: bool,
                           recompute: str | None) -> tuple[bool, dict]:
    """(passed, the equivalence report) of the layout trained on a tiny GPT-2 (dp at most
    2, fp64) against one device; ConfigError where minipar refuses the layout."""
    heads = 2 * tp
    report = train(TrainConfig(
        data="synthetic", precision="fp64", steps=1, seq_len=2 * tp, vocab_size=8 * tp,
        n_layer=pp, n_head=heads, d_model=4 * heads, dp=min(dp, 2), tp=tp, pp=pp, zero=zero,
        sequence_parallel=sequence_parallel, recompute_granularity=recompute,
        micro_batch_size=1, grad_accum_steps=max(pp, 1), check=True))
    return report.equivalence["passed"], report.equivalence


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    answers = report.run("the answers: valid layouts of all the GPUs, TP inside a node "
                         "(GPT-2 XL on 8 A100, Llama-2 70B on 64 H100)", check_answers, impl)
    checks = [("fits the GPU's usable memory (the planner's estimate)", check_fits),
              ("memory_gib within 15% of the planner's peak", check_memory_claim),
              (f"step time within {SLOWER}x of the planner's best layout (advise)",
               check_step_time),
              ("the bottleneck named = the planner's breakdown of the step",
               check_bottleneck),
              ("'why' names every parallelism it uses (the text, for the teacher)",
               check_prose),
              ("the emulator trains the layout scaled down, like one device",
               check_emulated)]
    for name, fn in checks:
        if answers is None or (fn is not check_fits
                               and any(a.estimate is None for a in answers)):
            report.skip(name, "needs the checks above")
        else:
            report.run(name, fn, answers)
    return report
