"""A run that does not compile (trainer.compile=false) never imports torch's compiler.

torch.optim imports torch._dynamo, the compiler's front end, the first time an optimizer is
built and at every step, only so that torch.compile does not trace into the optimizer: the
Optimizer methods behind torch._disable_dynamo import it to wrap themselves on their first
call, and the `step` of every optimizer (optimizer._use_grad_for_differentiable) imports it to
call torch._dynamo.graph_break(). Outside a compiled region both do nothing. The import itself
took 3 s here, as long as `import torch`: a quarter of a short run's CPU, paid again by every
DDP rank and every job of a sweep.

without_the_compiler(optimizer_class) takes those imports out for the process, before the
optimizer is built: each torch._disable_dynamo method is given itself as the wrapped function
that its first call would otherwise import torch._dynamo to make, and the class's step sets the
grad mode as _use_grad_for_differentiable does, without the graph break. Both rely on the
layout of torch's own wrappers (torch/_compile.py, torch/optim/optimizer.py); where a torch
version lays them out otherwise, nothing is changed and the compiler is imported as before
(tests/test_host_syncs.py checks that its runs leave it unimported).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

# The Optimizer methods torch wraps with torch._disable_dynamo (torch/optim/optimizer.py).
DISABLED_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
# What _disable_dynamo's wrapper caches on the function it wraps (torch/_compile.py).
CACHED_WRAPPER = "__dynamo_disable"


def without_the_compiler(optimizer_class: type[torch.optim.Optimizer]) -> None:
    """Keep torch._dynamo unimported by the optimizer's methods, in this process."""
    for name in DISABLED_METHODS:
        wrapped = getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
        if wrapped is not None and not hasattr(wrapped, CACHED_WRAPPER):
            setattr(wrapped, CACHED_WRAPPER, wrapped)
    _step_without_graph_break(optimizer_class)


def _step_without_graph_break(optimizer_class: type[torch.optim.Optimizer]) -> None:
    step = optimizer_class.step
    hooked = getattr(step, "hooked", False)  # wrapped by Optimizer.profile_hook_step already
    use_grad = getattr(step, "__wrapped__", None) if hooked else step
    if not _is_use_grad(use_grad):
        return
    raw_step = use_grad.__wrapped__

    @functools.wraps(raw_step)
    def eager_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        previous = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return raw_step(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(previous)

    if hooked:
        optimizer_class.step = torch.optim.Optimizer.profile_hook_step(eager_step)
        optimizer_class.step.hooked = True
    else:
        optimizer_class.step = eager_step  # hooked by the first instance, as torch does


def _is_use_grad(function: Any) -> bool:
    """Whether `function` is _use_grad_for_differentiable's wrapper around a step."""
    code = getattr(function, "__code__", None)
    return (code is not None and hasattr(function, "__wrapped__")
            and code in torch_optimizer._use_grad_for_differentiable.__code__.co_consts)
