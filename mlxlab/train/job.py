"""One training job, as a library call: run directory, model, data, LoRA, the loop, the adapter.

`run(cfg, hooks)` is what `python -m mlxlab train` runs. What a task adds around the loop (build
its dataset, evaluate the base and the tuned model, write a report: mlxlab/tasks/) comes in as a
`Hooks` object; this module knows no task, no evaluation and no Hydra.

Started by `mlx.launch` (several processes), the job joins the world first (train/world.py),
prints it, and trains data-parallel (train/parallel.py) or, with backward.pipeline, as a segment
pipeline (train/pipeline.py); rank 0 alone checks and writes the run directory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from mlxlab.config import DataConfig, to_dict
from mlxlab.errors import UserError
from mlxlab.train.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What the hooks see of a job in progress."""

    cfg: TrainConfig
    run_dir: Path
    data: DataConfig
    """The data config trained on (after `Hooks.prepare_data`)."""
    model: object = None
    tokenizer: object = None


class Hooks:
    """What a task adds around the training loop; every method may be left as it is (no-op)."""

    def config(self) -> dict | None:
        """Saved as `task` in the run's config.yaml (and checked on resume)."""
        return None

    def train_config(self, cfg: TrainConfig) -> TrainConfig:
        """The config to train with: a task may fill settings it owns (the adapter to start
        from, lora.init, when it trains on top of another run)."""
        return cfg

    def prepare_data(self, data: DataConfig, run_dir: Path) -> DataConfig:
        """The data config to train on (a task builds its dataset into the run directory)."""
        return data

    def before_lora(self, run: Run) -> None:
        """The base model is loaded, no LoRA attached yet."""

    def after_training(self, run: Run, summary: dict) -> None:
        """The final adapter is saved; anything added to `summary` goes into summary.json."""

    def finish(self, run: Run, summary: dict) -> None:
        """summary.json is written (with `wall_s` and `gradients`)."""


def run_dir_for(cfg: TrainConfig) -> Path:
    if cfg.out_dir:
        return Path(cfg.out_dir).expanduser().absolute()
    return Path("outputs", cfg.name, time.strftime("%Y%m%d-%H%M%S")).absolute()


# Settings that do not change the training trajectory (iters does, through the cosine schedule,
# but extending a run is the point of changing it).
RESUME_MAY_CHANGE = (
    "resume",
    "out_dir",  # where the run is, not what it does: a timestamped run resumes by it
    "iters",
    "save_every",
    "keep_last",
    "log_every",
    "val_every",
    "val_batches",
    "wandb",
    "wandb_project",
    "dist",
)


def _fill_missing(saved: dict, defaults: dict) -> None:
    """Settings added since `saved` was written take their defaults (what the run had)."""
    for k, v in defaults.items():
        if k not in saved:
            saved[k] = v
        elif isinstance(saved[k], dict) and isinstance(v, dict):
            _fill_missing(saved[k], v)


def _check_resume_config(run_dir: Path, now: dict, defaults: dict | None = None) -> None:
    """A resumed run must be the same run: only the length and bookkeeping may differ.
    `defaults` (the config's defaults) fill settings added since the run was started."""
    import yaml

    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        raise UserError(f"resume=true but {saved_path} is missing; is {run_dir} a run directory?")
    saved = yaml.safe_load(saved_path.read_text())
    if isinstance(saved.get("task"), dict) and saved["task"].get("name") is None:
        saved.pop("task")  # written before tasks were their own configs: no task
    _fill_missing(saved, defaults or {})
    differ = sorted(
        k
        for k in set(saved) | set(now)
        if k not in RESUME_MAY_CHANGE and saved.get(k) != now.get(k)
    )
    if differ:
        raise UserError(
            f"resume=true with a different config than {saved_path}: {', '.join(differ)}"
        )


