"""Engine: the coordinator. It holds the parts zero.initialize built (builder.py) and runs the
training loop a DeepSpeed user knows through them:

    loss = engine(batch)      # forward on the low-precision parameters
    engine.backward(loss)     # loss * loss_scale / gradient_accumulation_steps, then autograd
    engine.step()             # every micro-batch; updates at the accumulation boundary

The engine's phase moves IDLE -> FORWARD -> BACKWARD -> IDLE (step). Calling backward twice for one
micro-batch is an error: the gradients of the second call would be added after the reduction of
the first (sum the losses and call backward once). Two DeepSpeed styles end a micro-batch without
engine.step(): a backward inside engine.no_sync(), and one after
engine.set_gradient_accumulation_boundary(False); the next backward then starts the next
micro-batch.

Elsewhere: construction (builder.py), misuse checks (guards.py), DeepSpeed's getters and
fallthrough (deepspeed_api.py), generation (generation.py); checkpoints and exports read the
training state (state.py) in checkpoint/.
"""

import contextlib
import gc
import logging
import os

import torch

from .. import checkpoint
from ..accelerator import Accelerator
from ..autotuning import TrialProbe
from ..checkpoint import hf
from ..checkpoint.periodic import resume_latest
from ..comm import Communicator
from ..compiler import compile_model
from ..partition import gathered
from ..partition.units import UnitState
from ..profiling import flops_profiler
from ..state import StepCounters, TrainingState
from . import builder, generation, guards
from .deepspeed_api import DeepSpeedAPI
from .phase import Phase

logger = logging.getLogger("zero")


