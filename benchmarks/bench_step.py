"""One training step (forward + backward + AdamW) of minipar against PyTorch CPU eager.

    python benchmarks/bench_step.py [--rounds 16] [--sizes tiny small medium]

Both run the same GPT-2 architecture from the same fp32 weights with the same number of
threads. The two alternate in one process, in blocks of ~0.2 s of steps, so that machine
noise (other processes, frequency changes) hits both alike; the ratio of the median step
times is reported. Before timing, one step of each is compared: loss, every gradient and the
updated weights must agree at fp32 tolerance.

The PyTorch model is written the way nanoGPT writes it: nn.Linear, F.layer_norm,
F.scaled_dot_product_attention(is_causal=True), F.gelu(approximate="tanh"),
F.cross_entropy and torch.optim.AdamW with its defaults for CPU tensors.
Skips with a message when torch is not installed (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from arguments import positive_int
from machine import describe

from minipar.nn import GPT, AdamW, GPTConfig

SIZES = {  # name: (d_model, n_layer, seq_len, batch)
    "tiny": (64, 2, 32, 8),
    "small": (128, 4, 64, 8),
    "medium": (256, 4, 128, 8),
}
VOCAB, N_HEAD = 65, 4
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1
PAUSE_S, BLOCK_S = 0.15, 0.2


def blas_threads() -> tuple[int, str]:
    """NumPy's BLAS thread count, and how it was found."""
    try:
        from threadpoolctl import threadpool_info

        counts = [info["num_threads"] for info in threadpool_info()
                  if info.get("user_api") == "blas"]
        if counts:
            return counts[0], "threadpoolctl"
    except ImportError:
        pass
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(name):
            return int(os.environ[name]), name
    # OpenBLAS starts one thread per online CPU when nothing limits it.
    return os.cpu_count() or 1, "os.cpu_count() (OpenBLAS default)"


def build_torch_model(torch, config: GPTConfig, state: dict):
    """nanoGPT-style GPT-2 holding minipar's weights (HF Conv1D (in, out) -> nn.Linear
    (out, in) transposed)."""
    nn, functional = torch.nn, torch.nn.functional

    def linear(prefix, in_features, out_features):
        layer = nn.Linear(in_features, out_features)
        layer.weight.data = torch.from_numpy(state[prefix + ".weight"].T.copy())
        layer.bias.data = torch.from_numpy(state[prefix + ".bias"].copy())
        return layer

    def layer_norm(prefix, d):
        layer = nn.LayerNorm(d, eps=1e-5)
        layer.weight.data = torch.from_numpy(state[prefix + ".weight"].copy())
        layer.bias.data = torch.from_numpy(state[prefix + ".bias"].copy())
        return layer

    class Block(nn.Module):
        def __init__(self, i, d):
            super().__init__()
            p = f"h.{i}."
            self.ln_1 = layer_norm(p + "ln_1", d)
            self.c_attn = linear(p + "attn.c_attn", d, 3 * d)
            self.attn_proj = linear(p + "attn.c_proj", d, d)
            self.ln_2 = layer_norm(p + "ln_2", d)
            self.c_fc = linear(p + "mlp.c_fc", d, 4 * d)
            self.mlp_proj = linear(p + "mlp.c_proj", 4 * d, d)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
            heads = config.n_head
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
            h = functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
            return x + self.mlp_proj(h)

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = config.d_model
            self.wte = nn.Parameter(torch.from_numpy(state["wte.weight"].copy()))
            self.wpe = nn.Parameter(torch.from_numpy(state["wpe.weight"].copy()))
            self.h = nn.ModuleList(Block(i, d) for i in range(config.n_layer))
            self.ln_f = layer_norm("ln_f", d)

        def forward(self, idx, targets):
            x = functional.embedding(idx, self.wte) + self.wpe[: idx.shape[1]]
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.T  # tied LM head
            return functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                            targets.view(-1))

    return TorchGPT()


def torch_named_grads(model) -> dict[str, np.ndarray]:
    """The torch model's gradients under minipar's names and layouts."""
    grads = {"wte.weight": model.wte.grad.numpy(), "wpe.weight": model.wpe.grad.numpy(),
             "ln_f.weight": model.ln_f.weight.grad.numpy(),
             "ln_f.bias": model.ln_f.bias.grad.numpy()}
    pairs = [("ln_1", "ln_1"), ("attn.c_attn", "c_attn"), ("attn.c_proj", "attn_proj"),
             ("ln_2", "ln_2"), ("mlp.c_fc", "c_fc"), ("mlp.c_proj", "mlp_proj")]
    for i, block in enumerate(model.h):
        for ours, theirs in pairs:
            layer = getattr(block, theirs)
            weight = layer.weight.grad.numpy()
            grads[f"h.{i}.{ours}.weight"] = weight if ours.startswith("ln") else weight.T
            grads[f"h.{i}.{ours}.bias"] = layer.bias.grad.numpy()
    return grads