def _join(world, cfg: TrainConfig, hooks: Hooks) -> None:
    """Print the world (rank 0; the other ranks print warnings and errors only) and refuse
    what does not run on several processes."""
    import logging as logging_

    if world.writer:
        log.info(world.describe())
    else:  # warnings and errors only, marked with the rank
        logger = logging_.getLogger("mlxlab")
        logger.setLevel(logging_.WARNING)
        prefix = f"[rank {world.rank}] "

        def mark(record):
            record.msg, record.args = prefix + record.getMessage(), ()
            return True

        for handler in logger.handlers:
            handler.addFilter(mark)
    if type(hooks) is not Hooks:
        raise UserError(
            "a task run (task=..., e.g. +exp=chunk_seg4) builds and evaluates on one process; "
            "under mlx.launch train its data directly (data.train=DIR)"
        )
    if not cfg.backward.pipeline and cfg.batch_size % world.size:
        raise UserError(
            f"batch_size={cfg.batch_size} is not a multiple of the {world.size} processes: "
            "data parallel gives each rank batch_size / world size of every batch"
        )


@dataclass
class Start:
    """A job after its first step (`start`): the config it trains with, the world it trains in
    (None: this process alone), its run directory and what config.yaml will say."""

    cfg: TrainConfig
    hooks: Hooks
    world: object
    run_dir: Path
    config_dict: dict

    @property
    def writer(self) -> bool:
        """Whether this process writes the run directory (rank 0, or the only process)."""
        return self.world is None or self.world.writer

    @property
    def pipeline(self) -> bool:
        return self.world is not None and self.cfg.backward.pipeline


def start(cfg: TrainConfig, hooks: Hooks) -> Start:
    """The task's config, the world joined, the run directory checked (rank 0's, every rank
    stopping on its refusal): a resume must be the same run, a new run needs an empty one."""
    cfg = hooks.train_config(cfg)
    from mlxlab.train.world import World

    world = World.start(cfg.dist)  # None: this process trains alone
    if world is not None:
        _join(world, cfg, hooks)
    run_dir = run_dir_for(cfg)
    config_dict = to_dict(cfg)
    task_config = hooks.config()
    if task_config is not None:
        config_dict["task"] = task_config

    def check_run_dir():
        if cfg.resume:
            defaults = to_dict(TrainConfig())
            task_cfg = getattr(hooks, "cfg", None)
            if task_config is not None and dataclasses.is_dataclass(task_cfg):
                defaults["task"] = to_dict(type(task_cfg)())
            _check_resume_config(run_dir, config_dict, defaults)
        elif run_dir.exists() and not run_dir.is_dir():
            raise UserError(f"out_dir={run_dir} is a file; a run needs a directory")
        elif run_dir.exists() and any(run_dir.iterdir()):
            raise UserError(
                f"{run_dir} is not empty; pick another out_dir, or resume=true to continue it"
            )

    if world is None:
        check_run_dir()
    else:
        world.agree(check_run_dir, "checking the run directory")
    if cfg.backward.pipeline and world is None:
        log.warning(
            "warning: backward.pipeline=true needs several processes (mlx.launch -n K ...); "
            "this one trains alone with the segmented backward"
        )
    return Start(cfg, hooks, world, run_dir, config_dict)


@dataclass
class Prepared:
    """The model and the datasets (`load`)."""

    data: DataConfig
    model: object
    tokenizer: object
    train_set: object
    valid_set: object
    pairs: bool

    @property
    def per_unit(self) -> int:
        """Rows per sampler unit (a pair's two sides)."""
        return 2 if self.pairs else 1


def load(s: Start) -> Prepared:
    """The task's data prepared, the model loaded and the training and validation sets read."""
    from mlxlab.data.datasets import load_split, resolve_paths
    from mlxlab.models.zoo import load as load_model

    cfg = s.cfg
    if (
        cfg.objective == "grpo"
    ):  # a reward that cannot be imported stops the run before the model loads
        from mlxlab.train.grpo.rewards import resolve

        resolve(cfg.grpo.rewards, cfg.grpo.reward_weights)
    data_cfg = s.hooks.prepare_data(cfg.data, s.run_dir)
    train_path, valid_path = resolve_paths(data_cfg)
    # No bf16 copy of the LM head for decode: training's products are many-row ones (BLAS).
    # A pipeline stage loads lazily: the layers it does not hold are never read (pipeline_stage.py).
    model, tokenizer = load_model(cfg.model, cfg.dtype, decode_head="exact", lazy=s.pipeline)
    if cfg.objective == "grpo":  # prompts: the completions are the policy's own
        import functools

        from mlxlab.data.prompts import load_prompt_split

        load_split = functools.partial(load_prompt_split, max_tokens=cfg.grpo.max_tokens)  # noqa: F811
    pairs = cfg.objective in ("dpo", "orpo")
    if pairs:
        from mlxlab.data.preference import load_pair_split as load_split  # noqa: F811
    train_set = load_split(train_path, tokenizer, data_cfg)
    valid_set = load_split(valid_path, tokenizer, data_cfg) if valid_path else None
    return Prepared(data_cfg, model, tokenizer, train_set, valid_set, pairs)