class Engine(DeepSpeedAPI, torch.nn.Module):
    """A model trained with ZeRO stage 0, 1, 2 or 3 over one data-parallel group, or, built
    without an optimizer, run for forward, evaluation and generation only (ZeRO-Inference,
    [Note: ZeRO-Inference] in partition/stages.py; `inference_only`).

    Constructed by zero.initialize (every rank, collectively); `mpu` is a Megatron-style
    model-parallel unit when the model is tensor-parallel. `module` is the user's model, whose
    trainable parameters now view zero's flat low-precision buffers. As DeepSpeed's engine, an
    attribute the engine lacks is looked up on `module` (__getattr__), and destroy() detaches
    the engine from the model. `state` is the training state checkpoints save and load.
    """

    def __init__(
        self,
        model,
        config,
        comm: Communicator,
        accelerator: Accelerator,
        optimizer=None,
        model_parameters=None,
        lr_scheduler=None,
        mpu=None,
    ):
        super().__init__()
        self._destroyed = False  # close() / destroy() ran: training calls raise
        self._compiled = None  # engine.compile()'s compiler.Compiled
        self.config, self.comm, self.accelerator, self.module = config, comm, accelerator, model
        parts = builder.build(
            model, config, comm, accelerator, optimizer, model_parameters, lr_scheduler, mpu
        )
        self.parts = parts
        self.optimizer, self.scaler = parts.optimizer, parts.scaler
        self.gatherer, self.frozen = parts.gatherer, parts.frozen
        self.fetch, self.bucket_sizes = parts.fetch, parts.bucket_sizes
        self.partition_groups, self.periodic = parts.partition_groups, parts.periodic
        self.monitor, self.tput_timer = parts.monitor, parts.tput_timer
        self.flops_profiler = flops_profiler.attach(self)  # DeepSpeed's; None when off
        self.state = TrainingState(
            module=model,
            optimizer=parts.optimizer,
            lr_scheduler=parts.lr_scheduler,
            scaler=parts.scaler,
            counters=StepCounters(),
            comm=comm,
            config=config,
            device=accelerator.device,
            frozen=parts.frozen,
            gatherer=parts.gatherer,
        )
        self.phase = Phase.IDLE
        self._no_sync = False  # inside engine.no_sync()
        self._boundary = None  # set_gradient_accumulation_boundary's value; None: count
        self._step_optional = False  # the last backward needs no engine.step() before the next
        self._counted = True  # the last backward's micro-batch counts toward accumulation
        self._reduced = False  # the last backward reduced gradients
        self._step_applied = False
        self._trial = TrialProbe.attach_from_environment(self)  # zrun --autotuning's, or None

    # ----- training loop ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the model. With fp16.auto_cast, floating-point tensor arguments are cast to fp16.

        Raises RuntimeError, before the model runs, when a parameter's tensor, dtype or
        requires_grad changed after zero.initialize ([Note: parameters changed behind the
        engine's back] in partition/shared.py), and for a training forward after a backward that
        raised, until engine.zero_grad() ([Note: a failed backward] in partition/stages.py)."""
        self._refuse_closed("forward")
        self._check_params()
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), torch.float16)
        # an engine without an optimizer (ZeRO-Inference) has no backward to keep units for
        training = self.optimizer.trains and torch.is_grad_enabled() and self.module.training
        if training:
            self._refuse_failed("engine(...) (a training forward)")
        if self.phase is Phase.IDLE and training:
            self.phase = Phase.FORWARD
        if training:
            self.tput_timer.start()
        timer = self.monitor.timer("forward") if training else contextlib.nullcontext()
        if self.gatherer is None:
            with timer:
                return self.module(*args, **kwargs)
        if training:
            self.gatherer.release_kept()  # kept by a forward whose backward never came
        self.gatherer.keeping = training  # units may stay gathered for backward
        try:
            with timer, self.gatherer.saved_weights():
                output = self.module(*args, **kwargs)
        except RuntimeError as error:
            if "saved tensor hooks" not in str(error):
                raise
            raise RuntimeError(
                f"rank {self.comm.rank}: {error} Under ZeRO stage 3 engine(...) runs the model "
                "with saved-tensor hooks (they let a released unit's weights be freed until "
                "backward), so torch.func transforms cannot run inside the model's forward; run "
                "them outside engine(...) or use stage 0-2"
            ) from error
        finally:
            self.gatherer.keeping = False
        if not training:
            self.gatherer.release_all()  # no backward follows: release pinned units now
        return output

    def backward(
        self,
        loss: torch.Tensor,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
    ) -> torch.Tensor:
        """Backpropagate loss * loss_scale / gradient_accumulation_steps and reduce gradients;
        DeepSpeed's engine.backward. scale_wrt_gas=False leaves out the division by
        gradient_accumulation_steps (the script scaled the loss itself). allreduce_gradients and
        release_loss are accepted for DeepSpeed's signature: zero always reduces at the
        boundary (use no_sync() to skip a reduction) and keeps no reference to the loss.

        Collective: every rank calls it once per micro-batch. Raises RuntimeError when called twice
        for one micro-batch without engine.step() in between, and on an engine built without an
        optimizer (ZeRO-Inference; DeepSpeed asserts "must provide optimizer during init in
        order to use backward"), naming why it has none; when a parameter changed behind the
        engine's back (as forward); torch's in-place modification error for a loss computed
        before the last engine.step() ([Note: stale graphs] in partition/stages.py). After a
        backward that raised, every training call raises until engine.zero_grad() drops the
        step's gradients ([Note: a failed backward] in partition/stages.py).
        """
        del allreduce_gradients, release_loss
        self._refuse_closed("backward")
        guards.refuse_without_optimizer(self.optimizer, "engine.backward()")
        self._refuse_failed("engine.backward()")
        self._check_params()
        if self.phase is Phase.BACKWARD:
            if not self._step_optional:
                raise RuntimeError(
                    f"rank {self.comm.rank}: engine.backward() called twice for one micro-batch; "
                    "call engine.step() after each backward (sum the losses to backpropagate "
                    "several)"
                )
            self._end_micro_batch()
        self.phase = Phase.BACKWARD
        self._step_optional = self._no_sync or self._boundary is False
        self._counted = not self._no_sync  # DeepSpeed: no_sync's micro-batches do not count
        scale = self.scaler.scale
        if scale_wrt_gas:
            scale /= self.config.gradient_accumulation_steps
        self._reduced = self.is_gradient_accumulation_boundary() and not self._no_sync
        self.optimizer.start_backward(reduce=self._reduced)
        self.monitor.record_loss(loss)
        # Stage 3: a reentrant activation-checkpoint recomputation runs its forward inside this
        # backward; zero's saved-tensor hooks make it save gathered weights by reference too
        # ([Note: saved weights] in engine/partition/saved_weights.py).
        saved = self.gatherer.saved_weights() if self.gatherer else contextlib.nullcontext()
        with self.monitor.timer("backward"), saved:
            try:
                (loss * scale).backward(retain_graph=retain_graph)
                self.optimizer.finish_backward()
            except BaseException as error:
                explained = guards.stale_graph_error(error, self.comm.rank)
                # no collectives: ranks may be elsewhere; zero_grad() recovers
                self.optimizer.abandon_backward(explained or error)
                self.phase, self._step_optional = Phase.IDLE, False
                if explained is not None:
                    raise explained from error
                raise
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Finish a micro-batch; at the accumulation boundary update parameters (collective).

        At the boundary: unscale, check overflow (fp16, bf16), clip to gradient_clipping, step the
        optimizer on the owned shards, all-gather parameters, step the lr scheduler (not on a
        skipped step) with `lr_kwargs` as its keyword arguments (DeepSpeed's, e.g. Megatron's
        {"increment": n}), and broadcast rank 0's floating-point buffers. Raises RuntimeError on
        an engine built without an optimizer (ZeRO-Inference), as backward() does.
        """
        self._refuse_closed("step")
        guards.refuse_without_optimizer(self.optimizer, "engine.step()")
        self._refuse_failed("engine.step()")
        if self._no_sync:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.step() inside engine.no_sync(); leave the "
                "context first (its gradients are reduced by the first backward after it)"
            )
        if self.phase is not Phase.BACKWARD:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.step() called without engine.backward() for this "
                "micro-batch"
            )
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and not self._reduced and self.config.zero.stage < 2:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.step() at a gradient accumulation boundary, but "
                "the last backward did not reduce gradients (it ran inside engine.no_sync() or "
                "before set_gradient_accumulation_boundary(True)); run the last micro-batch's "
                "forward and backward outside no_sync, after setting the boundary"
            )
        self._step_applied = False
        if boundary:
            guards.check_no_unmanaged_gradients(self.module, self.comm.rank)
            with self.monitor.timer("step"):
                self._step_applied = self.optimizer.step()
            if self._step_applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.state.counters.skipped_steps += 1
            self._sync_buffers()
            counters = self.state.counters
            counters.global_steps += 1
            counters.global_samples += self.config.train_batch_size
            self.comm.ledger.end_step()
            self.monitor.on_step(self)
            if self._trial is not None:
                self._trial.on_step(self)  # exits after autotuning.end_profile_step
        self.tput_timer.stop(global_step=boundary, report_speed=False)
        self._end_micro_batch()
        if boundary and self.periodic is not None:
            # once the micro-batch is counted: the checkpoint records the boundary it is at
            self.periodic.after_step(self.state, self.save_checkpoint)

    def _end_micro_batch(self) -> None:
        if self._counted:
            self.state.counters.micro_steps += 1
        self._step_optional = False
        self.phase = Phase.IDLE

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without reducing them, for the backwards inside;
        DeepSpeed's engine.no_sync (DDP's meaning: the first backward after the context reduces
        the sum). Only stages 0 and 1, whose ranks keep full gradients: stages 2 and 3 reduce
        every micro-batch to partition them, so there it raises RuntimeError (as DeepSpeed).
        Inside: engine.step() raises, and micro-batches are not counted toward
        gradient_accumulation_steps; each backward ends its micro-batch without a step. Not a
        collective; every rank must use it around the same micro-batches."""
        self._refuse_closed("no_sync")
        stage = self.config.zero.stage
        if stage >= 2:
            raise RuntimeError(
                f"engine.no_sync() cannot run under ZeRO stage {stage}: it partitions gradients "
                "by reducing them in every backward; use gradient_accumulation_steps (or "
                "set_gradient_accumulation_boundary), or stage 0 or 1"
            )
        if self._no_sync:
            raise RuntimeError("engine.no_sync() contexts do not nest")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the next micro-batches end a gradient accumulation, overriding the
        count of gradient_accumulation_steps; DeepSpeed's method of this name. With False, each
        backward ends its micro-batch without engine.step(); set True before the last
        micro-batch's forward, then backward and step() apply the update; None returns to the
        count. The loss is still divided by gradient_accumulation_steps from the config. Every
        rank must set the same values (the reduction at the boundary is collective). Raises
        TypeError for anything but True, False or None."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(
                "set_gradient_accumulation_boundary takes True, False or None (back to counting "
                f"gradient_accumulation_steps), not {is_boundary!r}"
            )
        self._boundary = is_boundary

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed's engine.zero_grad(): clear the .grad of the model's parameters. Under zero
        they hold none (gradients go into zero's buckets during backward, [Note: gradient
        lifetime] in partition/stages.py), so this never drops gradients accumulated over the
        micro-batches of a step; zero clears those itself after the optimizer step. Not a
        collective, except after an engine.backward() that raised: then it drops every gradient
        of the optimizer step (the micro-batches before the failed one too, as torch's
        zero_grad() would) and training may go on with the next forward; every rank must call
        it, and every rank raises RankMismatchError when the ranks' failed backwards launched
        different reductions ([Note: a failed backward] in partition/stages.py)."""
        super().zero_grad(set_to_none=set_to_none)
        if not self._destroyed:
            self.optimizer.zero_grad(set_to_none)

    def _check_params(self) -> None:
        guards.check_params(
            self.optimizer, self.parts.whole_frozen, self.config.compute_dtype, self.comm.rank
        )

    def _refuse_failed(self, method: str) -> None:
        guards.refuse_failed(self.optimizer, method, self.comm.rank)

    def _refuse_closed(self, method: str) -> None:
        guards.refuse_closed(self._destroyed, method, self.comm.rank)

    def _sync_buffers(self) -> None:
        """Give every rank rank 0's floating-point buffers (BatchNorm running statistics, which
        each rank updates from its own micro-batches), as DDP's broadcast_buffers does: one
        broadcast per dtype. Collective."""
        if self.comm.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self.module.buffers():
            if buffer.is_floating_point() and buffer.numel():
                by_dtype.setdefault(buffer.dtype, []).append(buffer)
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            self.comm.broadcast(flat, src=0)
            offset = 0
            for buffer in buffers:
                buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()

    # ----- full weights and exports (checkpoint/full_state.py, checkpoint/hf.py) ------------
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The model's full state dict on rank 0 (None elsewhere), parameters in the compute
        dtype; DeepSpeed's method of this name, which accelerate and the Trainer call to save
        a stage-3 model. See checkpoint.consolidated_16bit_state_dict. Collective at stage 3:
        every rank, with the same exclude_frozen_parameters. Raises RuntimeError after
        destroy()."""
        self._refuse_closed("_zero3_consolidated_16bit_state_dict")
        exclude = bool(exclude_frozen_parameters)
        gather = self.parts.state_dict_gather
        return checkpoint.consolidated_16bit_state_dict(self.state, gather, exclude)

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors") -> str | None:
        """Write the full model in the compute dtype as one safetensors file from rank 0;
        DeepSpeed's method. Collective. Returns the path on rank 0, None elsewhere. Raises
        RuntimeError under stage 3 when stage3_gather_16bit_weights_on_model_save is false
        (checkpoint.save_16bit_model)."""
        self._refuse_closed("save_16bit_model")
        gather = self.parts.state_dict_gather
        return checkpoint.save_16bit_model(self.state, save_dir, save_filename, gather)

    def save_pretrained(self, save_dir, max_shard_size="5GB", dtype=None) -> str:
        """Write the model in Hugging Face's layout (config.json and model.safetensors, or
        shards of at most max_shard_size with an index); the fp32 master weights, cast to
        `dtype` when given. Atomic; rank 0 holds one tensor at a time beyond its training
        state. Collective: every rank must call it. Returns save_dir on every rank. Raises
        ValueError for a bad max_shard_size or dtype, NotImplementedError with tensor
        parallelism; a write error on rank 0 is raised there and as CheckpointError on the
        other ranks. See checkpoint/hf.py ([Note: export]) and docs/hf.md."""
        self._refuse_closed("save_pretrained")
        return hf.save_pretrained(self.state, save_dir, max_shard_size, dtype)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's engine.empty_partition_cache(): at stage 3, release every gathered unit
        that is neither persistent nor held (by zero.GatheredParameters or a state_dict() under
        way), e.g. after generation with engine.module, then give cached device memory back
        (gc.collect, torch.cuda.empty_cache). Between engine(...) and engine.backward() the
        units kept for backward are released too (backward all-gathers them again) and those
        pinned until the end of backward stay. Stages 0-2 gather nothing: no-op.

        Not a collective: releasing frees this rank's buffers (after waiting for a prefetch in
        flight)."""
        if self.gatherer is None or self._destroyed:
            return
        force = self.phase is Phase.IDLE  # no backward is waiting for a pinned unit
        for unit in self.gatherer.units:
            if unit.state is not UnitState.SHARDED:
                self.gatherer.release(unit, force=force)
        gc.collect()
        if self.accelerator.is_cuda:
            torch.cuda.empty_cache()

    # ----- checkpoints (checkpoint/; docs/checkpoints.md) ------------------------------------
    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state=None,
        save_latest=True,
        exclude_frozen_parameters=False,
    ) -> str:
        """Write a sharded checkpoint to save_dir/tag (default tag: global_step{N}); DeepSpeed's
        signature. Each rank writes the fp32 master weights and optimizer state it owns and its
        random number generators and data loader state; rank 0 adds meta.json and the
        unpartitioned tensors; `latest` names the new tag only once every file is complete.
        exclude_frozen_parameters=True leaves the frozen parameters out ([Note: frozen
        parameters left out] in checkpoint/format.py).

        Collective: every rank must call it, with the same exclude_frozen_parameters. Raises
        CheckpointError (a ValueError) on every rank, before anything is written, when
        client_state is not JSON-serializable, and between the micro-batches of a gradient
        accumulation cycle (save after engine.step() at the boundary); RuntimeError after
        destroy(). Returns the checkpoint directory (checkpoint.save).
        """
        self._refuse_closed("save_checkpoint")
        self._finish_periodic_save()
        exclude = bool(exclude_frozen_parameters)
        save_dir = os.fspath(save_dir)
        return checkpoint.save(self.state, save_dir, tag, client_state or {}, save_latest, exclude)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
    ):
        """Load load_dir/tag (default: the tag in `latest`), saved on any world size and stage.
        Returns (checkpoint directory, client_state); (None, None) with a warning when there is
        no tag and no `latest` (a first run), as DeepSpeed. Without load_module_only each rank's
        generators and data loader resume as that rank saved them. An engine built without an
        optimizer loads the weights alone (and the step counters without load_module_only),
        whatever load_optimizer_states says (checkpoint/weights.py).

        Collective: every rank must call it; each rank reads only the ranges it owns now.
        Raises CheckpointError naming the file and the key, before any state is modified, for a
        missing or truncated file, a model that does not fit, a checkpoint saved without an lr
        scheduler loaded into an engine with one (unless load_lr_scheduler_states=False), a
        DeepSpeed checkpoint (with the migration path), a load between the micro-batches of a
        gradient accumulation cycle, and a tag replaced during the load (checkpoint.load).
        """
        self._refuse_closed("load_checkpoint")
        self._finish_periodic_save()
        load_dir = os.fspath(load_dir)
        if checkpoint.nothing_to_load(self.state, load_dir, tag):
            return None, None
        if not self.optimizer.trains:
            weights_only = (load_dir, tag, load_module_strict, load_module_only)
            return checkpoint.load_weights(self.state, *weights_only)
        loading = (load_optimizer_states, load_lr_scheduler_states, load_module_only)
        return checkpoint.load(self.state, load_dir, tag, load_module_strict, *loading)

    def resume_latest(self, load_dir):
        """Resume from the checkpoint `latest` names in load_dir, saved at any world size, with
        the same global batch (train_batch_size; gradient_accumulation_steps adapts); nothing
        to load (a first run) returns (None, None). What checkpoint.auto_resume does in
        zero.initialize. Collective: every rank must call it. Raises ValueError naming both
        sizes when train_batch_size differs from the checkpoint's, and what load_checkpoint
        raises (checkpoint/periodic.py, docs/checkpoints.md)."""
        self._refuse_closed("resume_latest")
        return resume_latest(self.state, os.fspath(load_dir), self.load_checkpoint)

    def _finish_periodic_save(self) -> None:
        # A background periodic save must be published before another save or a load reads
        # or moves `latest` (checkpoint/periodic.py).
        periodic = getattr(self, "periodic", None)  # close() of a half-built engine
        if periodic is not None:
            periodic.wait()

    # ----- lifetime, compile, generation ----------------------------------------------------
    def close(self) -> None:
        """Detach the engine from the model and release what it holds; DeepSpeed's destroy()
        is the same call. Not a collective; idempotent.

        - removes every hook zero added to the model and its parameters (forward, state_dict
          and gradient hooks) and, at stage 3, to the graphs of forwards whose backward never
          came, so neither the model nor a loss the script keeps refers to the engine, which
          is freed once the script drops it; at stage 3 the load_state_dict guard stays (see
          below);
        - unregisters the parameters, so zero.utils and zero.GatheredParameters never read
          the closed engine's shards;
        - stage 3: releases every gathered unit but the persistent one (and units a
          zero.GatheredParameters still holds);
        - drops gradients accumulated for a step that has not come;
        - removes nvme offload's swap files (garbage collection of the engine and interpreter
          exit do that too) and closes the monitors' files.

        Afterwards forward, backward, step, no_sync, allreduce_gradients, the checkpoint and
        save methods raise RuntimeError; the fp32 master weights and optimizer state are freed
        with the engine and the optimizer zero.initialize returned. Stages 0-2: engine.module
        keeps its current weights (compute dtype) and works as a plain module. Stage 3: its
        parameters stay partitioned (0-element placeholders; their values lived in the
        engine's shards), so save what you need first (save_checkpoint, save_16bit_model,
        _zero3_consolidated_16bit_state_dict); calling the module afterwards raises
        RuntimeError, as does zero.initialize on it."""
        if self._destroyed:
            return
        try:
            self._finish_periodic_save()
        except Exception as error:  # close() does not raise; the previous checkpoint stands
            logger.error("rank %d: %s", self.comm.rank, error)
        self._destroyed = True
        if self._compiled is not None:
            self._compiled.restore()  # the model's own forward again
        keep = ("_load_state_dict_pre_hooks",) if self.gatherer is not None else ()
        for owner, table, key in self.parts.added_hooks:
            if table not in keep:
                getattr(owner, table).pop(key, None)
        if self.gatherer is not None:
            self.gatherer.release_all()
            self.gatherer.close()  # and the hooks on graphs a script may keep (its last loss)
            self.module.register_forward_pre_hook(guards.refuse_released_forward)
        self.optimizer.clear_gradients()
        self.optimizer.close()
        gathered.unregister(self.optimizer)
        self.monitor.close()

    def compile(
        self,
        backend="inductor",
        compile_kwargs: dict | None = None,
        schedule=None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """torch.compile the model's forward; DeepSpeed's engine.compile (accelerate's dynamo
        plugin calls it). Stages 0-2 compile the whole forward; stage 3 compiles each block's
        forward (a fetch unit holding its own parameters), so gathers and releases run eagerly
        between compiled blocks ([Note: what is compiled] in compiler.py). `backend` (a name or a
        callable) and `compile_kwargs` (mode, fullgraph, dynamic, options) go to torch.compile;
        tracing happens at the next forward. Idempotent: a second call does nothing
        (is_compiled). The config's `compile` block is read (deepcompile selects this same
        compile). Not a collective, but every rank should compile alike (each compiles its own
        graphs in its first forward).

        Raises NotImplementedError for `schedule` (DeepCompile's passes) and for
        compiled_autograd_enabled=True, TypeError for a compile_kwargs key torch.compile does
        not take, RuntimeError after destroy()."""
        self._refuse_closed("compile")
        if self._compiled is not None:
            return
        self._compiled = compile_model(
            self.module,
            self.gatherer,
            self.config,
            backend,
            compile_kwargs,
            schedule,
            compiled_autograd_enabled,
            self.comm.rank,
        )

    @property
    def is_compiled(self) -> bool:
        """Whether engine.compile() ran (DeepSpeed's engine.is_compiled)."""
        return self._compiled is not None

    def generate(self, *args, **kwargs):
        """The model's generate() (Hugging Face's, peft's, or the model's own) with the same
        arguments; at stage 3 on more than one rank with synced_gpus=True unless passed
        ([Note: synced decoding at stage 3] in generation.py). Each rank may pass its own
        prompts. Returns what the model's generate() returns. Collective at stage 3 with world
        size > 1. Raises AttributeError when the model has no generate(), RuntimeError after
        destroy(), ValueError for synced_gpus=False where the parameters must be gathered."""
        self._refuse_closed("generate")
        if getattr(self.module, "generate", None) is None:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute 'generate', nor has its model "
                f"({type(self.module).__name__})"
            )
        synced = self.gatherer is not None and self.comm.world_size > 1
        return generation.generate(self.module, synced, args, kwargs)


def _cast_floats(obj, dtype):
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
