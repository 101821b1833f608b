"""The table of docs/tensor-parallel.md's "SP gradients: one all-reduce per step": the
sequence-parallel LayerNorm/bias gradients summed over TP per parameter and micro-batch
(f's backward, the path a model used on its own keeps) against once per step in one flat
buffer (the training loop: Megatron's finalize_model_grads), on the same run in the same
process (about 10 s on 2 cores).

    python benchmarks/sp_grad_tables.py

Per layout (the CLI's default model, fp32, the default H100 profile, 3 steps), per step:
TP all-reduce calls of rank 0 and their simulated time, rank 0's TP bytes, the largest
exposed communication of any rank and the step time; then the fp64 --check agreement of
each path with the single device.
"""

from arguments import parse_no_flags

from minipar.train import TrainConfig, build, train

if __name__ == "__main__":
    parse_no_flags(__doc__)  # --help says what it measures; no flags to mistype

LAYOUTS = {
    "tp2 sp, accum 1": dict(tp=2),
    "tp2 sp, accum 2": dict(tp=2, grad_accum_steps=2),
    "dp2 tp2 sp zero2, accum 2": dict(dp=2, tp=2, zero=2, grad_accum_steps=2),
    "dp2 pp2 tp2 sp zero1, accum 4": dict(dp=2, tp=2, pp=2, zero=1, grad_accum_steps=4),
}
STEPS = 3


def per_backward(run):
    """`run()` with the deferral off: every SP gradient all-reduced in f's backward."""
    deferral = build.defer_gradient_reduction
    build.defer_gradient_reduction = lambda named_params: []
    try:
        return run()
    finally:
        build.defer_gradient_reduction = deferral


def figures(report) -> dict:
    tp_all_reduces = [t for t in report.transfers[0]
                      if t["group"] == "tp" and t["op"] == "all_reduce"]
    start, end = report.step_window(-1)
    return {"calls": len(tp_all_reduces) / STEPS,
            "calls_us": 1e6 * sum(t["end"] - t["start"] for t in tp_all_reduces) / STEPS,
            "tp_bytes": report.ranks[0]["comm"]["by_group"]["tp"] / STEPS,
            "exposed_us": 1e6 * max(r["time"]["exposed_comm_s"] for r in report.ranks) / STEPS,
            "step_us": 1e6 * (end - start)}


def main() -> None:
    print("| layout | path | TP all-reduces / step | their time (us) | TP bytes / step "
          "| exposed comm (us / step) | step (us) | fp64 max rel. param diff |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, settings in LAYOUTS.items():
        config = TrainConfig(steps=STEPS, sequence_parallel=True, **settings)
        checked = config.replace(precision="fp64", check=True)
        for path, run in (("per parameter", per_backward), ("per step", lambda f: f())):
            f = figures(run(lambda config=config: train(config)))
            equivalence = run(lambda checked=checked: train(checked)).equivalence
            print(f"| {label} | {path} | {f['calls']:.0f} | {f['calls_us']:.1f} | "
                  f"{f['tp_bytes']:,.0f} | {f['exposed_us']:.1f} | {f['step_us']:.1f} | "
                  f"{equivalence['max_rel_param_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