def attach_lora(s: Start, model) -> tuple[object, dict | None]:
    """(the LoRA plan, the adapter the run starts from or None): LoRA planned and applied, then
    `lora.init`'s weights loaded (DPO's reference too)."""
    from mlxlab.lora import apply as lora_apply
    from mlxlab.lora import io as lora_io

    cfg = s.cfg
    if cfg.data.pack:
        from mlxlab.models.runners import RUNNERS, runner_for

        try:
            runner_for(model)
        except UserError:
            raise UserError(
                f"data.pack needs a layer runner for the block-diagonal masks; model type "
                f"{getattr(model, 'model_type', '?')!r} has none (supported: "
                f"{', '.join(sorted(RUNNERS))})"
            ) from None
    plan = lora_apply.plan(model, cfg.lora)
    lora_apply.apply(model, plan, seed=cfg.seed)
    init = None
    if cfg.lora.init:
        import mlx.core as mx

        init = lora_io.read_init(cfg.lora.init, model, plan)
        model.load_weights(list(init.items()), strict=False)
        if not s.pipeline:  # a pipeline stage reads only the arrays it holds
            mx.eval(model.parameters())
        log.info(f"LoRA starts from {lora_io.resolve_dir(cfg.lora.init)}")
    elif plan.kind != "lora" and (
        cfg.objective == "dpo" or (cfg.objective == "grpo" and cfg.grpo.beta > 0)
    ):
        # DPO's reference (and GRPO's KL reference) is the model the run starts from. A LoRA's
        # scale at 0 gives the base exactly (objectives.adapters_off); DoRA's trained magnitudes
        # and a full fine-tune's weights have no such switch, so their starting arrays are kept
        # and swapped in for the reference pass: the base itself (full), or DoRA at init (the
        # base, to float rounding).
        init = dict(lora_apply.adapter_parameters(model))
        log.info(
            f"{cfg.objective.upper()}'s reference: the {plan.kind} adapter's starting arrays "
            "(the base model)"
        )
    return plan, init


def distribute(s: Start, d: Prepared, init) -> tuple[object, tuple[int, int]]:
    """(the run's `dist` object for the trainer, this rank's sampler shard): a segment pipeline,
    data parallel, or (None, (0, 1)) alone."""
    world, cfg = s.world, s.cfg
    if s.pipeline:
        from mlxlab.train.pipeline import Pipeline

        rows = [(len(e.ids) - 1, len(e.ids) - max(e.offset, 1)) for e in d.train_set.examples]
        return Pipeline.build(world, d.model, cfg, rows, init), (0, 1)
    if world is not None:
        from mlxlab.train.parallel import DataParallel

        log.info(
            f"data parallel: each rank trains on {cfg.batch_size // world.size} of every "
            f"{cfg.batch_size} {_units(cfg, d)}; rank 0 writes {s.run_dir}"
        )
        return DataParallel(world), (world.rank, world.size)
    return None, (0, 1)


def _units(cfg: TrainConfig, d: Prepared) -> str:
    return "pairs" if d.pairs else "prompts" if cfg.objective == "grpo" else "examples"