def compare(name, ours, theirs, tolerance=1e-4) -> float:
    """Largest difference relative to the largest entry; fp32 round-off is ~1e-6."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    scale = max(np.abs(theirs).max(), 1e-12)
    relative = np.abs(ours - theirs).max() / scale
    if relative > tolerance:
        raise AssertionError(f"{name}: minipar and torch differ by {relative:.3g} of the "
                             f"largest entry ({scale:.3g}); tolerance {tolerance}")
    return relative


def run_size(torch, name: str, rounds: int) -> dict:
    d, n_layer, seq_len, batch = SIZES[name]
    config = GPTConfig(vocab_size=VOCAB, seq_len=seq_len, n_layer=n_layer, n_head=N_HEAD,
                       d_model=d)
    model = GPT(config, seed=0, precision="fp32")
    optimizer = AdamW(model.named_parameters(), lr=LR, betas=BETAS, eps=EPS,
                      weight_decay=WEIGHT_DECAY)
    torch_model = build_torch_model(torch, config, model.state_dict())
    decay = [p for p in torch_model.parameters() if p.dim() >= 2]
    no_decay = [p for p in torch_model.parameters() if p.dim() < 2]
    torch_optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY},
         {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS)

    rng = np.random.default_rng(0)
    idx = rng.integers(0, VOCAB, size=(batch, seq_len))
    targets = rng.integers(0, VOCAB, size=(batch, seq_len))
    torch_idx, torch_targets = torch.from_numpy(idx), torch.from_numpy(targets)

    def minipar_step():
        model.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        return loss

    def torch_step():
        torch_optimizer.zero_grad(set_to_none=True)
        loss = torch_model(torch_idx, torch_targets)
        loss.backward()
        torch_optimizer.step()
        return loss

    # Correctness: one step from identical weights.
    loss, torch_loss = minipar_step(), torch_step()
    worst = compare("loss", loss.item(), torch_loss.item())
    ours = {n: p.grad for n, p in model.named_parameters()}
    for param_name, grad in torch_named_grads(torch_model).items():
        worst = max(worst, compare("grad " + param_name, ours[param_name], grad))
    worst = max(worst, compare("updated wte", model.wte.weight.data,
                               torch_model.wte.detach().numpy()))

    warmup_start = time.perf_counter()
    for _ in range(3):  # warm up caches and allocators
        minipar_step()
        torch_step()
    step_s = (time.perf_counter() - warmup_start) / 6
    # Alternate blocks of ~BLOCK_S seconds of steps. Before each block, pause so that the
    # other library's idle worker threads stop spinning (OpenBLAS spins ~0.1 s after a
    # call): on a 2-core machine a spinning thread steals a core from the one being
    # timed. The first step of a block wakes threads up and is not counted.
    block = max(3, min(50, round(BLOCK_S / step_s)))
    ours_s, theirs_s = [], []
    for _ in range(rounds):
        for step, times in ((minipar_step, ours_s), (torch_step, theirs_s)):
            time.sleep(PAUSE_S)
            step()
            for _ in range(block):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
    ours_median, theirs_median = statistics.median(ours_s), statistics.median(theirs_s)
    # Other processes only ever add time, so the fastest steps are the least disturbed.
    best_ratio = min(ours_s) / min(theirs_s)
    return {"size": name, "d_model": d, "n_layer": n_layer, "seq_len": seq_len,
            "batch": batch, "minipar_ms": 1e3 * ours_median, "torch_ms": 1e3 * theirs_median,
            "ratio": ours_median / theirs_median, "best_ratio": best_ratio,
            "max_rel_diff": worst}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=16,
                        help="alternations per size")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_step: torch is not installed, skipping "
              "(pip install -e \".[bench]\" installs torch==2.13.0 CPU)")
        return 0
    threads, source = blas_threads()
    torch.set_num_threads(threads)
    print(f"{describe()}; torch {torch.__version__}")
    print(f"threads: {threads} for both (numpy BLAS via {source}; torch.set_num_threads)")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("ms: median step time; ratio: minipar/torch of the medians; best: of the fastest "
          "steps")
    print(f"{'size':8} {'d':>4} {'L':>2} {'T':>4} {'B':>2} {'minipar ms':>11} "
          f"{'torch ms':>9} {'ratio':>6} {'best':>5} {'max rel diff':>13}")
    for name in args.sizes:
        r = run_size(torch, name, args.rounds)
        print(f"{r['size']:8} {r['d_model']:4} {r['n_layer']:2} {r['seq_len']:4} "
              f"{r['batch']:2} {r['minipar_ms']:11.2f} {r['torch_ms']:9.2f} "
              f"{r['ratio']:6.2f} {r['best_ratio']:5.2f} {r['max_rel_diff']:13.2e}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f} (other processes skew both timings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
