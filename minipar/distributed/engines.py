"""The engines by name: what `--engine` chooses (engine.py says what an engine is).

    engine = get_engine("torch", nproc_per_node=4)
"""

from __future__ import annotations

from minipar.errors import ConfigError

from .engine import Engine, ThreadEngine

ENGINES = ("threads", "torch")


def get_engine(name: str = "threads", *, nproc_per_node: int | None = None,
               timeout: float | None = None) -> Engine:
    """The engine called `name`: "threads" (launch.py, the default) or "torch" (one process
    per rank; torch_engine.py). nproc_per_node: processes this machine starts (torch;
    default: the launch's world size); timeout: seconds a rank may wait for a peer
    (default: launch.py's, $MINIPAR_LAUNCH_TIMEOUT or 600)."""
    if name == "threads":
        if nproc_per_node is not None:
            raise ConfigError("nproc_per_node", "starts processes of the torch engine; "
                              "drop it, or add --engine torch")
        return ThreadEngine()
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(nproc_per_node=nproc_per_node, timeout=timeout)
    raise ConfigError("engine", f"{name!r} is not one of {ENGINES}")
