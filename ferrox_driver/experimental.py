"""What the maintained experiment scripts (``benchmarks/`` of the repository) need from the
package, in one place: a decode's plan and its launches, to time one kernel of a plan alone
or a kernel variant in place of the shipped one. Not part of the stable API: names here may
change with the kernels.

    plan = plan_split(device, dtype, n_heads, n_kv_heads, head_dim, seq_len)
    for launch in split_launches(plan, q, k, v, out, workspace, ...):
        launch.run(stream, device, kernel=variant_module.get_function(launch.kernel))
"""

from __future__ import annotations

from .decode.launches import plan_split, split_launches
from .decode.plan import SplitPlan
from .kernels.abi import Launch

__all__ = ["Launch", "SplitPlan", "plan_split", "split_launches"]
