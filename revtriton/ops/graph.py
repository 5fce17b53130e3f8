"""What the running backward does, from autograd's graph-task state (a private API, with a safe
fallback where a torch lacks it)."""
from __future__ import annotations

import torch


def backward_keeps_graph() -> bool:
    """Whether the running backward keeps the graph (retain_graph=True): state a node holds for its
    backward must then stay for the next one. True where torch cannot say (keeping is safe)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())
