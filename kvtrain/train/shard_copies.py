"""The distributed optimizer's copies between model buffers and main shards, batched.

Every step megatron's ``DistributedOptimizer`` hands each parameter's gradient
shard to its main (fp32) shard, and after the update copies each main shard back
into the parameter buffer, one parameter at a time in Python: per parameter a
range lookup, two views, a slice and an attribute set or a copy kernel
(``_copy_model_grads_to_main_grads``, ``_copy_main_params_to_model_params``).
That is host work per parameter *tensor*, not per element: ~16 µs per tensor
and step on the CPU, what a launch-bound GPU step pays too, and every extra
tensor - each layer's KV-shift coefficients - pays it again.

The shards are fixed views of buffers that megatron allocates once, so
:func:`install` works them out once per optimizer and then does per step: an
attribute set per parameter for the gradients, and one multi-tensor copy for
the parameters (none where the main shard *is* the parameter's memory, as for
fp32 parameters). The values are megatron's bit for bit. It applies to the
plain case kvtrain runs (fp32 gradient buffers; no FSDP, fp8, precision-aware
optimizer or MXFP8 buffer reuse); any other keeps megatron's methods.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ShardCopies:
    """The shard pairs of one ``DistributedOptimizer``, worked out once."""

    def __init__(self, opt) -> None:
        self.grads: list[tuple[Tensor, Tensor]] = []  # (main shard, its gradient view)
        self.dst: list[Tensor] = []  # param-buffer shards that main shards are copied into
        self.src: list[Tensor] = []
        pairs = ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                 (opt.model_fp32_groups, opt.shard_fp32_groups))
        for model_groups, main_groups in pairs:
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main in zip(model_group, main_group):
                    self._add(opt, model_param, main)

    def _add(self, opt, model_param: Tensor, main: Tensor) -> None:
        ranges = opt._get_model_param_range_map(model_param)
        own, world = ranges["param"], ranges["gbuf_world_in_bucket"]
        if own.size != main.nelement() or world.size != main.nelement():
            raise RuntimeError("a main shard differs in size from its parameter's range")
        self.grads.append((main, model_param.main_grad.view(-1)[own.start:own.end]))
        gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
        buffer = opt.buffers[gbuf_index].buckets[bucket_id].param_data
        shard = buffer.view(-1)[world.start:world.end]
        if shard.data_ptr() != main.data_ptr():  # fp32: the main shard is a view of it
            self.dst.append(shard)
            self.src.append(main)

    def grads_to_main(self) -> None:
        """megatron's ``_copy_model_grads_to_main_grads``: each main shard's ``grad``
        is its slice of the reduced fp32 gradient buffer (megatron's ``.float()`` of it
        is the same tensor)."""
        for main, grad in self.grads:
            main.grad = grad

    def main_to_model(self) -> None:
        """megatron's ``_copy_main_params_to_model_params``: the updated main shards
        into the parameter buffer (cast to its dtype), one multi-tensor copy."""
        if self.dst:
            with torch.no_grad():
                torch._foreach_copy_(self.dst, self.src)


def applies(opt) -> bool:
    """Whether ``opt`` is a ``DistributedOptimizer`` in the plain case (see above)."""
    from megatron.core.fp8_utils import is_float8tensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(opt, DistributedOptimizer) or opt.is_stub_optimizer:
        return False
    config, ddp = opt.config, opt.ddp_config
    if (ddp.use_megatron_fsdp or config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            or config.reuse_grad_buf_for_mxfp8_param_ag):
        return False
    params = [p for group in opt.model_float16_groups + opt.model_fp32_groups for p in group]
    # gradient buffers reduced in fp32 (kvtrain's grad_reduce_in_fp32), so a main
    # shard's gradient is a view, not a cast to redo every step
    return not any(is_float8tensor(p) or p.main_grad.dtype != torch.float32 for p in params)


def install(optimizer) -> int:
    """Batches the copies of every distributed optimizer in ``optimizer`` (megatron's
    chained or single optimizer) where :func:`applies`; how many it took."""
    done = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if applies(opt):
            copies = ShardCopies(opt)
            opt._copy_model_grads_to_main_grads = copies.grads_to_main
            opt._copy_main_params_to_model_params = copies.main_to_model
            done += 1
    return done


__all__ = ["ShardCopies", "applies", "install"]