def samplers(cfg: TrainConfig, d: Prepared, shard: tuple[int, int]):
    """(the training sampler, the validation sampler or None)."""
    from mlxlab.data.batches import BatchSampler

    if cfg.objective == "grpo":  # batches of prompts, and the rollouts' key
        from mlxlab.data.prompts import PromptSampler

        train = PromptSampler(d.train_set.prompts, cfg.batch_size, cfg.seed, shard=shard)
        valid = None
        if d.valid_set:
            size = min(cfg.batch_size, len(d.valid_set.prompts))
            valid = PromptSampler(d.valid_set.prompts, size, cfg.seed, False, shard)
        return train, valid

    train = BatchSampler(
        d.train_set.examples,
        cfg.batch_size,
        cfg.seed,
        pack_length=cfg.data.max_seq_length if cfg.data.pack else 0,
        pairs=d.pairs,
        shard=shard,
    )
    valid = None
    if d.valid_set:
        valid = BatchSampler(
            d.valid_set.examples,
            min(cfg.batch_size, len(d.valid_set.examples) // d.per_unit),
            cfg.seed,
            shuffle=False,
            pairs=d.pairs,
            shard=shard,
        )
    return train, valid


def reference_logprobs(s: Start, model, dist, train_sampler, valid_sampler, init) -> None:
    """DPO's reference log-probs, precomputed into the run directory (after config.yaml, so a run
    killed here can resume); validation always gets fixed ones."""
    cfg = s.cfg
    if dist is None:
        from mlxlab.train.objectives import precompute_reference
    else:  # shared by the ranks; rank 0 reads and writes the file
        precompute_reference = dist.precompute_reference
    for sampler, name, needed in (
        (valid_sampler, "valid", valid_sampler is not None and cfg.val_every),
        (train_sampler, "train", cfg.dpo.precompute_ref),
    ):
        if needed:
            path = s.run_dir / f"reference_{name}.json"
            precompute_reference(model, sampler, path, cfg.model, init)


def describe(s: Start, d: Prepared, plan, train_sampler) -> None:
    """The run's opening lines: where, what model and adapter, how much data, how much padding."""
    from mlxlab.data.batches import BatchSampler
    from mlxlab.lora import apply as lora_apply

    cfg = s.cfg
    n_params = sum(v.size for v in lora_apply.adapter_parameters(d.model).values())
    what = (
        f"full fine-tuning of {len(plan.keys)} modules"
        if plan.kind == "full"
        else f"{'DoRA' if plan.kind == 'dora' else 'LoRA'} rank {plan.rank} on {len(plan.keys)} projections"
    )
    if cfg.objective == "grpo":
        g = cfg.grpo
        n_valid = len(d.valid_set.prompts) if d.valid_set else 0
        log.info(
            f"run dir: {s.run_dir}\nmodel: {cfg.model} ({cfg.dtype}) | {what} x "
            f"{len(plan.layers)} layers ({n_params / 1e6:.2f}M params)\ndata: {len(d.train_set.prompts)} train / {n_valid} valid prompts | "
            f"GRPO ({g.loss}): {cfg.batch_size} prompts x {g.group_size} completions of at most "
            f"{g.max_tokens} tokens a step, {g.updates} update(s) each, rewards "
            f"{', '.join(g.rewards)}"
        )
        return
    unit = "pairs" if d.pairs else "examples"
    n_valid = len(d.valid_set.examples) // d.per_unit if d.valid_set else 0
    log.info(
        f"run dir: {s.run_dir}\nmodel: {cfg.model} ({cfg.dtype}) | {what} x {len(plan.layers)} "
        f"layers ({n_params / 1e6:.2f}M params)\n"
        f"data: {len(d.train_set.examples) // d.per_unit} train / {n_valid} valid {unit}"
    )
    unpacked = (
        BatchSampler(d.train_set.examples, cfg.batch_size, cfg.seed).padding()
        if cfg.data.pack
        else None
    )
    log.info(
        f"padding: {train_sampler.padding():.1%} of an epoch's batch positions"
        + (
            f" packed ({len(train_sampler)} batches of {cfg.batch_size} rows holding "
            f"{train_sampler.examples_per_epoch()} examples), {unpacked:.1%} unpacked"
            if unpacked is not None
            else f" ({len(train_sampler)} batches of {cfg.batch_size})"
        )
    )


def gradients(s: Start, d: Prepared, dist, init):
    """(grad_fn, a line describing it): the pipeline's, else the configured backward mode's."""
    from mlxlab.train.backward import make_grad_fn
    from mlxlab.train.objectives import PairObjective

    cfg = s.cfg
    if s.pipeline:
        return dist.grad_fn(), dist.describe()
    rows = cfg.batch_size * d.per_unit
    objective = PairObjective.from_config(cfg, init)
    if cfg.objective == "grpo":
        from mlxlab.train.grpo.losses import GRPOObjective

        rows = -(-cfg.batch_size * cfg.grpo.group_size // cfg.grad_accum)
        objective = GRPOObjective.from_config(cfg)
    return make_grad_fn(
        d.model,
        cfg.backward,
        (rows, cfg.data.max_seq_length),
        compile=cfg.compile,
        objective=objective,
    )


def run(cfg: TrainConfig, hooks: Hooks | None = None) -> dict:
    """Train a LoRA adapter as `cfg` says; return the summary (also in <run>/summary.json).

    The steps, in order: `start` (world, run directory), `load` (the task's data, the model, the
    datasets), the hooks' `before_lora`, `attach_lora`, `distribute`, `samplers`, config.yaml
    (and DPO's `reference_logprobs`), `describe`, `gradients`, the trainer's loop (GRPO's:
    train/grpo/loop.py), the adapter, then the hooks' `after_training` and `finish` around
    summary.json."""
    import yaml

    from mlxlab.fsutil import atomic_write_text, writable_dir
    from mlxlab.lora import io as lora_io
    from mlxlab.train import trainer

    s = start(cfg, hooks or Hooks())
    cfg, hooks, run_dir = s.cfg, s.hooks, s.run_dir
    t_start = time.perf_counter()
    d = load(s)
    job = Run(cfg, run_dir, d.data, d.model, d.tokenizer)
    hooks.before_lora(job)
    plan, init = attach_lora(s, d.model)
    dist, shard = distribute(s, d, init)
    train_sampler, valid_sampler = samplers(cfg, d, shard)
    if s.writer:
        writable_dir(run_dir)
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(s.config_dict, sort_keys=False))
    if cfg.objective == "dpo":
        reference_logprobs(s, d.model, dist, train_sampler, valid_sampler, init)
    describe(s, d, plan, train_sampler)
    grad_fn, how = gradients(s, d, dist, init)
    log.info(f"gradients: {how}")
    meta = {"base_model": cfg.model, "run_dir": str(run_dir)}
    if s.writer:
        run_log = trainer.RunLog(run_dir, cfg.iters, cfg.wandb, cfg.wandb_project, s.config_dict)
    else:
        run_log = trainer.QuietLog()
    if cfg.objective == "grpo":
        from mlxlab.train.grpo.loop import train as grpo_train

        summary = grpo_train(
            d.model,
            d.tokenizer,
            plan,
            train_sampler,
            valid_sampler,
            cfg,
            run_dir,
            grad_fn,
            run_log=run_log,
            meta=meta,
            start_adapter=init,
            dist=dist,
        )
    else:
        summary = trainer.train(
            d.model,
            plan,
            train_sampler,
            valid_sampler,
            cfg,
            run_dir,
            grad_fn=grad_fn,
            run_log=run_log,
            meta=meta,
            dist=dist,
        )
    if dist is None:
        adapter_dir = lora_io.save(d.model, plan, run_dir / "adapter", meta=meta)
    else:  # rank 0 writes (the pipeline gathers the stages' arrays first)
        adapter_dir = dist.save_adapter(d.model, plan, run_dir / "adapter", meta)
    if not s.writer:
        return summary  # rank 0 reports the run
    summary["adapter"] = str(adapter_dir)
    hooks.after_training(job, summary)
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    summary["gradients"] = how
    if s.world is not None:
        summary["world"] = {**dist.world_info(), "backend": s.world.backend, "hosts": s.world.hosts}
    trainer.write_summary(run_dir, summary)
    hooks.finish(job, summary)
    val, first = summary.get("val_loss"), summary.get("initial_val_loss")
    if val is not None:
        change = f" (from {first:.4f})" if first is not None else ""
        log.info(f"final val loss {val:.4f}{change}")
    secs, peak = summary["seconds"], summary["peak_mem_gb"]
    log.info(
        f"done: training {'n/a' if secs is None else f'{secs:.0f} s'}, peak memory "
        f"{'n/a' if peak is None else f'{peak:.2f} GB'}"
        + (
            f" (whole run; this attempt resumed at step {summary['resumed_from_step']}: "
            f"{summary['resumed_seconds']:.0f} s)"
            if "resumed_from_step" in summary
            else ""
        )
    )
    return summary
