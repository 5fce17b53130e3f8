#!/usr/bin/env python
"""Mutation check: plant known bugs one at a time in a copy of the repository and report which
ones the tests let through (issue 21).

    python tools/mutate.py                 # every mutant; exit status 1 if any survives
    python tools/mutate.py --list          # the mutants and the tests that must catch them
    python tools/mutate.py --only NAME ... # some of them
    python tools/mutate.py --no-baseline   # skip the check that the unmutated copy passes

CPU only (the kernels run on the Triton interpreter, as in the default test run). The working
tree is copied once to a temporary directory (without .git and caches); for each mutant one
textual replacement is applied to one file (it must match exactly once, else the mutant is
reported as stale: update it), the mutant's test files are run there with ``pytest -x -q``,
and the file is restored. A mutant is *killed* when pytest fails; a *survivor* is a bug the
tests cannot see. Before the mutants, each distinct test selection runs once on the unmutated
copy and must pass (else a kill would mean nothing).

Keep the list growing: when a bug is fixed or a review plants one that survives, add it here
with the test that now catches it. Run it before resolving kernel or engine issues.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple  # pytest arguments: test files, node ids, "-k" expressions
    what: str


MUTANTS = [
    # ---- post-norm encoders under meft1 / meft2 (issue 48)
    Mutant("postnorm-layer-without-the-mask", "revtriton/convert/postnorm.py",
           "                      attention_mask=host.mask_for(self.block))\n",
           "                      attention_mask=None)\n",
           ("tests/test_postnorm.py", "-k", "keeping_the_function and Bert"),
           "a whole-layer half attends to padding (the model's mask not handed to the layer)"),
    Mutant("postnorm-relative-positions-admitted", "revtriton/convert/postnorm.py",
           "    if extra:\n        raise NotImplementedError(", "    if False:\n        raise NotImplementedError(",
           ("tests/test_postnorm.py", "-k", "deberta"),
           "DeBERTa-v2's layers run without their relative positions, silently"),
    Mutant("postnorm-layer-decodes-without-its-cache", "revtriton/convert/postnorm.py",
           '        inputs = dict(decoding_inputs(self.block, attention),\n',
           "        inputs = dict(\n",
           ("tests/test_postnorm.py", "-k", "post_norm_opt and meft1"),
           "a whole-layer half decodes without the library's cache: generate's tokens change"),
    # ---- a training step captured in a CUDA graph (issue 35; tests on a CPU stand-in)
    Mutant("captured-check-not-kept", "revtriton/engine/graphs.py",
           "                self._failed.logical_or_(torch.stack([c.failed_flag() for c in flagged]).any())\n",
           "                pass\n",
           ("tests/test_graphs.py", "-k", "failed_exact_check"),
           "a replay's failed exact-stream check is never seen (the graph keeps no flag of it)"),
    Mutant("captured-grads-not-put-back", "revtriton/engine/graphs.py",
           "            if p.grad is not grad:", "            if False:",
           ("tests/test_graphs.py", "-k", "gradients_stay"),
           "zero_grad(set_to_none=True) outside a captured step leaves p.grad None while the graph trains on"),
    Mutant("optimizer-resolves-checks-while-capturing", "revtriton/engine/checks.py",
           "    if capturing_now():  # the step is being captured: its checks are read after each replay\n        return\n",
           "",
           ("tests/test_graphs.py", "-k", "bitwise"),
           "the optimizer's pre-hook syncs to resolve checks inside a capture: the capture fails"),
    Mutant("captured-inputs-not-copied", "revtriton/engine/graphs.py",
           "            static.copy_(t)\n", "            pass\n",
           ("tests/test_graphs.py", "-k", "bitwise"),
           "a replay runs on the capturing call's batch, not the one given"),
    Mutant("captured-sweep-times-the-capture", "perf/measure.py",
           "    if graphs:\n        bench.step()  # the capture", "    if False:\n        bench.step()  # the capture",
           ("tests/test_perf.py", "-k", "cuda_graphs_sweep"),
           "--cuda-graphs times the capturing call among the replays"),
    Mutant("captured-draw-unchecked", "revtriton/halves/randomness.py",
           "            if graph_capturing(device):\n                raise NotImplementedError(CAPTURED_DRAW_MESSAGE)\n", "",
           ("tests/test_graphs.py", "-k", "drawing_random_numbers"),
           "a drawing half inside a CUDA graph capture fails deep in PyTorch ('not in capture mode') instead"),
    Mutant("captured-lr-unchecked", "revtriton/engine/graphs.py",
           "            self._check_rates()\n", "            pass\n",
           ("tests/test_graphs.py", "-k", "scheduler"),
           "a scheduler's new learning rate silently ignored by the replays"),
    # ---- PEFT with a preserving conversion (issue 38, point 1)
    Mutant("peft-model-adapters-not-saved", "revtriton/convert/__init__.py",
           "        if preserve is not None and peft_model:\n            _peft_trains_adapters(model, target)\n", "",
           ("tests/test_peft.py", "-k", "resumed and lora_then_revify"),
           "revify of a PEFT model leaves the adapters out of modules_to_save: checkpoints lack them, resume resets them"),
    Mutant("peft-frozen-adapters-unchecked", "revtriton/convert/core.py",
           "        check_adapters_train(block, list(adapters.values()))\n", "        pass\n",
           ("tests/test_peft.py", "-k", "raises_on_a_training_step"),
           "LoRA after revify(preserve=...) without modules_to_save: the frozen zero adapters never train, silently"),
    Mutant("peft-wrapper-original-trained", "revtriton/convert/preserve.py",
           "    return copies[active[0]]\n", "    return module.original_module\n",
           ("tests/test_peft.py", "-k", "adapters_train_beside"),
           "the engine runs PEFT's frozen original adapter, not the trained copy: the adapters never learn"),
    Mutant("train-adapters-only-trains-peft-originals", "revtriton/convert/preserve.py",
           '    return ".revtriton_adapters." in f".{name}" and ".original_module." not in f".{name}."\n',
           '    return ".revtriton_adapters." in f".{name}"\n',
           ("tests/test_peft.py", "-k", "train_adapters_only"),
           "train_adapters_only unfreezes PEFT's kept original adapters beside the trained copies"),
    # ---- the six bugs that survived the suite in issue 21
    Mutant("rebuilt-value-leaf-holds-a-stream", "revtriton/engine/guards.py",
           "leaf = torch.zeros((), dtype=wide, device=stream.device).expand(stream.shape).detach().requires_grad_()",
           "leaf = torch.zeros(stream.shape, dtype=wide, device=stream.device).requires_grad_()",
           ("tests/test_engine.py", "-k", "storage_less"),
           "an exact rebuild's leaf holds a stream of zeros: one stream more alive per rebuilt half"),
    Mutant("block-grads-subtract-into-the-leaf-first", "revtriton/engine/segment.py",
           "            if owned and n.dtype == dtype:  # (the leaf's gradient goes with the leaf)\n"
           "                return n.sub_(g), True\n"
           "            if g.dtype == dtype:\n"
           "                return torch.sub(n, g, out=g), True\n",
           "            if g.dtype == dtype:\n"
           "                return torch.sub(n, g, out=g), True\n"
           "            if owned and n.dtype == dtype:\n"
           "                return n.sub_(g), True\n",
           ("tests/test_pareprop.py", "-k", "at_most_two_blocks"),
           "an input gradient subtracted into the leaf's buffer while the engine's own one stays alive: "
           "one stream more at the sequential schedule's peak"),
    Mutant("inverse-port-keeps-its-values", "revtriton/ops/streams.py",
           "    port.data = torch.zeros((), dtype=grad_dtype, device=h.device).expand(h.shape)\n", "",
           ("tests/test_engine.py", "-k", "inverse_couples_port"),
           "an exact rebuild's port holds -h, a stream-sized buffer, until its half's backward (test_pareprop's sequential peak: 1.29 blocks)"),
    Mutant("compiled-half-routed", "revtriton/engine/replay.py",
           "        routed = routing and kind != \"own\"\n", "        routed = kind != \"own\"\n",
           ("tests/test_compile.py", "-k", "every_builtin_half"),
           "a compiled half probed under the routing mode: Dynamo skips its code for good (regional compile a no-op)"),
    Mutant("compiled-transformer-half-couples-fused", "revtriton/halves/transformer.py",
           "        if self._compiled_call_impl is not None:\n", "        if False:\n",
           ("tests/test_compile.py", "-k", "every_builtin_half"),
           "a built-in transformer half compiled in place still couples through the dispatch: nothing compiles"),
    Mutant("trunc-normal-std-without-sqrt2", "revtriton/models/common.py",
           ".erfinv_().mul_(std * math.sqrt(2.0))", ".erfinv_().mul_(std)",
           ("tests/test_models.py", "-k", "truncated_normal"),
           "the presets' initial weights 1/sqrt(2) too narrow (erfinv of a uniform is N(0, 1/2))"),
    Mutant("shared-block-parameter-request-allowed", "revtriton/engine/segment.py",
           "        if not accumulate:\n            _refuse_requested_block_parameters(run)\n", "",
           ("tests/test_engine_failures.py", "-k", "module_used_inside"),
           "autograd.grad of a parameter used inside a half and before the stack returns its outside part alone"),
    Mutant("pareprop-final-wait-removed", "revtriton/schedules.py",
           "    for lane in lanes:\n        main.wait_stream(lane)\n", "",
           ("tests/test_pareprop.py", "-k", "exactly_the_waits"),
           "the caller's stream stops waiting for the lanes: gradients read while still being written (GPU race)"),
    Mutant("dkdv-causal-split-one-block", "kernels/attention.py",
           "diagonal_end = lo + tl.cdiv((pid_n + 1) * BLOCK_FIXED - lo, BLOCK_STREAM) * BLOCK_STREAM",
           "diagonal_end = lo + BLOCK_STREAM",
           ("tests/test_tiles.py", "-k", "attention_backward"),
           "dk/dv skip the causal mask after one BLOCK_STREAM: wrong only when BLOCK_FIXED != BLOCK_STREAM"),
    Mutant("norm-eps-dropped", "kernels/norm.py",
           "1.0 / tl.sqrt(var + eps)", "1.0 / tl.sqrt(var)",
           ("tests/test_tiles.py", "-k", "row_kernels or constant_and_zero"),
           "rstd without eps: NaN on constant or zero rows"),
    Mutant("g-overflow-guard-removed", "revtriton/engine/segment.py",
           '                run.guards.add_range(("overflow", index, "G"), y2)\n', "",
           ("tests/test_exact_oracle.py", "-k", "overflow_and_nan"),
           "int32 overflow in a G half wraps silently"),
    Mutant("stream-grad-dtype-is-model-dtype", "revtriton/ops/streams.py",
           "return torch.promote_types(torch.float32, value_dtype)", "return value_dtype",
           ("tests/test_exact_oracle.py", "-k", "bitwise or ports"),
           "bf16 / fp16 models carry stream gradients in bf16 / fp16 instead of fp32"),
    Mutant("host-sync-per-block", "revtriton/engine/segment.py",
           "            recovered.checksum = _checksum(*recovered.inputs)\n",
           "            recovered.checksum = _checksum(*recovered.inputs)\n"
           "            if bool((recovered.checksum != self.checksum[recovered.index]).any()):\n"
           "                raise RuntimeError('checksum mismatch')\n",
           ("tests/test_host_sync.py",),
           "a bool() on a device flag per block: one GPU stall per block instead of one per backward"),
    # ---- the step's checks (issue 45) and the stack's plan (issue 44)
    Mutant("plan-ignores-dropout-rates", "revtriton/engine/plan.py",
           "[getattr(m, name, None) for m, name in self.random_settings],", "[],",
           ("tests/test_step_checks.py", "-k", "dropout_switched_on"),
           "a dropout rate raised between steps: the rebuild skips the RNG replay the probe said was not needed"),
    Mutant("plan-ignores-tensor-attributes", "revtriton/engine/plan.py",
           "[_tensor_identity(getattr(m, name, None)) for m, name in self.tensor_attributes])", "[])",
           ("tests/test_step_checks.py", "-k", "starts_requiring_grad"),
           "a captured tensor assigned between steps is not walked again: it gets no gradient, silently"),
    # ---- couples bound to their call signature (issue 44 step 5)
    Mutant("bound-couple-ignores-the-signature", "revtriton/ops/dispatch.py",
           "sign, frac_bits, *options.items(), call_signature(res, x, *weights))",
           "sign, frac_bits, *options.items())",
           ("tests/test_bound_couples.py", "-k", "change_between_calls and rows"),
           "a call of another shape runs a runner bound to the first call's plan: wrong rows, silently"),
    Mutant("bound-couple-ignores-the-dispatch-state", "revtriton/ops/dispatch.py",
           "    key = (couple, choice_state(), torch.is_autocast_enabled(device_type)",
           "    key = (couple, None, torch.is_autocast_enabled(device_type)",
           ("tests/test_bound_couples.py", "-k", "dispatch_state"),
           "use_backend / force_triton after a bound call are ignored: the other implementation keeps running"),
    Mutant("bound-couple-ignores-frozen-weights", "revtriton/ops/dispatch.py",
           "x.requires_grad or any(w is not None and w.requires_grad for w in weights)),",
           "x.requires_grad or False),",
           ("tests/test_bound_couples.py", "-k", "unfrozen"),
           "a weight frozen after a bound call still gets a gradient"),
    Mutant("bound-couple-ignores-the-options", "revtriton/ops/dispatch.py",
           "sign, frac_bits, *options.items(), call_signature(", "sign, frac_bits, call_signature(",
           ("tests/test_bound_couples.py", "-k", "eps or activation"),
           "a half's eps or activation changed after a bound call is ignored"),
    Mutant("bound-couple-binds-another-calls-tensors", "revtriton/ops/dispatch.py",
           "                a is b for a, b in zip(args[:2] + args[4:], tensors)):",
           "                True for a, b in zip(args[:2] + args[4:], tensors)):",
           ("tests/test_bound_couples.py", "-k", "transforms_its_tensors"),
           "a couple that hands run_op other tensors than its caller's (a transpose, a cast) is bound to the caller's"),
    Mutant("reset-keeps-bound-couples", "revtriton/ops/backend.py",
           "    _chosen.clear()\n    _epoch += 1\n\n\n# ----", "    _chosen.clear()\n\n\n# ----",
           ("tests/test_bound_couples.py", "-k", "dispatch_state"),
           "backend.reset() leaves runners bound to the forgotten choices"),
    Mutant("launch-plan-ignores-strides", "revtriton/ops/launches.py",
           "[(v.shape, v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor)",
           "[(v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor)",
           ("tests/test_fused_mlp.py", "-k", "kept_launch_plan"),
           "a strided input of a kept plan's shape runs with the plan's row stride: wrong rows, silently"),
    Mutant("choice-key-memo-ignores-autocast", "revtriton/ops/backend.py",
           "launches.call_signature(op_name, autocast, *args", "launches.call_signature(op_name, None, *args",
           ("tests/test_dispatch_choice.py", "-k", "key_is_built_once"),
           "a call under autocast finds the key (and the choice) of a call without: the wrong candidate's timing"),
    Mutant("kept-choice-ignores-the-override", "revtriton/ops/backend.py",
           "    memo = (signature, current_backend(), dispatch_state, _timer)",
           "    memo = (signature, None, dispatch_state, _timer)",
           ("tests/test_dispatch_choice.py", "-k", "kept_choice"),
           "use_backend / REVTRITON_BACKEND after a call of the same signature are ignored"),
    Mutant("kept-choice-ignores-force-triton", "revtriton/ops/backend.py",
           "    memo = (signature, current_backend(), dispatch_state, _timer)",
           "    memo = (signature, current_backend(), None, _timer)",
           ("tests/test_dispatch_choice.py", "-k", "kept_choice"),
           "a call under force_triton gets the reference chosen for the same call without it (no kernel runs)"),
    Mutant("kept-choice-survives-reset", "revtriton/ops/backend.py",
           "    _decisions.clear()\n    _chosen.clear()", "    _decisions.clear()",
           ("tests/test_dispatch_choice.py", "-k", "kept_choice"),
           "backend.reset() leaves the kept choices: a new measurement is never made"),
    Mutant("kept-choice-survives-a-registry-change", "revtriton/ops/backend.py",
           "    global _epoch\n    _chosen.clear()\n    _epoch += 1\n\n\ndef ops",
           "    global _epoch\n    _epoch += 1\n\n\ndef ops",
           ("tests/test_dispatch_choice.py", "-k", "kept_choice"),
           "a candidate registered again under its name: the old one still runs where it was chosen"),
    Mutant("backward-plan-ignores-the-gradient-layout", "revtriton/ops/fused_mlp.py",
           '("backward", ctx.needs_input_grad, g.stride(), g.dtype)', '("backward", ctx.needs_input_grad, g.dtype)',
           ("tests/test_fused_mlp.py", "-k", "kept_launch_plan"),
           "a strided output gradient runs the backward launches kept for a contiguous one: wrong rows, silently"),
    Mutant("attention-backward-plan-ignores-the-gradient-layout", "revtriton/ops/fused_attention.py",
           'launch(("backward", tuple(param_dtypes), need_dx, g2.stride(), g2.dtype)',
           'launch(("backward", tuple(param_dtypes), need_dx, g2.dtype)',
           ("tests/test_fused_attention.py", "-k", "kept_couple_plan"),
           "a strided output gradient runs the attention backward's launches kept for a contiguous one"),
    Mutant("optimizer-applies-failed-gradients", "revtriton/engine/checks.py",
           "            if ref() is not p or p.grad is not grad:", "            if True:",
           ("tests/test_step_checks.py", "-k", "optimizer_refuses"),
           "optimizer.step() applies the gradients of a backward whose check failed"),
    Mutant("check-step-forgets-deferred-checks", "revtriton/engine/checks.py",
           "    if bool(torch.stack(flags).any()):  # the one host sync", "    if False:",
           ("tests/test_step_checks.py", "-k", "deferred_one_at_check_step"),
           "check_step() drops the waiting checks without raising their failure"),
    Mutant("split-output-copied-for-backward", "revtriton/engine/segment.py",
           "y1, y2 = joined.detach().chunk(2, dim=-1)", "y1, y2 = joined.detach().clone().chunk(2, dim=-1)",
           ("tests/test_engine.py", "-k", "keeps_only_its_output"),
           "a float split stack keeps a copy of its output for backward: two outputs' bytes alive after forward"),
    # ---- the fused LM loss (issue 36)
    Mutant("fused-loss-smoothing-gradient-dropped", "revtriton/ops/linear_cross_entropy.py",
           "grad.sub_((smoothing / vocab * scale)[:, None])", "pass",
           ("tests/test_linear_cross_entropy.py", "-k", "float64 and smoothing"),
           "label smoothing's uniform term left out of the logits' gradient"),
    Mutant("fused-loss-softcap-chain-rule-dropped", "revtriton/ops/linear_cross_entropy.py",
           "grad.mul_(tanh.square_().neg_().add_(1.0))", "pass",
           ("tests/test_linear_cross_entropy.py", "-k", "float64 and softcap"),
           "the gradient through softcap * tanh(x / softcap) taken as the identity"),
    Mutant("fused-loss-ignores-num-items", "revtriton/ops/linear_cross_entropy.py",
           "    if num_items_in_batch is not None:\n        return torch.as_tensor", "    if False:\n        return torch.as_tensor",
           ("tests/test_lm_loss.py", "-k", "num_items"),
           "gradient accumulation's num_items_in_batch ignored: the mean over this batch's tokens"),
    Mutant("fused-loss-on-a-sharded-head", "revtriton/lm_loss.py",
           'and not any(cls.__name__ == "FSDPModule" for cls in type(head).__mro__))', ")",
           ("tests/test_accelerate_fsdp.py",),
           "the fused loss taken on a head that is its own FSDP unit (its hooks bypassed)"),
    # ---- more: schedules
    Mutant("pareprop-first-wait-removed", "revtriton/schedules.py",
           "lane.wait_stream(main)", "pass",
           ("tests/test_pareprop.py", "-k", "exactly_the_waits"),
           "the lanes start before the caller's stream made the outputs and dy (GPU race)"),
    Mutant("pareprop-grads-wait-skipped", "revtriton/schedules.py",
           "lane.wait_event(grads_done[i + 1])", "pass",
           ("tests/test_pareprop.py", "-k", "exactly_the_waits or really_waits"),
           "grads(i) reads dy before grads(i+1) on the other lane wrote it (GPU race)"),
    Mutant("pareprop-rebuild-on-wrong-lane", "revtriton/schedules.py",
           "lane, waits = lanes[i % 2], []", "lane, waits = lanes[(i + 1) % 2], []",
           ("tests/test_pareprop.py", "-k", "exactly_the_waits"),
           "rebuild(i) on the other lane than grads(i): autograd runs grads(i) on the rebuild's stream, no overlap"),
    # ---- more: exact streams and guards
    Mutant("range-check-high-off-by-one", "revtriton/ops/streams.py",
           "(high >= 2**STREAM_LIMIT_BITS)", "(high > 2**STREAM_LIMIT_BITS)",
           ("tests/test_exact_oracle.py", "-k", "range_bound"),
           "X = 2**29 passes the range check (the headroom argument needs |X| < 2**29)"),
    Mutant("range-check-low-off-by-one", "revtriton/ops/streams.py",
           "(low <= -(2**STREAM_LIMIT_BITS))", "(low < -(2**STREAM_LIMIT_BITS))",
           ("tests/test_exact_oracle.py", "-k", "range_bound"),
           "X = -2**29 passes the range check"),
    Mutant("nan-half-not-saturated", "revtriton/ops/streams.py",
           "nan_to_num_(nan=SATURATION)", "nan_to_num_(nan=0.0)",
           ("tests/test_exact_oracle.py", "-k", "overflow_and_nan"),
           "a NaN half output rounds to 0: silently dropped instead of caught"),
    Mutant("guard-reports-last-failure", "revtriton/engine/guards.py",
           "labels[min(where[i]", "labels[max(where[i]",
           ("tests/test_exact_oracle.py", "-k", "overflow_and_nan"),
           "the overflow error names a later block than the one that overflowed"),
    Mutant("halves-see-fp32-not-model-dtype", "revtriton/engine/guards.py",
           "return from_fixed(stream, self.frac_bits, self.value_dtype) if self.exact else stream",
           "return from_fixed(stream, self.frac_bits) if self.exact else stream",
           ("tests/test_exact_oracle.py", "-k", "bitwise"),
           "halves of a bf16 / fp16 / fp64 model see fp32 stream values"),
    Mutant("fp64-values-through-fp32", "revtriton/ops/streams.py",
           "return stream.double() * (2.0**-frac_bits)", "return (stream * (2.0**-frac_bits)).double()",
           ("tests/test_exact_oracle.py", "-k", "float64"),
           "an fp64 model's stream values lose 7 bits (float32 holds 24 of the stream's 31)"),
    Mutant("dx2-drops-f-input-grad", "revtriton/engine/segment.py",
           "nx2, fresh = rb.input_f.subtract_from(nx2, owned2 or coupling.scale2 != 1.0)", "fresh = False",
           ("tests/test_exact_oracle.py", "-k", "bitwise"),
           "the gradient through F's input is dropped"),
    # ---- more: kernels at the GPU tile sizes and on edge rows
    # (key_blocks is the forward's and the dq pass's key loop: each mutant breaks both)
    Mutant("fwd-causal-end-one-key-block", "kernels/attention.py",
           "hi = tl.minimum((pid_m + 1) * BLOCK_ROWS, seq_len)",
           "hi = tl.minimum(pid_m * BLOCK_ROWS + BLOCK_KEYS, seq_len)",
           ("tests/test_tiles.py", "-k", "attention_forward"),
           "causal forward stops one key block after the diagonal's start: wrong when BLOCK_M > BLOCK_N"),
    Mutant("dq-causal-split-unaligned", "kernels/attention.py",
           "split = (pid_m * BLOCK_ROWS // BLOCK_KEYS) * BLOCK_KEYS", "split = pid_m * BLOCK_ROWS",
           ("tests/test_tiles.py", "-k", "attention_backward"),
           "dq's unmasked loop runs into the diagonal block: wrong when BLOCK_STREAM > BLOCK_FIXED"),
    Mutant("gemm-group-size-not-clamped", "kernels/gemm.py",
           "group_size_m = min(num_pid_m - first_pid_m, GROUP_M)", "group_size_m = GROUP_M",
           ("tests/test_tiles.py", "-k", "gemm"),
           "grouped tile order skips tiles when fewer than GROUP_M row tiles remain (GPU configs use 8)"),
    Mutant("rms-mean-over-padded-row", "kernels/norm.py",
           "mean = 0.0\n        var = tl.sum(x * x, axis=0) / N",
           "mean = 0.0\n        var = tl.sum(x * x, axis=0) / BLOCK_N",
           ("tests/test_tiles.py", "-k", "row_kernels"),
           "RMSNorm divides by the padded row length"),
    Mutant("exact-epilogue-ties-away", "kernels/couple.py",
           "up = (diff > 0.5) | ((diff == 0.5) & odd)", "up = diff >= 0.5",
           ("tests/test_fused_mlp.py", "-k", "exact_epilogue"),
           "the fused exact epilogue rounds ties away from zero, not to even"),
    # ---- the raw-operand GEMM path (issue 12)
    Mutant("col-sum-extra-rows-not-zeroed", "kernels/gemm.py",
           "tl.store(col_sum_ptr + (first + extra) * N + rn, tl.zeros_like(partial), mask=mask_n)",
           "tl.store(col_sum_ptr + (first + extra) * N + rn, partial, mask=mask_n)",
           ("tests/test_tiles.py", "-k", "gemm_variants"),
           "a 128-row tile writes its bias-gradient partial twice: the bias gradient doubles"),
    Mutant("split-k-start-ignored", "kernels/gemm.py",
           "        a_base += k_start.to(tl.int64) * stride_ak\n", "",
           ("tests/test_tiles.py", "-k", "gemm_variants"),
           "every split-K program reads A from token 0: the weight gradient sums the wrong rows"),
    Mutant("tma-split-descriptor-runs-to-k", "kernels/gemm.py",
           "        k_end = k_start + span\n", "        k_end = K\n",
           ("tests/test_tiles.py", "-k", "tma"),
           "a split's descriptors run to K: its last tile reads the next split's tokens (counted twice)"),
    Mutant("tma-second-segment-restarts-at-zero", "kernels/gemm.py",
           "a2_desc = operand_tiles(a_ptr + K.to(tl.int64) * stride_ak, M, K,",
           "a2_desc = operand_tiles(a_ptr, M, K,",
           ("tests/test_tiles.py", "-k", "tma"),
           "the TMA input gradient reads A's first K columns again for the second segment (SwiGLU's up)"),
    Mutant("tma-b-layout-swapped", "revtriton/ops/gemm.py",
           "B_K_MAJOR=tma and stride_bk == 1,", "B_K_MAJOR=tma and stride_bn == 1,",
           ("tests/test_tiles.py", "-k", "tma"),
           "the launcher describes B with the wrong unit stride: the kernel reads W transposed"),
    Mutant("wide-tiles-for-the-couple", "kernels/configs.py",
           'return (not kwargs.get("RESIDUAL") and not kwargs.get("ACT_BWD")',
           'return (not kwargs.get("ACT_BWD")',
           ("tests/test_static.py", "-k", "gemm_prune"),
           "128 x 256 tiles offered to the couple GEMM: its residual epilogue spills (static model)"),
    Mutant("fp32-stages-not-fitted", "kernels/configs.py",
           "    stages = min(config.num_stages, MAX_SHARED[arch] // _stage_bytes(config, named_args, kwargs))\n",
           "    stages = config.num_stages\n",
           ("tests/test_static.py", "-k", "gemm_prune"),
           "fp32 operands keep the 16-bit tiles' stages: 256 KiB of shared memory asked, the launch fails"),
    Mutant("fourth-reduction-dropped", "kernels/norm.py",
           "    if JOBS >= 4:", "    if JOBS >= 5:",
           ("tests/test_fused_mlp.py", "-k", "reduce_partials"),
           "the fourth partial sum of a backward (e.g. a split-K weight gradient) is never reduced"),
    Mutant("scale-rows-ignores-row-scale", "kernels/norm.py",
           "g = g * tl.load(row_scale_ptr + row).to(tl.float32)", "g = g",
           ("tests/test_fused_mlp.py", "-k", "launchers"),
           "drop-path's row scale is lost from the backward's scaled gradient"),
    Mutant("normalize-unshifted-mean", "kernels/norm.py",
           "x0 = tl.load(row_ptr).to(tl.float32)", "x0 = 0.0",
           ("tests/test_tiles.py", "-k", "row_kernels"),
           "LayerNorm's mean summed unshifted in fp32: a 3000 + noise row loses about 1e-4 of its spread"),
    Mutant("checksum-weights-even", "kernels/checksum.py",
           "weight = (h * mix) | 1", "weight = h * mix",
           ("tests/test_checksum.py",),
           "the one-pass checksum's even weights: the top bit of every other element goes unseen"),
    Mutant("normalize-drops-beta", "kernels/norm.py",
           "y = y + tl.load(beta_ptr + cols, mask=mask, other=0.0).to(tl.float32)", "y = y + 0.0",
           ("tests/test_fused_mlp.py", "-k", "launchers"),
           "LayerNorm's beta is not added to the normalized rows the GEMMs read"),
    Mutant("qkv-group-rows-not-clamped", "kernels/attention_qkv.py",
           "group_rows = tl.minimum(tiles_m - first_m, GROUP_M)", "group_rows = GROUP_M",
           ("tests/test_tiles.py", "-k", "qkv"),
           "the QKV GEMM's grouped tile order skips row tiles when fewer than GROUP_M remain"),
    Mutant("trace-omits-run-ahead-bound", "revtriton/schedules.py",
           'waits.append(("grads", i + 2))', "pass",
           ("tests/test_pareprop.py", "-k", "hand_written"),
           "the trace no longer records that rebuild(i) runs after grads(i+2) on its lane"),
    Mutant("recompute-without-autocast", "revtriton/engine/segment.py",
           "with torch.enable_grad(), run.autocast.restored(), replayed(run.dispatch):",
           "with torch.enable_grad(), replayed(run.dispatch):",
           ("tests/test_engine.py", "-k", "gradients_equal_rounded_model_bitwise"),
           "the backward's recompute ignores the forward's autocast state"),
    Mutant("recompute-draws-from-the-global-generator", "revtriton/engine/replay.py",
           "        half = HalfGenerators(draws.start)\n        return _routed(half) if draws.routed else half",
           "        return _NO_ROUTING",
           ("tests/test_engine.py", "-k", "dropout"),
           "the recompute draws from wherever the global generator stands, not from the half's recorded start"),
    Mutant("half-draws-leave-the-global-generator-behind", "revtriton/engine/replay.py",
           "        half.advance_source()\n", "",
           ("tests/test_engine.py", "-k", "dropout_and_drop_path_replay_exactly"),
           "a half's forward draws do not move the global generator: the next half and step draw the same numbers"),
    Mutant("random-op-without-generator-draws-from-the-global-one", "revtriton/engine/replay.py",
           "            return _with_global_generator(device, generator, func, args, kwargs)",
           "            return func(*args, **kwargs)",
           ("tests/test_half_randomness.py", "-k", "native_dropout"),
           "native_dropout (no generator argument) draws from the global generator, not the half's"),
    Mutant("zero-rate-attention-counts-as-drawing", "revtriton/engine/replay.py",
           "        if any(value(*arg) == 0 for arg in self.rates):", "        if False:",
           ("tests/test_half_randomness.py", "-k", "draws_nothing"),
           "SDPA at dropout_p 0 is routed as a draw: attention halves keep the routing mode's host cost"),
    Mutant("routed-halves-run-unrouted-after-the-probe", "revtriton/engine/replay.py",
           'return "global" if self.global_start is not None else "routed" if self.routed else "own"',
           'return "global" if self.global_start is not None else "own"',
           ("tests/test_engine.py", "-k", "another_thread"),
           "a half that draws with no generator runs without routing after the probe: its draws leave the replay"),
    Mutant("draws-escaping-the-routing-go-unseen", "revtriton/engine/replay.py",
           "        escaped = global_start is not None and global_start.moved()", "        escaped = False",
           ("tests/test_engine.py", "-k", "cannot_reach"),
           "a custom op drawing from the global generator inside a routed half is not replayed"),
    Mutant("a-half-seen-escaping-stays-so", "revtriton/engine/segment.py",
           'if lp is not None and (draws is None or "global" in draws):', "if lp is not None and draws is None:",
           ("tests/test_engine.py", "-k", "goes_back"),
           "a half another thread drew under during the probe keeps the global-start record for good"),
    Mutant("rebuild-reads-the-buffers-as-the-forward-left-them", "revtriton/engine/state.py",
           "        m._buffers[name] = (buffer if start is None else start).clone()",
           "        m._buffers[name] = buffer.clone()",
           ("tests/test_engine_failures.py", "-k", "reads_the_buffers"),
           "the rebuild reads spectral_norm's vectors after the forward's power iteration: one iteration more"),
    Mutant("plan-blind-to-swapped-parameter-slots", "revtriton/engine/plan.py",
           "                and all(m._parameters.get(name) is p for m, name, p in self.parameter_slots))",
           "                and True)",
           ("tests/test_engine_failures.py", "-k", "functional_call"),
           "a plan built before functional_call keeps the module's own tensors: the swapped-in ones go unseen"),
    Mutant("backward-blind-to-swapped-parameter-slots", "revtriton/engine/state.py",
           "            if m._parameters.get(name) is not p:  # the forward ran other tensors (functional_call)",
           "            if False:",
           ("tests/test_engine_failures.py", "-k", "functional_call"),
           "the backward after functional_call rebuilds with the module's own weights, silently"),
    # ---- the sequential backward's memory (issue 20)
    Mutant("sequential-rebuilds-both-halves-first", "revtriton/engine/segment.py",
           "            grads, self._owned = self._block_grads(rb, dy1, dy2, owned,\n"
           "                                                   rebuild_f=lambda: self._in_phase(rb, f_phase))",
           "            self._in_phase(rb, f_phase)\n            grads, self._owned = self._block_grads(rb, dy1, dy2, owned)",
           ("tests/test_engine.py", "-k", "one_half_graph"),
           "F's recompute graph is built before G's gradients run: two half graphs alive at the peak"),
    Mutant("negated-gradient-not-restored", "revtriton/engine/segment.py",
           "return (None, torch.neg(n1), torch.neg(n2), None,", "return (None, n1, n2, None,",
           ("tests/test_engine.py", "-k", "float_mode_gradients_match"),
           "the negated gradients a segment's backward carries leave it negated"),
    Mutant("final-streams-freed-under-retain-graph", "revtriton/engine/segment.py",
           "        if not backward_keeps_graph():  # then the streams stay for the next backward", "        if True:",
           ("tests/test_engine.py", "-k", "backward_twice"),
           "backward(retain_graph=True) still frees the final streams: a second backward fails"),
    # ---- the static performance model and launch limits (issue 17)
    Mutant("attention-fwd-grid-check-removed", "revtriton/ops/fused_attention.py",
           'limits.check_grid("attention_fwd", grid({"BLOCK_M": 16}))', "pass",
           ("tests/test_limits.py",),
           "a forward grid past 2^31 - 1 programs is launched (it fails to launch on a GPU)"),
    Mutant("attention-fwd-int32-batch-offset", "kernels/attention.py",
           "    b64 = b.to(tl.int64)\n", "    b64 = b\n",
           ("tests/test_limits.py", "-k", "past_2_31"),
           "the forward's batch offset in int32: sequences past 2^31 elements read the wrong memory"),
    Mutant("attention-dq-int32-batch-offset", "kernels/attention.py",
           "    b = (pid_bh // heads).to(tl.int64)\n", "    b = pid_bh // heads\n",
           ("tests/test_limits.py", "-k", "past_2_31"),
           "the dq pass's batch offset in int32: dq of sequences past 2^31 elements is wrong"),
    Mutant("attention-dkdv-grid-half-the-kv-heads", "revtriton/ops/fused_attention.py",
           '(cdiv(tokens, meta["BLOCK_FIXED"]) * batch * kv_heads,)',
           '(cdiv(tokens, meta["BLOCK_FIXED"]) * batch * kv_heads // 2,)',
           ("tests/test_fused_attention.py", "-k", "fp32_gqa"),
           "the dk/dv grid covers half the kv heads: their dk, dv are never written"),
    Mutant("split-half-lanes-swapped", "kernels/attention.py",
           "columns = (lanes // (HEAD_PAD // 2)) * (HEAD_DIM // 2) + within",
           "columns = (1 - lanes // (HEAD_PAD // 2)) * (HEAD_DIM // 2) + within",
           ("tests/test_fused_attention.py", "-k", "head_dims"),
           "a padded head's two halves swap lanes: the RoPE backward rotates dq and dk the wrong way"),
    # ---- conditioning and captured tensors (issue 13, case 2)
    Mutant("cond-gradient-dropped", "revtriton/engine/segment.py",
           "*(leaf.grad if leaf.requires_grad else None for leaf in cond_leaves)",
           "*(None for leaf in cond_leaves)",
           ("tests/test_conditioning.py", "-k", "equal_the_twin"),
           "the conditioning gets no gradient from the stack"),
    Mutant("captured-tensor-walk-skipped", "revtriton/engine/segment.py",
           "if reaches_foreign_leaf(port, is_own):", "if False:",
           ("tests/test_conditioning.py", "-k", "captured"),
           "a half closing over a tensor that requires grad is not named (wrong or missing gradient)"),
    # ---- scaled couplings in the couple epilogues (issue 14)
    Mutant("scaled-inverse-drops-low-bits", "kernels/couple.py",
           "out |= ((window[:, :, None] >> positions[None, None, :]) & 1) << b",
           "out |= ((window[:, :, None] >> positions[None, None, :]) & 0) << b",
           ("tests/test_couple_kernel.py", "-k", "scaled_kernel"),
           "the exact scaled inverse never restores the bits the forward's shift dropped: not bitwise"),
    Mutant("scaled-forward-shifts-left", "kernels/gemm.py",
           "out = (res >> res_shift) + q", "out = (res << res_shift) + q",
           ("tests/test_fused_mlp.py", "-k", "linear_couple_applies"),
           "the fused exact forward multiplies the residual by 2**s instead of dividing"),
    Mutant("scaled-float-scales-h", "kernels/gemm.py",
           "out = res * res_scale + h", "out = res + h * res_scale",
           ("tests/test_fused_mlp.py", "-k", "scaled_float"),
           "the fused float forward scales the half's output instead of the residual"),
    Mutant("scaled-port-gradient-divided", "revtriton/ops/streams.py",
           "return grads[0] if frac_bits is None and res_scale is None else grads[1]\n",
           "return grads[0] if frac_bits is None and res_scale is None else grads[1] / (res_scale or 1.0)\n",
           ("tests/test_fused_mlp.py", "-k", "scaled_exact"),
           "a scaled couple's port sends g / scale to H(x): the engine already scales the stream's gradient"),
    # ---- padding masks and packed sequences in revified HF decoders (issue 15)
    Mutant("packed-rows-see-each-other", "revtriton/ops/reference.py",
           "    allowed = (same | padding_query) & (segments != 0)[:, None, None, :]\n",
           "    allowed = (segments != 0)[:, None, None, :].expand_as(same).clone()\n",
           ("tests/test_token_layouts.py", "-k", "each_sequence_alone and plain and False"),
           "a packed row's sequences attend to each other's keys"),
    Mutant("padding-keys-seen", "revtriton/ops/reference.py",
           "    allowed = (same | padding_query) & (segments != 0)[:, None, None, :]\n",
           "    allowed = same | padding_query | (segments == 0)[:, None, None, :]\n",
           ("tests/test_token_layouts.py", "-k", "each_sequence_alone and plain and False"),
           "real tokens attend to padding keys (left padding changes their logits)"),
    Mutant("packing-not-detected", "revtriton/convert/host.py",
           "        if bool((packed[:, -1] != 1).any()):", "        if False:",
           ("tests/test_token_layouts.py", "-k", "each_sequence_alone and plain and False"),
           "position_ids that restart are not read as packed sequences: one causal sequence per row"),
    Mutant("rope-ignores-positions", "revtriton/ops/attention.py",
           "        at = torch.arange(tokens, device=q.device) if positions is None else positions.to(q.device)",
           "        at = torch.arange(tokens, device=q.device)",
           ("tests/test_token_layouts.py", "-k", "layout_reaches"),
           "LLaMA's RoPE uses 0..T-1 whatever position_ids say"),
    Mutant("transition-without-layout", "revtriton/halves/base.py",
           "    return layer(x, cond=cond) if cond is not None and transition_takes_cond(layer) else layer(x)",
           "    return layer(x)",
           ("tests/test_token_layouts.py", "-k", "each_sequence_alone and meft3 and False"),
           "an ordinary_top block (stage transition) runs without the token layout: packed rows see each other"),
    # ---- decoders with LLaMA's layer conventions (issue 15)
    Mutant("qwen3-without-qk-norm", "revtriton/convert/llama.py",
           'qk_norm = (a.q_norm, a.k_norm) if spec.qk_norm else None', "qk_norm = None",
           ("tests/test_revify.py", "-k", "halves_compute_the_original_blocks and qwen3"),
           "Qwen3's per-head q/k RMSNorm is skipped"),
    Mutant("mistral-window-ignored", "revtriton/convert/llama.py",
           'window=spec.window,', "window=None,",
           ("tests/test_revify.py", "-k", "halves_compute_the_original_blocks and mistral"),
           "Mistral's sliding window is not applied: rows longer than it see too far back"),
    Mutant("sliding-window-one-too-wide", "revtriton/ops/reference.py",
           ".triu_(1 - window)", ".triu_(-window)",
           ("tests/test_revify.py", "-k", "halves_compute_the_original_blocks and mistral"),
           "the window lets a query see window + 1 keys (Hugging Face: kv > q - window)"),
    # ---- KV-cache generation of revified HF decoders (issue 15)
    Mutant("scaled-rope-frequencies-ignored", "revtriton/convert/llama.py",
           "rope_theta=spec.rope_theta, rope_inv_freq=rotary.inv_freq,",
           "rope_theta=spec.rope_theta, rope_inv_freq=None,",
           ("tests/test_revify.py", "-k", "scaled_rope and llama3"),
           "Llama 3 RoPE scaling computed as default RoPE from theta"),
    Mutant("yarn-attention-scaling-dropped", "revtriton/convert/llama.py",
           "                    rope_scale=float(rotary.attention_scaling))",
           "                    rope_scale=1.0)",
           ("tests/test_revify.py", "-k", "scaled_rope and yarn"),
           "YaRN's cos / sin scaling (attention_factor) is not applied"),
    Mutant("gemma-norm-taken-as-plain", "revtriton/convert/llama.py",
           "    return torch.allclose(got, expected, rtol=1e-2, atol=1e-3)  # bf16 weights round",
           "    return True",
           ("tests/test_revify.py", "-k", "halves_compute_the_original_blocks and gemma"),
           "Gemma's RMSNorm (scale 1 + weight) sent to the fused kernels as a plain RMSNorm (scale weight)"),
    Mutant("phi3-gate-and-up-swapped", "revtriton/convert/llama.py",
           'w_gate, w_up = parameter(m["gate_up_proj"], "weight").chunk(2, dim=0)',
           'w_up, w_gate = parameter(m["gate_up_proj"], "weight").chunk(2, dim=0)',
           ("tests/test_revify.py", "-k", "halves_compute_the_original_blocks and phi3"),
           "Phi-3's fused gate/up rows read in the wrong order"),
    # ---- timm (run with an environment that has timm: /work/venv-timm/bin/python tools/mutate.py --only ...)
    Mutant("eva-rope-dropped", "revtriton/convert/timm_eva.py",
           "        h = b.attn(b.norm1(x), rope=host.position_embeddings, attn_mask=host.mask_for(b))",
           "        h = b.attn(b.norm1(x), rope=None, attn_mask=host.mask_for(b))",
           ("tests/test_timm_eva.py", "-k", "function"),
           "EVA's attention halves ignore the model's rotary embedding"),
    Mutant("eva-layer-scale-dropped", "revtriton/convert/timm_eva.py",
           "        if gamma is not None:\n            h = gamma * h", "        if False:\n            h = gamma * h",
           ("tests/test_timm_eva.py", "-k", "function"),
           "EVA's halves drop the blocks' layer scale (gamma)"),
    Mutant("timm-intermediates-restart-the-streams", "revtriton/convert/host.py",
           '            streams = state["streams"]\n', "            streams = (x, x)\n",
           ("tests/test_revify.py", "-k", "forward_intermediates_are_the_pruned"),
           "forward_intermediates restarts both streams from the readout at every block"),
    Mutant("stack-slice-is-a-list", "revtriton/engine/stack.py",
           "        if isinstance(index, slice):\n", "        if False:\n",
           ("tests/test_revify.py", "-k", "forward_intermediates_are_the_pruned"),
           "a slice of a ReversibleStack is a list: timm's prune_intermediate_layers cannot assign it"),
    Mutant("timm-qk-norm-fused", "revtriton/convert/timm_vit.py",
           'for name in ("q_norm", "k_norm", "norm"))', 'for name in ("norm",))',
           ("tests/test_revify.py", "-k", "qk_norm_runs"),
           "a timm ViT with qk-norm sent to the fused attention, which has no qk-norm"),
    Mutant("hidden-states-without-the-layout", "revtriton/convert/host.py",
           "forward_streams(*streams, cond=self.cond)", "forward_streams(*streams)",
           ("tests/test_token_layouts.py", "-k", "each_sequence_alone and plain and False and llama"),
           "output_hidden_states runs the blocks without the padding / packing layout"),
    Mutant("hidden-states-last-not-normed", "revtriton/convert/host.py",
           "    if tie_last:\n        states[-1] = last\n", "    if tie_last:\n        pass\n",
           ("tests/test_revify.py", "-k", "hidden_states_are_each"),
           "the last hidden state is the stack's output before the final norm (the library ties it to the normed one)"),
    Mutant("padding-queries-see-only-themselves", "revtriton/ops/reference.py",
           "    allowed = (same | padding_query) & (segments != 0)[:, None, None, :]\n",
           "    allowed = same & (segments != 0)[:, None, None, :]\n",
           ("tests/test_token_layouts.py", "-k", "library_models and gpt2"),
           "padding queries see only themselves: a loss read at padding positions differs from the library's"),
    Mutant("decoding-state-reaches-other-models", "revtriton/convert/host.py",
           "    if call is None or call.stack is not stack or call.running:",
           "    if call is None or call.running:",
           ("tests/test_host_forward.py", "-k", "stand_ins"),
           "a model run inside another's forward (same thread) meets the other's layer stand-ins"),
    Mutant("meta-norms-never-fused", "revtriton/convert/llama.py",
           "        return None\n    generator = torch.Generator()", "        return False\n    generator = torch.Generator()",
           ("tests/test_revify.py", "-k", "meta_device"),
           "a model revified on the meta device decides its norms are not plain: the fused path is lost for good"),
    Mutant("hf-vit-last-hidden-state-normed", "revtriton/convert/hf_vit.py",
           "    _rope, _tokens_input, _caches, _tie_last = False, False, False, False",
           "    _rope, _tokens_input, _caches, _tie_last = False, False, False, True",
           ("tests/test_revify.py", "-k", "hf_vit_keeps"),
           "HF ViT's last hidden state is the normed output (the library's is the last layer's, before layernorm)"),
    Mutant("sass-unpredicated-branch-is-a-loop", "revtriton/sass.py",
           'if ins.mnemonic != "BRA" or ins.predicate is None:', 'if ins.mnemonic != "BRA":',
           ("tests/test_sass.py",),
           "barrier-wait stubs (unconditional backward branches) are counted as main loops"),
    Mutant("sass-hmma-shape-misread", "revtriton/sass.py",
           '_HMMA_SHAPE = re.compile(r"^HMMA\\.(16)(8)(\\d+)")', '_HMMA_SHAPE = re.compile(r"^HMMA\\.(\\d)(\\d)(\\d+)")',
           ("tests/test_sass.py",),
           "sm_80 HMMA.16816 read as 1x6x816: tensor cycles wrong by 2x"),
    Mutant("ttgir-replication-rule-loosened", "revtriton/sass.py",
           "self.warps_m * 16 > self.rows", "self.warps_m * 8 > self.rows",
           ("tests/test_sass.py",),
           "8 warps over a 64-row wgmma tile (two warpgroups on the same rows) not flagged"),
    # ---- scaled couplings (issue 14)
    Mutant("scaled-coupling-grad-unscaled", "revtriton/engine/segment.py",
           "nx1 = n1 if coupling.scale1 == 1.0 else n1 * coupling.scale1", "nx1 = n1",
           ("tests/test_scaled_couplings.py", "-k", "float_gradients or bitwise"),
           "the scaled stream's own gradient misses its scale"),
    Mutant("scaled-coupling-low-bits-dropped", "revtriton/ops/streams.py",
           "return restored | unpack_low_bits(self.low_bits, shift, stream.shape) if shift else restored",
           "return restored",
           ("tests/test_scaled_couplings.py", "-k", "bitwise or dropped_bits"),
           "the exact inverse shifts back without the bits the forward dropped"),
    Mutant("scaled-coupling-rebuild-ignores-swap", "revtriton/engine/segment.py",
           "        if coupling.swap:\n            y1, y2 = y2, y1\n        kept", "        kept",
           ("tests/test_scaled_couplings.py", "-k", "float_gradients"),
           "the rebuild reads a swapped block's outputs in the wrong order"),
    Mutant("scaled-twin-scale-missing", "revtriton/models/common.py",
           "s1, v1 = s1 >> scale_shift(c.scale1), v1 * c.scale1", "s1, v1 = s1 >> scale_shift(c.scale1), v1",
           ("tests/test_scaled_couplings.py", "-k", "bitwise"),
           "the exact stored-activation twin's straight-through path misses the scale"),
    Mutant("scaled-coupling-kept-bits-unpacked", "revtriton/ops/streams.py",
           "return pack_low_bits(res, self.shift)", "return (res & ((1 << self.shift) - 1)).to(torch.int32)",
           ("tests/test_scaled_couplings.py", "-k", "bytes_kept"),
           "the dropped bits are kept as one int32 per element (4 / (shift / 8) times the packed size)"),
    # ---- the attention half's sub-op mixes (issue 19)
    Mutant("sdpa-core-rope-backward-dropped", "revtriton/ops/fused_attention.py",
           "        packed[:, :, :rotated] = rope_unrotate_reference(packed[:, :, :rotated], *plan.rope)",
           "        pass",
           ("tests/test_fused_attention.py", "-k", "sub_op_mixes_match"),
           "the fused-GEMM + SDPA mix leaves dq and dk rotated (no RoPE backward)"),
    Mutant("flash-core-not-causal", "revtriton/ops/fused_attention.py",
           "    return FlashAttention.apply(q, k, v, bool(causal), segments)",
           "    return FlashAttention.apply(q, k, v, False, segments)",
           ("tests/test_fused_attention.py", "-k", "sub_op_mixes_match"),
           "the cuBLAS + Triton flash mix drops the causal mask"),
    Mutant("sub-op-mix-not-registered", "revtriton/ops/attention.py",
           'backend.register_candidate("norm_attention", "torch_gemm_flash", _norm_attention_torch_gemm_flash,\n'
           "                           available=triton_runs_on, supports=_triton_supports)",
           "",
           ("tests/test_dispatch_choice.py", "-k", "sub_op_mix"),
           "the cuBLAS + Triton flash mix is never raced"),

    # ---- the RevGPT presets as Hugging Face models (issue 15)
    Mutant("hf-preset-exact-gelu", "revtriton/models/hf.py",
           'activation_function="gelu_new"', 'activation_function="gelu"',
           ("tests/test_hf_presets.py", "-k", "function"),
           "the GPT-2 style preset uses exact GELU where RevGPT uses the tanh approximation"),
    Mutant("hf-preset-rope-theta-dropped", "revtriton/models/hf.py",
           "rope_theta=c.rope_theta, ", "",
           ("tests/test_hf_presets.py", "-k", "function"),
           "the LLaMA style preset ignores the preset's RoPE base"),

    # ---- GPT-NeoX (issue 15)
    Mutant("neox-qkv-rows-not-regrouped", "revtriton/convert/neox.py",
           "        return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)",
           "        return t",
           ("tests/test_revify.py", "-k", "interleaved_qkv"),
           "the fused path reads GPT-NeoX's per-head interleaved q/k/v rows as [q; k; v]"),
    Mutant("neox-parallel-residual-ignored", "revtriton/convert/core.py",
           '    return bool(getattr(block, "use_parallel_residual", False) or _spec_of(block).parallel)',
           '    return bool(_spec_of(block).parallel)',
           ("tests/test_revify.py", "-k", "neox_preserving or halves_compute_the_original"),
           "a preserving conversion of a parallel-residual layer composes its sublayers one after the other"),
    Mutant("neox-partial-rotary-whole-head", "revtriton/ops/attention.py",
           "        rotated = head_dim if rope_dims is None else rope_dims",
           "        rotated = head_dim",
           ("tests/test_revify.py", "-k", "halves_compute_the_original and neox"),
           "partial rotary rotates the whole head"),

    Mutant("revified-layers-renamed", "revtriton/convert/core.py",
           "    _half_classes: tuple = ()\n    _keeps_class_name = True\n",
           "    _half_classes: tuple = ()\n",
           ("tests/test_accelerate_fsdp.py",),
           "revified layers lose the library's class name: accelerate's FSDP2 wrap policy shards no layer, silently"),
    # ---- RevViT as a timm model (issue 15; run with a python that has timm)
    Mutant("revvit-mean-pool-norm-skipped", "revtriton/models/vit.py",
           'x = x[:, 0] if self.pool == "token" else self.norm(x.mean(dim=1))',
           'x = x[:, 0] if self.pool == "token" else x.mean(dim=1)',
           ("tests/test_timm_presets.py",),
           "forward_head skips the final norm of mean pooling"),
    Mutant("revvit-reset-keeps-head", "revtriton/models/vit.py",
           "        self.num_classes = num_classes\n        if num_classes == 0:",
           "        self.num_classes = num_classes\n        return\n        if num_classes == 0:",
           ("tests/test_timm_presets.py",),
           "reset_classifier keeps the old head"),
    # ---- decoders through the library's own forward (issue 15)
    Mutant("host-mask-ignores-the-layer-kind", "revtriton/convert/host.py",
           '        return self.masks[_spec_of(block).window is not None]', "        return self.masks[0]",
           ("tests/test_host_forward.py", "-k", "attention_kind"),
           "every layer gets the full-attention mask: sliding-window layers see past their window"),
    Mutant("host-4d-mask-fused", "revtriton/convert/host.py",
           "        return host.fusable and not decoding and not self._use_modules(x)",
           "        return not decoding and not self._use_modules(x)",
           ("tests/test_token_layouts.py", "-k", "custom_4d_mask"),
           "a custom 4-D mask is dropped: the fused kernels run plain causal attention"),
    Mutant("host-dynamic-rope-fused", "revtriton/convert/core.py",
           "    if rotary is not None and (rope_type not in STATIC_ROPE_TYPES or getattr(",
           "    if False and rotary is not None and (rope_type not in STATIC_ROPE_TYPES or getattr(",
           ("tests/test_revify.py", "-k", "rope_the_kernels_lack"),
           "dynamic / partial RoPE is rejected (or computed as default RoPE) instead of the model's own"),
    Mutant("host-rerun-appends-to-the-cache-twice", "revtriton/convert/host.py",
           "    call.keep_cache_layer(cache, attention.layer_idx)\n", "    pass\n",
           ("tests/test_generation.py", "-k", "failed_cached_forward"),
           "the overflow report's re-run of the halves appends the step to the cache again"),
    Mutant("host-new-cache-layers-kept", "revtriton/convert/host.py",
           "            del cache.layers[self.cache_depth:]", "            pass",
           ("tests/test_generation.py", "-k", "failed_cached_forward"),
           "a failed step stays in the cache layers the call created (a DynamicCache without a config)"),
    Mutant("host-packed-rows-decoded", "revtriton/convert/host.py",
           "            kwargs[\"use_cache\"], cache = False, None", "            pass",
           ("tests/test_token_layouts.py", "-k", "library_models and llama"),
           "packed rows without grad keep a cache, and the library's masks then join the sequences"),
    Mutant("probe-keeps-fused-branches", "revtriton/convert/probe.py",
           '                if spec.fused_attention and not _relative_error(attention(x, cond), a) <= tolerance:',
           "                if False:",
           ("tests/test_host_forward.py", "-k", "conventions_compute"),
           "SmolLM3's layer without RoPE and Helium's interleaved rotary run the fused kernels' RoPE"),
    Mutant("probe-passes-every-layer", "revtriton/convert/probe.py",
           "                error = _relative_error(x + a + m - x, out - x)  # against the layer's update, not x + update",
           "                error = 0.0",
           ("tests/test_host_forward.py", "-k", "not_llamas"),
           "a layer that is not LLaMA's (Granite's residual multiplier) converts, silently computing another function"),
    # ---- pre-norm encoders with BERT's layer parts (issue 15)
    Mutant("encoder-attention-causal", "revtriton/convert/encoder.py",
           "                            causal=False, norm=\"layer\", eps=norm.eps, segments=segments)",
           "                            causal=True, norm=\"layer\", eps=norm.eps, segments=segments)",
           ("tests/test_encoders.py", "-k", "heads_and_the_base"),
           "the encoder's fused attention masks future keys (the probe then keeps the library's modules: never fused)"),
    Mutant("encoder-padding-keys-seen", "revtriton/convert/encoder.py",
           "        segments = None if layout is None else layout[1]  # absolute positions entered with the embeddings",
           "        segments = None",
           ("tests/test_encoders.py", "-k", "each_sequence_alone"),
           "the encoder's fused attention attends to padding keys and across packed sequences"),
    Mutant("encoder-mlp-norm-twice", "revtriton/convert/encoder.py",
           "        h = b.intermediate(x if inside else norm(x))", "        h = b.intermediate(norm(x))",
           ("tests/test_revify.py", "-k", "halves_compute and roberta_pre"),
           "RoBERTa-PreLayerNorm's MLP normalises twice (its intermediate norms itself)"),
    Mutant("encoder-probe-passes-every-layer", "revtriton/convert/probe.py",
           "                error = _relative_error(x + a + m - x, out - x)  # against the layer's update, not x + update",
           "                error = 0.0",
           ("tests/test_encoders.py", "-k", "not_pre_norm"),
           "an encoder layer computing another function converts silently"),
    Mutant("encoder-decodes-on-the-library-path", "revtriton/convert/encoder.py",
           "    _layers, _rope, _caches = \"encoder.layer\", False, False",
           "    _layers, _rope, _caches = \"encoder.layer\", False, True",
           ("tests/test_encoders.py", "-k", "heads_and_the_base"),
           "an encoder without grad takes the library's modules (the decoding path) instead of the fused halves"),
    # ---- decoders with GPT-2's and GPT-J's layers, found by their conventions (issue 15)
    Mutant("parallel-residual-read-as-sequential", "revtriton/convert/core.py",
           '    return bool(getattr(block, "use_parallel_residual", False) or _spec_of(block).parallel)',
           '    return bool(getattr(block, "use_parallel_residual", False))',
           ("tests/test_host_forward.py", "-k", "parallel_layers_compute"),
           "GPT-J's whole-layer half computes mlp(h) after attention instead of beside it"),
    Mutant("parallel-probe-sequential", "revtriton/convert/probe.py",
           "                m = mlp(x if parallel else x + a)", "                m = mlp(x + a)",
           ("tests/test_host_forward.py", "-k", "parallel_layers_compute"),
           "the probe checks GPT-J's layers as sequential ones (and refuses them)"),
    Mutant("gpt2-style-loop-unchecked", "revtriton/convert/probe.py",
           '    _require_layer_loop(base, r"hidden_states = block\\(",', '    _require_layer_loop(base, r"",',
           ("tests/test_host_forward.py", "-k", "gpt2_style_layers"),
           "GPT-Neo converts although its loop reads outputs[0] of a stand-in that returns the hidden states"),
    Mutant("head-class-not-swapped", "revtriton/convert/host.py",
           "    if model is not base:\n        _swap_class(model, _RevifiedLM)", "    if False:\n        _swap_class(model, _RevifiedLM)",
           ("tests/test_host_forward.py", "-k", "head_classes"),
           "a classifier around a converted model takes gradient-checkpointing requests silently (never applied)"),
    Mutant("layer-slice-unchecked", "revtriton/convert/probe.py",
           '    _require_layer_loop(base, r"self\\.layers\\[|\\bin self\\.layers\\b",', '    _require_layer_loop(base, r"",',
           ("tests/test_host_forward.py", "-k", "not_llamas"),
           "a base model whose forward hides its layer loop converts (the stand-ins may never be asked)"),
    Mutant("encoder-loop-unchecked", "revtriton/convert/encoder.py",
           '    _require_layer_loop(encoder, r"\\bin (enumerate\\()?self\\.layer\\b",', '    _require_layer_loop(encoder, r"",',
           ("tests/test_encoders.py", "-k", "not_pre_norm"),
           "an encoder whose forward hides its layer loop converts"),
    Mutant("gpt2-linear-mlp-transposed", "revtriton/convert/gpt2.py",
           "    return weight if isinstance(projection, nn.Linear) else weight.t()",
           "    return weight.t()",
           ("tests/test_host_forward.py", "-k", "gpt2s_layer_conventions"),
           "GPTBigCode's nn.Linear MLP read as Conv1D (the probe then keeps its modules: never fused)"),
    Mutant("library-attention-without-layout-positions", "revtriton/convert/host.py",
           "        return host.layout[0]\n", "        return None\n",
           ("tests/test_token_layouts.py", "-k", "flash_style"),
           "GPTBigCode's attention module gets no position ids: a flash-style attention joins packed sequences"),
    Mutant("encoder-library-attention-without-positions", "revtriton/convert/encoder.py",
           "        return self._branch(x, host.mask_for(self.block), dict(extra, position_ids=self._position_ids(host)))",
           "        return self._branch(x, host.mask_for(self.block), extra)",
           ("tests/test_token_layouts.py", "-k", "flash_style"),
           "the encoder's attention module gets no position ids: a flash-style attention joins packed sequences"),
    Mutant("varlen-bounds-unchecked", "revtriton/convert/host.py",
           "        if given is not None and not torch.equal(given.to(device=bounds.device, dtype=bounds.dtype), bounds):",
           "        if False:",
           ("tests/test_token_layouts.py", "-k", "varlen"),
           "cu_seq_lens that mark other sequences than the position_ids are ignored silently"),
    # ---- padded and packed rows in the fused attention kernels (issue 15)
    Mutant("fused-forward-ignores-segments", "revtriton/ops/fused_attention.py",
           "            q, k, v, causal=plan.causal, segments=plan.segments))(q, k, v, None, plan.segments)",
           "            q, k, v, causal=plan.causal))(q, k, v, None, None)",
           ("tests/test_token_layouts.py", "-k", "fused_kernels"),
           "the fused half's attention forward sees across sequences and padding"),
    Mutant("fused-rope-ignores-positions", "revtriton/ops/fused_attention.py",
           "            self.rope = (cached_rope_tables(self.tokens, self.head_dim, rope_theta, x.device) if positions is None",
           "            self.rope = (cached_rope_tables(self.tokens, self.head_dim, rope_theta, x.device) if True",
           ("tests/test_fused_attention.py", "-k", "every_candidate_takes_the_token_layout"),
           "rows are rotated at 0..T-1, not at their positions"),
    Mutant("kernel-padding-query-never-sees-itself", "kernels/attention.py",
           "    alone = (seg == 0) & (offs < tl.load(SELF_UNTIL + b))",
           "    alone = seg < 0",
           ("tests/test_fused_attention.py", "-k", "padded_and_packed_rows_in_the_kernels"),
           "a padding query with no real key before it has an empty row (NaN)"),
    Mutant("kernel-dkdv-ignores-segments", "kernels/attention.py",
           "                p_t = tl.where(allowed & row_ok[None, :], p_t, 0.0)",
           "                p_t = tl.where(row_ok[None, :], p_t, 0.0)",
           ("tests/test_fused_attention.py", "-k", "padded_and_packed_rows_in_the_kernels"),
           "dk / dv sum over queries of other sequences"),

    Mutant("segment-span-drops-last-key", "revtriton/ops/fused_attention.py",
           'scatter_reduce(1, bucket, pos + 1, "amax")', 'scatter_reduce(1, bucket, pos, "amax")',
           ("tests/test_fused_attention.py", "-k", "spans_cover and packed"),
           "a packed sequence's key span ends one key early: the kernels skip a block it needs"),
    Mutant("dkdv-one-loop-drops-the-causal-mask", "kernels/attention.py",
           """s_t = tl.where(offs_m[None, :] >= offs_n[:, None], s_t, float("-inf"))""",
           """s_t = tl.where(offs_m[None, :] >= 0 * offs_n[:, None], s_t, float("-inf"))""",
           ("tests/test_tiles.py", "-k", "attention_backward"),
           "the one-loop dk/dv pass sums over future queries (the mask folded into S^T's accumulator is lost)"),
    Mutant("dkdv-one-loop-ignores-segments", "kernels/attention.py",
           """                    s_t = tl.where(allowed & row_ok[None, :], s_t, float("-inf"))""",
           """                    s_t = tl.where(row_ok[None, :], s_t, float("-inf"))""",
           ("tests/test_fused_attention.py", "-k", "padded_and_packed_rows_in_the_kernels"),
           "the one-loop dk/dv pass sums over queries of other sequences"),
    Mutant("dkdv-one-loop-delta-not-folded", "kernels/attention.py",
           "tl.dot(v, tl.trans(do), zero_scores - delta[None, :], input_precision=DOT_PRECISION)",
           "tl.dot(v, tl.trans(do), zero_scores, input_precision=DOT_PRECISION)",
           ("tests/test_tiles.py", "-k", "attention_backward"),
           "dS^T = P^T * dP^T without the row's delta: dk wrong in the one-loop form"),
    Mutant("dkdv-skips-the-last-query-block", "kernels/attention.py",
           "        stream_end = tl.minimum(end, seq_len)\n", "        stream_end = tl.minimum(end, seq_len) - 16\n",
           ("tests/test_fused_attention.py", "-k", "skipped_blocks and packed"),
           "the dk/dv pass stops a block before the last query that may see its keys"),
    # ---- the newcomer's findings (issue 38)
    Mutant("sweep-overwrites-an-earlier-run", "perf/sweep.py",
           "    while any((out_dir / f\"{candidate}.{kind}\").exists()",
           "    while False and any((out_dir / f\"{candidate}.{kind}\").exists()",
           ("tests/test_perf.py", "-k", "never_overwrites"),
           "a second sweep with the same device, date and tag overwrites the first one's files"),
    Mutant("plot-series-share-one-style", "perf/report.py",
           "PLOT_MARKERS[i % len(PLOT_MARKERS)], PLOT_LINES[i % len(PLOT_LINES)]", "\"o\", \"-\"",
           ("tests/test_perf.py", "-k", "memory_vs_depth_plot"),
           "every plotted series drawn alike: one lying on another hides it"),
    Mutant("from-pretrained-raises-the-log-level", "revtriton/convert/__init__.py",
           "    logger.addFilter(_only_errors)\n", "    logger.setLevel(40)\n",
           ("tests/test_revify.py", "-k", "stray_line"),
           "from_pretrained quiets the library by its logger's level: the library then warns of a TP plan"),
    Mutant("import-pulls-in-dynamo", "revtriton/engine/stack.py",
           "    @torch._disable_dynamo\n    def forward(", "    @torch.compiler.disable\n    def forward(",
           ("tests/test_engine.py", "-k", "import_revtriton"),
           "the stack's graph break imports torch._dynamo at import: `import revtriton` 1.5 s longer"),
    # ---- nothing silently wrong, round two (issue 39)
    Mutant("checksum-weights-linear-in-position", "revtriton/ops/streams.py",
           "weights = h.bitwise_xor_(h >> 16).mul_(CHECKSUM_MIX).bitwise_or_(1)", "weights = h.bitwise_or_(1)",
           ("tests/test_checksum.py", "-k", "swapped_rows and torch"),
           "checksum weights linear in the position: two equal-sum rows swapped at an even distance go unseen"),
    Mutant("backend-cache-written-unlocked", "revtriton/ops/backend.py",
           "        fcntl.flock(lock, fcntl.LOCK_EX)\n", "        pass\n",
           ("tests/test_dispatch_choice.py", "-k", "two_processes"),
           "two processes writing the backend cache at once: one loses the other's new entries"),
    Mutant("backend-cache-recursion-uncaught", "revtriton/ops/backend.py",
           "    except (OSError, ValueError, RecursionError) as error:", "    except (OSError, ValueError) as error:",
           ("tests/test_dispatch_choice.py", "-k", "bad_cache"),
           "a cache file of deeply nested JSON crashes the forward with RecursionError"),
    # ---- session 14: runs of packed rows, a fresh process's projections, checkpoint's early stop
    Mutant("run-end-ignored", "kernels/attention.py",
           "    free_hi = tl.minimum(tl.maximum((run_end // BLOCK) * BLOCK, free_lo), hi)\n",
           "    free_hi = hi\n",
           ("tests/test_fused_attention.py", "-k", "skipped_blocks"),
           "the unmasked loop runs past the run the rows share: scores of other sequences unmasked"),
    Mutant("dq-unmasked-blocks-run-twice", "kernels/attention.py",
           "    gap = 0\n    if SEGMENTS and MASKED:\n        gap = skip_hi - skip_lo\n",
           "    gap = 0\n",
           ("tests/test_fused_attention.py", "-k", "skipped_blocks and three"),
           "the dq pass's masked loop runs the run's blocks the unmasked loop already summed"),
    Mutant("dkdv-run-ignores-the-diagonal", "kernels/attention.py",
           "            free_from = tl.minimum(tl.maximum(diagonal_end, lo), stream_end)\n",
           "            free_from = tl.minimum(lo, stream_end)\n",
           ("tests/test_fused_attention.py", "-k", "skipped_blocks and three"),
           "causal dk/dv: query blocks crossing the diagonal take the unmasked loop inside a run"),
    Mutant("runs-span-padding", "revtriton/ops/fused_attention.py",
           "    return torch.where(real, run_first, tokens), torch.where(real, run_end, 0)",
           "    return run_first, run_end",
           ("tests/test_fused_attention.py", "-k", "segment_spans"),
           "padding tokens get runs: padding queries would take the unmasked loop"),
    Mutant("conv1d-fused-only-after-a-conversion", "revtriton/convert/core.py",
           "    return pytorch_utils is not None and type(module) is getattr(pytorch_utils, \"Conv1D\", None)",
           "    return False",
           ("tests/test_host_forward.py", "-k", "unpickled_gpt2"),
           "GPT-2's Conv1D not taken for a fused projection (as in a process that had converted no GPT-2)"),
    # ---- the conversion package's one registry (issue 46)
    Mutant("family-left-out-of-the-registry", "revtriton/convert/__init__.py",
           "parallel.FAMILY, gpt2.FAMILY,", "parallel.FAMILY,",
           ("tests/test_convert_fixtures.py", "-k", "registry"),
           "a family module whose FAMILY is not listed: its models are refused (GPT-2 here)"),
    Mutant("old-pickled-specs-not-read", "revtriton/convert/core.py",
           "    if isinstance(spec, dict):  # a model pickled when specs were dicts", "    if False:",
           ("tests/test_convert_fixtures.py", "-k", "pickle_made_before"),
           "a model pickled when layer specs were dicts no longer runs"),
    Mutant("layers-view-pickled-by-its-module", "revtriton/convert/host.py",
           "_host_layer_calls.__module__ = SWAPPED_MODULE", "pass",
           ("tests/test_convert_fixtures.py", "-k", "names_the_package"),
           "a converted stack pickles by today's module: moving the code breaks users' pickles"),
    Mutant("aligned-8-taken-for-16", "kernels/gemm.py",
           "        if A_K_MAJOR:\n            stride_am = stride_am // 8 * 8\n",
           "        if A_K_MAJOR:\n            stride_am = stride_am // 16 * 16\n",
           ("tests/test_tiles.py", "-k", "take_the_hints"),
           "the pointer path's alignment hint rounds a row stride of 8 elements' multiple to 16: rows misread"),
    Mutant("aligned-8-output-stride-taken-for-16", "kernels/gemm.py",
           "        stride_cm = stride_cm // 8 * 8\n", "        stride_cm = stride_cm // 16 * 16\n",
           ("tests/test_tiles.py", "-k", "take_the_hints"),
           "the epilogue's alignment hint rounds the output's row stride to 16: rows written over each other"),
    Mutant("qkv-tma-k-not-advanced", "kernels/attention_qkv.py",
           "            w = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])",
           "            w = w_desc.load([pid_n * BLOCK_N, 0])",
           ("tests/test_tiles.py", "-k", "qkv_projection"),
           "the QKV GEMM's TMA path multiplies every K step by W's first K tile"),
    Mutant("aligned-8-absent-tile-counted-as-8", "revtriton/ops/gemm.py",
           "16 if aux_stride is None else aux_stride", "8 if aux_stride is None else aux_stride",
           ("tests/test_tiles.py", "-k", "no_alignment_hint"),
           "a launch without a saved pre-activation counts its absent tile's stride as 8: the hint is set "
           "at every size, a second compiled variant of every GEMM"),
    Mutant("aligned-8-output-stride-as-a-product", "revtriton/ops/gemm.py",
           "stride_bk * stride_bn, stride_cm,\n", "stride_bk * stride_bn, stride_cm * stride_cn,\n",
           ("tests/test_tiles.py", "-k", "through_its_strides"),
           "the output's row stride checked as its product with the column stride: a transposed output's "
           "row stride 1 is rewritten as 0"),
    Mutant("persistent-walk-stops-a-tile-early", "kernels/gemm.py",
           "tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)",
           "tl.range(tl.program_id(0), num_tiles - 1, tl.num_programs(0)",
           ("tests/test_tiles.py", "-k", "persistent"),
           "a persistent GEMM's programs never reach the last output tile (left unwritten)"),
    Mutant("persistent-grid-for-every-config", "revtriton/ops/gemm.py",
           "persistent_programs(tiles, device) if meta[\"PERSISTENT\"] else tiles",
           "persistent_programs(tiles, device)",
           ("tests/test_tiles.py", "-k", "gemm_variants"),
           "one program per SM launched for a config that writes one tile a program: tiles left unwritten"),
    Mutant("persistent-kept-for-a-residual-epilogue", "kernels/configs.py",
           "persistent_unfit = kwargs.get(\"RESIDUAL\") or kwargs.get(\"SPLIT_K\", 1) > 1",
           "persistent_unfit = kwargs.get(\"SPLIT_K\", 1) > 1",
           ("tests/test_static.py", "-k", "persistent"),
           "a persistent config offered to the couple's residual GEMM, whose tile loop spills (static model)"),
    Mutant("static-persistent-tiles-as-programs", "perf/static.py",
           "launch.grid_size(dict(config.kwargs, PERSISTENT=False) if config.kwargs.get(\"PERSISTENT\")",
           "launch.grid_size(config.kwargs if config.kwargs.get(\"PERSISTENT\")",
           ("tests/test_static.py", "-k", "waves_count"),
           "the model counts a persistent config's programs (one per SM) as its tiles: one wave, wrong time"),
    Mutant("null-pointer-ignores-its-dtype", "revtriton/ops/launches.py",
           "        return NullPointer(dtype)\n", "        return NullPointer(like.dtype)\n",
           ("tests/test_launch_args.py",),
           "an unused low-bits pointer bound as int32 in the forward, uint8 in the inverse: two compiled kernels"),
    Mutant("null-pointer-under-the-interpreter", "revtriton/ops/launches.py",
           "if like.is_cuda and not interpreter_enabled() and", "if like.is_cuda and",
           ("tests/test_launch_args.py",),
           "null pointers handed to the interpreter, which reads every argument as a tensor"),
    Mutant("checkpoint-whole-still-stops-early", "perf/stacks.py",
           "use_reentrant=False, early_stop=self.early_stop)", "use_reentrant=False)",
           ("tests/test_perf.py", "-k", "early_stop"),
           "the benchmark's no-early-stop row recomputes what checkpoint does (the explanation would not show)"),
    # ---- families a user brings (issue 48)
    Mutant("stablelm-mlp-dropout-ignored", "revtriton/convert/llama.py",
           '"resid_mlp_dropout" if "resid_mlp_dropout" in _parts(block) else "dropout"', '"resid_mlp_dropout"',
           ("tests/test_host_forward.py", "-k", "drops_what and sequential"),
           "StableLM's MLP-branch dropout left out of the MLP half: training computes another function"),
    Mutant("stablelm-parallel-dropout-on-both-branches", "revtriton/convert/parallel.py",
           '        return _residual_dropout(self.block, "resid_dropout")\n',
           '        return _mlp_branch_dropout(self.block)\n',
           ("tests/test_host_forward.py", "-k", "drops_what and parallel"),
           "parallel StableLM's dropout applied to the attention branch too (only Phi's is on both)"),
    Mutant("stablelm-parallel-dropout-ignored", "revtriton/convert/parallel.py",
           '"resid_dropout" if hasattr(block, "resid_dropout") else "dropout"', '"resid_dropout"',
           ("tests/test_host_forward.py", "-k", "drops_what and parallel"),
           "parallel StableLM's MLP-branch dropout left out"),
    Mutant("sandwich-attention-post-norm-dropped", "revtriton/convert/host.py",
           "        return self._branch_output()(_first(out))\n", "        return self._branch_dropout()(_first(out))\n",
           ("tests/test_host_forward.py", "-k", "sandwich_norm_decoders_compute"),
           "the norm after a sandwich layer's attention left out of its half (the probe must refuse, or the "
           "logits differ)"),
    Mutant("sandwich-sliding-windows-not-set", "revtriton/convert/sandwich.py",
           "        block._revtriton_spec = replace(spec, window=window)\n", "        block._revtriton_spec = spec\n",
           ("tests/test_host_forward.py", "-k", "sandwich_norm_decoders_compute and Gemma2"),
           "Gemma 2's sliding-window layers get the full causal mask"),
    Mutant("sandwich-detected-after-llama", "revtriton/convert/__init__.py",
           "sandwich.FAMILY, llama.FAMILY,", "llama.FAMILY, sandwich.FAMILY,",
           ("tests/test_host_forward.py", "-k", "sandwich_norm_decoders_compute and Gemma2"),
           "LLaMA's detector, run first, refuses Gemma 2 for its extra norms"),
    Mutant("gemma3-rotary-per-layer-type-admitted", "revtriton/convert/sandwich.py",
           "    _refuse_rotary_per_layer_type(base, name)\n", "",
           ("tests/test_host_forward.py", "-k", "gemma3s_rotary"),
           "Gemma 3 converts, then fails at its first forward (or would use one rotary embedding for all)"),
    Mutant("dinov2-attention-layer-scale-dropped", "revtriton/convert/dinov2.py",
           "        return b.drop_path(b.layer_scale1(_first(b.attention(b.norm1(x), host.mask_for(b), **extra))))",
           "        return b.drop_path(_first(b.attention(b.norm1(x), host.mask_for(b), **extra)))",
           ("tests/test_host_forward.py", "-k", "dinov2_keeps"),
           "DINOv2's attention half without its layer scale (another function than the pretrained one)"),
    Mutant("opt-branch-dropout-ignored", "revtriton/convert/opt.py",
           "    return lambda h: nn.functional.dropout(h, p=block.dropout, training=block.training)",
           "    return lambda h: h",
           ("tests/test_host_forward.py", "-k", "opt_drops_what"),
           "OPT's dropout on the branches left out: training computes another function"),
    Mutant("opt-post-norm-admitted", "revtriton/convert/opt.py",
           "    if not config.do_layer_norm_before:  # OPT-350M", "    if False:  # OPT-350M",
           ("tests/test_host_forward.py", "-k", "opt_with_its_dropout"),
           "post-norm OPT (350M) converted as if its layers were pre-norm: another function, silently"),
]


def copy_tree(dst):
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".pytest_cache", "*.egg-info", "results",
                                    "build", "dist", ".mypy_cache", ".ruff_cache")
    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)
    # The package maps revtriton.kernels to kernels/ (pyproject's package-dir); an editable install
    # would resolve it to the original tree, so the copy gets its own revtriton/kernels.
    link = os.path.join(dst, "revtriton", "kernels")
    if not os.path.exists(link):
        os.symlink(os.path.join("..", "kernels"), link)


def environment(copy):
    env = dict(os.environ)
    env["PYTHONPATH"] = copy + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutated file never meets a stale .pyc
    env["TRITON_INTERPRET"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports_from(copy, env):
    code = ("import revtriton, revtriton.kernels.attention as a, revtriton.ops.streams as s; "
            "print(revtriton.__file__); print(a.__file__); print(s.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    paths = out.stdout.split()
    if out.returncode or len(paths) != 3 or not all(os.path.realpath(p).startswith(os.path.realpath(copy))
                                                    for p in paths):
        sys.exit(f"the copy does not import its own revtriton:\n{out.stdout}\n{out.stderr}")


def run_pytest(copy, env, tests, timeout):
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]
    start = time.time()
    try:
        out = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.time() - start, ""
    return out.returncode, time.time() - start, out.stdout + out.stderr


def baseline_selection(mutants):
    """One pytest run covering every mutant's selection: all their files, and a -k that ORs
    "module and (its -k expression)" per selection (-k matches module names too)."""
    files, keys = [], []
    for m in mutants:
        tests = list(m.tests)
        expr = None
        if "-k" in tests:
            i = tests.index("-k")
            expr = tests[i + 1]
            del tests[i:i + 2]
        files += [t for t in tests if t not in files]
        for t in tests:
            module = os.path.splitext(os.path.basename(t.split("::")[0]))[0]
            key = f"({module} and ({expr}))" if expr else f"({module})"
            if key not in keys:
                keys.append(key)
    return [*files, "-k", " or ".join(keys)]


def summary_line(output):
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args()

    mutants = MUTANTS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            sys.exit(f"unknown mutants: {sorted(unknown)}")
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:36s} {m.path:28s} {' '.join(m.tests)}\n{'':36s} {m.what}")
        return 0

    tmp = tempfile.mkdtemp(prefix="revtriton-mutate-")
    copy = os.path.join(tmp, "repo")
    copy_tree(copy)
    env = environment(copy)
    check_imports_from(copy, env)
    print(f"copy: {copy} ({len(mutants)} mutants)", flush=True)
    start = time.time()
    try:
        if not args.no_baseline:
            rc, seconds, output = run_pytest(copy, env, baseline_selection(mutants), args.timeout)
            print(f"baseline (every selection, unmutated): {'ok' if rc == 0 else 'FAILED'} ({seconds:.0f} s)", flush=True)
            if rc != 0:
                print(output[-3000:])
                sys.exit("the unmutated copy fails the mutants' tests: fix that first")
        results = []
        for m in mutants:
            path = os.path.join(copy, m.path)
            with open(path) as fh:
                original = fh.read()
            count = original.count(m.old)
            if count != 1:
                results.append((m, f"STALE (matches {count}x)", 0.0, ""))
                print(f"{m.name:36s} STALE: the text to replace occurs {count} times in {m.path}", flush=True)
                continue
            with open(path, "w") as fh:
                fh.write(original.replace(m.old, m.new))
            try:
                rc, seconds, output = run_pytest(copy, env, m.tests, args.timeout)
            finally:
                with open(path, "w") as fh:
                    fh.write(original)
            if rc == 0:
                verdict = "SURVIVED"
            elif rc == 1:
                verdict = "killed"
            elif rc == "timeout":
                verdict = "killed (timeout)"
            elif rc == 5:
                verdict = "NO TESTS RAN"
            else:
                verdict = f"killed (pytest exit {rc})"
            results.append((m, verdict, seconds, output))
            print(f"{m.name:36s} {verdict:18s} {seconds:5.0f} s  {summary_line(output)[:70]}", flush=True)
    finally:
        if args.keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    bad = [(m, v) for m, v, _, _ in results if not v.startswith("killed")]
    print(f"\n{len(results)} mutants, {len(results) - len(bad)} killed, {len(bad)} not killed "
          f"({time.time() - start:.0f} s)")
    for m, verdict in bad:
        print(f"  {verdict}: {m.name} ({m.path}): {m.what}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
