"""``kvtrain plan``: will this config run on that cluster, and for how long?

No GPU, torch or megatron needed: parameters (params.py), per-GPU memory
(memory.py), FLOPs and wall time (flops.py), the layout checks (layout.py) and
the report (report.py).
"""

from .flops import GPUS
from .layout import Plan, PlanError, make_plan
from .params import count_params, stage_params
from .report import as_dict, render

__all__ = [
    "GPUS",
    "Plan",
    "PlanError",
    "as_dict",
    "count_params",
    "make_plan",
    "render",
    "stage_params",
]
